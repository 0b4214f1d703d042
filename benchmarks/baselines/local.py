"""The runtime's ``local`` comm: the no-communication floor a training step is measured
against.

``Runtime(comm=LocalComm)`` keeps the whole model on every rank (``world = 1``):
parameters are read in place from the send shards, gradients are cast into the fp32
arena (the FSDP2 baseline's chunk-cat, ``pack``), and nothing is communicated. Each rank
does a sharded run's per-rank compute.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tidearray import Work
from tidearray.fsdp import UnitComm

from . import pack


class LocalComm(UnitComm):
    """No communication: parameters are the send shards themselves (``world = 1``)."""

    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Per (unit, gradient buffer, output), its cast (``_cast``), or None.
        self._casts: dict = {}

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
        cast = self._cast(unit, k, out, stream)
        if cast is not None:
            cast(self.group.backend.stream(stream))  # on the compute stream: done as issued
            return self.done()
        with self.on_stream(stream):  # fp16: a copy per parameter
            for o, g in zip(self.arena.views(out, unit), self.grads(unit, k)):
                self.xp.copyto(o, g, casting="unsafe")
        return self.done()

    def _cast(self, unit: int, k: int, out: Any, stream: Any) -> Optional[Callable[[Any], None]]:
        """The cast of gradient buffer ``k``'s ``unit`` into its block of ``out`` (padding
        zeroed), made once per unit, buffer and output: on cuda one launch of the FSDP2
        baseline's chunk-cat kernel, as ``tide`` reduces a unit with one kernel (a CuPy
        ``copyto`` cost more host time than ``tide``'s whole reduction); on the host the
        same table's copies. None for fp16 gradients (no such kernel). Its table goes up on
        ``stream``, which the cast runs on."""
        key = (unit, k, pack.ptr(out), out.size)
        cast = self._casts.get(key, False)
        if cast is False:
            with self.on_stream(stream):
                cast = self._casts[key] = pack.chunk_cat(
                    self.group.backend.name == "cuda", self.arena.layout.units[unit],
                    self.grads(unit, k), self.arena.block(out, unit))
        return cast
