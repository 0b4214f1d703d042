"""How the runtime moves a unit: gather it into slot ``k``, reduce gradient buffer ``k``.

``Runtime(comm=...)`` takes ``"tide"`` (the default, :class:`TideComm`) or a
comm factory: a :class:`UnitComm` subclass (or any callable with the same class
attributes) that the runtime calls as ``factory(group, shapes, dtype, arena,
num_slots, root)``. :class:`UnitComm` is the public extension point
(``tidearray.fsdp.UnitComm``, docs/fsdp.md): it gives a comm its gradient buffers,
views of a unit in a buffer, and the :class:`~tidearray.Work` its gathers and
reductions return. The benchmark's baselines (FSDP2's flat path, and the
no-communication floor) are such factories, in ``benchmarks/baselines/``, written
against that surface alone; they run the same trainer, so their step times compare
like for like.

[Note: comm streams]
Compute runs on the runtime's stream (``Runtime(stream=)``, CuPy's current stream if
None). A comm's ``gather`` and ``reduce`` are called with it (any kind the stream
resolver takes: a CuPy or torch stream, a handle; None on the host) and return at
once with a Work. Work issued on that stream itself is complete
as issued (:meth:`UnitComm.done`). Work on streams of the comm's own must start
after what compute issued before the call (it reads the shards and the gradients)
and be joined back before the runtime reads its result or reuses the buffer:
:meth:`UnitComm.on_side_stream` forks the side stream from the compute stream by an
event and returns a Work whose ``wait`` makes a stream wait for another, so in the
steady state no call blocks the host, except reading back the gradient norm when
clipping is on (not inside a capture).

``tide`` uses persistent TIDE plans (``Unit.gather_plan`` / ``reduce_plan``), as graph
plans with ``Config.unit_graphs`` ([Note: unit graphs]).
Each gather casts this rank's fp32 masters into its rows of the slot (one
kernel) and sends them from there, so no param-dtype send shards are kept
(FSDP2 casts in its copy-in the same way); or, where the arena keeps send
shards (``keep_param_shards``), gathers those with no cast. The gathered parameters are views
into symmetric slots; a unit's gradients are reduced with their staging in
the slot the unit just vacated (Slot-Reuse).
At one rank, where no cast is needed, a gather is views ([Note: one rank's gathers]).

[Note: one rank's gathers]
On a group of one rank a gather communicates nothing: it only makes the param-dtype
parameters from this rank's source, the fp32 masters or the kept send shards. Where
that source is in the param dtype already (fp32 parameters, or ``keep_param_shards``),
the gathered parameters are views of it: no copy, no launch, and the slots, which
then hold no parameters, are sized for the reductions' staging alone. What the
front end reads is the same values a gather would have copied; a write into a
gathered parameter (nothing the runtime does) would reach the masters, or the send
shards, instead of a slot. Where a cast is needed (bf16 parameters from fp32
masters), the gather is the cast plan, as at any size.

[Note: unit graphs]
On cuda an eager plan call costs 150-250 us of host time (an executor, its events,
each copy and kernel issued from Python), a graph plan's launch about 5 us: on a
host-bound model of many small units that difference is most of the front end's cost
per unit. So with ``unit_graphs`` (the default: docs/config.md) ``tide`` builds each
unit's plans as graph plans, each launch beside the compute stream (on the
``COMPUTE`` lane, as an eager call's lanes run). The host backend's graph plans
replay a recording of the call's primitives: the same protocol, so CPU runs test
what cuda runs. Building one runs its collective once outside any stream order, so
the build first waits for the device (once per unit and slot, in the first step;
every rank builds them in the same order, as it calls them). Inside a capture (a
captured step) no plan is built as a graph, and a graph plan issues its primitives
into the capture instead of launching.

Every implementation keeps ``num_slots`` gradient buffers in the param dtype:
unit ``i`` in slot ``k`` writes its gradients into buffer ``k``, and the
runtime waits for that buffer's previous reduction before handing it out
again ([Note: gradient buffers] in ``_accum``).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from .. import _dtypes
from .._arena import SlotArena
from .._errors import TideInvalid
from .._layout import UnitLayout, cached_unit
from .._plan import Unit, slot_chunk_nbytes
from .._work import Work
from ..backends import Done, array_backend, array_module
from ._shards import ShardArena
from ._slots import slot_units

if TYPE_CHECKING:
    from .._group import Group


class UnitComm(abc.ABC):
    """Gathers and reductions of the runtime's units, over ``num_slots`` slots.

    The interface of a comm factory (``Runtime(comm=Factory)``), public as
    ``tidearray.fsdp.UnitComm``: the runtime reads two class attributes before it
    builds the shard arena, then calls ``Factory(group, shapes, dtype, arena,
    num_slots, root)`` once, on every rank, and uses the instance's :meth:`gather`,
    :meth:`reduce` (a subclass writes these two), :meth:`grads`, :meth:`zero_grads`,
    :attr:`nbytes` and :meth:`close`:

    * ``Factory.sharded_over(group)``: the ranks parameters are sharded over
      (``group.size``; 1 for a comm that communicates nothing);
    * ``Factory.send_shards``: whether the arena keeps param-dtype send shards,
      which the optimizer writes (True; ``tide`` keeps them only with
      ``keep_param_shards``).

    The arena holds this rank's shards, each kind one flat array: ``arena.master``
    (fp32), ``arena.grad`` (fp32, what :meth:`reduce` writes, as its ``out`` or a
    scratch array like it) and ``arena.send`` (param dtype, or None). Unit ``u``
    lies in each as ``arena.layout.units[u]`` says (a
    :class:`~tidearray.layout.FlatLayout`, FSDP2's flat rank-major block):
    ``arena.views(flat, u)`` are its padded shards, ``arena.block(flat, u)`` its
    whole block. :meth:`views`, :meth:`done`, :meth:`on_side_stream` and
    :meth:`on_stream` are the helpers a comm is written with ([Note: comm streams]).

    Args:
        group: the tidearray group (its backend gives the array module).
        shapes: per unit, the parameters' full shapes.
        dtype: the param dtype (gathered parameters, gradients).
        arena: the shard arena (masters or send shards in, fp32 gradients out).
        num_slots: slots, and gradient buffers (prefetch depth + 1).
        root: unit 0 has a slot (and gradient buffer) of its own, slot
            ``num_slots``, sized for it alone; the others share the rest.
    """

    #: Ranks a parameter is sharded over (``sharded_over(group)``).
    world: int
    #: The comm's name, as checkpoints record it (``meta.json``'s ``comm``).
    name: str = "?"
    #: Whether the shard arena keeps param-dtype send shards for this comm.
    send_shards: bool = True

    @classmethod
    def sharded_over(cls, group: Group) -> int:
        """Ranks parameters are sharded over with this comm (the group's size)."""
        return group.size

    def __init__(self, group: Group, shapes: Sequence[Sequence[tuple[int, ...]]], dtype: Any,
                 arena: ShardArena, num_slots: int, root: bool = False) -> None:
        self.group = group
        self.world = self.sharded_over(group)
        self.xp = group.backend.xp
        self.dtype = _dtypes.normalize(dtype)
        self.shapes = [tuple(map(tuple, s)) for s in shapes]
        self.arena = arena
        self.num_slots = num_slots
        self.layouts: list[UnitLayout] = [cached_unit(s, self.dtype.itemsize, self.world)
                                          for s in self.shapes]
        #: Per slot, the units gathered into it (the root's own slot last; [Note: slots]).
        self.slot_units: list[list[int]] = slot_units(len(self.shapes), num_slots, root)
        self._grad_bufs = [self.xp.empty((self.slot_max(k, lambda u: self.layouts[u].nbytes),),
                                         np.uint8) for k in range(len(self.slot_units))]
        self._grad_views: dict = {}
        self._param_views: dict = {}

    def grads(self, unit: int, k: int) -> list:
        """The gradient arrays unit ``unit``'s backward writes when it is in slot ``k``."""
        views = self._grad_views.get((unit, k))
        if views is None:
            views = self._grad_views[(unit, k)] = self.views(self._grad_bufs[k], unit)
        return views

    def views(self, buf: Any, unit: int) -> list:
        """``unit``'s full parameters as views of the byte buffer ``buf`` (uint8, at least
        ``self.layouts[unit].nbytes``), in the param dtype, at its slot layout's offsets:
        how :meth:`grads` views a gradient buffer, and a comm a buffer of its own."""
        layout = self.layouts[unit]
        return [buf[off:off + s.nbytes].view(self.dtype).reshape(s.shape)
                for s, off in zip(layout.specs, layout.offsets)]

    @staticmethod
    def done(result: Any = None) -> Work:
        """A Work complete when issued, whose ``wait`` returns ``result``: for work that
        ran on the host, or on the compute stream itself ([Note: comm streams])."""
        return Work(Done(), result)

    @staticmethod
    def on_side_stream(side: Any, stream: Any, issue: Callable[[Any], None],
                       result: Any = None) -> Work:
        """``issue(side)`` on the comm's own cuda stream ``side`` (a CuPy stream), after
        the work issued on ``stream`` so far, as a Work whose ``wait`` orders a stream
        after it and returns ``result``: events both ways, nothing blocks the host
        ([Note: comm streams]). As FSDP2 runs its all-gathers and reduce-scatters on
        streams of their own."""
        backend = array_backend(array_module(side))  # a CuPy stream's: the cuda backend
        backend.completion(stream).wait(side)
        issue(side)
        return Work(backend.completion(side), result)

    def on_stream(self, stream: Any) -> Any:
        """A context in which the array module issues on ``stream`` (any kind the runtime
        passes; nothing on the host): for work on the compute stream itself."""
        return self.group.backend.on_stream(stream)

    def zero_grads(self, unit: int, k: int, stream: Any) -> None:
        """Zero the gradient bytes ``unit`` takes in buffer ``k``, on ``stream`` (None: the
        current one; one memset: what a backward leaves unwritten reduces as zeros)."""
        with self.on_stream(stream):
            self._grad_bufs[k][:self.layouts[unit].nbytes].fill(0)  # CuPy: a memset

    def slot_max(self, k: int, size: Any) -> int:
        """The largest ``size(unit)`` of the units that use slot ``k`` (0 if none)."""
        return max((size(u) for u in self.slot_units[k]), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this implementation holds (slots, gradients, flat buffers)."""
        return sum(b.nbytes for b in self._grad_bufs)

    @abc.abstractmethod
    def gather(self, unit: int, k: int, stream: Any) -> Work:
        """Start gathering ``unit`` into slot ``k``; the work's result is its parameters."""

    @abc.abstractmethod
    def reduce(self, unit: int, k: int, out: Any, stream: Any) -> Work:
        """Start reducing gradient buffer ``k`` (sum over ranks) into the fp32 flat ``out``."""

    def close(self) -> None:
        """Release communicators (collective)."""


class TideComm(UnitComm):
    """Persistent TIDE plans, built on first use (every rank uses them in the same order)."""

    name = "tide"
    send_shards = False  # the gathers cast the masters, unless keep_param_shards

    def __init__(self, group: Group, shapes: Sequence, dtype: Any, arena: ShardArena,
                 num_slots: int, root: bool = False) -> None:
        super().__init__(group, shapes, dtype, arena, num_slots, root)
        # Reductions stage in the slot their unit vacated (Slot-Reuse): chunks sized to
        # the slot keep the calls per reduction few.
        self.units: list[Unit] = [None] * len(self.shapes)  # type: ignore[list-item]
        for k in range(len(self.slot_units)):
            chunk = slot_chunk_nbytes(self.slot_max(k, lambda u: self.layouts[u].nbytes), group)
            for u in self.slot_units[k]:
                self.units[u] = Unit(self.shapes[u], self.dtype, group, chunk_nbytes=chunk)
                self.units[u].tag = (("unit", u),)  # a rank out of step is named at once

        # What gathers read: the masters (cast), or the send shards (keep_param_shards).
        self._source = arena.master if arena.send is None else arena.send
        #: Per unit, its one-rank gather as views of the source, where that is in the param
        #: dtype (None: gathers are plans): [Note: one rank's gathers].
        self._in_place: Optional[dict] = (
            {} if self.world == 1 and self._source.dtype == self.dtype else None)

        def need(u: int) -> int:
            staging = self.units[u].staging_nbytes
            return staging if self._in_place is not None else max(self.units[u].nbytes, staging)

        # One arena of the shared slots, and one of the root's (it may be much bigger or
        # smaller than a layer: an embedding and a head).
        shared = SlotArena(max(self.slot_max(k, need) for k in range(num_slots)), num_slots,
                           group=group)
        self.slots = list(shared.slots)
        if root:
            self.slots += SlotArena(self.slot_max(num_slots, need), 1, group=group).slots
        self._gather_plans: dict = {}
        self._reduce_plans: dict = {}
        self._graphs = group.config.unit_graphs

    def _built(self, stream: Any, build: Callable[[bool], Any]) -> Any:
        """A plan built now (its first call): a graph plan where it can be ([Note: unit
        graphs]), ``build(graph)`` making it."""
        backend = self.group.backend
        graph = self._graphs and not backend.capturing(stream)
        if graph:
            backend.synchronize()  # the build's run reads what the stream wrote
        return build(graph)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(s.nbytes for s in self.slots)

    def gather(self, unit: int, k: int, stream: Any) -> Work:
        if self._in_place is not None:
            return self._in_place.get(unit) or self._gathered_in_place(unit)
        plan = self._gather_plans.get((unit, k))  # (looked up inline: a call per unit)
        if plan is None:
            cast = self.arena.send is None  # else the optimizer keeps param-dtype shards
            plan = self._gather_plans[(unit, k)] = self._built(stream, lambda graph: (
                self.units[unit].gather_plan(self.arena.views(self._source, unit),
                                             self.slots[k], cast=cast, graph=graph)))
        return plan(stream=stream, async_op=True)

    def _gathered_in_place(self, unit: int) -> Work:
        """Unit ``unit`` gathered at one rank, where its source is in the param dtype: its
        parameters are views of the source ([Note: one rank's gathers]); the same Work,
        and list, at every call (a front end keeps what it builds on the list)."""
        params = [v.reshape(shape) for v, shape in
                  zip(self.arena.views(self._source, unit), self.shapes[unit])]
        assert self._in_place is not None
        work = self._in_place[unit] = self.done(params)
        return work

    def reduce(self, unit: int, k: int, out: Any, stream: Any) -> Work:
        plan = self._reduce_plans.get((unit, k, id(out)))
        if plan is None:
            plan = self._reduce_plans[(unit, k, id(out))] = self._built(stream, lambda graph: (
                self.units[unit].reduce_plan(self.grads(unit, k), self.arena.views(out, unit),
                                             op="sum", staging=self.slots[k], graph=graph)))
        return plan(stream=stream, async_op=True)


def comm_factory(comm: Any) -> Any:
    """The factory ``Runtime(comm=...)`` names: :class:`TideComm` for ``"tide"``, or
    ``comm`` itself when it is a factory (:class:`UnitComm`'s class attributes).

    Raises:
        TideInvalid: for any other string (``"stock"`` and ``"local"`` moved to the
            benchmarks), or an object that is not a comm factory.
    """
    if isinstance(comm, str):
        if comm == "tide":
            return TideComm
        raise TideInvalid(f"comm: expected 'tide' or a UnitComm factory, got {comm!r}")
    if not (callable(comm) and callable(getattr(comm, "sharded_over", None))
            and isinstance(getattr(comm, "send_shards", None), bool)):
        raise TideInvalid(f"comm: expected 'tide' or a UnitComm factory (callable, with "
                          f"sharded_over(group) and send_shards), got {comm!r}")
    return comm
