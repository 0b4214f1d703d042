"""Where a repeated call's host time goes (diagnostic).

    mpirun -n 2 python benchmarks/ab/call_profile.py [UNIT]     # default qwen3-30b-a3b

Run as a script, with the repository root on ``PYTHONPATH`` (for ``tests.support``): it
measures whichever ``tidearray`` comes first there. ``benchmarks/run.sh``'s ``ab`` step
puts another commit's tree (``before/``) ahead of the root to compare its eager calls'
host time with this tree's (``TIDE_AB_STEPS=calls``). It uses only names both have.

For one unit of ``tests.support``, on the default backend: the median host
time (the call's return) of ``reduce_scatter`` and ``all_gather`` called on the same
arrays again and again, as the benchmark's ``tide`` calls them, beside the same work
through a plan; then each call's cProfile on rank 0 (the functions with the most time
of their own). The device is synchronized after every call, so each is issued on an
idle stream.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import tidearray as ta
from tests.support import units
from tidearray.layout import shard_shape

REPS = 30


def host_us(fn, g, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(REPS):
        g.comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        sync()
    return statistics.median(times) * 1e6


def profile(fn, sync, top: int = 18) -> str:
    prof = cProfile.Profile()
    for _ in range(5):
        prof.enable()
        fn()
        prof.disable()
        sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip())


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
    g = ta.init()
    xp, W = g.backend.xp, g.size
    sync = (lambda: xp.cuda.Device().synchronize()) if g.backend.name == "cuda" else (
        lambda: None)
    unit_spec = next(u for u in units() if u.name == name)
    shapes = unit_spec.shapes
    grads = [xp.zeros(s, ta.bfloat16) for s in shapes]
    outs = [xp.zeros(shard_shape(s, W), "float32") for s in shapes]
    shards = [xp.zeros(shard_shape(s, W), ta.bfloat16) for s in shapes]
    unit = ta.Unit(shapes, ta.bfloat16)
    slots = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=2)
    calls = {
        "reduce_scatter": lambda: ta.reduce_scatter(grads, out=outs, staging=slots[1],
                                                    async_op=True),
        "reduce_scatter plan": unit.reduce_plan(grads, outs, staging=slots[1]),
        "all_gather": lambda: ta.all_gather(shards, shapes, slot=slots[0], async_op=True),
        "all_gather plan": unit.gather_plan(shards, slots[0]),
    }
    rows = {}
    for what, fn in calls.items():
        call = (lambda fn=fn: fn(async_op=True)) if "plan" in what else fn
        rows[what] = (host_us(call, g, sync), profile(call, sync))
    if g.rank == 0:
        print(f"tidearray from {Path(ta.__file__).parent}")
        print(f"{name} ({len(shapes)} parameters), {g.backend.name} backend, {W} ranks; "
              f"host time per call, median of {REPS}:")
        for what, (us, _) in rows.items():
            print(f"  {what:<22} {us:8.0f} us")
        for what, (_, prof) in rows.items():
            print(f"\n== {what}: cProfile of 5 calls (rank 0)\n{prof}")
    g.close()


if __name__ == "__main__":
    main()
