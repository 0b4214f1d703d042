"""Host time of ``cuGraphLaunch`` by what a graph holds: which node kinds and how many
streams make a graph plan's launch cost 20-50 us where a graph of copies costs 3 us.

    python benchmarks/probes/graph_launch.py [--out DIR]

One process, one GPU. Each graph is captured on a stream of its own (forked streams
join back through events, as the executor's lanes do), instantiated and uploaded, then
launched ``--iters`` times: once with the device idle before each launch (synchronized
outside the timing), once back to back (the queue filling, as in a training loop). The
median host time of the launch call is printed per graph, with the node count.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from typing import Any, Callable

import cupy

from tidearray.backends.cuda import driver

NBYTES = 4096


def _ok(err: int, what: str) -> None:
    """A driver call's CUresult, checked (not by ``assert``: the calls must run under -O)."""
    if err:
        raise RuntimeError(f"{what}: CUresult {err}")


def _capture(calls: Any, count_nodes: Callable[..., int],
             build: Callable[[Any], None]) -> tuple[Any, int]:
    origin = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.deviceSynchronize()
    _ok(calls.begin(origin.ptr, 1), "cuStreamBeginCapture")  # thread-local mode
    build(origin)
    graph = ctypes.c_void_p()
    _ok(calls.end(origin.ptr, ctypes.byref(graph)), "cuStreamEndCapture")
    exec_ = ctypes.c_void_p()
    _ok(calls.instantiate(ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
    _ok(calls.upload(exec_, origin.ptr), "cuGraphUpload")
    origin.synchronize()
    count = ctypes.c_size_t()
    _ok(count_nodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    return exec_, int(count.value)


def _forked(streams: int, per_stream: Callable[[Any, int], None]) -> Callable[[Any], None]:
    """``per_stream(stream, k)`` on ``streams`` streams forked from the origin and joined."""
    side = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)]

    def build(origin: Any) -> None:
        fork = cupy.cuda.Event(disable_timing=True)
        fork.record(origin)
        joins = []
        for k, s in enumerate(side):
            s.wait_event(fork)
            per_stream(s, k)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(s)
            joins.append(ev)
        for ev in joins:
            origin.wait_event(ev)
    return build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    calls = driver.GraphCalls()
    count_nodes = driver.entry("cuGraphGetNodes", driver.CUDA_12_0, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p)
    write = driver.stream_value32("Write")
    wait = driver.stream_value32("Wait")
    src = cupy.zeros(256 * NBYTES, cupy.uint8)
    dst = cupy.zeros(256 * NBYTES, cupy.uint8)
    words = cupy.zeros(1024, cupy.int32)
    small = cupy.zeros(256, cupy.float32)
    small += 1  # compiled before any capture
    rt = cupy.cuda.runtime
    d2d = rt.memcpyDeviceToDevice

    def copies(n: int) -> Callable[[Any, int], None]:
        def issue(s: Any, k: int) -> None:
            for i in range(n):
                j = k * n + i
                rt.memcpyAsync(dst.data.ptr + j * NBYTES, src.data.ptr + j * NBYTES, NBYTES,
                               d2d, s.ptr)
        return issue

    def memops(n: int) -> Callable[[Any, int], None]:
        def issue(s: Any, k: int) -> None:
            for i in range(n):
                addr = words.data.ptr + 4 * (k * n + i)
                _ok(write(s.ptr, addr, 1, 0), "cuStreamWriteValue32")
                _ok(wait(s.ptr, addr, 1, 0), "cuStreamWaitValue32")  # GEQ (0): the write
        return issue

    def kernels(n: int) -> Callable[[Any, int], None]:
        def issue(s: Any, k: int) -> None:
            with s:
                for _ in range(n):
                    small.__iadd__(1)
        return issue

    def mixed(n: int) -> Callable[[Any, int], None]:  # a lane: copies, a signal, a wait
        c, m = copies(n), memops(1)

        def issue(s: Any, k: int) -> None:
            c(s, k)
            m(s, k)
        return issue

    graphs = {
        "1 copy, 1 stream": _forked(1, copies(1)),
        "256 copies, 1 stream": _forked(1, copies(256)),
        "256 copies, 4 streams": _forked(4, copies(64)),
        "256 copies, 8 streams": _forked(8, copies(32)),
        "64 write+wait memops, 1 stream": _forked(1, memops(64)),
        "64 write+wait memops, 4 streams": _forked(4, memops(16)),
        "8 write+wait memops, 1 stream": _forked(1, memops(8)),
        "64 kernels, 1 stream": _forked(1, kernels(64)),
        "4 lanes x (64 copies + write + wait)": _forked(4, mixed(64)),
    }
    records = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for name, build in graphs.items():
        exec_, nodes = _capture(calls, count_nodes, build)
        for _ in range(20):
            calls.launch(exec_, stream.ptr)
        stream.synchronize()
        idle, queued = [], []
        for _ in range(args.iters):
            stream.synchronize()
            t0 = time.perf_counter_ns()
            calls.launch(exec_, stream.ptr)
            idle.append(time.perf_counter_ns() - t0)
        stream.synchronize()
        for _ in range(args.iters):
            t0 = time.perf_counter_ns()
            calls.launch(exec_, stream.ptr)
            queued.append(time.perf_counter_ns() - t0)
        stream.synchronize()
        rec = {"graph": name, "nodes": nodes, "idle_us": statistics.median(idle) / 1e3,
               "queued_us": statistics.median(queued) / 1e3,
               "commit": os.environ.get("TIDE_GIT_COMMIT", "unknown")}
        records.append(rec)
        print(f"{name:40s} {nodes:4d} nodes  launch {rec['idle_us']:7.2f} us idle, "
              f"{rec['queued_us']:7.2f} us queued", flush=True)
    with open(os.path.join(args.out, "graph_launch.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
