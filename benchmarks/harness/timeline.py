"""A timeline plot of one profiled region: one row per stream, from CUPTI events.

Events are coloured by role: model compute, TIDE's accumulate, NCCL, the
baselines' layout conversions (``pack.cu``, ``pack_bf16_f32.cu``), copy-engine copies and memsets.
"""

from __future__ import annotations

from collections import Counter

#: Kernel-name fragments of each role (first match wins); anything else is compute.
ROLES = (("accumulate", ("accum",)), ("nccl", ("nccl",)), ("layout", ("pack_",)),
         ("optimizer", ("adamw",)))
COLORS = {"compute": "#4C72B0", "accumulate": "#DD8452", "nccl": "#C44E52",
          "layout": "#8172B3", "optimizer": "#937860", "copy": "#55A868", "memset": "#CCB974"}


def load(path: str) -> list[dict]:
    """Events saved by ``cupti.save`` (``.json``, or gzipped ``.json.gz``)."""
    import gzip
    import json

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def role(event: dict) -> str:
    if event["cat"] == "gpu_memcpy":
        return "copy"
    if event["cat"] == "gpu_memset":
        return "memset"
    name = event["name"].lower()
    for r, keys in ROLES:
        if any(k in name for k in keys):
            return r
    return "compute"


def roles(events: list[dict]) -> Counter:
    """Device microseconds per role."""
    c: Counter = Counter()
    for e in events:
        c[role(e)] += e["dur_us"]
    return c


def union(intervals: list) -> list:
    """``(start, end)`` intervals merged where they overlap or touch, in order."""
    out: list = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy(events: list[dict]) -> tuple[float, float]:
    """The microseconds in which the device ran any of ``events``, and their span, from
    the first start to the last end (the rest of the span it waited, for the host mostly)."""
    spans = union([(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in events])
    return sum(e - s for s, e in spans), spans[-1][1] - spans[0][0]


def plot(events: list[dict], path: str, title: str = "") -> None:
    """Write a PNG with one row per stream (busiest first), time in ms from the first event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        return
    # From the first kernel: a profiled region can open with an upload long before it.
    t0 = min((e["ts_us"] for e in events if e["cat"] == "kernel"),
             default=min(e["ts_us"] for e in events))
    by_stream: dict[int, list[dict]] = {}
    for e in events:
        if e["ts_us"] >= t0:
            by_stream.setdefault(e["stream"], []).append(e)
    # One row per stream, the busiest first, labelled with the role it spends most time in.
    streams = sorted(by_stream, key=lambda s: -sum(e["dur_us"] for e in by_stream[s]))
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(streams) + 1.5))
    labels = []
    for row, s in enumerate(streams):
        spans: dict = {}
        for e in by_stream[s]:
            spans.setdefault(role(e), []).append(((e["ts_us"] - t0) / 1e3,
                                                  max(e["dur_us"], 1.0) / 1e3))
        for r, bars in spans.items():
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS[r])
        labels.append(f"stream {s} ({roles(by_stream[s]).most_common(1)[0][0]})")
    ax.set_yticks(range(len(streams)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=r) for r, c in COLORS.items()], ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.02 * len(streams)),
              fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
