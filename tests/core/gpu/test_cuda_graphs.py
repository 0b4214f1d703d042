"""CUDA graphs on the cuda backend: collectives inside a user's stream capture.

Graph plans (``graph=True``) are tested with every other plan in
``tests/core/mpi/test_graphs.py``, which runs on cuda too. Here the user captures: a gather
plan, a reduce plan and an eager gather are issued inside ``Stream.begin_capture``,
after one run outside it (the warm-up that uploads their tables), and the user's graph
is replayed with new inputs written in place and poisoned outputs: the gathers are the
full parameters bitwise, the reduction the bits of the same plan run eagerly after it.
Every flag is 0 after each replay ([Note: replay-safe flags] in ``_arena``).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta

from ..._util import (
    BF16,
    FP32,
    agree,
    compare_bits,
    fresh_seed,
    padded_shard,
    skip_in_debug,
    to_numpy,
)
from ..mpi._cases import full_params, poison, rank_grads
from ..mpi.test_graphs import nonzero_flags

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
SHAPES = [(64 * WORLD + 3, 96), (7,), (5 * WORLD, 33)]


def test_collectives_replay_from_a_users_capture(cuda_group):
    import cupy

    g = cuda_group
    skip_in_debug(g)
    unit = ta.Unit(SHAPES, BF16, group=g, chunk_nbytes=8192)
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=3, group=g)
    shards = [cupy.zeros(s, BF16) for s in unit.shard_shapes]
    grads = [cupy.zeros(s, BF16) for s in SHAPES]
    gather = unit.gather_plan(shards, arena[0])
    reduce = unit.reduce_plan(grads, op="sum", staging=arena[1])
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        params = gather(stream=stream)
        eager = ta.all_gather(shards, SHAPES, group=g, slot=arena[2], stream=stream)
        return params, eager, reduce(stream=stream)

    step()  # outside the capture first: tables uploaded, kernels compiled
    g.synchronize()
    stream.begin_capture()
    try:
        params, eager, outs = step()
    finally:
        graph = stream.end_capture()
    seed = fresh_seed(g.comm, bits=32)
    failures = []
    for call in range(5):
        full = full_params(SHAPES, BF16, seed + call)
        for s, f in zip(shards, full):
            s[...] = cupy.asarray(padded_shard(f, g.size, g.rank))
        for grad, mine in zip(grads, rank_grads(SHAPES, BF16, seed + call, g.rank)):
            grad[...] = cupy.asarray(mine)
        for slot in arena.slots:
            poison(slot)
        for o in outs:
            o.fill(np.nan)
        g.synchronize()
        g.comm.Barrier()  # peers write our slots: not before our poison landed
        graph.launch(stream)
        stream.synchronize()
        replayed = [to_numpy(o).copy() for o in outs]
        for i, f in enumerate(full):
            failures += compare_bits(params[i], f, f"replay {call}: gather plan {i}")
            failures += compare_bits(eager[i], f, f"replay {call}: eager gather {i}")
        failures += nonzero_flags(g, arena.slots)
        with stream:  # poisoned on the plan's stream: a fill on another would race it
            for o in reduce.out:
                o.fill(np.nan)
        again = reduce(stream=stream)  # the same plan, eagerly
        stream.synchronize()
        for i, o in enumerate(again):
            if replayed[i].dtype != FP32:
                failures.append(f"replay {call}: reduction {i} is {replayed[i].dtype}")
            failures += compare_bits(replayed[i], to_numpy(o), f"replay {call}: reduction {i}")
    agree(g.comm, failures, "user capture")
    del graph
    g.synchronize()
    for s in arena.slots:
        s.free()


def test_a_collective_in_a_users_capture_is_refused_in_debug_mode(cuda_group):
    """Debug mode checks each call's stamps on the host after it, which a capture
    cannot: a collective issued inside one raises a clear error on every rank (each
    rank's own capture), instead of a CUDA error from the stamps' wait."""
    import cupy

    g = cuda_group
    if not g.config.debug:
        pytest.skip("debug mode only (tests/gpu/run.sh's debug step)")
    unit = ta.Unit(SHAPES, BF16, group=g)
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=g)
    shards = [cupy.zeros(s, BF16) for s in unit.shard_shapes]
    gather = unit.gather_plan(shards, arena[0])
    stream = cupy.cuda.Stream(non_blocking=True)
    gather(stream=stream)
    g.synchronize()
    stream.begin_capture()
    try:
        with pytest.raises(ta.TideInvalid, match="no debug mode .* inside a stream capture"):
            gather(stream=stream)
    finally:
        try:
            stream.end_capture()
        except Exception:  # noqa: BLE001, S110 - the refused call forked a lane: unjoined
            pass
    g.synchronize()
