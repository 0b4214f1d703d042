"""``report``: markdown tables, rebuilt from JSON records.

``python -m benchmarks report --json run.jsonl [--json more.jsonl] --docs DIR``
writes ``DIR/README.md``. The terminal summary of a run uses
the same tables (:func:`summary`). The goals are judged in one place, from the records
kept under ``benchmarks/results``: ``python -m benchmarks.performance``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .records import load
from .tables import Results, gbs, grid, markdown, mib, num, phase_table, us

DEFINITIONS = """\
* **time**: median over the timed iterations of the per-iteration maximum over
  ranks; each iteration starts after a barrier, with the timing stream idle, and is timed with
  CUDA events on the issuing stream (wall clock on the host backend).
* **bandwidth**: per rank, `(W-1)/W` of the unit's bf16 bytes divided by the time
  (the same numerator for every implementation, so ratios of bandwidths are ratios
  of times; a baseline's fp32 traffic is part of its cost).
* **back to back**: the same number of calls issued one after another with no
  barrier (host issue overlapped with device work), an event after each; the
  median of the per-call times (max over ranks).
* **speedup**: `stock` time / implementation time, same run, same unit.
* **phase**: one piece of a collective, timed alone (copy-in, NCCL call, copy-out,
  pack, TIDE's accumulate; `peer_copy` is a reference, not a piece: one plain
  `cudaMemcpyAsync` of TIDE-AG's bytes to the peer).
* **SM time**: per call, measured by CUPTI: each kernel's time x min(1, CTAs / SMs).
  Copy engines: zero; copies within one GPU, which the driver runs on the SMs, are
  counted apart.
* **GEMM slowdown**: median time of the GEMMs that overlapped the looping
  collective (>= 95% of their duration) over the GEMM's median time in its alone loop
  run right before, minus 1; the median of three such alone-then-beside pairs.
* **memory**: largest rise of used device memory (`cudaMemGetInfo`) over the
  baseline taken after the inputs were made and pools emptied, with fresh NCCL
  communicators; includes NCCL's buffers, symmetric memory and the CuPy pool.
  `accounted` sums the buffers the path allocates itself.
* **RS error**: max |out - ref| / max |ref| against an fp64 reference of the
  average (normwise); elementwise relative error in the JSON.
"""


def build(json_paths: list[str], docs: str) -> str:
    """Write ``docs/README.md`` from the records; returns its path.

    Args:
        json_paths: JSON Lines record files (later records of a key win).
        docs: output directory.
    """
    res = Results(load(json_paths))
    os.makedirs(docs, exist_ok=True)
    text = render(res)
    path = os.path.join(docs, "README.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def _spread(rec: dict) -> str:
    """A time record as ``median [p10, p90]`` in microseconds."""
    extra = rec.get("extra") or {}
    if "p10_s" not in extra:
        return us(rec.get("value"))
    return f"{us(rec.get('value'))} [{us(extra['p10_s'])}, {us(extra['p90_s'])}]"


def render(res: Results) -> str:
    out = ["# tidearray benchmarks\n", _provenance(res)]
    out.append(_units_section(res))
    out.append(_detail_section(res))
    out.append(_interference_section(res))
    out.append(_memory_section(res))
    out.append(_sweep_section(res))
    out += ["## Definitions\n", DEFINITIONS, _problems(res)]
    return "\n".join(out)


def _provenance(res: Results) -> str:
    runs = res.runs()
    if not runs:
        return "_No run metadata._\n"
    lines = ["Made by:\n", "```"]
    seen = set()
    for r in runs:
        ex = r.get("extra") or {}
        # The settings the run was made with (not the backend choice, which is the device's).
        env = " ".join(f"{k}={v}" for k, v in sorted((ex.get("env") or {}).items())
                       if k.startswith("TIDE_") and k != "TIDE_BACKEND")
        cmd = f"{env + ' ' if env else ''}mpirun -n {ex.get('world')} {ex.get('argv')}"
        if cmd not in seen:
            seen.add(cmd)
            lines.append(cmd)
    lines.append("```\n")
    ex = runs[-1].get("extra") or {}
    keys = ("device", "sms", "backend", "group", "nccl", "mpi", "cupy", "driver", "runtime",
            "host", "tidearray", "group_note")
    lines += [f"* {k}: `{_printable(ex[k])}`" for k in keys if ex.get(k) not in (None, "")]
    lines.append(f"* runs: {', '.join(sorted({r['run'] for r in runs}))}\n")
    return "\n".join(lines)


def _printable(v: Any) -> str:
    return "".join(c for c in str(v) if c.isprintable()).strip()


def _units_section(res: Results) -> str:
    out = ["## Model units (one FSDP unit per collective)\n"]
    for suite, name in (("ag", "All-gather"), ("rs", "Reduce-scatter (bf16 grads -> fp32)")):
        ws = res.workloads(suite, "unit")
        if not ws:
            continue
        out += [f"### {name}: median time [p10, p90] (us)\n",
                markdown(grid(res, suite, "time", ws, _spread, value=lambda r: r)),
                f"### {name}: median time per call issued back to back (us)\n",
                markdown(grid(res, suite, "time", ws, us, value=_back_to_back)),
                f"### {name}: speedup vs stock\n",
                markdown(grid(res, suite, "speedup_vs_stock", ws, lambda v: num(v) + "x")),
                f"### {name}: per-rank bandwidth (GB/s)\n",
                markdown(grid(res, suite, "bandwidth", ws, gbs)),
                f"### {name}: per-rank bandwidth, calls issued back to back (GB/s)\n",
                markdown(grid(res, suite, "bandwidth_back_to_back", ws, gbs))]
        if suite == "rs":
            out += ["### Reduce-scatter error vs fp64 (normwise max relative)\n",
                    markdown(grid(res, "rs", "rs_error", ws, lambda v: num(v, "{:.1e}")))]
        else:
            out += ["### All-gather output bitwise equal to the reference (1 = yes)\n",
                    markdown(grid(res, "ag", "correct", ws, lambda v: num(v, "{:.0f}")))]
    return "\n".join(out)


def _back_to_back(rec: dict) -> Optional[float]:
    """A time record's median per call issued back to back."""
    return (rec.get("extra") or {}).get("back_to_back_median_s")


def _detail_section(res: Results) -> str:
    out = ["## Breakdowns and SM time\n"]
    for suite in ("ag", "rs"):
        ws = res.workloads(suite, "unit")
        if ws:
            out += [f"### {suite.upper()} phases, each timed alone\n",
                    markdown(phase_table(res, suite, ws))]
            if any(res.get(suite, i, w, "sm_time_cupti") for i in res.impls(suite) for w in ws):
                out += [f"### {suite.upper()} SM time per call, measured by CUPTI (us): "
                        "kernel time x min(1, blocks / SMs)\n",
                        markdown(grid(res, suite, "sm_time_cupti", ws, us))]
    return "\n".join(out)


def _interference_section(res: Results) -> str:
    metrics = res.interference_metrics()
    if not metrics:
        return ""
    unit = next(iter(res.workloads("interference")), "")
    head = ["impl"] + metrics
    rows = []
    for impl in res.impls("interference"):
        cells = [impl]
        for m in metrics:
            r = res.get("interference", impl, unit, m)
            v = None if r is None else r.get("value")
            cells.append("-" if v is None else f"{v * 100:+.1f}%")
        rows.append(cells)
    alone = [f"{k[3].split(':')[0]} alone {us(r['value'])} us at the start of the suite"
             for k, r in res.by_key.items()
             if k[0] == "interference" and k[3].endswith(":alone")]
    out = [f"## GEMM slowdown while the collective loops ({unit})\n",
           "; ".join(alone) + "\n", markdown((head, rows))]
    times = [[impl, m, f"{us(ex['collective_alone_s'])} -> {us(ex['collective_beside_s'])}"]
             for impl in res.impls("interference") for m in metrics
             if (r := res.get("interference", impl, unit, m))
             and (ex := r.get("extra") or {}).get("collective_beside_s") is not None]
    if times:
        out += ["### The collective's own time per call (us): timed alone (one call after a "
                "barrier) -> in the loop beside the GEMMs (issued back to back)\n",
                markdown((["impl", "collective + GEMM", "time"], times))]
    return "\n".join(out)


def _memory_section(res: Results) -> str:
    ws = res.workloads("memory")
    if not ws:
        return ""
    out = ["## Device memory beyond the inputs (MiB per rank)\n"]
    for metric in ("peak", "accounted"):
        if any(k[0] == "memory" and k[3] == metric for k in res.by_key):
            out += [f"### {metric}\n", markdown(grid(res, "memory", metric, ws, mib))]
    return "\n".join(out)


def _sweep_section(res: Results) -> str:
    parts = [part for kind in ("size", "count") for suite in ("ag", "rs")
             if (ws := res.workloads(suite, kind))
             for part in (f"## {_sweep_title(res, suite, kind)}: {suite.upper()} per-rank "
                          "bandwidth (GB/s)\n", markdown(grid(res, suite, "bandwidth", ws, gbs)))]
    return "\n".join(parts)


def _sweep_title(res: Results, suite: str, kind: str) -> str:
    if kind == "size":
        return "Size sweep (8 equal parameters)"
    return f"Parameter-count sweep ({res.sweep_mib(suite, kind) or 0:g} MiB)"


def _problems(res: Results) -> str:
    probs = res.problems()
    if not probs:
        return ""
    rows = [[r["suite"], r["impl"], r["workload"], r["status"], r.get("reason", "")]
            for r in probs]
    return "## Skipped and failed\n\n" + markdown((["suite", "impl", "workload", "status",
                                                    "reason"], rows))


def summary(ctx: Any) -> str:
    """The end-of-run terminal table, from this run's records."""
    res = Results(ctx.sink.records)
    out = []
    for suite in ("ag", "rs"):
        ws = res.workloads(suite)
        if ws:
            out += [f"{suite.upper()} median time (us)", markdown(grid(res, suite, "time", ws, us)),
                    f"{suite.upper()} speedup vs stock",
                    markdown(grid(res, suite, "speedup_vs_stock", ws, lambda v: num(v) + "x"))]
    out += [_interference_section(res), _memory_section(res)]  # "" where it has no records
    probs = res.problems()
    if probs:
        out.append(f"{len(probs)} skipped/failed entries (see the JSON records)")
    return "\n".join(o for o in out if o)


__all__ = ["build", "render", "summary"]
