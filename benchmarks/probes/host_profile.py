"""Where a gather plan's time goes (diagnostic).

    mpirun -n 2 python benchmarks/probes/host_profile.py

For the Llama-3.1-8B unit (or the unit named by ``TIDE_PROFILE_UNIT``, e.g.
``qwen3-30b-a3b``) it prints, per rank, medians over timed calls of:

* ``call``: the plan call as the benchmark times it (events around the call on an
  idle stream: host issue included);
* ``pre-issued``: the same call issued behind a 2 ms spinning kernel, timed from
  the kernel's end, so the host's issue is hidden: what the device itself takes;
* ``push``: one plain ``cudaMemcpyAsync`` of this rank's share to the peer, the
  benchmark's copy-engine bound, also pre-issued;
* ``push+own``: that push, and beside it (another stream) the local copy of the
  same share into this rank's own slot, as an out-of-place gather must do;
* ``pieces``: the plan's own pushes (one copy per parameter, as the slot layout
  puts each parameter's rows apart), as plain ``cudaMemcpyAsync`` calls, and
  ``batch``: the same copies as the plan's one batch, both without flags;
* ``own batch``: the plan's own copies (within the GPU, cut) as one batch, without
  flags: what such copies cost to issue;
* ``host``: the call's host time, and each primitive's share of it (wrapped
  executor methods), plus the top of a cProfile of the calls on rank 0;
* with ``TIDE_PROFILE_CAST=1``, the same for a cast plan (fp32 masters).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.getcwd())
import tidearray as ta  # noqa: E402
from benchmarks.harness.plans import raw_copies  # noqa: E402
from benchmarks.harness.workloads import units  # noqa: E402
from tidearray.backends.cuda import executor as cex  # noqa: E402

ITERS = 30
SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}""", "spin")

comm = MPI.COMM_WORLD
g = ta.init()
shapes = {u.name: u for u in units()}[os.environ.get("TIDE_PROFILE_UNIT", "llama3.1-8b")].shapes
cast = os.environ.get("TIDE_PROFILE_CAST") == "1"
unit = ta.Unit(shapes, ta.bfloat16)
arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=1)
dtype = np.float32 if cast else ta.bfloat16
shards = [cp.zeros(s, dtype) for s in unit.shard_shapes]
plan = unit.gather_plan(shards, arena[0], cast=cast)
stream = cp.cuda.Stream(non_blocking=True)
spent: dict = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t0
    return wrapper


for name in ("_copy", "_signal", "_wait", "_accumulate", "_depend", "finish", "_lane"):
    setattr(cex.CudaExecutor, name, timed(name, getattr(cex.CudaExecutor, name)))
cex.CudaExecutor.__init__ = timed("executor()", cex.CudaExecutor.__init__)
cex.CudaCompletion.wait = timed("completion.wait", cex.CudaCompletion.wait)


def events():
    return (cp.cuda.Event(), cp.cuda.Event())


def one(pre_issue: bool, fn) -> tuple[float, float]:
    stream.synchronize()
    comm.Barrier()
    a, b = events()
    if pre_issue:
        SPIN((1,), (1,), (np.int64(4_000_000),), stream=stream)  # ~2 ms
    a.record(stream)
    h0 = time.perf_counter()
    fn()
    host = time.perf_counter() - h0
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3, host * 1e6


me, L = g.local_rank, g.local_size
nbytes = sum(s.byte_range(g.rank)[1] for s in unit.layout.specs)


def push() -> None:
    for k in range(1, L):
        p = (me + k) % L
        cp.cuda.runtime.memcpyAsync(arena[0].ptr(p), arena[0].ptr(me), nbytes, 4, stream.ptr)


side = cp.cuda.Stream(non_blocking=True)
fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
own = cp.zeros(nbytes, cp.uint8)


def push_and_own() -> None:
    fork.record(stream)
    side.wait_event(fork)
    cp.cuda.runtime.memcpyAsync(arena[0].ptr(me), own.data.ptr, nbytes, 3, side.ptr)
    push()
    join.record(side)
    stream.wait_event(join)


pieces = raw_copies(plan._program(arena[0]))[1][(me + 1) % L] if L > 1 else ()


def plain_pieces() -> None:
    for dst, src, n in pieces:
        cp.cuda.runtime.memcpyAsync(dst, src, n, 4, stream.ptr)


def batch() -> None:
    g.backend.lanes.copier.copy(stream.ptr, pieces)


def own_batch() -> None:
    g.backend.lanes.copier.copy(stream.ptr, plan._program.own, local=True)


def call() -> None:
    plan(stream=stream)


for _ in range(5):
    one(False, call)
spent.clear()
rows = {}
for label, pre, fn in (("call", False, call), ("pre-issued", True, call),
                       ("push", True, push), ("push+own", True, push_and_own),
                       ("pieces", True, plain_pieces), ("batch", True, batch),
                       ("own batch", True, own_batch)):
    samples = [one(pre, fn) for _ in range(ITERS)]
    dev = comm.allreduce(np.median([s[0] for s in samples]), op=MPI.MAX)
    rows[label] = (dev, np.median([s[1] for s in samples]))
# Per call over the two timed rows of plan calls, taken before cProfile adds its own.
per_call = {name: 1e6 * s / (2 * ITERS) for name, s in spent.items()}
prof = cProfile.Profile()
prof.enable()
for _ in range(ITERS):
    one(False, call)
prof.disable()
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
for r in range(comm.size):
    if r == comm.rank:
        print(f"rank {r} ({'cast plan' if cast else 'plan'}, {nbytes} B per peer):")
        for label, (dev, host) in rows.items():
            print(f"  {label:11s} device {dev:8.1f} us (max over ranks)   host {host:6.1f} us")
        for name, us in sorted(per_call.items(), key=lambda kv: -kv[1]):
            print(f"  host in {name:16s} {us:7.1f} us per call")
        if r == 0:
            print(out.getvalue())
        sys.stdout.flush()
    comm.Barrier()
arena[0].free()
