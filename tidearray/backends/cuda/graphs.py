"""Graph plans on the cuda backend: a collective captured once, launched per call.

[Note: graph plans]
A plan's every address is fixed when it is built, and its flags take the same
values on every call ([Note: replay-safe flags] in ``_arena``), so what one
call issues can be captured once as a CUDA graph and launched per call: one
driver call of host time, whatever the number of copies, flags and kernels.

The capture runs on a stream of its own. The executor's lanes fork from it
(an event recorded on the capturing stream pulls every lane that waits on it
into the capture) and join back into it at the end, so the graph holds the
whole collective with its cross-lane orderings; NCCL calls capture as well.
A graph takes no batched copy (``cuMemcpyBatchAsync`` refuses capture), so
copies go one ``cudaMemcpyAsync`` each, which costs host time only once, at
capture. A capture must not upload or allocate: the plan runs once outside
it first (its tables are uploaded and its kernels compiled by that run).

A launch is ``cuGraphLaunch`` on the caller's stream (after its earlier work,
before its later work), an event after it, and the watchdog's registration of
that event with the waits the capture recorded ([Note: watchdog]): a replay
that does not complete within ``Config.timeout`` releases its waits and
breaks the group, as an eager call's would.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable

from ..._errors import TideBackendError
from .._base import Graph
from . import driver
from .executor import CudaCompletion, CudaExecutor, _event
from .streams import stream_ptr, wait_for_readers

if TYPE_CHECKING:
    from .executor import Lanes

#: CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: other threads (the watchdog's) stay free
#: to query events while this one captures.
THREAD_LOCAL = 1
_calls: Any = None
#: Completion events per graph, taken in turn.
EVENTS = 8


def _graph_calls() -> driver.GraphCalls:
    global _calls
    if _calls is None:
        _calls = driver.GraphCalls()
    return _calls


def _checked(err: int, what: str) -> None:
    if err:
        raise TideBackendError(f"{what} failed: CUresult {err}")


class CudaGraph(Graph):
    """One collective as an instantiated CUDA graph, and what a launch registers."""

    def __init__(self, lanes: Lanes, graph: int, exec_: int, waits: tuple,
                 abort: Any, what: str, keep: Any) -> None:
        self._lanes, self._graph, self._exec = lanes, graph, exec_
        self._waits, self._abort, self._what = waits, abort, what
        self._keep = keep  # what the graph's nodes read (tables): alive while it lives
        self._last: Any = None
        self._launch = _graph_calls().launch
        # Completion events, reused in turn (creating one per launch cost microseconds).
        # Launches of one graph run in order, so an event re-recorded by a later launch
        # only ever fires later: a stale Work waits a little longer, never less.
        self._events = [_event() for _ in range(EVENTS)]
        self._turn = 0
        import cupy

        self._record = cupy.cuda.runtime.eventRecord

    def launch(self, stream: Any = None) -> CudaCompletion:
        watchdog = self._lanes.watchdog
        if watchdog.broken is not None:
            watchdog.check()
        ptr = stream_ptr(stream)
        err = self._launch(self._exec, ptr)
        if err:
            _checked(err, "cuGraphLaunch")
        self._turn = turn = (self._turn + 1) % EVENTS
        ev = self._last = self._events[turn]
        self._record(ev.ptr, ptr)  # outside any capture: the watchdog may query it
        watchdog.watch(self._what, (ev,), self._waits, self._abort)
        return CudaCompletion([ev])

    def __del__(self) -> None:
        wait_for_readers(self._last)  # an exec may go while in flight; its tables not
        calls = _calls
        if calls is not None:
            try:
                calls.destroy_exec(self._exec)
                calls.destroy(self._graph)
            except Exception:  # noqa: BLE001, S110 - interpreter shutdown
                pass


def capture(lanes: Lanes, local_size: int, issue: Callable[[Any], Any], what: str) -> CudaGraph:
    """Capture ``issue(executor)`` (one collective's primitives) into a graph."""
    import cupy

    calls = _graph_calls()
    with cupy.cuda.Device(lanes.device):
        origin = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.deviceSynchronize()  # nothing in flight joins the capture
        _checked(calls.begin(origin.ptr, THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        failed: BaseException | None = None
        ex = None
        try:
            ex = CudaExecutor(lanes, local_size, origin)
            keep = issue(ex)
            ex.finish().wait(origin)  # every lane joins back into the origin
        except BaseException as e:  # noqa: BLE001 - end the capture, then raise it
            failed = e
        err = calls.end(origin.ptr, ctypes.byref(graph))
        if failed is not None:
            if graph.value:
                calls.destroy(graph)
            raise failed
        _checked(err, "cuStreamEndCapture")
        exec_ = ctypes.c_void_p()
        _checked(calls.instantiate(ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
        _checked(calls.upload(exec_, origin.ptr), "cuGraphUpload")
        origin.synchronize()
    return CudaGraph(lanes, graph.value, exec_.value, tuple(ex.waits), ex.abort, what, keep)
