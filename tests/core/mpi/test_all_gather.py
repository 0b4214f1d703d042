"""TIDE-AG, multi-rank: bitwise equal to the reference, into poisoned slots, at any world size.

Run with ``mpiexec -n N python -m pytest --with-mpi tests/core/mpi``. Every rank
generates the same full parameters from a shared seed, shards its own copy,
gathers, and compares bits; failures are collective (``agree``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from mpi4py import MPI

import tidearray
from tidearray.layout import unit_nbytes

from ..._util import (
    BF16,
    DTYPES,
    FP16,
    FP32,
    agree,
    compare_bits,
    dtypes,
    fresh_seed,
    padded_shard,
    seeds,
    shapes,
    to_xp,
)
from ._cases import (
    POISON_BYTE,
    _stray_writes,
    check_gathered,
    poison,
    run_all_gather,
    slot_bytes,
    to_numpy,
)

WORLD = MPI.COMM_WORLD.Get_size()
SLOT_BYTES = 256 << 10
pytestmark = pytest.mark.mpi


def _skip_without_multicast(group) -> None:
    """Skip on every rank unless every rank's backend allows multicast."""
    answers = group.comm.allgather(group.backend.multicast_capability())
    if not all(ok for ok, _ in answers):
        pytest.skip(f"no multicast here: {answers}")


@pytest.fixture(scope="module", params=["push", "multicast"])
def arena(request, group):
    """Two slots, made once (mapping is the expensive part), for each transport: push
    (one batch per peer) and multicast slots (on host: the emulation that checks
    multicast addressing). Tests use ``arena.group``."""
    if request.param == "multicast":
        _skip_without_multicast(group)
    return tidearray.SlotArena(SLOT_BYTES, num_slots=2, group=group,
                               multicast=request.param == "multicast")


def _fits(group, unit, dtype) -> list[str]:
    n = unit_nbytes(unit, dtype, group=group)
    return [] if n <= SLOT_BYTES else [f"test bug: unit needs {n} bytes > slot {SLOT_BYTES}"]


@given(shapes(WORLD), dtypes, seeds, st.integers(0, 1), st.booleans())
@example([], BF16, 1, 0, False)
@example([(1,)], FP32, 2, 1, False)
@example([(WORLD - 1 or 1, 3), (WORLD + 1,), (2 * WORLD, 2, 2)], FP16, 3, 0, True)
def test_all_gather_is_bitwise_exact(arena, unit, dtype, seed, which, async_op):
    """Random units (0..12 parameters, 1-D to 3-D, d0 < W, ragged, empty) in bf16, fp16 and
    fp32, random bit patterns, into a slot poisoned with all-ones bytes: every output
    bit equals the reference, no byte outside the parameters is written, the outputs are
    views into the slot, and the shards are not modified."""
    failures = _fits(arena.group, unit, dtype)
    if not failures:
        failures, _ = run_all_gather(arena.group, unit, dtype, seed, slot=arena[which],
                                     async_op=async_op)
    agree(arena.group.comm, failures, f"unit {unit} {dtype}")


def _masters(unit: list, seed: int) -> list[np.ndarray]:
    """fp32 full parameters over a wide range of exponents (rounding at every scale)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 2.0 ** rng.integers(-12, 12, s)).astype(FP32)
            for s in unit]


@given(shapes(WORLD, min_count=1), dtypes, seeds)
def test_cast_plan_is_astype_on_every_transport(arena, unit, dtype, seed):
    """fp32 masters cast into the slot and gathered in place, on every transport (and
    across emulated nodes in the CI matrix): every output equals the full fp32 values
    rounded by astype, and no byte outside the parameters is written."""
    g = arena.group
    failures = _fits(g, unit, dtype)
    if not failures:
        full = _masters(unit, seed)
        masters = [to_xp(g.backend.xp, padded_shard(f, g.size, g.rank)) for f in full]
        plan = tidearray.Unit(unit, dtype, group=g).gather_plan(masters, arena[0], cast=True)
        poison(arena[0])
        got = plan()
        for i, (o, f) in enumerate(zip(got, full)):
            failures += compare_bits(o, f.astype(dtype), f"parameter {i}")
        failures += _stray_writes(g, arena[0], got)
    agree(arena.group.comm, failures, f"cast plan, unit {unit} {dtype}")


@given(shapes(WORLD, min_count=1), dtypes, seeds, st.booleans())
def test_gather_into_the_callers_buffers(arena, unit, dtype, seed, cast):
    """A plan given ``out`` gathers into those buffers (poisoned first), from shards of
    the unit's dtype or fp32 masters cast on the way, on every transport (and across
    emulated nodes in the CI matrix): every output bit equals the reference's, the
    outputs are the buffers given, and on the push transport this rank's own rows of
    the slot stay unwritten (they go straight to the buffers)."""
    g = arena.group
    failures = _fits(g, unit, dtype)
    if not failures:
        full = _masters(unit, seed)
        want = [f.astype(dtype) for f in full]
        src = [to_xp(g.backend.xp, padded_shard(f if cast else w, g.size, g.rank))
               for f, w in zip(full, want)]
        xp = g.backend.xp
        outs = [to_xp(xp, np.frombuffer(bytes([POISON_BYTE]) * w.nbytes, dtype)
                      .reshape(w.shape).copy()) for w in want]  # poisoned: all-ones bytes
        u = tidearray.Unit(unit, dtype, group=g)
        plan = u.gather_plan(src, arena[0], cast=cast, out=outs)
        poison(arena[0])
        got = plan()
        failures += [] if all(a is b for a, b in zip(got, outs)) else ["outputs are not out"]
        for i, (o, w) in enumerate(zip(outs, want)):
            failures += compare_bits(o, w, f"parameter {i}")
        raw = to_numpy(slot_bytes(arena[0]))
        pushed = not arena[0].buffer.multicast
        for i, (spec, off) in enumerate(zip(u.layout.specs, u.layout.offsets)):
            lo, n = spec.byte_range(g.rank)
            if pushed and n and not (raw[off + lo:off + lo + n] == POISON_BYTE).all():
                failures.append(f"parameter {i}: this rank's rows of the slot were written")
    agree(g.comm, failures, f"gather into out, unit {unit} {dtype}, cast {cast}")


@given(shapes(WORLD, min_count=1), shapes(WORLD, min_count=1), dtypes, seeds)
def test_second_gather_leaves_the_first_intact(arena, unit_a, unit_b, dtype, seed):
    """Slot 0 keeps unit A while unit B goes into slot 1; then slot 0 is reused for C."""
    failures = _fits(arena.group, unit_a, dtype) + _fits(arena.group, unit_b, dtype)
    if not failures:
        failures, outs_a = run_all_gather(arena.group, unit_a, dtype, seed, slot=arena[0])
        f_b, outs_b = run_all_gather(arena.group, unit_b, FP32, seed + 1, slot=arena[1])
        failures += f_b + check_gathered(outs_a, unit_a, dtype, seed, "A after B")
        f_c, _ = run_all_gather(arena.group, unit_b, dtype, seed + 2, slot=arena[0])
        failures += f_c + check_gathered(outs_b, unit_b, FP32, seed + 1, "B after C")
    agree(arena.group.comm, failures)


def test_writers_wait_for_the_owners_grant(arena):
    """Each rank in turn is late to poison its slot (its last use before the gather):
    peers must wait for its grant, or the poison overwrites what they delivered.

    This bites on the cuda backend, where the poison is queued behind a spinning
    kernel and the host call returns at once. On host the validation Allreduce
    already holds every rank until all have poisoned, so it passes either way there.
    """
    unit = [(3 * WORLD + 1, 40), (WORLD,)]
    failures = []
    for late in range(WORLD):
        f, _ = run_all_gather(arena.group, unit, BF16, 50 + late, slot=arena[late % 2],
                              late=0.05 if arena.group.rank == late else 0.0)
        failures += [f"rank {late} late: {x}" for x in f]
    agree(arena.group.comm, failures)


def test_default_slots_keep_the_previous_unit(group):
    """Without ``slot=``, the group's own two slots alternate: a unit's parameters stay
    valid while the next unit is gathered, also when the slots must grow."""
    small = [(2 * WORLD + 1, 3), (1,)]
    big = [(64 * WORLD + 3, 33), (WORLD,)]
    failures, outs_small = run_all_gather(group, small, BF16, 11)
    f2, outs_big = run_all_gather(group, big, BF16, 12)
    failures += f2 + check_gathered(outs_small, small, BF16, 11, "small after big")
    f3, _ = run_all_gather(group, small, BF16, 13)
    failures += f3 + check_gathered(outs_big, big, BF16, 12, "big after small")
    agree(group.comm, failures)


def moe_layer(hidden: int = 64, heads: int = 4, kv_heads: int = 2, head: int = 16,
              experts: int = 32, ffn: int = 24) -> list[tuple]:
    """A Qwen3-30B-A3B-like MoE layer, scaled down: many small parameters."""
    attn = [(heads * head, hidden), (kv_heads * head, hidden), (kv_heads * head, hidden),
            (hidden, heads * head), (head,), (head,)]
    expert = [(ffn, hidden), (ffn, hidden), (hidden, ffn)] * experts
    return attn + [(experts, hidden)] + expert + [(hidden,), (hidden,)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_parameter_unit(group, dtype):
    """~100 parameters of realistic shapes into the default slots."""
    failures, outs = run_all_gather(group, moe_layer(), np.dtype(dtype), 21)
    agree(group.comm, failures)


def test_zero_sized_parameters(arena):
    """Empty parameters (d0 = 0 or an inner dim 0) next to non-empty ones."""
    unit = [(0,), (3 * WORLD, 0), (WORLD + 1, 2), (0, 4), (1,)]
    failures, outs = run_all_gather(arena.group, unit, BF16, 5, slot=arena[0])
    failures += [f"parameter {i}: shape {o.shape}, expected {s}"
                 for i, (o, s) in enumerate(zip(outs, unit)) if o.shape != s]
    agree(arena.group.comm, failures)


def test_async_handle(arena):
    """``async_op=True`` returns a Work whose ``wait()`` gives the gathered parameters."""
    unit = [(3 * WORLD + 2, 5), (7,)]
    failures, outs = run_all_gather(arena.group, unit, BF16, 9, slot=arena[1], async_op=True)
    agree(arena.group.comm, failures)


def test_multicast_group_default_slots(group):
    """A group with ``multicast=True`` gathers into multicast default slots."""
    _skip_without_multicast(group)
    g = tidearray.init(backend=group.backend.name, multicast=True)
    unit = [(5 * WORLD + 2, 3), (WORLD,), (1, 7)]
    failures, _ = run_all_gather(g, unit, BF16, 41)
    f2, _ = run_all_gather(g, unit, FP32, 42)
    g.close()
    agree(group.comm, failures + f2)


def test_only_own_copies_are_marked_local(arena, monkeypatch):
    """The copies a gather marks ``local`` (which the cuda backend cuts: [Note: same-device
    copies]) are exactly this rank's shards into its own slot: on the push transport
    there is one per non-empty local parameter, and every other copy reads or writes
    a peer's slot."""
    from tidearray._layout import shard_spec
    from tidearray.backends.host import HostBackend

    g = arena.group
    if g.backend.name != "host":
        pytest.skip("records the host backend's compiled copies")
    seen = []
    compile_copies = HostBackend.compile_copies

    def spy(self, copies, local=False, split=False):
        seen.append((bool(local), tuple(copies)))
        return compile_copies(self, copies, local, split)

    monkeypatch.setattr(HostBackend, "compile_copies", spy)
    unit = [(2 * WORLD + 1, 3), (WORLD,), (0, 4)]
    rng = np.random.default_rng(fresh_seed(g.comm, bits=63))
    fulls = [rng.standard_normal(s).astype(np.float32) for s in unit]
    shards = [tidearray.shard(f, rank=g.rank, world=g.size) for f in fulls]
    slot = arena[0]
    me = g.topology.local_rank
    poison(slot)
    out = tidearray.all_gather(shards, unit, group=g, slot=slot)
    monkeypatch.undo()
    failures = [f"parameter {i} differs" for i, (o, f) in enumerate(zip(out, fulls))
                if not np.array_equal(np.asarray(o), f)]

    def inside(ptr, n, base, size):
        return base <= ptr and ptr + n <= base + size
    own = [(s.ctypes.data, s.nbytes) for s in shards if s.nbytes]
    mine = slot.ptr(me), slot.nbytes
    local = [c for flag, cs in seen if flag for c in cs if c[2]]
    other = [c for flag, cs in seen if not flag for c in cs if c[2]]
    for dst, src, n in local:
        if not inside(dst, n, *mine) or not any(inside(src, n, *s) for s in own):
            failures.append(f"a local copy ({dst:#x} <- {src:#x}, {n} B) leaves this rank")
    transport = "multicast" if slot.buffer.multicast else "push"
    cut = not slot.buffer.multicast
    for dst, src, n in other:
        if cut and inside(dst, n, *mine) and any(inside(src, n, *s) for s in own):
            failures.append(f"an own copy ({n} B) not marked local")
    real = sum(shard_spec(s, 4, g.size).byte_range(g.rank)[1] for s in unit)  # no padding
    if cut and sum(n for _, _, n in local) != real:
        failures.append(f"{transport}: local copies hold {sum(n for *_, n in local)} B, "
                        f"this rank's rows {real} B")
    agree(g.comm, failures, f"transport {transport}")
