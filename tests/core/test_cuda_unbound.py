"""The cuda backend's host-side logic without a GPU: a backend bound to no group
(``backends.array_backend(cupy)``: the optimizer's and the gradient norm's) must not need
the lanes a group's setup makes; device memory that a collected owner leaves must stay
until its readers are done."""

from __future__ import annotations

import gc
import random

from tidearray.backends.cuda import backend as cuda_backend
from tidearray.backends.cuda.streams import keep_until_read


def test_capturing_without_lanes_asks_the_driver(monkeypatch):
    """``capturing(stream)`` of a backend with no lanes queries ``cuStreamIsCapturing``
    itself (every fused AdamW step on cuda asks it), for the stream given."""
    unbound = cuda_backend.CudaBackend(None)
    assert unbound.lanes is None
    asked = []
    monkeypatch.setattr(cuda_backend.streams, "stream_ptr", lambda stream: 4096 + (stream or 0))
    monkeypatch.setattr(cuda_backend, "_is_capturing",
                        lambda: lambda ptr: asked.append(ptr) or ptr == 4097)
    assert unbound.capturing() is False
    assert unbound.capturing(1) is True
    assert asked == [4096, 4097]


def test_the_last_stream_object_is_resolved_once(monkeypatch):
    """``stream_ptr`` remembers the last stream object it resolved (a front end passes the
    same one to every call of a step); another object, None (the current stream, which
    moves) and an int handle are resolved each time, and an object met again after
    another is resolved again."""
    streams = cuda_backend.streams
    resolved = []
    monkeypatch.setattr(streams, "_resolve", lambda s: resolved.append(s) or 8192 + len(resolved))
    monkeypatch.setattr(streams, "_last_resolved", (None, 0))
    a, b = object(), object()
    assert [streams.stream_ptr(a) for _ in range(3)] == [8193] * 3
    assert streams.stream_ptr(b) == 8194 and streams.stream_ptr(b) == 8194
    assert streams.stream_ptr(a) == 8195
    assert streams.stream_ptr(None) == 8196 and streams.stream_ptr(None) == 8197
    assert streams.stream_ptr(7) == 8198 and streams.stream_ptr(7) == 8199
    assert resolved == [a, b, a, None, None, 7, 7]


def test_the_capture_query_counts_an_invalidated_capture(monkeypatch):
    """The capture query takes CuPy's ``streamIsCapturing``, which raises where an earlier
    error invalidated the capture: that stream is still capturing (as the driver's status
    says); any other error is raised."""
    import sys
    import types

    def query(ptr: int) -> bool:
        if ptr == 3:
            raise RuntimeError("the stream was capturing, but an error has invalidated the "
                               "capture sequence")
        if ptr == 4:
            raise RuntimeError("cudaErrorStreamCaptureImplicit")
        return ptr == 2

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(streamIsCapturing=query)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cuda_backend._is_capturing.cache_clear()
    try:
        capturing = cuda_backend._is_capturing()
        assert capturing(1) is False and capturing(2) is True and capturing(3) is True
        try:
            capturing(4)
        except RuntimeError as e:
            assert "Implicit" in str(e)
        else:
            raise AssertionError("expected the query's other error raised")
    finally:
        cuda_backend._is_capturing.cache_clear()


class _Event:
    """CuPy's ``Event`` as the collector sees it: its ``__del__`` destroys the handle."""

    def __init__(self, log: list) -> None:
        self.log, self.alive, self.fired = log, True, False

    @property
    def done(self) -> bool:
        self.log.append(("query", self.alive))  # a destroyed handle: the driver dies
        return self.fired

    def synchronize(self) -> None:
        self.log.append(("wait", self.alive))
        self.fired = True

    def __del__(self) -> None:
        self.alive = False


def test_an_owner_collected_in_a_cycle_waits_on_live_events_then_releases():
    """``keep_until_read`` ([Note: finalizers in cycles]): an owner collected with a
    reference cycle (as a graph plan held by a runtime) waits on its events while they
    are alive, whatever order the collector finalizes the cycle in, then releases, then
    lets the memory go; never before the owner goes."""
    log: list = []
    owners, events, keeps = [], [], []
    m = random.randint(2, 5)
    for _ in range(m):
        # Events made first: the collector would finalize them before the owner (a
        # ``__del__`` of the owner then saw every one destroyed, on CPython 3.11).
        evs = [_Event(log) for _ in range(random.randint(1, 3))]
        owner = type("Owner", (), {})()
        owner.cycle, owner.events, owner.keep = owner, evs, bytearray(8)  # as the graph's
        keep_until_read(owner, evs, owner.keep, lambda: log.append(("release", None)))
        owners.append(owner)
        events += evs
        keeps.append(owner.keep)
    del owner, evs
    gc.collect()
    assert log == [], "released while the owner lives"
    n = len(events)
    del owners, events, keeps
    gc.collect()
    assert [kind for kind, _ in log].count("release") == m
    queried = [alive for kind, alive in log if kind in ("query", "wait")]
    assert len(queried) == 2 * n, log  # each event queried, then waited on (it had not fired)
    assert all(queried), f"an event was used after its handle was destroyed: {log}"
    assert log[-1] == ("release", None)


def test_a_device_table_waits_for_its_readers_before_it_is_freed():
    """``keep_until_read``, as the cuda tables and graph plans use it: when the owner
    goes, a pending event is waited on and a fired one is not, then the release runs;
    an event whose context is gone (interpreter shutdown) raises nothing."""
    class Event:
        def __init__(self, done: bool, fail: bool = False) -> None:
            self.done, self.fail, self.waited = done, fail, 0

        def synchronize(self) -> None:
            if self.fail:
                raise RuntimeError("context destroyed")
            self.waited += 1

    class Owner:
        pass

    released: list = []
    pending, fired, gone = Event(False), Event(True), Event(False, fail=True)
    owner = Owner()
    keep_until_read(owner, [pending, fired], None, lambda: released.append("table"))
    assert (pending.waited, released) == (0, []), "waited while the owner lives"
    del owner
    assert (pending.waited, fired.waited, released) == (1, 0, ["table"])
    owner = Owner()
    keep_until_read(owner, [gone], None, lambda: released.append("gone"))
    del owner  # raises nothing, and releases nothing through a dead context
    assert (gone.waited, released) == (0, ["table"])


def test_no_finalizer_touches_the_device_inside_a_capture():
    """``no_release_in_capture`` (around tidearray's own thread-local captures): an owner
    that goes inside it, by its last reference or in a cycle, neither queries, waits nor
    releases until the capture ends (a query inside one invalidates it); the collector is
    off inside and back on after; nested captures release at the outer one's end."""
    from tidearray.backends.cuda.streams import no_release_in_capture

    log: list = []
    owners = []
    for k in range(random.randint(2, 4)):
        owner = type("Owner", (), {})()
        if k % 2:
            owner.cycle = owner
        keep_until_read(owner, [_Event(log)], None, lambda k=k: log.append(("release", k)))
        owners.append(owner)
    n = len(owners)
    assert gc.isenabled()
    with no_release_in_capture():
        assert not gc.isenabled(), "the collector may run a finalizer inside the capture"
        with no_release_in_capture():
            del owner
            owners.clear()
            gc.collect()  # (an explicit collection still runs: the finalizers must wait)
        assert log == [], f"touched the device inside the capture: {log}"
    assert gc.isenabled()
    assert [kind for kind, _ in log].count("release") == n, log
    assert [kind for kind, _ in log].count("query") == n, log
    # Overlapping captures (two threads): the collector stays off until the last one ends.
    first, second = no_release_in_capture(), no_release_in_capture()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled(), "a capture still open, the collector back on"
    second.__exit__(None, None, None)
    assert gc.isenabled()
