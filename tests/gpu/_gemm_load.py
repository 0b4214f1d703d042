"""A GEMM load for ``tests/gpu/run.sh``'s stress step: bf16-sized matrix products on the
GPU, back to back, until the file named on the command line exists (or for
``--seconds``), so the timing-sensitive tests share the SMs and the memory with compute
the way a training step's would.

Usage: ``python3 tests/gpu/_gemm_load.py STOP_FILE [--size 8192] [--seconds 900]``
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stop_file", help="stop once this file exists")
    ap.add_argument("--size", type=int, default=8192, help="square matrix side (8192)")
    ap.add_argument("--seconds", type=float, default=900.0, help="stop after this long (900)")
    args = ap.parse_args()

    import cupy

    a = cupy.random.standard_normal((args.size, args.size), dtype=cupy.float32).astype(
        cupy.float16)
    b = cupy.random.standard_normal((args.size, args.size), dtype=cupy.float32).astype(
        cupy.float16)
    c = cupy.empty_like(a)
    stream = cupy.cuda.Stream(non_blocking=True)
    t0, products = time.monotonic(), 0
    with stream:
        while not os.path.exists(args.stop_file) and time.monotonic() - t0 < args.seconds:
            for _ in range(8):  # a burst between checks: the GPU stays busy
                cupy.matmul(a, b, out=c)
            products += 8
            stream.synchronize()
    print(f"gemm load: {products} products of {args.size}^3 (fp16) in "
          f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
