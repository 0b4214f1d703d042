"""What the training-step comparisons share (``benchmarks/steps/``): the loss checks, one
step under CUPTI, steps under cProfile, and the plots of a run's steps.

Every comparison trains each impl from the same weights on the same batches, its last step
on the first step's batch again, so a record is judged the same way everywhere: each
impl's loss fell (:func:`loss_fell`), and impls that train alike agree step by step within
a relative tolerance (:func:`agreement`). :func:`check` does both, :func:`failures` says
what is wrong in words and :func:`lines` writes the check as markdown.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from typing import Callable, Optional, Sequence

import numpy as np


def agreement(reference: str, ref_losses: Sequence[float], impl: str,
              losses: Sequence[float], rtol: float) -> dict:
    """The largest relative difference of ``losses`` from ``ref_losses``, its step (from 1)
    and whether it is within ``rtol``; ``steps`` where the two ran different numbers of
    steps (then they do not agree)."""
    a, b = np.array(ref_losses, dtype=float), np.array(losses, dtype=float)
    out = {"reference": reference, "impl": impl, "rtol": rtol}
    if a.shape != b.shape:
        return {**out, "steps": (a.size, b.size), "max_rel_diff": float("inf"),
                "step_of_max": 0, "agree": False}
    rel = np.abs(a - b) / np.abs(a)
    return {**out, "max_rel_diff": float(rel.max()), "step_of_max": int(rel.argmax()) + 1,
            "agree": bool(rel.max() <= rtol)}


def loss_fell(losses: Sequence[float]) -> dict:
    """The first and last step's loss, and whether the last (on the first step's batch
    again) is below the first."""
    return {"first": losses[0], "last": losses[-1], "fell": losses[-1] < losses[0]}


def check(by: dict[str, dict], groups: Sequence[Sequence[str]], rtol: float) -> dict:
    """Whether every impl trained: each record of ``by`` (impl -> record with ``losses``)
    has a falling loss, and in each group the impls present agree with its first present.

    Returns:
        ``{"loss_fell": {impl: loss_fell(...)}, "agreement": [agreement(...), ...]}``.
    """
    pairs = []
    for group in groups:
        present = [k for k in group if k in by]
        pairs += [agreement(present[0], by[present[0]]["losses"], k, by[k]["losses"], rtol)
                  for k in present[1:]]
    return {"loss_fell": {k: loss_fell(r["losses"]) for k, r in by.items()},
            "agreement": pairs}


def failures(t: dict) -> list[str]:
    """What :func:`check` found wrong, in words (empty: every impl trained alike)."""
    out = [f"{k}'s loss did not fall ({v['first']:.6f} at the first step, {v['last']:.6f} "
           "at the last, on the same batch)" for k, v in t["loss_fell"].items() if not v["fell"]]
    for p in t["agreement"]:
        if "steps" in p:
            out.append(f"{p['impl']}: {p['steps'][1]} steps, {p['reference']}: "
                       f"{p['steps'][0]}")
        elif not p["agree"]:
            out.append(f"{p['reference']} and {p['impl']} losses differ by "
                       f"{p['max_rel_diff']:.2e} at step {p['step_of_max']} (> {p['rtol']:g})")
    return out


def lines(t: dict) -> list[str]:
    """:func:`check`'s result as markdown: each impl's first and last loss, each pair's
    largest relative difference."""
    out = ["", "Training: each impl's loss at the first step and at the last, on the first "
           "step's batch again; the largest relative loss difference between impls that "
           "train alike.", ""]
    out += [f"- {k}: {v['first']:.4f} -> {v['last']:.4f}"
            + ("" if v["fell"] else " (**did not fall**)") for k, v in t["loss_fell"].items()]
    out += [f"- {p['impl']} vs {p['reference']}: {p['max_rel_diff']:.2e} (step "
            f"{p['step_of_max']}), tolerance {p['rtol']:g}: "
            + ("agree" if p["agree"] else "**differ**") for p in t["agreement"]]
    return out


def profile_step(step: Callable[[], None], trace_path: Optional[str],
                 log: Callable[[str], None]) -> Optional[dict]:
    """One step under CUPTI: its device milliseconds per role (compute, accumulate, NCCL,
    layout conversion, copies) and busy and idle (waiting, from its first event to its
    last), logged and returned as the record's ``{"ms_per_role": ..., "busy_ms": ...}``;
    its events saved to ``trace_path`` (None: not saved; for ``plot_timelines``). None,
    said in the log, where CUPTI is unavailable."""
    from benchmarks.harness import cupti, timeline

    events = cupti.trace(step)
    if events is None:
        log(f"profile: skipped ({cupti.available()[1]})")
        return None
    if trace_path:
        cupti.save(events, trace_path)
    roles = {r: us / 1e3 for r, us in timeline.roles(events).items()}
    busy, span = timeline.busy(events)
    log(f"profiled step: device ms per role {roles}; busy {busy / 1e3:.2f} of {span / 1e3:.2f}")
    return {"ms_per_role": roles, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3}


#: Functions in each of :func:`host_profile`'s two tables.
TOP_FUNCTIONS = 15


def host_profile(step: Callable[[], None], steps: int, out: Optional[str], name: str,
                 log: Callable[..., None]) -> None:
    """``steps`` calls of ``step`` (each synchronized by it) under cProfile: where the host
    time goes, by function, per step: printed, and with ``out`` written as
    ``{name}_host_profile.txt`` and ``.pstats``. Python that C++ calls on this thread
    (autograd's hooks) is counted in its own frames; Python on other threads is not (XLA
    runs a scanned body's callbacks on its workers: ``ShardedUnits.callback_seconds``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    rows = [(f"{os.path.basename(f)}:{line}({fn})", nc / steps, tt / steps * 1e3,
             ct / steps * 1e3) for (f, line, fn), (_, nc, tt, ct, _) in stats.stats.items()]
    for title, key in (("own time", 2), ("cumulative time", 3)):
        text.write(f"\nTop {TOP_FUNCTIONS} by {title}, per step:\n\n| function | calls | own "
                   "(ms) | cumulative (ms) |\n| --- | ---: | ---: | ---: |\n" + "".join(
                       f"| `{n}` | {c:.0f} | {t:.2f} | {ct:.2f} |\n" for n, c, t, ct in
                       sorted(rows, key=lambda r: -r[key])[:TOP_FUNCTIONS]))
    stats.sort_stats("tottime").print_stats(30)
    log(f"[{name}] host profile, {steps} steps:\n{text.getvalue()}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}_host_profile.txt"), "w") as f:
            f.write(text.getvalue())
        stats.dump_stats(os.path.join(out, f"{name}_host_profile.pstats"))


def plot_timelines(rec: dict, out: str) -> None:
    """A timeline PNG per saved CUPTI trace next to the record (``<impl>_step_trace.json``,
    gzipped or not)."""
    from benchmarks.harness import timeline

    for r in rec["runs"]:
        for name in (f"{r['impl']}_step_trace.json", f"{r['impl']}_step_trace.json.gz"):
            path = os.path.join(out, name)
            if os.path.exists(path):
                timeline.plot(timeline.load(path),
                              os.path.join(out, f"{r['impl']}_step_timeline.png"),
                              f"{r['impl']}: one training step, rank 0 ({rec['model']}, "
                              f"{rec['world']} ranks)")


def plot_steps(runs: list[dict], path: str, model: str) -> None:
    """Each run's step time and loss by step, side by side (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for r in runs:
        steps = range(1, len(r["step_s"]) + 1)
        a.plot(steps, [t * 1e3 for t in r["step_s"]], label=r["impl"])
        b.plot(steps, r["losses"], label=r["impl"])
    a.set(xlabel="step", ylabel="step time (ms)", title=f"{model}: step time")
    lo = min(min(r["step_s"][2:] or r["step_s"]) for r in runs) * 1e3
    a.set_ylim(lo * 0.97, lo * 1.08)
    b.set(xlabel="step", ylabel="loss (mean over ranks)", title="loss")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(rec: dict, out: str, name: str) -> None:
    """``name`` (the steps' plot) and the timelines next to a record, where matplotlib is
    installed (the optional 'bench' extra)."""
    try:
        plot_steps(rec["runs"], os.path.join(out, name), rec["model"])
        plot_timelines(rec, out)
    except ImportError:
        pass
