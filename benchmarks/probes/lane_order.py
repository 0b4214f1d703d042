"""The inter-node pipelines as issued: which lane gets which work, in which order.

Runs one reduce-scatter and one all-gather across emulated nodes on the host backend,
records every primitive rank 0 issues (lane, kind, chunk or step), and draws them as a
picture of the lanes: docs/img/pipelines.png, the picture in docs/topology.md. It
shows the issue order, the schedule every backend runs (on the host backend a lane's
work is done when its call returns), not measured time::

    TIDE_LOCAL_SIZE=2 mpiexec -n 8 python -m benchmarks.probes.lane_order \\
        --out docs/img/pipelines.png

Needs matplotlib on rank 0. Prints the order as text too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import tidearray as ta
from tidearray._schedule import internode_ag_steps

RECORDED = ("copy", "exchange", "accumulate")


def record(group: Any) -> list:
    """Patch the group's backend: every executor it makes logs ``(kind, lane, args)``."""
    from tests._util import recording_executor  # the recorder the pipeline tests use

    log, group.backend.executor = recording_executor(group.backend.executor, RECORDED)
    return log


def reduce_scatter_order(group: Any, log: list) -> list[tuple[str, str]]:
    """``(lane, label)`` per primitive of one reduce-scatter of 4 chunks."""
    W, nodes = group.size, group.topology.num_nodes
    shapes = [(16 * W, 256)]  # 16 rows of 512 B per shard: 4 chunks of 4 rows per node
    unit = ta.Unit(shapes, np.float16, group=group, chunk_nbytes=4 * 512 * nodes)
    grads = [np.ones(shapes[0], np.float16)]
    plan = unit.reduce_plan(grads, op="avg")
    del log[:]
    plan()
    return _labels(group, log, "chunk")


def all_gather_order(group: Any, log: list) -> list[tuple[str, str]]:
    W = group.size
    shapes = [(8 * W, 64)]
    unit = ta.Unit(shapes, np.float16, group=group)
    shards = [np.ones(unit.shard_shapes[0], np.float16)]
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=group)
    plan = unit.gather_plan(shards, slot=arena[0])
    del log[:]
    plan()
    out = _labels(group, log, "step")
    arena[0].free()
    return out


def _labels(group: Any, log: list, unit_word: str) -> list[tuple[str, str]]:
    """Name each primitive: its lane, and which chunk (RS) or arrival group (AG) it is."""
    ex_compute, ex_net = group.local_size, group.local_size + 1
    me = group.topology.local_rank
    counts: dict = {}
    out = []
    for name, lane, args in log:
        if name == "accumulate":
            what = "sum" if np.dtype(args[1]) == np.float32 else "acc"
        elif name == "exchange":
            what = "exchange"
        else:
            what = "push" if lane != me else "own copy"
        k = counts[(what, lane)] = counts.get((what, lane), -1) + 1
        lane_name = ("COMPUTE" if lane == ex_compute else "NET" if lane == ex_net
                     else f"lane {lane}" + (" (own)" if lane == me else ""))
        if unit_word == "step" and what == "push":
            label = "push own shards" if k == 0 else f"push step {k - 1}'s"
        elif unit_word == "step":
            label = f"{what} {k}" if what == "exchange" else what
        else:
            label = f"{what} {k}"
        out.append((lane_name, label))
    return out


def draw(panels: list[tuple[str, list]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"push": "#4c72b0", "acc": "#55a868", "sum": "#c44e52", "exchange": "#8172b2",
               "own": "#937860"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 * len(panels) + 0.6))
    for ax, (title, order) in zip(np.atleast_1d(axes), panels):
        lanes = sorted({lane for lane, _ in order}, key=lambda s: (s == "NET", s == "COMPUTE", s))
        for x, (lane, label) in enumerate(order):
            y = lanes.index(lane)
            c = next((v for k, v in colours.items() if label.startswith(k)), "#777777")
            ax.barh(y, 0.92, left=x, height=0.6, color=c)
            ax.text(x + 0.46, y, label.replace(" ", "\n", 1), ha="center", va="center",
                    fontsize=6.5, color="white")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlim(-0.2, len(order) + 0.2)
        ax.set_xlabel("issue order (each lane runs its work in this order; lanes wait "
                      "only on marks, events and flags)")
        ax.set_title(title, fontsize=10, loc="left")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="PNG to write (rank 0; none by default)")
    args = ap.parse_args(argv)
    group = ta.init(backend="host")
    topo = group.topology
    if topo.num_nodes < 2:
        sys.exit("lane_order: needs several nodes (TIDE_LOCAL_SIZE)")
    log = record(group)
    rs = reduce_scatter_order(group, log)
    ag = all_gather_order(group, log)
    if group.rank == 0:
        steps = len(internode_ag_steps(topo.num_nodes, topo.node))
        panels = [(f"reduce-scatter, rank 0 of {topo.num_nodes} nodes x {topo.local_size}: "
                   "each chunk's exchange overlaps the next chunk's accumulate", rs),
                  (f"all-gather, rank 0: {steps} exchange steps; each step's pieces are "
                   "pushed while the next step runs", ag)]
        for title, order in panels:
            print(title)
            for lane, label in order:
                print(f"  {lane:14s} {label}")
        if args.out:
            draw(panels, args.out)
            print(f"wrote {args.out}")
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
