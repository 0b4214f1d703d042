"""Persistent plans, multi-rank: built once, called many times, at any world size.

Each call changes the inputs in place and poisons the outputs first, so a plan
that skipped its transfers, or read stale addresses, fails. Reductions use
normal values (fp32 sums of them are inexact) against an fp64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import tidearray as ta

from ..._util import (
    DTYPES,
    FP32,
    agree,
    compare_bits,
    fresh_seed,
    padded_shard,
    seeds,
    shapes,
    to_numpy,
    to_xp,
)
from ._cases import full_params, poison, rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi

#: fp32 accumulation of W normal values vs fp64: relative to the sum of magnitudes.
RS_RTOL = 4 * WORLD * 2.0**-24


def _arena(group, unit, num=2):
    return ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=num, group=group)


@given(shapes=shapes(WORLD, max_count=8, min_count=1), dtype=st.sampled_from(DTYPES),
       seed=seeds)
def test_gather_plan_repeats_with_new_data(group, xp, shapes, dtype, seed):
    """Three calls into two slots, each with new shard contents written in place."""
    unit = ta.Unit(shapes, dtype, group=group)
    arena = _arena(group, unit)
    shards = [xp.zeros(s, dtype) for s in unit.shard_shapes]
    plans = [unit.gather_plan(shards, arena[k]) for k in range(2)]
    failures = []
    for call in range(3):
        full = full_params(shapes, dtype, seed + call)
        for s, f in zip(shards, full):
            s[...] = to_xp(xp, padded_shard(f, group.size, group.rank))
        slot = arena[call % 2]
        poison(slot)
        got = plans[call % 2]()
        for i, (g, f) in enumerate(zip(got, full)):
            failures += compare_bits(g, f, f"call {call}: parameter {i}")
    agree(group.comm, failures, "gather plan")
    for s in arena.slots:
        s.free()


@given(shapes=shapes(WORLD, max_count=8, min_count=1), dtype=st.sampled_from(DTYPES),
       seed=seeds)
def test_cast_gather_plan_rounds_masters_into_the_slot(group, xp, shapes, dtype, seed):
    """fp32 masters with values no 16-bit dtype holds exactly, cast on every call:
    the slot holds each full parameter rounded to nearest even (bitwise what
    NumPy and ml_dtypes' astype give), after a reduction staged in that slot."""
    unit = ta.Unit(shapes, dtype, group=group)
    arena = _arena(group, unit)
    masters = [xp.zeros(s, FP32) for s in unit.shard_shapes]
    plans = [unit.gather_plan(masters, arena[k], cast=True) for k in range(2)]
    reduce = unit.reduce_plan([xp.zeros(s, dtype) for s in shapes], op="sum", staging=arena[1])
    failures = []
    for call in range(3):
        rng = np.random.default_rng([seed, call])
        # Finite values over many binades, most with bits below any 16-bit mantissa (NaN
        # payloads are the one documented difference between the kernel and astype).
        full = [(rng.standard_normal(s) * 2.0 ** rng.integers(-12, 12, s)).astype(FP32)
                for s in shapes]
        for m, f in zip(masters, full):
            m[...] = to_xp(xp, padded_shard(f, group.size, group.rank))
        if call == 1:
            reduce()  # stages in slot 1: the cast must not write it before the reduction is done
        poison(arena[call % 2])
        got = plans[call % 2]()
        for i, (g, f) in enumerate(zip(got, full)):
            failures += compare_bits(g, f.astype(dtype), f"call {call}: parameter {i}")
    agree(group.comm, failures, "cast gather plan")
    for s in arena.slots:
        s.free()


@given(shapes=shapes(WORLD, max_count=8, min_count=1), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["sum", "avg"]), seed=seeds)
def test_reduce_plan_repeats_with_new_data(group, xp, shapes, dtype, op, seed):
    """Slot-Reuse staging; new gradients and poisoned outputs before each of three calls."""
    unit = ta.Unit(shapes, dtype, group=group)
    arena = _arena(group, unit, 1)
    grads = [xp.zeros(s, dtype) for s in shapes]
    plan = unit.reduce_plan(grads, op=op, staging=arena[0])
    failures = []
    for call in range(3):
        every = [rank_grads(shapes, dtype, seed + call, r) for r in range(group.size)]
        for g, mine in zip(grads, every[group.rank]):
            g[...] = to_xp(xp, mine)
        for o in plan.out:
            o.fill(np.nan)
        got = plan()
        for i in range(len(shapes)):
            total = sum(e[i].astype(np.float64) for e in every)
            scale = 1.0 / group.size if op == "avg" else 1.0
            want = padded_shard(total * scale, group.size, group.rank)
            bound = padded_shard(sum(np.abs(e[i].astype(np.float64)) for e in every),
                                 group.size, group.rank) * RS_RTOL
            err = np.abs(to_numpy(got[i]).astype(np.float64) - want)
            if to_numpy(got[i]).dtype != FP32 or not np.all(err <= bound):
                failures.append(f"call {call}: parameter {i}: max error {np.nanmax(err)!r} "
                                f"beyond {RS_RTOL:.2g} x sum|g|")
    agree(group.comm, failures, "reduce plan")
    arena[0].free()


def test_many_plans_interleaved(group, xp):
    """400 plans (one per unit), called in a shuffled order the ranks share: no plan's
    addresses or flag counts leak into another's."""
    rng = np.random.default_rng(fresh_seed(group.comm, bits=63))
    n = 400
    dtype = np.dtype(np.float32)
    unit_shapes = [[(int(rng.integers(1, 3 * WORLD + 2)), 3)] for _ in range(n)]
    units = [ta.Unit(s, dtype, group=group) for s in unit_shapes]
    arena = ta.SlotArena(max(u.nbytes for u in units), num_slots=2, group=group)
    fulls = [[rng.standard_normal(s[0]).astype(dtype)] for s in unit_shapes]
    plans = [u.gather_plan([xp.asarray(padded_shard(f[0], group.size, group.rank))],
                           arena[i % 2]) for i, (u, f) in enumerate(zip(units, fulls))]
    failures = []
    for i in rng.permutation(n)[:120]:
        poison(arena[i % 2])
        failures += compare_bits(plans[i]()[0], fulls[i][0], f"plan {i}")
    agree(group.comm, failures, "400 plans")
    for s in arena.slots:
        s.free()


def test_bad_plan_input_raises_on_every_rank(group, xp):
    """One rank's wrong shard shape, or a too-small staging slot: TideInvalid everywhere."""
    unit = ta.Unit([(2 * WORLD + 1, 3)], FP32, group=group)
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=group)
    shape = unit.shard_shapes[0]
    if group.rank == group.size - 1:
        shape = (shape[0] + 1, 3)
    with pytest.raises(ta.TideInvalid, match=f"rank {group.size - 1}"):
        unit.gather_plan([xp.zeros(shape, FP32)], arena[0])
    small = ta.SlotArena(64, num_slots=1, group=group)
    if unit.staging_nbytes > small[0].nbytes:
        with pytest.raises(ta.TideInvalid, match="staging"):
            unit.reduce_plan([xp.zeros((2 * WORLD + 1, 3), FP32)], staging=small[0])
    with pytest.raises(ta.TideInvalid, match="dtype"):
        unit.gather_plan([xp.zeros(unit.shard_shapes[0], np.float16)], arena[0])
    with pytest.raises(ta.TideInvalid, match="float32 shards to cast"):
        ta.Unit([(2 * WORLD + 1, 3)], np.float16, group=group).gather_plan(
            [xp.zeros(unit.shard_shapes[0], np.float16)], arena[0], cast=True)
    for r in (*arena.slots, *small.slots):
        r.free()


def test_unit_rejects_bad_shapes_everywhere(group):
    with pytest.raises(ta.TideInvalid, match="int"):
        ta.Unit([(5.0, 3)], FP32, group=group)
    shapes = [(3,)] if group.rank == 0 else [(4,)]
    if group.size > 1:
        with pytest.raises(ta.TideInvalid, match="Unit"):
            ta.Unit(shapes, FP32, group=group)


@pytest.mark.mpi(min_size=2)
def test_debug_mode_catches_plans_called_out_of_order(comm):
    """With ``debug=True``, ranks calling different plans raise together, before any copy."""
    g = ta.init(comm, backend="host", debug=True)
    try:
        units = [ta.Unit([(2 * g.size, 2)], FP32, group=g) for _ in range(2)]
        arena = ta.SlotArena(units[0].nbytes, num_slots=1, group=g)
        plans = [u.gather_plan([np.zeros(u.shard_shapes[0], FP32)], arena[0]) for u in units]
        plans[0]()  # in order: fine
        with pytest.raises(ta.TideInvalid, match="plan"):
            plans[0 if g.rank == 0 else 1]()
    finally:
        comm.Barrier()
        g.close()


def test_plans_on_some_ranks_leave_other_groups_in_step(comm):
    """Plans are numbered per group: rank 0 building plans on a group of its own does
    not put a debug-mode group of every rank out of step."""
    sub = comm.Split(0 if comm.rank == 0 else 1, comm.rank)
    alone = ta.init(sub, backend="host", local_size=1)  # any size divides by 1
    if comm.rank == 0:
        unit = ta.Unit([(4, 2)], FP32, group=alone)
        slot = ta.SlotArena(unit.nbytes, num_slots=1, group=alone)[0]
        for _ in range(2):
            unit.gather_plan([np.zeros(unit.shard_shapes[0], FP32)], slot)
    g = ta.init(comm, backend="host", debug=True)
    try:
        unit = ta.Unit([(2 * g.size, 2)], FP32, group=g)
        full = np.random.default_rng(fresh_seed(g.comm)).standard_normal((2 * g.size, 2))
        full = full.astype(FP32)
        full = g.comm.bcast(full)
        slot = ta.SlotArena(unit.nbytes, num_slots=1, group=g)[0]
        poison(slot)
        plan = unit.gather_plan([padded_shard(full, g.size, g.rank)], slot)
        failures = compare_bits(plan()[0], full, "debug-mode plan")
        agree(comm, failures, "plan numbers per group")
    finally:
        comm.Barrier()
        g.close()
        alone.close()
        sub.Free()


def test_reduce_plan_uses_the_units_chunks(group, xp):
    """A unit's ``chunk_nbytes`` decides the plan's chunks (and so its staging), not the
    group's: 4 KiB chunks over a 64 KiB parameter need several, and still sum right."""
    shapes = [(8 * WORLD, 2048)]
    unit = ta.Unit(shapes, FP32, group=group, chunk_nbytes=4096)
    assert len(unit.rs_plan.chunks) > 1
    arena = _arena(group, unit, 1)
    every = [rank_grads(shapes, FP32, 9, r) for r in range(group.size)]
    plan = unit.reduce_plan([to_xp(xp, every[group.rank][0])], op="sum", staging=arena[0])
    want = padded_shard(sum(e[0].astype(np.float64) for e in every), group.size, group.rank)
    got = to_numpy(plan()[0]).astype(np.float64)
    ok = np.allclose(got, want, rtol=0, atol=RS_RTOL * np.abs(want).max() * 4 + 1e-6)
    failures = [] if ok else ["wrong sums"]
    if plan._red.plan != unit.rs_plan:
        failures.append("the plan ignored the unit's chunks")
    agree(group.comm, failures)
    arena[0].free()


@given(seed=seeds, dtype=st.sampled_from(DTYPES))
def test_reduction_bits_do_not_depend_on_chunking(group, xp, seed, dtype):
    """The same gradients reduced with 4 KiB chunks, 64 KiB chunks and the group's
    default give the same bits: chunks change how the work is cut, not what is summed."""
    shapes = [(6 * WORLD + 1, 300), (5,), (2 * WORLD, 1024)]
    every = [rank_grads(shapes, dtype, seed, r) for r in range(group.size)]
    results = []
    for chunk in (4096, 65536, None):
        unit = ta.Unit(shapes, dtype, group=group, chunk_nbytes=chunk)
        arena = _arena(group, unit, 1)
        grads = [to_xp(xp, g) for g in every[group.rank]]
        plan = unit.reduce_plan(grads, op="avg", staging=arena[0])
        results.append([to_numpy(o).copy() for o in plan()])
        arena[0].free()
    failures = [f"chunking {k}: parameter {i} differs from 4 KiB chunks"
                for k in (1, 2) for i, (a, b) in enumerate(zip(results[0], results[k]))
                if a.tobytes() != b.tobytes()]
    agree(group.comm, failures, f"seed {seed}")
