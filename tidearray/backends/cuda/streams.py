"""The one stream resolver: what every entry point that takes ``stream=`` accepts.

A stream is None (CuPy's current stream), a CuPy stream, an int ``cudaStream_t``,
an object with ``__cuda_stream__`` (returning ``(version, handle)``: cuda.core,
CuPy, Numba) or with ``cuda_stream`` (a ``torch.cuda.Stream``). The collectives
take its handle (:func:`stream_ptr`); the optimizer's kernels and the runtime's
own work run inside it as CuPy's current stream (:func:`cupy_stream`).

[Note: initialized memory]
Whatever the library writes into device memory outside a call's own stream
order (the zeroed moments, masters, tables and norms its constructors make,
the masters and moments a load writes) goes on the stream that is current
then: often the legacy default stream, while the first use may come on the
model's stream, or any stream a caller passes, which need not wait for it (a
non-blocking stream never does). On a busy GPU such a write can land after
that first use: a zeroing memset wipes a step's moments, or a gradient is read
before its upload. So an entry point that writes device memory that way
returns only once those writes are done (:func:`settle`, or the group's
``synchronize``): it runs once, at construction or load, never per step.
Writes made per call (index fills, coefficient uploads) go on the call's own
stream instead, and an asynchronous upload's host source is pinned memory that
outlives the copy (:class:`HostUpload`).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ..._errors import TideInvalid

#: The last stream object :func:`stream_ptr` resolved, and its handle (one tuple: read and
#: written whole, so another thread never sees one without the other). A front end passes
#: the same stream object to every call of a step; the reference keeps it alive, so an
#: object seen again is that stream, whose handle does not change.
_last_resolved: tuple = (None, 0)


def stream_ptr(stream: Any) -> int:
    """The ``cudaStream_t`` of ``stream`` as an int.

    Raises:
        TideInvalid: ``stream`` is none of the kinds this module lists.
    """
    global _last_resolved
    last = _last_resolved
    if stream is last[0] and stream is not None:  # (None: the current one, which moves)
        return last[1]
    ptr = _resolve(stream)
    if stream is not None and not isinstance(stream, int):
        _last_resolved = (stream, ptr)
    return ptr


def _resolve(stream: Any) -> int:
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


def settle() -> None:
    """Wait (on the host) for the work issued so far on CuPy's current stream: the
    device writes of a constructor or a load ([Note: initialized memory])."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


class HostUpload:
    """Host-to-device copies of small tables whose host source outlives each copy
    ([Note: initialized memory]): the table goes into pinned memory, which the
    copy engine reads asynchronously after the call returns, and the next upload
    reuses that memory only once the event after the last copy has fired."""

    def __init__(self) -> None:
        self._host: Any = None  # pinned bytes
        self._nbytes = 0  # how many
        self._event: Any = None  # recorded after the last copy out of them

    def __call__(self, dst: Any, table: np.ndarray, stream: Any = None) -> None:
        """Copy ``table`` into the start of CuPy array ``dst`` on ``stream`` (a CuPy
        stream; None: the current one); returns without waiting for the copy."""
        import cupy

        if stream is None:
            stream = cupy.cuda.get_current_stream()

        if table.nbytes > dst.nbytes:
            raise AssertionError(f"an upload of {table.nbytes} bytes into {dst.nbytes}")
        if self._event is None:
            self._event = cupy.cuda.Event(block=False, disable_timing=True)
        elif not self._event.done:
            self._event.synchronize()  # the last copy has read the pinned bytes
        if table.nbytes > self._nbytes:
            self._nbytes = max(table.nbytes, 4096)
            self._host = cupy.cuda.alloc_pinned_memory(self._nbytes)
        np.frombuffer(self._host, np.uint8, table.nbytes)[:] = \
            np.ascontiguousarray(table).view(np.uint8).ravel()
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, self._host.ptr, table.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._event.record(stream)


def keep_until_read(owner: Any, events: Sequence[Any], keep: Any,
                    release: Optional[Callable[[], None]] = None) -> None:
    """When ``owner`` is collected, block until each of ``events`` (each recorded after
    a reader of the device memory in ``keep``) has fired, then ``release()``, then let
    ``keep`` go: the pool must not hand that memory to another allocation while a
    kernel, copy or graph may still read it.

    [Note: finalizers in cycles]
    Not a ``__del__``: an owner in a reference cycle (a plan's table, a graph plan held
    by a runtime that refers to itself) is collected together with everything only it
    refers to, and the collector runs their finalizers in any order. CuPy's
    ``Event.__del__`` destroys the event's handle, so an owner's ``__del__`` could
    query an event already destroyed, which dies in the driver: signal 11 in a graph
    plan's ``__del__`` under ``gc.collect()``, at 2 ranks on an H100. A
    ``weakref.finalize`` holds its arguments from a registry of its own, so they are
    never part of the collected cycle, and the collector calls it before the cycle's
    finalizers. Not at interpreter exit (``atexit`` off): the context may be gone.
    """
    weakref.finalize(owner, _wait_then_release, events, keep, release).atexit = False


#: Releases that came while a capture was open (:func:`no_release_in_capture`).
_deferred: list[tuple[Sequence[Any], Any, Optional[Callable[[], None]]]] = []
_captures_open = 0
_collecting = False  # whether the collector was on when the first open capture began


@contextlib.contextmanager
def no_release_in_capture() -> Iterator[None]:
    """A stream capture of tidearray's own (``cudaStreamCaptureModeThreadLocal``) inside:
    no finalizer of :func:`keep_until_read` queries, waits or destroys anything until it
    ends (those calls are not allowed during a capture and would invalidate it: the
    collector may run one at any allocation), and no collection starts. Deferred
    releases run when the last open capture ends."""
    global _captures_open, _collecting
    if not _captures_open:  # (captures on other threads may overlap: the first one decides)
        _collecting = gc.isenabled()
        gc.disable()
    _captures_open += 1
    try:
        yield
    finally:
        _captures_open -= 1
        if not _captures_open:
            if _collecting:
                gc.enable()
            while _deferred:
                _wait_then_release(*_deferred.pop())


def _wait_then_release(events: Sequence[Any], keep: Any,
                       release: Optional[Callable[[], None]]) -> None:
    if _captures_open:
        _deferred.append((events, keep, release))
        return
    try:
        for event in events:
            if not event.done:
                event.synchronize()
        if release is not None:
            release()
    except Exception:  # noqa: BLE001, S110 - a finalizer raises nowhere useful
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
