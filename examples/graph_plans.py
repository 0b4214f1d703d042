"""Graph plans: a unit's gather and reduction captured once, replayed at every step.

Run on any number of ranks, on the default backend::

    mpiexec -n 2 python examples/graph_plans.py

``Unit.gather_plan(..., graph=True)`` and ``Unit.reduce_plan(..., graph=True)`` run
their collective once, then capture what one call issues: a CUDA graph on the cuda
backend (one ``cuGraphLaunch`` of host time per call, whatever the number of
parameters), a recording of the call's primitives on the host backend. Each later
call replays it. The inputs are read in place, so a loop writes each step's shards
and gradients into the same arrays, as FSDP does. This example does that for 20
steps, checks every replay against the eager plans' results (bitwise), times both,
and prints a summary on rank 0. A third plan gathers into buffers of the caller's
(``out=``, for parameters that must live in memory of their own, as XLA's do in
``tidearray.jax``), checked against the same results.
"""

from __future__ import annotations

import time

import numpy as np

import tidearray as ta

SHAPES = [(1024, 256), (256,), (688, 256), (256, 688), (3, 5)]
STEPS = 20


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def main() -> None:
    g = ta.init()
    xp = g.backend.xp
    unit = ta.Unit(SHAPES, ta.bfloat16, group=g)
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=3, group=g)
    shards = [xp.zeros(s, ta.bfloat16) for s in unit.shard_shapes]
    grads = [xp.zeros(s, ta.bfloat16) for s in SHAPES]
    eager = unit.gather_plan(shards, arena[0]), unit.reduce_plan(grads, staging=arena[2])
    graph = (unit.gather_plan(shards, arena[1], graph=True),
             unit.reduce_plan(grads, staging=arena[2], graph=True))
    outs = [xp.empty(s, ta.bfloat16) for s in SHAPES]  # the parameters live here
    into = unit.gather_plan(shards, arena[0], graph=True, out=outs)
    rng = np.random.default_rng(g.rank)
    host = {"eager": [], "graph": []}
    ok = True
    for _ in range(STEPS):
        for s in shards:  # new data, in place: the plans read these very arrays
            s[...] = xp.asarray(rng.standard_normal(s.shape).astype(ta.bfloat16))
        for a in grads:
            a[...] = xp.asarray(rng.standard_normal(a.shape).astype(ta.bfloat16))
        results = {}
        for name, (gather, reduce) in (("eager", eager), ("graph", graph)):
            t0 = time.perf_counter()
            params, reduced = gather(async_op=True), reduce(async_op=True)
            host[name].append(time.perf_counter() - t0)
            results[name] = ([to_host(p).copy() for p in params.wait()],
                             [to_host(r).copy() for r in reduced.wait()])
        into()  # arena[0] again: after the eager gather, which was waited for
        results["into"] = ([to_host(o).copy() for o in outs], results["eager"][1])
        same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for other in ("graph", "into")
                   for k in (0, 1) for a, b in zip(results["eager"][k], results[other][k]))
        ok = g.comm.allreduce(same, op=min) and ok
    if g.rank == 0:
        med = {k: float(np.median(v[2:])) * 1e6 for k, v in host.items()}
        print(f"graph plans on {g.size} rank(s), backend {g.backend.name}: {STEPS} steps, "
              f"{len(SHAPES)} parameters")
        print(f"  host time per gather + reduction: eager plans {med['eager']:.0f} us, "
              f"graph plans {med['graph']:.0f} us (median after 2 steps)")
        print(f"  every replay, and every gather into buffers of ours (out=), bitwise "
              f"equal to the eager plans: {ok}")
        if g.backend.name == "host":
            print("  (host backend: a call does the copies itself, so its host time is the "
                  "collective's; on cuda a graph plan call is one graph launch)")
    g.close()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
