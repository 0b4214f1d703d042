"""A JAX transformer's training step: unsharded, ``tidearray.jax`` and JAX's own FSDP over a
mesh, from the same weights on the same batches.

    mpirun -n 1 python benchmarks/steps/jax_step.py --out OUT/jax        # mid-size, GPU
    mpiexec -n 1 python benchmarks/steps/jax_step.py --tiny             # the CPU check

    # tidearray.jax against JAX's FSDP (docs/jax.md): one launch each, then one report
    python benchmarks/steps/jax_step.py --impls xla-fsdp --scan --out D/xla
    mpirun -n 2 python benchmarks/steps/jax_step.py --impls tidearray \\
        --scan --out D/tide
    CUDA_VISIBLE_DEVICES=0 python benchmarks/steps/jax_step.py --impls unsharded --world 2 \\
        --scan --out D/one
    python benchmarks/steps/jax_step.py --report D/*/jax_step.json
    # on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2 for xla-fsdp, --tiny and
    # --dtype float32 in each launch

``examples/jax_train.py``'s model, data and loss (``--layers``, ``--width``, ``--seq``
tokens per rank or device per step; ``--tiny``: 2 layers, width 64, 32 tokens), bf16
compute over fp32 masters, AdamW without clipping, the learning rate warmed up over the
untimed ``--warmup`` steps; the blocks in a Python loop, or under ``lax.scan``
(``--scan``; always in ``tidearray-scan``). Impls (``--impls``, run in this order, that
of expected peak memory): ``tidearray`` (``ShardedUnits.apply`` per unit, parameters
released after each forward and gathered again for backward), ``tidearray-scan`` (the
blocks as one stacked unit under ``lax.scan``), ``tidearray-keep``
(``reshard_after_forward=False``), ``tidearray-keep-plans`` (the same, its collectives
through tidearray's plans at one rank, where the others' are XLA's casts), ``tidearray-cb``
(``command_buffer=True``, plans at one rank), ``unsharded-remat`` (``unsharded`` with each
unit under ``jax.checkpoint``: the forward runs again, as in ``tidearray``),
``unsharded`` (one device, the global batch) and, not by default and in a launch of its
own, ``xla-fsdp`` (a 1-D mesh ``fsdp`` over every local device, parameters and moments
sharded on dim 0, the collectives XLA inserts). docs/jax.md says more of each.

Per impl: the compile time (JAX's lowering and XLA's compile; with ``--recompile`` each
again with XLA's in-process caches warm; ``xla_cache``: ``cold`` for a process's first
compile, which alone pays XLA's GEMM autotuning), the compiled step's GEMMs and distinct
GEMMs, its optimized HLO (``IMPL.hlo.txt.gz`` under ``--out``), with ``--profile`` one
more step under CUPTI (its device time, busy and idle: ``profile``), the median step time,
host time to issue a step and host CPU per step (every thread: XLA's callback threads
too), JAX's peak device memory and XLA's own footprint estimate. ``--out DIR`` writes
``jax_step.json`` (with the git commit) and a table; ``--report JSON...`` remakes the
table from records. A run or a report fails unless every loss fell (the last step
re-runs the first step's batch) and the impls agree step by step with ``xla-fsdp``
(else ``unsharded``) within ``LOSS_RTOL``. The table ends with the goals (``GOALS``),
met or not. On GPUs JAX runs at XLA's default flags: never time with
``--xla_gpu_autotune_level=0`` (it picks slow kernels).

[Note: peak memory in one process]
JAX has no way to reset its peak counter, so the impls run in order of expected
footprint and each reports the peak reached by its end; a later impl that needs less
than an earlier one shows the earlier peak. ``xla_bytes`` (the compiled step's
arguments, outputs and temporaries, from ``memory_analysis``) does not have that
limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import tidearray as ta  # noqa: E402
from benchmarks.harness import training  # noqa: E402
from benchmarks.harness.records import git_commit  # noqa: E402
from tests.support import example  # noqa: E402
from tidearray.fsdp import AdamW  # noqa: E402

ex = example("jax_train")

IMPLS = ("tidearray", "tidearray-scan", "tidearray-keep", "tidearray-keep-plans", "tidearray-cb",
         "unsharded-remat", "unsharded", "xla-fsdp")
GROUP_IMPLS = IMPLS[:5]  # the impls that need a tidearray group
PLANS_AT_ONE_RANK = ("tidearray-keep-plans", "tidearray-cb")  # ([Note: one rank], _runners)
#: Largest relative loss difference accepted as agreement, by compute dtype.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS[:-1]))
    p.add_argument("--report", nargs="+", metavar="JSON", help="the table of these records")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096, help="tokens per rank per step")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(LOSS_RTOL))
    p.add_argument("--lr", type=float, default=None, help="3e-4 (3e-3 with --tiny)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per impl")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the lr's warm-up)")
    p.add_argument("--world", type=int, default=None,
                   help="unsharded: devices whose batches make the global batch")
    p.add_argument("--scan", action="store_true", help="the blocks under lax.scan")
    p.add_argument("--recompile", action="store_true",
                   help="compile each step twice: the second compile finds XLA's in-process "
                        "caches (GEMM autotuning) warm")
    p.add_argument("--profile", action="store_true",
                   help="CUPTI: one more step's device time per role, busy and idle")
    p.add_argument("--tiny", "--quick", action="store_true", help="a tiny model (CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.vocab = 2, 64, 2, 32, 64
        args.steps, args.warmup = 6, 2
    args.lr = args.lr or (3e-3 if args.tiny else 3e-4)
    return args


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    if args.report:
        sys.exit(report(args.report))
    impls = [i for i in IMPLS if i in args.impls.split(",")]
    g = ta.init() if set(impls) & set(GROUP_IMPLS) else None
    if g is not None:
        jax = ex.setup_jax(g)
    else:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")  # as setup_jax: no TF32
    cfg = ex.Config(vocab=args.vocab, width=args.width, heads=args.heads, layers=args.layers,
                    seq=args.seq, batch=1, steps=args.warmup + args.steps, lr=args.lr,
                    scan=args.scan, max_grad_norm=None)
    rank0 = g is None or g.rank == 0
    log = print if rank0 else (lambda *a, **k: None)
    log(f"jax_step: {args.layers} layers, width {args.width}, {args.seq} tokens/rank, "
        f"{args.dtype}, {g.size if g else 1} rank(s), impls {impls}")
    records, units = [], ex.init_units(cfg)  # made once: seconds at the mid size
    for impl in impls:
        records.append(run_impl(jax, g, cfg, args, impl, units, log))
        # XLA keeps its GEMM autotuning in the process: only the first compile pays all of it
        records[-1]["xla_cache"] = "warm" if len(records) > 1 else "cold"
    rec = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "argv": sys.argv, "config": cfg.__dict__, "dtype": args.dtype,
           "world": g.size if g else 1, "backend": g.backend.name if g else "jax",
           "runs": records}
    failed = 0
    if rank0:
        failed = summarize([rec])
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "jax_step.json"), "w") as f:
                json.dump(rec, f, indent=1)
            with open(os.path.join(args.out, "jax_step.md"), "w") as f:
                f.write(table(records) + "\n")
            log(f"record: {os.path.join(args.out, 'jax_step.json')}")
    if g is not None:
        failed = g.comm.bcast(failed)
        g.close()
    sys.exit(failed)


def run_impl(jax: Any, g: Optional[ta.Group], cfg: Any, args: argparse.Namespace, impl: str,
             units: list, log: Callable) -> dict:
    """Compile, then warm-up and timed steps of one impl: its record."""
    run, devices, world, extra = build(jax, g, dataclasses.replace(
        cfg, scan=cfg.scan or impl == "tidearray-scan"), args, impl, units)
    compiled = run(0, compile_only=True)  # ahead of the steps: the compile alone
    compile_s = extra["lower_s"] + extra["xla_compile_s"]
    extra["xla_bytes"] = _xla_bytes(compiled)
    hlo = compiled.as_text()
    extra.update(gemm_counts(hlo))
    if args.out and (g is None or g.rank == 0):  # XLA's optimized step, to study offline
        os.makedirs(args.out, exist_ok=True)
        with gzip.open(os.path.join(args.out, f"{impl}.hlo.txt.gz"), "wt") as f:
            f.write(hlo)
    callbacks = extra.pop("callback_seconds", lambda: 0.0)  # tidearray's host time in them
    issue, cpu, wall, losses, in_callbacks = [], [], [], [], []
    for s in range(cfg.steps):
        if g is not None:
            g.comm.Barrier()
        b0, c0, t0 = callbacks(), time.process_time(), time.perf_counter()
        loss = run(s)
        t1 = time.perf_counter()
        loss = float(np.asarray(loss))  # waits for the step
        t2, c1 = time.perf_counter(), time.process_time()
        losses.append(loss if g is None else g.comm.allreduce(loss) / g.size)
        if s < args.warmup:
            log(f"[{impl}] warm-up step {s}: {t2 - t0:.2f} s", flush=True)
        else:
            issue.append(t1 - t0)
            wall.append(t2 - t0)
            cpu.append(c1 - c0)
            in_callbacks.append(callbacks() - b0)
    if args.profile:  # the step's edges, where the device waits for the host, included
        trace = (os.path.join(args.out, f"{impl}_step_trace.json")
                 if args.out and (g is None or g.rank == 0) else None)
        extra["profile"] = training.profile_step(lambda: float(np.asarray(run(0))), trace, log)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peak, cpu_s = max((p for p in peaks if p is not None), default=None), statistics.median(cpu)
    if g is not None:  # the largest of the ranks' peaks, the mean of their CPU times
        peak = max((p for p in g.comm.allgather(peak) if p is not None), default=None)
        cpu_s = g.comm.allreduce(cpu_s) / g.size
    r = {"impl": impl, "world": world, "compile_s": compile_s, "step_s": wall,
         "median_step_s": statistics.median(wall), "median_issue_s": statistics.median(issue),
         "median_cpu_s": cpu_s, "median_callback_s": statistics.median(in_callbacks),
         "peak_bytes": peak, "losses": losses,
         "platform": devices[0].platform, **extra}
    log(f"[{impl}] step {r['median_step_s'] * 1e3:.2f} ms, compile {compile_s:.2f} s, host "
        f"issue {r['median_issue_s'] * 1e3:.3f} ms, host CPU {cpu_s * 1e3:.2f} ms (in "
        f"tidearray's callbacks {r['median_callback_s'] * 1e3:.2f} ms), peak "
        f"{_gib(peak)} GiB, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return r


def learning_rate(args: argparse.Namespace, s: int) -> float:
    """Linear warm-up over the untimed steps, then constant (examples/train.py's rule)."""
    return args.lr * (s + 1) / args.warmup if s < args.warmup else args.lr


def data_step(cfg: Any, s: int) -> int:
    """The batch of step ``s``: the last step re-runs the first's, so its loss must be lower."""
    return 0 if s == cfg.steps - 1 else s


def global_batch(cfg: Any, s: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every device's samples of step ``s``, in rank order (what tidearray's ranks see)."""
    parts = [ex.batch(cfg, data_step(cfg, s), r) for r in range(world)]
    return np.concatenate([t for t, _ in parts]), np.concatenate([y for _, y in parts])


def build(jax: Any, g: Optional[ta.Group], cfg: Any, args: argparse.Namespace, impl: str,
          units: list) -> tuple[Callable, list, int, dict]:
    """``(run(s, compile_only=False) -> loss, devices, world, extra record fields)``."""
    import tidearray.jax as tj

    opt, extra = tj.ShardAdamW(AdamW(lr=args.lr)), {}
    dtype = jax.numpy.dtype(args.dtype)
    coef = lambda s: opt.coefficients(s + 1, learning_rate(args, s))  # noqa: E731
    model, fns, stacked = ex.sharded_model(jax, cfg, units)
    make_runner = functools.partial(runner, jax, phases=extra, recompile=args.recompile)
    if impl == "xla-fsdp":
        return (*xla_fsdp(jax, cfg, model, stacked, opt, whole_step(jax, cfg, opt, dtype), coef,
                          make_runner), extra)
    if impl.startswith("unsharded"):
        device, world = _device(jax, g), args.world or (g.size if g else 1)
        params = jax.device_put(model, device)
        step = whole_step(jax, cfg, opt, dtype, remat=impl == "unsharded-remat")
        return (make_runner(jax.jit(step, donate_argnums=(0, 1)),
                       params, opt.init(params), coef,
                       lambda s: jax.device_put(global_batch(cfg, s, world), device)),
                [device], world, extra)
    su = tj.shard_units(model, group=g, compute_dtype=dtype, stacked=stacked,
                        reshard_after_forward=not impl.startswith("tidearray-keep"),
                        command_buffer=impl == "tidearray-cb",
                        xla_at_one_rank=impl not in PLANS_AT_ONE_RANK)
    extra["callback_seconds"] = lambda: su.callback_seconds
    return (make_runner(ex.sharded_step(jax, su, fns, opt), su.shards, opt.init(su.shards), coef,
                   lambda s: [jax.device_put(a, su.device)
                              for a in ex.batch(cfg, data_step(cfg, s), g.rank)]),
            [su.device], g.size, extra)


def runner(jax: Any, jitted: Any, params: Any, state: Any, coef: Callable, batch: Callable,
           phases: dict, recompile: bool = False) -> Callable:
    """``run(s, compile_only=False)``: a jitted ``step(params, state, coef, tokens, targets)
    -> (params, state, loss)`` on step ``s``'s batch; ``compile_only`` compiles it (JAX's
    lowering and XLA's compile timed in ``phases``) and returns the compiled step;
    ``recompile``: a second time (``relower_s``, ``rexla_compile_s``), XLA's in-process
    caches (GEMM autotuning) warm. The steps call ``jitted``, which finds the executable
    in JAX's caches: a compiled object with host callbacks (tidearray's) has no C++
    dispatch: its Python one cost a 16-layer tiny tidearray-keep 7-8 ms a call (CPU)."""
    box = {"params": params, "state": state}

    def run(s: int, compile_only: bool = False) -> Any:
        args = (coef(s), *batch(s))
        if compile_only:
            for key in ("", "re")[:1 + recompile]:
                jax.clear_caches()  # JAX's traces, lowerings and executables, not XLA's
                t0 = time.perf_counter()
                lowered = jitted.lower(box["params"], box["state"], *args)
                t1 = time.perf_counter()
                box["step"], t2 = lowered.compile(), time.perf_counter()
                phases[f"{key}lower_s"], phases[f"{key}xla_compile_s"] = t1 - t0, t2 - t1
            return box["step"]
        box["params"], box["state"], loss = jitted(box["params"], box["state"], *args)
        return loss
    return run


def whole_step(jax: Any, cfg: Any, opt: Any, dtype: Any, remat: bool = False) -> Callable:
    """The step on the whole model's fp32 parameters cast to ``dtype`` (scanned or not);
    ``remat``: each unit's function under ``jax.checkpoint``."""
    fns = ex.unit_fns(jax, cfg)
    if remat:
        fns = [jax.checkpoint(fn) for fn in fns]

    def loss_fn(model: list, tokens: Any, targets: Any) -> Any:
        model = jax.tree_util.tree_map(lambda a: a.astype(dtype), model)
        h = fns[0](model[0], tokens)
        if cfg.scan:  # model[1]: the blocks stacked on a leading layer axis
            h = jax.lax.scan(lambda x, p: (fns[1](p, x), None), h, model[1])[0]
        else:
            for p, fn in zip(model[1:-1], fns[1:-1]):
                h = fn(p, h)
        return ex.cross_entropy(jax, fns[-1](model[-1], h), targets)

    def step(params: list, state: Any, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        return (*opt.update(params, grads, state, coef), loss)
    return step


def xla_fsdp(jax: Any, cfg: Any, model: list, stacked: list, opt: Any, step: Callable,
             coef: Callable, make_runner: Callable) -> tuple:
    """``(run, devices, world)``: one jit over a 1-D mesh ``fsdp`` of every local device."""
    devices = jax.devices()
    mesh, P = jax.sharding.Mesh(np.array(devices), ("fsdp",)), jax.sharding.PartitionSpec
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731

    def spec(shape: tuple, st: bool) -> Any:  # dim 0 (of each layer) where it divides
        return P() if len(shape) <= st or shape[st] % len(devices) else P(*[None] * st, "fsdp")

    shardings = [jax.tree_util.tree_map(lambda a, st=int(i in stacked): named(
        spec(a.shape, st)), unit) for i, unit in enumerate(model)]
    params = jax.device_put(model, shardings)
    state = opt.init(model)
    state = jax.device_put(state, type(state)(shardings, shardings))
    replicated = named(P())
    # the outputs keep the inputs' shardings: the parameters stay sharded between steps
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     out_shardings=(shardings, type(state)(shardings, shardings), replicated))
    batch = named(P("fsdp"))
    return (make_runner(jitted, params, state, lambda s: jax.device_put(coef(s), replicated),
                   lambda s: jax.device_put(global_batch(cfg, s, len(devices)), batch)),
            devices, len(devices))


def _device(jax: Any, g: Optional[ta.Group]) -> Any:
    if g is not None and g.backend.name == "cuda":
        return jax.devices("gpu")[g.backend.device]
    return jax.devices()[0]


#: A GEMM in XLA's optimized HLO: a cuBLAS call, a Triton GEMM fusion (GPU), a dot (CPU).
_GEMM = re.compile(r'__cublas\$|__triton_gemm|"kind":"__cudnn\$|\bdot\(')
#: What makes two GEMMs' lines differ and not their work: names, metadata, ids.
_NAMES = re.compile(r'%[\w.\-]+|metadata=\{[^}]*\}|"operation_queue_id":"\d+"|, calls=[\w.\-]+')


def gemm_counts(hlo: str) -> dict:
    """``gemms`` (the compiled step's GEMMs) and ``distinct_gemms`` (those that differ in
    more than their names: XLA autotunes each distinct one on GPUs, and a step whose layers
    repeat should have few)."""
    lines = [ln for ln in hlo.splitlines() if _GEMM.search(ln) and "=" in ln]
    distinct = {_NAMES.sub("", ln.split("=", 1)[1]).strip() for ln in lines}
    return {"gemms": len(lines), "distinct_gemms": len(distinct)}


def _xla_bytes(compiled: Any) -> Optional[int]:
    """XLA's footprint of the compiled step (arguments + outputs + temporaries - aliased)."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None


def _gib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def table(records: list) -> str:
    """The runs as markdown, each against the reference (``xla-fsdp``, else ``unsharded``)."""
    by = {r["impl"]: r for r in records}
    ref = by.get("xla-fsdp") or by.get("unsharded")
    vs = f"vs {ref['impl']}" if ref else "vs -"
    lines = [f"| impl | world | step ms | {vs} | compile s | host issue ms | host CPU ms | "
             f"peak GiB | {vs} | XLA GiB | first loss | last loss |", "|---" * 12 + "|"]
    for r in records:
        t = f"{r['median_step_s'] / ref['median_step_s']:.3f}x" if ref else "-"
        m = (f"{r['peak_bytes'] / ref['peak_bytes']:.3f}x"
             if ref and r.get("peak_bytes") and ref.get("peak_bytes") else "-")
        lines.append(f"| {r['impl']} | {r.get('world', '-')} | {r['median_step_s'] * 1e3:.2f} "
                     f"| {t} | {r.get('compile_s', 0):.2f} | {r['median_issue_s'] * 1e3:.3f} | "
                     f"{r['median_cpu_s'] * 1e3:.2f} | {_gib(r.get('peak_bytes'))} | {m} | "
                     f"{_gib(r.get('xla_bytes'))} | {r['losses'][0]:.4f} | "
                     f"{r['losses'][-1]:.4f} |")
    lines += compile_table(records) + targets(by)
    profiled = [f"- {r['impl']}: one step under CUPTI: the device busy {p['busy_ms']:.2f} ms, "
                f"idle {p['idle_ms']:.2f} ms" for r in records if (p := r.get("profile"))]
    return "\n".join(lines + [""] * bool(profiled) + profiled)


def compile_table(records: list) -> list[str]:
    """Where each impl's compile goes: JAX's lowering, XLA's compile, the same again with
    XLA's in-process caches warm (``--recompile``), and the compiled step's GEMMs."""
    rows = [r for r in records if "xla_compile_s" in r]
    if not rows:
        return []
    cell = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    lines = ["", "| impl | lower s | XLA compile s | again: lower s | again: XLA s | GEMMs | "
             "distinct GEMMs |", "|---" * 7 + "|"]
    lines += [f"| {r['impl']} | {cell(r, 'lower_s')} | {cell(r, 'xla_compile_s')} | "
              f"{cell(r, 'relower_s')} | {cell(r, 'rexla_compile_s')} | {r.get('gemms', '-')} | "
              f"{r.get('distinct_gemms', '-')} |" for r in rows]
    return lines


#: The step's goals: (what, impl, reference, field, ratio or difference, bound).
GOALS = (("compile time", "tidearray", "unsharded", "compile_s", "ratio", 1.5),
         ("step time", "tidearray-keep", "unsharded", "median_step_s", "ratio", 1.02),
         ("step time", "tidearray", "unsharded-remat", "median_step_s", "ratio", 1.05),
         ("host CPU per step", "tidearray", "unsharded", "median_cpu_s", "ms over", 2.0))


def targets(by: dict) -> list[str]:
    """Each goal this run's impls allow, measured (reported; the checks are training's)."""
    lines = []
    for what, impl, ref, key, kind, bound in GOALS:
        if impl in by and ref in by:
            a, b = by[impl][key], by[ref][key]
            if key == "compile_s" and len({by[k].get("xla_cache") for k in (impl, ref)}) > 1:
                lines.append(f"- {what}: {impl} against {ref}: not compared, one found XLA's "
                             "autotuning warm (a process per impl: run.sh's jaxcompile)")
                continue
            value = a / b if kind == "ratio" else (a - b) * 1e3
            shown = f"{value:.3f}x" if kind == "ratio" else f"{value:+.2f} ms"
            goal = f"{bound}x" if kind == "ratio" else f"{bound} ms"
            lines.append(f"- {what}: {impl} against {ref}: {shown} (goal at most {goal}: "
                         f"{'met' if value <= bound else 'NOT met'})")
    return ["", *lines] if lines else []


def checks(recs: list) -> list[str]:
    """What is wrong with the records, in words (empty: every impl trained, and alike with
    the reference: ``xla-fsdp``, else ``unsharded``)."""
    first = recs[0]
    want = {"dtype": first["dtype"], **first["config"]}
    out = [f"{r['argv']} ran with {k} {got[k]!r}, {first['argv']} with {v!r}: not the same run"
           for r in recs[1:] for got in [{**r["config"], **r}]
           for k, v in want.items() if got.get(k) != v]
    by = {r["impl"]: r for rec in recs for r in rec["runs"]}
    ref = "xla-fsdp" if "xla-fsdp" in by else "unsharded"
    group = [ref, *(k for k in by if k != ref)] if ref in by else []
    t = training.check(by, [group], LOSS_RTOL[want["dtype"]])
    print("\n".join(training.lines(t)))
    return out + training.failures(t)


def summarize(recs: list) -> int:
    """Print the table of these records and their checks; 1 where a check fails."""
    print("\n" + table([r for rec in recs for r in rec["runs"]]) + "\n")
    problems = checks(recs)
    for p in problems:
        print(f"FAIL: {p}")
    print("jax_step: " + ("FAILED" if problems else "OK: every impl trained, and alike"))
    return 1 if problems else 0


def report(paths: list) -> int:
    recs = []
    for path in paths:
        with open(path) as f:
            recs.append(json.load(f))
    return summarize(recs)


if __name__ == "__main__":
    main()
