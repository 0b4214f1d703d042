"""The ``memory`` suite: device memory each path needs beyond its inputs.

For every unit and implementation: inputs (shards and gradients) are made
first; pools are emptied; then the implementation opens fresh communicators
(NCCL allocates its buffers at init and at the first collective), sets up, and
runs its all-gather and reduce-scatter twice. ``peak`` is the largest rise of
``cudaMemGetInfo``'s used bytes over the baseline, read after each step; it
includes NCCL's own buffers, symmetric memory and the CuPy pool. ``pool`` is
the CuPy pool's size afterwards; ``accounted`` sums the buffers the path made
itself (the only figure on the host backend).
"""

from __future__ import annotations

from typing import Any

from .data import UnitData
from .guard import guarded
from .suite import Suite, prepare, release


def run(ctx: Any, workloads: list) -> None:
    ctx.log(f"== memory: {len(workloads)} units")
    with Suite(ctx, "memory") as suite:
        for impl in suite.impls:  # measured with fresh communicators, below
            guarded(ctx, "memory", impl.name, "*", "close", impl.close)
        for unit in workloads:
            data = UnitData(unit, ctx.dev.xp, ctx.rank, ctx.size)
            ctx.log(f"memory {unit.label}: inputs {data.input_nbytes / 2**20:.1f} MiB per rank")
            for impl in suite.impls:
                _measure(ctx, impl, data)
            del data
            ctx.dev.release_pools()
        for impl in suite.impls:
            guarded(ctx, "memory", impl.name, "*", "open", impl.open)


def _measure(ctx: Any, impl: Any, data: UnitData) -> None:
    dev, unit = ctx.dev, data.unit
    dev.release_pools()
    ctx.comm.Barrier()
    base, pool0 = dev.mem_used(), dev.pool_bytes()
    ok, _ = guarded(ctx, "memory", impl.name, unit.name, "open", impl.open)
    if not ok:
        return
    seen = [dev.mem_used()]
    prep = prepare(ctx, "memory", impl, data)
    if prep is not None:
        def run() -> None:
            for _ in range(2):
                for op in ("ag", "rs"):
                    if prep.pre.get(op):
                        prep.pre[op]()
                    fn = getattr(prep, op)
                    if fn is not None:
                        fn()
                        seen.append(dev.mem_used())
        ran, _ = guarded(ctx, "memory", impl.name, unit.name, "run", run)
        pool = dev.pool_bytes()
        release(ctx, "memory", impl, data, prep)
        if ran:
            _record(ctx, impl, unit, base, seen, pool0, pool, prep.accounted_nbytes)
    guarded(ctx, "memory", impl.name, unit.name, "close", impl.close)
    dev.release_pools()


def _record(ctx: Any, impl: Any, unit: Any, base: Any, seen: list, pool0: Any, pool: Any,
            accounted: Any) -> None:
    line = f"  {impl.name:<12}"
    if accounted is not None:
        accounted = max(ctx.comm.allgather(accounted))
        ctx.sink.add("memory", impl.name, unit.name, "accounted", accounted, "B")
        line += f" accounted {accounted / 2**20:9.1f} MiB"
    if base is not None:
        peak = max(ctx.comm.allgather(max(s - base for s in seen if s is not None)))
        pool_rise = max(ctx.comm.allgather(pool - pool0))
        ctx.sink.add("memory", impl.name, unit.name, "peak", peak, "B", pool=pool_rise)
        line += f"  peak {peak / 2**20:9.1f} MiB  (CuPy pool {pool_rise / 2**20:.1f} MiB)"
    ctx.log(line)
