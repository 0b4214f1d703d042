"""The ``interference`` suite: how much a collective slows a GEMM running beside it.

A bf16 GEMM runs on a side stream while an implementation's collective loops on
the timing stream (every rank does the same). Each GEMM and each group of
collectives is bracketed by CUDA events; a GEMM counts as "under the
collective" when at least 95% of it overlaps the union of the collectives'
intervals. "Alone" is the same loop without the collective (back-to-back GEMMs,
so launch gaps are excluded from both), run again right before each "beside" loop,
so that both see the same clocks and power state (an alone figure taken once, at
the start, let a full-device GEMM look faster beside a collective than alone). The
collective's own time per call in the beside loop is kept too (issued back to back
there, so not the same measure as its time alone, one call after a barrier): levers
that spare the GEMM may slow the collective, and this compares them.
Slowdown = median GEMM time under the collective / that adjacent median alone - 1,
measured for :data:`PAIRS` alone-then-beside pairs in a row; the figure is the median
of the pairs (the same code moved by about ten points between single runs), and the
record keeps every pair, the start-of-suite figure, and the SM and memory clocks and
the power read after each loop (``nvidia-smi``, where it answers). GEMMs (M x N x K):
the single-wave 1024x2048x16384 and 8192^3.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .data import UnitData
from .guard import guarded
from .suite import Suite, prepare, release
from .timeline import union
from .timing import measure

GEMMS = {"gemm-1024x2048x16384": (1024, 2048, 16384), "gemm-8192^3": (8192, 8192, 8192)}
OVERLAP = 0.95
#: Alone-then-beside pairs per (collective, GEMM); the slowdown is their median.
PAIRS = 3


def run(ctx: Any, unit: Any) -> None:
    if ctx.dev.name != "cuda":
        ctx.sink.skip("interference", "*", unit.name, "needs a GPU (cuda device)")
        ctx.log("== interference: skipped (needs a GPU)")
        return
    ctx.log(f"== interference: {unit.label}, GEMMs {', '.join(GEMMS)}")
    gemms = {}
    for name, (m, n, k) in GEMMS.items():
        ok, fn = guarded(ctx, "interference", "gemm", unit.name, name,
                         lambda m=m, n=n, k=k: ctx.dev.gemm(m, n, k))
        if not ok:
            continue
        ok, res = guarded(ctx, "interference", "none", unit.name, name,
                          lambda fn=fn: gemm_loop(ctx, None, 0.0, fn, 1.0))
        if ok and res[0] is not None:
            alone = float(np.max(ctx.comm.allgather(res[0])))
            gemms[name] = (fn, alone)
            ctx.sink.add("interference", "none", unit.name, f"{name}:alone", alone, "s",
                         gemms=res[2])
            ctx.log(f"  {name} alone: {alone * 1e6:.1f} us (back to back)")
    data = UnitData(unit, ctx.dev.xp, ctx.rank, ctx.size)
    with Suite(ctx, "interference") as suite:
        for impl in suite.impls:
            prep = prepare(ctx, "interference", impl, data)
            if prep is None:
                continue
            try:
                for op in ("ag", "rs"):
                    coll = getattr(prep, op)
                    if coll is None or prep.pre.get(op):
                        continue
                    ok, st = guarded(ctx, "interference", impl.name, unit.name, f"{op} alone",
                                     lambda c=coll: measure(ctx, c, iters=5, warmup=2,
                                                           back_to_back=False))
                    if not ok:
                        continue
                    for gname, (gemm, alone) in gemms.items():
                        _one(ctx, impl.name, op, unit, coll, st.median, gname, gemm, alone)
            finally:
                release(ctx, "interference", impl, data, prep)
    del data
    ctx.dev.release_pools()


def _one(ctx: Any, impl: str, op: str, unit: Any, coll: Any, coll_t: float, gname: str,
         gemm: Any, first_alone: float) -> None:
    pairs = []
    for _ in range(PAIRS):
        ok, pair = guarded(ctx, "interference", impl, unit.name, f"{op} + {gname}",
                           lambda: _pair(ctx, coll, coll_t, gemm, first_alone))
        if not ok:
            return
        if pair is None:
            break
        pairs.append(pair)
    metric = f"{op}:{gname}"
    if len(pairs) < PAIRS:
        ctx.sink.add("interference", impl, unit.name, metric, None, status="error",
                     reason="too few GEMMs overlapped the collective (under 3 on a rank)")
        return
    slows = [p["under_s"] / p["alone_s"] - 1.0 for p in pairs]
    mid = sorted(range(PAIRS), key=lambda k: slows[k])[PAIRS // 2]  # the median pair
    slow, p = slows[mid], pairs[mid]
    ctx.sink.add("interference", impl, unit.name, metric, slow, "fraction",
                 alone_s=p["alone_s"], under_s=p["under_s"], alone_at_start_s=first_alone,
                 pairs=pairs, slowdowns=slows, gemms_overlapped=p["gemms_overlapped"],
                 gemms=p["gemms"], collective_alone_s=coll_t,
                 collective_beside_s=p["collective_beside_s"], clocks=p["clocks"])
    sm = [p["clocks"].get(k, {}).get("sm_mhz") for k in ("after_alone", "after_beside")]
    ctx.log(f"  {impl:<12} {op} + {gname}: {p['alone_s'] * 1e6:.1f} -> "
            f"{p['under_s'] * 1e6:.1f} us ({slow * 100:+.1f}%; pairs "
            + ", ".join(f"{s * 100:+.1f}%" for s in slows) + ")"
            + (f"; SM clock {sm[0]:.0f} -> {sm[1]:.0f} MHz" if None not in sm else "")
            + f"; {op} per call {coll_t * 1e6:.0f} us timed alone, "
              f"{p['collective_beside_s'] * 1e6:.0f} us in the loop beside the GEMMs")


def _pair(ctx: Any, coll: Any, coll_t: float, gemm: Any, first_alone: float) -> Optional[dict]:
    """The GEMM alone, then beside the collective: the same clocks for both. None where
    fewer than 3 GEMMs overlapped the collective on some rank."""
    clocks = {}
    alone = gemm_loop(ctx, None, 0.0, gemm, 1.0)[0]
    clocks["after_alone"] = ctx.dev.clocks()
    under, n_under, n_total, coll_beside = gemm_loop(ctx, coll, coll_t, gemm, first_alone)
    clocks["after_beside"] = ctx.dev.clocks()
    counts = ctx.comm.allgather(n_under)
    unders = ctx.comm.allgather(under)
    if None in unders or min(counts) < 3:
        return None
    return {"alone_s": float(np.max(ctx.comm.allgather(alone))),
            "under_s": float(np.max(unders)), "gemms_overlapped": min(counts),
            "gemms": n_total, "clocks": clocks,
            "collective_beside_s": float(np.max(ctx.comm.allgather(coll_beside)))}


def gemm_loop(ctx: Any, coll: Any, coll_t: float, gemm: Any, gemm_t: float,
              rounds: int = 24) -> tuple[Optional[float], int, int, Optional[float]]:
    """Median GEMM time while ``coll`` loops (or alone if ``coll`` is None).

    Returns (median, GEMMs counted, GEMMs run, the collective's median time per call
    in the loop, beside the GEMMs; None alone).
    """
    import cupy

    dev = ctx.dev
    cs, gs = dev.stream, dev.side_stream
    n_coll = max(1, math.ceil(gemm_t / coll_t)) if coll else 0
    n_gemm = max(1, int(n_coll * coll_t / gemm_t)) if coll else 4
    ev = cupy.cuda.Event
    origin = ev()
    marks_c, marks_g = [], []
    dev.sync()
    ctx.comm.Barrier()
    origin.record(cs)
    if coll:
        coll()  # a head start, so the GEMMs begin under a collective
    for _ in range(rounds):
        a, b = ev(), ev()
        a.record(cs)
        for _ in range(n_coll):
            coll()
        b.record(cs)
        marks_c.append((a, b))
        for _ in range(n_gemm):
            c, d = ev(), ev()
            c.record(gs)
            gemm()
            d.record(gs)
            marks_g.append((c, d))
    dev.sync()

    def t(e: Any) -> float:
        return cupy.cuda.get_elapsed_time(origin, e) * 1e-3

    busy = union([(t(a), t(b)) for a, b in marks_c])
    durations = []
    for k, (c, d) in enumerate(marks_g):
        s, e = t(c), t(d)
        if coll is None:
            if k >= 2:  # the first two warm up
                durations.append(e - s)
        elif e > s and _covered(s, e, busy) >= OVERLAP * (e - s):
            durations.append(e - s)
    med = float(np.median(durations)) if durations else None
    per_call = (float(np.median([(t(b) - t(a)) / n_coll for a, b in marks_c]))
                if coll else None)
    return med, len(durations), len(marks_g), per_call


def _covered(s: float, e: float, busy: list) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in busy)
