"""Zero-SM flags: ``cuStreamWriteValue32`` to signal, ``cuStreamWaitValue32`` to wait.

A signal is a stream memory operation: the 32-bit write happens once the
stream's earlier work is done, with a memory barrier (the default flag), so a
peer that sees the flag also sees the data the same stream copied before it.
A wait holds the stream until the local word is >= the value
(``CU_STREAM_WAIT_VALUE_GEQ``, a cyclic comparison). Neither uses an SM and
neither involves the host.

Where the driver refuses stream memory operations, one-thread kernels from
``kernels/flags.cu`` stand in; ``FlagOps.probe`` decides and says why.

[Note: flags in graphs]
In a CUDA graph (a graph plan's capture, or the user's) the same one-thread
kernels signal and wait instead of memory operations: a graph's launch costs the
driver about 2 us of host time per memory-operation node and nothing measurable
per kernel node (``benchmarks/probes/graph_launch.py``, one H200: 64 write+wait
pairs 160 us, 8 pairs 23 us, 64 kernels 3.4 us, 256 copies 5 us), so with memory
operations a collective's graph launched in 20-50 us. A waiting kernel keeps one
CTA resident while it spins, on one SM, where a memory operation holds none.
The kernels are loaded when the flags are probed, since a capture cannot load them.
``Config.graph_flag_kernels`` (on by default) chooses, once per group; eager calls keep memory
operations either way.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..._errors import TideBackendError
from . import driver


class FlagOps:
    """Signal and wait on int32 flag words, on a given stream."""

    def __init__(self, device: int, graph_kernels: bool = True) -> None:
        self.device = device
        self._graph_kernels_wanted = graph_kernels
        self.memops = False
        self.reason = "not probed yet"
        self._write: Any = None
        self._wait: Any = None
        self._flags: dict[str, int] = {}
        # Flags in the graphs captured from now on are kernels ([Note: flags in graphs]):
        # Config.graph_flag_kernels, where the kernels load; read at each capture.
        self.graph_kernels = False

    def probe(self, stream: Any) -> tuple[bool, str]:
        """Try a write and a wait on a scratch word; fall back to kernels on failure."""
        import cupy

        word = cupy.zeros(1, cupy.int32)
        cupy.cuda.get_current_stream().synchronize()
        try:
            from cuda.bindings import driver as cu

            # CU_STREAM_WRITE_VALUE_DEFAULT writes after a memory barrier; GEQ waits cyclically.
            self._flags = {
                "Write": int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                "Wait": int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)}
            self._write = driver.stream_value32("Write")
            self._wait = driver.stream_value32("Wait")
            self.memops = True
            self.signal(stream, word.data.ptr, 7)
            self.wait(stream, word.data.ptr, 7)
            stream.synchronize()
            if int(word.get()[0]) != 7:
                raise RuntimeError("the trial write did not land")
            self.reason = "cuStreamWriteValue32 / cuStreamWaitValue32 (GEQ): zero SMs"
            self.graph_kernels = self._graph_kernels_wanted and self._load_kernels()
        except Exception as e:  # noqa: BLE001 - old driver, memops disabled: spin kernels instead
            self.memops = False
            self.reason = (f"off ({type(e).__name__}: {e}); one-thread flag kernels "
                           "(kernels/flags.cu) instead")
            # Said once, not only in tidearray.info: the spinning kernels occupy SMs, which
            # the zero-SM transport promises not to.
            warnings.warn(f"tidearray: stream memory operations are unavailable, so flags "
                          f"use one-thread spinning kernels (SMs): {self.reason}",
                          RuntimeWarning, stacklevel=2)
        return self.memops, self.reason

    def _load_kernels(self) -> bool:
        """Load the flag kernels now, for graphs; False (memory operations in graphs too)
        where they cannot be compiled."""
        from . import kernels as _kernels

        try:
            for name in ("tide_signal", "tide_wait"):
                _kernels.function("flags.cu", name, self.device)
        except Exception as e:  # noqa: BLE001 - no NVRTC: graphs keep memory operations
            self.reason += f"; in graphs too ({type(e).__name__}: {e})"
            return False
        self.reason += "; one-thread kernels in graphs"
        return True

    def signal(self, stream: Any, addr: int, value: int, graph: bool = False) -> None:
        """After ``stream``'s earlier work, write ``value`` to the int32 at ``addr``.
        ``graph``: ``stream`` is capturing ([Note: flags in graphs])."""
        self._op("Write", "tide_signal", stream, addr, value, graph)

    def wait(self, stream: Any, addr: int, value: int, graph: bool = False) -> None:
        """Hold ``stream`` until the int32 at ``addr`` is >= ``value`` (cyclically)."""
        self._op("Wait", "tide_wait", stream, addr, value, graph)

    def _op(self, op: str, kernel: str, stream: Any, addr: int, value: int,
            graph: bool) -> None:
        if not self.memops or (graph and self.graph_kernels):
            self._kernel(kernel, stream, addr, value)
            return
        memop = self._write if op == "Write" else self._wait
        err = memop(stream.ptr, addr, value & 0xFFFFFFFF, self._flags[op])
        if err:
            raise TideBackendError(f"cuStream{op}Value32 failed: CUresult {err}")

    def _kernel(self, name: str, stream: Any, addr: int, value: int) -> None:
        from . import kernels as _kernels

        k = _kernels.function("flags.cu", name, self.device)
        with stream:
            k((1,), (1,), (np.uint64(addr), np.int32(np.uint32(value & 0xFFFFFFFF).view(
                np.int32))))
