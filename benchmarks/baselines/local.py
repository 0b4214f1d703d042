"""The runtime's ``local`` comm: the no-communication floor a training step is measured
against.

``Runtime(comm=LocalComm)`` keeps the whole model on every rank (``world = 1``):
parameters are read in place from the send shards, gradients are cast into the fp32
arena, and nothing is communicated. Each rank does a sharded run's per-rank compute.
"""

from __future__ import annotations

from typing import Any, Optional

from tidearray import Work
from tidearray.fsdp import UnitComm


class LocalComm(UnitComm):
    """No communication: parameters are the send shards themselves (``world = 1``)."""

    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Per (unit, gradient buffer, output), its flat copy's two arrays, or None.
        self._flat: dict = {}

    @classmethod
    def sharded_over(cls, group: Any) -> int:
        return 1

    def gather(self, unit: int, k: int, stream: Any) -> Work:
        # The same list every step, as the other kinds' gathers return (front ends
        # keep what they build on it by the list's identity).
        views = self._param_views.get(unit)
        if views is None:
            views = self._param_views[unit] = self.arena.views(self.arena.send, unit)
        return self.done(views)

    def reduce(self, unit: int, k: int, out: Any, stream: Any) -> Work:
        with self.on_stream(stream):  # on the compute stream: complete as issued
            flat = self._flat_pair(unit, k, out)
            pairs = [flat] if flat else zip(self.arena.views(out, unit), self.grads(unit, k))
            for o, g in pairs:
                self.xp.copyto(o, g, casting="unsafe")
        return self.done()

    def _flat_pair(self, unit: int, k: int, out: Any) -> Optional[tuple[Any, Any]]:
        """``(out's block, gradient buffer k)`` of ``unit`` as two flat arrays, where each
        parameter lies at the same element offset in both (the gaps between parameters
        included: the gradient buffer's are zeroed before each backward), else None.

        So the floor casts a unit's gradients with one copy, as ``tide`` reduces a unit with
        one kernel: a copy per parameter (a launch each on cuda) made the floor cost more
        host time per unit than the collectives it is the floor of."""
        face = getattr(out, "__cuda_array_interface__", None) or out.__array_interface__
        key = (unit, k, face["data"][0], out.size)  # the runtime's output buffers are few
        pair = self._flat.get(key, False)
        if pair is False:
            slot, arena = self.layouts[unit], self.arena.layout.units[unit]
            itemsize = self.dtype.itemsize
            same = all(a * itemsize == b for a, b in zip(arena.offsets, slot.offsets))
            n = arena.offsets[-1] + arena.specs[-1].shard_numel if arena.specs else 0
            pair = None
            if same and n:
                grads = self._grad_bufs[k][:n * itemsize].view(self.dtype)
                pair = (self.arena.block(out, unit)[:n], grads)
            self._flat[key] = pair
        return pair
