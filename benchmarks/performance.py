"""docs/performance.md, its plots and the README's summary, from benchmarks/results/.

Run from the repository root::

    python -m benchmarks.performance            # write the page, the plots, the README block
    python -m benchmarks.performance --check    # exit 1 if the page or the block is stale

(``python benchmarks/performance.py`` works the same.) Every figure is read from one run
folder's records, ``benchmarks/results/<run>/``, whose ``run.json`` names its commit,
machine kind and command. ``--check`` compares the markdown only (the standard library
alone; the plots need matplotlib); ``tests/docs/test_performance.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
PAGE = "docs/performance.md"
README = "README.md"
BEGIN = "<!-- performance:begin -->"
END = "<!-- performance:end -->"
COMMAND = "python -m benchmarks.performance"
GEMM = "gemm-1024x2048x16384"
UNIT = "llama3.1-8b"
QWEN = "qwen3-30b-a3b"
GIB = 2 ** 30
#: The plots the generator writes (paths from the repository root), and the only
#: images under benchmarks/results/ that a doc may embed.
PLOTS = ("benchmarks/results/run14/collectives.png", "benchmarks/results/run12-fsdp2/steps.png")
#: Where the page's hand-written part starts (kept as it is from this line on).
HAND = ("<!-- Hand-written from here on: python -m benchmarks.performance keeps this part "
        "as it is. -->")
#: Commands of older records that run otherwise now, and what the page says of each.
MOVED = {
    "tidearray.bench": "The harness was `python -m tidearray.bench` then; the same command "
                       "is `python -m benchmarks` now.",
    "examples/compare_fsdp2.py": "It is `benchmarks/steps/compare_fsdp2.py` now.",
    "--passes 2": "`--passes` (the impls again, every other pass reversed, the medians "
                  "pooled) has left `compare_fsdp2.py`; commit `4350af1` has it.",
    "--impl all --profile": "The trainer's comparison of comms (`examples/train.py --impl "
                            "all`) is `benchmarks/steps/compare_train.py --impl all` now.",
}
MACHINES = {
    "nvidia-h200-x2": "2 NVIDIA H200 joined by NVLink, one process per GPU",
    "nvidia-h200": "one NVIDIA H200; ranks share it where there are several, so no timing "
                   "between ranks comes from it",
    "nvidia-h100-x1": "one NVIDIA H100, as the H200 above (no timing between ranks)",
}


@dataclass(frozen=True)
class Figure:
    """One row of the page: what is measured, the goal, the value, and whether it is met."""

    what: str
    goal: str
    measured: str
    met: Optional[bool] = None  # None: no pass/fail goal (a reference figure)


@dataclass(frozen=True)
class Section:
    """The figures of one run folder, with its heading and optional plot."""

    run: str
    title: str
    about: str
    figures: tuple[Figure, ...]
    plot: Optional[str] = None


# ---- reading the records -------------------------------------------------------------


class Run:
    """One folder of benchmarks/results: its run.json and its records files."""

    def __init__(self, root: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(root, RESULTS, name)
        self.meta = self.json("run.json")

    def json(self, name: str) -> dict:
        with open(os.path.join(self.path, name)) as f:
            return json.load(f)

    def bench(self, name: str) -> dict:
        """A bench records file (JSON Lines) as {(suite, impl, workload, metric): record},
        ok only."""
        with open(os.path.join(self.path, name)) as f:
            rows = [json.loads(line) for line in f]
        return {(r["suite"], r["impl"], r["workload"], r["metric"]): r
                for r in rows if r.get("status") == "ok" and r["suite"] != "run"}


def value(recs: dict, suite: str, impl: str, metric: str, w: str = UNIT) -> Optional[float]:
    return (recs.get((suite, impl, w, metric)) or {}).get("value")


def extra(recs: dict, suite: str, impl: str, metric: str, w: str = UNIT) -> dict:
    return (recs.get((suite, impl, w, metric)) or {}).get("extra") or {}


# ---- formatting ----------------------------------------------------------------------


def us(s: float) -> str:
    return f"{s * 1e6:,.0f} us"


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def x(r: float, digits: int = 2) -> str:
    return f"{r:.{digits}f}x"


def pct(f: float) -> str:
    return f"{f * 100:+.1f}%"


def gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def against(what: str, goal: str, a: float, b: float, fmt: Callable[[float], str],
            met: Optional[Callable[[float], bool]] = None, digits: int = 3) -> Figure:
    """A figure of ``a / b`` with both shown in ``fmt``; ``met`` judges the ratio (None:
    a reference figure)."""
    r = a / b
    return Figure(what, goal, f"{x(r, digits)} ({fmt(a)} against {fmt(b)})",
                  None if met is None else met(r))


# ---- 2xH200: the collectives (run14) -------------------------------------------------


#: A bench record of run14's ``records.jsonl``: (suite, impl, metric, workload).
Key = tuple[str, str, str, str]


def _t(suite: str, impl: str, w: str = UNIT) -> Key:
    """The median time per call of ``impl`` on unit ``w``."""
    return (suite, impl, "time", w)


PUSH, QWEN_PUSH = ("ag", "tide", "phase:peer_copy", UNIT), ("ag", "tide", "phase:peer_copy", QWEN)
#: run14's "faster than" figures, in the page's order, each rendered by :func:`faster`:
#: (what, goal: the least speedup, the call timed, the baseline, the baseline's name).
#: A goal of "within N%" is a speedup of at least 1 / (1 + N%).
AG_FASTER = (
    ("TIDE-AG faster than `stock` (FSDP2's path: copy-in, NCCL all-gather, copy-out)", 1.5,
     _t("ag", "tide"), _t("ag", "stock"), "stock"),
    ("TIDE-AG faster than `symm` (NCCL's copy-engine all-gather, with copy-in/out)", 1.2,
     _t("ag", "tide"), _t("ag", "symm"), "symm"),
    ("TIDE-AG faster than FSDP2's own unit (`fsdp2`)", 1.0, _t("ag", "tide"),
     _t("ag", "fsdp2"), "fsdp2"),
    ("TIDE-AG within 3% of its own push timed alone (the copy-engine bound)",
     round(1 / 1.03, 3), _t("ag", "tide"), PUSH, "the push"),
    ("TIDE-AG as a plan (`tide-plan`) within 3% of the push", round(1 / 1.03, 3),
     _t("ag", "tide-plan"), PUSH, "the push"),
    ("TIDE-AG faster than NCCL's copy-engine all-gather in place", 1.0, _t("ag", "tide"),
     ("ag", "symm", "phase:collective", UNIT), "NCCL CE"),
)
RS_FASTER = (
    ("TIDE-RS (bf16 in, fp32 out) faster than `stock` (fp32 pack, NCCL fp32 RS)", 2.0,
     _t("rs", "tide"), _t("rs", "stock"), "stock"),
    ("TIDE-RS faster than FSDP2's own unit (`fsdp2`)", 1.0, _t("rs", "tide"),
     _t("rs", "fsdp2"), "fsdp2"),
    ("TIDE-RS faster than a Megatron-style bf16 all-to-all + fp32 accumulate", 1.0,
     _t("rs", "tide"), _t("rs", "nccl-a2a"), "nccl-a2a"),
)
QWEN_FASTER = (
    ("Qwen3-30B-A3B (393 parameters): TIDE-AG faster than `stock`", 1.0,
     _t("ag", "tide", QWEN), _t("ag", "stock", QWEN), "stock"),
    ("Qwen3-30B-A3B: TIDE-AG as a plan within 10% of its push", round(1 / 1.1, 3),
     _t("ag", "tide-plan", QWEN), QWEN_PUSH, "the push"),
    ("Qwen3-30B-A3B: TIDE-RS faster than `stock`", 2.0, _t("rs", "tide", QWEN),
     _t("rs", "stock", QWEN), "stock"),
    ("Qwen3-30B-A3B: TIDE-RS as a plan faster than `stock`", 2.0, _t("rs", "tide-plan", QWEN),
     _t("rs", "stock", QWEN), "stock"),
)


def faster(R: dict, rows: tuple) -> list[Figure]:
    """One figure per row of a ``*_FASTER`` table: the baseline's time over the call's,
    met where it reaches the goal."""
    out = []
    for what, goal, timed, base, base_name in rows:
        t, b = value(R, *timed), value(R, *base)
        out.append(Figure(what, f">= {goal:g}x",
                          f"{x(b / t)} ({us(t)} against {base_name} {us(b)})", b / t >= goal))
    return out


def collectives(run: Run) -> tuple[Figure, ...]:
    R = run.bench("records.jsonl")
    sm = extra(R, "ag", "tide", "sm_time_cupti")
    n_sm = sm.get("kernel_launches", 0) + sm.get("same_device_copies", 0)
    bw = value(R, "ag", "tide", "bandwidth")
    figs = faster(R, AG_FASTER) + [
        Figure("TIDE-AG bandwidth per rank, one call", ">= 350 GB/s", f"{bw:.0f} GB/s", bw >= 350),
        Figure("TIDE-AG work on the SMs (CUPTI)", "none",
               f"{sm.get('kernel_launches', 0):g} kernels, {sm.get('same_device_copies', 0):g} "
               f"same-device copies ({sm.get('same_device_copy_us', 0):.0f} us, run by the "
               "driver on the SMs) per call", n_sm == 0),
    ] + faster(R, RS_FASTER)
    sm_t, sm_s = value(R, "rs", "tide", "sm_time_cupti"), value(R, "rs", "stock", "sm_time_cupti")
    err, err_s = value(R, "rs", "tide", "rs_error"), value(R, "rs", "stock", "rs_error")
    figs += [
        Figure("TIDE-RS SM time 12.5x below `stock`'s (CUPTI)", ">= 12.5x",
               f"{x(sm_s / sm_t)} ({us(sm_t)} against {us(sm_s)})", sm_s / sm_t >= 12.5),
        Figure("TIDE-RS error against fp64 (normwise), as fp32 NCCL's", "<= 1e-05",
               f"{err:.1e} (`stock`: {err_s:.1e})", err <= 1e-5),
    ]
    return tuple(figs + interference(R) + memory(R) + faster(R, QWEN_FASTER))


def interference(R: dict) -> list[Figure]:
    out = []
    for op in ("ag", "rs"):
        v = value(R, "interference", "tide", f"{op}:{GEMM}")
        s = value(R, "interference", "stock", f"{op}:{GEMM}")
        out.append(Figure(f"A single-wave GEMM ({GEMM}) beside TIDE-{op.upper()}: slowdown",
                          "<= +10%", f"{pct(v)} (beside `stock`: {pct(s)}; median of 3 pairs)",
                          v <= 0.10))
    return out


def memory(R: dict) -> list[Figure]:
    units = ("llama3.1-8b", "llama3.1-70b", QWEN, "wan2.2-dit")
    ratios = {w: value(R, "memory", "tide", "peak", w) / value(R, "memory", "stock", "peak", w)
              for w in units}
    text = ", ".join(f"{w} {x(r)}" for w, r in ratios.items())
    return [Figure("Peak memory beyond the inputs, TIDE against `stock`", "<= 1x", text,
                   max(ratios.values()) <= 1.0)]


# ---- 2xH200: training steps (run12-fsdp2, run7) --------------------------------------


def fsdp2(run: Run) -> tuple[Figure, ...]:
    d = run.json("compare.json")
    by, c = {r["impl"]: r for r in d["runs"]}, d["comparison"]
    t, f, floor = (by[k]["median_step_s"] for k in ("tide", "fsdp2", "floor"))
    return (
        Figure("`shard_module` step 10% below `fully_shard`'s", "<= 0.90x",
               f"{x(t / f, 3)} ({ms(t)} against {ms(f)}; medians, {d['passes']} passes)",
               t / f <= 0.90),
        Figure("`shard_module` step within 3% of the no-communication floor", "<= 1.03x",
               f"{x(t / floor, 3)} (floor {ms(floor)}; `fully_shard` {x(f / floor, 3)})",
               t / floor <= 1.03),
        against("`shard_module` peak memory no higher than `fully_shard`'s", "<= 1x",
                by["tide"]["peak_bytes"], by["fsdp2"]["peak_bytes"], gib, lambda r: r <= 1),
        Figure("Losses agree with `fully_shard`'s", f"rel. diff <= {c['loss_rtol']:g}",
               f"{c['loss_max_rel_diff']:.1e} (step {c['loss_step_of_max']})", c["losses_agree"]),
    )


def trainer(run: Run) -> tuple[Figure, ...]:
    d = run.json("train.json")
    by, c = {r["impl"]: r for r in d["runs"]}, d["comparison"]
    t, s = by["tide"]["median_step_s"], by["stock"]["median_step_s"]
    P = run.bench("plans.jsonl")
    figs = [
        Figure("Trainer step on `tide` within 3% of the floor (`local`)", "<= 1.03x",
               f"{x(c['tide_over_floor'], 3)} ({ms(t)}; `stock` {x(c['stock_over_floor'], 3)})",
               c["tide_over_floor"] <= 1.03),
        against("Trainer step on `tide` below `stock` (FSDP2's path over NCCL)", "< 1x", t, s,
                ms, lambda r: r < 1),
        against("Trainer peak memory, `tide` against `stock`", "<= 1x",
                by["tide"]["peak_bytes"], by["stock"]["peak_bytes"], gib, lambda r: r <= 1),
        Figure("Trainer losses, `tide` against `stock`", "bitwise equal",
               "bitwise equal" if c["tide_vs_stock_losses"]["bitwise"] else
               f"max rel. diff {c['tide_vs_stock_losses']['max_rel_diff']:.1e}",
               c["tide_vs_stock_losses"]["bitwise"]),
    ]
    for w in (UNIT, QWEN):
        for op in ("ag", "rs"):
            plan = value(P, "plans", "plan", f"{op}_host_us", w)
            call = value(P, "plans", "call", f"{op}_host_us", w)
            figs.append(Figure(f"Host time per {op.upper()} call, {w}: plan against eager call",
                               "plan below the call", f"{plan:,.0f} us against {call:,.0f} us",
                               plan < call))
    return tuple(figs)


# ---- one H200 (run21, run24, run30), one H100 -------------------------------------


def captured_trainer(run: Run) -> tuple[Figure, ...]:
    """The captured trainer step against the eager one (``compare_train.py --impl graph``)."""
    d = run.json("train.json")
    by = {r["impl"]: r for r in d["runs"]}
    e, g = by["tide"], by["tide-graph"]
    figs = [Figure(f"Captured trainer step: {c['goal']}", "bitwise equal", c["measured"],
                   c["met"]) for c in d["comparison"]["goals"] if "losses" in c["goal"]]
    host = g["median_host_s"] / e["median_host_s"]
    figs += [
        Figure("Captured trainer step: host time per step against eager", "below eager",
               f"{x(host, 4)} ({g['median_host_s'] * 1e3:.3f} ms against "
               f"{ms(e['median_host_s'])})", host < 1),
        against("Captured trainer step: step time against eager", "<= 1x",
                g["median_step_s"], e["median_step_s"], ms, lambda r: r <= 1),
        against("Captured trainer step: peak memory against eager", "reference",
                g["peak_bytes"], e["peak_bytes"], gib),
    ]
    return tuple(figs)


GRAPH_UNITS = (UNIT, "llama3.1-70b", QWEN, "wan2.2-dit")


def one_h200_graph_plans(run: Run) -> tuple[Figure, ...]:
    """Host time per graph plan call, back to back (the goal) and with the device idle;
    with the flags as memory operations; the eager plan's."""
    P = run.bench("plans.jsonl")
    figs = []
    for w in GRAPH_UNITS:
        for op in ("ag", "rs"):
            q = value(P, "plans", "graph", f"{op}_queued_host_us", w)

            def us(impl: str, metric: str, w: str = w, op: str = op) -> str:
                return f"{value(P, 'plans', impl, f'{op}_{metric}', w):,.1f} us"
            figs.append(Figure(
                f"Host time per {op.upper()} graph plan call, {w}, back to back (device idle "
                "before each call; flags as memory operations, back to back; the eager "
                "plan's, back to back)", "<= 10 us",
                f"{q:,.1f} us ({us('graph', 'host_us')}; {us('graph-memops', 'queued_host_us')}"
                f"; {us('plan', 'queued_host_us')})", q <= 10))
    return tuple(figs)


def one_h200_units(run: Run, record: str = "compare.json") -> tuple[Figure, ...]:
    """Per-unit overhead over the same model with no wrapper, eager, at one rank (the
    0.3 ms goal is small-32l's, a host-bound model's, judged on a quiet host only)."""
    d = run.json(record)
    c, model = d["comparison"], d["model"]
    units, per = c["units"], c["per_unit_over_plain_s"]
    by = {r["impl"]: r["median_step_s"] for r in d["runs"]}
    figs = [Figure(f"{model}: step time, {k}", "reference",
                   f"{ms(by[k])} ({x(by[k] / by['plain'])} plain's, "
                   f"{x(by[k] / by['fsdp2'])} FSDP2's)") for k in by]
    busy = max(r.get("step_spread", 0.0) for r in d["runs"]) > 0.10
    judged, note = model == "small-32l" and not busy, "; a busy host: not judged" * busy
    figs += [Figure(f"`shard_module` eager: step over plain per unit ({units} units)",
                    "<= 0.3 ms" if model == "small-32l" else "reference",
                    f"{per['tide'] * 1e3:.2f} ms (no communication, the floor: "
                    f"{per['floor'] * 1e3:.2f} ms" + (f"; no-op hooks of its shape, torch's "
                    f"own: {per['hooks'] * 1e3:.2f} ms" if "hooks" in per else "") + f"{note})",
                    per["tide"] <= 0.3e-3 if judged else None),
             Figure("`fully_shard` eager: step over plain per unit", "reference",
                    f"{per['fsdp2'] * 1e3:.2f} ms")]
    return tuple(figs)


def _stress_loops(run: Run, name: str) -> dict[str, tuple[int, int]]:
    """A stress step's ``loops.txt``: {job: (loops, failed)}, ``adamw0``, ``adamw1``... as one."""
    out: dict[str, tuple[int, int]] = {}
    with open(os.path.join(run.path, name)) as f:
        for line in f:
            job, _, rest = line.partition(" loop ")
            job = job.rstrip("0123456789")
            loops, failed = out.get(job, (0, 0))
            out[job] = (loops + 1, failed + (": exit 0:" not in rest))
    return out


def _pytest(run: Run, log: str) -> tuple[int, int, int, Optional[str]]:
    """A pytest log's summary: (passed, skipped, failed or errors, None); a log cut before
    it (its time ran out): (0, 0, the F and E of pytest -q's progress, how far it got)."""
    with open(os.path.join(run.path, log), errors="replace") as f:
        text = f.read()
    line = re.search(r".*\d+ passed.* in \d.*", text)
    if line is None:
        reached = re.findall(r"\[ *(\d+)%\]", text)
        return 0, 0, len(re.findall(r"\x1b\[31m[FE]", text)), f"{(reached or ['0'])[-1]}%"
    n = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|failed|error)", line[0])}
    return n.get("passed", 0), n.get("skipped", 0), n.get("failed", 0) + n.get("error", 0), None


def one_h200_suite(run: Run) -> tuple[Figure, ...]:
    """The GPU suite at one commit: the default steps and 3-4 ranks, the stress step, and
    tidearray.jax's GPU tests at 1-4 ranks."""
    figs = []
    for log, what in (("np2", "all of `tests/`, 2 ranks"), ("np1", "all of `tests/`, 1 rank"),
                      ("np3", "the multi-rank and GPU tests, 3 ranks"),
                      ("np4", "the multi-rank and GPU tests, 4 ranks"),
                      *((f"jaxjit_np{n}", f"`tidearray.jax` on cuda, {n} rank" + "s" * (n > 1))
                        for n in (1, 2, 3, 4))):
        if not os.path.exists(os.path.join(run.path, f"{log}.log")):
            continue  # a run of some steps only
        passed, skipped, failed, cut = _pytest(run, f"{log}.log")
        figs.append(Figure(f"`{log}`: {what}, tests that failed", "0",
                           f"{failed} ({passed} passed, {skipped} skipped)" if cut is None else
                           f"{failed} in what ran; its time ran out at {cut}",
                           failed == 0 and cut is None))
    loops = _stress_loops(run, "stress_loops.txt")
    for job, what in (("adamw", "the fused-AdamW and graph tests, 1 rank, 4 processes at once"),
                      ("rs", "beside it: pipeline and reduce-scatter tests, 3 ranks"),
                      ("graphs", "beside it: graph tests, 2 ranks")):
        n, failed = loops.get(job, (0, 0))
        figs.append(Figure(f"Stress: loops that failed, {what}", "0", f"{failed} of {n}",
                           failed == 0 and n > 0))
    return tuple(figs)


def one_ab(run: Run) -> tuple[Figure, ...]:
    """benchmarks/run.sh's ``ab`` step (ab/): `tide`'s step at this commit against before/'s,
    the fastest of each side's pass medians; judged where the host was quiet (spread <= 10%)."""
    if not os.path.isdir(os.path.join(run.path, "ab")):
        return ()  # a run without the A/B step
    def fig(step: str, model: str) -> Figure:
        rs = {b: [r for n in (0, 1) for r in run.json(f"ab/{step}_{b}_{n}.json")["runs"]
                  if r["impl"] == "tide"] for b in ("after", "before")}
        quiet = max(r["step_spread"] for r in rs["after"] + rs["before"]) <= 0.10
        return against(f"A/B, {model}: `tide`'s step, this commit against before/ (a "
                       f"{'quiet' if quiet else 'busy'} host)", "<= 1.02x",
                       *(min(r["median_step_s"] for r in rs[k]) for k in ("after", "before")),
                       ms, (lambda r: r <= 1.02) if quiet else None)
    return fig("ab", "llama3-8b-8l"), fig("unitsab", "small-32l")


def _jax_pair(what: str, t: dict, u: dict) -> list[Figure]:
    """``t`` against ``u``: compile time (judged only where both found XLA's GEMM autotuning
    alike: in one process the first compile fills it), host CPU per step, peak memory, and
    both trainings (every loss down, the last ones within the bf16 bound)."""
    cpu = t["median_cpu_s"] - u["median_cpu_s"]
    diff = abs(t["losses"][-1] - u["losses"][-1]) / abs(u["losses"][-1])
    alike = "xla_cache" in t and t["xla_cache"] == u.get("xla_cache")  # unrecorded: not
    vs = f"`{t['impl']}` against `{u['impl']}`"
    return [against(f"{what}compile time, {vs}", "<= 1.5x", t["compile_s"], u["compile_s"],
                    lambda v: f"{v:.1f} s", (lambda r: r <= 1.5) if alike else None, 2),
            Figure(f"{what}host CPU per step, {vs}", "<= 2 ms over", f"{cpu * 1e3:+.1f} ms "
                   f"({ms(t['median_cpu_s'])} against {ms(u['median_cpu_s'])})", cpu <= 2e-3),
            against(f"{what}peak memory, {vs}", "reference", t["peak_bytes"], u["peak_bytes"],
                    gib, digits=2),
            Figure(f"{what}losses, first to last; the last ones apart", "down; <= 3e-2",
                   f"{t['losses'][0]:.4f} -> {t['losses'][-1]:.4f} ({u['losses'][-1]:.4f}); "
                   f"{diff:.1e}", max(t["losses"][-1] - t["losses"][0], diff - 3e-2) < 0)]


def one_h200_jaxscan(run: Run) -> tuple[Figure, ...]:
    """The scanned JAX step at two depths against the unsharded step, scanned too (in one
    process, `unsharded` second: its compile found XLA's autotuning warm; a record without
    it, one that does not fit the card at 32 layers: `unsharded-remat`)."""
    recs = {d: {r["impl"]: r for r in run.json(f"{d}/jax_step.json")["runs"]}
            for d in ("l4", "l32")}
    t4, t32 = recs["l4"]["tidearray-scan"], recs["l32"]["tidearray-scan"]
    figs = [against("`tidearray-scan` compile time, 32 layers over 4", "<= 1.2x",
                    t32["compile_s"], t4["compile_s"], lambda v: f"{v:.1f} s",
                    lambda r: r <= 1.2, 2)]
    for d, r in recs.items():
        t, u = r["tidearray-scan"], r.get("unsharded", r.get("unsharded-remat"))
        figs += [*_jax_pair(f"{d[1:]} layers: ", t, u),
                 against(f"{d[1:]} layers: step time", "reference", t["median_step_s"],
                         u["median_step_s"], ms, digits=2)]
    return tuple(figs)


def one_jax_step(run: Run) -> tuple[Figure, ...]:
    """The unrolled JAX step, every impl in one process (jax/); the first compile of
    `tidearray` and `unsharded` in a process each (jaxcompile/)."""
    by = {r["impl"]: r for r in run.json("jax/jax_step.json")["runs"]}
    cold = [dict(run.json(f"jaxcompile/{i}/jax_step.json")["runs"][0], xla_cache="cold")
            for i in ("tidearray", "unsharded")  # each alone in its process
            if os.path.exists(os.path.join(run.path, "jaxcompile"))]
    step = [against(f"Step time, `{a}` against `{b}`", f"<= {bound}x", by[a]["median_step_s"],
                    by[b]["median_step_s"], ms, lambda r, bound=bound: r <= bound)
            for a, b, bound in (("tidearray-keep", "unsharded", 1.02),
                                ("tidearray", "unsharded-remat", 1.05))]
    step += [against(f"Step time, `{a}` (tidearray's plans at one rank) against `unsharded`",
                     "reference", by[a]["median_step_s"], by["unsharded"]["median_step_s"], ms)
             for a in by if a.endswith("-plans")]
    first = _jax_pair("A process per impl: ", *cold)[:1] if cold else []
    return (*first, *step, *_jax_pair("One process: ", by["tidearray"], by["unsharded"])[1:])


# ---- the page --------------------------------------------------------------------------


def sections(root: str) -> list[Section]:
    def S(name: str, title: str, about: str, fn: Callable[[Run], tuple],
          plot: Optional[str] = None) -> Section:
        return Section(name, title, about, fn(Run(root, name)), plot)

    def suite(r: Run) -> tuple:  # the GPU suite, the units at two shapes, the A/B
        return (*one_h200_suite(r), *one_h200_units(r),
                *one_h200_units(r, "units8b/compare.json"), *one_ab(r))

    return [
        S("run14", "Collectives against NCCL and FSDP2's path",
          "One Llama-3.1-8B layer (9 parameters, 436 MB bf16) unless named; medians of 20 "
          "timed calls.", collectives, PLOTS[0]),
        S("run12-fsdp2", "`shard_module` against `fully_shard`, eager",
          "One PyTorch Llama-style model (llama3-8b-8l: 8 layers, hidden 4096, 8192 tokens "
          "per GPU).", fsdp2, PLOTS[1]),
        S("run7", "The trainer of examples/train.py, and host time per call",
          "A Llama-3.1-8B-shaped model (8 layers, 8192 tokens per GPU).", trainer),
        S("run21-one-h200", "CUDA graphs: the captured trainer step",
          "The trainer at one rank: llama3-8b-8l, 8192 tokens, medians after 2 warm-up "
          "steps, each run's model in its capturable form, the default pool's cache given "
          "back before capturing.", captured_trainer),
        S("run24-one-h200", "CUDA graphs: host time per graph plan call, back to back",
          "2 ranks sharing the GPU, medians of 50 calls, as a training loop issues them; "
          "with the device idle and the ranks synchronized before each call the launch "
          "costs about 4x (1.4-13x) a one-rank launch (run22; why is not known).",
          one_h200_graph_plans),
        S("run31-one-h200-jaxscan", "`tidearray.jax` scanned: compile time against depth",
          "One rank, default flags: `jax_step.py --scan` at 4 and 32 layers. `unsharded` "
          "compiled second in the process, its autotuning warm: the compile ratios are not "
          "judged (run37 compiles each impl in a process of its own).", one_h200_jaxscan),
        S("run37-one-h100-jax", "`tidearray.jax` unrolled: compile, step, host and memory",
          "One rank, XLA's default flags: `jax_step.py` (8 layers, width 2048, 4096 tokens, "
          "bf16), every impl in one process, 12 timed steps after 3; the first compile of "
          "`tidearray` and `unsharded` in a process each (README.md).", one_jax_step),
        S("run45-one-h200-suite", "The GPU suite, per-unit overhead and an A/B at 9b40dc2",
          "Seven commands on one H200 (README.md): the suite at 1-4 ranks (`jaxjit` at 10e912e), "
          "stress; small-32l, llama3-8b-8l; `tide` against 6c6dced, 2 passes.", suite),
        S("run47-one-h100-alone-grid", "The default GPU suite, per-unit overhead and the JAX "
          "step at 0e1cb85", "Five commands on one H100 (README.md): run46's, JAX's collectives "
          "on every SM, fewer host calls per unit.", lambda r: (*suite(r), *one_jax_step(r))),
        S("run51-one-h100-one-rank-casts", "The default GPU suite, per-unit overhead and the "
          "JAX step with one rank's casts in XLA", "Six commands on one H100 (README.md: the "
          "JAX step at 3cdf960).", lambda r: (*suite(r), *one_jax_step(r))),
        S("run52-one-h100-one-rank-views", "The GPU suite at 1-4 ranks and the Llama-8B shape "
          "with one rank's gathers as views", "Five commands on one H100 (README.md).", suite),
        S("run53-one-h100-final-suite", "The GPU suite and both shapes", "See README.md.", suite),
    ]


def _status(f: Figure) -> str:
    return "reference" if f.met is None else ("met" if f.met else "**missed**")


def _section(root: str, s: Section) -> list[str]:
    meta = Run(root, s.run).meta
    # A record keeps the command that ran; the page says what runs it now.
    now = "".join(f" ({note})" for old, note in MOVED.items() if old in meta["command"])
    out = [f"### {s.title} ({s.run}, {meta['machine']})", "",
           f"Record [`{RESULTS}/{s.run}`](../{RESULTS}/{s.run}/) at commit `{meta['commit']}`"
           f", {meta['date']}, on `{meta['machine']}`. {s.about}{now} Command:", "",
           "```", *meta["command"].split("; "), "```", "",
           "| figure | goal | measured | status |", "| --- | --- | --- | --- |"]
    out += [f"| {f.what} | {f.goal} | {f.measured} | {_status(f)} |" for f in s.figures]
    if s.plot:
        out += ["", f"![{s.title}](../{s.plot})"]
    return out + [""]


def _archived(root: str) -> list[str]:
    """The runs whose ``run.json`` has an ``archived`` title (their code has left the tree,
    or a later run measured the same again), one entry each: title, record, commit and
    command. The page's hand-written part gives what each found."""
    out = ["## Earlier records", "",
           "Runs whose code has left the tree, or that a later run measured again. Each "
           "record stays in its folder; what it found, and the commit that holds its code, "
           "are under \"Retired experiments\" and \"Superseded sections\" below.", ""]
    runs = (Run(root, n) for n in sorted(os.listdir(os.path.join(root, RESULTS))))
    for run in (r for r in runs if "archived" in r.meta):
        meta = run.meta
        commands = "; ".join(f"`{c}`" for c in meta["command"].split("; "))
        out.append(f"- **{meta['archived']}** ({run.name}, {meta['machine']}): "
                   f"[record](../{RESULTS}/{run.name}/) at commit `{meta['commit']}`, "
                   f"{meta['date']}. Command: {commands}.")
    return out + [""]


def hand_written(root: str = ROOT) -> str:
    """The page's hand-written part (from ``HAND`` on), or "" where it has none."""
    path = os.path.join(root, PAGE)
    text = open(path).read() if os.path.exists(path) else ""
    return text[text.find(HAND):] if HAND in text else ""


def render_page(root: str = ROOT) -> str:
    """docs/performance.md: the records' sections, then the page's hand-written part."""
    secs = sections(root)
    out = [f"<!-- Generated by `{COMMAND}` from {RESULTS}/; edit benchmarks/performance.py, "
           "not this page, except its hand-written end. -->", "", "# Performance", "",
           "Every figure below comes from the records of one run folder under "
           f"[`{RESULTS}/`](../{RESULTS}/), whose `run.json` gives its commit, machine kind "
           "and command. Figures of different machine kinds are never compared with each "
           "other. `stock` is the harness's re-implementation of FSDP2's collective path "
           "over NCCL (copy-in, flat NCCL collective, copy-out; fp32 pack for the "
           "reduce-scatter). A goal is what the project targets; *missed* goals stay "
           f"listed. Rebuild this page, its plots and the README's summary with `{COMMAND}`.",
           ""]
    for kind, about in MACHINES.items():
        out += [f"## `{kind}`: {about}", ""]
        for s in secs:
            if Run(root, s.run).meta["machine"] == kind:
                out += _section(root, s)
    out += _archived(root)
    hand = hand_written(root)
    return "\n".join(out).rstrip("\n") + "\n" + (f"\n{hand}" if hand else "")


def render_summary(root: str = ROOT) -> str:
    """The README's block between the markers (markers included)."""
    by = {s.run: s for s in sections(root)}
    c, f = by["run14"].figures, by["run12-fsdp2"].figures

    def first(figs: tuple, start: str) -> Figure:
        return next(g for g in figs if g.what.startswith(start))

    ag, rs = first(c, "TIDE-AG faster than `stock`"), first(c, "TIDE-RS (bf16")
    gemm = [g for g in c if g.what.startswith("A single-wave GEMM")]
    lines = [
        BEGIN, f"<!-- Generated by `{COMMAND}`; edit benchmarks/performance.py. -->", "",
        f"On `nvidia-h200-x2` (2 H200, NVLink), one Llama-3.1-8B layer "
        f"([run14](benchmarks/results/run14/)): `all_gather` **{ag.measured.split()[0]}** "
        f"faster than FSDP2's collective path over NCCL, `reduce_scatter` (bf16 in, fp32 out) "
        f"**{rs.measured.split()[0]}**; a GEMM beside them slows by "
        f"{gemm[0].measured.split()[0]} and {gemm[1].measured.split()[0]} (goal +10%).",
        "",
        f"On `nvidia-h200-x2`, a PyTorch Llama-style model "
        f"([run12-fsdp2](benchmarks/results/run12-fsdp2/)): `shard_module`'s step is "
        f"**{f[0].measured.split()[0]}** `fully_shard`'s, {f[1].measured.split()[0]} the "
        f"no-communication floor, at {f[2].measured.split()[0]} its peak memory.",
        "",
        "Every figure, its goal, machine, record and command: "
        "[docs/performance.md](docs/performance.md).", END]
    return "\n".join(lines)


def generated_block(text: str, begin: str = BEGIN, end: str = END) -> Optional[str]:
    """The generated block of ``text`` from ``begin`` to ``end`` (markers included; by
    default the README's), or None where it has none."""
    i, j = text.find(begin), text.find(end)
    return None if i < 0 or j < i else text[i:j + len(end)]


def stale(root: str = ROOT) -> list[str]:
    """The outputs (paths from root) whose text differs from what the records give."""
    out = []
    page = os.path.join(root, PAGE)
    if not os.path.exists(page) or open(page).read() != render_page(root):
        out.append(PAGE)
    with open(os.path.join(root, README)) as f:
        if generated_block(f.read()) != render_summary(root):
            out.append(README)
    return out


# ---- plots (matplotlib only here) ------------------------------------------------------


def plot(root: str = ROOT) -> list[str]:
    """Write PLOTS from the records; deterministic (no dates or versions in the files)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.hashsalt": "tidearray", "font.family": "DejaVu Sans"})
    R = Run(root, "run14").bench("records.jsonl")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, op, impls in ((axes[0], "ag", ("tide", "tide-plan", "symm", "stock", "fsdp2")),
                          (axes[1], "rs", ("tide", "tide-plan", "nccl-a2a", "stock", "fsdp2"))):
        ts = [value(R, op, i, "time") * 1e6 for i in impls]
        ax.barh(impls, ts, color=["#1f77b4" if i.startswith("tide") else "#999999"
                                  for i in impls])
        ax.invert_yaxis()
        ax.set_title(f"{op.upper()}, {UNIT} (run14, nvidia-h200-x2)", fontsize=9)
        ax.set_xlabel("median time per call (us)")
    _save(fig, os.path.join(root, PLOTS[0]))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names, eager, comp = ("floor", "fsdp2", "tide", "tide-kept"), [], []
    for label, acc in (("run12-fsdp2", eager), ("run12-fsdp2-compile", comp)):
        by = {r["impl"]: r for r in Run(root, label).json("compare.json")["runs"]}
        acc += [by[n]["median_step_s"] * 1e3 for n in names]
    ys = range(len(names))
    ax.barh([y - 0.2 for y in ys], eager, 0.4, label="eager")
    ax.barh([y + 0.2 for y in ys], comp, 0.4, label="torch.compile")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("median step (ms)")
    ax.set_title("llama3-8b-8l step (run12-fsdp2, nvidia-h200-x2)", fontsize=9)
    ax.set_xlim(0, max(eager + comp) * 1.35)  # room for the legend beside the bars
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, os.path.join(root, PLOTS[1]))
    return list(PLOTS)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)


# ---- the command -----------------------------------------------------------------------


def rewrite_block(path: str, new: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the generated block from ``begin`` to ``end`` of the file at ``path`` with
    ``new`` (``benchmarks/memory.py`` rewrites docs/memory.md's section the same way)."""
    with open(path) as f:
        text = f.read()
    old = generated_block(text, begin, end)
    if old is None:
        raise SystemExit(f"{path} has no {begin} ... {end} block to rewrite")
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def write(root: str = ROOT) -> None:
    page = render_page(root)  # before the open below empties the page's hand-written part
    with open(os.path.join(root, PAGE), "w") as f:
        f.write(page)
    rewrite_block(os.path.join(root, README), render_summary(root))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if docs/performance.md or the README block is stale")
    p.add_argument("--no-plots", action="store_true", help="write the markdown only")
    p.add_argument("--root", default=ROOT, help="repository root")
    a = p.parse_args(argv)
    if a.check:
        bad = stale(a.root)
        for path in bad:
            print(f"{path} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if bad else 0
    write(a.root)
    if not a.no_plots:
        plot(a.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
