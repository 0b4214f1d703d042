"""Per-rank bytes of the collectives' buffers across nodes, from the planner alone.

Run from the repository root::

    python -m benchmarks.memory            # print the tables
    python -m benchmarks.memory --write    # rewrite docs/memory.md's generated section
    python -m benchmarks.memory --check    # exit 1 if that section is stale
    python -m benchmarks.memory --ranks 16,256 --local-size 4 --chunk-mib 16 --depth 1

Every figure comes from ``tidearray.layout.memory_report`` (``plan_unit`` and
``plan_reduce_scatter``): no device, no MPI, the standard library and tidearray only.
The output per rank is held fixed: at ``W`` ranks a unit is ``W // W0`` copies of its
layer's parameters, ``W0`` the fewest ranks asked for (16 by default), so what grows
with ``W`` is the unit, as when a model grows with its job. ``--write`` and ``--check``
use the defaults only, so the page states one configuration; a test
(``tests/benchmarks/test_memory.py``) fails when the page's section is stale. The
``memory`` suite of ``python -m benchmarks`` measures what the implementations allocate
on devices; this command is its planner-side counterpart.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional, Sequence

from tests.support import BF16_BYTES, MiB, Unit, units
from tidearray import Config, TideInvalid
from tidearray.layout import MemoryReport, memory_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = "docs/memory.md"
BEGIN = "<!-- memory-report:begin -->"
END = "<!-- memory-report:end -->"
COMMAND = "python -m benchmarks.memory"
UNITS = ("llama3.1-8b", "llama3.1-70b", "qwen3-30b-a3b", "wan2.2-dit")
#: Prose is wrapped like the hand-written pages around it.
WIDTH = 90
COLUMNS = ("ranks", "nodes", "fp32 output", "TIDE slot", "staging", "partial sums", "receive",
           "TIDE-RS total", "stock AG output", "stock RS fp32 input")


@dataclass(frozen=True)
class Settings:
    """One what-if: the rank counts, the node size and the reduce-scatter's settings."""

    ranks: tuple[int, ...] = (16, 32, 64, 128, 512)
    local_size: int = 8
    chunk_nbytes: int = Config.chunk_nbytes
    depth: int = Config.depth

    @property
    def base(self) -> int:
        """``W0``: the rank count at which a unit is one copy of its layer."""
        return min(self.ranks)

    def check(self) -> None:
        """Raises TideInvalid on settings the library itself would refuse."""
        Config(local_size=self.local_size, chunk_nbytes=self.chunk_nbytes,
               depth=self.depth).check()
        if not self.ranks or self.base < 1:
            raise TideInvalid(f"ranks: expected positive rank counts, got {self.ranks}")
        for w in self.ranks:
            if w % self.base or w % self.local_size:
                raise TideInvalid(f"ranks: expected multiples of {self.base} (the fewest) and "
                                  f"of the local size {self.local_size}, got {w}")


@dataclass(frozen=True)
class Row:
    """One unit at one rank count."""

    ranks: int
    nodes: int
    report: MemoryReport


def rows(unit: Unit, s: Settings) -> list[Row]:
    """The unit at each of ``s.ranks``, as ``ranks // s.base`` copies of its parameters."""
    out = []
    for w in s.ranks:
        shapes = unit.shapes * (w // s.base)
        rep = memory_report(shapes, BF16_BYTES, w, s.local_size, s.chunk_nbytes, s.depth)
        out.append(Row(w, w // s.local_size, rep))
    return out


def spread(rs: Sequence[Row]) -> float:
    """max/min - 1 of the TIDE-RS totals."""
    totals = [r.report.rs_nbytes for r in rs]
    return max(totals) / min(totals) - 1


def mib(n: int) -> str:
    return f"{n / MiB:,.1f}"


def table(unit: Unit, rs: Sequence[Row]) -> list[str]:
    out = [f"**{unit.label}** ({unit.nparams} parameters, {mib(unit.nbytes)} MiB in bf16 "
           "per copy):", "", "| " + " | ".join(COLUMNS) + " |",
           "| " + " | ".join("---:" for _ in COLUMNS) + " |"]
    for r in rs:
        m = r.report
        cells = [f"{r.ranks}", f"{r.nodes}"] + [mib(b) for b in (
            m.output, m.slot, m.staging, m.partial, m.receive, m.rs_nbytes,
            m.stock_ag_output, m.stock_rs_input)]
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def intro(s: Settings) -> str:
    defaults = (s.chunk_nbytes, s.depth) == (Config.chunk_nbytes, Config.depth)
    return (
        "Per rank, in MiB, from the planner alone (`tidearray.layout.memory_report`, which "
        "reads `plan_unit` and `plan_reduce_scatter`; no device, no MPI): bf16 parameters "
        f"and gradients, {s.local_size} ranks per node, chunks of "
        f"{s.chunk_nbytes / MiB:g} MiB and depth {s.depth}{' (the defaults)' * defaults}. "
        f"The output per rank is held fixed: at `W` ranks the unit is `W // {s.base}` copies "
        f"of the layer's parameters, so each rank's fp32 output shard stays what it is at "
        f"{s.base} ranks (padding rows aside), while the unit, and with it the slot and "
        "FSDP2's flat buffers, grows with `W`. *staging* is the node-local staging, "
        "*partial sums* and *receive* the fp32 buffers of the inter-node phase, and "
        "*TIDE-RS total* their sum: the staging region a reduce-scatter needs. *stock* is "
        "FSDP2's flat path on the same unit: every parameter padded to `ceil(d0 / W) x W` "
        "rows, the all-gather output in bf16 and, with `reduce_dtype=float32`, the "
        "reduce-scatter input of all the unit's gradients in fp32.")


def render(s: Settings = Settings(), names: Sequence[str] = UNITS) -> str:
    """The tables and the spread lines for ``s`` (the page's section with the defaults)."""
    by = {u.name: u for u in units()}
    body = [_fill(intro(s)), ""]
    lines = [_fill(f"From {min(s.ranks)} to {max(s.ranks)} ranks, the spread of the TIDE-RS "
                   "totals (max/min - 1), how much stock's reduce-scatter input grows, and "
                   "the fp32 output per rank:"), ""]
    for name in names:
        unit = by[name]
        rs = rows(unit, s)
        body += table(unit, rs)
        grow = rs[-1].report.stock_rs_input / rs[0].report.stock_rs_input
        lo, hi = (mib(f(r.report.output for r in rs)) for f in (min, max))
        lines.append(_fill(f"- {unit.label}: TIDE-RS total {spread(rs) * 100:.1f}%, stock RS "
                           f"fp32 input {grow:.1f}x, output {lo}"
                           + (f" to {hi}" if hi != lo else "") + " MiB", indent="  "))
    c, d, L = s.chunk_nbytes, s.depth, s.local_size
    bound = d * (L - 1) * c + (d + 1) * c * 2  # bf16 gradients: fp32 blocks are 2x
    lines += ["", _fill(
        f"Every total is at most the bound `depth x (local_size - 1) x chunk + (depth + 1) x "
        f"chunk x 4 / itemsize` ({mib(bound)} MiB here) at any world size. A unit of no more "
        "chunks than buffers has its chunks evened out and stays below it (the Llama-3.1-8B "
        "layer at the smallest count), which is all its larger spread says.")]
    return "\n".join(body + lines) + "\n"


def section() -> str:
    """docs/memory.md's generated section, markers included."""
    return "\n".join([BEGIN, f"<!-- Generated by `{COMMAND} --write`; edit "
                      "benchmarks/memory.py, not this section. -->", "", render().rstrip("\n"),
                      "", _fill(f"Regenerate with `{COMMAND} --write`; `--check` (and "
                                "`tests/benchmarks/test_memory.py`) fails when this section "
                                "is stale."), END])


def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def stale(root: str = ROOT) -> bool:
    """Whether the page's generated section differs from :func:`section`."""
    from .performance import generated_block

    with open(os.path.join(root, PAGE)) as f:
        return generated_block(f.read(), BEGIN, END) != section()


def write(root: str = ROOT) -> None:
    from .performance import rewrite_block

    rewrite_block(os.path.join(root, PAGE), section(), BEGIN, END)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite {PAGE}'s generated section")
    p.add_argument("--check", action="store_true", help=f"exit 1 if {PAGE}'s section is stale")
    p.add_argument("--root", default=ROOT, help="repository root")
    p.add_argument("--ranks", type=_ints, help="comma list of rank counts (16,32,64,128,512)")
    p.add_argument("--local-size", type=int, help="ranks per node (8)")
    p.add_argument("--chunk-mib", type=float, help="reduce-scatter chunk in MiB (32)")
    p.add_argument("--depth", type=int, help="reduce-scatter buffers in flight (2)")
    a = p.parse_args(argv)
    what_if = {k: v for k, v in (("ranks", a.ranks), ("local_size", a.local_size),
                                 ("chunk_nbytes", a.chunk_mib and int(a.chunk_mib * MiB)),
                                 ("depth", a.depth)) if v is not None}
    if (a.write or a.check) and what_if:
        p.error("--write and --check state the defaults: drop --ranks, --local-size, "
                "--chunk-mib and --depth")
    if a.check:
        if stale(a.root):
            print(f"{PAGE}'s memory report is stale: run `{COMMAND} --write`", file=sys.stderr)
            return 1
        return 0
    if a.write:
        write(a.root)
        return 0
    s = Settings(**what_if)
    try:
        s.check()
    except TideInvalid as e:
        p.error(str(e))
    print(render(s), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
