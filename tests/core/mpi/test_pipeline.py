"""The inter-node pipelines, from the order in which the lanes were issued work.

On the host backend a lane's work is done when its call returns, so the order of the
calls is the order of the work: a test reads the recorded calls, never a clock. Both
collectives must interleave the network with node-local work ([Note: inter-node
pipeline] in ``_reduce_scatter``):

* reduce-scatter: chunk ``k``'s exchange of partial sums goes out before chunk
  ``k+1``'s node-local sums are computed, and its sum comes after it;
* all-gather: what inter-node step ``s`` delivered is pushed to the node-local
  peers before step ``s+1``'s exchange.

And the reduction's summation order, which chunking must not change, bit for bit:
each node's sources in local-rank order, scaled, then the nodes in node order.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import tidearray as ta
from tidearray._schedule import internode_ag_steps

from ..._util import (
    DTYPES,
    FP16,
    agree,
    padded_shard,
    recording_executor,
    seeds,
    to_numpy,
    to_xp,
)
from ._cases import documented_sum, poison, rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi
RECORDED = ("copy", "multicast_copy", "exchange", "accumulate")


def _record(monkeypatch: pytest.MonkeyPatch, group: Any) -> list:
    """Every primitive of every executor the group makes from now on, in issue order."""
    log, executor = recording_executor(group.backend.executor, RECORDED)
    monkeypatch.setattr(group.backend, "executor", executor)
    return log


def _needs(group: Any, nodes: int = 2, local: int = 1) -> None:
    if group.backend.name != "host":
        pytest.skip("issue order is completion order on the host backend only")
    topo = group.topology
    if topo.num_nodes < nodes or topo.local_size < local:
        pytest.skip(f"needs >= {nodes} nodes of >= {local} ranks (TIDE_LOCAL_SIZE), "
                    f"have {topo.num_nodes} x {topo.local_size}")


def _where(log: list, name: str, pred: Any = lambda lane, args: True) -> list[int]:
    return [i for i, (n, lane, args) in enumerate(log) if n == name and pred(lane, args)]


def _stamp(args: tuple) -> bool:
    """A debug-mode stamp copy (``tidearray._stamps``: 4-byte sequence numbers), not data."""
    return all(nbytes == 4 for _, _, nbytes in args[0])


def test_each_chunk_crosses_the_network_before_the_next_is_reduced(group, xp, monkeypatch):
    _needs(group)
    shapes = [(8 * WORLD + 1, 300), (3 * WORLD, 64)]
    unit = ta.Unit(shapes, FP16, group=group, chunk_nbytes=4096)
    n = len(unit.rs_plan.chunks)
    assert n >= 3, f"test bug: {n} chunks"
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=1, group=group)
    grads = [to_xp(xp, g) for g in rank_grads(shapes, FP16, 5, group.rank)]
    plan = unit.reduce_plan(grads, op="avg", staging=arena[0])
    log = _record(monkeypatch, group)
    plan()
    local = _where(log, "accumulate", lambda lane, a: np.dtype(a[1]) == FP16)
    sums = _where(log, "accumulate", lambda lane, a: np.dtype(a[1]) == np.float32)
    sent = _where(log, "exchange")
    failures = [] if len(local) == len(sums) == len(sent) == n else [
        f"expected {n} node-local sums, exchanges and inter-node sums, got "
        f"{len(local)}, {len(sent)}, {len(sums)}"]
    if not failures:
        failures += [f"chunk {k}: exchanged before its node partial sums"
                     for k in range(n) if not local[k] < sent[k]]
        failures += [f"chunk {k}: summed before its exchange" for k in range(n)
                     if not sent[k] < sums[k]]
        failures += [f"chunk {k}: exchange issued after chunk {k + 1}'s node-local sums, "
                     "not overlapping them" for k in range(n - 1) if not sent[k] < local[k + 1]]
    arena[0].free()
    agree(group.comm, failures, f"{n} chunks")


@pytest.mark.parametrize("multicast", [False, True], ids=["push", "multicast"])
def test_gather_spreads_each_step_before_the_next_exchange(group, xp, monkeypatch, multicast):
    _needs(group, nodes=2, local=2)
    topo = group.topology
    steps = len(internode_ag_steps(topo.num_nodes, topo.node))
    shapes = [(4 * WORLD + 3, 40), (WORLD, 8)]
    unit = ta.Unit(shapes, FP16, group=group)
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=group, multicast=multicast)
    shards = [to_xp(xp, np.full(unit.shard_shapes[i], group.rank, FP16))
              for i in range(len(shapes))]
    plan = unit.gather_plan(shards, slot=arena[0])
    log = _record(monkeypatch, group)
    full = plan()
    me = topo.local_rank
    sent = _where(log, "exchange")
    if multicast:
        lanes = {me: _where(log, "multicast_copy")}
    else:
        lanes = {p: _where(log, "copy", lambda lane, a, p=p: lane == p and not _stamp(a))
                 for p in range(topo.local_size) if p != me}
    failures = [] if len(sent) == steps else [f"expected {steps} exchanges, got {len(sent)}"]
    for p, writes in lanes.items():
        if len(writes) != steps + 1:
            failures.append(f"lane {p}: expected {steps + 1} pushes (own shards, then one "
                            f"per step), got {len(writes)}")
            continue
        failures += [f"lane {p}: step {s}'s pieces pushed before that step's exchange"
                     for s in range(steps) if not sent[s] < writes[s + 1]]
        failures += [f"lane {p}: pieces held before exchange {s} pushed only after it"
                     for s in range(steps) if not writes[s] < sent[s]]
    rows = [np.repeat(np.arange(WORLD), unit.shard_shapes[i][0])[:shapes[i][0]]
            for i in range(len(shapes))]
    for i, (f, want) in enumerate(zip(full, rows)):
        got = to_numpy(f)
        if not (got == want.astype(FP16).reshape(-1, *([1] * (got.ndim - 1)))).all():
            failures.append(f"parameter {i}: wrong rows")
    arena[0].free()
    agree(group.comm, failures, f"{topo.num_nodes} nodes x {topo.local_size}, "
                                f"{'multicast' if multicast else 'push'}")


@settings(max_examples=int(os.environ.get("TIDE_TEST_EXAMPLES", "0") or 0) or 12)
@given(dtype=st.sampled_from(DTYPES), seed=seeds, op=st.sampled_from(["sum", "avg"]),
       chunk=st.sampled_from([4096, 16384, None]))
def test_reduction_is_summed_in_the_documented_order(group, xp, dtype, seed, op, chunk):
    """Bit for bit: whatever the chunk and the split into nodes (``TIDE_LOCAL_SIZE``)."""
    shapes = [(5 * WORLD + 1, 70), (WORLD, 33), (2,)]
    every = [rank_grads(shapes, dtype, seed, r) for r in range(WORLD)]
    unit = ta.Unit(shapes, dtype, group=group, chunk_nbytes=chunk)
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=1, group=group)
    poison(arena[0])
    grads = [to_xp(xp, g) for g in every[group.rank]]
    out = [xp.full(unit.shard_shapes[i], np.nan, np.float32) for i in range(len(shapes))]
    unit.reduce_plan(grads, out=out, op=op, staging=arena[0])()
    scale = 1.0 / WORLD if op == "avg" else 1.0
    failures = []
    for i, o in enumerate(out):
        want = padded_shard(documented_sum([e[i] for e in every], group.topology, scale),
                            WORLD, group.rank)
        got = to_numpy(o)
        if got.tobytes() != want.tobytes():
            bad = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
            failures.append(f"parameter {i}: {bad} of {got.size} elements differ from the "
                            "documented order")
    arena[0].free()
    agree(group.comm, failures, f"seed {seed} {dtype} {op} chunk {chunk}")
