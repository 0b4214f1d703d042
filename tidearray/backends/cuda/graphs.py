"""Graph plans on the cuda backend: a collective captured once, launched per call.

[Note: graph plans on cuda]
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
breaks the group, as an eager call's would. A launch ``beside`` the caller's
stream (an asynchronous call, as an eager one runs beside it on the lanes) goes
on the ``COMPUTE`` lane instead, forked from the caller's stream by an event:
it runs concurrently with the caller's later work until a ``Work.wait``.

[Note: capture inside a step]
A plan that an XLA callback finds again (``eager_plan``'s ``graph_after``) is
captured in the middle of a jitted step, where a host wait would stall XLA's
thread until the device drains. It need not wait: the plan ran at its earlier
calls on XLA's stream, so its tables are uploaded and its kernels compiled, and
a capture records work without running it. What is in flight on the lanes (the
earlier calls) does not join the capture: only work issued on a lane after it
waits on the capture's fork event does. The graph is uploaded on XLA's stream,
in order before its first launch there, and that launch waits on the region's
last collective, the eager call before it ([Note: graph order] in ``_plan``).
A plan captured at build (``graph=True``) runs once just before, on the current
stream, and its capture waits for the device first.

[Note: graph launch cost]
A replay's host time is the driver's launch plus the Python around it, and
both are kept small: the driver's grows by about 2 us per stream memory
operation in the graph and hardly at all per copy or kernel node
(``benchmarks/probes/graph_launch.py``), so flags in graphs are kernels
([Note: flags in graphs] in ``flags``); around it, a launch reads no
configuration, allocates nothing it can reuse (the events and their completions
are made once per graph) and calls CuPy's compiled
``graphLaunch`` rather than the driver through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any, Callable

from ..._errors import TideBackendError
from .._base import Graph, StepPool
from . import driver
from .executor import CudaCompletion, CudaExecutor, _event
from .streams import keep_until_read, no_release_in_capture, stream_ptr

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
                 abort: Any, what: str, keep: Any, side: Any) -> None:
        import cupy

        self._lanes, self._graph, self._exec = lanes, graph, exec_
        self._side, self._side_ptr = side, side.ptr  # the lane a launch beside goes on
        self._waits, self._abort, self._what = waits, abort, what
        self._watchdog = lanes.watchdog
        # A launch is host time taken from the thread that launches the model's kernels
        # ([Note: graph launch cost]): CuPy's compiled runtime call where it has one.
        self._launch = getattr(cupy.cuda.runtime, "graphLaunch", None)
        self._driver_launch = _graph_calls().launch
        self._current_stream = cupy.cuda.get_current_stream
        self._record = cupy.cuda.runtime.eventRecord
        self._wait_event = cupy.cuda.runtime.streamWaitEvent
        # Completion events, reused in turn (creating one per launch cost microseconds).
        # Launches of one graph run in order, so an event re-recorded by a later launch
        # only ever fires later: a stale Work waits a little longer, never less.
        self._events = [_event() for _ in range(EVENTS)]
        self._event_ptrs = [ev.ptr for ev in self._events]
        self._completions = [CudaCompletion([ev]) for ev in self._events]
        self._watched = [(ev,) for ev in self._events]
        self._turn = 0
        self._stream: Any = None  # the last launch's stream object, and its handle
        self._stream_ptr = 0
        # ``keep``, what the graph's nodes read (tables), lives while the graph does and
        # until its launches are done; the exec may go while in flight, not so its tables
        # ([Note: finalizers in cycles]).
        keep_until_read(self, self._events, keep, functools.partial(_destroy, exec_, graph))

    def launch(self, stream: Any = None, after: Any = None,
               beside: bool = False) -> CudaCompletion:
        watchdog = self._watchdog
        if watchdog.broken is not None:
            watchdog.check()
        if stream is None:
            ptr = self._current_stream().ptr
        elif stream is self._stream:  # the same stream object as the last launch's
            ptr = self._stream_ptr
        else:
            ptr = stream_ptr(stream)
            self._stream, self._stream_ptr = stream, ptr  # kept alive: its handle stays
        if beside:  # forked from the caller's stream: a wait takes the event's state now
            fork = self._lanes.events.take()
            self._record(fork.ptr, ptr)
            ptr = self._side_ptr
            self._wait_event(ptr, fork.ptr, 0)
        if after is not None and after.stream != ptr:  # (on one stream: in its order)
            after.wait(ptr)
        self._launch_on(ptr)
        self._turn = turn = (self._turn + 1) % EVENTS
        self._record(self._event_ptrs[turn], ptr)  # outside any capture: the watchdog
        watchdog.watch(self._what, self._watched[turn], self._waits, self._abort)  # queries it
        completion = self._completions[turn]
        completion.stream = ptr
        return completion

    def _launch_on(self, ptr: int) -> None:
        """``cuGraphLaunch`` of the exec on stream ``ptr``, nothing else."""
        if self._launch is not None:
            try:
                self._launch(self._exec, ptr)
            except Exception as e:  # noqa: BLE001 - CuPy's CUDARuntimeError, named ours
                raise TideBackendError(f"cudaGraphLaunch failed: {e}") from e
            return
        err = self._driver_launch(self._exec, ptr)
        if err:
            _checked(err, "cuGraphLaunch")


def _destroy(exec_: int, graph: int) -> None:
    """Destroy a graph and its exec (a graph plan's, once its launches are done)."""
    calls = _calls
    if calls is not None:
        calls.destroy_exec(exec_)
        calls.destroy(graph)


def capture(lanes: Lanes, local_size: int, issue: Callable[[Any], Any], what: str,
            launch_on: int | None = None) -> CudaGraph:
    """Capture ``issue(executor)`` (one collective's primitives) into a graph; where it
    ran at earlier calls on ``launch_on`` (a stream pointer), without a host wait
    ([Note: capture inside a step])."""
    import cupy

    calls = _graph_calls()
    with cupy.cuda.Device(lanes.device), no_release_in_capture():
        origin = cupy.cuda.Stream(non_blocking=True)
        if launch_on is None:
            cupy.cuda.runtime.deviceSynchronize()  # the run just before is done
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
        if launch_on is None:
            _checked(calls.upload(exec_, origin.ptr), "cuGraphUpload")
            origin.synchronize()
        else:  # in order before the launches on that stream
            _checked(calls.upload(exec_, launch_on), "cuGraphUpload")
    return CudaGraph(lanes, graph.value, exec_.value, tuple(ex.waits), ex.abort, what, keep,
                     side=lanes.streams[ex.COMPUTE])


class CudaStepPool(StepPool):
    """A captured step's own CuPy memory pool ([Note: captured steps] in ``fsdp._graph``),
    made by ``CudaBackend.step_pool``."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool  # a cupy.cuda.MemoryPool

    def using(self) -> Any:
        """``cupy.cuda.using_allocator`` of this pool's ``malloc``."""
        import cupy

        return cupy.cuda.using_allocator(self._pool.malloc)

    def capture(self, stream: Any, step: Callable[[], Any]) -> tuple[Any, Any]:
        """``step()`` captured (``streamCaptureModeRelaxed``) on the CuPy ``stream``, made
        current for it: the ``cupy.cuda.Graph``, and what step returned."""
        import cupy

        with stream:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                result = step()
            except BaseException:
                try:  # the step's error broke the capture: raise that one, not the ending's
                    stream.end_capture()
                except Exception:  # noqa: BLE001, S110 - unjoined lanes, most likely
                    pass
                raise
            graph = stream.end_capture()
        return graph, result

    def free_all_blocks(self) -> None:
        self._pool.free_all_blocks()
