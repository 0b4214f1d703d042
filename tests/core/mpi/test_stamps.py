"""Debug stamps ([Note: stamps] in tidearray/_stamps.py): every call proves its bytes arrived.

In debug mode each node-local transfer is followed, on its lane, by a copy of its
sequence number into the reader's memory, and the reader snapshots those numbers where
it starts reading. These tests check that good calls pass the check with correct data,
and that the check fails, on every rank, when a writer's stamp
never arrives (what a reader that went ahead without the data would see).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta
from tidearray import _stamps

from ..._util import FP32, agree, compare_bits, fresh_seed, padded_shard, to_numpy, to_xp
from ._cases import rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi
SHAPES = [(6 * WORLD + 1, 40), (5,), (2 * WORLD, 3, 7)]


@pytest.fixture(scope="module")
def debug_group(group):
    g = ta.init(backend=group.backend.name, debug=True, chunk_nbytes=4096)
    yield g
    g.comm.Barrier()
    g.close()


def _data(g, xp, seed):
    rng = np.random.default_rng(seed)
    fulls = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    shards = [to_xp(xp, padded_shard(f, WORLD, g.rank)) for f in fulls]
    return fulls, shards


def test_good_calls_pass_the_stamp_check(debug_group, xp):
    """Gathers and reductions (calls and plans, several chunks) return correct data and
    raise nothing in debug mode, call after call."""
    g = debug_group
    seed = fresh_seed(g.comm, bits=30)
    fulls, shards = _data(g, xp, seed)
    unit = ta.Unit(SHAPES, FP32, group=g, chunk_nbytes=4096)
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), 2, group=g)
    gather = unit.gather_plan(shards, arena[0])
    grads = [to_xp(xp, a) for a in rank_grads(SHAPES, FP32, seed, g.rank)]
    reduce = unit.reduce_plan(grads, op="sum", staging=arena[1])
    failures = []
    for step in range(3):
        params = gather() if step % 2 else ta.all_gather(shards, SHAPES, group=g, slot=arena[0])
        outs = reduce() if step % 2 else ta.reduce_scatter(grads, op="sum", group=g,
                                                           staging=arena[1])
        for j, (p, f) in enumerate(zip(params, fulls)):
            failures += compare_bits(p, f, f"step {step}: parameter {j}")
        every = [rank_grads(SHAPES, FP32, seed, r) for r in range(WORLD)]
        for j, o in enumerate(outs):
            want = padded_shard(sum(e[j].astype(np.float64) for e in every), WORLD, g.rank)
            err = np.abs(to_numpy(o) - want).max(initial=0.0)
            if err > 1e-5 * max(np.abs(want).max(initial=0.0), 1.0):
                failures.append(f"step {step}: reduced parameter {j} off by {err}")
    agree(g.comm, failures, "debug calls")


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_stamp_that_never_arrives_fails_every_rank(debug_group, xp, monkeypatch, collective):
    """Rank 1 drops its stamps (as if its data never came): every rank raises
    TideBackendError at the call, instead of returning."""
    g = debug_group
    if g.local_size < 2:
        pytest.skip("stamps are node-local: needs two ranks on a node")
    fulls, shards = _data(g, xp, 5)
    if g.topology.local_rank == 1:
        monkeypatch.setattr(_stamps.Stamps, "send", lambda *a, **k: None)
    failures = []
    try:
        if collective == "all_gather":
            ta.all_gather(shards, SHAPES, group=g)
        else:
            ta.reduce_scatter([to_xp(xp, a) for a in rank_grads(SHAPES, FP32, 3, g.rank)],
                              op="sum", group=g)
        failures.append("returned although rank 1's stamps never arrived")
    except ta.TideBackendError as e:
        if "read before it arrived" not in str(e):
            failures.append(f"unclear message: {e}")
    monkeypatch.undo()
    agree(g.comm, failures, collective)
