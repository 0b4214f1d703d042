"""The runtime's parts alone, with no ranks: the unit lifecycle's bookkeeping, the slot
table, the front-end options and the gradient accumulator (NumPy, a fake comm).

``UnitLifecycle`` ([Note: unit lifecycle] in ``tidearray/fsdp/_lifecycle.py``) and
``SlotTable`` ([Note: slots] in ``tidearray/fsdp/_slots.py``) are pure bookkeeping; the
multi-rank tests (``tests/torch/mpi/test_lifecycle.py``) check what training does with them.
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest

from tidearray import TideInvalid
from tidearray.fsdp import FrontEnd, GradScale
from tidearray.fsdp._accum import GradAccumulator
from tidearray.fsdp._lifecycle import BLIND, State, UnitLifecycle, UseToken
from tidearray.fsdp._shards import ShardArena, arena_layout
from tidearray.fsdp._slots import SlotTable, slot_of, slot_units


def test_uses_keep_a_unit_in_forward_until_its_backward_opens():
    life = UnitLifecycle([[True], [True, False]])
    life.use(1, None)
    life.use(1, None)  # a second use is a use, not a new pass
    assert life.state == [State.IDLE, State.FORWARD]
    assert not life.in_backward
    life.open(1)
    assert life.state[1] is State.BACKWARD and life.in_backward
    life.close(1, [True, True])
    assert life.state[1] is State.DONE
    life.end_pass()
    assert life.state == [State.IDLE, State.IDLE] and not life.in_backward


def test_a_unit_closes_when_no_use_token_is_pending():
    life = UnitLifecycle([[True]])
    first, second = UseToken(), UseToken()
    life.use(0, first)
    life.use(0, second)
    life.open(0)
    life.use_done(0, second)
    assert not life.may_close(0)  # the first use's backward is still to come
    life.use_done(0, first)
    assert life.may_close(0)


def test_an_open_unit_gives_its_slot_up_to_an_opening_unit_not_to_a_prefetch():
    """A model called twice: the second call's backward comes first, and when another
    unit's backward opens, the first call's is still to come. The open unit is suspended
    (what it wrote recorded) and opens afresh; a running unit never gives its slot up."""
    life = UnitLifecycle([[True, True], [True, True]])
    first, second = UseToken(), UseToken()
    life.use(1, first)
    assert not life.may_give_up(1, prefetch=False)  # running
    life.forward_issued(1)
    life.use(1, second)
    life.forward_issued(1)
    life.open(1)
    life.write(1, 0)
    life.use_done(1, second)
    assert life.may_give_up(1, prefetch=False) and not life.may_give_up(1, prefetch=True)
    assert not life.may_close(1)
    life.suspend(1, life.written[1])  # its slot taken: what it wrote is recorded
    assert 1 in life.suspended and life.written[1] == [False, False]
    assert list(life.had_grad) == [0, 0, 1, 0]
    life.open(1)  # the first call's backward gathers it again
    assert 1 not in life.suspended
    life.write(1, 1)
    life.use_done(1, first)
    assert life.may_close(1)
    life.close(1, life.written[1])
    assert list(life.had_grad) == [0, 0, 1, 1]


def test_a_discarded_forward_is_not_waited_for():
    """Tokens are held weakly: a forward whose graph is gone leaves nothing pending."""
    life = UnitLifecycle([[True]])
    kept, dropped = UseToken(), UseToken()
    life.use(0, kept)
    life.use(0, dropped)
    del dropped
    gc.collect()
    life.open(0)
    life.use_done(0, kept)
    assert life.may_close(0)


def test_a_blind_use_or_a_recompute_closes_only_from_outside():
    life = UnitLifecycle([[True], [True]])
    life.use(0, BLIND)  # no input needs a gradient: its backward's end is not seen
    life.open(0)
    assert not life.may_close(0)
    life.open(1)  # opened with no forward in this pass (a reentrant recompute)
    assert not life.may_close(1)


def test_gradients_present_are_those_written_and_trained():
    life = UnitLifecycle([[True, False, True], [True]])
    life.use(0, None)
    life.open(0)
    assert life.write(0, 2) and not life.write(0, 2)  # the second is not the first
    life.close(0, life.written[0])
    life.open(1)
    life.close(1, None)  # a front end that writes every gradient
    assert life.end_step().tolist() == [0, 0, 1, 1]
    assert life.end_step().tolist() == [0, 0, 0, 0]  # cleared for the next step


def test_release_forgets_a_forward_with_no_backward():
    life = UnitLifecycle([[True], [True]])
    life.use(0, None)
    life.use(1, None)
    life.forget_forward()
    assert life.state == [State.IDLE, State.IDLE] and not life.running


def test_a_pass_begins_at_a_use_or_an_open_and_ends_with_the_pass():
    """``in_pass`` and ``in_backward``: what a front end's hooks read to begin a pass and
    to queue the end of a backward, without keeping a flag of their own."""
    life = UnitLifecycle([[True], [True]])
    assert not life.in_pass and not life.in_backward
    life.use(0, None)
    assert life.in_pass and not life.in_backward
    life.forget_forward()  # a forward with no backward ends its pass
    assert not life.in_pass
    life.open(1)  # a backward with no forward in this pass (after a release)
    assert life.in_pass and life.in_backward
    life.close(1, None)
    life.end_pass()
    assert not life.in_pass and not life.in_backward


def test_a_unit_of_several_modules_ends_its_forward_with_the_last():
    life = UnitLifecycle([[True]])
    assert life.forward_done(0, 1)  # one module: every forward ends the unit's
    assert not life.forward_done(0, 3) and not life.forward_done(0, 3)
    assert life.forward_done(0, 3)
    assert not life.forward_done(0, 3)  # the next use counts afresh
    life.end_pass()  # a pass cut short forgets the modules counted
    assert not life.forward_done(0, 2) and life.forward_done(0, 2)


def test_the_trainable_flags_are_the_callers():
    """The lifecycle keeps the runtime's flags, not a copy (one home)."""
    flags = [[True, False]]
    assert UnitLifecycle(flags).trainable is flags


class _Table:
    """A SlotTable over 4 units and 2 slots, recording gathers and releases."""

    def __init__(self, busy: set) -> None:
        self.busy, self.log = busy, []
        self.slots = SlotTable(4, 2, False, self.gather, lambda u, prefetch: u not in self.busy,
                               lambda u: self.log.append(("release", u)),
                               lambda u: f"unit {u} (layer{u}.w, ...)")

    def gather(self, i: int, k: int) -> str:
        self.log.append(("gather", i, k))
        return f"work {i}"


def test_a_unit_not_in_use_gives_its_slot_up():
    t = _Table(busy=set())
    t.slots.ensure(0)
    t.slots.ensure(2)  # unit 2 shares slot 0 with unit 0, which is idle
    assert t.log == [("gather", 0, 0), ("release", 0), ("gather", 2, 0)]
    assert t.slots.units() == [2]


def test_a_prefetch_waits_for_a_slot_in_use_and_a_demand_fails_on_every_rank_alike():
    t = _Table(busy={0})
    t.slots.ensure(0)
    t.slots.ensure(2, prefetch=True)  # unit 0 is running: deferred, issued when its
    t.slots.ensure(2, prefetch=True)  # slot is released (once)
    assert t.slots.waiting() == [2]
    with pytest.raises(TideInvalid, match=r"unit 2 \(layer2\.w.*unit 0 \(layer0\.w.*"
                                          r"num_slots=4"):
        t.slots.ensure(2)
    t.busy.clear()
    t.slots.release(0)
    assert t.log[-2:] == [("release", 0), ("gather", 2, 0)] and not t.slots.waiting()


def test_ending_a_pass_issues_no_deferred_prefetch():
    """A forward with no backward ends (``Runtime.release``, before an optimizer step)
    while a prefetch waits for a slot: the table forgets it before the slots are given
    up, so no gather issued then outlives the step with parameters from before it (giving
    the slots up first issued it: unit 2 stayed gathered, and the next forward used it)."""
    t = _Table(busy={0})
    t.slots.ensure(0)
    t.slots.ensure(2, prefetch=True)  # unit 0 is running: deferred
    t.busy.clear()  # the forward is over
    t.slots.clear()
    assert t.log == [("gather", 0, 0), ("release", 0)]
    assert t.slots.units() == [] and t.slots.waiting() == []


def test_the_slot_rule_has_one_home():
    """The slot table and the comms' buffers both follow ``slot_of`` ([Note: slots])."""
    assert slot_units(5, 2, False) == [[0, 2, 4], [1, 3]]
    assert slot_units(5, 2, True) == [[2, 4], [1, 3], [0]]  # the root's own slot last
    t = _Table(busy=set())
    assert [t.slots.slot(i) for i in range(4)] == [slot_of(i, 2, False) for i in range(4)]


def test_front_end_options_come_one_way():
    """``Runtime(front_end=FrontEnd(...))``, or its fields as keywords (the spelling of
    earlier versions), never both; a bad ``accumulate`` is refused either way."""
    release = print
    assert FrontEnd.of(None, True, release, "sum") == FrontEnd(True, release, "sum")
    given = FrontEnd(report_grads=True)
    assert FrontEnd.of(given, False, None, "mean") is given
    with pytest.raises(TideInvalid, match="front_end: expected it or report_grads"):
        FrontEnd.of(given, False, None, "sum")
    with pytest.raises(TideInvalid, match="accumulate: expected 'mean' or 'sum', got 'avg'"):
        FrontEnd(accumulate="avg")
    with pytest.raises(TideInvalid, match="front_end: expected a FrontEnd, got dict"):
        FrontEnd.of({}, False, None, "mean")


class _Host:
    """The group and the comm a GradAccumulator asks: NumPy, and reductions that write
    ones at once (a Work whose wait does nothing)."""

    xp = np

    def __init__(self) -> None:
        self.backend = self

    def on_stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reduce(self, unit: int, k: int, out, stream):
        out += 1
        return self

    def wait(self, stream) -> None:
        pass


def test_a_units_first_reduction_in_a_step_writes_its_shard_and_later_ones_add():
    """A unit reduced twice in one pass (paused, then resumed) adds its second reduction,
    as a later micro-batch does; a unit not forwarded is zeroed only where nothing wrote
    its shard yet."""
    arena = ShardArena(arena_layout([[(4,)], [(4,)]], 1), np, np.float32, send=False)
    arena.grad[...] = 7  # the last step's

    class Writer(_Host):  # a reduction writes ones into the unit's block of ``out``
        def reduce(self, unit: int, k: int, out, stream):
            arena.block(out, unit)[...] = 1
            return self

    host = Writer()
    acc = GradAccumulator(host, 1, arena, host, mean=False)
    acc.reduce(0, 0, None)
    acc.retire(0, None)
    acc.reduce(0, 1, None)
    acc.retire(1, None)
    acc.no_backward(1, None)
    acc.end_pass()
    acc.no_backward(0, None)  # a later pass that did not forward it adds nothing
    acc.no_backward(1, None)
    g0, g1 = (arena.block(arena.grad, u) for u in (0, 1))
    assert (g0 == 2).all() and (g1 == 0).all()
    acc.end_step()
    acc.reduce(0, 0, None)  # the next step writes again
    acc.retire(0, None)
    assert (arena.block(arena.grad, 0) == 1).all()


def test_the_accumulator_alone_counts_micro_batches_and_holds_the_clip():
    """Later micro-batches reduce into scratch, added at retire; ``end_step`` is the one
    reset of the count (and of a held clip); a held clip is refused after a backward."""
    host = _Host()
    arena = ShardArena(arena_layout([[(4,)]], 1), np, np.float32, send=False)
    acc = GradAccumulator(host, 1, arena, host, mean=True)
    for _ in range(2):
        acc.reduce(0, 0, None)
        acc.retire(0, None)
        acc.end_pass()
    assert acc.micro_batches == 2 and (arena.grad == 2).all()
    scale = acc.finalize(None, None, False, None, (0, 0, 0))
    assert scale == GradScale(0.5)
    acc.hold(scale)
    assert acc.take_held(in_backward=False) == scale and acc.take_held(False) is None
    acc.hold(scale)
    acc.end_pass()  # a backward after the clip: its norm is stale
    with pytest.raises(TideInvalid, match="no backward between clip_grad_norm_ and the step"):
        acc.take_held(in_backward=False)
    acc.hold(scale)
    acc.end_step()
    assert acc.micro_batches == 0 and acc.take_held(False) is None
    with pytest.raises(TideInvalid, match="expected a backward since the last step"):
        acc.finalize(None, None, False, None, (0, 0, 0))
