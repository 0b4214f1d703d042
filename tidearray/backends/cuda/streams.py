"""The one stream resolver: what every entry point that takes ``stream=`` accepts.

A stream is None (CuPy's current stream), a CuPy stream, an int ``cudaStream_t``,
an object with ``__cuda_stream__`` (returning ``(version, handle)``: cuda.core,
CuPy, Numba) or with ``cuda_stream`` (a ``torch.cuda.Stream``). The collectives
take its handle (:func:`stream_ptr`); the optimizer's kernels and the runtime's
own work run inside it as CuPy's current stream (:func:`cupy_stream`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..._errors import TideInvalid


def stream_ptr(stream: Any) -> int:
    """The ``cudaStream_t`` of ``stream`` as an int.

    Raises:
        TideInvalid: ``stream`` is none of the kinds this module lists.
    """
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, bool):
        raise TideInvalid("stream: expected a stream, got a bool")
    if isinstance(stream, int):
        return stream
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream.ptr
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    raise TideInvalid(f"stream: expected None, a CuPy stream, an int handle, an object with "
                      f"__cuda_stream__ or a torch.cuda.Stream, got {type(stream).__name__}")


def cupy_stream(stream: Any) -> Any:
    """``stream`` as a CuPy stream (itself if it is one; CuPy's current one for None),
    to make current with ``with``."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    ptr = stream_ptr(stream)
    if hasattr(cupy.cuda.Stream, "from_external"):  # newer CuPy; ExternalStream goes
        return cupy.cuda.Stream.from_external(_Handle(ptr))
    return cupy.cuda.ExternalStream(ptr)


class _Handle:
    """A bare ``__cuda_stream__`` for CuPy's ``Stream.from_external``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


def wait_for_readers(event: Any) -> None:
    """Block until ``event``, recorded after a device table's last reader, has fired.

    For the ``__del__`` of tables in CuPy memory: the pool must not hand their memory
    to another allocation while a kernel or copy may still read it. At interpreter
    shutdown the context may be gone; then there is nothing left to wait for.
    """
    try:
        if event is not None and not event.done:
            event.synchronize()
    except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the context is gone
        pass


def check_uploaded(capture: bool, what: str = "a table this call uploads at its first run") -> None:
    """Raise if a capture would have to upload (or allocate) ``what``: a graph cannot
    take that, so a collective is captured only after one run outside the capture."""
    if capture:
        raise TideInvalid(f"stream capture: expected a collective that ran once before "
                          f"being captured, got {what} (call it once outside the capture "
                          "first, as a warm-up)")


def on_stream(stream: Any) -> Any:
    """A ``with`` context making ``stream`` current: any stream the collectives take
    (``backends.cuda.streams``); nothing for None (the host backend, or CuPy's
    current stream)."""
    if stream is None:
        return contextlib.nullcontext()
    return cupy_stream(stream)
