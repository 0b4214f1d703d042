"""JAX FSDP two ways, side by side: XLA's own sharding over a mesh, and ``tidearray.jax``.

One launch per impl, each writing ``DIR/<impl>.json``; ``--report DIR`` reads them:

    # CPU, the correctness check (two CPU devices, two ranks on the host backend)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python benchmarks/steps/jax_fsdp.py --impl xla-fsdp --quick --dtype float32 --out D
    mpiexec -n 2 python benchmarks/steps/jax_fsdp.py --impl tidearray --quick \\
        --dtype float32 --out D
    python benchmarks/steps/jax_fsdp.py --impl unsharded --quick --dtype float32 --out D
    python benchmarks/steps/jax_fsdp.py --report D

    # nvidia-h200-x2: xla-fsdp one process over both GPUs, tidearray one process per GPU,
    # unsharded on one GPU (the floor: the global batch, no communication)
    python benchmarks/steps/jax_fsdp.py --impl xla-fsdp --out D
    mpirun -n 2 -x TIDE_JAX_CUDA=1 python benchmarks/steps/jax_fsdp.py --impl tidearray --out D
    CUDA_VISIBLE_DEVICES=0 python benchmarks/steps/jax_fsdp.py --impl unsharded --out D
    python benchmarks/steps/jax_fsdp.py --report D

The model, data and loss are ``examples/jax_train.py``'s (8 layers, width 2048, 4096
tokens per device, bf16 compute over fp32 masters by default; ``--quick``: 2 layers,
width 64, 32 tokens), the blocks stacked under ``lax.scan`` (``--unrolled``: a Python
loop) in every impl. Every impl trains on the same global batch (one sequence per
device), with the same AdamW (no clipping) and learning rate, warmed up linearly over
the untimed ``--warmup`` steps. Impls:

* ``xla-fsdp``: one process over every local device, a 1-D mesh axis ``fsdp``; the fp32
  parameters and AdamW's moments sharded on (each layer's) dim 0 with
  ``NamedSharding(mesh, P('fsdp'))``, replicated where that dim does not divide; the
  batch sharded on the same axis; one ``jax.jit`` step, the collectives XLA inserts
  (all-gathers; on CPU it reduces with all-reduces). Its AdamW is written here in
  ``jax.numpy`` (``ShardAdamW``'s math: optax is not needed).
* ``tidearray``: one process per device (mpiexec), ``shard_units`` + ``ShardAdamW``;
  each unit re-gathered and recomputed in backward (``reshard_after_forward``), where
  xla-fsdp keeps what XLA chooses to keep (no ``jax.checkpoint``): the memory and step
  ratios include that trade.
* ``unsharded``: one process, one device, the whole global batch (``--world`` devices'
  samples), ``ShardAdamW``.

Per impl: the median step time after warm-up (wall, until the loss is read), the compile
time of the first step, the peak memory per device (``memory_stats``; None on CPU) and
the host CPU time per step (process time, XLA's threads included: xla-fsdp's one process
drives every device; tidearray's is the mean of its ranks'). The report shows
tidearray / xla-fsdp ratios and fails unless every loss fell (the last step re-runs the
first step's batch and must score lower) and the impls agree step by step (relative:
1e-4 in float32, 3e-2 in bfloat16). On GPUs JAX runs at XLA's default flags: never time
with ``--xla_gpu_autotune_level=0`` (it picks slow kernels).
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

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a true peak per impl

import numpy as np  # noqa: E402

from benchmarks.harness.records import git_commit  # noqa: E402
from tests.support import example  # noqa: E402
from tidearray.fsdp import AdamW  # noqa: E402

ex = example("jax_train")

IMPLS = ("xla-fsdp", "tidearray", "unsharded")
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("--report", metavar="DIR", help="compare the records in DIR")
    p.add_argument("--out", default=None, help="write DIR/<impl>.json")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096, help="tokens per device per step")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(LOSS_RTOL))
    p.add_argument("--lr", type=float, default=None, help="3e-4 (3e-3 with --quick)")
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the lr's warm-up)")
    p.add_argument("--world", type=int, default=2,
                   help="unsharded: devices whose batches make the global batch")
    p.add_argument("--unrolled", action="store_true", help="the blocks in a Python loop")
    p.add_argument("--quick", action="store_true", help="a tiny model (the CPU check)")
    args = p.parse_args(argv)
    if (args.impl is None) == (args.report is None):
        p.error("expected one of --impl or --report")
    if args.quick:
        args.layers, args.width, args.heads, args.seq, args.vocab = 2, 64, 2, 32, 64
        args.steps, args.warmup = 6, 2
    args.lr = args.lr or (3e-3 if args.quick else 3e-4)
    return args


def config(args: argparse.Namespace) -> Any:
    return ex.Config(vocab=args.vocab, width=args.width, heads=args.heads, layers=args.layers,
                     seq=args.seq, batch=1, steps=args.warmup + args.steps, lr=args.lr,
                     scan=not args.unrolled, max_grad_norm=None)


def learning_rate(args: argparse.Namespace, s: int) -> float:
    """Linear warm-up over the untimed steps, then constant (examples/train.py's rule)."""
    return args.lr * (s + 1) / args.warmup if s < args.warmup else args.lr


def data_step(cfg: Any, s: int) -> int:
    """The batch of step ``s``: the last step re-runs the first's, so its loss must be lower
    (other batches' losses differ by more than a few steps of training change them)."""
    return 0 if s == cfg.steps - 1 else s


def global_batch(cfg: Any, s: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every device's samples of step ``s``, in rank order (what tidearray's ranks see)."""
    parts = [ex.batch(cfg, data_step(cfg, s), r) for r in range(world)]
    return np.concatenate([t for t, _ in parts]), np.concatenate([y for _, y in parts])


# --- AdamW in plain jax.numpy (xla-fsdp): ShardAdamW's math, coefficients on the host ---

def adamw_coefficients(hp: AdamW, step: int, lr: float) -> np.ndarray:
    """ShardAdamW's float32 scalars of step ``step`` (1-based): float64 on the host, rounded
    once (decay, beta1, 1-beta1, beta2, 1-beta2, eps, step size, sqrt(bias2), grad scale)."""
    b1, b2 = hp.betas
    return np.array([1.0 - lr * hp.weight_decay, b1, 1.0 - b1, b2, 1.0 - b2, hp.eps,
                     lr / (1.0 - b1**step), np.sqrt(1.0 - b2**step), 1.0], np.float32)


def adamw_update(jax: Any, params: Any, grads: Any, state: tuple, c: Any) -> tuple:
    """``(params, (m, v))`` after one AdamW step; ``c``: :func:`adamw_coefficients`."""
    tm, jnp = jax.tree_util.tree_map, jax.numpy

    def one(p: Any, g: Any, m: Any, v: Any) -> tuple:
        g = g * c[8]
        m, v = c[1] * m + c[2] * g, c[3] * v + c[4] * (g * g)
        return p * c[0] - c[6] * (m / (jnp.sqrt(v) / c[7] + c[5])), m, v

    out = tm(one, params, grads, *state)
    pick = [tm(lambda t, k=k: t[k], out, is_leaf=lambda t: isinstance(t, tuple))
            for k in range(3)]
    return pick[0], (pick[1], pick[2])


# --- the whole model (unsharded, xla-fsdp): the example's units, scanned or not ---

def whole_loss(jax: Any, cfg: Any, dtype: Any) -> Callable:
    """``loss(model, tokens, targets)`` on full parameters cast to ``dtype`` (fp32 masters)."""
    fns = ex.unit_fns(jax, cfg)

    def loss(model: list, tokens: Any, targets: Any) -> Any:
        model = jax.tree_util.tree_map(lambda a: a.astype(dtype), model)
        h = fns[0](model[0], tokens)
        if cfg.scan:  # model[1]: the blocks stacked on a leading layer axis
            h = jax.lax.scan(lambda x, p: (fns[1](p, x), None), h, model[1])[0]
        else:
            for p, fn in zip(model[1:-1], fns[1:-1]):
                h = fn(p, h)
        return ex.cross_entropy(jax, fns[-1](model[-1], h), targets)
    return loss


def fsdp_spec(jax: Any, shape: tuple, stacked: bool, n: int) -> Any:
    """``P('fsdp')`` on (each layer's) dim 0 where it divides by ``n``, else replicated."""
    P = jax.sharding.PartitionSpec
    dim = 1 if stacked else 0
    if len(shape) <= dim or shape[dim] % n:
        return P()
    return P(*([None] * dim), "fsdp")


def build_xla_fsdp(jax: Any, cfg: Any, args: argparse.Namespace) -> tuple:
    """``(step(s) -> loss, devices, world)``: one jit over a 1-D mesh of every local device."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    model, _, stacked = ex.sharded_model(jax, cfg)
    shardings = [jax.tree_util.tree_map(
        lambda a, st=i in stacked: named(fsdp_spec(jax, a.shape, st, len(devices))), unit)
        for i, unit in enumerate(model)]
    params = jax.device_put(model, shardings)
    zeros = lambda: jax.device_put(jax.tree_util.tree_map(np.zeros_like, model), shardings)  # noqa: E731
    state = (zeros(), zeros())  # AdamW's moments, sharded as the parameters
    loss_fn, hp = whole_loss(jax, cfg, jax.numpy.dtype(args.dtype)), AdamW(lr=args.lr)
    replicated, batch_sharding = named(jax.sharding.PartitionSpec()), named(
        jax.sharding.PartitionSpec("fsdp"))

    def step(params: list, state: tuple, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        return (*adamw_update(jax, params, grads, state, coef), loss)

    # the outputs keep the inputs' shardings: the parameters stay sharded between steps
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     out_shardings=(shardings, (shardings, shardings), replicated))
    box = {"params": params, "state": state}

    def run(s: int, compile_only: bool = False) -> Any:
        coef = jax.device_put(adamw_coefficients(hp, s + 1, learning_rate(args, s)), replicated)
        batch = jax.device_put(global_batch(cfg, s, len(devices)), batch_sharding)
        if compile_only:  # the steps run this executable: one compile, timed alone
            box["step"] = jitted.lower(box["params"], box["state"], coef, *batch).compile()
            return None
        box["params"], box["state"], loss = box["step"](box["params"], box["state"], coef,
                                                        *batch)
        return loss
    return run, devices, len(devices)


def build_unsharded(jax: Any, cfg: Any, args: argparse.Namespace) -> tuple:
    """``(step(s) -> loss, devices, world)``: the whole model on one device, the global batch."""
    import tidearray.jax as tj

    device = jax.devices()[0]
    model, _, _ = ex.sharded_model(jax, cfg)
    opt, loss_fn = tj.ShardAdamW(AdamW(lr=args.lr)), whole_loss(jax, cfg,
                                                                   jax.numpy.dtype(args.dtype))

    def step(params: list, state: Any, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        return (*opt.update(params, grads, state, coef), loss)

    jitted = jax.jit(step, donate_argnums=(0, 1))
    box = {"params": jax.device_put(model, device)}
    box["state"] = opt.init(box["params"])

    def run(s: int, compile_only: bool = False) -> Any:
        coef = opt.coefficients(s + 1, learning_rate(args, s))
        batch = jax.device_put(global_batch(cfg, s, args.world), device)
        if compile_only:  # the steps run this executable: one compile, timed alone
            box["step"] = jitted.lower(box["params"], box["state"], coef, *batch).compile()
            return None
        box["params"], box["state"], loss = box["step"](box["params"], box["state"], coef,
                                                        *batch)
        return loss
    return run, [device], args.world


def build_tidearray(jax: Any, g: Any, cfg: Any, args: argparse.Namespace) -> tuple:
    """``(step(s) -> loss, devices, world)``: this rank's shards, the example's jitted step."""
    import tidearray.jax as tj

    model, fns, stacked = ex.sharded_model(jax, cfg)
    su = tj.shard_units(model, group=g, compute_dtype=jax.numpy.dtype(args.dtype),
                        stacked=stacked)
    opt = tj.ShardAdamW(AdamW(lr=args.lr), group=g)
    jitted = ex.sharded_step(jax, su, fns, opt)
    box = {"params": su.shards, "state": opt.init(su.shards)}

    def run(s: int, compile_only: bool = False) -> Any:
        coef = opt.coefficients(s + 1, learning_rate(args, s))
        batch = [jax.device_put(a, su.device) for a in ex.batch(cfg, data_step(cfg, s), g.rank)]
        if compile_only:  # the steps run this executable: one compile, timed alone
            box["step"] = jitted.lower(box["params"], box["state"], coef, *batch).compile()
            return None
        box["params"], box["state"], loss = box["step"](box["params"], box["state"], coef,
                                                        *batch)
        return loss
    return run, [su.device], g.size


def train(jax: Any, run: Callable, cfg: Any, args: argparse.Namespace, comm: Any) -> dict:
    """Compile, then every step, timed; ``comm`` (tidearray's) averages the ranks' losses."""
    say = print if comm is None or comm.rank == 0 else (lambda *a, **k: None)
    t0 = time.perf_counter()
    run(0, compile_only=True)  # ahead of the steps: the compile alone, on the first batch
    compile_s = time.perf_counter() - t0
    say(f"[{args.impl}] compiled the step in {compile_s:.2f} s", flush=True)
    wall, cpu, losses = [], [], []
    for s in range(cfg.steps):
        if comm is not None:
            comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = float(run(s))  # waits for the step
        t1, c1 = time.perf_counter(), time.process_time()
        losses.append(loss if comm is None else comm.allreduce(loss) / comm.size)
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        tag = "warm-up" if s < args.warmup else "timed"
        say(f"[{args.impl}] step {s + 1:3d}/{cfg.steps} ({tag})  loss {losses[-1]:.6f}  "
            f"{(t1 - t0) * 1e3:.2f} ms", flush=True)
    w = args.warmup
    return {"compile_s": compile_s, "step_s": wall, "median_step_s": statistics.median(wall[w:]),
            "median_cpu_s": statistics.median(cpu[w:]), "losses": losses}


def peak_bytes(devices: list) -> Optional[int]:
    """The largest ``peak_bytes_in_use`` of these devices (None where JAX reports none)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    return max((p for p in peaks if p is not None), default=None)


def run_impl(args: argparse.Namespace) -> None:
    cfg, g, comm = config(args), None, None
    if args.impl == "tidearray":
        import tidearray as ta

        g = ta.init()
        comm, jax = g.comm, ex.setup_jax(g)
    else:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")  # as setup_jax: no TF32
    build = {"xla-fsdp": build_xla_fsdp, "unsharded": build_unsharded}.get(args.impl)
    run, devices, world = (build_tidearray(jax, g, cfg, args) if g is not None
                           else build(jax, cfg, args))
    rank0 = comm is None or comm.rank == 0
    if rank0:
        print(f"jax_fsdp: {args.impl}, {cfg.layers} layers ({'scan' if cfg.scan else 'unrolled'})"
              f", width {cfg.width}, {cfg.seq} tokens/device, {args.dtype}, world {world}, "
              f"devices {[str(d) for d in devices]}", flush=True)
    rec = train(jax, run, cfg, args, comm)
    peak = peak_bytes(devices)
    if comm is not None:  # one device per rank: the largest of them
        peaks = [p for p in comm.allgather(peak) if p is not None]
        peak = max(peaks) if peaks else None
        rec["median_cpu_s"] = comm.allreduce(rec["median_cpu_s"]) / comm.size
    rec.update(impl=args.impl, world=world, dtype=args.dtype, peak_bytes=peak,
               config=dataclasses.asdict(cfg), platform=devices[0].platform,
               commit=git_commit(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), argv=sys.argv)
    if rank0:
        mem = "-" if peak is None else f"{peak / 2**30:.2f} GiB"
        print(f"[{args.impl}] median step {rec['median_step_s'] * 1e3:.2f} ms, compile "
              f"{rec['compile_s']:.2f} s, host CPU {rec['median_cpu_s'] * 1e3:.2f} ms/step, "
              f"peak {mem}/device, loss {rec['losses'][0]:.4f} -> {rec['losses'][-1]:.4f}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"{args.impl}.json")
            with open(path, "w") as f:
                json.dump(rec, f, indent=1)
            print(f"record: {path}")
    if g is not None:
        g.close()


def checks(records: dict) -> list[str]:
    """What is wrong with the records, in words (empty: every impl trained, and alike)."""
    ref = "unsharded" if "unsharded" in records else next(iter(records))
    want = {"dtype": records[ref]["dtype"], "world": records[ref]["world"],
            **records[ref]["config"]}
    out = [f"{k} ran with {key} {got[key]!r}, {ref} with {v!r}: not the same run"
           for k, r in records.items() for got in [{**r["config"], **r}]
           for key, v in want.items() if got.get(key) != v]
    out += [f"{k}'s loss did not fall ({r['losses'][0]:.6f} at the first step, "
            f"{r['losses'][-1]:.6f} at the last, on the same batch)"
            for k, r in records.items() if not r["losses"][-1] < r["losses"][0]]
    rtol = LOSS_RTOL[want["dtype"]]
    for k, r in records.items():
        a, b = np.array(records[ref]["losses"]), np.array(r["losses"])
        if k == ref or a.shape != b.shape:
            out += [] if k == ref else [f"{k}: {b.size} steps, {ref}: {a.size}"]
            continue
        rel = np.abs(a - b) / np.abs(a)
        print(f"{k} vs {ref}: largest relative loss difference {rel.max():.2e} (step "
              f"{int(rel.argmax()) + 1}), tolerance {rtol:g}")
        if not rel.max() <= rtol:
            out.append(f"{k} and {ref} losses differ by {rel.max():.2e} at step "
                       f"{int(rel.argmax()) + 1} (> {rtol:g})")
    return out


def report(folder: str) -> int:
    """Print the side-by-side table of ``folder``'s records and check them; the exit code."""
    records = {}
    for impl in IMPLS:
        path = os.path.join(folder, f"{impl}.json")
        if os.path.exists(path):
            with open(path) as f:
                records[impl] = json.load(f)
    if not records:
        print(f"jax_fsdp: no records in {folder}")
        return 1
    xla = records.get("xla-fsdp")
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    lines = ["| impl | world | step ms | vs xla-fsdp | compile s | host CPU ms | "
             "peak GiB/device | vs xla-fsdp | first loss | last loss |", "|" + "---|" * 10]
    for k, r in records.items():
        t = f"{r['median_step_s'] / xla['median_step_s']:.3f}x" if xla else "-"
        m = (f"{r['peak_bytes'] / xla['peak_bytes']:.3f}x"
             if xla and r["peak_bytes"] and xla["peak_bytes"] else "-")
        lines.append(f"| {k} | {r['world']} | {r['median_step_s'] * 1e3:.2f} | {t} | "
                     f"{r['compile_s']:.2f} | {r['median_cpu_s'] * 1e3:.2f} | "
                     f"{gib(r['peak_bytes'])} | {m} | {r['losses'][0]:.6f} | "
                     f"{r['losses'][-1]:.6f} |")
    first = next(iter(records.values()))
    c = first["config"]
    print(f"jax_fsdp report: {c['layers']} layers, width {c['width']}, {c['seq']} tokens/device, "
          f"{first['dtype']}, {first['platform']}, world {first['world']}\n")
    print("\n".join(lines) + "\n")
    problems = checks(records)
    for p in problems:
        print(f"FAIL: {p}")
    print("jax_fsdp: " + ("FAILED" if problems else
                          f"OK: {len(records)} impls trained and agree ({', '.join(records)})"))
    return 1 if problems else 0


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    if args.report:
        sys.exit(report(args.report))
    run_impl(args)


if __name__ == "__main__":
    main()
