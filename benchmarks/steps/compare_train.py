"""The training step under each runtime comm: TIDE against FSDP2's flat path and the floor.

    mpirun -n 2 python benchmarks/steps/compare_train.py --model small --steps 20
    mpirun -n 2 python benchmarks/steps/compare_train.py --model llama3-8b-8l \\
        --tokens 8192 --steps 50 --profile --out OUT/train

``examples/train.py``'s trainer (same model, data and optimizer), run once per
``--impl``: ``tide`` (TIDE plans), ``stock`` (:class:`benchmarks.baselines.StockComm`:
FSDP2's flat path, fused copy-in/out + flat all-gather, fused fp32 pack + flat fp32
reduce-scatter; NCCL on cuda), ``local`` (:class:`benchmarks.baselines.LocalComm`: the
no-communication floor, the whole model on each rank, the same per-rank work), or
``all`` (the three in turn, in one run, then a comparison; the default), or ``graph``
(``tide`` eager, then ``tide`` with the whole step captured as a CUDA graph and
replayed: ``train.py --graph``; host time per step and step time side by side, and the
losses, which must be bitwise equal). ``--out DIR``
writes the run's JSON record (with the git commit), a table and plots; ``--profile``
adds one CUPTI-profiled step of each; ``--report JSON`` remakes the table and plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Optional

import tidearray as ta
from benchmarks.baselines import LocalComm, StockComm
from benchmarks.harness import training
from benchmarks.harness.records import git_commit
from tests.support import example

train = example("train")

#: ``--impl`` name -> what ``Runtime(comm=...)`` gets.
COMMS = {"tide": "tide", "stock": StockComm, "local": LocalComm}


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = train.parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--impl", default="all", choices=[*COMMS, "all", "graph"])
    p.add_argument("--out", default=None, help="directory for the record, table and plots")
    p.add_argument("--profile", action="store_true",
                   help="profile one step of each impl with CUPTI (torch.profiler) into --out")
    p.add_argument("--report", default=None, metavar="TRAIN_JSON",
                   help="only rebuild the table and plot next to this record, then exit")
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    if args.report:
        print(report(args.report))
        return
    g = ta.init(backend=args.backend)
    log = train.Log(g.rank)
    cfg, B = train.configure(args, g)
    tokens = B * cfg.seq
    impls = {"all": list(COMMS), "graph": ["tide", "tide-graph"]}.get(args.impl, [args.impl])
    log(f"compare_train: {args.model} ({cfg.layers} layers, hidden {cfg.hidden}), {tokens} "
        f"tokens/rank x {args.micro_batches} micro-batches, {g.size} ranks, backend "
        f"{g.backend.name}, {args.param_dtype}, impls {impls}")
    records = []
    for kind in impls:
        inspect = None
        if args.profile and args.out:
            def inspect(sm: Any, net: Any, batches: list, stream: Any, kind: str = kind) -> Any:
                return profile_step(args, g, kind, sm, net, batches, stream, log)
        # Both runs of --impl graph use the model's capturable kernels: bitwise comparable.
        run_args = argparse.Namespace(**{**vars(args), "graph": kind.endswith("-graph"),
                                         "capturable_model": args.impl == "graph"})
        records.append(train.run(run_args, g, COMMS[kind.removesuffix("-graph")], cfg, B, log,
                                 inspect=inspect))
    rows = goals(records)
    log("\n" + "\n".join(table(records, rows)))
    if args.out and g.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        record = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "argv": sys.argv, "model": args.model, "config": cfg.__dict__,
                  "tokens_per_rank": tokens, "world": g.size, "backend": g.backend.name,
                  "param_dtype": args.param_dtype, "runs": records, "comparison": {"goals": rows}}
        path = os.path.join(args.out, "train.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        log(f"record: {path}; table and plot: {report(path)}")
    g.close()


def profile_step(args: argparse.Namespace, g: Any, kind: str, sm: Any, net: Any,
                 batches: list, stream: Any, log: Any) -> Optional[dict]:
    """One more step under CUPTI: its events (for a timeline PNG) go to --out, the device
    time per role (compute, accumulate, NCCL, layout conversion, copies) to the record."""
    xp = g.backend.xp

    def step() -> None:
        with stream or contextlib.nullcontext():
            train.whole_step(sm, net, [(xp.asarray(t), xp.asarray(y)) for t, y in batches])
        train.sync(xp)

    path = os.path.join(args.out, f"{kind}_step_trace.json") if g.rank == 0 else None
    return training.profile_step(step, path, log)


def table(runs: list, rows: list) -> list[str]:
    """The runs (medians after warm-up) and the goals, as markdown."""
    floor = next((r["median_step_s"] for r in runs if r["impl"] == "local"), None)
    lines = ["| impl | median step (ms) | host per step (ms) | vs floor | peak memory (GiB) "
             "| first loss | last loss |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        ratio = f"{r['median_step_s'] / floor:.3f}" if floor else "-"
        host = f"{r['median_host_s'] * 1e3:.3f}" if "median_host_s" in r else "-"  # run7's
        lines.append(f"| {r['impl']} | {r['median_step_s'] * 1e3:.2f} | {host} | {ratio} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | {r['losses'][0]:.4f} | "
                     f"{r['losses'][-1]:.4f} |")
    lines += ["", "| goal | measured | |", "| --- | --- | --- |"]
    return lines + [f"| {g['goal']} | {g['measured']} | {'met' if g['met'] else 'missed'} |"
                    for g in rows]


def goals(records: list) -> list[dict]:
    """The step-time, memory and loss goals of a tide/stock/local run, from its records."""
    by = {r["impl"]: r for r in records}
    if {"tide", "tide-graph"} <= set(by):
        return graph_goals(by["tide"], by["tide-graph"])
    if not {"tide", "stock"} <= set(by):
        return []
    out = []
    a, b = by["tide"]["losses"], by["stock"]["losses"]
    diff = training.agreement("stock", b, "tide", a, 1e-2)
    out.append({"goal": f"tide and stock losses equal for {len(a)} steps",
                "measured": "bitwise equal" if a == b else
                f"max relative difference {diff['max_rel_diff']:.3g}",
                "met": a == b or diff["agree"]})
    peak = by["tide"]["peak_bytes"] / max(by["stock"]["peak_bytes"], 1)
    out.append({"goal": "tide peak memory <= stock's", "measured": f"{peak:.3f}x",
                "met": peak <= 1})
    if "local" not in by:
        return out
    t, s, floor = (by[k]["median_step_s"] for k in ("tide", "stock", "local"))
    out.append({"goal": "tide step <= 1.03 x the local floor", "measured": f"{t / floor:.3f}x "
                f"(stock {s / floor:.3f}x)", "met": t <= 1.03 * floor})
    floors = [("the local floor", floor)]
    prof = {k: (by[k].get("profile") or {}).get("ms_per_role", {}) for k in by}
    if all("optimizer" in prof[k] for k in ("tide", "local")):
        # The floor steps AdamW over the whole model, the sharded runs over 1/W of it:
        # the same floor with the sharded runs' optimizer time, from the measured kernels.
        adj = floor - (prof["local"]["optimizer"] - prof["tide"]["optimizer"]) / 1e3
        floors.append(("the floor with a sharded optimizer (CUPTI)", adj))
    for name, f in floors:
        out.append({"goal": f"tide - floor <= (stock - floor) / 5, over {name}",
                    "measured": f"tide {1e3 * (t - f):+.2f} ms, stock {1e3 * (s - f):+.2f} ms "
                                f"(floor {1e3 * f:.2f} ms)",
                    "met": t - f <= (s - f) / 5})
    return out


def graph_goals(eager: dict, graph: dict) -> list[dict]:
    """The captured step against the eager one: the same losses, less host time, no
    slower a step."""
    a, b = eager["losses"], graph["losses"]
    host = graph["median_host_s"] / eager["median_host_s"]
    step = graph["median_step_s"] / eager["median_step_s"]
    return [{"goal": f"captured and eager losses bitwise equal for {len(a)} steps",
             "measured": "bitwise equal" if a == b else
             f"differ from step {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) + 1}",
             "met": a == b},
            {"goal": "captured step's host time < eager's",
             "measured": f"{graph['median_host_s'] * 1e3:.3f} ms vs "
                         f"{eager['median_host_s'] * 1e3:.3f} ms ({host:.3f}x)",
             "met": host < 1},
            {"goal": "captured step time <= eager's",
             "measured": f"{graph['median_step_s'] * 1e3:.2f} ms vs "
                         f"{eager['median_step_s'] * 1e3:.2f} ms ({step:.3f}x)",
             "met": step <= 1.0}]


def report(path: str) -> str:
    """``train.md`` (a table) and ``train_steps.png`` (step times and losses) next to the
    record ``path``, made from the record alone. Returns the table's path."""
    with open(path) as f:
        rec = json.load(f)
    out = os.path.dirname(os.path.abspath(path))
    lines = [f"# Training step: {rec['model']}, {rec['tokens_per_rank']} tokens per rank, "
             f"{rec['world']} ranks ({rec['backend']}, {rec['param_dtype']})", "",
             f"Commit `{rec['commit']}`; command `{' '.join(rec['argv'])}`; "
             f"{len(rec['runs'][0]['losses'])} steps, medians after the warm-up steps.", "",
             *table(rec["runs"], goals(rec["runs"]))]
    path = os.path.join(out, "train.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    training.plots(rec, out, "train_steps.png")
    return path


if __name__ == "__main__":
    train.run_as_group(main)
