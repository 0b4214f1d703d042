"""What copies cost to issue and to run (diagnostic): ``python benchmarks/probes/issue_probe.py``.

One process, one GPU, 393 copies (Qwen3-30B-A3B's layer has 393 parameters):

* ``issue``: host time of one batch of 393 copies of 1 MiB, within the GPU (which
  the driver runs on the SMs), from pinned host memory and into it (copy
  engines): medians of 25;
* ``own copy``: device time of 393 copies of 1.5 MiB within the GPU, as the
  driver's batch (cut to 8 MiB, host issue included), as a batch that asks for a
  copy engine (``PREFER_OVERLAP_WITH_COMPUTE``), and as one launch of the
  copy kernel (``pack_bytes``) at several grids and block sizes: medians of 15;
* ``engine``: the rate of same-device copies asking for a copy engine, for the
  Llama-3.1-8B unit's own copy at 2 ranks (one copy per parameter) and one
  256 MiB copy, on 1, 2 and 4 streams, against the same copies on the SMs.

``python benchmarks/probes/issue_probe.py engine`` runs only the last part.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import cupy as cp

sys.path.insert(0, os.getcwd())
from tests.gpu._copies import FlaggedBatch  # noqa: E402
from tidearray.backends.cuda import copies  # noqa: E402

N = 393
stream = cp.cuda.Stream(non_blocking=True)
copier = copies.Copier(None, 8 << 20)
copier.probe(stream.ptr)
engine = FlaggedBatch()


def host_us(fn, k: int = 25) -> float:
    out = []
    for _ in range(k):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    cp.cuda.Device().synchronize()
    return statistics.median(out)


def device_us(fn, k: int = 15) -> float:
    a, b, out = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(k):
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(out)


def issue() -> None:
    size = 1 << 20
    srcs = [cp.zeros(size, cp.uint8) for _ in range(N)]
    dst = cp.zeros(N * size, cp.uint8)
    host = cp.cuda.alloc_pinned_memory(N * size)
    kinds = {
        "within the GPU": tuple((dst.data.ptr + i * size, a.data.ptr, size)
                                for i, a in enumerate(srcs)),
        "host to device": tuple((dst.data.ptr + i * size, host.ptr + i * size, size)
                                for i in range(N)),
        "device to host": tuple((host.ptr + i * size, a.data.ptr, size)
                                for i, a in enumerate(srcs)),
    }
    for name, batch in kinds.items():
        us = host_us(lambda b=batch: copier.copy(stream.ptr, b))
        print(f"issue  {name:16s} {N} copies of 1 MiB, one batch: {us:7.0f} us of host time")
    us = host_us(lambda b=kinds["within the GPU"]: engine.copy(stream.ptr, b, local=True))
    print(f"issue  within the GPU, asking for a copy engine, one batch: {us:7.0f} us of host time")


def own_copy() -> None:
    size = 3 << 19
    srcs = [cp.ones(size, cp.uint8) for _ in range(N)]
    dst = cp.zeros(N * size, cp.uint8)
    batch = tuple((dst.data.ptr + i * size, a.data.ptr, size) for i, a in enumerate(srcs))
    total = N * size
    us = device_us(lambda: copier.copy(stream.ptr, batch, local=True))
    print(f"own copy  driver batch, cut to 8 MiB:      {us:7.0f} us  {total / us / 1e3:6.0f} GB/s")
    dst.fill(0)
    us = device_us(lambda: engine.copy(stream.ptr, batch, local=True))
    assert bool((dst == 1).all()), "the flagged batch left bytes unwritten"
    print(f"own copy  batch asking for a copy engine:  {us:7.0f} us  {total / us / 1e3:6.0f} GB/s")
    for threads in (512, 1024):
        copies.KERNEL_THREADS = threads
        for ctas in (8, 16, 33, 66, 132):
            kernel = copies._KernelCopy(batch, cp.cuda.Device().id, ctas)
            us = device_us(lambda k=kernel: k(stream))
            print(f"own copy  kernel {threads:4d} threads x {ctas:3d} CTAs: {us:7.0f} us  "
                  f"{total / us / 1e3:6.0f} GB/s  {total / us / 1e3 / ctas:5.1f} GB/s per CTA")


def engine_rate() -> None:
    from benchmarks.harness.workloads import units
    from tidearray._copies import split_copies
    from tidearray._layout import cached_unit

    unit = next(u for u in units() if u.name == "llama3.1-8b")
    layout = cached_unit(tuple(unit.shapes), 2, 2)
    share = sum(spec.byte_range(0)[1] for spec in layout.specs)
    src = cp.random.randint(0, 255, share, dtype=cp.uint8)
    dst = cp.empty(layout.nbytes, cp.uint8)
    own, at = [], 0
    for spec, off in zip(layout.specs, layout.offsets):
        start, n = spec.byte_range(0)
        own.append((dst.data.ptr + off + start, src.data.ptr + at, n))
        at += n
    big = 256 << 20
    a, b = cp.empty(big, cp.uint8), cp.empty(big, cp.uint8)
    extra = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    for name, batch in (("Llama-3.1-8B own copy", tuple(own)),
                        ("one 256 MiB copy", ((b.data.ptr, a.data.ptr, big),))):
        nbytes = sum(n for _, _, n in batch)
        for ways in (1, 2, 4):
            runs = [tuple(r) for r in split_copies(batch, ways) if r] if ways > 1 else [batch]
            for label, c in (("SMs (driver, cut)", copier), ("asking for an engine", engine)):
                def go(c=c, runs=runs) -> None:
                    fork = cp.cuda.Event(disable_timing=True)
                    fork.record(stream)
                    for s, r in zip([stream, *extra], runs):
                        if s is not stream:
                            s.wait_event(fork)
                        c.copy(s.ptr, r, local=True)
                    for s in extra[:len(runs) - 1]:
                        join = cp.cuda.Event(disable_timing=True)
                        join.record(s)
                        stream.wait_event(join)
                dst.fill(0)
                us = device_us(go)
                if name.startswith("Llama"):
                    got = cp.concatenate([dst[d - dst.data.ptr: d - dst.data.ptr + n]
                                          for d, _, n in own])
                    assert bool(cp.array_equal(got, src)), f"{label}: wrong bytes"
                print(f"engine  {name:22s} {nbytes / 1e6:6.0f} MB on {ways} stream(s), "
                      f"{label:20s}: {us:7.0f} us  {nbytes / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, commit "
          f"{os.environ.get('TIDE_GIT_COMMIT', 'unknown')}")
    if sys.argv[1:] != ["engine"]:
        issue()
        own_copy()
    engine_rate()
