"""``Runtime``: the FSDP runtime over a list of units.

It knows nothing of autograd. A front end calls four hooks per unit, at the
points where FSDP2 hooks in, and :meth:`Runtime.step` once per step::

    for i in range(n):                      # forward
        params = model.pre_forward(i)       # gathered (prefetch of i+1.. issued)
        x = forward(i, params, x)
        model.post_forward(i)               # slot free for the next gather
    for i in reversed(range(n)):            # backward
        params, grads = model.pre_backward(i)
        dx = backward(i, params, dx, grads) # writes the unit's gradients into grads
        model.post_backward(i)              # reduce-scatter starts; slot reused as staging
    model.step()                            # fused AdamW on the shards

[Note: runtime parts]
``Runtime`` coordinates: it holds what describes the model (names, shapes,
trainable flags, the root), where to issue (``stream``, which the torch front
end points at torch's current stream) and a :class:`FrontEnd`'s options (those
only a front end sets). The state of a step lives in the parts it owns, each
changed only through its own methods:

* ``slots``, a ``SlotTable`` (``_slots``): which unit holds which slot, its
  gather's work, the prefetches deferred for a slot. The slot rule itself is
  ``_slots.slot_of``, which the comms' buffers follow too ([Note: slots]).
* ``life``, a ``UnitLifecycle`` (``_lifecycle``): where each unit is in the
  pass, the uses pending, the gradients written, and per parameter whether it
  had a gradient in this step (``end_step`` hands that over and clears it).
  The torch hooks read it (``runtime.life``) and change it through the runtime.
* ``accum``, a ``GradAccumulator`` (``_accum``): the reductions in flight, one
  per gradient buffer, the scratch arena, the micro-batch count, the clip
  ``clip_grad_norm_`` holds for the step, the scale of the step a capture
  holds, and the global norm. It alone counts micro-batches: one more at its
  ``end_pass`` (the runtime's end of each backward pass), back to 0 at its
  ``end_step``, which the runtime calls after ``step`` and ``apply_step`` and
  from ``zero_grad``.
* ``optimizer``, a ``FusedAdamW`` (``_optim``): the moments and the step
  counts. It alone counts steps ([Note: step counts] in ``_optim``): an eager
  step, and each replay's ``stage_step``; a step issued inside a capture
  counts none, so ``CapturedStep`` leaves the count alone.
* ``comm`` (a ``UnitComm``) and ``arena`` (a ``ShardArena``): the buffers and
  what moves them; the runtime and its parts call them.

[Note: passes]
Real training loops do not always pair a forward with a backward, run each
unit once, nor give every parameter a gradient. Where each unit is in the
current pass is one state machine, ``UnitLifecycle`` ([Note: unit lifecycle]
in ``_lifecycle``); the runtime acts on its transitions:

* a ``pre_forward`` in the forward phase is one more use of its unit (gathered
  again if its slot was taken); one in the backward phase ends the pass;
* ``release`` ends a forward that has no backward (an evaluation, a discarded
  forward): its gathered units are released and nothing of it is reduced;
* a backward pass ends (and its micro-batch counts) at :meth:`finish_backward`,
  which the torch front end calls from autograd's end-of-backward callback and
  which the next pass's first ``pre_forward`` and ``step`` call otherwise. It
  closes the units still open (``report_grads``) and reduces zeros for every
  unit with trainable parameters not reduced yet: forwarded units whose
  backward never began (gathered, then reduced), and units not forwarded at
  all (no collective: a sum of zeros is zero on every rank);
* a unit is reduced at its ``post_backward`` (and where it is suspended), in the
  order the hooks run, which every rank must share (a rank that runs another unit
  at a step's first collective is named on every rank by its agreement, later ones
  under ``TIDE_DEBUG``); ``finish_backward`` reduces the rest in descending order.

With ``root=True`` unit 0 is the root, as FSDP2's (embedding, final norm, head,
a weight tied between them): a slot of its own, gathered from its
``pre_forward`` until its ``post_backward``, which comes last.

[Note: gradient buffers] is in ``_accum``: which buffer a unit's backward writes, and
when the compute stream waits for its reduction.
Streams: [Note: comm streams] in ``_comm``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from .. import _dtypes
from .._adamw import AdamW
from .._errors import TideInvalid
from .._group import Group, default_group
from . import _checkpoint
from ._accum import GradAccumulator
from ._comm import UnitComm, comm_factory
from ._lifecycle import State, UnitLifecycle, UseToken
from ._norm import GlobalNorm, GradScale, check_max_norm, clip_limit
from ._options import FrontEnd, agree_settings, agree_step, slot_count
from ._shards import Init, ShardArena, arena_adamw, arena_layout, describe_units, trainable_flags
from ._slots import SlotTable


class UnitArrays(NamedTuple):
    """What :meth:`Runtime.pre_backward` gives: the unit's arrays for its backward."""

    #: Its gathered parameters (views of its slot).
    params: list
    #: The gradient arrays its backward writes (views of its gradient buffer).
    grads: list


class Runtime:
    """A model's units, sharded over the group, with their optimizer. Collective.

    Args:
        units: per FSDP unit, ``(name, value)`` pairs: ``value`` is the full
            parameter (any array; the same on every rank) or, with ``init``, its
            shape. Names must be unique.
        init: ``init(name, shape)`` returns a full parameter (any array), called
            one parameter at a time so that only one full parameter exists at once.
        group: the group (default: the last ``init``).
        param_dtype: dtype of the gathered parameters and of the gradients
            (bf16 default; fp32 masters are kept either way).
        optimizer: AdamW hyper-parameters (defaults of :class:`AdamW`).
        max_grad_norm: clip the averaged gradient to this global L2 norm at every
            :meth:`step` (> 0), as ``torch.nn.utils.clip_grad_norm_``; None (default):
            ``optimizer.max_grad_norm``, where that is None too no clipping (see
            [Note: clipping] in ``_norm``).
        prefetch: units gathered ahead of the one running (1).
        num_slots: slots (and gradient buffers); ``prefetch + 1`` if None (more
            only spread the gathers further apart; see [Note: slots]).
        comm: ``"tide"`` (default), or a comm factory: a
            :class:`~tidearray.fsdp.UnitComm` subclass, called as
            ``comm(group, shapes, dtype, arena, num_slots, root)``, whose
            ``sharded_over(group)`` and ``send_shards`` size the shard arena
            (see ``UnitComm``). The benchmarks' baselines are such factories
            (``benchmarks.baselines.StockComm``, FSDP2's flat path, and
            ``LocalComm``, the no-communication floor).
        keep_param_shards: ``tide`` only: keep a param-dtype copy of this
            rank's shards, written by the optimizer, and gather from it, instead
            of casting the masters into the slot at every gather. Costs
            ``param_dtype.itemsize`` bytes per sharded parameter; saves the cast
            kernels (one per gather) beside the compute, and at one rank copies too
            ([Note: one rank's gathers]). A factory's ``send_shards`` says whether it keeps them.
        stream: the compute stream (cuda; CuPy's current stream if None).
        root: unit 0 is the root unit (its own slot; gathered from its
            ``pre_forward`` to its ``post_backward``; see [Note: passes]).
        trainable: per unit, per parameter, whether it is trained (all True if
            None). A unit with none is never reduced; the others reduce every
            parameter (a frozen one's gradient as zeros: zeroed when its backward
            opens, or by a ``fill_grads`` front end, so a frozen gradient left
            unwritten counts nothing in the norm) and the optimizer leaves frozen
            parameters bitwise unchanged.
        param_groups: ``(hyper-parameters, parameter names)`` pairs: those
            parameters step with those AdamW settings (say, no weight decay on
            norms and biases); the others with ``optimizer``. Frozen parameters
            are never stepped.
        report_grads, on_release, accumulate: :class:`FrontEnd`'s fields, given one by
            one (where ``front_end`` is None).
        front_end: the options only a front end sets (:class:`FrontEnd`; its defaults
            if None).

    Raises:
        TideInvalid: on every rank, for bad units, dtype or settings.
    """

    def __init__(self, units: Sequence[Sequence[tuple[str, Any]]], *,
                 init: Optional[Init] = None, group: Optional[Group] = None,
                 param_dtype: Any = _dtypes.bfloat16, optimizer: Optional[AdamW] = None,
                 max_grad_norm: Optional[float] = None,
                 prefetch: int = 1, comm: Any = "tide", stream: Any = None,
                 num_slots: Optional[int] = None, keep_param_shards: bool = False,
                 root: bool = False,
                 trainable: Optional[Sequence[Sequence[bool]]] = None,
                 param_groups: Sequence[tuple[AdamW, Sequence[str]]] = (),
                 report_grads: bool = False,
                 on_release: Optional[Callable[[int], None]] = None,
                 accumulate: str = "mean", front_end: Optional[FrontEnd] = None) -> None:
        group = group or default_group()
        described = describe_units(units, init)
        self.front_end = FrontEnd.of(front_end, report_grads, on_release, accumulate)
        self.num_slots, self.prefetch = slot_count(prefetch, num_slots), prefetch
        factory = comm_factory(comm)
        self.group, self.kind, self.stream = group, factory.name, stream
        self.names, self.shapes = described.names, described.shapes
        self.root = bool(root)
        self.trainable = trainable_flags(trainable, self.shapes)
        self.param_dtype = _dtypes.normalize(param_dtype)
        agree_settings(group, dict(
            units=self.names, trainable=self.trainable, param_dtype=self.param_dtype.name,
            optimizer=optimizer, max_grad_norm=max_grad_norm, param_groups=param_groups,
            prefetch=prefetch, num_slots=self.num_slots, comm=factory.name, root=self.root,
            keep_param_shards=keep_param_shards, accumulate=self.front_end.accumulate))
        self.xp = group.backend.xp
        self.world = factory.sharded_over(group)
        self.rank = group.rank if self.world > 1 else 0
        # Unless asked to keep them, tide's gathers cast the masters into the slots.
        self.arena = ShardArena(arena_layout(self.shapes, self.world), self.xp, self.param_dtype,
                                send=factory.send_shards or keep_param_shards)
        self.arena.fill_masters(described.values, init, self.rank)
        hp = optimizer or AdamW()
        self.optimizer = arena_adamw(hp, self.arena, self.names, param_groups)
        self.max_grad_norm = clip_limit(max_grad_norm, hp.max_grad_norm)
        self.comm: UnitComm = factory(group, self.shapes, self.param_dtype, self.arena,
                                      self.num_slots, self.root)
        self.life = UnitLifecycle(self.trainable)  # [Note: passes]
        self.slots = SlotTable(self.num_units, self.num_slots, self.root, self._gather,
                               self.life.may_give_up, self._released, self.describe)
        self.accum = GradAccumulator(group, self.world, self.arena, self.comm,
                                     mean=self.front_end.accumulate == "mean")
        self._to_reduce = {i for i, t in enumerate(self.trainable) if any(t)}
        #: Units whose buffer is zeroed when their backward opens: what is left unwritten
        #: (a reporting front end's, or a frozen parameter's) reduces as zeros.
        self._zero_on_open = {i for i, t in enumerate(self.trainable)
                              if self.front_end.fill_grads is None
                              and (self.report_grads or (any(t) and not all(t)))}
        # The arena's zeros and masters went on the current stream, which the model's
        # stream need not wait for ([Note: initialized memory] in backends.cuda.streams).
        group.synchronize()

    @property
    def num_units(self) -> int:
        return len(self.shapes)

    @property
    def report_grads(self) -> bool:
        """Whether the front end reports the gradients it writes (:class:`FrontEnd`)."""
        return self.front_end.report_grads

    # -- the four hooks ---------------------------------------------------------

    def pre_forward(self, i: int, use: Any = None) -> list:
        """Unit ``i``'s full parameters (waited on the compute stream); prefetches
        the next ``prefetch`` units. In the forward phase, one more use of the unit;
        in the backward phase, the start of a new pass ([Note: passes]).

        Args:
            use: a :class:`UseToken` whose backward the front end reports
                (:meth:`use_done`), :data:`~._lifecycle.BLIND` for a use whose backward it cannot
                see, or None (a front end that calls ``post_backward`` itself, or a
                forward with grad disabled); see [Note: unit lifecycle].
        """
        life, slots = self.life, self.slots
        if life.in_backward:
            self.finish_backward()
        life.use(i, use)
        work = slots.ensure(i)
        for j in range(i + 1, min(i + 1 + self.prefetch, slots.num_units)):
            slots.ensure(j, prefetch=True)
        return work.wait(self.stream)

    def post_forward(self, i: int) -> None:
        """Unit ``i``'s forward is issued: its slot may take another gather.
        The last unit keeps its parameters for its backward, which comes next,
        and so does the root (see [Note: passes])."""
        self.life.forward_issued(i)
        if i != self.slots.num_units - 1 and not (self.root and i == 0) and self.slots.holds(i):
            self.slots.release(i)

    def release(self) -> None:
        """End a forward that has no backward (evaluation, generation, a discarded
        forward): release every gathered unit and drop deferred prefetches.

        Not collective and never needed for correctness (units are gathered again
        where needed), but it frees the slots at once.
        """
        self.slots.clear(self.stream, wait=True)  # a later gather waits on this stream
        if not self.life.in_backward:
            self.life.forget_forward()

    def pre_backward(self, i: int) -> UnitArrays:
        """Open unit ``i``'s backward: its parameters and the gradient arrays its backward
        must write (the same ones again while it is open)."""
        return UnitArrays(self.open_backward(i), self.comm.grads(i, self.slots.unit_slots[i]))

    def open_backward(self, i: int) -> list:
        """:meth:`pre_backward`'s parameters alone (a ``fill_grads`` front end needs no
        gradient arrays)."""
        life, slots = self.life, self.slots
        if life.state[i] is State.DONE:
            raise TideInvalid(f"unit {i}: expected one backward per unit per pass, got a "
                              "second one after its gradients were reduced")
        if life.is_open(i):  # (a suspended one opens afresh)
            return slots.ensure(i).wait(self.stream)  # gathered since it opened
        life.open(i)
        work = slots.ensure(i)
        for j in range(i - 1, max(i - 1 - self.prefetch, -1), -1):
            slots.ensure(j, prefetch=True)
        k = slots.unit_slots[i]
        self.accum.retire(k, self.stream)  # [Note: gradient buffers]
        if i in self._zero_on_open:  # what the backward does not write reduces as zeros
            self.comm.zero_grads(i, k, self.stream)
        return work.wait(self.stream)

    def grad_written(self, i: int, k: int) -> bool:
        """(``report_grads``) Parameter ``k`` of open unit ``i`` got its gradient;
        whether it is the first in this pass (a later one adds to it)."""
        return self.life.write(i, k)

    def use_done(self, i: int, use: UseToken) -> None:
        """(``report_grads``) The backward of one use of unit ``i`` is done: close the unit
        if no other use is pending, after the open units above it that wait for none, in
        descending order ([Note: unit lifecycle], order: a blind one is suspended)."""
        life = self.life
        if not life.use_done(i, use):
            return
        for j in life.closable_above(i):
            if not life.blind(j):
                self.post_backward(j)
            elif self.slots.holds(j) and j not in life.suspended:
                self.slots.release(j)  # (which suspends it: _released)
        self.post_backward(i)

    def post_backward(self, i: int) -> None:
        """Unit ``i``'s gradients are written (issued): reduce them into the fp32 shards
        (the step's first reduction of the unit writes them, later ones add: ``_accum``)."""
        if self.life.state[i] is not State.BACKWARD:
            raise TideInvalid(f"unit {i}: expected post_backward after its pre_backward, once "
                              f"per pass, got it in state {self.life.state[i].value}")
        self._close(i, self._written(i, self.slots.unit_slots[i]))

    def _written(self, i: int, k: int) -> Optional[list[bool]]:
        """Which gradients unit ``i``'s buffer (slot ``k``; ``i`` in BACKWARD) holds before it
        is reduced (None: all); a ``fill_grads`` front end writes them now (suspended: none)."""
        fill = self.front_end.fill_grads
        if fill is None:
            return self.life.written[i] if self.report_grads else None
        if i in self.life.suspended or i not in self._to_reduce:
            return [False] * len(self.names[i])
        return fill(i, self.comm.grads(i, k))

    def _close(self, i: int, written: Optional[list[bool]]) -> None:
        """Reduce open unit ``i``, its buffer ``written`` (None: all; zeros elsewhere)."""
        # (suspended: reduced when it lost its slot; its buffer another's, even if regathered)
        fresh = i not in self.life.suspended
        self.life.close(i, written)
        if self.slots.holds(i):
            if fresh and i in self._to_reduce:
                self.accum.reduce(i, self.slots.unit_slots[i], self.stream)
            self.slots.release(i)

    def finish_backward(self) -> None:
        """Complete this backward pass ([Note: passes]): with ``report_grads`` the open
        units close; then every unit with trainable parameters not yet reduced reduces
        zeros, in descending order. Collective (every rank must reach it at the same
        point: the torch front end calls it from the callback autograd runs at the end
        of each backward).
        """
        life = self.life
        if not life.in_backward:
            return  # no backward began: nothing to finish (a forward-only pass)
        opened = life.units_in(State.BACKWARD)
        if opened and not self.report_grads:
            raise TideInvalid(f"units {opened}: expected post_backward for every unit whose "
                              "pre_backward ran, before finish_backward")
        for i in sorted(opened, reverse=True):
            self.post_backward(i)
        for i in sorted(self._to_reduce, reverse=True):
            if life.state[i] is State.FORWARD:  # its backward never began: reduce zeros
                self.pre_backward(i)
                k, fill = self.slots.unit_slots[i], self.front_end.fill_grads is not None
                if not fill and i not in self._zero_on_open:
                    self.comm.zero_grads(i, k, self.stream)
                self._close(i, self._written(i, k) if fill else [False] * len(self.names[i]))
            elif life.state[i] is State.IDLE:
                self.accum.no_backward(i, self.stream)  # not forwarded: no collective
        self._end_pass()

    def _end_pass(self) -> None:
        """Count the micro-batch; release what the pass gathered."""
        self.accum.end_pass()
        self.life.end_pass()
        self.slots.clear()  # a backward's prefetches end with it

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass has begun and is not complete."""
        return self.life.in_backward

    def state(self, i: int) -> State:
        """Unit ``i``'s place in the current pass ([Note: unit lifecycle])."""
        return self.life.state[i]

    def last_used(self) -> int:
        """The highest unit used in this pass's forward phase (-1: none)."""
        return self.life.last_used

    # -- the step -----------------------------------------------------------------

    def step(self, lr: Optional[float] = None) -> Any:
        """Average the accumulated gradients and run the fused AdamW on every shard.

        Args:
            lr: this step's learning rate (the optimizer's ``lr`` if None).

        Returns:
            The global gradient norm when clipping is on (:attr:`max_grad_norm`, or
            :meth:`clip_grad_norm_` before the step: a float, which syncs the host, or a
            device array inside a capture), else None.

        Raises:
            TideInvalid: no backward since the last step, or one after
                :meth:`clip_grad_norm_`; ``lr`` not the same on every rank.
        """
        scale = self._step_scale()
        present = agree_step(self.group, lr, self.life.had_grad)
        if self._capturing():
            self.accum.captured(scale)  # what each replay stages (captured_scale)
        self.optimizer.step(self.arena.grad, grad_scale=scale.factor, lr=lr,
                            stream=self.stream, present=present)
        self.life.end_step()  # after the step: a refused one keeps what it would have read
        self.accum.end_step()
        return scale.norm

    def finalize_grads(self, max_norm: Optional[float] = None) -> GradScale:
        """End the backward pass, wait for every reduction (on the stream) and release the
        gathered units; the gradient shards are then the sums over ranks and micro-batches.
        With ``max_norm``, clip (collective; [Note: clipping] in ``_norm``).

        Returns:
            What turns the shards into the averaged (and clipped) gradient: its
            ``factor``, the global ``norm`` (None without ``max_norm``), and whether the
            device applies the clip (``on_device``: inside a stream capture, for the
            fused AdamW's step only).

        Raises:
            TideInvalid: no backward since the last step; ``max_norm`` not a real > 0
                (inf: the norm, no clip); inside a capture, a clip before
                :meth:`prepare_capture`.
        """
        if max_norm is not None:
            check_max_norm(max_norm, inf=True)
        self.finish_backward()
        self.accum.retire_all(self.stream)
        self.release()  # parameters gathered now would be stale after the step
        opt = self.optimizer
        return self.accum.finalize(max_norm, self.stream,
                                   max_norm is not None and self._capturing(),
                                   opt.coeff_dev, opt.table_layout)

    def apply_step(self, step: Callable[[np.ndarray], None], lr: Any = None) -> None:
        """Step with another optimizer: the gradient shards finalized (:meth:`finalize_grads`,
        clipped as :meth:`step` clips) and scaled to the averaged gradient in place, then
        ``step(present)``, which updates :meth:`params` (the fp32 masters) from
        :meth:`grads`, skipping the parameters whose ``present`` is False (no rank gave
        them a gradient, or frozen; units in order, flattened); then the send shards.
        ``lr`` (the optimizer's learning rates, or anything every rank must share) is
        agreed across the ranks first, as :meth:`step`'s.

        Raises:
            TideInvalid: as :meth:`step`; inside a capture, a clip.
        """
        scale = self._step_scale()
        if scale.on_device:
            raise TideInvalid("a clip inside a stream capture reaches the fused AdamW "
                              "(step()) only, got another optimizer's step")
        present = agree_step(self.group, lr, self.life.had_grad)
        with self._on_stream():
            self.arena.grad *= np.float32(scale.factor)
        step(present)
        self.life.end_step()
        with self._on_stream():  # before the next gather, which reads them
            self.arena.refresh_send()
        self.accum.end_step()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step, as torch's ``zero_grad()``
        drops them: the next backward starts the step afresh (its first micro-batch
        reduces straight into the gradient shards; no parameter counts as having had a
        gradient). A backward whose last ``post_backward`` ran is finished first, as
        :meth:`step` finishes it (collective then: every rank calls it at the same
        point); then it waits for the reductions in flight.

        Raises:
            TideInvalid: inside a backward pass (a unit's ``post_backward`` still due).
        """
        opened = self.life.units_in(State.BACKWARD)
        if opened:
            raise TideInvalid(f"zero_grad: expected no backward in progress, got units "
                              f"{opened} between pre_backward and post_backward")
        self.finish_backward()
        self.accum.retire_all(self.stream)
        self.accum.end_step()  # a clip_grad_norm_ since the last step was of what is dropped
        self.life.end_step()

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip the averaged gradient to the global L2 norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does, at the next :meth:`step` (which then
        applies no :attr:`max_grad_norm`). Call it after the step's last backward.

        Collective: the ranks' sums of squares are all-gathered ([Note: global norm] in
        ``_norm``), and the host reads the norm back (a sync). Inside a stream capture
        (a captured step, ``CapturedStep``) nothing is read back: the clip factor is
        computed on the device, for the fused AdamW's :meth:`step` only.

        Returns:
            The global norm of the averaged gradient, before clipping: a float, or,
            inside a capture, a 0-d float64 device array that each replay overwrites.

        Raises:
            TideInvalid: ``max_norm`` is not a real > 0 (``inf``, as in torch: the norm,
                unclipped); inside a capture, before :meth:`prepare_capture`.
        """
        scale = self.finalize_grads(max_norm)
        self.accum.hold(scale)
        return scale.norm

    def _step_scale(self) -> GradScale:
        """This step's finalized gradients, finalized once: :meth:`clip_grad_norm_`'s where
        it ran (a forward since only gathered parameters, released here), else
        :meth:`finalize_grads` with :attr:`max_grad_norm`."""
        scale = self.accum.take_held(self.life.in_backward)
        if scale is None:
            return self.finalize_grads(self.max_grad_norm)
        self.release()  # parameters gathered now would be stale after the step
        return scale

    def global_norm(self) -> GlobalNorm:
        """What computes the gradient's global norm, made at its first use (collective:
        every rank makes it at the same call)."""
        return self.accum.global_norm()

    def prepare_capture(self) -> None:
        """Make, outside a capture, what a captured step reads (collective): the
        optimizer's device table of coefficients and the global norm's plan and kernels.
        A capture's :meth:`captured_scale` starts here."""
        self.optimizer.prepare_capture()
        self.global_norm()
        self.accum.begin_capture()

    def captured_scale(self) -> GradScale:
        """The gradient scale of the :meth:`step` captured since :meth:`prepare_capture`:
        each replay stages its ``factor`` ([Note: captured steps] in ``_graph``).

        Raises:
            TideInvalid: no step was captured since.
        """
        return self.accum.captured_scale()

    def _capturing(self) -> bool:
        """Whether the stream the runtime issues on is capturing (cuda only)."""
        with self._on_stream():
            return self.group.backend.capturing()

    def _on_stream(self) -> Any:
        """A context in which the array module issues on the compute stream."""
        return self.group.backend.on_stream(self.stream)

    # -- what the slots ask ----------------------------------------------------------

    def describe(self, i: int) -> str:
        """Unit ``i`` in words, for errors: its index and its first parameter's name."""
        return f"unit {i} ({self.names[i][0]}, ...)"

    def _gather(self, i: int, k: int) -> Any:
        return self.comm.gather(i, k, self.stream)

    def _released(self, u: int) -> None:
        life = self.life
        if life.state[u] is State.BACKWARD and life.is_open(u):  # (most are not: no call)
            k = self.slots.unit_slots[u]
            life.suspend(u, self._written(u, k))
            if u in self._to_reduce:
                self.accum.reduce(u, k, self.stream)
        if self.front_end.on_release is not None:
            self.front_end.on_release(u)

    # -- state --------------------------------------------------------------------

    def params(self, unit: int) -> list:
        """This rank's fp32 master shards of ``unit`` (padded views into the arena)."""
        return self.arena.views(self.arena.master, unit)

    def grads(self, unit: int) -> list:
        """This rank's fp32 gradient shards of ``unit`` (padded views into the arena)."""
        return self.arena.views(self.arena.grad, unit)

    def gathered(self, unit: int) -> bool:
        """Whether ``unit`` holds a slot now (gathered, or its gather issued)."""
        return self.slots.holds(unit)

    def synchronize(self) -> None:
        """Wait for every outstanding gather, reduction and optimizer step (host)."""
        self.accum.retire_all(self.stream)
        self.group.synchronize()  # the group's device, not whichever is current

    def close(self) -> None:
        """Release communicators (collective). Slots go with the group."""
        self.comm.close()

    def save(self, path: str) -> None:
        """Save the sharded state; see :func:`tidearray.fsdp.save`."""
        _checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Load a sharded state saved at the same world size; see :func:`tidearray.fsdp.load`."""
        _checkpoint.load(self, path)

    def export(self, path: str) -> None:
        """Write the gathered fp32 model to one ``.npz`` (rank 0 writes; collective)."""
        _checkpoint.export(self, path)

    def full_param(self, unit: int, k: int, root: Optional[int] = None) -> Optional[np.ndarray]:
        """Parameter ``k`` of ``unit`` gathered in full from the fp32 masters, as a NumPy
        array: on every rank, or with ``root`` on that rank only (None elsewhere).
        Collective; waits for the optimizer first. See ``_checkpoint.full_param``."""
        self.synchronize()
        return _checkpoint.full_param(self, unit, k, root)
