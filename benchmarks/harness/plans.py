"""The ``plans`` suite: host time per plan call, against the convenience calls.

A training loop issues its collectives from the thread that launches the
model's kernels, so the host time of one call is time taken from compute
launch. For each unit this measures, per call, the median of ``--iters`` calls
two ways: ``{op}_host_us`` with the device idle and the ranks synchronized before
each call, and ``{op}_queued_host_us`` with the calls issued back to back, as a
loop that runs ahead of the device issues them. After an idle wait a call costs
more: on one H200 at 2 ranks sharing it, a graph's launch alone costs about 4x what
the same unit's does at one rank (run22-one-h200, docs/performance.md). Per impl:

* ``plan``: ``GatherPlan(...)(async_op=True)`` / ``ReducePlan(...)(async_op=True)``,
  the host time to issue (no wait); the reduction's chunks are sized to its
  Slot-Reuse slot, as ``tidearray.fsdp`` sizes them;
* ``call``: ``all_gather`` / ``reduce_scatter`` on the same buffers (the
  convenience path, which validates across ranks on every call, with the
  group's ``chunk_nbytes``);
* ``graph``: the same plans made with ``graph=True``, each call one replay of
  a captured CUDA graph (on the host backend, of the recorded primitives); on
  cuda its flags are one-thread kernels (``Config.graph_flag_kernels``, the default).

Every timed call is complete and checked afterwards: the gathered parameters
against the full ones (bitwise), so calls that skipped their work fail. ``benchmarks/run.sh``
runs it on one unit as its ``calls`` step, also against another tree (``ab``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tests import support as W
from tidearray import bfloat16


def run(ctx: Any, units: list) -> None:
    for u in units:
        _one_unit(ctx, u)


def unit_buffers(g: Any, xp: Any, u: Any) -> tuple:
    """A workload unit's ``Unit`` (bf16, chunks sized to its Slot-Reuse slot, as
    ``tidearray.fsdp`` makes them), a two-slot arena, its full parameters, this rank's
    shards of them and gradients of ones."""
    import tidearray as ta
    from tidearray.layout import slot_chunk_nbytes, unit_nbytes

    chunk = slot_chunk_nbytes(unit_nbytes(u.shapes, bfloat16, group=g), g)
    unit = ta.Unit(u.shapes, bfloat16, group=g, chunk_nbytes=chunk)
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=2, group=g)
    full = [W.values(xp, 11, i, int(np.prod(s))).reshape(s).astype(bfloat16)
            for i, s in enumerate(u.shapes)]
    shards = [ta.shard(f, group=g) for f in full]
    grads = [xp.ones(s, bfloat16) for s in u.shapes]
    return unit, arena, full, shards, grads


def _one_unit(ctx: Any, u: Any) -> None:
    import tidearray as ta

    g, xp, stream = ctx.group, ctx.dev.xp, ctx.dev.stream
    unit, arena, full, shards, grads = unit_buffers(g, xp, u)
    gather = unit.gather_plan(shards, arena[0])
    reduce = unit.reduce_plan(grads, op="avg", staging=arena[1])
    graph_gather = unit.gather_plan(shards, arena[0], graph=True)
    graph_reduce = unit.reduce_plan(grads, op="avg", staging=arena[1], graph=True)
    cases = {
        ("ag", "graph"): lambda: graph_gather(stream=stream, async_op=True),
        ("rs", "graph"): lambda: graph_reduce(stream=stream, async_op=True),
        ("ag", "plan"): lambda: gather(stream=stream, async_op=True),
        ("ag", "call"): lambda: ta.all_gather(shards, u.shapes, group=g, slot=arena[0],
                                              stream=stream, async_op=True),
        ("rs", "plan"): lambda: reduce(stream=stream, async_op=True),
        ("rs", "call"): lambda: ta.reduce_scatter(grads, op="avg", out=reduce.out, group=g,
                                                  staging=arena[1], stream=stream,
                                                  async_op=True)}
    for (op, impl), fn in cases.items():
        us = _host_us(ctx, fn)
        ctx.sink.add("plans", impl, u.name, f"{op}_host_us", us, "us")
        queued = _host_us(ctx, fn, idle=False)
        ctx.sink.add("plans", impl, u.name, f"{op}_queued_host_us", queued, "us")
        ctx.log(f"  {u.name:16s} {op} {impl:12s}: {us:8.1f} us host per call, "
                f"{queued:8.1f} us back to back")
    _check(ctx, gather, full)
    _check(ctx, graph_gather, full)


def _host_us(ctx: Any, fn: Any, idle: bool = True) -> float:
    """Median host microseconds of one call among ``--iters``, after untimed warm-up:
    with the device idle and the ranks synchronized before each call (``idle``), or
    issued back to back, the device still busy with the earlier ones."""
    for _ in range(ctx.args.warmup):
        fn()
    ctx.dev.sync()
    ctx.comm.Barrier()
    times = []
    for _ in range(ctx.args.iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if idle:
            ctx.dev.sync()  # each call issues onto idle lanes
            ctx.comm.Barrier()
    ctx.dev.sync()
    ctx.comm.Barrier()
    return float(np.median(times)) * 1e6


def _check(ctx: Any, plan: Any, full: list) -> None:
    """Poison the slot, gather once more, compare bits on every rank (collective)."""
    slot = plan.slot
    slot.view(0, (slot.nbytes,), np.uint8).fill(0xFF)
    ctx.dev.sync()  # the fill ran on the current stream, which the lanes do not follow
    ctx.comm.Barrier()  # peers write our slot: none may start before our poison landed
    got = plan(stream=ctx.dev.stream)
    ctx.dev.sync()
    bad = [i for i, (a, b) in enumerate(zip(got, full))
           if not bool((a.view(np.uint16) == b.view(np.uint16)).all())]
    everything = ctx.comm.allgather(bad)
    if any(everything):
        raise AssertionError(f"plans: gathered parameters differ: {everything}")
