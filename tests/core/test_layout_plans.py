"""Pure layout: topology, inter-node all-gather steps, reduce-scatter chunking (one process)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import tidearray
from tidearray._copies import MAX_PITCH, cut_copies, strided_runs
from tidearray._layout import ALIGN, align_up, plan_unit
from tidearray._schedule import ag_pieces, internode_ag_steps, plan_reduce_scatter
from tidearray._topology import Topology

shape_st = st.tuples(st.integers(0, 300), st.lists(st.integers(0, 70), max_size=2)).map(
    lambda t: (t[0], *t[1]))


@st.composite
def topologies(draw, max_nodes=9, max_local=5):
    nodes, local = draw(st.integers(1, max_nodes)), draw(st.integers(1, max_local))
    return Topology(nodes * local, draw(st.integers(0, nodes * local - 1)), local)


@given(st.integers(1, 6), st.integers(1, 6))
def test_topology_numbering(nodes, local):
    world = nodes * local
    seen = set()
    for rank in range(world):
        t = Topology(world, rank, local)
        assert t.num_nodes == nodes
        assert t.global_rank(t.node, t.local_rank) == rank
        assert t.column(t.local_rank)[t.node] == rank
        assert all(Topology(world, q, local).local_rank == t.local_rank
                   for q in t.column(t.local_rank))
        seen.add((t.node, t.local_rank))
    assert len(seen) == world


@pytest.mark.parametrize("world,local", [(4, 3), (6, 4), (3, 0), (5, -1)])
def test_topology_rejects_a_local_size_that_does_not_divide(world, local):
    with pytest.raises(tidearray.TideInvalid, match="local size"):
        Topology(world, 0, local)


@given(st.integers(1, 40))
@example(1)
@example(3)
@example(8)
def test_internode_steps_deliver_everything_once(num_nodes):
    """Simulate every node's steps: each sends only what it holds, sends match receives
    pairwise, nothing arrives twice, and at the end every node holds every node's data."""
    plans = [internode_ag_steps(num_nodes, n) for n in range(num_nodes)]
    assert len({len(p) for p in plans}) == 1
    holds = [{n} for n in range(num_nodes)]
    for s in range(len(plans[0])):
        steps = [p[s] for p in plans]
        for n, st_ in enumerate(steps):
            assert set(st_.send_nodes) <= holds[n], (s, n)
            partner = steps[st_.send_peer]
            assert partner.recv_peer == n and partner.recv_nodes == st_.send_nodes, (s, n)
        for n, st_ in enumerate(steps):
            assert not holds[n] & set(st_.recv_nodes), f"step {s}: node {n} got data twice"
            holds[n] |= set(st_.recv_nodes)
    assert all(h == set(range(num_nodes)) for h in holds)
    power_of_two = num_nodes & (num_nodes - 1) == 0
    assert len(plans[0]) == (num_nodes.bit_length() - 1 if power_of_two else num_nodes - 1)


@given(st.sampled_from([2, 4, 8, 16]), st.lists(shape_st, max_size=6))
def test_recursive_doubling_sends_one_range_per_parameter(num_nodes, shapes):
    """With one rank per node, each step's data is one contiguous range of each parameter."""
    unit = plan_unit(shapes, 2, num_nodes)
    for n in range(num_nodes):
        for k, step in enumerate(internode_ag_steps(num_nodes, n)):
            block = step.recv_nodes
            assert block == tuple(range(block[0], block[0] + 2**k)) and block[0] % 2**k == 0
            pieces = ag_pieces(unit, step.send_nodes)
            for i in {p.param for p in pieces}:
                mine = sorted((p.offset, p.nbytes) for p in pieces if p.param == i)
                assert all(a + n_ == b for (a, n_), (b, _) in zip(mine, mine[1:]))


@given(st.lists(shape_st, max_size=12), st.sampled_from([2, 4]), topologies(),
       st.integers(4096, 1 << 16), st.integers(1, 4))
@example([(1000, 64)], 2, Topology(4, 0, 2), 4096, 2)
@example([(3, 70, 70)], 4, Topology(3, 0, 1), 4096, 1)  # a row larger than the budget
@example([(1, 0), (1, 2, 57)], 4, Topology(9, 0, 1), 4096, 1)  # the same, after an empty row
def test_rs_plan_covers_every_row_once_within_budget(shapes, itemsize, topo, chunk, depth):
    unit = plan_unit(shapes, itemsize, topo.world)
    plan = plan_reduce_scatter(unit, topo, chunk, depth)
    budget = max(1, chunk // topo.num_nodes)
    next_row = [0] * len(shapes)
    for ch in plan.chunks:
        assert ch.pieces, "empty chunk"
        end, data = 0, 0
        for pc in ch.pieces:
            spec = unit.specs[pc.param]
            assert pc.row_start == next_row[pc.param] and pc.row_stop > pc.row_start
            next_row[pc.param] = pc.row_stop
            assert pc.offset % ALIGN == 0 and pc.offset >= end
            end = pc.offset + (pc.row_stop - pc.row_start) * spec.row_nbytes
            data += (pc.row_stop - pc.row_start) * spec.row_nbytes
        assert ch.block_nbytes == align_up(end)
        # Over budget only as the one-row minimum (pieces of zero-byte rows aside).
        real = [pc for pc in ch.pieces if unit.specs[pc.param].row_nbytes]
        one_row = len(real) == 1 and real[0].row_stop - real[0].row_start == 1
        assert data <= budget or one_row, (data, budget)
        assert ch.block_nbytes <= align_up(budget) or one_row
    assert next_row == [s.rows_per_shard for s in unit.specs]
    assert plan.source_nbytes == max((c.block_nbytes for c in plan.chunks), default=0) * \
        topo.num_nodes
    assert plan.buffer_nbytes == plan.source_nbytes * (topo.local_size - 1)
    # Only buffers that some chunk uses are allocated; across nodes, as many fp32
    # partial-sum buffers of one block per node, and one receive buffer of the others'.
    used = min(depth, len(plan.chunks))
    nodes = topo.num_nodes
    widest = max((c.block_nbytes for c in plan.chunks), default=0) // itemsize
    assert plan.net_numel == (widest if nodes > 1 else 0)
    assert plan.local_nbytes == used * plan.buffer_nbytes
    assert plan.partial_nbytes == (used * nodes * widest * 4 if nodes > 1 else 0)
    assert plan.receive_nbytes == (nodes - 1) * widest * 4
    assert plan.staging_nbytes == plan.local_nbytes + plan.partial_nbytes + plan.receive_nbytes
    assert plan.partial_offset == plan.local_nbytes
    assert plan.receive_offset == plan.local_nbytes + plan.partial_nbytes
    for k, ch in enumerate(plan.chunks):  # a chunk's fp32 partial sums fit one block
        assert plan.chunk_numel(k) * itemsize == ch.block_nbytes
        assert nodes == 1 or plan.chunk_numel(k) <= plan.net_numel
    assert [plan.buffer_of(k) for k in range(5)] == [k % depth for k in range(5)]
    end = 0
    for off, spec in zip(plan.out_offsets, unit.specs):
        assert off % (ALIGN // 4) == 0 and off >= end
        end = off + spec.shard_numel
    assert plan.block_numel >= end


def test_rs_plan_splits_a_parameter_across_chunks():
    """The small-chunk MPI tests rely on this: one shard spread over several chunks."""
    unit = plan_unit([(100, 64), (5,), (40, 64)], 2, 2)  # shard 0: 6400 B
    plan = plan_reduce_scatter(unit, Topology(2, 0, 2), 4096, 2)
    chunks_of = {i: [k for k, c in enumerate(plan.chunks) for p in c.pieces if p.param == i]
                 for i in range(3)}
    assert len(chunks_of[0]) >= 2 and len(plan.chunks) >= 3


def test_rs_plan_rejects_depth_zero():
    unit = plan_unit([(4,)], 2, 2)
    with pytest.raises(tidearray.TideInvalid, match="depth"):
        plan_reduce_scatter(unit, Topology(2, 0, 2), 4096, 0)


@pytest.mark.parametrize("world,local", [(3, 1), (6, 2), (64, 8), (512, 8)])
def test_rs_staging_within_the_documented_bound(world, local):
    """plan_reduce_scatter's docstring: ``chunk_nbytes`` bounds one remote source's bytes
    per chunk, summed over target nodes, so node-local staging <= depth * (L-1) *
    chunk_nbytes; across nodes the fp32 partial sums (depth buffers) and the receive
    buffer add at most (depth + 1) * chunk_nbytes * 4 / itemsize."""
    unit = plan_unit([(60 * world, 50)], 2, world)  # 100-byte rows: 13 fit 1365 B, 1536 aligned
    plan = plan_reduce_scatter(unit, Topology(world, 0, local), 4096 * world // local, 2)
    chunk = 4096 * world // local
    assert plan.source_nbytes <= chunk
    assert plan.local_nbytes <= 2 * (local - 1) * chunk
    assert plan.partial_nbytes + plan.receive_nbytes <= 3 * chunk * 4 // 2


copy_lists = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40),
                                st.integers(0, 1 << 20)), max_size=30)


@given(copy_lists, st.integers(2, 40), st.integers(1, 1 << 16), st.integers(0, 1 << 16),
       st.integers(0, 1 << 16))
@example([], 3, 4096, 4096, 4096)
def test_strided_runs_expand_to_the_same_copies(rest, count, width, dgap, sgap):
    strided = [((1 << 42) + k * (width + dgap), (1 << 43) + k * (width + sgap), width)
               for k in range(count)]
    copies = rest + strided + rest
    runs = strided_runs(copies)
    rows = [(r.dst + k * r.dpitch, r.src + k * r.spitch, r.width)
            for r in runs for k in range(r.height)]
    assert rows == [c for c in copies if c[2]]  # same copies, same order, none empty
    for r in runs:
        assert r.height >= 1 and r.width > 0
        if r.height > 1:  # rows never overlap
            assert r.width <= r.dpitch <= MAX_PITCH and r.width <= r.spitch <= MAX_PITCH
    assert len(strided_runs(strided)) == 1  # a constant-stride block alone: one 2D copy


@given(copy_lists, st.one_of(st.just(0), st.integers(1 << 12, 1 << 18)))
@example([(0, 0, 10), (100, 7, 0), (5, 9, 1 << 20)], 4096)
def test_cut_copies_cover_each_byte_once_in_order(copies, cap):
    cut = list(cut_copies(copies, cap))
    if cap == 0:
        assert cut == list(copies)
        return
    # Walk the pieces against the copies: each copy's pieces follow each other with
    # no gap or overlap on both sides, each starts a multiple of cap into its copy,
    # none is longer than cap, only a zero-byte copy gives a zero-byte piece, and
    # together they hold exactly its bytes, in the copies' order.
    k = 0
    for dst, src, n in copies:
        at = 0
        while True:
            d, s, m = cut[k]
            k += 1
            assert (d, s) == (dst + at, src + at) and at % cap == 0
            assert 0 < m <= cap or m == n == 0
            at += m
            if at >= n:
                break
        assert at == n
    assert k == len(cut)


def test_shared_devices_names_ranks_of_one_communicator_on_one_device():
    from tidearray._topology import shared_devices

    # 4 ranks on 2 GPUs, local_size=2: ranks 0 and 2 share local rank 0 and device 0.
    places = [(r % 2, "h", r % 2) for r in range(4)]
    assert shared_devices(places) == [(0, 2), (1, 3)]
    # 2 ranks on 2 GPUs, local_size=1: distinct devices.
    assert shared_devices([(0, "h", 0), (0, "h", 1)]) == []
    # The same device number on two hosts is two devices.
    assert shared_devices([(0, "a", 0), (0, "b", 0)]) == []
