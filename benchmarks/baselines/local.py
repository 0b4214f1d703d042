"""The runtime's ``local`` comm: the no-communication floor a training step is measured
against.

``Runtime(comm=LocalComm)`` keeps the whole model on every rank (``world = 1``):
parameters are read in place from the send shards, gradients are cast into the fp32
arena, and nothing is communicated. Each rank does a sharded run's per-rank compute.
"""

from __future__ import annotations

from typing import Any

from tidearray import Work
from tidearray.fsdp import UnitComm


class LocalComm(UnitComm):
    """No communication: parameters are the send shards themselves (``world = 1``)."""

    name = "local"

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
            for o, g in zip(self.arena.views(out, unit), self.grads(unit, k)):
                self.xp.copyto(o, g, casting="unsafe")
        return self.done()
