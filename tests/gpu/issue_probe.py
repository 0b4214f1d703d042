"""What copies cost to issue and to run (diagnostic): ``python tests/gpu/issue_probe.py``.

One process, one GPU, 393 copies (Qwen3-30B-A3B's layer has 393 parameters):

* ``issue``: host time of one batch of 393 copies of 1 MiB, within the GPU (which
  the driver runs on the SMs), from pinned host memory and into it (copy
  engines): medians of 25;
* ``own copy``: device time of 393 copies of 1.5 MiB within the GPU, as the
  driver's batch (cut to 8 MiB, host issue included) and as one launch of the
  copy kernel (``pack_bytes``) at several grids and block sizes: medians of 15.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import cupy as cp

sys.path.insert(0, os.getcwd())
from tidearray.backends.cuda import copies  # noqa: E402

N = 393
stream = cp.cuda.Stream(non_blocking=True)
copier = copies.Copier(None, 8 << 20)
copier.probe(stream.ptr)


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


def own_copy() -> None:
    size = 3 << 19
    srcs = [cp.ones(size, cp.uint8) for _ in range(N)]
    dst = cp.zeros(N * size, cp.uint8)
    batch = tuple((dst.data.ptr + i * size, a.data.ptr, size) for i, a in enumerate(srcs))
    total = N * size
    us = device_us(lambda: copier.copy(stream.ptr, batch, local=True))
    print(f"own copy  driver batch, cut to 8 MiB:      {us:7.0f} us  {total / us / 1e3:6.0f} GB/s")
    for threads in (512, 1024):
        copies.KERNEL_THREADS = threads
        for ctas in (8, 16, 33, 66, 132):
            kernel = copies._KernelCopy(batch, cp.cuda.Device().id, ctas)
            us = device_us(lambda k=kernel: k(stream))
            print(f"own copy  kernel {threads:4d} threads x {ctas:3d} CTAs: {us:7.0f} us  "
                  f"{total / us / 1e3:6.0f} GB/s  {total / us / 1e3 / ctas:5.1f} GB/s per CTA")


if __name__ == "__main__":
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, commit "
          f"{os.environ.get('TIDE_GIT_COMMIT', 'unknown')}")
    issue()
    own_copy()
