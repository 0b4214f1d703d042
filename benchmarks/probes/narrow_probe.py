"""Can one warp per SM keep pace as the accumulate? (diagnostic)

    mpirun -n 1 python benchmarks/probes/narrow_probe.py [RECORD.json]

A Hopper GEMM's CTA leaves 1,024 registers and about 19 KB of shared memory on its SM
(``benchmarks/probes/footprints.py``): room for one warp at 32 registers. An accumulate of that
shape shares every SM with a GEMM instead of holding SMs a GEMM waits for. This times
such kernels on flat arrays (no piece table, one CTA per SM, the sources streamed into
shared memory by bulk async copies), at one and two sources, against the library's
vector accumulate on its default grid and its narrow one (which walks the piece
table), and then the interference suite's single-wave GEMM beside each
(alone-then-beside pairs, as in ``benchmarks.harness.interference``).

Per kernel it reports the per-SM rate (elements per ns per SM), its registers and
local memory per thread (spills), and checks the output bitwise against the same sum
on the host side of CuPy. One GPU: the sources are local, so it says what the kernel
can do, not TIDE-RS's time between two GPUs. Between two H200s the accumulate must
keep pace with the copy engines: about 1.2 elements per ns per SM for the Llama-3.1-8B
unit (run 14: 109M elements per rank in 711 us).
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from types import SimpleNamespace

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.getcwd())
from benchmarks.harness import interference  # noqa: E402
from benchmarks.harness.device import CudaDevice  # noqa: E402
from benchmarks.harness.records import git_commit  # noqa: E402
from benchmarks.variants.accumulate import (  # noqa: E402
    DIR,
    NARROW_MAX_SOURCES,
    NARROW_SMEM,
    StreamedAccumulator,
)
from benchmarks.variants.accumulate import source as variant_source  # noqa: E402
from tests.gpu._timing import timed_on  # noqa: E402
from tidearray._dtypes import bfloat16  # noqa: E402
from tidearray.backends._base import AccumPiece  # noqa: E402
from tidearray.backends.cuda.accumulate import Accumulator, Kernel  # noqa: E402

#: Elements per source: the Llama-3.1-8B unit's shard per rank at two ranks.
N = 109 * (1 << 20)
PAIRS = 3
GEMM = (1024, 2048, 16384)

#: The flat kernel; the bulk-copy helpers are the variants' (benchmarks/variants/bulk_copy.cuh).
SOURCE = (DIR / "bulk_copy.cuh").read_text() + r"""
typedef unsigned short u16;
typedef long long i64;

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// Lane 0 loads chunk c of every source into stage s. TOUCH: what else lane 0 does
// with shared memory (a word past the barriers) around the issue, as a walk that
// keeps its state there would: 1 store before the proxy fence, 2 store after the
// copies, 3 load before the fence.
__device__ __forceinline__ void issue(const u16* const* srcs, i64 c, unsigned data,
                                      unsigned bars, int s, volatile i64* spare) {
    const unsigned bar = bars + 8 * s;
    if (TOUCH == 1) *spare = c;
    if (TOUCH == 3) {
        volatile i64 r = *spare;
        (void)r;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    barrier_expect(bar, NSRC * CHUNK * 2);
#pragma unroll
    for (int k = 0; k < NSRC; ++k)
        bulk_load(data + (s * NSRC + k) * CHUNK * 2, srcs[k] + c * CHUNK, CHUNK * 2, bar);
    if (TOUCH == 2) *spare = c;
}

constexpr int kUnroll = UNROLL;

// s1 is read only with two sources.
extern "C" __global__ void BOUNDS
narrow(const u16* s0, const u16* s1, float* __restrict__ out, i64 n_chunks, float scale) {
    const u16* const srcs[2] = {s0, s1};
    extern __shared__ __align__(128) unsigned char smem[];
    volatile i64* spare = reinterpret_cast<volatile i64*>(smem + STAGES * NSRC * CHUNK * 2
                                                          + 8 * STAGES);
    const unsigned data = smem_addr(smem), bars = data + STAGES * NSRC * CHUNK * 2;
    const int lane = threadIdx.x;
    // CONTIG: each CTA takes a contiguous run of chunks, as the library's kernel
    // takes a run of tiles; else chunks grid-stride.
    const i64 step = CONTIG ? 1 : gridDim.x;
    const i64 first = CONTIG ? blockIdx.x * n_chunks / gridDim.x : blockIdx.x;
    const i64 last = CONTIG ? (blockIdx.x + 1) * n_chunks / gridDim.x : n_chunks;
    i64 next = first;
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES && next < last; ++s, next += step)
            issue(srcs, next, data, bars, s, spare);
    }
    __syncwarp();
    int stage = 0;
    unsigned parity = 0;
    for (i64 c = first; c < last; c += step) {
        barrier_wait(bars + 8 * stage, parity);
        const uint4* slot = reinterpret_cast<const uint4*>(smem + stage * NSRC * CHUNK * 2);
        float* o = out + c * CHUNK;
#pragma unroll (kUnroll)
        for (int u = lane; u < CHUNK / 8; u += 32) {
            uint4 x = slot[u];
            float v[8] = {lo(x.x), hi(x.x), lo(x.y), hi(x.y), lo(x.z), hi(x.z), lo(x.w), hi(x.w)};
#pragma unroll
            for (int k = 1; k < NSRC; ++k) {
                uint4 y = slot[k * CHUNK / 8 + u];
                v[0] = __fadd_rn(v[0], lo(y.x)); v[1] = __fadd_rn(v[1], hi(y.x));
                v[2] = __fadd_rn(v[2], lo(y.y)); v[3] = __fadd_rn(v[3], hi(y.y));
                v[4] = __fadd_rn(v[4], lo(y.z)); v[5] = __fadd_rn(v[5], hi(y.z));
                v[6] = __fadd_rn(v[6], lo(y.w)); v[7] = __fadd_rn(v[7], hi(y.w));
            }
            store4(o + 8 * u, __fmul_rn(v[0], scale), __fmul_rn(v[1], scale),
                   __fmul_rn(v[2], scale), __fmul_rn(v[3], scale));
            store4(o + 8 * u + 4, __fmul_rn(v[4], scale), __fmul_rn(v[5], scale),
                   __fmul_rn(v[6], scale), __fmul_rn(v[7], scale));
        }
        __syncwarp();  // every lane has read the stage: refill it
        if (lane == 0 && next < last) {
            issue(srcs, next, data, bars, stage, spare);
            next += step;
        }
        if (++stage == STAGES) {
            stage = 0;
            parity ^= 1;
        }
    }
}
"""

#: (name, CHUNK elements per source per stage, STAGES, UNROLL, register bound, CONTIG,
#: TOUCH). All fit beside the GEMM's CTA (at most 16 KB of stages at two sources).
#: ``narrow-probe-b288f01.json`` has more shapes: 2 KB stages, and no register bound.
SHAPES = (("c2048x2", 2048, 2, 2, "__maxnreg__(32)", 0, 0),
          ("c2048x2 runs", 2048, 2, 2, "__maxnreg__(32)", 1, 0))
#: The library's kernel, with its source edited: (name, (old, new) text pairs).
#: Variants run before, each no faster than the shipped kernel, are in the probe as it
#: stood at their commits: at 33bdde7 the flat kernel with TOUCH 1-3 (lane 0 storing to
#: or loading from shared memory around its copies), at 83f23ab the library's kernel
#: without its register cap, with the proxy fence first, and inlined
#: (benchmarks/results/run16-one-h200).
LIBRARY_VARIANTS = (("as shipped", ()),)

#: Cycle counters, edited into a kernel's text: per item, lane 0's clock64() time
#: waiting on the stage's barrier, consuming the stage, and refilling it.
_COUNTERS = "__device__ unsigned long long tide_probe[4];\n"
_TIMED_END = ("""            parity ^= 1;
        }
    }
}
""", """            parity ^= 1;
        }
    }
    if (threadIdx.x == 0) {
        atomicAdd(&tide_probe[0], c_wait);
        atomicAdd(&tide_probe[1], c_use);
        atomicAdd(&tide_probe[2], c_make);
        atomicAdd(&tide_probe[3], n_items);
    }
}
""")
_TIMED_START = "    unsigned long long c_wait = 0, c_use = 0, c_make = 0, n_items = 0;\n"
_T_A = "        long long t_a = clock64();\n"
_T_B = "        long long t_b = clock64();\n"
_T_C = "        long long t_c = clock64();\n"
_T_SUM = ("        c_wait += t_b - t_a; c_use += t_c - t_b; c_make += clock64() - t_c;"
          " ++n_items;\n")
TIMED_LIBRARY = (
    ("__maxnreg__(32)", "__launch_bounds__(32, 1)"),  # room for the counters
    ("""    for (;;) {
        barrier_wait(bars + 8 * stage, parity);
""", _TIMED_START + "    for (;;) {\n" + _T_A + "        barrier_wait(bars + 8 * stage, parity);\n"
     + _T_B),
    ("""        __syncwarp();  // every lane has read the stage: refill it
        if (threadIdx.x == 0) produce<NSrc>(*cursor, l, items, data, bars, stage);
        __syncwarp();
""", _T_C + """        __syncwarp();  // every lane has read the stage: refill it
        if (threadIdx.x == 0) produce<NSrc>(*cursor, l, items, data, bars, stage);
        __syncwarp();
""" + _T_SUM),
    _TIMED_END)
TIMED_FLAT = (
    ("""    for (i64 c = first; c < last; c += step) {
        barrier_wait(bars + 8 * stage, parity);
""", _TIMED_START + "    for (i64 c = first; c < last; c += step) {\n" + _T_A
     + "        barrier_wait(bars + 8 * stage, parity);\n" + _T_B),
    ("        __syncwarp();  // every lane has read the stage: refill it\n",
     _T_C + "        __syncwarp();  // every lane has read the stage: refill it\n"),
    ("        if (++stage == STAGES) {\n", "        __syncwarp();\n" + _T_SUM
     + "        if (++stage == STAGES) {\n"),
    _TIMED_END)


def edited(text: str, edits) -> str:
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


def cycles(mod, launch) -> dict:
    """Lane 0's clock cycles per item of one launch, by part (mean over CTAs)."""
    counters = cp.ndarray((4,), cp.uint64, mod.get_global("tide_probe"))
    counters.fill(0)
    launch()
    dev.sync()
    wait, use, make, items = (int(x) for x in counters.get())
    return {"items": items, "wait": wait / items, "consume": use / items,
            "refill": make / items}


comm = MPI.COMM_WORLD
dev = CudaDevice()
ctx = SimpleNamespace(dev=dev, comm=comm)
timed = partial(timed_on, dev.stream, reps=7)




def narrow_kernel(n_src: int, chunk: int, stages: int, unroll: int, bounds: str,
                  contig: int, touch: int, source: str = SOURCE):
    opts = tuple(f"-D{k}={v}" for k, v in (("NSRC", n_src), ("CHUNK", chunk),
                                           ("STAGES", stages), ("UNROLL", unroll),
                                           ("CONTIG", contig), ("TOUCH", touch)))
    mod = cp.RawModule(code=source.replace("BOUNDS", bounds),
                       options=("-std=c++17", "-arch=sm_90") + opts)
    fn = mod.get_function("narrow")
    smem = stages * n_src * chunk * 2 + 8 * stages + 8
    fn.max_dynamic_shared_size_bytes = smem
    fn.preferred_shared_memory_carveout = 100  # leave the GEMM's CTA its shared memory
    return fn, smem, mod


def library_kernel(acc: Accumulator, text: str):
    """The narrow variant's kernel compiled from ``text``, installed in ``acc`` for the
    source counts it takes."""
    mod = cp.RawModule(code=text, options=("--std=c++14",))
    fn = mod.get_function("tide_accumulate_bf16_narrow")
    fn.max_dynamic_shared_size_bytes = NARROW_SMEM
    fn.preferred_shared_memory_carveout = 100
    for n_src in range(1, NARROW_MAX_SOURCES + 1):
        acc._kernels[bfloat16, "float32", n_src] = Kernel(fn, 32, NARROW_SMEM, acc.max_grid)
    return fn, mod


def sources(n_src: int, scale) -> tuple:
    """``n_src`` fresh bf16 sources of ``N`` elements and ``scale * sum`` in fp32, made
    before returning (the kernels run on a stream that does not wait for the default one)."""
    srcs = [cp.random.standard_normal(N, dtype=cp.float32).astype(bfloat16)
            for _ in range(n_src)]
    want = srcs[0].astype(cp.float32)
    for s in srcs[1:]:
        want = want + s.astype(cp.float32)
    want = want * scale
    dev.sync()
    return srcs, want


def main() -> None:
    sms = dev.num_sms
    gemm = dev.gemm(*GEMM)
    first_alone = interference.gemm_loop(ctx, None, 0.0, gemm, 1.0)[0]
    record = {"commit": git_commit(), "device": cp.cuda.runtime.getDeviceProperties(
        dev.dev.id)["name"].decode(), "n": N, "gemm": GEMM, "gemm_alone_s": first_alone,
        "rows": []}
    print(f"{record['device']}: {sms} SMs; {N:,} elements per source; GEMM "
          f"{'x'.join(map(str, GEMM))} alone {first_alone * 1e6:.1f} us", flush=True)
    scale = np.float32(0.5)
    for n_src in (2, 1, 4, 8):  # the flat kernel takes one or two
        srcs, want = sources(n_src, scale)
        out = cp.empty(N, cp.float32)
        cases = []
        pieces = (AccumPiece(out.data.ptr, tuple(s.data.ptr for s in srcs), N),)
        vec = Accumulator(dev.dev.id, sms)
        cases.append(("vector (library)", vec.max_grid, 512, None,
                      lambda vec=vec, pieces=pieces: vec.launch(dev.stream, pieces, bfloat16,
                                                             float(scale))))
        for name, edits in LIBRARY_VARIANTS:
            acc = StreamedAccumulator(dev.dev.id, sms, kernel="narrow")
            fn, _ = library_kernel(acc, edited(variant_source("narrow"), edits))
            cases.append((f"narrow (library, {name})", acc.max_grid, 32, fn,
                          lambda acc=acc, pieces=pieces: acc.launch(
                              dev.stream, pieces, bfloat16, float(scale))))
        for name, chunk, stages, unroll, bounds, contig, touch in SHAPES * (n_src <= 2):
            fn, smem, _ = narrow_kernel(n_src, chunk, stages, unroll, bounds, contig, touch)
            args = (srcs[0], srcs[-1], out, np.int64(N // chunk), scale)

            def launch(fn=fn, smem=smem, args=args) -> None:
                with dev.stream:
                    fn((sms,), (32,), args, shared_mem=smem)
            cases.append((f"narrow {name}", sms, 32, fn, launch))
        for name, grid, threads, fn, launch in cases:
            out.fill(np.nan)
            try:
                t = timed(launch)
            except cp.cuda.driver.CUDADriverError as e:  # refused: say so, go on
                print(f"  {n_src} src  {name:<26} failed: {type(e).__name__}: {e}", flush=True)
                continue
            ok = bool(cp.array_equal(out, want))
            rate = N / t / sms * 1e-9  # elements per ns per SM (1e3 per us)
            row = {"sources": n_src, "kernel": name, "grid": grid, "threads": threads,
                   "time_s": t, "per_sm_elems_per_ns": rate, "bitwise": ok}
            if fn is not None:
                row.update(registers=fn.num_regs, local_bytes=fn.local_size_bytes)
            pairs = [interference._pair(ctx, launch, t, gemm, first_alone)
                     for _ in range(PAIRS)]
            slows = [p["under_s"] / p["alone_s"] - 1 for p in pairs if p]
            row["gemm_slowdowns"] = slows
            row["gemm_slowdown"] = float(np.median(slows)) if slows else None
            row["beside_s"] = [p["collective_beside_s"] for p in pairs if p]
            record["rows"].append(row)
            regs = (f"; {row['registers']} regs, {row['local_bytes']} B local"
                    if fn is not None else "")
            print(f"  {n_src} src  {name:<26} {grid:>3} x {threads:<3} {t * 1e6:8.1f} us  "
                  f"{rate:5.2f} elem/ns/SM  bitwise {ok}{regs};  GEMM "
                  + (f"{row['gemm_slowdown'] * 100:+.1f}% (pairs "
                     + ", ".join(f"{x * 100:+.1f}%" for x in slows) + "), "
                     f"beside {np.median(row['beside_s']) * 1e6:.0f} us/call"
                     if slows else "n/a"), flush=True)
            if not ok:
                record["failed"] = True
        counted = []
        if n_src <= NARROW_MAX_SOURCES:  # more go to the vector kernel: nothing to count
            acc = StreamedAccumulator(dev.dev.id, sms, kernel="narrow")
            _, mod = library_kernel(acc, _COUNTERS + edited(
                variant_source("narrow"), TIMED_LIBRARY))
            counted.append(("library", cycles(mod, partial(
                acc.launch, dev.stream, pieces, bfloat16, float(scale)))))
        if n_src <= 2:
            fn, smem, mod = narrow_kernel(n_src, 2048, 2, 2, "__launch_bounds__(32, 1)", 1, 0,
                                          _COUNTERS + edited(SOURCE, TIMED_FLAT))
            counted.append(("flat c2048x2 runs", cycles(mod, partial(
                fn, (sms,), (32,), (srcs[0], srcs[-1], out, np.int64(N // 2048), scale),
                shared_mem=smem, stream=dev.stream))))
        for name, c in counted:
            record["rows"].append({"sources": n_src, "kernel": f"cycles: {name}", **c})
            print(f"  {n_src} src  cycles per item, {name:<18} ({c['items']:,} items): wait "
                  f"{c['wait']:,.0f}, consume {c['consume']:,.0f}, refill {c['refill']:,.0f}",
                  flush=True)
        del srcs, want, out
    finish(record, sys.argv[1] if len(sys.argv) > 1 else None)


def finish(record: dict, path) -> None:
    """Write the record (where a path is given); exit 1 if a kernel's sum was wrong."""
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    sys.exit(1 if record.get("failed") else 0)


if __name__ == "__main__":
    main()
