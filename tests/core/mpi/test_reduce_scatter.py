"""TIDE-RS, multi-rank: bf16/fp16/fp32 gradients in, fp32 shards out, vs an fp64 reference.

Every rank regenerates every rank's gradients from a shared seed and computes
the fp64 sum itself. The tolerance is derived in ``_cases.rs_reference``:
``|out - ref| <= (W + 2) * 2**-24 * scale * sum_r |g_r|`` per element (fp32
accumulation of W exactly converted terms); padding rows must be exactly +0.0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import tidearray
from tidearray._layout import plan_unit
from tidearray._schedule import plan_reduce_scatter
from tidearray.layout import shard_shape

from ..._util import (
    BF16,
    FP16,
    FP32,
    agree,
    bits,
    dtypes,
    fresh_seed,
    seeds,
    shapes,
    to_numpy,
    to_xp,
)
from ._cases import (
    compare_rs,
    rank_grads,
    rs_reference,
    run_all_gather,
    run_reduce_scatter,
    small_unit,
)

WORLD = MPI.COMM_WORLD.Get_size()
ops = st.sampled_from(["sum", "avg"])
pytestmark = pytest.mark.mpi


@given(shapes(WORLD), dtypes, seeds, ops, st.booleans(), st.booleans())
@example([], BF16, 1, "avg", True, False)
@example([(1,)], BF16, 2, "sum", False, False)
@example([(WORLD - 1 or 1, 3), (WORLD + 1,), (2 * WORLD, 2, 2)], FP16, 3, "avg", True, True)
def test_reduce_scatter_matches_fp64(group, unit, dtype, seed, op, out, async_op):
    """Random units, sum and avg, with and without poisoned (NaN) ``out=`` arrays."""
    failures, _ = run_reduce_scatter(group, unit, dtype, seed, op, out=out, async_op=async_op)
    agree(group.comm, failures, f"unit {unit} {dtype} {op}")


@given(shapes(WORLD, min_count=1), dtypes, seeds, ops)
def test_reduce_scatter_is_bitwise_reproducible(group, unit, dtype, seed, op):
    """Two runs on the same inputs give the same bits (fixed accumulation order)."""
    failures, first = run_reduce_scatter(group, unit, dtype, seed, op)
    f2, second = run_reduce_scatter(group, unit, dtype, seed, op, out=False)
    failures += f2
    for i, (a, b) in enumerate(zip(first, second)):
        if (bits(to_numpy(a)) != bits(to_numpy(b))).any():
            failures.append(f"parameter {i}: the two runs differ")
    agree(group.comm, failures)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda d: f"depth{d}")
def small_chunks(request, group):
    """A second group with 4 KiB chunks: many chunks, parameters split across chunks,
    staging buffers reused (depth 1) or rotated (depth 2, 3)."""
    g = tidearray.init(backend=group.backend.name, chunk_nbytes=4096, depth=request.param)
    yield g
    g.comm.Barrier()
    g.close()


def big_shapes():
    return shapes(WORLD, max_count=8, max_rows=12 * WORLD + 3, max_inner=70)


@given(big_shapes(), dtypes, seeds, ops)
@example([(100 * WORLD + 3, 64), (5,), (9 * WORLD, 3, 40)], BF16, 4, "avg")
def test_reduce_scatter_in_many_chunks(small_chunks, unit, dtype, seed, op):
    failures, _ = run_reduce_scatter(small_chunks, unit, dtype, seed, op)
    agree(small_chunks.comm, failures, f"unit {unit} {dtype} {op}")


def test_the_small_chunk_example_really_splits(small_chunks):
    """Guards the test above: its explicit example spans several chunks, and its first
    parameter is cut across at least two of them, at every world size we run."""
    unit = plan_unit([(100 * WORLD + 3, 64), (5,), (9 * WORLD, 3, 40)], 2, WORLD)
    plan = plan_reduce_scatter(unit, small_chunks.topology, 4096, 2)
    first = {k for k, c in enumerate(plan.chunks) for p in c.pieces if p.param == 0}
    assert len(plan.chunks) >= 3 and len(first) >= 2


@pytest.fixture(scope="module")
def staging_slot(group):
    return tidearray.SlotArena(1 << 20, num_slots=1, group=group)[0]


@given(shapes(WORLD, min_count=1), dtypes, seeds, ops)
def test_reduce_scatter_staged_in_a_slot(group, staging_slot, unit, dtype, seed, op):
    """Slot-Reuse: staging in a user-given symmetric slot instead of the group's own."""
    failures, _ = run_reduce_scatter(group, unit, dtype, seed, op, staging=staging_slot)
    agree(group.comm, failures)


@pytest.fixture(scope="module")
def reuse_slot(small_chunks):
    """A slot of the small-chunk group, for gathers and staging in turn."""
    return tidearray.SlotArena(256 << 10, num_slots=1, group=small_chunks)[0]


@given(shapes(WORLD, min_count=1, max_count=6), shapes(WORLD, min_count=1, max_count=6),
       dtypes, seeds)
@settings(max_examples=10)
def test_slot_alternates_between_gather_and_staging(small_chunks, reuse_slot, unit_p, unit_g,
                                                    dtype, seed):
    """The FSDP backward pattern on one slot: gather a unit's parameters into it, then
    (parameters dead) stage the unit's reduce-scatter in it, then gather again; the
    small chunks make the staging cycle through its buffers."""
    g, slot = small_chunks, reuse_slot
    failures = []
    for k in range(2):
        f, _ = run_all_gather(g, unit_p, dtype, seed + k, slot=slot)
        failures += f
        f, _ = run_reduce_scatter(g, unit_g, dtype, seed + k, "avg", staging=slot)
        failures += f
    agree(g.comm, failures)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
def test_large_parameter(group, dtype):
    """One parameter larger than a few pages, plus a norm vector; avg."""
    unit = [(128 * WORLD + 5, 96), (96,)]
    failures, res = run_reduce_scatter(group, unit, np.dtype(dtype), 31, "avg")
    agree(group.comm, failures)


def test_a_repeat_reads_new_values_without_resolving_again(group, monkeypatch):
    """The same gradient and output arrays, called again with new values written into
    them, as in training: each call matches fp64 into outputs poisoned before it, and
    the repeats find their validated call without resolving those arrays again."""
    xp, W, r = group.backend.xp, group.size, group.rank
    unit = small_unit(W)
    seed = fresh_seed(group.comm, bits=30)
    grads = [xp.zeros(s, BF16) for s in unit]
    outs = [xp.zeros(shard_shape(s, W), np.float32) for s in unit]
    mine = {id(a) for a in grads + outs}
    seen, resolve = [], group.backend.resolve
    monkeypatch.setattr(group.backend, "resolve",
                        lambda a: (seen.append(id(a) in mine), resolve(a))[1])
    failures = []
    for k in range(3):
        for g, m in zip(grads, rank_grads(unit, BF16, seed + k, r)):
            g[...] = to_xp(xp, m)
        for o in outs:
            o[...] = np.nan
        seen.clear()
        res = tidearray.reduce_scatter(grads, op="avg", out=outs, group=group)
        failures += [f"call {k}: {f}" for f in
                     compare_rs(res, *rs_reference(unit, BF16, seed + k, W, r, "avg"))]
        failures += [f"call {k}: result {i} is not the out= array"
                     for i, (a, b) in enumerate(zip(res, outs)) if a is not b]
        if k and any(seen):
            failures.append(f"call {k}: resolved {sum(seen)} of its arrays again")
    agree(group.comm, failures)


def test_zero_sized_parameters(group):
    unit = [(0,), (3 * WORLD, 0), (WORLD + 1, 2), (0, 4), (1,)]
    failures, res = run_reduce_scatter(group, unit, BF16, 5, "sum")
    failures += [f"parameter {i}: shape {r.shape}, expected {shard_shape(s, WORLD)}"
                 for i, (r, s) in enumerate(zip(res, unit))
                 if r.shape != shard_shape(s, WORLD)]
    agree(group.comm, failures)


def test_sum_of_ones_is_exact(group):
    """A hand-checkable case: every rank contributes rank+1, so the sum is W(W+1)/2."""
    xp = group.backend.xp
    unit = [(2 * WORLD + 1, 3)]
    g = [xp.full(unit[0], group.rank + 1, dtype=BF16)]
    res = to_numpy(tidearray.reduce_scatter(g, op="sum", group=group)[0])
    rows = len(range(group.rank * 3, min(group.rank * 3 + 3, 2 * WORLD + 1)))
    want = np.zeros((3, 3), np.float32)
    want[:rows] = WORLD * (WORLD + 1) / 2
    agree(group.comm, [] if (bits(res) == bits(want)).all() else [f"got {res}"])


@given(seeds, st.sampled_from(["sum", "avg"]), dtypes)
def test_sum_order_is_local_rank_order(group, seed, op, dtype):
    """Within a node each element is ``acc = g_0; acc += g_1; ...; acc * scale`` in fp32,
    sources in local-rank order (docs/api.md, Determinism), bit for bit.

    Magnitudes spread over 2**-8..2**24 (2**10 for fp16) make fp32 sums depend on their order; at 3+
    ranks the test also checks that the reversed order would differ, so it can tell.
    """
    if group.topology.num_nodes > 1:
        pytest.skip("across nodes the node partial sums are reduced by MPI/NCCL")
    rng = np.random.default_rng(seed)
    shape = (4 * WORLD + 3, 64)
    every, top = [], 11 if dtype == FP16 else 25  # fp16 tops out near 2**16
    for _ in range(WORLD):
        g = rng.standard_normal(shape) * np.exp2(rng.integers(-8, top, shape))
        every.append(g.astype(dtype))
    xp = group.backend.xp
    from ..._util import to_xp

    out = tidearray.reduce_scatter([to_xp(xp, every[group.rank])], op=op, group=group)[0]
    scale = np.float32(1.0 / WORLD if op == "avg" else 1.0)

    def fold(order):
        acc = every[order[0]].astype(np.float32)
        for r in order[1:]:
            acc = acc + every[r].astype(np.float32)
        return acc * scale if scale != 1 else acc

    c = -(-shape[0] // WORLD)
    lo, hi = min(group.rank * c, shape[0]), min((group.rank + 1) * c, shape[0])
    want = np.zeros((c, shape[1]), np.float32)
    want[:hi - lo] = fold(list(range(WORLD)))[lo:hi]  # the documented order
    failures = []
    got = to_numpy(out)
    if (bits(got) != bits(want)).any():
        failures.append(f"{int((bits(got) != bits(want)).sum())} elements differ from the "
                        "local-rank-order fold")
    forward, backward = fold(list(range(WORLD))), fold(list(range(WORLD))[::-1])
    if WORLD >= 3 and (bits(forward) == bits(backward)).all():
        failures.append("the data cannot tell the orders apart")
    agree(group.comm, failures, f"seed {seed}")
