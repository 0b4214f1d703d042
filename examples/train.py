"""Train a Llama-style decoder with tidearray's FSDP runtime.

    mpirun -n 2 python examples/train.py                      # tiny model, default backend
    mpirun -n 2 python examples/train.py --model llama3-8b-8l --tokens 8192
    mpirun -n 2 python examples/train.py --graph                # cuda: the step as a CUDA graph
    mpirun -n 2 python examples/train.py --graph --clip 1.0     # the clip captured with it

Each rank trains on its own ``--tokens`` per step (data parallel); the model's
units are sharded over the ranks by ``tidearray.fsdp.Runtime``. The
model (``llama.py``, next to this file) has a hand-written backward and runs on
the backend's array module: CuPy on the cuda backend, NumPy on host.

Step times against FSDP2's flat path and the no-communication floor, under this
same trainer, are a benchmark: ``benchmarks/steps/compare_train.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import time
import zlib
from typing import Any, Callable, Optional

import llama
import numpy as np

import tidearray as ta
from tidearray.fsdp import AdamW, CapturedStep, Runtime


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The trainer's options (the step comparison adds its own to them)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(llama.MODELS))
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank per step (default: 4 sequences)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (model default)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation: micro-batches of --tokens per step")
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
                   help="gather from param-dtype shards the optimizer keeps, no casts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--save", default=None, help="save a sharded checkpoint here at the end")
    p.add_argument("--resume", default=None, help="load a sharded checkpoint first")
    p.add_argument("--export", default=None, help="write the full fp32 model (.npz) at the end")
    p.add_argument("--backend", default=None, help="tidearray backend (default: auto)")
    p.add_argument("--graph", action="store_true",
                   help="cuda: capture the whole step once (after one eager step) as a CUDA "
                        "graph and replay it (tidearray.fsdp.CapturedStep); implies "
                        "--capturable-model")
    p.add_argument("--capturable-model", action="store_true",
                   help="cuda: the model's matmuls and embedding gradient in the forms a "
                        "capture takes (llama.Capturable), as --graph runs them eagerly too")
    return p


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


def build(args: argparse.Namespace, g: Any, comm: Any, cfg: llama.ModelConfig,
          stream: Any) -> Runtime:
    """The sharded model; ``comm`` is ``"tide"`` or a comm factory (``Runtime``)."""
    specs = llama.unit_specs(cfg)
    named = [[(f"{u}.{name}", shape) for name, shape in unit] for u, unit in enumerate(specs)]
    opt = AdamW(lr=args.lr, weight_decay=args.weight_decay)
    common = dict(group=g, param_dtype=args.param_dtype, optimizer=opt, max_grad_norm=args.clip,
                  prefetch=args.prefetch, comm=comm, stream=stream,
                  keep_param_shards=args.keep_param_shards)
    if g.backend.name == "cuda":
        return Runtime(named, init=device_init(g.backend.xp, args.seed, cfg), **common)
    full = llama.init_params(cfg, args.seed)
    units = [[(n, a) for (n, _), a in zip(names, arrays)] for names, arrays in zip(named, full)]
    return Runtime(units, **common)


def train_step(sm: Runtime, net: llama.Llama, tokens: Any, targets: Any) -> Any:
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


def whole_step(sm: Runtime, net: llama.Llama, inputs: list,
               lr: Optional[float] = None) -> tuple[list, Any]:
    """Every micro-batch's forward and backward, then the optimizer (at ``lr``): one step,
    what a captured step holds. Returns the micro-batches' losses (device arrays) and
    the gradient norm with ``--clip`` (a float, or a device array from a capture), else
    None."""
    losses = [train_step(sm, net, tok, tgt) for tok, tgt in inputs]
    return losses, sm.step(lr=lr)


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


def run(args: argparse.Namespace, g: Any, comm: Any, cfg: llama.ModelConfig, B: int,
        log: Log, inspect: Optional[Callable[..., Any]] = None) -> dict:
    """Train ``args.steps`` steps; the run's record (losses, step times, peak memory).

    ``inspect(sm, net, batches, stream)``, if given, runs after the last step, before
    the model is closed; what it returns is the record's ``"profile"``.
    """
    kind = comm if isinstance(comm, str) else comm.name
    xp = g.backend.xp
    stream = xp.cuda.Stream(non_blocking=True) if xp is not np else None
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    mem = Memory(xp)
    sm = build(args, g, comm, cfg, stream)
    graph = getattr(args, "graph", False)
    capturable = xp is not np and (graph or getattr(args, "capturable_model", False))
    net = llama.Llama(cfg, llama.Capturable(stream) if capturable else xp)
    rank = g.rank
    if args.resume:
        sm.load(args.resume)
    first = sm.optimizer.step_count
    data = [[llama.batch(cfg, step=first + s, batch_size=B, seed=args.seed,
                         first_sample=(rank * args.micro_batches + m) * B)
             for m in range(args.micro_batches)] for s in range(args.steps)]
    losses, norms, times, host = [], [], [], []
    if graph:  # the step reads its batch from the same arrays every time
        inputs = [(xp.empty(t.shape, t.dtype), xp.empty(y.shape, y.dtype)) for t, y in data[0]]
    captured = None
    sync(xp)
    for s in range(args.steps):
        t0 = time.perf_counter()
        lr = learning_rate(args, first + s)
        with stream or contextlib.nullcontext():
            if not graph:
                dev_losses, norm = whole_step(sm, net, [(xp.asarray(t), xp.asarray(y))
                                                        for t, y in data[s]], lr)
            else:
                for (tok, tgt), (tokens, targets) in zip(inputs, data[s]):
                    tok.set(tokens, stream=stream)
                    tgt.set(targets, stream=stream)
                if s == 0:  # one eager step first: it builds the plans and kernels
                    dev_losses, norm = whole_step(sm, net, inputs, lr)
                else:
                    if captured is None:
                        captured = CapturedStep(sm, functools.partial(whole_step, sm, net, inputs))
                    dev_losses, norm = captured(lr=lr)
        host.append(time.perf_counter() - t0)
        sync(xp)
        dt = time.perf_counter() - t0
        mem.sample()
        local = float(sum(float(v) for v in dev_losses) / len(dev_losses))
        loss = g.comm.allreduce(local) / g.size
        losses.append(loss)
        norms.append(None if norm is None else float(norm))
        times.append(dt)
        tok = B * cfg.seq * args.micro_batches
        clipped = "" if norm is None else f"  norm {norms[-1]:.4f}"
        log(f"[{kind}] step {first + s + 1:4d}  loss {loss:.6f}{clipped}  {dt * 1e3:9.2f} ms  "
            f"{tok / dt:12,.0f} tok/s/rank  mem {mem.peak / 2**30:6.2f} GiB")
    if args.save:
        sm.save(args.save)
    if args.export:
        sm.export(args.export)
    prof = inspect(sm, net, data[-1], stream) if inspect else None
    if captured is not None:
        captured.close()
    steady = times[args.warmup:] or times
    rec = {"impl": kind + ("-graph" if graph else ""), "losses": losses, "norms": norms,
           "step_s": times,
           "median_step_s": float(np.median(steady)), "host_s": host,
           "median_host_s": float(np.median(host[args.warmup:] or host)), "peak_bytes": mem.peak,
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


def main(argv: Optional[list] = None) -> None:
    args = parse(argv)
    g = ta.init(backend=args.backend)
    log = Log(g.rank)
    cfg, B = configure(args, g)
    log(f"train: {args.model} ({cfg.layers} layers, hidden {cfg.hidden}), {B * cfg.seq} "
        f"tokens/rank x {args.micro_batches} micro-batches, {g.size} ranks, backend "
        f"{g.backend.name}, {args.param_dtype}")
    rec = run(args, g, "tide", cfg, B, log)
    log(f"loss {rec['losses'][0]:.4f} -> {rec['losses'][-1]:.4f} over {len(rec['losses'])} "
        f"steps; median step {rec['median_step_s'] * 1e3:.2f} ms; peak "
        f"{rec['peak_bytes'] / 2**30:.2f} GiB per rank")
    g.close()


def configure(args: argparse.Namespace, g: Any) -> tuple[llama.ModelConfig, int]:
    """The model config (``--seq`` applied) and sequences per micro-batch; fills in the
    defaults that depend on the model or the backend (``--lr``, ``--param-dtype``)."""
    cfg = llama.MODELS[args.model]
    if args.seq:
        cfg = llama.ModelConfig(**{**cfg.__dict__, "seq": args.seq})
    tokens = args.tokens or 4 * cfg.seq
    if tokens % cfg.seq:
        raise SystemExit(f"--tokens: expected a multiple of the sequence length {cfg.seq}, "
                         f"got {tokens}")
    if getattr(args, "graph", False) and g.backend.name != "cuda":
        raise SystemExit(f"--graph: expected the cuda backend (a CUDA graph), got "
                         f"{g.backend.name}")
    if args.lr is None:
        args.lr = 3e-4 if cfg.hidden >= 1024 else 3e-3
    args.param_dtype = args.param_dtype or ("bfloat16" if g.backend.name == "cuda" else
                                            "float32")
    return cfg, tokens // cfg.seq


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
