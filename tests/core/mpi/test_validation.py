"""Bad inputs: the same TideInvalid on every rank, before any transfer, never a hang.

In each case one rank (the last) holds the bad input and the others hold good
ones, except where noted ("everywhere"). Every rank must raise TideInvalid with
the same message, naming the bad rank (and the parameter, where there is
one); no output may have been written (slots and ``out=`` arrays stay
poisoned); and a good all-gather and reduce-scatter must then work, which
proves the group kept no half-done state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import tidearray
from tidearray.layout import shard_shape

from ..._util import BF16, FP16, FP32, agree, compare_bits, fresh_seed, to_numpy, to_xp
from ._cases import (
    POISON_BYTE,
    check_usable,
    compare_rs,
    full_params,
    poison,
    rank_grads,
    rs_reference,
    slot_bytes,
)

WORLD = MPI.COMM_WORLD.Get_size()
BAD = WORLD - 1
pytestmark = pytest.mark.mpi


def unit() -> list[tuple]:
    return [(4 * WORLD + 1, 3), (3 * WORLD, 2), (2,)]


@dataclass
class Ctx:
    group: Any
    xp: Any
    slots: Any
    bad: bool

    def shards(self, shapes: list, dtype: Any = BF16) -> list:
        return [tidearray.shard(to_xp(self.xp, f), rank=self.group.rank, world=WORLD)
                for f in full_params(shapes, np.dtype(dtype), 3)]

    def grads(self, shapes: list, dtype: Any = BF16) -> list:
        return [to_xp(self.xp, g) for g in rank_grads(shapes, np.dtype(dtype), 3, 0)]

    def outs(self, shapes: list) -> list:
        return [self.xp.full(shard_shape(s, WORLD), np.nan, np.float32)
                for s in shapes]


@dataclass
class Case:
    build: Callable[[Ctx], dict]
    expect: tuple  # fragments of the message; "{bad}" is the bad rank
    cross: bool = False  # the error is a disagreement between ranks: needs 2+ ranks


def _swap(items: list, i: int, new: Any) -> list:
    items = list(items)
    items[i] = new
    return items


def _ag(c: Ctx, shapes: list = None, shards: list = None, **kw: Any) -> dict:
    shapes = unit() if shapes is None else shapes
    return dict(shards=c.shards(shapes) if shards is None else shards, shapes=shapes, **kw)


def _ag_bad_shard(make: Callable[[Ctx], Any]) -> Callable[[Ctx], dict]:
    """Parameter 1's shard replaced by ``make(ctx)`` on the bad rank."""
    return lambda c: _ag(c, shards=_swap(c.shards(unit()), 1, make(c)) if c.bad else None)


def _padded_rows(i: int) -> int:
    return shard_shape(unit()[i], WORLD)[0]


AG_CASES = {
    "extra parameter": Case(lambda c: _ag(c, unit() + [(5,)] if c.bad else None),
                            ("number of shapes", "rank {bad}"), cross=True),
    "different shape": Case(lambda c: _ag(c, _swap(unit(), 1, (3 * WORLD, 5)) if c.bad
                                          else None),
                            ("parameter 1", "rank {bad}", "shape"), cross=True),
    "different dtype": Case(lambda c: _ag(c, shards=c.shards(unit(), FP16) if c.bad else None),
                            ("dtype", "rank {bad}", "float16"), cross=True),
    "different slot": Case(lambda c: _ag(c, slot=c.slots[1 if c.bad else 0]),
                           ("slot", "rank {bad}", "region #"), cross=True),
    "float64 first shard": Case(
        lambda c: _ag(c, shards=_swap(c.shards(unit()), 0, c.shards(unit(), np.float64)[0])
                      if c.bad else None),
        ("parameter 0", "rank {bad}", "float64")),
    "mixed dtypes": Case(_ag_bad_shard(lambda c: c.shards(unit(), FP32)[1]),
                         ("parameter 1", "rank {bad}", "float32")),
    "int32 shard": Case(_ag_bad_shard(lambda c: c.xp.zeros((_padded_rows(1), 2), np.int32)),
                        ("parameter 1", "rank {bad}", "int32")),
    "float64 everywhere": Case(lambda c: _ag(c, shards=c.shards(unit(), np.float64)),
                               ("parameter 0", "rank 0", "float64")),
    "non-contiguous shard": Case(
        _ag_bad_shard(lambda c: c.xp.zeros((_padded_rows(1), 4), BF16)[:, ::2]),
        ("parameter 1", "rank {bad}", "contiguous")),
    "shard one row too long": Case(
        _ag_bad_shard(lambda c: c.xp.zeros((_padded_rows(1) + 1, 2), BF16)),
        ("parameter 1", "rank {bad}", "shard")),
    "shard of a wrong inner size": Case(
        _ag_bad_shard(lambda c: c.xp.zeros((_padded_rows(1), 3), BF16)),
        ("parameter 1", "rank {bad}", "shard")),
    "fewer shards than shapes": Case(
        lambda c: _ag(c, shards=c.shards(unit())[:2] if c.bad else None),
        ("rank {bad}", "shard")),
    "negative dimension": Case(
        lambda c: _ag(c, _swap(unit(), 2, (-2,)) if c.bad else None, c.shards(unit())),
        ("parameter 2", "rank {bad}", "non-negative")),
    "0-d shape": Case(lambda c: _ag(c, _swap(unit(), 2, ()) if c.bad else None,
                                    _swap(c.shards(unit()), 2, c.xp.zeros((), BF16))
                                    if c.bad else None),
                      ("parameter 2", "rank {bad}")),
    "shard inside the output slot": Case(
        _ag_bad_shard(lambda c: c.slots[0].view(1024, (_padded_rows(1), 2), BF16)),
        ("parameter 1", "rank {bad}", "slot")),
    "a list instead of a shard": Case(_ag_bad_shard(lambda c: [0.0] * 4),
                                      (("parameter 1", "shard 1"), "rank {bad}")),
    "a dimension that is None": Case(
        lambda c: _ag(c, _swap(unit(), 2, (None,)) if c.bad else None, c.shards(unit())),
        ("rank {bad}", "shape")),
    "a dimension that is not a number": Case(
        lambda c: _ag(c, _swap(unit(), 2, ("x",)) if c.bad else None, c.shards(unit())),
        ("rank {bad}", "shape")),
    "slot too small everywhere": Case(lambda c: _ag(c, _swap(unit(), 0, (4096 * WORLD, 64))),
                                      ("slot", "rank 0")),
    "a slot that is not a region": Case(lambda c: _ag(c, slot="x" if c.bad else c.slots[0]),
                                        ("slot", "rank {bad}", "expected a Region")),
    "a shard that is not an array": Case(_ag_bad_shard(lambda c: "x"),
                                         ("shard 1", "rank {bad}", "expected an array")),
}


def _rs(c: Ctx, grads: list = None, out: list = None, **kw: Any) -> dict:
    return dict(grads=c.grads(unit()) if grads is None else grads,
                out=c.outs(unit()) if out is None else out, **kw)


def _rs_bad_grad(make: Callable[[Ctx], Any]) -> Callable[[Ctx], dict]:
    return lambda c: _rs(c, _swap(c.grads(unit()), 1, make(c)) if c.bad else None)


def _rs_bad_out(make: Callable[[Ctx], Any]) -> Callable[[Ctx], dict]:
    return lambda c: _rs(c, out=_swap(c.outs(unit()), 1, make(c)) if c.bad else None)


def _aliasing(c: Ctx) -> dict:
    grads = c.grads(unit(), FP32)
    outs = c.outs(unit())
    if c.bad:  # output 1 is the first bytes of gradient 1
        outs[1] = grads[1].reshape(-1)[: outs[1].size].reshape(outs[1].shape)
    return _rs(c, grads, outs)


def _overlapping_outs(c: Ctx) -> dict:
    outs = c.outs(unit())
    if c.bad:  # output 1 is the first bytes of output 0
        outs[1] = outs[0].reshape(-1)[: outs[1].size].reshape(outs[1].shape)
    return _rs(c, out=outs)


def _read_only_out(c: Ctx) -> dict:
    if c.xp is not np:
        pytest.skip("a read-only array: NumPy's flag (the host backend)")
    outs = c.outs(unit())
    if c.bad:
        outs[1].flags.writeable = False
    return _rs(c, out=outs)


def _small_staging(c: Ctx) -> dict:
    if c.group.local_size == 1:
        pytest.skip("with one rank per node nothing is staged")
    big = [(64 * WORLD, 256)]
    return _rs(c, c.grads(big), c.outs(big), staging=c.slots.tiny)


RS_CASES = {
    "extra gradient": Case(lambda c: _rs(c, c.grads(unit() + [(5,)]), c.outs(unit() + [(5,)]))
                           if c.bad else _rs(c), ("number of shapes", "rank {bad}"), cross=True),
    "different shape": Case(
        lambda c: _rs(c, _swap(c.grads(unit()), 1, c.grads([(3 * WORLD, 5)])[0]),
                      _swap(c.outs(unit()), 1, c.outs([(3 * WORLD, 5)])[0])) if c.bad
        else _rs(c), ("parameter 1", "rank {bad}", "shape"), cross=True),
    "different dtype": Case(lambda c: _rs(c, c.grads(unit(), FP16) if c.bad else None),
                            ("dtype", "rank {bad}", "float16"), cross=True),
    "different op": Case(lambda c: _rs(c, op="sum" if c.bad else "avg"),
                         ("op", "rank {bad}"), cross=True),
    "out on some ranks only": Case(lambda c: {**_rs(c), "out": None} if c.bad else _rs(c),
                                   ("out", "rank {bad}", "no out="), cross=True),
    "mixed dtypes": Case(_rs_bad_grad(lambda c: c.grads(unit(), FP32)[1]),
                         ("parameter 1", "rank {bad}", "float32")),
    "int32 gradient": Case(_rs_bad_grad(lambda c: c.xp.zeros(unit()[1], np.int32)),
                           ("parameter 1", "rank {bad}", "int32")),
    "float64 everywhere": Case(lambda c: _rs(c, c.grads(unit(), np.float64)),
                               ("parameter 0", "rank 0", "float64")),
    "non-contiguous gradient": Case(
        _rs_bad_grad(lambda c: c.xp.zeros((3 * WORLD, 4), BF16)[:, ::2]),
        ("parameter 1", "rank {bad}", "contiguous")),
    "output one row too long": Case(
        _rs_bad_out(lambda c: c.xp.zeros((_padded_rows(1) + 1, 2), np.float32)),
        ("parameter 1", "rank {bad}", "shape")),
    "bf16 output": Case(_rs_bad_out(lambda c: c.xp.zeros((_padded_rows(1), 2), BF16)),
                        ("parameter 1", "rank {bad}", "float32")),
    "non-contiguous output": Case(
        _rs_bad_out(lambda c: c.xp.zeros((_padded_rows(1), 4), np.float32)[:, ::2]),
        ("parameter 1", "rank {bad}", "contiguous")),
    "fewer outputs than gradients": Case(
        lambda c: _rs(c, out=c.outs(unit())[:2] if c.bad else None), ("rank {bad}", "output")),
    "output aliases a gradient": Case(_aliasing, ("parameter 1", "rank {bad}", "alias")),
    "output inside the staging slot": Case(
        lambda c: dict(_rs_bad_out(lambda c: c.slots[0].view(
            0, shard_shape(unit()[1], WORLD), np.float32))(c), staging=c.slots[0]),
        ("parameter 1", "rank {bad}", "staging")),
    "outputs that overlap": Case(_overlapping_outs, ("parameter 0", "rank {bad}", "overlap")),
    "a read-only output": Case(_read_only_out, ("parameter 1", "rank {bad}", "writable")),
    "a staging that is not a region": Case(
        lambda c: _rs(c, staging="x" if c.bad else c.slots[0]),
        ("staging", "rank {bad}", "expected a Region")),
    "gradient inside the staging slot": Case(
        lambda c: dict(_rs_bad_grad(lambda c: c.slots[0].view(0, unit()[1], BF16))(c),
                       staging=c.slots[0]),
        ("parameter 1", "rank {bad}", "staging")),
    "a list instead of a gradient": Case(_rs_bad_grad(lambda c: [0.0] * 6),
                                         (("parameter 1", "gradient 1"), "rank {bad}")),
    "a list instead of an output": Case(_rs_bad_out(lambda c: [0.0] * 6),
                                        (("parameter 1", "output 1"), "rank {bad}")),
    "None instead of the gradient list": Case(
        lambda c: _rs(c, out=c.outs(unit())) | ({"grads": None} if c.bad else {}),
        ("rank {bad}", "gradient")),
    "staging slot too small everywhere": Case(_small_staging, ("staging", "rank 0")),
    "bad op": Case(lambda c: _rs(c, op="mean" if c.bad else "avg"), ("op", "rank {bad}", "mean")),
    "bad op everywhere": Case(lambda c: _rs(c, op="max"), ("op", "rank 0", "max")),
}


def names_rank(msg: str, rank: int) -> bool:
    """Whether ``msg`` names ``rank`` ("rank 3", "ranks 0,1,3", "... on rank 3")."""
    return any(rank in {int(x) for x in m.split(",")}
               for m in re.findall(r"\branks? (\d+(?:,\d+)*)", msg))


def _has(msg: str, fragment: Any) -> bool:
    """``fragment``: text, "rank N" (checked with names_rank), or a tuple of alternatives."""
    if isinstance(fragment, tuple):
        return any(_has(msg, f) for f in fragment)
    m = re.fullmatch(r"rank (\d+)", fragment)
    return names_rank(msg, int(m.group(1))) if m else fragment in msg


def _fmt(fragment: Any) -> Any:
    if isinstance(fragment, tuple):
        return tuple(_fmt(f) for f in fragment)
    return fragment.format(bad=BAD)


def _message_failures(err: Any, case: Case) -> list[str]:
    if not isinstance(err, tidearray.TideInvalid):
        return [f"expected TideInvalid, got {err!r}"]
    msg = str(err)
    return [f"message lacks {f!r}: {msg}" for f in map(_fmt, case.expect) if not _has(msg, f)]


def _build(group: Any, slots: Any, case: Case) -> dict:
    """Every rank's inputs, or the same failure on every rank (never a lone exception)."""
    if case.cross and WORLD == 1:
        pytest.skip("a disagreement between ranks needs 2+ ranks")
    try:
        kwargs, errors = case.build(Ctx(group, group.backend.xp, slots, group.rank == BAD)), []
    except Exception as e:  # noqa: BLE001 - a test bug; report it on every rank
        kwargs, errors = {}, [f"building the inputs failed: {e!r}"]
    agree(group.comm, errors)
    return kwargs


def _expect_rejected(group: Any, call: Callable[[], Any], case: Case,
                     untouched: Callable[[], list[str]]) -> None:
    try:
        call()
        err: Any = None
    except Exception as e:  # noqa: BLE001 - anything but TideInvalid is a failure to report
        err = e
    failures = _message_failures(err, case) + untouched()
    messages = group.comm.allgather(str(err))
    if len(set(messages)) != 1:
        failures.append(f"ranks raised different messages: {messages}")
    agree(group.comm, failures)
    agree(group.comm, check_usable(group), "the group after the error")


def _run_ag_case(group: Any, slots: Any, case: Case) -> None:
    for s in slots:
        poison(s)
    kwargs = _build(group, slots, case)
    kwargs.setdefault("slot", slots[0])

    def untouched() -> list[str]:
        return [f"slot {i} was written before the error"
                for i, s in enumerate(slots) if (to_numpy(slot_bytes(s)) != POISON_BYTE).any()]

    _expect_rejected(group, lambda: tidearray.all_gather(group=group, **kwargs), case,
                     untouched)


def _run_rs_case(group: Any, slots: Any, case: Case) -> None:
    kwargs = _build(group, slots, case)
    grads = kwargs.pop("grads")
    watched = [o for o in kwargs["out"] or ()  # the poisoned (NaN) outputs, on every rank
               if getattr(o, "dtype", None) == np.float32 and o.size
               and np.isnan(to_numpy(o)).all()]

    def untouched() -> list[str]:
        return ["an output was written before the error" for o in watched
                if not np.isnan(to_numpy(o)).all()]

    _expect_rejected(group, lambda: tidearray.reduce_scatter(grads, group=group, **kwargs),
                     case, untouched)


@pytest.fixture(scope="module")
def slots(group):
    arena = tidearray.SlotArena(64 << 10, num_slots=2, group=group)
    arena.tiny = tidearray.SlotArena(4096, num_slots=1, group=group)[0]
    return arena


@pytest.mark.parametrize("name", AG_CASES)
def test_all_gather_rejects(group, slots, name):
    _run_ag_case(group, slots, AG_CASES[name])


@pytest.mark.parametrize("name", RS_CASES)
def test_reduce_scatter_rejects(group, slots, name):
    _run_rs_case(group, slots, RS_CASES[name])


def test_all_gather_rejects_a_float_dimension(group, slots):
    _run_ag_case(group, slots, Case(
        lambda c: _ag(c, _swap(unit(), 2, (2.5,)) if c.bad else None, c.shards(unit())),
        ("rank {bad}", "shape")))


def test_a_repeated_call_rejected_by_one_rank(group, slots):
    """Good ranks repeat a call they made before (validated and cached); the last
    rank's shape differs. Every rank raises, no slot is written, and the same call
    then gathers bitwise right, twice, into slots poisoned after the error (no grant
    of the rejected call may let a peer write a slot its owner is still writing)."""
    if WORLD == 1:
        pytest.skip("a disagreement between ranks needs 2+ ranks")
    seed = fresh_seed(group.comm, bits=30)
    shapes = unit()
    fulls = full_params(shapes, BF16, seed)
    xp = group.backend.xp
    shards = [tidearray.shard(to_xp(xp, f), rank=group.rank, world=WORLD) for f in fulls]
    for _ in range(2):  # validated, its program cached
        tidearray.all_gather(shards, shapes, group=group, slot=slots[0])
    _run_ag_case(group, slots, Case(
        lambda c: dict(shards=shards, shapes=_swap(shapes, 1, (3 * WORLD, 5)) if c.bad
                       else shapes),
        ("parameter 1", "rank {bad}", "shape"), cross=True))
    failures = []
    for k in range(2):
        poison(slots[0])
        outs = tidearray.all_gather(shards, shapes, group=group, slot=slots[0])
        failures += [x for i, (o, f) in enumerate(zip(outs, fulls))
                     for x in compare_bits(o, f, f"call {k}: parameter {i}")]
    agree(group.comm, failures)


def test_a_repeated_reduce_scatter_sees_a_gradient_reshaped_in_place(group):
    """A repeat of a validated reduce-scatter (the same arrays, found again without
    resolving them) still sees a gradient reshaped in place on one rank (on every rank,
    at 1 rank): every rank raises, naming the shape, and no output is written; undone,
    the same call reduces right again."""
    xp = group.backend.xp
    shapes = unit()
    seed = fresh_seed(group.comm, bits=30)
    grads = [to_xp(xp, g) for g in rank_grads(shapes, BF16, seed, group.rank)]
    outs = [xp.full(shard_shape(s, WORLD), np.nan, np.float32) for s in shapes]
    for _ in range(2):  # validated, then found again as a repeat
        tidearray.reduce_scatter(grads, out=outs, group=group)
    bad = group.rank == BAD
    for o in outs:
        o[...] = np.nan
    if bad:
        grads[1].shape = (2, 3 * WORLD)  # the same bytes, another unit
    try:
        with pytest.raises(tidearray.TideInvalid, match=f"rank {BAD}.*parameter 1.*shape"):
            tidearray.reduce_scatter(grads, out=outs, group=group)
    finally:
        if bad:
            grads[1].shape = (3 * WORLD, 2)
    failures = [f"output {i} was written before the error" for i, o in enumerate(outs)
                if not np.isnan(to_numpy(o)).all()]
    res = tidearray.reduce_scatter(grads, out=outs, group=group)
    failures += compare_rs(res, *rs_reference(shapes, BF16, seed, WORLD, group.rank, "avg"))
    agree(group.comm, failures)


def test_a_float_dimension_is_rejected_after_the_int_call_is_cached(group, slots):
    """``(2.0,) == (2,)`` in Python, and both hash alike: a float dimension must not find
    the cached entry of a validated int call. One rank (or every rank, at 1 rank) repeats
    a cached call with a float; every rank raises."""
    shapes = unit()
    xp = group.backend.xp
    shards = [tidearray.shard(to_xp(xp, f), rank=group.rank, world=WORLD)
              for f in full_params(shapes, BF16, 5)]
    tidearray.all_gather(shards, shapes, group=group, slot=slots[0])  # validated, cached
    floats = [tuple(float(d) for d in s) for s in shapes]
    bad = group.rank == BAD
    with pytest.raises(tidearray.TideInvalid, match=f"rank {BAD}.*int"):
        tidearray.all_gather(shards, floats if bad else shapes, group=group, slot=slots[0])


def test_an_odd_first_dtype_is_reported_once(group, slots):
    """A float64 first shard is that parameter's error, not every other parameter's."""
    xp = group.backend.xp
    shards = [tidearray.shard(to_xp(xp, f), rank=group.rank, world=WORLD)
              for f in full_params(unit(), BF16, 4)]
    shards[0] = xp.zeros(shards[0].shape, np.float64)
    with pytest.raises(tidearray.TideInvalid) as err:
        tidearray.all_gather(shards, unit(), group=group, slot=slots[0])
    msg = str(err.value)
    agree(group.comm, [] if "parameter 0" in msg and "parameter 1" not in msg
          and "parameter 2" not in msg else [f"message: {msg}"])


def test_ranks_calling_different_collectives_are_told_so(group, slots):
    """The last rank reduce-scatters while the others all-gather the same unit: every rank
    raises TideInvalid naming both calls (not a field that merely differs between them), no
    slot or output is written, and the group stays usable."""
    if WORLD == 1:
        pytest.skip("a disagreement between ranks needs 2+ ranks")
    c = Ctx(group, group.backend.xp, slots, group.rank == BAD)
    shapes = unit()
    for s in slots:
        poison(s)
    outs = c.outs(shapes)
    try:
        if c.bad:
            tidearray.reduce_scatter(c.grads(shapes), group=group, out=outs)
        else:
            tidearray.all_gather(c.shards(shapes), shapes, group=group, slot=slots[0])
        err: Any = None
    except Exception as e:  # noqa: BLE001 - anything but TideInvalid is a failure to report
        err = e
    failures = _message_failures(err, Case(lambda c: {}, (
        "expected the same call on every rank", "all_gather on rank 0",
        f"reduce_scatter on rank {BAD}")))
    failures += [f"slot {i} was written before the error" for i, s in enumerate(slots)
                 if (to_numpy(slot_bytes(s)) != POISON_BYTE).any()]
    failures += ["an output was written before the error" for o in outs
                 if o.size and not np.isnan(to_numpy(o)).all()]
    agree(group.comm, failures)
    agree(group.comm, check_usable(group), "the group after the error")



def test_another_groups_slot_is_refused(group, slots):
    """Region numbers are per group, so a slot of another group (on one rank, or on all)
    would pass the ranks' agreement on the number: refused as another group's."""
    other = tidearray.init(group.comm, backend=group.backend.name)
    try:
        foreign = tidearray.SlotArena(64 << 10, num_slots=1, group=other)[0]
        for bad_rank in {BAD, None}:  # the last rank only, then every rank
            case = Case(lambda c, b=bad_rank: _ag(
                c, slot=foreign if b is None or c.group.rank == b else c.slots[0]),
                ("slot", f"rank {BAD if bad_rank is not None else 0}", "another group"))
            _run_ag_case(group, slots, case)
    finally:
        other.close()


def test_a_closed_group_is_refused(group):
    xp = group.backend.xp
    other = tidearray.init(group.comm, backend=group.backend.name)
    other.close()
    shapes = unit()
    shards = [xp.zeros(shard_shape(s, WORLD), BF16) for s in shapes]
    for call in (lambda: tidearray.all_gather(shards, shapes, group=other),
                 lambda: tidearray.reduce_scatter([xp.zeros(s, BF16) for s in shapes],
                                                  group=other),
                 lambda: tidearray.SlotArena(4096, group=other)):
        with pytest.raises(tidearray.TideInvalid, match="expected an open group"):
            call()


@pytest.mark.parametrize("differ", ["slot_nbytes", "num_slots", "a float size"])
def test_slot_arenas_must_agree(group, differ):
    """Peers find each other's flag words by their own slot's size, so an arena that
    differs on one rank would signal at the wrong offsets: every rank raises, before any
    memory is mapped, and the group stays usable."""
    kw = {"slot_nbytes": 8192, "num_slots": 2}
    if group.rank == BAD:
        kw.update({"slot_nbytes": {"slot_nbytes": 4096, "a float size": 1024.5}.get(
            differ, kw["slot_nbytes"]), "num_slots": 3 if differ == "num_slots" else 2})
    if WORLD == 1 and differ != "a float size":
        pytest.skip("a disagreement between ranks needs 2+ ranks")
    try:
        tidearray.SlotArena(group=group, **kw)
        err: Any = None
    except Exception as e:  # noqa: BLE001 - anything but TideInvalid is a failure to report
        err = e
    failures = [] if isinstance(err, tidearray.TideInvalid) and names_rank(str(err), BAD) \
        else [f"expected TideInvalid naming rank {BAD}, got {err!r}"]
    agree(group.comm, failures)
    agree(group.comm, check_usable(group), "the group after the error")


def test_torch_tensors_as_arrays(group):
    """CPU tensors on the host backend, as the docs promise any DLPack producer: bfloat16
    (which NumPy's DLPack cannot import), parameters and tensors that require grad gather
    bitwise."""
    torch = pytest.importorskip("torch")
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    shapes = unit()
    fulls = full_params(shapes, BF16, fresh_seed(group.comm, bits=30))
    shards = [torch.from_numpy(np.array(tidearray.shard(f.view(np.int16), rank=group.rank,
                                                        world=WORLD))).view(torch.bfloat16)
              for f in fulls]
    shards[0] = torch.nn.Parameter(shards[0])  # requires grad; its class is torch.nn's
    shards[1].requires_grad_(True)
    outs = tidearray.all_gather(shards, shapes, group=group)
    agree(group.comm, [x for i, (o, f) in enumerate(zip(outs, fulls))
                       for x in compare_bits(o, f, f"parameter {i}")])
