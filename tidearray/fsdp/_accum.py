"""The step's gradient: the reductions into the gradient shards, the micro-batches they
add up, and the scale (average and clip) the step applies.

[Note: gradient buffers]
Unit ``i`` in slot ``k`` writes its gradients into gradient buffer ``k``
(``num_slots`` of them, each as big as the largest unit). The reduction of
buffer ``k`` reads it on tidearray's lanes while compute goes on; before
buffer ``k`` is handed to another backward, the compute stream waits for that
reduction (:meth:`GradAccumulator.retire`). So at most ``num_slots`` units'
gradients exist at once and nothing blocks the host.

A unit's first reduction in a step writes straight into its gradient shard
(``arena.grad``); later ones (later micro-batches, or a unit suspended and
opened again in one pass: [Note: unit lifecycle]) reduce into a scratch arena
like it, which is added into the shard when the reduction is retired; a
unit not forwarded in the step's first pass has its shard zeroed, and so
counts as written. A pass counts as a
micro-batch when it ends (:meth:`GradAccumulator.end_pass`), and the count
goes back to 0 in one place, :meth:`GradAccumulator.end_step`, which the
runtime calls when a step has used the gradients or ``zero_grad`` dropped
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from .._errors import TideInvalid
from ._norm import GlobalNorm, GradScale

if TYPE_CHECKING:
    from .._group import Group
    from ._comm import UnitComm
    from ._shards import ShardArena


class Reduction(NamedTuple):
    """A unit's reduction in flight out of a gradient buffer."""

    #: The comm's Work; its ``wait`` orders a stream after the reduction.
    work: Any
    #: The unit reduced.
    unit: int
    #: Whether it reduced into the scratch arena (a later micro-batch), to be added.
    into_scratch: bool


class HeldClip(NamedTuple):
    """The finalized gradients ``clip_grad_norm_`` keeps for the next step."""

    #: The micro-batches they cover: a backward since makes them stale.
    micro_batches: int
    scale: GradScale


class GradAccumulator:
    """The gradient shards between two steps ([Note: gradient buffers]; [Note: clipping] in
    ``_norm``): the reductions in flight (one per gradient buffer), the scratch arena of
    later micro-batches, the micro-batch count, the clip ``clip_grad_norm_`` holds for the
    next step, the scale of the step a capture holds, and the global norm (made at its
    first use).

    Args:
        group: the group the shards are spread over.
        world: the ranks they are sharded over (1: no exchange).
        arena: the shard arena whose ``grad`` the reductions write.
        comm: the comm that reduces.
        mean: the step takes the mean of the micro-batches (else their sum); either way
            the sum over the ranks is averaged.
    """

    def __init__(self, group: Group, world: int, arena: ShardArena, comm: UnitComm,
                 mean: bool) -> None:
        self._group, self._world, self._arena, self._comm = group, world, arena, comm
        self._mean = mean
        self._xp = group.backend.xp
        self._in_flight: dict[int, Reduction] = {}  # gradient buffer -> its reduction
        self._scratch: Any = None  # later micro-batches' reductions, made at the first
        self._micro = 0
        self._written: set[int] = set()  # units whose gradient shard this step wrote
        self._held: Optional[HeldClip] = None
        self._captured: Optional[GradScale] = None
        self._norm: Optional[GlobalNorm] = None

    @property
    def micro_batches(self) -> int:
        """The backward passes ended since the last step."""
        return self._micro

    # -- the reductions -------------------------------------------------------------

    def reduce(self, unit: int, k: int, stream: Any) -> None:
        """Start reducing gradient buffer ``k``, ``unit``'s, into the shards (the unit's first
        reduction in the step) or the scratch arena (a later one, added at :meth:`retire`)."""
        into_scratch = unit in self._written
        self._written.add(unit)
        out = self._scratch_arena() if into_scratch else self._arena.grad
        self._in_flight[k] = Reduction(self._comm.reduce(unit, k, out, stream), unit,
                                       into_scratch)

    def retire(self, k: int, stream: Any) -> None:
        """Order ``stream`` after gradient buffer ``k``'s reduction (and add a scratch
        one into the shards, on ``stream``); nothing where none is in flight."""
        red = self._in_flight.pop(k, None)
        if red is None:
            return
        red.work.wait(stream)
        if red.into_scratch:
            arena = self._arena
            with self._group.backend.on_stream(stream):
                grad = arena.block(arena.grad, red.unit)
                self._xp.add(grad, arena.block(self._scratch, red.unit), out=grad)

    def retire_all(self, stream: Any) -> None:
        """:meth:`retire` every reduction in flight, in the order they were issued."""
        for k in list(self._in_flight):
            self.retire(k, stream)

    def no_backward(self, unit: int, stream: Any) -> None:
        """``unit`` (with trainable parameters) was not forwarded in a pass: where the step
        wrote its gradient shard yet, it is zeroed, on ``stream`` (no collective: a sum of
        zeros is zero on every rank); else nothing is added to it."""
        if unit not in self._written:
            self._written.add(unit)
            with self._group.backend.on_stream(stream):
                self._arena.block(self._arena.grad, unit).fill(0)

    def end_pass(self) -> None:
        """A backward pass ended: one more micro-batch."""
        self._micro += 1

    def end_step(self) -> None:
        """The gradients were stepped or dropped: the next backward starts a step afresh
        (the one place the micro-batch count goes back to 0), and a held clip is gone."""
        self._micro = 0
        self._written.clear()
        self._held = None

    # -- the step's scale -------------------------------------------------------------

    def finalize(self, max_norm: Optional[float], stream: Any, capturing: bool,
                 table: Any, table_shape: tuple[int, int, int]) -> GradScale:
        """The scale of the retired gradient shards: the average over the ranks (and the
        micro-batches, with ``mean``), clipped to ``max_norm`` where given: by the host,
        or where the stream is ``capturing``, by the device, into the optimizer's
        coefficient ``table`` (laid out as ``table_shape``; None: not made yet).

        Raises:
            TideInvalid: no backward since the last step; inside a capture, a clip with
                the norm or the table not made before it (``Runtime.prepare_capture``).
        """
        if self._micro == 0:
            raise TideInvalid("step: expected a backward since the last step, got none")
        average = 1.0 / (self._world * (self._micro if self._mean else 1))
        if max_norm is None:
            return GradScale(average)
        grad = self._arena.grad
        if not capturing:
            return self.global_norm().clip(grad, average, max_norm, stream=stream)
        if self._norm is None or table is None:
            raise TideInvalid("clip_grad_norm_ inside a stream capture: expected "
                              "prepare_capture() before the capture (it makes what the "
                              "captured clip reads), got none")
        return self._norm.clip(grad, average, max_norm, stream=stream, table=table,
                               table_shape=table_shape)

    def hold(self, scale: GradScale) -> None:
        """Keep ``clip_grad_norm_``'s finalized gradients for the next step."""
        self._held = HeldClip(self._micro, scale)

    def take_held(self, in_backward: bool) -> Optional[GradScale]:
        """The held clip's scale, no longer held; None where none is.

        Raises:
            TideInvalid: a backward began since the clip (``in_backward``, or more
                micro-batches now); the clip is dropped all the same.
        """
        held, self._held = self._held, None
        if held is None:
            return None
        if in_backward or self._micro != held.micro_batches:
            raise TideInvalid("step: expected no backward between clip_grad_norm_ and the "
                              "step (its norm is of the gradient before), got one")
        return held.scale

    def global_norm(self) -> GlobalNorm:
        """The :class:`GlobalNorm` of the gradient shards, made at its first use
        (collective: every rank makes it at the same call)."""
        if self._norm is None:
            self._norm = GlobalNorm(self._group if self._world > 1 else None, self._world,
                                    self._xp)
        return self._norm

    def begin_capture(self) -> None:
        """A capture begins (``prepare_capture``): no step of it is held yet."""
        self._captured = None

    def captured(self, scale: GradScale) -> None:
        """A step was issued inside a capture with ``scale``: what each replay stages."""
        self._captured = scale

    def captured_scale(self) -> GradScale:
        """The scale of the step captured since :meth:`begin_capture`.

        Raises:
            TideInvalid: no step was captured since.
        """
        if self._captured is None:
            raise TideInvalid("a captured step: expected a step function that calls the "
                              "model's step(), got one that does not")
        return self._captured

    def _scratch_arena(self) -> Any:
        if self._scratch is None:
            self._scratch = self._xp.zeros_like(self._arena.grad)
        return self._scratch
