"""PNG plots from records (matplotlib, Agg backend). Each returns its file name or None."""

from __future__ import annotations

import os
from typing import Any, Optional

from .tables import Results

#: One color per implementation, the same in every plot.
COLORS = {"tide": "tab:blue", "stock": "tab:orange", "symm": "tab:green", "nccl-bf16": "tab:red",
          "nccl-a2a": "tab:olive", "fsdp2": "tab:purple"}


def _color(impl: str) -> Any:
    return COLORS.get(impl)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, res: Results, suite: str, metric: str, workloads: list, scale: float,
          ylabel: str, title: str) -> None:
    impls = [i for i in res.impls(suite)
             if any(res.value(suite, i, w, metric) is not None for w in workloads)]
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        ys = [res.value(suite, impl, w, metric) for w in workloads]
        xs = [j + k * width for j, y in enumerate(ys) if y is not None]
        ax.bar(xs, [y * scale for y in ys if y is not None], width, label=impl,
               color=_color(impl))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def units(res: Results, out: str) -> Optional[str]:
    ws = res.workloads("ag", "unit") or res.workloads("rs", "unit")
    if not ws:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    _bars(axes[0], res, "ag", "time", ws, 1e6, "median time (us)", "All-gather, one unit")
    _bars(axes[1], res, "rs", "time", ws, 1e6, "median time (us)",
          "Reduce-scatter bf16 grads -> fp32 shards")
    return _save(fig, plt, out, "units.png")


def sweeps(res: Results, out: str) -> Optional[str]:
    kinds = [k for k in ("size", "count") if any(res.workloads(s, k) for s in ("ag", "rs"))]
    if not kinds:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(kinds), 2, figsize=(13, 4.5 * len(kinds)), squeeze=False)
    for ax, (suite, kind) in zip(axes.flat, [(s, k) for k in kinds for s in ("ag", "rs")]):
        ws = res.workloads(suite, kind)
        if not ws:
            ax.set_visible(False)
            continue
        for impl in res.impls(suite):
            pts = []
            for w in ws:
                r = res.get(suite, impl, w, "bandwidth")
                x = (res.get(suite, impl, w, "time") or {}).get("extra", {}).get("x")
                if r is not None and r.get("value") is not None and x is not None:
                    pts.append((x / 2**20 if kind == "size" else x, r["value"]))
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=impl, color=_color(impl))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("unit size (MiB), 8 parameters" if kind == "size"
                      else f"parameters per unit ({res.sweep_mib(suite, kind) or 0:g} MiB total)")
        ax.set_ylabel("per-rank bandwidth (GB/s)")
        ax.set_title(f"{suite.upper()} vs {kind}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, plt, out, "sweeps.png")


def interference(res: Results, out: str) -> Optional[str]:
    metrics = res.interference_metrics()
    impls = [i for i in res.impls("interference")]
    if not metrics or not impls:
        return None
    unit = next(iter(res.workloads("interference")), None)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        ys = [res.value("interference", impl, unit, m) for m in metrics]
        xs = [j + k * width for j, y in enumerate(ys) if y is not None]
        ax.bar(xs, [y * 100 for y in ys if y is not None], width, label=impl,
               color=_color(impl))
    ax.axhline(10, color="k", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))])
    ax.set_xticklabels(metrics, fontsize=7)
    ax.set_ylabel("GEMM slowdown (%)")
    ax.set_title(f"Concurrent GEMM slowdown while the collective loops ({unit})")
    ax.legend(fontsize=7)
    return _save(fig, plt, out, "interference.png")


def memory(res: Results, out: str) -> Optional[str]:
    ws = res.workloads("memory")
    metric = "peak" if any(k[0] == "memory" and k[3] == "peak" for k in res.by_key) \
        else "accounted"
    if not ws:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 4.5))
    _bars(ax, res, "memory", metric, ws, 1 / 2**20, f"{metric} (MiB)",
          f"Device memory beyond inputs ({metric})")
    return _save(fig, plt, out, "memory.png")


def _save(fig: Any, plt: Any, out: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    return name


ALL = (units, sweeps, interference, memory)
