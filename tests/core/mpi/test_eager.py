"""The eager calls build (or find) plans ([Note: one pipeline] in ``_plan``), multi-rank.

A repeated call on the same buffers finds its plan (no new one); new buffers, another
op or another slot make one; the group keeps at most ``EAGER_PLANS``; ranks whose
caches differ (one rank dropped its plans) still pair their agreements, so the calls
neither hang nor disagree; and an input that changes in place between calls is read
again. Results are checked bitwise (gathers) or against an fp64 reference
(reductions) on fresh data, outputs poisoned before each call.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta
from tidearray._group import EAGER_PLANS

from ..._util import BF16, FP32, agree, compare_bits, fresh_seed, padded_shard, to_numpy, to_xp
from ._cases import full_params, poison, rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi

SHAPES = [(2 * WORLD + 1, 3), (WORLD,), (5, 7)]
#: fp32 accumulation of W normal values vs fp64: relative to the sum of magnitudes.
RS_RTOL = 4 * WORLD * 2.0**-24


@pytest.fixture
def eager(group):
    """The group with no eager plans, before and after the test."""
    group.eager_plans.clear()
    yield group
    group.eager_plans.clear()


def _seed(group) -> int:
    return fresh_seed(group.comm)


def _gather(group, xp, shards, full, slot, label) -> list[str]:
    poison(slot)
    got = ta.all_gather(shards, SHAPES, group=group, slot=slot)
    return [f for i, (g, w) in enumerate(zip(got, full))
            for f in compare_bits(g, w, f"{label}: parameter {i}")]


def _shards(xp, group, full):
    return [to_xp(xp, padded_shard(f, group.size, group.rank)) for f in full]


def test_a_repeated_gather_finds_its_plan(eager, xp):
    g = eager
    arena = ta.SlotArena(ta.Unit(SHAPES, BF16, group=g).nbytes, num_slots=2, group=g)
    seed = _seed(g)
    full = full_params(SHAPES, BF16, seed)
    shards = _shards(xp, g, full)
    failures = _gather(g, xp, shards, full, arena[0], "first")
    plans = len(g.eager_plans)
    for k in range(3):  # new values written in place: the same plan reads them again
        full = full_params(SHAPES, BF16, seed + 1 + k)
        for s, f in zip(shards, _shards(xp, g, full)):
            s[...] = f
        failures += _gather(g, xp, shards, full, arena[0], f"repeat {k}")
    if len(g.eager_plans) != plans or plans != 1:
        failures.append(f"expected one eager plan, got {plans} then {len(g.eager_plans)}")
    failures += _gather(g, xp, shards, full, arena[1], "other slot")
    if len(g.eager_plans) != 2:
        failures.append(f"another slot: expected a second plan, got {len(g.eager_plans)}")
    other = _shards(xp, g, full)  # the same values in new arrays: a new plan
    failures += _gather(g, xp, other, full, arena[0], "new arrays")
    if len(g.eager_plans) != 3:
        failures.append(f"new arrays: expected a third plan, got {len(g.eager_plans)}")
    agree(g.comm, failures, "eager gathers")


def test_ranks_whose_caches_differ_still_agree(eager, xp):
    """Rank 0 drops its plans between calls: it builds (one agreement in validation)
    while the others find theirs (one agreement on the signature), and a call that some
    rank gets wrong still raises on every rank."""
    g = eager
    seed = _seed(g)
    full = full_params(SHAPES, FP32, seed)
    shards = _shards(xp, g, full)
    slot = ta.SlotArena(ta.Unit(SHAPES, FP32, group=g).nbytes, num_slots=1, group=g)[0]
    failures = _gather(g, xp, shards, full, slot, "first")
    for k in range(3):
        if g.rank == 0:
            g.eager_plans.clear()
        failures += _gather(g, xp, shards, full, slot, f"after rank 0 dropped its plans {k}")
    bad = list(SHAPES)
    if g.rank == g.size - 1:
        bad[0] = (bad[0][0] + WORLD, 3)  # another shape on one rank: found by nobody
    with pytest.raises(ta.TideInvalid, match="all_gather"):
        ta.all_gather(shards, bad, group=g, slot=slot)
    failures += _gather(g, xp, shards, full, slot, "after the error")
    agree(g.comm, failures, "eager gathers across differing caches")


def test_reductions_with_and_without_out(eager, xp):
    g = eager
    seed = _seed(g)
    out = [xp.zeros(s, np.float32) for s in ta.Unit(SHAPES, BF16, group=g).shard_shapes]
    failures = []
    for k in range(3):
        every = [rank_grads(SHAPES, BF16, seed + k, r) for r in range(g.size)]
        grads = [to_xp(xp, a) for a in every[g.rank]]
        for o in out:
            o[...] = np.nan
        kept = ta.reduce_scatter(grads, out=out, op="sum", group=g)
        fresh = ta.reduce_scatter(grads, op="sum", group=g)
        for i in range(len(SHAPES)):
            want = padded_shard(sum(e[i].astype(np.float64) for e in every), g.size, g.rank)
            tol = RS_RTOL * sum(np.abs(e[i].astype(np.float64)) for e in every)
            tol = padded_shard(tol, g.size, g.rank)
            for label, got in (("out=", kept[i]), ("new arrays", fresh[i])):
                if not (np.abs(to_numpy(got).astype(np.float64) - want) <= tol).all():
                    failures.append(f"call {k}, {label}: parameter {i} off the fp64 sum")
        if kept[0] is not out[0]:
            failures.append("out=: expected the given arrays back")
    agree(g.comm, failures, "eager reductions")


def test_the_group_keeps_the_latest_plans(eager, xp):
    g = eager
    arrays = [[xp.zeros((k + 1,), np.float32)] for k in range(EAGER_PLANS + 3)]
    for a in arrays:
        ta.reduce_scatter(a, op="sum", group=g)
    failures = [] if len(g.eager_plans) == EAGER_PLANS else [
        f"expected {EAGER_PLANS} plans kept, got {len(g.eager_plans)}"]
    agree(g.comm, failures, "bounded eager plans")
