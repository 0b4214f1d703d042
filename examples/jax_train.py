"""Train a small JAX network on tidearray's FSDP runtime, one ``jax.vjp`` per unit.

    mpiexec -n 2 python examples/jax_train.py            # then checks a 1-process JAX run

Each unit (a dense layer) is a pure function ``unit(params, x)``. For every unit,
the runtime gathers its parameters into a slot; the slot is viewed as JAX arrays
through DLPack, without a copy; ``jax.vjp`` runs the unit and keeps its pullback.
In backward the runtime gathers the unit again into the *same* slot (so the
arrays the pullback holds see the same values), the pullback gives the unit's
gradients, they are written into the runtime's gradient buffers, and the
unit's reduce-scatter starts. The fused AdamW steps the fp32 shards.

[Note: JAX and the slots]
JAX assumes a buffer it imported never changes. A slot does change between
units, so a unit's arrays are used only while the slot holds that unit: from
``pre_forward`` to ``post_forward`` and from ``pre_backward`` to
``post_backward`` (the runtime puts unit ``i`` in slot ``i % slots`` every
time, so the pullback's arrays are right again in backward). Results are made
concrete (``block_until_ready``) before the slot is released.

[Note: JAX's stream]
On the cuda backend XLA runs on its own stream, which tidearray cannot see. The
runtime orders its work on CuPy's current stream, so the two are joined on the
host at the points where data crosses: that stream is synchronized before JAX
reads a gathered unit (``ready_for_jax``), and JAX's results are made concrete
before the runtime reads them or reuses the slot (gradients copied on CuPy's
stream, then ``post_backward``). Host joins are the simple, always-correct
choice for a small model; a large one would pass events instead.

At the end, rank 0 trains the same network in one process on every rank's
samples with the same AdamW and prints the largest loss difference; the run
fails if it is above 1e-5 relative on CPU or 1e-4 on GPUs (fp32 throughout,
matmuls at full precision). It runs on the default backend (cuda where a GPU
and a CUDA JAX exist; ``TIDE_BACKEND=host`` forces the CPU). Needs JAX
(``pip install 'tidearray[jax]'``); without it, it fails, naming the extra.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import tidearray as ta
from tidearray.fsdp import AdamW, FusedAdamW, ShardedModel

SIZES = (8, 32, 32, 4)
STEPS, B, LR = 10, 16, 1e-2


def init_units(seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32),
             np.zeros(o, np.float32)] for i, o in zip(SIZES, SIZES[1:])]


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([step % 2, rank])
    x = rng.standard_normal((B, SIZES[0])).astype(np.float32)
    return x, np.sin(2 * x[:, :SIZES[-1]])


def unit_fn(jnp, last: bool):
    def f(params, x):
        w, b = params
        y = x @ w.T + b
        return y if last else jnp.tanh(y)
    return f


class Bridge:
    """Arrays between the runtime's backend and JAX on one device (see the Notes)."""

    def __init__(self, jax, g) -> None:
        self.jax, self.xp = jax, g.backend.xp
        self.cuda = g.backend.name == "cuda"
        self.device = jax.devices("gpu")[g.backend.device] if self.cuda else jax.devices()[0]
        self.copies = 0  # parameters JAX could not take without a copy

    def ready_for_jax(self) -> None:
        """Work the runtime issued on CuPy's stream is done before XLA's stream reads it."""
        if self.cuda:
            self.xp.cuda.get_current_stream().synchronize()

    def to_jax(self, a):
        """A JAX array over ``a``'s memory (DLPack, no copy) where JAX can take it."""
        try:
            return self.jax.dlpack.from_dlpack(a)
        except Exception:  # noqa: BLE001 - an unaligned or read-only buffer: a copy instead
            self.copies += 1
            host = a.get() if self.cuda else a
            return self.jax.device_put(host, self.device)

    def put(self, x: np.ndarray):
        return self.jax.device_put(x, self.device)

    def copy_into(self, buf, d) -> None:
        """``buf[...] = d`` (a finished JAX array), on the runtime's side."""
        if self.cuda:
            self.xp.copyto(buf, self.xp.from_dlpack(d))
        else:
            np.copyto(buf, np.asarray(d))


def train_sharded(jax, g) -> tuple[list[float], Bridge]:
    jnp = jax.numpy
    bridge = Bridge(jax, g)
    units = init_units()
    n = len(units)
    names = [[(f"{i}.w", u[0]), (f"{i}.b", u[1])] for i, u in enumerate(units)]
    sm = ShardedModel(names, group=g, param_dtype=ta.float32, optimizer=AdamW(lr=LR))
    losses = []
    for s in range(STEPS):
        x, y = batch(s, g.rank)
        h, pullbacks = bridge.put(x), []
        for i in range(n):
            arrays = sm.pre_forward(i)
            bridge.ready_for_jax()  # [Note: JAX's stream]
            h, pull = jax.vjp(unit_fn(jnp, i == n - 1), [bridge.to_jax(a) for a in arrays], h)
            h.block_until_ready()  # [Note: JAX and the slots]
            pullbacks.append(pull)
            sm.post_forward(i)
        loss, dloss = jax.value_and_grad(lambda o, t: jnp.mean((o - t) ** 2))(h, bridge.put(y))
        dh = dloss
        for i in reversed(range(n)):
            _, grads_out = sm.pre_backward(i)
            bridge.ready_for_jax()
            dparams, dh = jax.block_until_ready(pullbacks[i](dh))
            for buf, d in zip(grads_out, dparams):
                bridge.copy_into(buf, d)
            sm.post_backward(i)
        sm.step()
        losses.append(g.comm.allreduce(float(loss)) / g.size)
        if g.rank == 0:
            print(f"step {s:3d}  loss {losses[-1]:.6f}", flush=True)
    sm.synchronize()
    return losses, bridge


def train_reference(jax, world: int) -> list[float]:
    """One process, every rank's samples, the fused AdamW's NumPy path on each parameter."""
    jnp = jax.numpy
    units = init_units()
    n = len(units)
    opts = [[FusedAdamW(AdamW(lr=LR), p.reshape(-1), None, np) for p in u] for u in units]

    def loss_fn(all_params, x, y):
        h = x
        for i, p in enumerate(all_params):
            h = unit_fn(jnp, i == n - 1)(p, h)
        return jnp.mean((h - y) ** 2)

    losses = []
    for s in range(STEPS):
        xs, ys = zip(*[batch(s, r) for r in range(world)])
        loss, grads = jax.value_and_grad(loss_fn)(units, np.concatenate(xs), np.concatenate(ys))
        for gu, ou in zip(grads, opts):
            for gp, opt in zip(gu, ou):  # each parameter's master, updated in place
                opt.step(np.asarray(gp, np.float32).reshape(-1))
        losses.append(float(loss))
    return losses


def main() -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to us
    try:
        import jax
        import jax.dlpack  # noqa: F401
    except ImportError as e:
        sys.exit(f"jax_train.py: needs JAX ({e}); pip install 'tidearray[jax]'")
    g = ta.init()
    if g.backend.name == "cuda" and not _has_gpu(jax):
        sys.exit("jax_train.py: the cuda backend needs a CUDA JAX (pip install 'jax[cuda12]'); "
                 "TIDE_BACKEND=host runs it on the CPU")
    if g.backend.name == "cuda":  # JAX's start-up leaves another GPU current: ours back
        g.backend.xp.cuda.Device(g.backend.device).use()
    else:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32, not TF32, on GPUs
    losses, bridge = train_sharded(jax, g)
    tol = 1e-4 if bridge.cuda else 1e-5
    ok = True
    if g.rank == 0:
        with jax.default_device(bridge.device):
            want = train_reference(jax, g.size)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        ok = diff <= tol and losses[-1] < losses[0]
        print(f"backend {g.backend.name}, JAX on {bridge.device}; parameters copied instead of "
              f"shared: {bridge.copies}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest relative difference from "
              f"one JAX process on all the samples: {diff:.2e} (tolerance {tol:g})")
    ok = g.comm.bcast(ok)
    g.close()
    if not ok:
        sys.exit("jax_train.py: the sharded run does not match the reference")


def _has_gpu(jax) -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
