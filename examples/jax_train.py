"""Train a small JAX transformer fully sharded, one ``jax.jit`` per step, with ``tidearray.jax``.

    mpiexec -n 2 python examples/jax_train.py            # then checks a 1-process JAX run

The model is plain JAX: a token and position embedding, pre-norm blocks of causal
self-attention and an MLP, a final norm and a head. Each of them is a *unit*: a
pytree of parameters and a function ``unit(params, x)``. By default the blocks are one
*stacked* unit, their parameters stacked on a leading layer axis (MaxText's
``scan_layers``), run by ``ShardedUnits.scan`` inside ``jax.lax.scan``: one compiled
block, whatever the depth; ``--unrolled`` makes each block a unit of its own, applied
in a Python loop. ``tidearray.jax.shard_units`` keeps this rank's fp32 dim-0 shard of
each unit (of each layer); the training step, one ``jax.jit``, runs every unit (every
layer) through ``ShardedUnits.apply``: its parameters are gathered (TIDE-AG) just
before its forward, released after it, and gathered again for its backward, and its
gradients are reduced (TIDE-RS) into fp32 shard gradients, averaged over the ranks.
``ShardAdamW`` clips them by the whole gradient's global norm (``--max-grad-norm``,
torch's ``clip_grad_norm_`` rule; ``none`` turns it off) and steps the shards inside
the same jit. Nothing leaves the jitted step but the loss: the collectives run inside
it, on XLA's buffers and, on GPUs, on XLA's stream.

At the end, ``ShardedUnits.full_params`` gathers the trained model whole onto rank 0
(``--save FILE`` writes it, fp32, to one ``.npz``), and rank 0 trains the same model in
one process on every rank's samples (the global batch), its blocks unrolled, clipping
the whole gradient, with the same AdamW, and prints the largest loss difference and the
trained parameters' largest relative difference; the run fails if either is above 1e-5
relative on CPU or 1e-4 on GPUs (fp32 throughout, matmuls at full precision).
``--dtype bfloat16`` gathers bf16 parameters and reduces bf16 gradients into the fp32
shards (loss tolerance 3e-2; the parameters' difference printed, not bounded). It runs
on the default backend (cuda where a GPU and a CUDA JAX exist; ``TIDE_BACKEND=host``
forces the CPU). Needs JAX (``pip install 'tidearray[jax]'``); without it, it fails,
naming the extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

import tidearray as ta
from tidearray.fsdp import AdamW

TOLERANCE = {("cpu", "float32"): 1e-5, ("gpu", "float32"): 1e-4}
BF16_TOLERANCE = 3e-2
#: The trained fp32 parameters, relative to each leaf's norm, where the loss bound is too
#: tight for them: on a GPU, AdamW turns a near-zero gradient's summation-order differences
#: into learning-rate-sized steps (the leaves that start at zero: 1.2e-4 at 3 ranks).
PARAM_TOLERANCE = {("gpu", "float32"): 1e-3}


@dataclass(frozen=True)
class Config:
    """The model's shape and the run's."""

    vocab: int = 64
    width: int = 32
    heads: int = 2
    layers: int = 2
    seq: int = 16
    batch: int = 4  # sequences per rank per step
    steps: int = 10
    lr: float = 3e-3
    scan: bool = True  # the blocks as one stacked unit under lax.scan (False: unrolled)
    max_grad_norm: Optional[float] = 1.5  # clip the global gradient norm (None: no clip)


def init_units(cfg: Config, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The model's units: embedding, ``layers`` blocks, head (fp32, NumPy)."""
    rng = np.random.default_rng(seed)
    d = cfg.width

    def dense(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def norm() -> dict[str, np.ndarray]:
        return {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}

    embed = {"tok": (0.5 * rng.standard_normal((cfg.vocab, d))).astype(np.float32),
             "pos": (0.1 * rng.standard_normal((cfg.seq, d))).astype(np.float32)}
    blocks = [{"ln1": norm(), "qkv": dense(3 * d, d), "proj": dense(d, d), "ln2": norm(),
               "up": dense(4 * d, d), "up_b": np.zeros(4 * d, np.float32),
               "down": dense(d, 4 * d)} for _ in range(cfg.layers)]
    head = {"ln": norm(), "out": dense(cfg.vocab, d)}
    return [embed, *blocks, head]


def unit_fns(jax: Any, cfg: Config) -> list[Callable[[Any, Any], Any]]:
    """Each unit's ``fn(params, x)``, plain JAX, in the order of :func:`init_units`."""
    jnp = jax.numpy

    def layer_norm(p: dict, x: Any) -> Any:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]

    def embed(p: dict, tokens: Any) -> Any:
        return p["tok"][tokens] + p["pos"][: tokens.shape[1]]

    def block(p: dict, x: Any) -> Any:
        b, t, d = x.shape
        hd = d // cfg.heads
        q, k, v = jnp.split(layer_norm(p["ln1"], x) @ p["qkv"].T, 3, axis=-1)
        q, k, v = (a.reshape(b, t, cfg.heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        scores = (q @ k.transpose(0, 1, 3, 2)) / float(np.sqrt(hd))  # weak: keeps the dtype
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        att = jax.nn.softmax(scores, axis=-1) @ v
        x = x + att.transpose(0, 2, 1, 3).reshape(b, t, d) @ p["proj"].T
        h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["up"].T + p["up_b"])
        return x + h @ p["down"].T

    def head(p: dict, x: Any) -> Any:
        return layer_norm(p["ln"], x) @ p["out"].T

    return [embed, *[block] * cfg.layers, head]


def sharded_model(jax: Any, cfg: Config,
                  units: Optional[list] = None) -> tuple[list, list, list[int]]:
    """``(units, fns, stacked)`` as ``shard_units`` and :func:`sharded_step` take them: with
    ``cfg.scan`` the blocks are one unit, each leaf stacked on a leading layer axis, whose
    one ``fn`` is a block's. ``units``: :func:`init_units`' (made here if None)."""
    units = init_units(cfg) if units is None else units
    fns = unit_fns(jax, cfg)
    if not cfg.scan:
        return units, fns, []
    blocks = jax.tree_util.tree_map(lambda *layers: np.stack(layers), *units[1:-1])
    return [units[0], blocks, units[-1]], [fns[0], fns[1], fns[-1]], [1]


def batch(cfg: Config, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s tokens and next-token targets for ``step`` (a learnable sequence)."""
    rng = np.random.default_rng([step % 3, rank])
    start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
    seq = (start + 3 * np.arange(cfg.seq + 1)) % cfg.vocab
    return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def cross_entropy(jax: Any, logits: Any, targets: Any) -> Any:
    logp = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
    return -jax.numpy.take_along_axis(logp, targets[..., None], axis=-1).mean()


def sharded_step(jax: Any, su: Any, fns: list, opt: Any) -> Callable:
    """The jitted training step on this rank's shards: loss, shard gradients, AdamW."""

    def loss_fn(shards: list, tokens: Any, targets: Any) -> Any:
        h = tokens
        for i, fn in enumerate(fns):
            # gathered here (each layer in its iteration of lax.scan), reduced in backward
            run = su.apply if su.layers(i) is None else su.scan
            h = run(i, fn, shards[i], h)
        return cross_entropy(jax, h, targets)

    def step(shards: list, state: Any, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(shards, tokens, targets)
        shards, state = opt.update(shards, grads, state, coef)
        return shards, state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def train_sharded(jax: Any, g: ta.Group, cfg: Config, dtype: str = "float32") -> tuple:
    """``(losses averaged over the ranks, ShardedUnits, the trained shards)`` of
    ``cfg.steps`` jitted steps."""
    import tidearray.jax as tj

    units, fns, stacked = sharded_model(jax, cfg)
    su = tj.shard_units(units, group=g, compute_dtype=jax.numpy.dtype(dtype), stacked=stacked)
    # clips by the norm of the whole gradient, over every rank's shards
    opt = tj.ShardAdamW(AdamW(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm), group=g)
    step = sharded_step(jax, su, fns, opt)
    shards, state, losses = su.shards, opt.init(su.shards), []
    for s in range(cfg.steps):
        tokens, targets = (jax.device_put(a, su.device) for a in batch(cfg, s, g.rank))
        if s == 0:  # compiled ahead, so a slow compile shows as such (it can take a while);
            # the loop calls the jitted function, which finds it: JAX's compiled object of a
            # step with host callbacks has no C++ dispatch, the jitted function has
            started = time.perf_counter()
            step.lower(shards, state, opt.coefficients(1), tokens, targets).compile()
            if g.rank == 0:
                print(f"compiled the step in {time.perf_counter() - started:.1f} s", flush=True)
        shards, state, loss = step(shards, state, opt.coefficients(s + 1), tokens, targets)
        losses.append(g.comm.allreduce(float(loss)) / g.size)
        if g.rank == 0:
            print(f"step {s:3d}  loss {losses[-1]:.6f}", flush=True)
        if s == 0:  # the first step's callbacks also build the plans
            first = su.callback_seconds
    if g.rank == 0 and cfg.steps > 1:
        per_step = (su.callback_seconds - first) / (cfg.steps - 1)
        print(f"host time in tidearray's callbacks: {per_step * 1e3:.2f} ms per step after "
              "the first")
    return losses, su, shards


def reference_run(jax: Any, cfg: Config, world: int) -> tuple[list[float], list[float], list]:
    """``(losses, gradient norms, trained units)`` of one process on every rank's samples:
    the blocks unrolled, the whole gradient clipped (:func:`clip_whole`), the same AdamW on
    the full parameters."""
    import tidearray.jax as tj

    fns, opt = unit_fns(jax, cfg), tj.ShardAdamW(AdamW(lr=cfg.lr))

    def loss_fn(units: list, tokens: Any, targets: Any) -> Any:
        h = tokens
        for p, fn in zip(units, fns):
            h = fn(p, h)
        return cross_entropy(jax, h, targets)

    @jax.jit
    def step(units: list, state: Any, coef: Any, tokens: Any, targets: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(units, tokens, targets)
        grads, norm = clip_whole(jax, grads, cfg.max_grad_norm)
        units, state = opt.update(units, grads, state, coef)
        return units, state, loss, norm

    units = jax.tree_util.tree_map(jax.numpy.asarray, init_units(cfg))
    state, losses, norms = opt.init(units), [], []
    for s in range(cfg.steps):
        tokens, targets = (np.concatenate(a) for a in zip(*[batch(cfg, s, r)
                                                             for r in range(world)]))
        units, state, loss, norm = step(units, state, opt.coefficients(s + 1), tokens,
                                        targets)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, units


def param_differences(jax: Any, cfg: Config, model: list,
                      trained: list) -> list[tuple[str, float]]:
    """``(path, relative difference)`` of each leaf of ``model`` (``full_params``' result)
    from the one process's ``trained`` units (:func:`reference_run`), in the sharded
    model's layout; ``inf`` for a leaf that is not a float32 NumPy array of its shape."""
    out = []
    reference = jax.tree_util.tree_leaves(sharded_model(jax, cfg, trained)[0])
    leaves = jax.tree_util.tree_leaves_with_path(model)
    if len(leaves) != len(reference):
        return [(f"{len(leaves)} leaves, the reference {len(reference)}", float("inf"))]
    for (path, got), ref in zip(leaves, reference):
        ref = np.asarray(ref)
        ok = isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == ref.shape
        out.append((jax.tree_util.keystr(path), float(np.linalg.norm(got - ref)
                                                      / np.linalg.norm(ref)) if ok else
                    float("inf")))
    return out


def clip_whole(jax: Any, grads: Any, max_norm: Optional[float]) -> tuple[Any, Any]:
    """``(grads clipped, their norm before)``: torch's ``clip_grad_norm_`` on one process's
    whole gradient, ``min(1, max_norm / (norm + 1e-6))`` (not clipped where ``max_norm`` is
    None)."""
    jnp = jax.numpy
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    if max_norm is None:
        return grads, norm
    factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree_util.tree_map(lambda g: g * factor, grads), norm


def setup_jax(g: ta.Group) -> Any:
    """JAX on this rank's device: the backend's GPU (cuda), the CPU (host)."""
    import jax

    if g.backend.name == "cuda":
        if not _has_gpu(jax):
            sys.exit("jax_train.py: the cuda backend needs a CUDA JAX (pip install "
                     "'jax[cuda12]'); TIDE_BACKEND=host runs it on the CPU")
        g.backend.xp.cuda.Device(g.backend.device).use()  # JAX's start-up may change it
    else:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32, not TF32, on GPUs
    return jax


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--unrolled", action="store_true",
                   help="each block a unit of its own, applied in a Python loop (default: "
                        "the blocks stacked, under lax.scan)")
    p.add_argument("--max-grad-norm", type=_limit, default=Config.max_grad_norm,
                   help="clip the global gradient norm to this; 'none': no clip (default "
                        f"{Config.max_grad_norm})")
    p.add_argument("--save", default=None, metavar="NPZ",
                   help="write the trained model's full fp32 parameters (rank 0) to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to us
    try:
        import jax  # noqa: F401
    except ImportError as e:
        sys.exit(f"jax_train.py: needs JAX ({e}); pip install 'tidearray[jax]'")
    g = ta.init()
    jax = setup_jax(g)
    cfg = Config(steps=args.steps, scan=not args.unrolled, max_grad_norm=args.max_grad_norm)
    losses, su, shards = train_sharded(jax, g, cfg, args.dtype)
    model = su.full_params(shards, root=0)  # the trained model whole, on rank 0 (collective)
    ok = True
    if g.rank == 0:
        kind = su.device.platform if su.device.platform == "cpu" else "gpu"
        tol = TOLERANCE.get((kind, args.dtype), BF16_TOLERANCE)
        with jax.default_device(su.device):
            want, norms, trained = reference_run(jax, cfg, g.size)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        param_diff = max(diff for _, diff in param_differences(jax, cfg, model, trained))
        # bf16: the loss bound alone; leaves that start at zero (biases, norms' shifts) end
        # 6e-2 apart at 3 ranks, each step's bf16-rounded gradients moving them apart
        param_tol = PARAM_TOLERANCE.get((kind, args.dtype), tol)
        param_ok = args.dtype != "float32" or param_diff <= param_tol
        ok = diff <= tol and param_ok and losses[-1] < losses[0]
        if args.save:
            np.savez(args.save, **{jax.tree_util.keystr(path): a for path, a in
                                   jax.tree_util.tree_leaves_with_path(model)})
            print(f"saved the trained model's full fp32 parameters to {args.save}")
        blocks = f"{cfg.layers} blocks " + ("under lax.scan" if cfg.scan else "unrolled")
        clipped = sum(n > cfg.max_grad_norm for n in norms) if cfg.max_grad_norm else 0
        print(f"backend {g.backend.name}, JAX on {su.device}, {args.dtype} parameters, {blocks}")
        print(f"gradient norm {min(norms):.3f} to {max(norms):.3f}; clip at "
              f"{cfg.max_grad_norm}: {clipped} of {cfg.steps} steps clipped")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest relative difference from "
              f"one JAX process on all the samples: {diff:.2e} (tolerance {tol:g})")
        print(f"trained parameters (ShardedUnits.full_params): largest relative difference "
              f"from that process's {param_diff:.2e} "
              + (f"(tolerance {param_tol:g})" if args.dtype == "float32"
                 else "(not bounded in bf16)"))
    ok = g.comm.bcast(ok)
    g.close()
    if not ok:
        sys.exit("jax_train.py: the sharded run does not match the reference")


def _limit(text: str) -> Optional[float]:
    """``--max-grad-norm``'s value: a float, or None for 'none'."""
    return None if text.lower() == "none" else float(text)


def _has_gpu(jax: Any) -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
