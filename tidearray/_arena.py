"""Symmetric regions: slots for all-gather, staging for reduce-scatter.

A region is symmetric memory (same size on every node-local rank, mapped by
every peer once, at creation) followed by int32 flag words. Flags implement a
grant/arrive protocol per *channel*: channel 0 serves all-gather into the
region, channels 1.. serve reduce-scatter staging buffers inside it.

[Note: grant/arrive]
For each use of a channel:

* the owner of the memory *grants* it by writing 1 into each writer's FREE
  word, ordered after everything the owner's stream did with the memory
  before (its readers of the previous contents);
* a writer waits for FREE >= 1 in its own memory and writes it back to 0
  (it *consumes* the grant), writes the data, then writes 1 into the owner's
  ARRIVED word for that writer;
* the owner waits for ARRIVED >= 1 from every writer, consumes it, then reads.

[Note: replay-safe flags]
Every flag is written with the same value on every call, and every wait is for the
same value, so a collective captured once (a CUDA graph, or a host recording)
replays correctly. What makes that safe is the reset: each flag has one reader, who
writes it back to 0 right after its wait, on the lane that waited, and the writer
writes it again only after a chain that starts after that reset. For FREE: the
writer's reset, then its copies and ARRIVED (same lane), which the owner waits for
before it grants again (later, on the same lane as that wait). For ARRIVED: the
owner's reset, then its next grant (same lane), which the writer waits for before it
arrives again. So no write of 1 can land before the 0 that precedes it, and between
calls every flag is 0. A call consumes every flag it sets: the reduce-scatter grants
a buffer again only for a chunk of the same call. Debug stamps carry use numbers
([Note: stamps]) and are reset by their readers the same way.

All waits are on local memory, all signals are remote writes issued on the
same lane as the data they follow: zero SMs on the cuda backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from . import _validate
from ._adamw import is_int
from ._layout import align_up

if TYPE_CHECKING:
    from ._group import Group
    from ._layout import UnitLayout

FREE, ARRIVED = 0, 1
#: Debug stamps ([Note: stamps] in ``_stamps``): a writer's use number, copied in
#: after its data (STAMP, in the reader's memory), from a word of the writer's own (OUTBOX).
STAMP, OUTBOX = 2, 3
NUM_KINDS = 4
AG_CHANNEL = 0
#: Channel of reduce-scatter staging buffer ``b`` is ``RS_CHANNEL0 + b``.
RS_CHANNEL0 = 1
NUM_CHANNELS = RS_CHANNEL0 + 4


class Region:
    """Symmetric memory of ``nbytes`` plus flag words. Collective over the node.

    Use :class:`SlotArena` to make slots; a slot can also hold a
    reduce-scatter's staging (Slot-Reuse).
    """

    def __init__(self, group: Group, nbytes: int, multicast: bool = False) -> None:
        self.group = group
        self.id = group.next_region_id()
        self.nbytes = align_up(nbytes)
        L = group.local_size
        self._flag_words = NUM_CHANNELS * NUM_KINDS * L
        alloc = group.backend.alloc_multicast if multicast else group.backend.alloc_symmetric
        self.buffer = alloc(self.nbytes + self._flag_words * 4)
        flags = self.buffer.view(self.nbytes, (self._flag_words,), "int32")
        flags[...] = 0
        group.backend.synchronize()
        group.node_comm.Barrier()  # no peer signals before our flags are zero
        self.uses = [0] * NUM_CHANNELS  # per channel, calls so far: the debug stamps' values
        #: The last collective on this region: (its graph, or None if eager, its completion)
        #: ([Note: graph order] in ``_plan``).
        self.last: Optional[tuple[Any, Any]] = None
        self._views: dict = {}

    def ptr(self, local_rank: int) -> int:
        return self.buffer.ptr(local_rank)

    def flag(self, at: int, channel: int, kind: int, peer: int) -> int:
        """Address of the flag word in ``at``'s memory about ``peer``."""
        L = self.group.local_size
        return (self.buffer.ptr(at) + self.nbytes
                + ((channel * NUM_KINDS + kind) * L + peer) * 4)

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.buffer.view(offset, shape, dtype)

    def views(self, unit: UnitLayout, dtype: Any) -> list:
        """Arrays over ``unit``'s parameters in this region, made once and reused.

        Building hundreds of device-array views costs milliseconds per call;
        the views of a (unit, dtype) never change, so they are cached.
        """
        key = (unit, str(dtype))
        views = self._views.get(key)
        if views is None:
            views = [self.view(off, spec.shape, dtype)
                     for spec, off in zip(unit.specs, unit.offsets)]
            self._views[key] = views
        return list(views)

    def contains(self, ptr: int, nbytes: int) -> bool:
        base = self.ptr(self.group.local_rank)
        return nbytes > 0 and ptr < base + self.nbytes and base < ptr + nbytes

    def free(self) -> None:
        self.buffer.free()

    def __repr__(self) -> str:
        return f"Region(id={self.id}, nbytes={self.nbytes})"


class SlotArena:
    """``num_slots`` symmetric slots of ``slot_nbytes`` each. Collective.

    A unit's all-gathered parameters are views into the slot it was gathered
    into; reuse a slot only once its parameters are dead. Map once, at start-up:
    creating an arena imports peer memory, which costs milliseconds to seconds.

    Args:
        group: the group; the default group if None.
        slot_nbytes: bytes per slot, at least the biggest unit's
            ``unit_nbytes(...)``.
        num_slots: slots (2 = prefetch one unit ahead).
        multicast: bind the slots to NVSwitch multicast, so all-gather writes
            each shard once (default: the group's ``multicast`` setting). Refused
            (TideInvalid) where the machine does not allow it.
    """

    def __init__(self, slot_nbytes: int, num_slots: int = 2, group: Optional[Group] = None,
                 multicast: Optional[bool] = None) -> None:
        from ._group import default_group

        group = group or default_group()
        _validate.check_open(group, "SlotArena")
        if multicast is None:
            multicast = group.config.multicast
        # Collective: every rank's slots must be alike, as peers find each other's flag
        # words by their own slot's size; any rank's bad or differing arguments raise
        # the same TideInvalid on every rank, before any memory is mapped.
        ok = is_int(num_slots) and num_slots >= 1 and is_int(slot_nbytes) and slot_nbytes >= 0
        errors = [] if ok else [f"expected num_slots an integer >= 1 and slot_nbytes an "
                                f"integer >= 0, got {num_slots!r} and {slot_nbytes!r}"]
        _validate.check(group, "SlotArena", (("slot_nbytes", repr(slot_nbytes)),
                                             ("num_slots", repr(num_slots)),
                                             ("multicast", bool(multicast))), errors)
        self.group = group
        self.slots = [Region(group, slot_nbytes, bool(multicast)) for _ in range(num_slots)]
        for s in self.slots:
            group.keep(("slot", s.id), s)

    def __getitem__(self, i: int) -> Region:
        return self.slots[i]

    def __len__(self) -> int:
        return len(self.slots)


def default_region(group: Group, kind: str, nbytes: int, ring: int = 1) -> Region:
    """The group's own region(s) of ``kind``, grown (collectively) when too small.

    Callers pass ``nbytes`` that every rank agrees on (validated), so growth
    happens on every rank together. Outgrown regions stay alive: arrays the
    user still holds may point into them.
    """
    key = ("default", kind)
    state = group.kept(key)
    if state is None or state.nbytes < nbytes:
        if state is not None:
            group.keep(("retired", kind, state.nbytes), state)
        state = _Ring(group, nbytes, ring, kind == "slot" and group.config.multicast)
        group.keep(key, state)
    return state.next()


class _Ring:
    def __init__(self, group: Group, nbytes: int, count: int, multicast: bool) -> None:
        self.nbytes = nbytes
        self.regions = [Region(group, nbytes, multicast) for _ in range(count)]
        self._next = 0

    def next(self) -> Region:
        r = self.regions[self._next]
        self._next = (self._next + 1) % len(self.regions)
        return r

    def free(self) -> None:
        for r in self.regions:
            r.free()


def order_after(region: Region, stream: Any) -> None:
    """Order ``stream`` (an eager call's) after ``region``'s last collective if a graph's
    ([Note: graph order] in ``_plan``); not inside a capture, which cannot wait on a
    replay's event and follows a synchronization ([Note: captured steps] in
    ``fsdp._graph``)."""
    last = region.last
    if last is not None and last[0] is not None and not region.group.backend.capturing(stream):
        last[1].wait(stream)


def region_check(group: Group, value: Any, name: str, optional: bool) -> list[str]:
    """Errors of a slot or staging region: a Region of ``group`` (None where optional).
    Another group's region has its own numbering, so the ranks' agreement on its number
    would not tell one group's slot from another's."""
    if optional and value is None:
        return []
    if not isinstance(value, Region):
        return [f"{name}: expected a Region (a SlotArena entry), got {type(value).__name__}"]
    if value.group is not group:
        return [f"{name}: expected a region of this group's (a SlotArena made on it), got "
                f"one of another group"]
    return []
