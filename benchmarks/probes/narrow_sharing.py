"""Do the GEMM's slow pairs beside the narrow accumulate come with two narrow CTAs on
one SM? (diagnostic)

    mpirun -n 1 python benchmarks/probes/narrow_sharing.py [PAIRS] [RECORD.json]

One GEMM's CTA and one narrow CTA fit on an SM together; two narrow CTAs and a GEMM's
CTA do not. Nothing stops the block scheduler from putting two narrow CTAs on an SM
that is idle when the kernel starts (between two GEMMs), and then that SM holds a
GEMM's CTA back. This runs alone-then-beside pairs (as in
``benchmarks.harness.interference``) beside the library's narrow kernel and the probe's
flat one, each with counters edited in: per SM, the most CTAs of the kernel resident
at once over the pair. It prints each pair's GEMM slowdown beside the SMs that held
two or more, and the SMs that held none, and each kernel's time alone and beside the
GEMM (the counters slow the library's kernel).

On one H200 the answer was no: pairs with dozens of SMs doubled ran the GEMM within 3%
of alone, and a kernel that let only one CTA per SM work (at ``da6723a``, where this
script also ran those variants) slowed the GEMM in nearly every pair
(benchmarks/results/run16-one-h200).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import cupy as cp
import numpy as np

sys.path.insert(0, os.getcwd())
from benchmarks.probes.narrow_probe import (  # noqa: E402
    GEMM,
    SOURCE,
    AccumPiece,
    N,
    StreamedAccumulator,
    bfloat16,
    ctx,
    dev,
    edited,
    finish,
    git_commit,
    interference,
    library_kernel,
    narrow_kernel,
    sources,
    timed,
    variant_source,
)

_GLOBALS = "__device__ int tide_occ[1024];\n__device__ int tide_peak[1024];\n"
_ENTER = ("    unsigned tide_sm;\n    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(tide_sm));\n"
          "    if (threadIdx.x == 0) atomicMax(&tide_peak[tide_sm], "
          "atomicAdd(&tide_occ[tide_sm], 1) + 1);\n")
_END = ("            parity ^= 1;\n        }\n    }\n}\n",
        "            parity ^= 1;\n        }\n    }\n"
        "    if (threadIdx.x == 0) atomicSub(&tide_occ[tide_sm], 1);\n}\n")
LIBRARY = (("    const unsigned data = smem_addr(smem), bars = data + DATA_BYTES;\n",
            "    const unsigned data = smem_addr(smem), bars = data + DATA_BYTES;\n" + _ENTER),
           _END)
FLAT = (("    const int lane = threadIdx.x;\n", "    const int lane = threadIdx.x;\n" + _ENTER),
        _END)


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    sms = dev.num_sms
    gemm = dev.gemm(*GEMM)
    first_alone = interference.gemm_loop(ctx, None, 0.0, gemm, 1.0)[0]
    record = {"commit": git_commit(), "device": cp.cuda.runtime.getDeviceProperties(
        dev.dev.id)["name"].decode(), "n": N, "gemm": GEMM, "rows": []}
    print(f"{record['device']}: {sms} SMs; GEMM alone {first_alone * 1e6:.1f} us", flush=True)
    scale = np.float32(0.5)
    for n_src in (2, 1):
        srcs, want = sources(n_src, scale)
        out = cp.empty(N, cp.float32)
        pieces = (AccumPiece(out.data.ptr, tuple(s.data.ptr for s in srcs), N),)
        acc = StreamedAccumulator(dev.dev.id, sms, kernel="narrow")
        _, lib_mod = library_kernel(acc, _GLOBALS + edited(variant_source("narrow"), LIBRARY))
        cases = [("narrow (library)", lib_mod,
                  partial(acc.launch, dev.stream, pieces, bfloat16, float(scale)))]
        fn, smem, flat_mod = narrow_kernel(n_src, 2048, 2, 2, "__maxnreg__(32)", 1, 0,
                                           _GLOBALS + edited(SOURCE, FLAT))
        args = (srcs[0], srcs[-1], out, np.int64(N // 2048), scale)

        def flat(fn=fn, smem=smem, args=args) -> None:
            with dev.stream:
                fn((sms,), (32,), args, shared_mem=smem)
        cases.append(("narrow c2048x2 runs (flat)", flat_mod, flat))
        for name, mod, launch in cases:
            peak = cp.ndarray((1024,), cp.int32, mod.get_global("tide_peak"))
            out.fill(np.nan)
            t = timed(launch)
            ok = bool(cp.array_equal(out, want))
            print(f"  {n_src} src {name:<28} bitwise {ok}", flush=True)
            record.setdefault("bitwise", []).append([n_src, name, ok])
            if not ok:
                record["failed"] = True
            for k in range(pairs):
                peak.fill(0)
                dev.sync()
                p = interference._pair(ctx, launch, t, gemm, first_alone)
                counts = peak.get()[:sms]
                slow = p["under_s"] / p["alone_s"] - 1 if p else None
                row = {"sources": n_src, "kernel": name, "pair": k, "time_s": t,
                       "gemm_slowdown": slow, "sms_doubled": int((counts >= 2).sum()),
                       "sms_empty": int((counts == 0).sum()), "peak": int(counts.max())}
                if p:
                    row["beside_s"] = p["collective_beside_s"]
                record["rows"].append(row)
                print(f"  {n_src} src {name:<28} pair {k:2d}: alone {t * 1e6:4.0f} us, beside "
                      + (f"{p['collective_beside_s'] * 1e6:4.0f} us; GEMM {slow * 100:+6.1f}%"
                         if p else "n/a")
                      + f"; SMs with >= 2 CTAs at once {row['sms_doubled']:3d}, with none "
                      f"{row['sms_empty']:3d}, most on one {row['peak']}", flush=True)
        del srcs, out, want
    finish(record, sys.argv[2] if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    main()
