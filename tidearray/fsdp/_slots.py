"""Which unit holds which slot, and when a slot changes hands.

[Note: slots]
``prefetch + 1`` slots; unit ``i`` is always gathered into slot
``i % (prefetch + 1)`` (:func:`slot_of`, the one home of that rule: the comms size
their buffers by it too), when first needed or prefetched, so its parameters
have the same addresses in forward and in backward (front ends whose autograd
saved the forward's parameter tensors find them again, regathered, in
backward). A slot is free again after its unit's forward (the last unit stays
for its backward, as FSDP2 keeps the root) or after its backward. A gather
into a slot is ordered after everything the compute stream issued before the
gather was issued, so it never overwrites parameters still in use; on the tide
path its grant also follows the reduce-scatter that staged in that slot
(Slot-Reuse).

A unit that is neither running (between its ``pre_forward`` and
``post_forward``) nor open for its backward gives its slot up to a gather
that needs it (its next use gathers it again, into the same slot): a unit
kept gathered for a backward that does not come next (a reused unit, a
forward with no backward) never blocks another. An open unit gives it up
to a unit whose backward opens (not to a prefetch): it is in no use's
backward then ([Note: unit lifecycle], slots), and loses its gradient
buffer with the slot, so its gradients so far are reduced first; its next
backward gathers it again and reduces once more (FSDP2 reduces per use the
same way). A gather whose slot a running unit holds raises ``TideInvalid``
(units in use at once, nested units, need ``num_slots`` of their own).

A prefetch whose slot still holds a unit that does not give it up (autograd may start unit
``i-1``'s backward before unit ``i``'s gradients are all in, and unit ``i-2``
shares unit ``i``'s slot) is deferred: it is issued when that slot is released
(``post_backward``), so ``prefetch + 1`` slots suffice for autograd too. Every
rank defers the same prefetches, since every rank runs the same hooks in the
same order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .._errors import TideInvalid


def slot_of(unit: int, num_slots: int, root: bool) -> int:
    """The slot ``unit`` is always gathered into (and whose gradient buffer its backward
    writes): ``unit % num_slots``; with ``root``, unit 0 has slot ``num_slots``, its own."""
    return num_slots if root and unit == 0 else unit % num_slots


def slot_units(num_units: int, num_slots: int, root: bool) -> list[list[int]]:
    """Per slot (the root's own last, with ``root``), the units :func:`slot_of` puts in it."""
    units: list[list[int]] = [[] for _ in range(num_slots + root)]
    for i in range(num_units):
        units[slot_of(i, num_slots, root)].append(i)
    return units


class SlotTable:
    """The runtime's slots: ``num_slots`` shared ones and, with ``root``, the root's own
    (the last). ``gather(i, k)`` starts gathering unit ``i`` into slot ``k`` and returns
    its work; ``may_give_up(u, prefetch)`` says whether gathered unit ``u`` may lose its
    slot (to a gather needed now, or to a ``prefetch``);
    ``released(u)`` is told whenever unit ``u`` loses it; ``describe(u)`` names unit ``u``
    in errors.

    Attributes:
        unit_slots: per unit, its slot (:func:`slot_of`, computed once: the runtime reads
            it several times per unit per step).
    """

    def __init__(self, num_units: int, num_slots: int, root: bool,
                 gather: Callable[[int, int], Any],
                 may_give_up: Callable[[int, bool], bool],
                 released: Callable[[int], None], describe: Callable[[int], str]) -> None:
        self.num_units, self.num_slots, self.root = num_units, num_slots, root
        self._gather, self._may_give_up, self._released = gather, may_give_up, released
        self._describe = describe
        self.unit_slots = tuple(slot_of(i, num_slots, root) for i in range(num_units))
        self._work: dict[int, Any] = {}  # gathered unit -> its gather's work, in gather order
        self._holder: dict[int, int] = {}  # slot -> the unit gathered into it
        self._deferred: list[int] = []  # prefetches waiting for their slot

    def slot(self, i: int) -> int:
        """Unit ``i``'s slot: the same one every time (:func:`slot_of`)."""
        return self.unit_slots[i]

    def holds(self, i: int) -> bool:
        """Whether unit ``i`` holds its slot (gathered, or its gather issued)."""
        return i in self._work

    def units(self) -> list[int]:
        """The units holding a slot, in the order they were gathered."""
        return list(self._work)

    def waiting(self) -> list[int]:
        """The prefetches deferred until their slot is released, in order."""
        return list(self._deferred)

    def ensure(self, i: int, prefetch: bool = False) -> Optional[Any]:
        """Unit ``i``'s gather work (whose ``wait`` gives its parameters), the gather issued
        now if ``i`` holds no slot: into its slot, taken from the unit holding it if that
        may give it up. A ``prefetch`` whose slot is not given up is deferred until the
        slot is released (None); a gather needed now raises then. (One method for both:
        a prefetch, issued per unit, is then one call.)"""
        work = self._work.get(i)
        if work is not None:
            return work
        if prefetch and i in self._deferred:
            return None
        k = self.unit_slots[i]
        holder = self._holder.get(k)
        if holder is not None:
            if not self._may_give_up(holder, prefetch):
                if prefetch:
                    self._deferred.append(i)
                    return None
                raise TideInvalid(
                    f"{self._describe(i)}: expected its slot {k} to be free, got it holding "
                    f"{self._describe(holder)}, which is running: units used at once "
                    "(nested units, units out of order) need "
                    f"slots of their own: pass num_slots={self.num_units} (one per unit)")
            self.release(holder, issue_deferred=False)
        if i in self._deferred:  # only now: a refused gather changes nothing
            self._deferred.remove(i)
        self._holder[k] = i
        work = self._work[i] = self._gather(i, k)
        return work

    def release(self, i: int, issue_deferred: bool = True) -> None:
        """Unit ``i`` gives its slot up; a prefetch deferred for the slot is issued."""
        del self._work[i]
        k = self.unit_slots[i]
        del self._holder[k]
        self._released(i)
        if not issue_deferred or not self._deferred:
            return
        for j in self._deferred:
            if self.unit_slots[j] == k:
                self._deferred.remove(j)
                self.ensure(j)
                return

    def clear(self, stream: Any = None, *, wait: bool = False) -> None:
        """End what a pass gathered: forget the prefetches waiting for their slot, then
        every unit gives its slot up, in the order they were gathered; with ``wait``, each
        gather is first waited for on ``stream`` (a later gather into the slot is ordered
        after that stream). In that order, and with no way to release all without it: a
        prefetch issued by a release here would stay gathered past an optimizer step and
        serve the next forward parameters from before it."""
        self._deferred.clear()
        for i in list(self._work):
            if wait:
                self._work[i].wait(stream)
            self.release(i)
