"""XLA's buffers and stream, seen by the backend, inside a ``buffer_callback``.

A ``jax.experimental.buffer_callback`` hands its Python callable XLA's own device
buffers (``Buffer``: ``__array__`` on CPU, ``__cuda_array_interface__`` on GPU) and
XLA's stream (``ExecutionContext.stream``, a ``cudaStream_t`` on GPU). This module
turns them, once per callback, into the arrays and the stream the backend takes, and
copies between such arrays on that stream.

[Note: XLA's buffers on cuda]
The backend's ``wrap`` makes a CuPy array straight over the buffer's pointer
(``UnownedMemory``), not through ``cupy.asarray`` or DLPack: CuPy's
``__cuda_array_interface__`` import synchronizes on a producer's stream where the
interface names one, and a DLPack export may do the same. Inside a callback the
buffer is XLA's and in order on XLA's stream already, so no synchronization is
needed, and none is done: the arrays are used only by work issued on
``ctx.stream`` during the callback. The backend keeps each array by its address,
shape and dtype and hands it out again at the next callback that meets them (XLA's
buffer assignment repeats), so a step's callbacks make no CuPy arrays after the first.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ContextManager, Optional, Sequence

from jax.experimental.buffer_callback import ExecutionStage


class XlaBuffers:
    """The backend's view of XLA's buffers and stream (one per group).

    Args:
        backend: the group's backend (``host`` or ``cuda``).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cuda = backend.device_kind == "gpu"  # XLA's stream is a cudaStream_t

    def arrays(self, buffers: Sequence[Any]) -> list[Any]:
        """Each buffer as an array of the backend over the same memory (no copy)."""
        return [self.backend.wrap(b) for b in buffers]

    def runs(self, ctx: Any) -> bool:
        """Whether the callback is to act now: XLA may call it at earlier stages of an
        executable's life (instantiate, prepare, initialize) as well as to execute."""
        return ctx.stage == ExecutionStage.EXECUTE

    def on_device(self) -> ContextManager:
        """The backend's device current for CuPy (XLA calls back on a thread of its own,
        whose current device CuPy does not know)."""
        return self.backend.on_device()

    def stream(self, ctx: Any) -> Optional[int]:
        """XLA's stream of this callback (cuda), None on the host backend."""
        return int(ctx.stream) if self.cuda else None

    def copy(self, dst: Sequence[Any], src: Sequence[Any], stream: Optional[int]) -> None:
        """``dst[k][...] = src[k]`` for arrays of equal bytes, on ``stream`` (cuda: one
        device-to-device copy each, asynchronous; host: memmove)."""
        self.backend.copy_arrays(dst, src, stream)


class HostClock:
    """Host seconds spent inside ``with clock:`` blocks, summed over the threads XLA calls
    back on (on the CPU a scanned body's callbacks run on XLA's worker threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._start = threading.local()

    def __enter__(self) -> None:
        self._start.t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        spent = time.perf_counter() - self._start.t
        with self._lock:
            self.seconds += spent
