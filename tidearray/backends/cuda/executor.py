"""The cuda executor: lanes are CUDA streams, forked from and joined to the user's stream.

[Note: streams]
The backend creates its lane streams once, at setup, all non-blocking (they
never synchronise with the legacy default stream):

* lane ``p`` (``0..L-1``) pushes to node-local peer ``p``: one stream per peer,
  so pushes to different peers run on different copy engines at once, and a
  lane blocked on one peer's grant never holds up another peer;
* ``COMPUTE`` runs grants, arrival waits and the accumulate kernel;
* ``NET`` runs NCCL (the inter-node exchanges of both collectives).

An executor records one event on the user's stream when it is created (from
the backend's spare fork events, returned by ``finish``: a stream wait takes
an event's state when it is issued, so a later re-record cannot affect it). Each
lane waits on that event before its first operation of the collective (lazily,
so unused lanes cost nothing): everything the user issued before the call is
ordered before the collective. ``finish`` records an event on every lane used;
the completion makes a stream wait on those events (no host synchronisation).

Lanes are shared by successive collectives and run in issue order, which every
rank shares, so the flag protocol of ``_arena`` cannot deadlock.

[Note: split pushes]
A large batch to or from a peer can be cut into ``push_split`` runs of equal
bytes (``TIDE_CE_SPLIT``), each on its own stream forked from the lane and
joined back before the lane's next operation, so several copy engines share
the link. Still no SM. On 2xH200 one engine per lane was as fast as two or
three (development record run3's sweep, in git history), so the default is 1.

[Note: buffer lifetimes]
Buffers the collective allocates (``Backend.empty``: the reduce-scatter's
partial sums and results) are held by the backend, with the events of the
collective that follows their allocation, until those events have fired: so
CuPy's pool cannot recycle them while a lane still writes them, even when the
caller drops them at once or waits on a stream other than the one they were
allocated on. Accumulate tables live in their own ring (``accumulate``).
The caller's inputs must stay alive until the work is waited on, as with any
asynchronous CUDA call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._base import Completion, Executor
from .copies import CudaBatch
from .streams import stream_ptr

if TYPE_CHECKING:
    from .accumulate import Accumulator
    from .copies import Copier
    from .flags import FlagOps
    from .nccl import NcclLink
    from .watchdog import Watchdog

def _event() -> Any:
    import cupy

    return cupy.cuda.Event(block=False, disable_timing=True)


@dataclass
class Lanes:
    """Everything an executor issues onto: this rank's device, one stream per lane
    ([Note: streams]) and the engines behind the primitives. ``CudaBackend.setup``
    makes it once; an executor reads nothing else of the backend."""

    device: int
    local_rank: int
    streams: list  # lanes 0..L-1 (node-local peers), then COMPUTE and NET
    aux_streams: list  # per peer lane, push_split - 1 more ([Note: split pushes])
    push_split: int
    copier: Copier
    flags: FlagOps
    accumulator: Accumulator
    watchdog: Watchdog
    retire: Callable[[list], None]  # holds the call's buffers ([Note: buffer lifetimes])
    nccl: Optional[NcclLink] = None  # between nodes only
    #: ``stream -> bool``: whether a stream is capturing a graph (``driver``).
    capturing: Callable[[int], bool] = lambda stream: False
    events: EventRing = field(default_factory=lambda: EventRing())
    fork_events: list = field(default_factory=list)  # spare fork events, reused
    mark_events: list = field(default_factory=list)  # spare mark events, reused


class EventRing:
    """Events for orderings that are waited on right after they are recorded
    (split forks and joins, lane dependencies), reused in turn rather than
    created and destroyed per use. A stream wait takes the event's state when
    it is issued, so re-recording an event later cannot affect it."""

    def __init__(self, size: int = 64) -> None:
        self._events = [_event() for _ in range(size)]
        self._next = 0

    def take(self) -> Any:
        ev = self._events[self._next]
        self._next = (self._next + 1) % len(self._events)
        return ev


@functools.cache
def _stream_wait_event() -> Callable[[int, int, int], None]:
    """CuPy's ``streamWaitEvent``, looked up once (a ``Work.wait`` per unit per pass)."""
    import cupy

    return cupy.cuda.runtime.streamWaitEvent


class CudaCompletion(Completion):
    """Events on the lanes a collective used. ``stream``: the one stream handle its one
    event was last recorded on (a graph launch's; None for an eager call's)."""

    def __init__(self, events: list) -> None:
        self._events = events
        self.stream: int | None = None

    def wait(self, stream: Any = None) -> None:
        ptr = stream_ptr(stream)
        wait_event = _stream_wait_event()
        for ev in self._events:
            wait_event(ptr, ev.ptr, 0)

    def query(self) -> bool:
        return all(ev.done for ev in self._events)


class CudaExecutor(Executor):
    """Issues one collective's primitives onto the lane streams of ``lanes``.

    On a stream that is capturing a graph (the user's, or a graph plan's own:
    [Note: graph plans] in ``graphs``), the lanes fork from it and ``finish``'s
    events join them back into it; copies go one by one (a graph takes no batch),
    and nothing is registered with the watchdog or retired, since events
    recorded in a capture cannot be queried.
    """

    def __init__(self, lanes: Lanes, local_size: int, stream: Any) -> None:
        super().__init__(local_size)
        import cupy

        self.lanes = lanes
        rt = cupy.cuda.runtime
        self._prev_device = rt.getDevice()
        if self._prev_device != lanes.device:  # another library moved the current device
            rt.setDevice(lanes.device)
        forks = lanes.fork_events
        self._fork = forks.pop() if forks else _event()
        ptr = stream_ptr(stream)
        self.capture = lanes.capturing(ptr)
        rt.eventRecord(self._fork.ptr, ptr)
        self._started: set[int] = set()
        self._waits: list[tuple[int, int]] = []  # for the watchdog ([Note: watchdog])
        self._uses_nccl = False
        self._marks: list = []  # back to the spare marks at finish, every wait issued

    def _lane(self, lane: int) -> Any:
        """Lane ``lane``'s stream, made to wait for the fork on first use."""
        s = self.lanes.streams[lane]
        if lane not in self._started:
            s.wait_event(self._fork)
            self._started.add(lane)
        return s

    def _copy(self, lane: int, copies: Any, local: bool) -> None:
        """One batch; a plan's split push over ``push_split`` streams ([Note: split pushes])."""
        copier = self.lanes.copier
        if not isinstance(copies, CudaBatch):  # raw copies: planned for this call only
            to_peer = lane < self.COMPUTE and lane != self.lanes.local_rank
            copies = copier.plan(copies, local, self.lanes.push_split if to_peer else 1,
                                 kernel=False)
        s = self._lane(lane)
        runs = copies.runs
        if len(runs) == 1:
            copier.issue(s.ptr, runs[0], s, self.capture)
            return
        fork, joins = self.lanes.events.take(), []
        fork.record(s)
        for k, run in enumerate(runs):
            aux = s if k == 0 else self.lanes.aux_streams[lane][k - 1]
            if k:
                aux.wait_event(fork)
            copier.issue(aux.ptr, run, aux, self.capture)
            if k:
                joins.append(self.lanes.events.take())
                joins[-1].record(aux)
        for ev in joins:  # the lane's next op (the arrival signal) follows every run
            s.wait_event(ev)

    def _multicast_copy(self, lane: int, buffer: Any, copies: list) -> None:
        # One write per piece, to the multicast mapping: the switch fans it out.
        self.lanes.copier.copy(self._lane(lane).ptr,
                               [(buffer.mc_ptr + off, src, n) for off, src, n in copies],
                               capture=self.capture)

    def _signal(self, lane: int, addr: int, value: int) -> None:
        self.lanes.flags.signal(self._lane(lane), addr, value, self.capture)

    def _wait(self, lane: int, addr: int, value: int) -> None:
        self.lanes.flags.wait(self._lane(lane), addr, value, self.capture)
        self._waits.append((addr, value))

    def _accumulate(self, lane: int, pieces: list, src_dtype: Any, scale: float,
                    out_dtype: Any) -> None:
        self.lanes.accumulator.launch(self._lane(lane), pieces, src_dtype, scale, out_dtype,
                                      self.capture)

    def _zero(self, lane: int, addr: int, nbytes: int) -> None:
        import cupy

        cupy.cuda.runtime.memsetAsync(addr, 0, nbytes, self._lane(lane).ptr)

    def _exchange(self, lane: int, sends: list, recvs: list) -> None:
        self._uses_nccl = True
        self.lanes.nccl.exchange(self._lane(lane).ptr, sends, recvs)

    def _depend(self, lane: int, on: int) -> None:
        ev = self.lanes.events.take()
        ev.record(self._lane(on))
        self._lane(lane).wait_event(ev)

    def _mark(self, lane: int) -> Any:
        # Its own event, not the ring's: a mark may be waited on many operations later.
        marks = self.lanes.mark_events
        ev = marks.pop() if marks else _event()
        ev.record(self._lane(lane))
        self._marks.append(ev)
        return ev

    def _after(self, lane: int, mark: Any) -> None:
        self._lane(lane).wait_event(mark)

    @property
    def waits(self) -> list[tuple[int, int]]:
        """The (flag address, value) pairs this collective's lanes wait for."""
        return self._waits

    @property
    def abort(self) -> Optional[Callable[[], None]]:
        """What ends this collective's NCCL work (None: it issued none)."""
        nccl = self.lanes.nccl
        return nccl.abort if self._uses_nccl and nccl else None

    def finish(self) -> CudaCompletion:
        events = []
        for lane in sorted(self._started):
            ev = _event()
            ev.record(self.lanes.streams[lane])
            events.append(ev)
        if events:  # every lane's wait on the fork is issued: it can be re-recorded
            self.lanes.fork_events.append(self._fork)
        else:  # nothing issued: completion is the fork itself
            events.append(self._fork)
        self.lanes.mark_events += self._marks  # likewise every wait on a mark
        if not self.capture:
            self.lanes.retire(events)
            self.lanes.watchdog.watch("collective", events, self._waits, self.abort)
        if self._prev_device != self.lanes.device:
            import cupy

            cupy.cuda.runtime.setDevice(self._prev_device)
        return CudaCompletion(events)
