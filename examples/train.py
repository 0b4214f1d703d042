"""Train a Llama-style decoder with tidearray's FSDP runtime.

    mpirun -n 2 python examples/train.py                      # tiny model, default backend
    mpirun -n 2 python examples/train.py --model llama3-8b-8l --tokens 8192 --impl all

Each rank trains on its own ``--tokens`` per step (data parallel); the model's
units are sharded over the ranks by ``tidearray.fsdp.ShardedModel``. The
model (``llama.py``, next to this file) has a hand-written backward and runs on
the backend's array module: CuPy on the cuda backend, NumPy on host.

``--impl`` picks the communication under the same trainer: ``tide`` (TIDE
plans), ``stock`` (FSDP2's flat path: fused copy-in/out + flat all-gather,
fused fp32 pack + flat fp32 reduce-scatter; NCCL on cuda), ``local`` (the
no-communication floor: the whole model on each rank, the same per-rank work),
or ``all`` (the three in turn, in one run, then a comparison). ``--out DIR``
writes the run's JSON record (with the git commit), a table and plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import zlib
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama  # noqa: E402

import tidearray as ta  # noqa: E402
from tidearray.bench.records import git_commit  # noqa: E402
from tidearray.fsdp import AdamW, ShardedModel  # noqa: E402


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(llama.MODELS))
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank per step (default: 4 sequences)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (model default)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation: micro-batches of --tokens per step")
    p.add_argument("--impl", default="tide", choices=["tide", "stock", "local", "all"])
    p.add_argument("--param-dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: bfloat16 on cuda, float32 on host")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 3e-3, or 3e-4 for models of hidden >= 1024)")
    p.add_argument("--lr-warmup", type=int, default=0,
                   help="steps of linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=None, help="global grad-norm clip")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--keep-param-shards", action="store_true",
                   help="tide: gather from param-dtype shards the optimizer keeps, no casts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--save", default=None, help="save a sharded checkpoint here at the end")
    p.add_argument("--resume", default=None, help="load a sharded checkpoint first")
    p.add_argument("--export", default=None, help="write the full fp32 model (.npz) at the end")
    p.add_argument("--out", default=None, help="directory for the record, table and plots")
    p.add_argument("--profile", action="store_true",
                   help="profile one tide step with CUPTI (torch.profiler) into --out")
    p.add_argument("--backend", default=None, help="tidearray backend (default: auto)")
    p.add_argument("--report", default=None, metavar="TRAIN_JSON",
                   help="only rebuild the table and plot next to this record, then exit")
    return p.parse_args(argv)


class Log:
    """Prints on rank 0 only, flushed (progress lines under mpirun)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, *args: Any) -> None:
        if self.rank == 0:
            print(*args, flush=True)


def device_init(xp: Any, seed: int, cfg: llama.ModelConfig) -> Any:
    """``init(name, shape)`` drawing on the device: the 8B shapes would take a minute in
    NumPy. Deterministic per (seed, name), so every rank and implementation agrees."""
    out_scale = 1.0 / math.sqrt(2 * cfg.layers)

    def init(name: str, shape: tuple) -> Any:
        if name.endswith("norm"):
            return xp.ones(shape, np.float32)
        std = 0.02 * (out_scale if name.rsplit(".", 1)[-1] in ("wo", "w_down") else 1.0)
        rng = xp.random.RandomState(seed * 7919 + zlib.crc32(name.encode()))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    return init


def build(args: argparse.Namespace, g: Any, kind: str, cfg: llama.ModelConfig,
          stream: Any) -> ShardedModel:
    specs = llama.unit_specs(cfg)
    named = [[(f"{u}.{name}", shape) for name, shape in unit] for u, unit in enumerate(specs)]
    opt = AdamW(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.clip)
    common = dict(group=g, param_dtype=args.param_dtype, optimizer=opt, prefetch=args.prefetch,
                  comm=kind, stream=stream, keep_param_shards=args.keep_param_shards)
    if g.backend.name == "cuda":
        return ShardedModel(named, init=device_init(g.backend.xp, args.seed, cfg), **common)
    full = llama.init_params(cfg, args.seed)
    units = [[(n, a) for (n, _), a in zip(names, arrays)] for names, arrays in zip(named, full)]
    return ShardedModel(units, **common)


def train_step(sm: ShardedModel, net: llama.Llama, tokens: Any, targets: Any) -> Any:
    """One micro-batch's forward and backward through the runtime's hooks; the loss."""
    n = sm.num_units
    saved, x = [], tokens
    for i in range(n):
        params = sm.pre_forward(i)
        x, s = net.forward(i, params, (x, targets) if i == n - 1 else x)
        saved.append(s)
        sm.post_forward(i)
    loss, dx = x, 1.0
    for i in reversed(range(n)):
        params, grads = sm.pre_backward(i)
        dx, _ = net.backward(i, params, saved[i], dx, grads_out=grads)
        saved[i] = None
        sm.post_backward(i)
    return loss


class Memory:
    """Peak device bytes in use (sampled after each step; the pool keeps what a step
    allocated, so the sample holds the step's peak), or host RSS on the host backend."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.base = self.used()
        self.peak = 0

    def used(self) -> int:
        if self.xp is np:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        free, total = self.xp.cuda.runtime.memGetInfo()
        return total - free

    def sample(self) -> None:
        self.peak = max(self.peak, self.used() - self.base)


def run(args: argparse.Namespace, g: Any, kind: str, cfg: llama.ModelConfig, B: int,
        log: Log) -> dict:
    xp = g.backend.xp
    stream = xp.cuda.Stream(non_blocking=True) if xp is not np else None
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    mem = Memory(xp)
    sm = build(args, g, kind, cfg, stream)
    net = llama.Llama(cfg, xp)
    rank = g.rank
    if args.resume:
        sm.load(args.resume)
    first = sm.optimizer.step_count
    data = [[llama.batch(cfg, step=first + s, batch_size=B, seed=args.seed,
                         first_sample=(rank * args.micro_batches + m) * B)
             for m in range(args.micro_batches)] for s in range(args.steps)]
    losses, times = [], []
    sync(xp)
    for s in range(args.steps):
        t0 = time.perf_counter()
        dev_losses = []
        with stream or contextlib.nullcontext():
            for tokens, targets in data[s]:
                dev_losses.append(train_step(sm, net, xp.asarray(tokens), xp.asarray(targets)))
            sm.step(lr=learning_rate(args, first + s))
        sync(xp)
        dt = time.perf_counter() - t0
        mem.sample()
        local = float(sum(float(v) for v in dev_losses) / len(dev_losses))
        loss = g.comm.allreduce(local) / g.size
        losses.append(loss)
        times.append(dt)
        tok = B * cfg.seq * args.micro_batches
        log(f"[{kind}] step {first + s + 1:4d}  loss {loss:.6f}  {dt * 1e3:9.2f} ms  "
            f"{tok / dt:12,.0f} tok/s/rank  mem {mem.peak / 2**30:6.2f} GiB")
    if args.save:
        sm.save(args.save)
    if args.export:
        sm.export(args.export)
    prof = None
    if args.profile and args.out:
        prof = profile_step(args, g, kind, sm, net, data[-1], stream, log)
    steady = times[args.warmup:] or times
    rec = {"impl": kind, "losses": losses, "step_s": times,
           "median_step_s": float(np.median(steady)), "peak_bytes": mem.peak,
           "comm_bytes": sm.comm.nbytes, "arena_bytes": sm.arena.nbytes, "profile": prof}
    sm.close()
    del sm
    return rec


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up over ``--lr-warmup`` steps, then constant."""
    if args.lr_warmup and step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    return args.lr


def sync(xp: Any) -> None:
    """Wait for the device (the step's end; the loss is read after it)."""
    if xp is not np:
        xp.cuda.Device().synchronize()


def profile_step(args: argparse.Namespace, g: Any, kind: str, sm: ShardedModel,
                 net: llama.Llama, batches: list, stream: Any, log: Log) -> Optional[dict]:
    """One more step under CUPTI: its events, a timeline PNG and the device time per
    role (compute, accumulate, NCCL, layout conversion, copies) go to --out."""
    from tidearray.bench import cupti, timeline

    xp = g.backend.xp

    def step() -> None:
        with stream or contextlib.nullcontext():
            for tokens, targets in batches:
                train_step(sm, net, xp.asarray(tokens), xp.asarray(targets))
            sm.step()
        sync(xp)

    events = cupti.trace(step)
    if events is None:
        log(f"profile: skipped ({cupti.available()[1]})")
        return None
    roles = {r: us / 1e3 for r, us in timeline.roles(events).items()}
    kernels = {k: v for k, v in cupti.by_name(events).items() if not k.startswith("kernel: ")
               or timeline.role({"cat": "kernel", "name": k}) != "compute"}
    if g.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        cupti.save(events, os.path.join(args.out, f"{kind}_step_trace.json"))
        log(f"[{kind}] profiled step: device ms per role {roles}")
        log(cupti.summary(events, top=15))
    return {"ms_per_role": roles, "non_compute_events": kernels}


def summarize(records: list, log: Log) -> dict:
    """Print the comparison of a ``--impl all`` run; return it for the record."""
    floor = next((r["median_step_s"] for r in records if r["impl"] == "local"), None)
    log("\nsummary (median step time after warm-up; peak memory per rank)")
    log(f"{'impl':8s} {'step ms':>10s} {'vs local':>9s} {'peak GiB':>9s} {'last loss':>12s}")
    for r in records:
        ratio = f"{r['median_step_s'] / floor:.3f}x" if floor else "-"
        log(f"{r['impl']:8s} {r['median_step_s'] * 1e3:10.2f} {ratio:>9s} "
            f"{r['peak_bytes'] / 2**30:9.2f} {r['losses'][-1]:12.6f}")
    for r in records:
        log(f"{r['impl']}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} over "
            f"{len(r['losses'])} steps")
    rows = goals(records)
    for g in rows:
        log(f"{'met   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']}")
    return {"goals": rows}


def goals(records: list) -> list[dict]:
    """The step-time, memory and loss goals of a tide/stock/local run, from its records."""
    by = {r["impl"]: r for r in records}
    if not {"tide", "stock"} <= set(by):
        return []
    out = []
    a, b = by["tide"]["losses"], by["stock"]["losses"]
    diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    out.append({"goal": f"tide and stock losses equal for {len(a)} steps",
                "measured": "bitwise equal" if a == b else f"max relative difference {diff:.3g}",
                "met": a == b or diff < 1e-2})
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


def report(path: str) -> str:
    """``train.md`` (a table) and ``train_steps.png`` (step times and losses) next to the
    record ``path``, made from the record alone. Returns the table's path."""
    with open(path) as f:
        rec = json.load(f)
    out = os.path.dirname(os.path.abspath(path))
    runs = rec["runs"]
    floor = next((r["median_step_s"] for r in runs if r["impl"] == "local"), None)
    lines = [f"# Training step: {rec['model']}, {rec['tokens_per_rank']} tokens per rank, "
             f"{rec['world']} ranks ({rec['backend']}, {rec['param_dtype']})", "",
             f"Commit `{rec['commit']}`; command `{' '.join(rec['argv'])}`; "
             f"{len(runs[0]['losses'])} steps, medians after the warm-up steps.", "",
             "| impl | median step (ms) | vs floor | peak memory (GiB) | first loss | last loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        ratio = f"{r['median_step_s'] / floor:.3f}" if floor else "-"
        lines.append(f"| {r['impl']} | {r['median_step_s'] * 1e3:.2f} | {ratio} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | {r['losses'][0]:.4f} | "
                     f"{r['losses'][-1]:.4f} |")
    lines += ["", "| goal | measured | |", "| --- | --- | --- |"]
    lines += [f"| {g['goal']} | {g['measured']} | {'met' if g['met'] else 'missed'} |"
              for g in goals(runs)]
    table = os.path.join(out, "train.md")
    with open(table, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot_steps(runs, os.path.join(out, "train_steps.png"), rec["model"])
        plot_timelines(rec, out)
    except ImportError:
        pass  # matplotlib is the optional 'bench' extra
    return table


def plot_timelines(rec: dict, out: str) -> None:
    """A timeline PNG per saved CUPTI trace next to the record (``<impl>_step_trace.json``,
    gzipped or not)."""
    from tidearray.bench import timeline

    for r in rec["runs"]:
        for name in (f"{r['impl']}_step_trace.json", f"{r['impl']}_step_trace.json.gz"):
            path = os.path.join(out, name)
            if os.path.exists(path):
                timeline.plot(timeline.load(path),
                              os.path.join(out, f"{r['impl']}_step_timeline.png"),
                              f"{r['impl']}: one training step, rank 0 ({rec['model']}, "
                              f"{rec['world']} ranks)")


def plot_steps(runs: list, path: str, model: str) -> None:
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


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    if args.report:
        print(report(args.report))
        return
    g = ta.init(backend=args.backend)
    log = Log(g.rank)
    cfg = llama.MODELS[args.model]
    if args.seq:
        cfg = llama.ModelConfig(**{**cfg.__dict__, "seq": args.seq})
    tokens = args.tokens or 4 * cfg.seq
    if tokens % cfg.seq:
        raise SystemExit(f"--tokens: expected a multiple of the sequence length {cfg.seq}, "
                         f"got {tokens}")
    B = tokens // cfg.seq
    if args.lr is None:
        args.lr = 3e-4 if cfg.hidden >= 1024 else 3e-3
    args.param_dtype = args.param_dtype or ("bfloat16" if g.backend.name == "cuda" else
                                            "float32")
    impls = ["tide", "stock", "local"] if args.impl == "all" else [args.impl]
    log(f"train: {args.model} ({cfg.layers} layers, hidden {cfg.hidden}), {tokens} tokens/rank "
        f"x {args.micro_batches} micro-batches, {g.size} ranks, backend {g.backend.name}, "
        f"{args.param_dtype}, impls {impls}")
    records = [run(args, g, kind, cfg, B, log) for kind in impls]
    comparison = summarize(records, log)
    if args.out and g.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        record = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "argv": sys.argv, "model": args.model, "config": cfg.__dict__,
                  "tokens_per_rank": tokens, "world": g.size, "backend": g.backend.name,
                  "param_dtype": args.param_dtype, "runs": records, "comparison": comparison}
        path = os.path.join(args.out, "train.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        log(f"record: {path}; table and plot: {report(path)}")
    g.close()


def run_as_group(main: Any) -> None:
    """Run ``main``; on an error, abort every rank (as ``python -m mpi4py`` does), so a
    failed rank never leaves its peers waiting in a collective."""
    try:
        main()
    except BaseException as e:
        from mpi4py import MPI

        if MPI.COMM_WORLD.size > 1 and not isinstance(e, SystemExit):
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        raise


if __name__ == "__main__":
    run_as_group(main)
