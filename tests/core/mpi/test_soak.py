"""Soak: thousands of all-gathers and reduce-scatters, nothing leaks, nothing drifts.

Alternates two units, two slots, the plans and the convenience calls, synchronous and
``async_op`` calls, and (on cuda) two streams. Every 50 steps the results are checked
against references (bitwise for the gathers, fp64 for the reductions). Host RSS, open
file descriptors, the group's symmetric regions and (cuda) device memory are read after a
warm-up and at the end: descriptors and regions (each holds its VMM or IPC mappings) must
not change, RSS and the device memory CuPy's pool holds may grow by at most 32 and 64 MiB.
Also reported: the pool's bytes in use (they move by the few results alive when read) and
the device's memory in use (the whole device's, other processes' too). ``TIDE_SOAK_STEPS`` sets the
length (300 here; 2,000 for the figures in docs/reliability.md); ``TIDE_SOAK_REPORT=path``
appends the before/after figures to a file.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta

from ..._util import FP32, agree, compare_bits, fresh_seed, padded_shard, to_numpy, to_xp
from ._cases import rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
STEPS = int(os.environ.get("TIDE_SOAK_STEPS", "300"))
CHECK_EVERY = 50
WARMUP = 20
pytestmark = pytest.mark.mpi


def _usage(group, xp) -> dict:
    """RSS, open descriptors, the group's symmetric regions (each holds its VMM or IPC
    mappings) and, on cuda, device memory in use (driver) and in CuPy's pool."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    out = {"rss": rss, "fds": len(os.listdir("/proc/self/fd")),
           "regions": len(group._resources)}
    if xp is not np:
        xp.cuda.Device().synchronize()
        free, total = xp.cuda.runtime.memGetInfo()
        out["device_used"] = total - free  # the whole device's: other processes' too
        pool = xp.get_default_memory_pool()
        out["pool_used"], out["pool_held"] = pool.used_bytes(), pool.total_bytes()
    return out


def test_soak(group, xp):
    shapes = [[(4 * WORLD + 1, 33), (7,)], [(2 * WORLD, 64)]]
    units = [ta.Unit(s, FP32, group=group) for s in shapes]
    arena = ta.SlotArena(max(max(u.nbytes, u.staging_nbytes) for u in units), 3, group=group)
    rng = np.random.default_rng(fresh_seed(group.comm, bits=30))
    fulls = [[rng.standard_normal(s).astype(np.float32) for s in u.shapes] for u in units]
    shards = [[to_xp(xp, padded_shard(f, WORLD, group.rank)) for f in full] for full in fulls]
    grads = [[to_xp(xp, g) for g in rank_grads(u.shapes, FP32, 11, group.rank)] for u in units]
    gathers = {(i, k): u.gather_plan(shards[i], arena[k]) for i, u in enumerate(units)
               for k in range(2)}
    reduces = [u.reduce_plan(grads[i], op="sum", staging=arena[2]) for i, u in enumerate(units)]
    streams = [None] if xp is np else [xp.cuda.Stream(non_blocking=True) for _ in range(2)]
    failures, before = [], None
    for step in range(STEPS):
        i, k, stream = step % 2, (step // 2) % 2, streams[step % len(streams)]
        async_op, planned = step % 3 == 0, step % 4 < 2
        if planned:
            params = gathers[(i, k)](stream=stream, async_op=async_op)
            outs = reduces[i](stream=stream, async_op=async_op)
        else:
            params = ta.all_gather(shards[i], units[i].shapes, group=group, slot=arena[k],
                                   stream=stream, async_op=async_op)
            outs = ta.reduce_scatter(grads[i], op="sum", group=group, staging=arena[2],
                                     stream=stream, async_op=async_op)
        if async_op:
            params, outs = params.wait(stream), outs.wait(stream)
        if step % CHECK_EVERY == CHECK_EVERY - 1 or step == STEPS - 1:
            if stream is not None:
                stream.synchronize()
            failures += _check(group, units[i], params, outs, fulls[i], step)
        if step == WARMUP:
            before = _usage(group, xp)
    after = _usage(group, xp)
    for what in ("fds", "regions"):
        if after.get(what) != before.get(what):
            failures.append(f"{what} {before.get(what)} -> {after.get(what)}")
    if after.get("pool_held", 0) - before.get("pool_held", 0) > 64 << 20:
        grew = (after["pool_held"] - before["pool_held"]) >> 20
        failures.append(f"CuPy's pool grew {grew} MiB")
    if after["rss"] - before["rss"] > 32 << 20:
        failures.append(f"RSS grew {(after['rss'] - before['rss']) >> 20} MiB")
    if os.environ.get("TIDE_SOAK_REPORT"):
        with open(os.environ["TIDE_SOAK_REPORT"], "a") as f:
            f.write(json.dumps({"rank": group.rank, "world": WORLD, "steps": STEPS,
                                "backend": group.backend.name, "before": before,
                                "after": after}) + "\n")
    agree(group.comm, failures, "soak")


def _check(group, unit, params, outs, full, step) -> list[str]:
    failures = []
    for j, (p, f) in enumerate(zip(params, full)):
        failures += compare_bits(p, f, f"step {step}: parameter {j}")
    every = [rank_grads(unit.shapes, FP32, 11, r) for r in range(WORLD)]
    for j, o in enumerate(outs):
        want = padded_shard(sum(e[j].astype(np.float64) for e in every), WORLD, group.rank)
        err = np.abs(to_numpy(o).astype(np.float64) - want).max(initial=0.0)
        if err > 4 * WORLD * 2.0**-24 * max(np.abs(want).max(initial=0.0), 1.0) * 8:
            failures.append(f"step {step}: reduced parameter {j} off by {err}")
    return failures
