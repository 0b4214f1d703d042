"""A JAX transformer's training step three ways, in one run: unsharded jit, ``tidearray.jax``
inside one jit, and the per-unit ``jax.vjp`` path outside jit.

    mpirun -n 1 python benchmarks/steps/jax_step.py --out OUT/jax        # mid-size, GPU
    mpiexec -n 1 python benchmarks/steps/jax_step.py --tiny             # the CPU check

``examples/jax_train.py``'s model, data and AdamW (``ShardAdamW``), at ``--layers``,
``--width`` and ``--seq`` (one sequence of ``--seq`` tokens per rank per step). Impls
(``--impls``, in this order, which is that of expected peak memory):

* ``tidearray``: ``ShardedUnits.apply`` per unit in the jitted step, parameters
  released after each unit's forward and gathered again for its backward (the unit's
  forward runs again: one more forward of compute);
* ``tidearray-scan``: ``tidearray`` with the blocks as one stacked unit, run by
  ``ShardedUnits.scan`` inside ``jax.lax.scan`` (one compiled block; the same
  collectives, per layer in the loop);
* ``tidearray-keep``: ``tidearray`` with ``reshard_after_forward=False`` (no second gather or
  forward; every unit's parameters live until its backward);
* ``tidearray-cb``: ``tidearray`` with ``command_buffer=True`` (XLA may record the
  callbacks' GPU work into its command buffers);
* ``per-unit``: ``benchmarks/baselines/jax_per_unit.py`` (the runtime's plans, one
  ``jax.vjp`` per unit, XLA's stream joined on the host at every unit);
* ``unsharded``: the whole model in one jitted step, fp32 masters, the same AdamW.

Per impl: the median step time (wall, the loss made concrete), the median host time
to issue a step (until the call returns) and the median host CPU time per step (every
thread of the process: XLA's callback threads included), JAX's device memory (the
peak, and XLA's own estimate of a jitted step's footprint), and on cuda the cost of the
copy out of the slot into XLA's buffer for the largest unit against its gather.
``--out DIR`` writes ``jax_step.json`` (with the git commit) and a table.

[Note: peak memory in one process]
JAX has no way to reset its peak counter, so the impls run in order of expected
footprint and each reports the peak reached by its end; a later impl that needs less
than an earlier one shows the earlier peak. ``xla_bytes`` (the compiled step's
arguments, outputs and temporaries, from ``memory_analysis``) does not have that
limit, for the jitted impls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import tidearray as ta  # noqa: E402
from benchmarks.harness.records import git_commit  # noqa: E402
from tests.support import example  # noqa: E402
from tidearray.fsdp import AdamW  # noqa: E402

ex = example("jax_train")

IMPLS = ("tidearray", "tidearray-scan", "tidearray-keep", "tidearray-cb", "per-unit", "unsharded")


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096, help="tokens per rank per step")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=12, help="timed steps per impl")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.vocab = 2, 32, 2, 16, 64
        args.steps, args.warmup = 3, 1
    return args


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    g = ta.init()
    jax = ex.setup_jax(g)
    cfg = ex.Config(vocab=args.vocab, width=args.width, heads=args.heads, layers=args.layers,
                    seq=args.seq, batch=1, steps=args.warmup + args.steps)
    log = print if g.rank == 0 else (lambda *a, **k: None)
    log(f"jax_step: {args.layers} layers, width {args.width}, {args.seq} tokens/rank, "
        f"{args.dtype}, {g.size} rank(s), backend {g.backend.name}")
    records, units = [], ex.init_units(cfg)  # made once: seconds at the mid size
    for impl in [i for i in IMPLS if i in args.impls.split(",")]:
        rec = run_impl(jax, g, cfg, args, impl, units)
        records.append(rec)
        log(f"[{impl}] step {rec['median_step_s'] * 1e3:.2f} ms, host issue "
            f"{rec['median_issue_s'] * 1e3:.3f} ms, host CPU {rec['median_cpu_s'] * 1e3:.2f} "
            f"ms, peak {rec['peak_bytes'] / 2**30:.2f} GiB, loss {rec['losses'][-1]:.4f}")
    table = summarize(records)
    log(table)
    if args.out and g.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        record = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "argv": sys.argv, "config": cfg.__dict__, "dtype": args.dtype,
                  "world": g.size, "backend": g.backend.name, "runs": records}
        with open(os.path.join(args.out, "jax_step.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "jax_step.md"), "w") as f:
            f.write(table + "\n")
        log(f"record: {os.path.join(args.out, 'jax_step.json')}")
    g.close()


def run_impl(jax: Any, g: ta.Group, cfg: Any, args: argparse.Namespace, impl: str,
             units: list) -> dict:
    """Warm-up and timed steps of one impl: its record."""
    step, device, extra = build(jax, g, cfg, args, impl, units)
    issue, cpu, wall, losses = [], [], [], []
    for s in range(cfg.steps):
        tokens, targets = (jax.device_put(a, device) for a in ex.batch(cfg, s, g.rank))
        g.comm.Barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = step(s, tokens, targets)
        t1 = time.perf_counter()
        losses.append(float(np.asarray(loss)))  # waits for the step
        t2, c1 = time.perf_counter(), time.process_time()
        if s < args.warmup and g.rank == 0:  # progress: the first includes XLA's compile
            print(f"[{impl}] warm-up step {s}: {t2 - t0:.2f} s", flush=True)
        if s >= args.warmup:
            issue.append(t1 - t0)
            wall.append(t2 - t0)
            cpu.append(c1 - c0)
    stats = device.memory_stats() or {}
    return {"impl": impl, "median_step_s": statistics.median(wall),
            "median_issue_s": statistics.median(issue), "median_cpu_s": statistics.median(cpu),
            "peak_bytes": stats.get("peak_bytes_in_use", 0), "losses": losses, **extra}


def build(jax: Any, g: ta.Group, cfg: Any, args: argparse.Namespace, impl: str,
          units: list) -> tuple[Callable, Any, dict]:
    """``(step(s, tokens, targets) -> loss, device, extra record fields)`` of one impl."""
    import tidearray.jax as tj

    fns, opt = ex.unit_fns(jax, cfg), tj.ShardAdamW(AdamW(lr=cfg.lr))
    dtype = jax.numpy.dtype(args.dtype)
    if impl == "per-unit":
        from benchmarks.baselines.jax_per_unit import PerUnitTrainer

        device = _device(jax, g)
        trainer = PerUnitTrainer(jax, g, units, fns,
                                 lambda h, y: ex.cross_entropy(jax, h, y), device,
                                 ta.bfloat16 if args.dtype == "bfloat16" else ta.float32,
                                 AdamW(lr=cfg.lr))
        extra: dict = {"copied_params": 0}

        def per_unit_step(s: int, x: Any, y: Any) -> float:
            loss = trainer.step(x, y)
            # parameters JAX could not take through DLPack (copied: slower than the path)
            extra["copied_params"] = trainer.bridge.copies
            return loss
        return per_unit_step, device, extra
    if impl == "unsharded":
        device = _device(jax, g)
        state = {"params": jax.device_put(units, device)}
        state["opt"] = opt.init(state["params"])
        jitted = jax.jit(whole_step(jax, fns, opt, dtype), donate_argnums=(0, 1))
    else:
        model, model_fns, stacked = ex.sharded_model(
            jax, dataclasses.replace(cfg, scan=impl == "tidearray-scan"), units)
        su = tj.shard_units(model, group=g, compute_dtype=dtype, stacked=stacked,
                            reshard_after_forward=impl != "tidearray-keep",
                            command_buffer=impl == "tidearray-cb")
        device, state = su.device, {"params": su.shards, "opt": opt.init(su.shards)}
        jitted = ex.sharded_step(jax, su, model_fns, opt)

    def step(s: int, tokens: Any, targets: Any) -> Any:
        coef = opt.coefficients(s + 1)
        if "xla_bytes" not in extra:
            extra["xla_bytes"] = _xla_bytes(jitted, state, coef, tokens, targets)
        state["params"], state["opt"], loss = jitted(state["params"], state["opt"], coef,
                                                     tokens, targets)
        return loss

    extra: dict = {}
    if impl == "tidearray" and g.backend.name == "cuda":
        extra["slot_copy"] = slot_copy_cost(g, su)
    return step, device, extra


def whole_step(jax: Any, fns: list, opt: Any, dtype: Any) -> Callable:
    """The unsharded step: the same model and AdamW on the full fp32 parameters."""
    def loss_fn(units: list, tokens: Any, targets: Any) -> Any:
        h = tokens
        for p, fn in zip(units, fns):
            h = fn(jax.tree_util.tree_map(lambda a: a.astype(dtype), p), h)
        return ex.cross_entropy(jax, h, targets)

    def step(units: list, state: Any, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(units, tokens, targets)
        return (*opt.update(units, grads, state, coef), loss)
    return step


def _device(jax: Any, g: ta.Group) -> Any:
    return jax.devices("gpu")[g.backend.device] if g.backend.name == "cuda" else jax.devices()[0]


def _xla_bytes(jitted: Any, state: dict, *rest: Any) -> Optional[int]:
    """XLA's footprint of the compiled step (arguments + outputs + temporaries - aliased)."""
    try:
        m = jitted.lower(state["params"], state["opt"], *rest).compile().memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None


def slot_copy_cost(g: ta.Group, su: Any, reps: int = 20) -> dict:
    """The copy a gather adds on cuda (slot -> XLA's buffer) for the largest unit, against
    the gather itself, both timed with CUDA events on one stream."""
    import cupy

    from tidearray.jax._buffers import XlaBuffers

    unit = max(su._units, key=lambda u: u.unit.nbytes)
    shards = [cupy.ones(s, unit.unit.dtype) for s in unit.unit.shard_shapes]
    outs = [cupy.empty(s, unit.unit.dtype) for s in unit.shapes]
    xb, stream = XlaBuffers(g.backend), cupy.cuda.Stream(non_blocking=True)

    def timed(fn: Callable) -> float:
        fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps

    def gather() -> Any:
        return ta.all_gather(shards, unit.shapes, group=g, slot=su.slot, stream=stream.ptr)

    params = gather()
    copy_us = timed(lambda: xb.copy(outs, params, stream.ptr))
    gather_us = timed(gather)
    return {"unit_bytes": unit.unit.nbytes, "copy_us": copy_us, "gather_us": gather_us,
            "gathers_per_step": 2 * len(su._units)}


def summarize(records: list) -> str:
    """The table of a run (markdown)."""
    base = next((r for r in records if r["impl"] == "unsharded"), None)
    lines = ["| impl | step ms | vs unsharded | host issue ms | host CPU ms | peak GiB | "
             "XLA GiB | last loss |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = f"{r['median_step_s'] / base['median_step_s']:.3f}x" if base else "-"
        xla = r.get("xla_bytes")
        lines.append(f"| {r['impl']} | {r['median_step_s'] * 1e3:.2f} | {ratio} | "
                     f"{r['median_issue_s'] * 1e3:.3f} | {r['median_cpu_s'] * 1e3:.2f} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | "
                     f"{'-' if xla is None else f'{xla / 2**30:.2f}'} | "
                     f"{r['losses'][-1]:.4f} |")
    for r in records:
        c = r.get("slot_copy")
        if c:
            lines.append(f"\n{r['impl']}: slot -> XLA copy of the largest unit "
                         f"({c['unit_bytes'] / 2**20:.1f} MiB) {c['copy_us']:.1f} us against "
                         f"its gather {c['gather_us']:.1f} us; {c['gathers_per_step']} "
                         f"gathers a step")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
