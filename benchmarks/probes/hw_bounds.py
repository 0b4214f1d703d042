"""What the hardware leaves for two of the collectives' goals (diagnostic).

    mpirun -n 2 python benchmarks/probes/hw_bounds.py [RECORD.json]

Run on an otherwise idle pair of GPUs; prints a report from rank 0 and, with a path,
writes the figures there as JSON (with the git commit).

1. **Per-CTA streaming rate.** TIDE-RS's only SM work is its accumulate, and CUPTI's
   SM time of a kernel is ``duration x CTAs / SMs``: its bytes over the rate one CTA
   streams at, times ``1 / SMs``. This times the accumulate (both kernels: ``vector``,
   ``bulk``) alone on one GPU at grids from 1 CTA to every SM, with three probes
   (16-byte streaming loads, eight in flight per thread, 1,024 threads per CTA): read
   only; a copy (as many bytes written as read, as in the accumulate); and the
   accumulate's own traffic, two bf16 sources summed into fp32. It reports the lowest
   SM time for the Llama-3.1-8B unit's accumulate at the accumulate's best rate and at
   the best rate of a probe with the accumulate's read/write mix.
2. **A single-wave GEMM beside bare copies.** The GEMM of the interference suite
   (1024x2048x16384, bf16) beside: the push alone (this rank's share to the peer, one
   copy, no protocol: the push bound), the own copy alone (the share into this rank's
   own memory), both together (an out-of-place all-gather with nothing else), the
   same bytes cut into TIDE-AG's per-parameter pieces (one batch per stream, still
   no flags), TIDE-AG, and TIDE-AG with its large pieces sent as single copies.
   Alone-then-beside pairs, as in ``benchmarks.harness.interference``; the slowdown is
   the median of three. Also: the own copy and the pieces with the own copy cut into
   ``Config.local_copy_max`` pieces or asking for a copy engine, and TIDE-AG with its
   own copy left whole. Then the GEMM beside the own copy alone (any rank
   count, each rank its own copy): as one copy, as one copy per parameter in a batch,
   cut, as 2D copies and in a batch, and in a batch that asks for a copy engine
   (``PREFER_OVERLAP_WITH_COMPUTE``).
3. **Which copies need SMs.** Each kind of copy issued while a kernel holds every SM
   (two 1,024-thread CTAs per SM) for milliseconds: a copy engine's copy runs beside
   it; a copy the driver runs on the SMs waits until it ends. Kinds: host to device
   (a copy engine's, the reference), within the device (one copy, a batch, a 2D
   copy, a batch that asks for a copy engine), to the peer's memory (the push), and
   the protocol's flag write and wait.

``TIDE_BOUNDS_PARTS`` picks parts by name (default ``"rates gemm own held"``: 1, 2,
the GEMM beside the own copy alone, 3).
"""

from __future__ import annotations

import json
import math
import os
import sys
from functools import partial
from types import SimpleNamespace
from typing import Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.getcwd())
import tidearray as ta  # noqa: E402
from benchmarks.harness import interference  # noqa: E402
from benchmarks.harness.device import CudaDevice  # noqa: E402
from benchmarks.harness.plans import raw_copies  # noqa: E402
from benchmarks.harness.records import git_commit  # noqa: E402
from benchmarks.harness.timing import measure  # noqa: E402
from benchmarks.harness.workloads import units  # noqa: E402
from benchmarks.variants.accumulate import StreamedAccumulator  # noqa: E402
from tests.gpu._copies import FlaggedBatch  # noqa: E402
from tests.gpu._timing import timed_on  # noqa: E402
from tidearray._all_gather import build_program  # noqa: E402
from tidearray._arena import Region  # noqa: E402
from tidearray._copies import cut_copies  # noqa: E402
from tidearray._dtypes import bfloat16  # noqa: E402
from tidearray._layout import cached_unit  # noqa: E402
from tidearray.backends._base import AccumPiece  # noqa: E402
from tidearray.backends.cuda.accumulate import Accumulator  # noqa: E402
from tidearray.backends.cuda.copies import Copier  # noqa: E402

GRIDS = (1, 2, 4, 8, 16, 33, 66, 132)
#: Elements per source of the streaming runs: 2 x 192 MB in, 384 MB out (far past L2).
N = 96 << 20
PAIRS = 3
GEMM = (1024, 2048, 16384)
#: The default cut of same-device copies (``Config.local_copy_max``).
LOCAL_MAX = ta.Config().local_copy_max

PROBES = r"""
extern "C" __global__ void read_probe(const uint4* __restrict__ p, long long n,
                                      unsigned* __restrict__ sink) {
  unsigned acc = 0;
  long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldcs(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n; i += stride) { uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; almost never taken
}

// Holds every SM: two 1,024-thread CTAs per SM fill its thread slots.
extern "C" __global__ void __launch_bounds__(1024, 2) hold_sms(float* out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (int i = 0; i < iters; ++i) { a = a * b + 1e-7f; b = b * 0.99999f + 1e-6f; }
  if (a == 12345.f) out[0] = a;  // keeps the loop; never taken
}

extern "C" __global__ void copy_probe(const uint4* __restrict__ p, uint4* __restrict__ q,
                                      long long n) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldcs(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) __stcs(q + i + k * stride, v[k]);
  }
  for (; i < n; i += stride) __stcs(q + i, __ldcs(p + i));
}

// The accumulate's traffic in the copy probe's shape: two bf16 sources in, their fp32
// sum out (32 bytes read, 32 written per 16-byte word of a source), four words of each
// source in flight per thread.
__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

extern "C" __global__ void pair_probe(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                      float4* __restrict__ out, long long n) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i < n; i += 4 * stride) {
    uint4 q[4], r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      long long j = i + k * stride;
      q[k] = j < n ? __ldcs(a + j) : make_uint4(0, 0, 0, 0);
      r[k] = j < n ? __ldcs(b + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      long long j = i + k * stride;
      if (j >= n) break;
      __stcs(out + 2 * j, make_float4(lo(q[k].x) + lo(r[k].x), hi(q[k].x) + hi(r[k].x),
                                      lo(q[k].y) + lo(r[k].y), hi(q[k].y) + hi(r[k].y)));
      __stcs(out + 2 * j + 1, make_float4(lo(q[k].z) + lo(r[k].z), hi(q[k].z) + hi(r[k].z),
                                          lo(q[k].w) + lo(r[k].w), hi(q[k].w) + hi(r[k].w)));
    }
  }
}
"""

comm = MPI.COMM_WORLD
group = ta.init()
import cupy as cp  # noqa: E402

cp.cuda.Device(group.backend.device).use()
dev = CudaDevice()
ctx = SimpleNamespace(dev=dev, comm=comm)
say = print if comm.rank == 0 else (lambda *a, **k: None)
timed = partial(timed_on, dev.stream)




def streaming() -> dict:
    """Per-CTA GB/s of each kernel at each grid, on this rank's GPU."""
    src = [cp.random.standard_normal(N, dtype=cp.float32).astype(bfloat16) for _ in range(2)]
    out = cp.empty(N, cp.float32)
    pieces = (AccumPiece(out.data.ptr, tuple(s.data.ptr for s in src), N),)
    mod = cp.RawModule(code=PROBES)
    read, copy = mod.get_function("read_probe"), mod.get_function("copy_probe")
    pair = mod.get_function("pair_probe")
    sink = cp.zeros(1, cp.uint32)
    words = out.nbytes // 16
    sums = src[0].astype(cp.float32) + src[1].astype(cp.float32)
    rows: dict = {}
    for kernel in ("vector", "bulk"):
        acc = (Accumulator(dev.dev.id, dev.num_sms) if kernel == "vector"
               else StreamedAccumulator(dev.dev.id, dev.num_sms, kernel=kernel))
        per = {}
        for g in GRIDS:
            acc.set_grid(g)
            t = timed(lambda acc=acc: acc.launch(dev.stream, pieces, bfloat16, 0.5))
            per[g] = (2 * src[0].nbytes + out.nbytes) / t / g
        assert bool(cp.array_equal(out, sums * 0.5)), f"{kernel}: the accumulate summed wrong"
        rows[f"accumulate ({kernel})"] = per
    for name, fn, args, nbytes in (  # the copy probe overwrites a source: last
            ("read probe", read, (out, np.int64(words), sink), out.nbytes),
            ("pair probe", pair, (src[0], src[1], out, np.int64(src[0].nbytes // 16)),
             2 * src[0].nbytes + out.nbytes),
            ("copy probe", copy, (out, src[0], np.int64(src[0].nbytes // 16)),
             2 * src[0].nbytes)):
        per = {}
        for g in GRIDS:
            def launch(fn=fn, g=g, args=args) -> None:
                with dev.stream:
                    fn((g,), (1024,), args)
            per[g] = nbytes / timed(launch) / g
        if name == "pair probe":
            assert bool(cp.array_equal(out, sums)), "the pair probe summed wrong"
        rows[name] = per
    return rows


def accumulate_bytes() -> int:
    """Bytes one rank's accumulate moves for the Llama-3.1-8B unit: two bf16 sources
    read and one fp32 output written per element of its shard."""
    unit = next(u for u in units() if u.name == "llama3.1-8b")
    per_rank = sum(math.ceil(s[0] / group.size) * math.prod(s[1:]) for s in unit.shapes)
    return per_rank * (group.size * 2 + 4)


def stock_sm_time() -> float | None:
    """``stock``'s CUPTI SM time per reduce-scatter of that unit, from run 11's records."""
    path = os.path.join("docs", "benchmarks", "run11.jsonl")
    if not os.path.exists(path):
        return None
    for line in open(path):
        r = json.loads(line)
        if (r["suite"], r["impl"], r["workload"], r["metric"]) == (
                "rs", "stock", "llama3.1-8b", "sm_time_cupti"):
            return r["value"]
    return None


def gemm_beside(name: str, fn: Callable[[], None], gemm, first_alone: float) -> dict:
    """``fn`` timed alone, then the GEMM's slowdown beside it: PAIRS alone-then-beside
    pairs, as in ``benchmarks.harness.interference``; printed and returned."""
    coll_t = measure(ctx, fn, iters=5, warmup=2, back_to_back=False).median
    pairs = [interference._pair(ctx, fn, coll_t, gemm, first_alone) for _ in range(PAIRS)]
    slows = [q["under_s"] / q["alone_s"] - 1 for q in pairs if q]
    row = {"collective_us": coll_t * 1e6, "slowdowns": slows,
           "median": float(np.median(slows)) if slows else None}
    say(f"  {name:<34} alone {coll_t * 1e6:7.1f} us; GEMM "
        + (f"{row['median'] * 100:+.1f}% (pairs "
           + ", ".join(f"{x * 100:+.1f}%" for x in slows) + ")" if slows else "n/a"))
    return row


def bare_copies() -> dict:
    """The interference suite's single-wave GEMM beside each bare copy and TIDE-AG."""
    unit = next(u for u in units() if u.name == "llama3.1-8b")
    me, L = group.local_rank, group.local_size
    if group.topology.num_nodes != 1 or L < 2:
        return {}
    shards = [cp.random.standard_normal(
        (math.ceil(s[0] / L), *s[1:]), dtype=cp.float32).astype(bfloat16) for s in unit.shapes]
    share = sum(s.nbytes for s in shards)
    layout = cached_unit(tuple(unit.shapes), 2, group.size)
    slot = ta.SlotArena(max(2 * share, layout.nbytes), num_slots=1)[0]
    # TIDE-AG's own copy list into this slot: its pieces, as its lanes issue them
    program = build_program(group, layout, [s.data.ptr for s in shards], slot)
    own_copies, pushes = raw_copies(program)
    copier = Copier(None)
    copier.probe(dev.stream.ptr)
    cut_copier = Copier(None, local_max=LOCAL_MAX)
    cut_copier.probe(dev.stream.ptr)
    engine_copier = FlaggedBatch()
    flat = cp.empty(share, cp.uint8)
    own_stream = cp.cuda.Stream(non_blocking=True)
    peer = (me + 1) % L
    memcpy = cp.cuda.runtime.memcpyAsync

    def push() -> None:  # into the peer's first half; the own copy writes our second
        memcpy(slot.ptr(peer), flat.data.ptr, share, 4, dev.stream.ptr)

    def own(stream=None) -> None:
        memcpy(slot.ptr(me) + share, flat.data.ptr, share, 4, (stream or dev.stream).ptr)

    def both() -> None:  # on two streams, as TIDE-AG's lanes run them
        fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        fork.record(dev.stream)
        own_stream.wait_event(fork)
        own(own_stream)
        push()
        join.record(own_stream)
        dev.stream.wait_event(join)

    def own_cut() -> None:  # the own copy as TIDE-AG now issues it
        cut_copier.copy(dev.stream.ptr, own_copies, local=True)

    def pieces(own_copier=copier) -> None:  # TIDE-AG's pieces, batched, with no flags
        fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        fork.record(dev.stream)
        own_stream.wait_event(fork)
        own_copier.copy(own_stream.ptr, own_copies, local=own_copier is not copier)
        copier.copy(dev.stream.ptr, pushes[peer])
        join.record(own_stream)
        dev.stream.wait_event(join)

    tide_slot = Region(group, layout.nbytes)

    def tide() -> None:  # as the benchmark calls it: one slot, made once
        ta.all_gather(shards, unit.shapes, slot=tide_slot, stream=dev.stream)

    lanes_copier = group.backend.lanes.copier

    def tide_configured(**how) -> Callable[[], None]:
        def run() -> None:
            lanes_copier.configure(**how)
            try:
                tide()
            finally:
                lanes_copier.configure()
        return run

    gemm = dev.gemm(*GEMM)
    first_alone = float(np.max(comm.allgather(interference.gemm_loop(ctx, None, 0.0, gemm,
                                                                      1.0)[0])))
    cut_mib = f"{LOCAL_MAX >> 20} MiB"
    rows = {name: gemm_beside(name, fn, gemm, first_alone) for name, fn in (
        ("push (the bound)", push), ("own copy", own),
        (f"own copy, cut to {cut_mib}", own_cut),
        ("push + own copy", both), ("the same, as pieces", pieces),
        (f"the same, own pieces cut to {cut_mib}", lambda: pieces(cut_copier)),
        ("the same, own pieces asking for a copy engine", lambda: pieces(engine_copier)),
        ("TIDE-AG", tide),
        ("TIDE-AG, own copy uncut", tide_configured(local_max=0)),
        ("TIDE-AG, large pieces alone", tide_configured(large_min=1 << 20)))}
    dev.sync()
    slot.free()
    tide_slot.free()
    return rows


def own_copy_beside_gemm() -> dict:
    """The single-wave GEMM beside the own copy alone (no peer), cut four ways."""
    unit = next(u for u in units() if u.name == "llama3.1-8b")
    world = max(group.size, 2)
    me = group.rank % world
    layout = cached_unit(tuple(unit.shapes), 2, world)
    shards = [cp.random.standard_normal(spec.byte_range(me)[1] // 2, dtype=cp.float32)
              .astype(bfloat16) for spec in layout.specs]
    full = cp.empty(layout.nbytes, cp.uint8)
    own = tuple((full.data.ptr + off + spec.byte_range(me)[0], sh.data.ptr, sh.nbytes)
                for spec, off, sh in zip(layout.specs, layout.offsets, shards))
    share = sum(sh.nbytes for sh in shards)
    flat = cp.empty(share, cp.uint8)
    whole, cut = Copier(None), Copier(None, local_max=LOCAL_MAX)
    engine = FlaggedBatch()
    for c in (whole, cut):
        c.probe(dev.stream.ptr)
    cut_list = cut_copies(own, LOCAL_MAX)
    stream, rt = dev.stream.ptr, cp.cuda.runtime
    mib = f"{LOCAL_MAX >> 20} MiB"
    ways = {
        "one copy": lambda: rt.memcpyAsync(full.data.ptr, flat.data.ptr, share,
                                           rt.memcpyDefault, stream),
        "one copy per parameter, one batch": lambda: whole.copy(stream, own),
        f"cut to {mib}, as 2D copies": lambda: whole.copy(stream, cut_list),
        f"cut to {mib}, one batch (shipped)": lambda: cut.copy(stream, own, local=True),
        "one copy per parameter, asking for a copy engine": lambda: engine.copy(stream, own),
    }
    gemm = dev.gemm(*GEMM)
    first_alone = float(np.max(comm.allgather(interference.gemm_loop(ctx, None, 0.0, gemm,
                                                                      1.0)[0])))
    rows = {}
    for name, fn in ways.items():
        full.fill(0x7E)
        fn()
        dev.sync()
        if name != "one copy":
            got = [full[d - full.data.ptr: d - full.data.ptr + n] for d, _, n in own]
            assert all(bool(cp.array_equal(g, sh.view(cp.uint8))) for g, sh in
                       zip(got, shards)), f"own copy, {name}: wrong bytes"
        rows[name] = gemm_beside(name, fn, gemm, first_alone)
    dev.sync()
    return rows


def copies_beside_held_sms() -> dict:
    """Each kind of copy alone, then issued while a kernel holds every SM."""
    me, L = group.local_rank, group.local_size
    nbytes = 64 << 20
    src, dst = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    host = cp.cuda.alloc_pinned_memory(nbytes)
    rt, stream = cp.cuda.runtime, dev.stream.ptr
    copier = Copier(None)
    copier.probe(stream)
    engine = FlaggedBatch()
    eighth = nbytes // 8
    batch = tuple((dst.data.ptr + k * eighth, src.data.ptr + k * eighth, eighth)
                  for k in range(8))
    kinds = {
        "host to device (copy engine)": lambda: rt.memcpyAsync(
            dst.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, stream),
        "within the device, one copy": lambda: rt.memcpyAsync(
            dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDefault, stream),
        "within the device, a batch of 8": lambda: copier.copy(stream, batch, local=True),
        "within the device, one 2D copy": lambda: rt.memcpy2DAsync(
            dst.data.ptr, eighth, src.data.ptr, eighth, eighth, 8, rt.memcpyDefault, stream),
        "within the device, asking for a copy engine": lambda: engine.copy(stream, batch),
    }
    flags, word = group.backend.lanes.flags, cp.zeros(1, cp.int32)
    if flags.memops:  # the protocol's flags: stream memory operations, where the driver has them
        kinds["a flag write, then a wait on it"] = lambda: (
            flags.signal(dev.stream, word.data.ptr, 1), flags.wait(dev.stream, word.data.ptr, 1))
    slot = None
    if L >= 2 and group.topology.num_nodes == 1:
        slot = ta.SlotArena(nbytes, num_slots=1)[0]
        peer = slot.ptr((me + 1) % L)
        kinds["to the peer's memory (the push)"] = lambda: rt.memcpyAsync(
            peer, src.data.ptr, nbytes, rt.memcpyDefault, stream)
    hold = cp.RawModule(code=PROBES).get_function("hold_sms")
    sink = cp.zeros(1, cp.float32)
    side = dev.side_stream

    def held(iters: int) -> tuple:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(side)
        hold((2 * dev.num_sms,), (1024,), (sink, np.int32(iters)), stream=side)
        b.record(side)
        return a, b

    def us(a, b) -> float:
        return cp.cuda.get_elapsed_time(a, b) * 1e-3

    held(10)
    dev.sync()
    a, b = held(20000)
    dev.sync()
    iters = max(20000, int(20000 * 4e-3 / us(a, b)))  # about 4 ms
    rows = {}
    for name, fn in kinds.items():
        alone = timed(fn)
        comm.Barrier()
        ha, hb = held(iters)
        ca, cb = cp.cuda.Event(), cp.cuda.Event()
        ca.record(dev.stream)
        fn()
        cb.record(dev.stream)
        dev.sync()
        beside, hold_s = us(ca, cb), us(ha, hb)
        waited = beside > 0.5 * hold_s
        rows[name] = {"alone_s": alone, "beside_s": beside, "held_s": hold_s,
                      "waited": waited}
        say(f"  {name:<34} alone {alone * 1e6:7.1f} us; issued while every SM is held for "
            f"{hold_s * 1e3:.1f} ms: {beside * 1e6:7.1f} us "
            f"({'waited for the SMs' if waited else 'ran beside'})")
    dev.sync()
    if slot is not None:
        slot.free()
    return rows


def rates_part(record: dict) -> None:
    say("== per-CTA streaming rate, GB/s per CTA (each GPU alone; rank 0's)")
    rates = streaming()
    best_all = comm.allgather(max(max(v.values()) for k, v in rates.items()
                                  if k.startswith("accumulate")))
    probe_all = comm.allgather(max(max(rates[k].values()) for k in ("copy probe",
                                                                   "pair probe")))
    say("  grid " + "".join(f"{g:>8d}" for g in GRIDS))
    for name, per in rates.items():
        say(f"  {name:<22}" + "".join(f"{per[g] / 1e9:8.1f}" for g in GRIDS))
    nbytes = accumulate_bytes()
    best = max(best_all)
    floor = nbytes / (dev.num_sms * best)
    stock = stock_sm_time()
    say(f"  the Llama-3.1-8B unit's accumulate moves {nbytes / 1e6:.0f} MB per rank; at the "
        f"best accumulate rate seen, {best / 1e9:.1f} GB/s per CTA, its SM time is at least "
        f"{floor * 1e6:.1f} us")
    probe = max(probe_all)
    probe_floor = nbytes / (dev.num_sms * probe)
    say(f"  at the best copy or pair probe rate, {probe / 1e9:.1f} GB/s per CTA (the same "
        f"read/write mix), at least {probe_floor * 1e6:.1f} us")
    if stock:
        need = nbytes / (dev.num_sms * stock / 12.5)
        say(f"  stock's SM time (run 11, CUPTI) {stock * 1e6:.1f} us: 12.5x below it is "
            f"{stock / 12.5 * 1e6:.1f} us, which needs {need / 1e9:.1f} GB/s per CTA; "
            f"the accumulate's best rate allows {stock / floor:.1f}x, the probes' "
            f"{stock / probe_floor:.1f}x")
    record.update(rates={k: {str(g): v for g, v in per.items()} for k, per in rates.items()},
                  accumulate_bytes=nbytes, best_accumulate_rate=best,
                  sm_time_floor_s=floor, best_probe_rate=probe,
                  sm_time_probe_floor_s=probe_floor, stock_sm_time_s=stock)


def main() -> None:
    record = {"commit": git_commit(), "device": dev.describe(), "ranks": comm.size,
              "gpus": cp.cuda.runtime.getDeviceCount()}
    parts = os.environ.get("TIDE_BOUNDS_PARTS", "rates gemm own held").split()
    record["parts"] = parts
    say(f"benchmarks/probes/hw_bounds.py at {record['commit']}, {comm.size} ranks, "
        f"{record['device']['device']}, {dev.num_sms} SMs; parts: {' '.join(parts)}")
    if "rates" in parts:
        rates_part(record)
    if "gemm" in parts:
        say("== single-wave GEMM {}x{}x{} beside bare copies (Llama-3.1-8B unit)".format(*GEMM))
        record["gemm_beside"] = bare_copies()
    if "own" in parts:
        say(f"== the same GEMM beside the own copy alone ({group.size} ranks, each its own)")
        record["own_copy_beside"] = own_copy_beside_gemm()
    if "held" in parts:
        say("== copies issued while a kernel holds every SM (rank 0's)")
        record["held_sms"] = copies_beside_held_sms()
    record["local_copy_max"] = LOCAL_MAX
    if comm.rank == 0 and len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(record, f, indent=1)
        say(f"wrote {sys.argv[1]}")


main()
