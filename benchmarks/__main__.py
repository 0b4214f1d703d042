"""``python -m benchmarks <subcommand>`` (under ``mpirun -n N`` for several ranks).

Subcommands (registered below, like mpi4py's bench):

* ``ag``, ``rs``: all-gather / reduce-scatter over the model units and the sweeps
  (time, bandwidth, ratio to stock, correctness, breakdowns, SM time);
* ``interference``: slowdown of a concurrent GEMM;
* ``memory``: device memory per path;
* ``plans``: host time per call of persistent plans vs the convenience calls;
* ``all``: everything above, then ``report`` into ``<out>/report``;
* ``report``: markdown tables from JSON records.

The records kept for the docs are in benchmarks/results; ``python -m
benchmarks.performance`` writes docs/performance.md and the README's summary from them.

Example (2 GPUs): ``mpirun -n 2 python -m benchmarks all --out results``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from tests import support as W

from .harness import interference, memory, plans, speed
from .harness.report import build, summary
from .harness.timing import MIN_ITERS

COMMANDS: dict[str, Callable[[Any], None]] = {}
#: The unit whose collectives the interference suite runs beside the GEMMs.
INTERFERENCE_UNIT = "llama3.1-8b"


def command(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        COMMANDS[name] = fn
        return fn
    return deco


def select_workloads(args: Any) -> list:
    """The units and sweeps ``--workloads`` asks for (smaller ones with ``--quick``)."""
    kinds = set(args.workloads.split(","))
    out = []
    if "units" in kinds:
        out += _units(args)
    if "sizes" in kinds:
        out += W.size_sweep([1, 2, 4, 8] if args.quick else [2 ** k for k in range(12)])
    if "counts" in kinds:
        out += W.count_sweep([1, 4, 16, 64] if args.quick else [2 ** k for k in range(11)],
                             total_mib=4 if args.quick else 256)
    return out


def _units(args: Any) -> list:
    units = W.units(16 if args.quick else 1)
    if args.units:
        want = args.units.split(",")
        units = [u for u in units if u.name in want]
    return units


@command("ag")
def cmd_ag(ctx: Any) -> None:
    speed.run(ctx, "ag", select_workloads(ctx.args))


@command("rs")
def cmd_rs(ctx: Any) -> None:
    speed.run(ctx, "rs", select_workloads(ctx.args))


@command("interference")
def cmd_interference(ctx: Any) -> None:
    unit = next(u for u in W.units(16 if ctx.args.quick else 1) if u.name == INTERFERENCE_UNIT)
    interference.run(ctx, unit)


@command("memory")
def cmd_memory(ctx: Any) -> None:
    memory.run(ctx, _units(ctx.args))


@command("plans")
def cmd_plans(ctx: Any) -> None:
    plans.run(ctx, _units(ctx.args))


@command("all")
def cmd_all(ctx: Any) -> None:
    for name in ("ag", "rs", "interference", "memory"):
        COMMANDS[name](ctx)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        s = sub.add_parser(name, help="run every suite, then write the report" if name == "all"
                           else f"run the {name} suite")
        s.add_argument("--out", default="bench-out",
                       help="directory for bench.jsonl, bench.log and (all) report/")
        s.add_argument("--docs", default=None, help="report directory (all; default <out>/report)")
        s.add_argument("--quick", action="store_true", help="small sizes (CPU smoke runs)")
        s.add_argument("--iters", type=int, default=MIN_ITERS, help="timed iterations (>= 20)")
        s.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
        s.add_argument("--impls", default="", help="comma list (default: all registered)")
        s.add_argument("--workloads", default="units,sizes,counts",
                       help="any of units,sizes,counts (ag, rs)")
        s.add_argument("--units", default="", help="comma list of unit names (default: all four)")
        s.add_argument("--device", default="auto", choices=("auto", "cuda", "host"))
        s.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    s = sub.add_parser("report", help="rebuild the tables from JSON records")
    s.add_argument("--json", action="append", required=True,
                   help="JSON Lines record file (repeatable)")
    s.add_argument("--docs", default=os.path.join(os.environ.get("OUT", "bench-out"), "report"),
                   help="output directory (default $OUT/report, else bench-out/report)")
    return p


def main(argv: Any = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "report":
        print(build(args.json, args.docs))
        return 0
    if args.iters < MIN_ITERS:
        print(f"note: --iters {args.iters} < {MIN_ITERS}: medians over fewer iterations "
              "than the benchmarks' method asks for", file=sys.stderr)
    from .harness.context import environment, make_ctx

    ctx = make_ctx(args)
    try:
        ctx.sink.add("run", "*", "*", "env", None, **environment(ctx))
        ctx.log(f"benchmarks {args.command}: {ctx.size} ranks, device {ctx.dev.name}, "
                f"group {ctx.group!r}" + (f" [{ctx.group_note}]" if ctx.group_note else ""))
        COMMANDS[args.command](ctx)
        ctx.out("\n" + summary(ctx))
        if args.command == "all" and ctx.rank == 0 and ctx.sink.path:
            docs = args.docs or os.path.join(args.out, "report")
            ctx.log(f"report: {build([ctx.sink.path], docs)}")
        if ctx.rank == 0 and ctx.sink.path:
            ctx.log(f"records: {ctx.sink.path}")
        if ctx.errors:
            ctx.log(f"FAILED: {len(ctx.errors)} step(s) failed: " + "; ".join(ctx.errors[:5]))
    finally:
        ctx.close()
        ctx.group.close()
    return 1 if ctx.errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:  # fail as a group, like mpi4py.run: never leave peers hanging
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        if MPI.COMM_WORLD.size > 1:
            MPI.COMM_WORLD.Abort(1)
        raise
