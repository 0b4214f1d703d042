"""A graph plan's replay taken apart: what each part of a call costs the host, per unit.

    mpirun -n 2 python benchmarks/probes/graph_replay.py [--iters 200] [--out DIR]

For each unit of the ``plans`` suite (``benchmarks.harness.workloads.units``), a gather
and a reduce graph plan, once with the flags as one-thread kernels (the default) and once
as stream memory operations. Per graph: its nodes by type and its root nodes (the lanes
that start it). Per call, ``--iters`` times with the device idle before each, the host
time of the bare launch (``cuGraphLaunch`` alone), of the launch and its completion
event (one event, or one of eight in turn as a graph's launch takes them), of the
graph's launch (``CudaGraph.launch``: those and the watchdog's registration) and of the
whole plan call (``plan(async_op=True)``). Twice: every rank launching
right after a barrier ("together"), and rank r launching r x 500 us after it
("staggered"), so that ranks sharing a GPU do not enter the driver at the same moment.
Each rank's median and 10th and 90th percentiles; every gather is checked bitwise at the
end.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import time
from typing import Any, Callable

import numpy as np

STAGGER_NS = 500_000


def _node_kinds(graph: int) -> tuple[dict[str, int], int]:
    """The graph's nodes by type name (cuda.bindings' enum), and its root count."""
    from cuda.bindings import driver as cu

    from tidearray.backends.cuda import driver

    p = ctypes.c_void_p
    get_nodes = driver.entry("cuGraphGetNodes", driver.CUDA_12_0, p, p, p)
    get_roots = driver.entry("cuGraphGetRootNodes", driver.CUDA_12_0, p, p, p)
    get_type = driver.entry("cuGraphNodeGetType", driver.CUDA_12_0, p, p)
    count, roots = ctypes.c_size_t(), ctypes.c_size_t()
    for fn, n in ((get_nodes, count), (get_roots, roots)):
        if fn(graph, None, ctypes.byref(n)):
            raise RuntimeError("cuGraphGetNodes / cuGraphGetRootNodes failed")
    nodes = (ctypes.c_void_p * count.value)()
    if get_nodes(graph, nodes, ctypes.byref(count)):
        raise RuntimeError("cuGraphGetNodes failed")
    kinds: dict[str, int] = {}
    kind = ctypes.c_int()
    for node in nodes:
        if get_type(node, ctypes.byref(kind)):
            raise RuntimeError("cuGraphNodeGetType failed")
        name = cu.CUgraphNodeType(kind.value).name.removeprefix("CU_GRAPH_NODE_TYPE_")
        kinds[name] = kinds.get(name, 0) + 1
    return kinds, int(roots.value)


def _spread(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns) / 1e3
    return {"median_us": float(np.median(a)), "p10_us": float(np.percentile(a, 10)),
            "p90_us": float(np.percentile(a, 90))}


def _time(comm: Any, iters: int, staggered: bool, fn: Callable[[], Any]) -> list[int]:
    import cupy

    delay = STAGGER_NS * comm.rank if staggered else 0
    out = []
    for _ in range(iters):
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        if delay:
            until = time.perf_counter_ns() + delay
            while time.perf_counter_ns() < until:
                pass
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", default="together,staggered")
    args = ap.parse_args()
    import cupy

    import tidearray as ta
    from benchmarks.harness import workloads as W
    from benchmarks.harness.plans import memop_graph_flags, unit_buffers

    g = ta.init(backend="cuda")
    comm, flags = g.comm, g.backend.lanes.flags
    if not flags.graph_kernels:
        raise SystemExit("graph_replay: expected the flags in graphs as kernels (the default, "
                         f"TIDE_GRAPH_FLAG_KERNELS=1), got memory operations: {flags.reason}")
    stream = cupy.cuda.Stream(non_blocking=True)
    record = cupy.cuda.runtime.eventRecord
    event = cupy.cuda.Event(block=False, disable_timing=True)
    events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(8)]
    commit = os.environ.get("TIDE_GIT_COMMIT", "unknown")
    records = []
    for u in W.units():
        unit, arena, full, shards, grads = unit_buffers(g, cupy, u)
        for flag_kind in ("kernels", "memops"):
            # Each plan is captured as it is made, with the flags of that moment.
            with memop_graph_flags(flags) if flag_kind == "memops" else contextlib.nullcontext():
                plans = {"ag": unit.gather_plan(shards, arena[0], graph=True),
                         "rs": unit.reduce_plan(grads, op="avg", staging=arena[1],
                                                graph=True)}
            for op, plan in plans.items():
                graph = plan.graph
                kinds, roots = _node_kinds(graph._graph)
                ptr = stream.ptr

                def with_event(graph: Any = graph, ptr: int = ptr) -> None:
                    graph._launch_on(ptr)
                    record(event.ptr, ptr)

                turn = itertools.cycle(events)

                def with_events(graph: Any = graph, ptr: int = ptr, turn: Any = turn) -> None:
                    graph._launch_on(ptr)  # and one of 8 events, as CudaGraph.launch
                    record(next(turn).ptr, ptr)

                calls = {"bare": lambda graph=graph, ptr=ptr: graph._launch_on(ptr),
                         "event": with_event, "events8": with_events,
                         "launch": lambda graph=graph, ptr=ptr: graph.launch(ptr),
                         "call": lambda plan=plan: plan(stream=stream, async_op=True)}
                for mode in args.modes.split(","):
                    rec = {"unit": u.name, "op": op, "flags": flag_kind, "mode": mode,
                           "ranks": g.size, "nodes": kinds, "roots": roots,
                           "commit": commit}
                    for name, fn in calls.items():
                        per_rank = comm.allgather(_spread(_time(comm, args.iters,
                                                                mode == "staggered", fn)))
                        rec[name] = per_rank
                    records.append(rec)
                    if g.rank == 0:
                        cols = "  ".join(
                            f"{n} {np.median([r['median_us'] for r in rec[n]]):6.1f}"
                            for n in calls)
                        print(f"{u.name:14s} {op} {flag_kind:7s} {mode:9s} {cols} us "
                              f"(median over ranks of each rank's median)  "
                              f"roots {roots} nodes {kinds}", flush=True)
            plan = plans["ag"]
            plan.slot.view(0, (plan.slot.nbytes,), np.uint8).fill(0xFF)
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            got = plan(stream=stream)
            stream.synchronize()
            bad = [i for i, (a, b) in enumerate(zip(got, full))
                   if not bool((a.view(np.uint16) == b.view(np.uint16)).all())]
            if any(comm.allgather(bad)):
                raise AssertionError(f"{u.name}: gathered parameters differ")
            plans["rs"](stream=stream)
            stream.synchronize()
            comm.Barrier()
    if g.rank == 0:
        with open(os.path.join(args.out, "graph_replay.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        print(f"records: {os.path.join(args.out, 'graph_replay.jsonl')}")
    g.close()


if __name__ == "__main__":
    main()
