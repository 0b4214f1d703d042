"""The ``ag`` and ``rs`` suites: time, bandwidth, ratio to ``stock``, correctness,
breakdowns and SM time (measured by CUPTI).

For every workload, the inputs are made once and every implementation is set
up, timed (median over the iterations; see ``timing``), checked (AG: bitwise
against the reference parameters; RS: error against an fp64 reference), and
released. For the model units, each phase of each implementation is also
timed alone (``phase:<name>``), and CUPTI measures the SM time of a call.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .data import UnitData, recv_nbytes
from .guard import guarded
from .suite import Suite, prepare, release
from .timing import measure

OPS = ("ag", "rs")


def run(ctx: Any, op: str, workloads: list) -> None:
    """Run suite ``op`` (``"ag"`` or ``"rs"``) over ``workloads``."""
    assert op in OPS
    ctx.log(f"== {op}: {len(workloads)} workloads, {ctx.args.iters} timed iterations each")
    with Suite(ctx, op) as suite:
        for unit in workloads:
            ok, data = guarded(ctx, op, "*", unit.name, "inputs",
                               lambda u=unit: UnitData(u, ctx.dev.xp, ctx.rank, ctx.size))
            if not ok:
                continue
            ctx.log(f"{op} {unit.label}: {unit.nparams} params, {unit.nbytes / 2**20:.1f} MiB")
            times = {}
            for impl in suite.impls:
                t = _run_one(ctx, op, impl, data, detail=unit.kind == "unit")
                if t is not None:
                    times[impl.name] = t
            _ratios(ctx, op, unit, times)
            del data
            ctx.dev.release_pools()


def _run_one(ctx: Any, op: str, impl: Any, data: UnitData, detail: bool) -> Optional[float]:
    if op not in impl.ops:
        return None  # by design (e.g. nccl-a2a has no all-gather): nothing to record
    prep = prepare(ctx, op, impl, data)
    if prep is None:
        return None
    try:
        fn = getattr(prep, op)
        t = _time(ctx, op, impl, data, fn, prep)
        if t is None:
            return None
        _check(ctx, op, impl, data, prep)
        if detail:
            _phases(ctx, op, impl, data, prep)
            _cupti_sm_time(ctx, op, impl, data, fn, prep)
        return t
    finally:
        release(ctx, op, impl, data, prep)


def _time(ctx: Any, op: str, impl: Any, data: UnitData, fn: Any, prep: Any) -> Optional[float]:
    a, unit = ctx.args, data.unit
    ok, stats = guarded(ctx, op, impl.name, unit.name, "timing",
                        lambda: measure(ctx, fn, iters=a.iters, warmup=a.warmup,
                                        pre=prep.pre.get(op)))
    if not ok:
        return None
    t, b2b = stats.median, stats.back_to_back
    recv = recv_nbytes(unit, ctx.size)
    bw = recv / t / 1e9
    common = {"kind": unit.kind, "x": unit.x, "nparams": unit.nparams, "nbytes": unit.nbytes}
    ctx.sink.add(op, impl.name, unit.name, "time", t, "s", **stats.summary(), **common)
    ctx.sink.add(op, impl.name, unit.name, "bandwidth", bw, "GB/s", **common)
    if b2b:
        ctx.sink.add(op, impl.name, unit.name, "bandwidth_back_to_back", recv / b2b / 1e9,
                     "GB/s", **common)
    ctx.log(f"  {impl.name:<12} {t * 1e6:10.1f} us  {bw:8.1f} GB/s per rank" + (
        f"  (back to back {b2b * 1e6:.1f} us, {recv / b2b / 1e9:.1f} GB/s)" if b2b else ""))
    return t


def _check(ctx: Any, op: str, impl: Any, data: UnitData, prep: Any) -> None:
    """One more call, verified: on inputs the timed calls never saw (renewed in place),
    into outputs poisoned first, so a call that skipped its transfers or read stale
    inputs fails."""
    get = prep.ag_out if op == "ag" else prep.rs_out
    if get is None:
        return

    def check() -> Any:
        ctx.dev.sync()
        data.renew()
        _poison(ctx.dev.xp, get())
        if prep.pre.get(op):
            prep.pre[op]()
        ctx.dev.sync()
        ctx.comm.Barrier()  # no rank's call may reach a peer's output before its poison
        getattr(prep, op)()
        ctx.dev.sync()
        return data.check_ag(get()) if op == "ag" else data.rs_error(get())

    ok, res = guarded(ctx, op, impl.name, data.unit.name, "check", check)
    if not ok:
        return
    res = ctx.comm.allgather(res)
    if op == "ag":
        good = all(r[0] for r in res)
        why = "; ".join(f"rank {i}: {r[1]}" for i, r in enumerate(res) if not r[0])
        ctx.sink.add(op, impl.name, data.unit.name, "correct", int(good), "bool",
                     status="ok" if good else "error", reason=why)
        if not good:
            ctx.log(f"  {impl.name:<12} WRONG RESULT: {why}")
            ctx.errors.append(f"{op} {impl.name} {data.unit.name}: {why}")
        return
    worst = {k: max(r[k] for r in res) for k in res[0]}
    inexact = worst["norm_rel"] > impl.rs_tolerance
    bad = worst["nonfinite"] or worst["pad_nonzero"] or inexact
    ctx.sink.add(op, impl.name, data.unit.name, "rs_error", worst["norm_rel"], "rel",
                 status="error" if bad else "ok", **worst)
    wrong = (f"WRONG: {worst['nonfinite']} unwritten, {worst['pad_nonzero']} nonzero padding, "
             f"error {worst['norm_rel']:.2e} (tolerance {impl.rs_tolerance:g})")
    ctx.log(f"  {impl.name:<12} error vs fp64: max {worst['max_abs']:.2e}, mean "
            f"{worst['mean_abs']:.2e}, {worst['norm_rel']:.2e} normwise, "
            f"{worst['elem_rel']:.2e} elementwise" + (f"  {wrong}" if bad else ""))
    if bad:
        ctx.errors.append(f"{op} {impl.name} {data.unit.name}: {wrong}")


def _poison(xp: Any, outs: Any) -> None:
    """All-ones bits in every output (NaN in floats): nothing the data can hold."""
    for o in outs:
        if o.size:
            bits = o.view(f"uint{8 * o.dtype.itemsize}")
            bits.fill(np.iinfo(bits.dtype).max)


def _phases(ctx: Any, op: str, impl: Any, data: UnitData, prep: Any) -> None:
    a, unit = ctx.args, data.unit
    for name, ph in prep.phases.items():
        if not name.startswith(op + "."):
            continue
        ok, stats = guarded(ctx, op, impl.name, unit.name, f"phase {name}",
                            lambda f=ph.fn: measure(ctx, f, iters=a.iters, warmup=a.warmup,
                                                    back_to_back=False))
        if not ok:
            continue
        ctx.sink.add(op, impl.name, unit.name, "phase:" + name.split(".", 1)[1], stats.median,
                     "s", kind=ph.kind, ctas=ph.ctas, note=ph.note, part=ph.part)


#: Calls traced by CUPTI per implementation and unit (the SM time is per call).
CUPTI_CALLS = 5


def _cupti_sm_time(ctx: Any, op: str, impl: Any, data: UnitData, fn: Any, prep: Any) -> None:
    """SM time per call measured by CUPTI over ``CUPTI_CALLS`` calls, and every kernel
    the calls launched (cuda, where torch.profiler can reach CUPTI)."""
    from . import cupti

    if ctx.dev.name != "cuda":
        return
    ok, why = cupti.available()
    if not ok or prep.pre.get(op):
        reason = why if not ok else "needs an untimed step before each call, inside the window"
        ctx.sink.skip(op, impl.name, data.unit.name, f"sm_time_cupti: {reason}")
        return

    def traced() -> Any:
        def calls() -> None:
            for _ in range(CUPTI_CALLS):
                fn()
            ctx.dev.sync()
        return cupti.trace(calls)

    ok, events = guarded(ctx, op, impl.name, data.unit.name, "CUPTI trace", traced)
    if not ok or events is None:
        return
    kernels = sorted({e["name"] for e in events if e["cat"] == "kernel"})
    value = cupti.sm_seconds(events, ctx.dev.num_sms) / CUPTI_CALLS
    local = cupti.same_device_copies(events)
    local_us = sum(e["dur_us"] for e in local) / CUPTI_CALLS
    ctx.sink.add(op, impl.name, data.unit.name, "sm_time_cupti", value, "s",
                 kernels=[k[:120] for k in kernels[:24]], calls=CUPTI_CALLS,
                 kernel_launches=sum(e["cat"] == "kernel" for e in events) / CUPTI_CALLS,
                 same_device_copies=len(local) / CUPTI_CALLS, same_device_copy_us=local_us)
    ctx.log(f"  {impl.name:<12} SM time (CUPTI) {value * 1e6:8.1f} us per call; kernels: "
            + (", ".join(k[:40] for k in kernels[:6]) or "none")
            + (f"; same-device copies (on the SMs, grid unknown): {len(local) / CUPTI_CALLS:g} "
               f"per call, {local_us:.1f} us" if local else ""))


def _ratios(ctx: Any, op: str, unit: Any, times: dict) -> None:
    base = times.get("stock")
    if base is None:
        return
    for name, t in times.items():
        ctx.sink.add(op, name, unit.name, "speedup_vs_stock", base / t, "x")
