"""Host time per eager call, for an A/B of two trees in one session.

    mpirun -n 2 python benchmarks/probes/eager_ab.py LABEL OUT.jsonl [UNIT ...]

Run from the repository root with ``PYTHONPATH`` naming the tree under test first
(``PYTHONPATH=before:.`` for an older tree, ``PYTHONPATH=.`` for this one): the probe
uses only calls both trees have (``init``, ``all_gather``, ``reduce_scatter``, ``Unit``
and its plans, ``SlotArena``; ``_shard.shard_shape``). For each unit of
``benchmarks.harness.workloads`` (default: the Qwen3-30B-A3B layer, 393 parameters, and
the Llama-3.1-8B layer) it times the host time of each call's return (median of
``call_profile.REPS``; the device synchronized after every call, so each is issued on
an idle stream):
the eager gather into a given slot and into the group's own, the eager reduction with
``out=`` and without, and both plans. One JSON record per (unit, call) goes to OUT, with
the label, the commit (``TIDE_GIT_COMMIT``), the backend and the world size.
``TIDE_AB_SCALE`` > 1 divides every width (a CPU smoke run).
"""

from __future__ import annotations

import json
import os
import sys

import tidearray as ta
from benchmarks.harness.workloads import units
from benchmarks.probes.call_profile import REPS, host_us
from tidearray._shard import shard_shape


def calls(g, spec) -> dict:
    """The timed calls of one unit, on zeros (host time does not depend on values)."""
    xp, W, shapes = g.backend.xp, g.size, spec.shapes
    grads = [xp.zeros(s, ta.bfloat16) for s in shapes]
    outs = [xp.zeros(shard_shape(s, W), "float32") for s in shapes]
    shards = [xp.zeros(shard_shape(s, W), ta.bfloat16) for s in shapes]
    unit = ta.Unit(shapes, ta.bfloat16, group=g)
    slots = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=2, group=g)
    gather = unit.gather_plan(shards, slots[0])
    reduce = unit.reduce_plan(grads, outs, staging=slots[1])
    return {
        "all_gather slot=": lambda: ta.all_gather(shards, shapes, group=g, slot=slots[0],
                                                  async_op=True),
        "all_gather": lambda: ta.all_gather(shards, shapes, group=g, async_op=True),
        "reduce_scatter out=": lambda: ta.reduce_scatter(grads, out=outs, group=g,
                                                         staging=slots[1], async_op=True),
        "reduce_scatter": lambda: ta.reduce_scatter(grads, group=g, async_op=True),
        "all_gather plan": lambda: gather(async_op=True),
        "reduce_scatter plan": lambda: reduce(async_op=True),
    }


def main() -> None:
    label, out = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or ["qwen3-30b-a3b", "llama3.1-8b"]
    g = ta.init()
    xp = g.backend.xp
    sync = (lambda: xp.cuda.Device().synchronize()) if g.backend.name == "cuda" else (
        lambda: None)
    records = []
    scale = int(os.environ.get("TIDE_AB_SCALE", "1"))  # > 1: narrower units (CPU smoke)
    for spec in (u for u in units(scale) if u.name in names):
        for what, fn in calls(g, spec).items():
            us = host_us(fn, g, sync)
            records.append({"label": label, "commit": os.environ.get("TIDE_GIT_COMMIT", "?"),
                            "backend": g.backend.name, "world": g.size, "unit": spec.name,
                            "params": len(spec.shapes), "call": what, "host_us": round(us, 1),
                            "reps": REPS, "scale": scale})
            if g.rank == 0:
                print(f"{label:>8} {spec.name:<14} {what:<22} {us:8.0f} us", flush=True)
    if g.rank == 0:
        with open(out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    g.close()


if __name__ == "__main__":
    main()
