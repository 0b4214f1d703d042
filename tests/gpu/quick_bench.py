"""A first GPU measurement of one FSDP unit: TIDE-AG bandwidth, TIDE-RS vs pack + NCCL RS.

Run from the repo root on a GPU machine (one process per GPU)::

    mpirun -n 2 python tests/gpu/quick_bench.py [--unit llama3.1-8b] [--iters 30] [--json F]

What is timed, on a non-blocking stream, with CUDA events, after 5 untimed
warm-ups; each iteration starts after a device sync and an MPI barrier, and
its time is the maximum over ranks; the median over iterations is reported:

* ``tide_ag``: ``all_gather`` of the unit's bf16 shards into a slot (two slots
  in turn). Receive bandwidth = bytes this rank receives from its peers
  (the unit's bytes minus its own rows) / time;
* ``tide_rs``: ``reduce_scatter`` of per-parameter bf16 gradients into fp32
  shards (``avg``), read in place;
* ``pack_nccl_rs``: FSDP2's path: pack the bf16 gradients into one flat fp32
  buffer, rank-major and padded (one fused kernel launch, as ``_chunk_cat``:
  the accumulate kernel with one source), then NCCL fp32 reduce-scatter (AVG);
  also ``pack`` and ``nccl_rs`` alone;
* ``nccl_ag``: NCCL bf16 all-gather of flat buffers, no copy-in/out (reference).

``pipelined`` figures time ``--iters`` back-to-back calls between two events
(host issue overlapped with device work), divided by the count; ``host_s`` is
the median time the call takes on the host. Calibration: ``ce_push`` is one
``cudaMemcpyAsync`` of the bytes TIDE-AG receives, pushed into the peer's
slot by every rank at once (the copy-engine line rate); ``--profile F``
writes a cProfile of rank 0's host side of AG and RS to F.

Only rank 0 prints; ``--json`` writes the records there too.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import math
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tidearray  # noqa: E402
from tests.gpu._units import BF16, UNITS, bf16_normal, padded_shard, shard_rows  # noqa: E402
from tidearray import _all_gather  # noqa: E402
from tidearray._cache import CallCache  # noqa: E402
from tidearray.backends._base import AccumPiece  # noqa: E402
from tidearray.backends._cuda_nccl import NcclLink  # noqa: E402


def timed(comm: Any, cp: Any, stream: Any, fn: Callable[[int], Any], iters: int) -> dict:
    """Median per-iteration time (max over ranks) and the pipelined average, in seconds."""
    for i in range(5):
        fn(i)
    cp.cuda.runtime.deviceSynchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    samples, host = [], []
    for i in range(iters):
        cp.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        start.record(stream)
        t0 = time.perf_counter()
        fn(i)
        host.append(time.perf_counter() - t0)
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    samples = np.max(np.array(comm.allgather(samples)), axis=0)
    cp.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    start.record(stream)
    for i in range(iters):
        fn(i)
    end.record(stream)
    end.synchronize()
    pipe = comm.allreduce(cp.cuda.get_elapsed_time(start, end) / 1e3 / iters, op=MPI.MAX)
    return {"median_s": float(np.median(samples)), "min_s": float(samples.min()),
            "p90_s": float(np.percentile(samples, 90)), "pipelined_s": pipe,
            "host_s": float(np.median(host)), "iters": iters}


def on_streams(cp: Any, stream: Any, streams: Any, issues: Any) -> None:
    """Issue ``issues[k](stream_ptr)`` on ``streams[k]``, all forked from and joined
    back to ``stream``, so they run at once."""
    fork = cp.cuda.Event(disable_timing=True)
    fork.record(stream)
    for s, issue in zip(streams, issues):
        s.wait_event(fork)
        issue(s.ptr)
        join = cp.cuda.Event(disable_timing=True)
        join.record(s)
        stream.wait_event(join)


def memcpy(cp: Any, dst: int, src: int, n: int) -> Callable[[int], None]:
    """A ``cudaMemcpyAsync`` of ``n`` bytes, to be issued on a stream."""
    return lambda stream_ptr: cp.cuda.runtime.memcpyAsync(dst, src, n, 4, stream_ptr)


def profile_host(comm: Any, fn: Callable[[int], Any], iters: int, path: str) -> None:
    """cProfile rank 0's host side of ``iters`` calls (every rank runs them)."""
    prof = cProfile.Profile() if comm.rank == 0 else None
    comm.Barrier()
    if prof:
        prof.enable()
    for i in range(iters):
        fn(i)
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        with open(path, "a") as f:
            f.write(buf.getvalue())


def calibrate(comm: Any, cp: Any, stream: Any, g: Any, src: Any, peer_slot: int, n: int,
              record: Callable, iters: int) -> None:
    """Copy-engine and flag calibrations on 2 GPUs (see the module docstring)."""
    local = cp.empty(n, cp.uint8)
    side = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]

    def both(i: int) -> None:  # push to the peer and a local copy, on two streams at once
        on_streams(cp, stream, side, [memcpy(cp, peer_slot, src.data.ptr, n),
                                      memcpy(cp, local.data.ptr, src.data.ptr, n)])

    def local_copy(i: int) -> None:
        cp.cuda.runtime.memcpyAsync(local.data.ptr, src.data.ptr, n, 4, stream.ptr)

    res = timed(comm, cp, stream, local_copy, iters)
    record("ce_local", res, GBps=n / res["median_s"] / 1e9)
    res = timed(comm, cp, stream, both, iters)
    record("ce_push_and_local", res, recv_GBps=n / res["median_s"] / 1e9)
    copier = g.backend.copier
    # The same two copies in ONE batch on one stream (NCCL's CE all-gather does this).
    batch = [(peer_slot, src.data.ptr, n), (local.data.ptr, src.data.ptr, n)]
    res = timed(comm, cp, stream, lambda i: copier.copy(stream.ptr, batch), iters)
    record("ce_batch_push_and_local", res, recv_GBps=n / res["median_s"] / 1e9)
    piece = 8 << 20  # the push alone, cut into 8 MiB copies of one batch
    cuts = [(peer_slot + o, src.data.ptr + o, min(piece, n - o)) for o in range(0, n, piece)]
    res = timed(comm, cp, stream, lambda i: copier.copy(stream.ptr, cuts), iters)
    record("ce_batch_push_8MiB", res, recv_GBps=n / res["median_s"] / 1e9)
    res = timed(comm, cp, stream, lambda i: copier.copy(stream.ptr, batch[:1]), iters)
    record("ce_batch_push", res, recv_GBps=n / res["median_s"] / 1e9)
    theirs_slot = peer_slot  # pull: read the peer's memory instead

    def pull(i: int) -> None:
        cp.cuda.runtime.memcpyAsync(local.data.ptr, theirs_slot, n, 4, stream.ptr)

    res = timed(comm, cp, stream, pull, iters)
    record("ce_pull", res, recv_GBps=n / res["median_s"] / 1e9)
    region = tidearray.Region(g, 256)
    me, peer, trips, count = g.local_rank, 1 - g.local_rank, 20, [0]
    mine, theirs = region.flag(me, 0, 0, peer), region.flag(peer, 0, 0, me)
    flags = g.backend.flags

    def pingpong(i: int) -> None:
        for _ in range(trips):
            count[0] += 1
            if me == 0:
                flags.signal(stream, theirs, count[0])
                flags.wait(stream, mine, count[0])
            else:
                flags.wait(stream, mine, count[0])
                flags.signal(stream, theirs, count[0])

    res = timed(comm, cp, stream, pingpong, iters)
    record("flag_round_trip", {k: (v / trips if k.endswith("_s") else v)
                               for k, v in res.items()})


def sweep_ctas(comm: Any, cp: Any, stream: Any, g: Any, rs: Callable, record: Callable,
               args: argparse.Namespace) -> None:
    """TIDE-RS and its accumulate alone at each accumulate grid of ``--ctas``.

    SM time = accumulate time x CTAs / SMs (the issue's definition).
    """
    acc = g.backend.accumulator
    sms = cp.cuda.runtime.getDeviceProperties(g.backend.device)["multiProcessorCount"]
    call = next(v for k, v in g.calls._entries.items() if k[0] == "reduce_scatter")
    chunks = [pieces for _, pieces in next(iter(call.programs.values())).chunks]
    default = acc.max_grid
    for ctas in args.ctas:
        cp.cuda.runtime.deviceSynchronize()
        acc.set_grid(ctas)
        res = timed(comm, cp, stream, rs, args.iters)
        record(f"tide_rs_ctas{ctas}", res)

        def accumulate(i: int) -> None:
            for pieces in chunks:
                acc.launch(stream, pieces, BF16, 0.5)

        res = timed(comm, cp, stream, accumulate, args.iters)
        record(f"accumulate_ctas{ctas}", res, ctas=ctas,
               sm_time_us=res["median_s"] * 1e6 * ctas / sms)
    cp.cuda.runtime.deviceSynchronize()
    acc.set_grid(default)


def copy_modes(comm: Any, cp: Any, stream: Any, copier: Any, fn: Callable, name: str,
               record: Callable, iters: int, recv: int = 0) -> None:
    """``fn`` under other copy plans ([Note: copy plans]): ``singles`` (copies of
    4 MiB or more alone, pairs as 2D copies: the plan before run 6), every copy
    alone, no 2D runs."""
    default = (copier.large_min, copier.strided, copier.min_rows)
    for mode, large_min, strided, rows in (("singles", 4 << 20, True, 2),
                                           ("alone", 0, True, default[2]),
                                           ("no2d", default[0], False, default[2])):
        copier.configure(large_min, strided, rows)
        res = timed(comm, cp, stream, fn, iters)
        extra = {"recv_GBps": recv / res["median_s"] / 1e9} if recv else {}
        record(f"{name}_{mode}", res, **extra)
    copier.configure(*default)


def pull_probe(comm: Any, cp: Any, stream: Any, g: Any, arena: Any, ag: Callable,
               record: Callable, iters: int, recv: int) -> None:
    """Where the gather's pulls lose rate: the same bytes pulled from the peer's slot,
    both ranks at once, into a plain buffer or into our own slot, as one copy or as
    the gather's own pieces (its cached program, no flags, no staging)."""
    me, peer = g.local_rank, 1 - g.local_rank
    ag(0)  # programs for both slots exist
    ag(1)
    cp.cuda.runtime.deviceSynchronize()
    call = next(v for k, v in g.calls._entries.items() if k[0] == "all_gather")
    slot = arena[0]
    pieces = [c for part in call.programs[slot.id].pulls[peer] for c in part]
    local = cp.empty(recv, cp.uint8)
    rt = cp.cuda.runtime
    cases = {
        "pull_one_into_buffer": lambda i: rt.memcpyAsync(local.data.ptr, slot.ptr(peer), recv,
                                                         4, stream.ptr),
        "pull_one_into_slot": lambda i: rt.memcpyAsync(arena[1].ptr(me), slot.ptr(peer), recv,
                                                       4, stream.ptr),
        "pull_pieces_into_slot": lambda i: [rt.memcpyAsync(d, s_, n, 4, stream.ptr)
                                            for d, s_, n in pieces],
        "pull_pieces_batch": lambda i: g.backend.copier.copy(stream.ptr, tuple(pieces)),
        "gather": ag,
    }
    for name, fn in cases.items():
        res = timed(comm, cp, stream, fn, iters)
        record(name, res, recv_GBps=recv / res["median_s"] / 1e9,
               recv_GBps_pipelined=recv / res["pipelined_s"] / 1e9, pieces=len(pieces))


def host_probe(comm: Any, cp: Any, stream: Any, g: Any, record: Callable,
               calls: int = 2000) -> None:
    """Host cost of each driver call on a collective's issue path (us per call,
    ``calls`` in a row, then a sync): events, stream waits, flag writes and
    waits, and 9-entry batches and single copies of 4 KiB into local memory and
    into a peer's legacy-IPC and VMM memory (where the driver's per-copy work
    differs)."""
    from tidearray.backends._cuda_memory import IpcSymmetricBuffer
    from tidearray.backends._cuda_vmm import VmmSymmetricBuffer

    be, rt = g.backend, cp.cuda.runtime
    me, peer = g.local_rank, (g.local_rank + 1) % g.local_size
    n, size = 9, 4096
    ipc = IpcSymmetricBuffer(g.node_comm, 2 * n * size, be.device)
    vmm = VmmSymmetricBuffer(g.node_comm, 2 * n * size, be.device)
    local = cp.zeros(2 * n * size, cp.uint8)
    flag = cp.zeros(1, cp.int32)
    flag[0] = 1
    ev = cp.cuda.Event(block=False, disable_timing=True)

    def batch(dst: int) -> tuple:
        return tuple((dst + k * size, local.data.ptr + (n + k) * size, size) for k in range(n))

    batches = {name: batch(dst) for name, dst in (("local", local.data.ptr),
                                                  ("ipc_peer", ipc.ptr(peer)),
                                                  ("vmm_peer", vmm.ptr(peer)),
                                                  ("vmm_own", vmm.ptr(me)))}
    cases = {
        "event_create": lambda: cp.cuda.Event(block=False, disable_timing=True),
        "event_record": lambda: rt.eventRecord(ev.ptr, stream.ptr),
        "stream_wait_event": lambda: rt.streamWaitEvent(stream.ptr, ev.ptr, 0),
        "write_value_local": lambda: be.flags.signal(stream, flag.data.ptr, 1),
        "wait_value_local": lambda: be.flags.wait(stream, flag.data.ptr, 1),
        "board_agree": lambda: g.agree_max([1, 2, 3]),
    }
    for name, copies in batches.items():
        be.copier.copy(stream.ptr, copies)  # plan once
        cases[f"batch9_{name}"] = lambda c=copies: be.copier.copy(stream.ptr, c)
        cases[f"memcpy_{name}"] = lambda c=copies[0]: rt.memcpyAsync(c[0], c[1], c[2], 4,
                                                                     stream.ptr)
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        stream.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = (time.perf_counter() - t0) / calls
        stream.synchronize()
        t = comm.allreduce(t, op=MPI.MAX)
        record(f"host_{name}", {"median_s": t, "pipelined_s": t, "host_s": t,
                                "iters": calls})
    ipc.free()
    vmm.free()


def link_probe(comm: Any, cp: Any, stream: Any, g: Any, shapes: list, shards: list,
               arena: Any, record: Callable, records: list, iters: int,
               recv: int) -> None:
    """How fast the peer's bytes can cross the link, both ranks at once: pulled
    (read by our copy engine), pushed (written by the peer's), or half and half
    at once (two engines on the same direction); on one or two streams; and the
    gather's pieces pulled straight from the peer's shards in symmetric memory
    (no staging), beside the copy of our own shards into our slot."""
    from tidearray._layout import ag_pieces, align_up, plan_unit
    from tidearray.backends._cuda_vmm import VmmSymmetricBuffer

    me, peer = g.local_rank, 1 - g.local_rank
    rt = cp.cuda.runtime
    half = recv // 2 // 256 * 256
    src = tidearray.Region(g, recv)  # what the peer reads or we write from
    local = cp.empty(recv, cp.uint8)
    side = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]

    def on_two(*copies: tuple) -> None:  # one copy per side stream
        on_streams(cp, stream, side, [memcpy(cp, *c) for c in copies])

    peer_slot, peer_src, mine = arena[0].ptr(peer), src.ptr(peer), src.ptr(me)
    cases = {
        "link_pull_one": lambda i: rt.memcpyAsync(local.data.ptr, peer_src, recv, 4,
                                                  stream.ptr),
        "link_push_one": lambda i: rt.memcpyAsync(peer_slot, mine, recv, 4, stream.ptr),
        "link_pull_two": lambda i: on_two((local.data.ptr, peer_src, half),
                                          (local.data.ptr + half, peer_src + half,
                                           recv - half)),
        "link_push_two": lambda i: on_two((peer_slot, mine, half),
                                          (peer_slot + half, mine + half, recv - half)),
        "link_pull_half_push_half": lambda i: on_two(
            (local.data.ptr, peer_src, half),
            (peer_slot + half, mine + half, recv - half)),
    }
    vmm_src = VmmSymmetricBuffer(g.node_comm, recv, g.backend.device)
    vmm_dst = VmmSymmetricBuffer(g.node_comm, recv, g.backend.device)
    vsrc, vdst_peer, vsrc_peer = vmm_src.ptr(me), vmm_dst.ptr(peer), vmm_src.ptr(peer)
    cases["vmm_push_one"] = lambda i: rt.memcpyAsync(vdst_peer, vsrc, recv, 4, stream.ptr)
    cases["vmm_pull_one"] = lambda i: rt.memcpyAsync(local.data.ptr, vsrc_peer, recv, 4,
                                                     stream.ptr)
    cases["vmm_push_batch"] = lambda i: g.backend.copier._batch(
        stream.ptr, ((vdst_peer, vsrc, recv),))
    cases["ipc_push_batch"] = lambda i: g.backend.copier._batch(
        stream.ptr, ((peer_slot, mine, recv),))
    cases["ipc_push_from_plain"] = lambda i: rt.memcpyAsync(peer_slot, local.data.ptr, recv, 4,
                                                            stream.ptr)
    drv = g.backend.copier._driver

    def overlap_flag(copies: tuple) -> None:  # cudaMemcpyFlagPreferOverlapWithCompute
        drv._attrs[5] = 1
        g.backend.copier._batch(stream.ptr, copies)
        drv._attrs[5] = 0

    if drv is not None:
        cases["vmm_push_batch_overlap"] = lambda i: overlap_flag(((vdst_peer, vsrc, recv),))
        cases["ipc_push_batch_overlap"] = lambda i: overlap_flag(((peer_slot, mine, recv),))
        cases["ipc_pull_batch_overlap"] = lambda i: overlap_flag(
            ((local.data.ptr, peer_src, recv),))
    # Shards laid out one after another in symmetric memory: the pull gather
    # could then read them in place, with no staging copy.
    unit = plan_unit(tuple(shapes), 2, g.size)
    offs, o = [], 0
    for sh in shards:
        offs.append(o)
        o = align_up(o + sh.nbytes)
    store = tidearray.Region(g, o)
    for sh, off in zip(shards, offs):
        rt.memcpy(store.ptr(me) + off, sh.data.ptr, sh.nbytes, 4)
    base = arena[1].ptr(me)
    theirs = [(base + pc.offset, store.ptr(peer) + offs[pc.param], pc.nbytes)
              for pc in ag_pieces(unit, (g.rank ^ 1,))]
    own = [(base + pc.offset, shards[pc.param].data.ptr, pc.nbytes)
           for pc in ag_pieces(unit, (g.rank,))]
    copier = g.backend.copier
    theirs_t, own_t = tuple(theirs), tuple(own)

    high = cp.cuda.Stream(non_blocking=True, priority=-5)

    def direct(first: tuple, second: tuple, streams: tuple = tuple(side)) -> None:
        on_streams(cp, stream, streams, [lambda p, c=c: copier.copy(p, c)
                                         for c in (first, second)])

    everything = own_t + theirs_t
    cases["direct_pulls_alone"] = lambda i: copier.copy(stream.ptr, theirs_t)
    cases["direct_own_alone"] = lambda i: copier.copy(stream.ptr, own_t)
    cases["direct_pulls_and_own"] = lambda i: direct(own_t, theirs_t)
    cases["direct_pulls_then_own_issue"] = lambda i: direct(theirs_t, own_t)
    cases["direct_own_high_priority"] = lambda i: direct(own_t, theirs_t, (high, side[1]))
    cases["direct_serial_own_first"] = lambda i: copier.copy(stream.ptr, everything)
    cases["direct_one_batch"] = lambda i: copier._batch(stream.ptr, everything)
    cases["direct_one_batch_pulls_first"] = lambda i: copier._batch(stream.ptr,
                                                                   theirs_t + own_t)
    rt.deviceSynchronize()
    comm.Barrier()
    for name, fn in cases.items():
        res = timed(comm, cp, stream, fn, iters)
        record(name, res, recv_GBps=recv / res["median_s"] / 1e9,
               recv_GBps_pipelined=recv / res["pipelined_s"] / 1e9)
    scratch = cp.empty((2, recv), cp.uint8)
    other = ((scratch[1].data.ptr, scratch[0].data.ptr, recv),)
    small = ((scratch[1].data.ptr, scratch[0].data.ptr, 8 << 20),)
    a = cp.ones((4096, 4096), cp.float32)

    def gemm() -> None:
        with stream:
            for _ in range(4):
                a @ a

    phases = {"own_then_pulls": (own_t, theirs_t, False),
              "pulls_then_pulls": (theirs_t, theirs_t, False),
              "scratch_then_pulls": (other, theirs_t, False),
              "small_then_pulls": (small, theirs_t, False),
              "gemm_then_pulls": (gemm, theirs_t, False),
              "own_sync_pulls": (own_t, theirs_t, True)}
    for name, (first, second, sync) in phases.items():  # each phase timed on its own
        ev = [cp.cuda.Event() for _ in range(3)]
        t1, t2 = [], []
        for i in range(iters + 3):
            rt.deviceSynchronize()
            comm.Barrier()
            ev[0].record(stream)
            if callable(first):
                first()
            else:
                copier.copy(stream.ptr, first)
            ev[1].record(stream)
            if sync:
                ev[1].synchronize()
                comm.Barrier()
            copier.copy(stream.ptr, second)
            ev[2].record(stream)
            ev[2].synchronize()
            if i >= 3:
                t1.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
                t2.append(cp.cuda.get_elapsed_time(ev[1], ev[2]) * 1e3)
        t1 = np.max(np.array(comm.allgather(t1)), axis=0)
        t2 = np.max(np.array(comm.allgather(t2)), axis=0)
        records.append({"bench": f"phase_{name}", "first_us": float(np.median(t1)),
                        "second_us": float(np.median(t2)), "median_s": 0.0,
                        "pipelined_s": 0.0, "host_s": 0.0})
    scratch = a = None
    rt.deviceSynchronize()
    comm.Barrier()
    store.free()
    src.free()
    vmm_src.free()
    vmm_dst.free()


def trace(comm: Any, cp: Any, stream: Any, fn: Callable[[int], Any], calls: int,
          path: str, spaced: bool = False) -> None:
    """A lane timeline of ``calls`` calls: for every executor operation, when the
    host issued it, when its lane reached it and when it was done, in us from a
    start event on ``stream`` (timing events recorded around each op; every
    rank, to ``path``). Back to back, or ``spaced`` as in :func:`timed` (a device
    sync and a barrier before each call, times from that call's start): then
    only copies get timing events, and the host also marks resolving, the call
    cache, validation, the executor, ``finish`` and the views."""
    from tidearray import _validate
    from tidearray._arena import Region
    from tidearray._cache import CallCache
    from tidearray.backends._cuda_exec import CudaExecutor

    names = ("_copy", "_wait", "_signal", "_accumulate", "_depend")
    orig = {n: getattr(CudaExecutor, n) for n in names}
    hooks = [(_validate, "resolve_all"), (CallCache, "get"), (_validate, "check"),
             (CudaExecutor, "__init__"), (CudaExecutor, "finish"), (Region, "views")]
    hooked = {(o, n): getattr(o, n) for o, n in hooks}
    marks: list = []
    h0 = [0.0]

    def wrap(name: str) -> Callable:
        def op(self: Any, lane: int, *a: Any) -> None:
            h = (time.perf_counter() - h0[0]) * 1e6
            if spaced and name != "_copy":  # host marks only: events would delay the copies
                orig[name](self, lane, *a)
                marks.append((name[1:], lane, "", h, None, None))
                return
            s = self._lane(lane)
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record(s)
            orig[name](self, lane, *a)
            t1.record(s)
            size = sum(c[2] for c in a[0]) if name == "_copy" else ""
            marks.append((name[1:], lane, size, h, t0, t1))
        return op

    def host_mark(name: str, f: Callable) -> Callable:
        def hooked_call(*a: Any, **k: Any) -> Any:
            h = (time.perf_counter() - h0[0]) * 1e6
            out = f(*a, **k)
            marks.append((name, "host", "", h, (time.perf_counter() - h0[0]) * 1e6, None))
            return out
        return hooked_call

    for i in range(3):
        fn(i)
    cp.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    starts = []
    for n in names:
        setattr(CudaExecutor, n, wrap(n))
    if spaced:
        for (o, n), f in hooked.items():
            setattr(o, n, host_mark(n, f))
    try:
        for i in range(calls):
            if spaced or not starts:
                cp.cuda.runtime.deviceSynchronize()
                comm.Barrier()
                starts.append(cp.cuda.Event())
                starts[-1].record(stream)
                h0[0] = time.perf_counter()
                marks.append(("call", "start", i, 0.0, starts[-1], starts[-1]))
            fn(i)
            marks.append(("call", "return", i, (time.perf_counter() - h0[0]) * 1e6, None, None))
            if spaced:
                end = cp.cuda.Event()
                end.record(stream)
                marks.append(("call", "end", i, (time.perf_counter() - h0[0]) * 1e6, end, end))
    finally:
        for n in names:
            setattr(CudaExecutor, n, orig[n])
        for (o, n), f in hooked.items():
            setattr(o, n, f)
    cp.cuda.runtime.deviceSynchronize()
    lines = [f"rank {comm.rank}: {calls} calls, {'spaced' if spaced else 'back to back'}; "
             "columns: op, lane, bytes, host issue us, lane reached -> done us"]
    start = starts[0]
    for name, lane, size, h, t0, t1 in marks:
        if name == "call" and lane == "start":
            start = t0
        if lane == "host":
            lines.append(f"  host     {name:<10} {'':>10} {h:9.1f} (returned {t0:7.1f})")
        elif t0 is None:
            lines.append(f"  {lane!s:<8} {name:<10} {size!s:>10} {h:9.1f}")
        else:
            a = cp.cuda.get_elapsed_time(start, t0) * 1e3
            b = cp.cuda.get_elapsed_time(start, t1) * 1e3
            lines.append(f"  lane {lane!s:>3} {name:<10} {size!s:>10} {h:9.1f} {a:9.1f} -> "
                         f"{b:9.1f} ({b - a:7.1f})")
    every = comm.gather("\n".join(lines), root=0)
    if comm.rank == 0:
        with open(path, "a") as f:
            f.write("\n".join(every) + "\n")


def many_copies(comm: Any, cp: Any, stream: Any, g: Any, peer: int, local: Any,
                record: Callable, iters: int, count: int = 384, size: int = 3 << 19) -> None:
    """``count`` pulls of ``size`` bytes at a stride of 2x ``size`` from the peer's slot
    (a Qwen3 unit's pull pattern): one batch, one memcpy each, one 2D copy; and
    the same bytes as one copy, batched and not. Host issue is ``host_s``."""
    from cuda.bindings import runtime as rt

    copies = tuple((local.data.ptr + k * size, peer + 2 * k * size, size) for k in range(count))
    copier = g.backend.copier
    res = timed(comm, cp, stream, lambda i: copier.copy(stream.ptr, copies), iters)
    record("many_batch", res, copies=count, recv_GBps=count * size / res["median_s"] / 1e9)
    def singles(i: int) -> None:
        for d, s_, n in copies:
            cp.cuda.runtime.memcpyAsync(d, s_, n, 4, stream.ptr)

    res = timed(comm, cp, stream, singles, iters)
    record("many_singles", res, copies=count, recv_GBps=count * size / res["median_s"] / 1e9)
    whole = ((local.data.ptr, peer, count * size),)  # one copy of as many bytes
    res = timed(comm, cp, stream, lambda i: copier._batch(stream.ptr, whole), iters)
    record("pull_batch_one", res, recv_GBps=count * size / res["median_s"] / 1e9)
    res = timed(comm, cp, stream, lambda i: cp.cuda.runtime.memcpyAsync(
        local.data.ptr, peer, count * size, 4, stream.ptr), iters)
    record("pull_memcpy_one", res, recv_GBps=count * size / res["median_s"] / 1e9)

    def two_d(i: int) -> None:
        rt.cudaMemcpy2DAsync(local.data.ptr, size, peer, 2 * size, size, count,
                             rt.cudaMemcpyKind.cudaMemcpyDefault, stream.ptr)

    res = timed(comm, cp, stream, two_d, iters)
    record("many_2d", res, copies=count, recv_GBps=count * size / res["median_s"] / 1e9)


def pack_pieces(shapes: list, grads: list, flat: Any, W: int) -> tuple[list, int]:
    """``_chunk_cat`` as accumulate pieces: rank-major fp32 blocks, each param padded."""
    numel_shard = [-(-s[0] // W) * math.prod(s[1:]) for s in shapes]
    block = sum(numel_shard)
    pieces, off = [], 0
    for s, g, n in zip(shapes, grads, numel_shard):
        row = math.prod(s[1:])
        for r in range(W):
            a, b = shard_rows(s[0], W, r)
            if b > a:
                pieces.append(AccumPiece(flat.data.ptr + 4 * (r * block + off),
                                         (g.data.ptr + 2 * a * row,), (b - a) * row))
        off += n
    return pieces, block


def run(args: argparse.Namespace) -> list[dict]:
    import cupy as cp

    g = tidearray.init(backend="cuda")
    comm, W, r = g.comm, g.size, g.rank
    be = g.backend
    shapes = UNITS[args.unit]()
    unit_bytes = sum(math.prod(s) for s in shapes) * 2
    own = sum(2 * (b - a) * math.prod(s[1:]) for s in shapes
              for a, b in [shard_rows(s[0], W, r)])
    recv = comm.allreduce(unit_bytes - own, op=MPI.MIN)
    stream = cp.cuda.Stream(non_blocking=True)
    records = []

    def record(name: str, res: dict, **extra: Any) -> None:
        records.append({"bench": name, "unit": args.unit, "world": W, **res, **extra})

    with stream:
        full = [bf16_normal(cp, 10 + i, s) for i, s in enumerate(shapes)]
        shards = [padded_shard(cp, f, W, r) for f in full]
        del full
        arena = tidearray.SlotArena(tidearray.unit_nbytes(shapes, BF16, group=g), 2, group=g)
        def ag(i: int) -> None:
            tidearray.all_gather(shards, shapes, group=g, slot=arena[i % 2], stream=stream)

        res = timed(comm, cp, stream, ag, args.iters)
        record("tide_ag", res, recv_bytes=recv, recv_GBps=recv / res["median_s"] / 1e9,
               recv_GBps_pipelined=recv / res["pipelined_s"] / 1e9, split=be.push_split)
        copy_modes(comm, cp, stream, be.copier, ag, "tide_ag", record, args.iters, recv)
        default = (be.push_split, be.aux_streams, g.config)
        variants = [(t, s, _all_gather.PULL_PARTS) for t in ("pull", "push")
                    for s in args.splits] + [("push-batch", 1, _all_gather.PULL_PARTS)]
        variants += [("pull", s, n) for s in args.splits for n in args.parts]
        parts_default = _all_gather.PULL_PARTS
        for transport, split, parts in variants:  # copy-engine streams per peer lane
            g.config = dataclasses.replace(default[2], ag_transport=transport)
            be.push_split = split
            be.aux_streams = [[cp.cuda.Stream(non_blocking=True) for _ in range(split - 1)]
                              for _ in range(g.local_size)]
            _all_gather.PULL_PARTS = parts
            g.calls = CallCache()  # programs are cut into parts when built
            res = timed(comm, cp, stream, ag, args.iters)
            record(f"tide_ag_{transport}_split{split}_parts{parts}", res,
                   recv_GBps=recv / res["median_s"] / 1e9,
                   recv_GBps_pipelined=recv / res["pipelined_s"] / 1e9)
        be.push_split, be.aux_streams, g.config = default
        _all_gather.PULL_PARTS = parts_default
        g.calls = CallCache()
        if args.trace:
            trace(comm, cp, stream, ag, 2, args.trace)
            trace(comm, cp, stream, ag, 3, args.trace, spaced=True)
        if args.pull_probe and W == 2 and g.local_size == 2:
            pull_probe(comm, cp, stream, g, arena, ag, record, args.iters, recv)
        if args.host_probe and g.local_size > 1:
            host_probe(comm, cp, stream, g, record)
        if args.link_probe and W == 2 and g.local_size == 2:
            link_probe(comm, cp, stream, g, shapes, shards, arena, record, records, args.iters,
                       recv)
        if W == 2 and g.local_size == 2 and args.many and arena[0].nbytes >= 384 * (3 << 20):
            local = cp.empty(384 * (3 << 19), cp.uint8)
            many_copies(comm, cp, stream, g, arena[0].ptr(1 - g.local_rank), local, record,
                        args.iters)
            local = None
        if W == 2:
            src = cp.empty(recv, cp.uint8)
            peer_slot = arena[0].ptr(1 - g.local_rank) if g.local_size == 2 else None

            def ce_push(i: int) -> None:
                cp.cuda.runtime.memcpyAsync(peer_slot, src.data.ptr, recv, 4, stream.ptr)

            if peer_slot is not None and not args.skip_calibration:
                res = timed(comm, cp, stream, ce_push, args.iters)
                record("ce_push", res, recv_GBps=recv / res["median_s"] / 1e9)
                calibrate(comm, cp, stream, g, src, peer_slot, recv, record, args.iters)
            src = None

        grads = [bf16_normal(cp, 1000 * r + i, s) for i, s in enumerate(shapes)]
        outs = [cp.empty(tidearray.shard_shape(s, W), cp.float32) for s in shapes]
        def rs(i: int) -> None:
            tidearray.reduce_scatter(grads, op="avg", out=outs, group=g, stream=stream)

        record("tide_rs", timed(comm, cp, stream, rs, args.iters))
        copy_modes(comm, cp, stream, be.copier, rs, "tide_rs", record, args.iters)
        if args.trace:
            trace(comm, cp, stream, rs, 1, args.trace)
            trace(comm, cp, stream, rs, 2, args.trace, spaced=True)
        sweep_ctas(comm, cp, stream, g, rs, record, args)
        if args.profile:
            profile_host(comm, ag, 10, args.profile)
            profile_host(comm, rs, 10, args.profile)

        link = NcclLink()
        link.setup(comm)
        block = sum(-(-s[0] // W) * math.prod(s[1:]) for s in shapes)
        flat = cp.zeros(W * block, cp.float32)  # padding rows stay zero: pack never writes them
        shard32 = cp.empty(block, cp.float32)
        pieces, _ = pack_pieces(shapes, grads, flat, W)

        def pack(i: int) -> None:
            be.accumulator.launch(stream, pieces, BF16, 1.0)

        def nccl_rs(i: int) -> None:
            link._nb.reduce_scatter(flat.data.ptr, shard32.data.ptr, block,
                                    int(link._nccl.FLOAT32), int(link._nccl.AVG), link._raw,
                                    stream.ptr)

        record("pack", timed(comm, cp, stream, pack, args.iters))
        record("nccl_rs", timed(comm, cp, stream, nccl_rs, args.iters))
        record("pack_nccl_rs", timed(comm, cp, stream, lambda i: (pack(i), nccl_rs(i)),
                                     args.iters))
        flat = shard32 = None  # freed before the AG reference
        flat16 = cp.empty(W * block, cp.uint16)
        mine = flat16[r * block:(r + 1) * block]

        def nccl_ag(i: int) -> None:
            link._nb.all_gather(mine.data.ptr, flat16.data.ptr, block,
                                int(link._nccl.BFLOAT16), link._raw, stream.ptr)

        record("nccl_ag", timed(comm, cp, stream, nccl_ag, args.iters))
        link.close()
    by = {x["bench"]: x for x in records}
    by["tide_rs"]["speedup_vs_pack_nccl_rs"] = (by["pack_nccl_rs"]["median_s"]
                                                / by["tide_rs"]["median_s"])
    by["tide_rs"]["speedup_vs_pack_nccl_rs_pipelined"] = (by["pack_nccl_rs"]["pipelined_s"]
                                                          / by["tide_rs"]["pipelined_s"])
    g.close()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--unit", default="llama3.1-8b", choices=sorted(UNITS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None, help="write the records here (rank 0)")
    p.add_argument("--profile", default=None, help="write a host cProfile here (rank 0)")
    p.add_argument("--parts", type=int, nargs="*", default=[],
                   help="also time the pull TIDE-AG in these numbers of parts (e.g. 1 2 8)")
    p.add_argument("--ctas", type=int, nargs="*", default=[],
                   help="also time TIDE-RS and its accumulate at these grids (e.g. 16 32)")
    p.add_argument("--trace", default=None,
                   help="append lane timelines of AG and RS (back to back, then spaced as timed, "
                        "with host marks) here (rank 0)")
    p.add_argument("--pull-probe", action="store_true",
                   help="time the gather's pulls alone, as one copy and as its pieces")
    p.add_argument("--link-probe", action="store_true",
                   help="time pulls, pushes and both at once over the link, and pulls "
                        "straight from shards in symmetric memory")
    p.add_argument("--host-probe", action="store_true",
                   help="time each driver call of the issue path on the host")
    p.add_argument("--many", action="store_true",
                   help="time 384 small pulls as one batch, one graph and one 2D copy")
    p.add_argument("--skip-calibration", action="store_true",
                   help="leave out the copy-engine calibrations")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time TIDE-AG with these push splits (e.g. 1 2 3)")
    args = p.parse_args()
    records = run(args)
    if MPI.COMM_WORLD.rank:
        return
    for x in records:
        extra = {k: v for k, v in x.items()
                 if k.endswith(("GBps", "pipelined", "pack_nccl_rs", "sm_time_us", "_us"))}
        print(f"{x['bench']:<14} median {x['median_s'] * 1e6:8.1f} us  pipelined "
              f"{x['pipelined_s'] * 1e6:8.1f} us  host {x['host_s'] * 1e6:7.1f} us  " + "  ".join(
                  f"{k}={v:.2f}" for k, v in extra.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
