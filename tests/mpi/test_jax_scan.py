"""``tidearray.jax``: a stacked unit under ``jax.lax.scan``, multi-rank, on CPU JAX.

* ten jitted steps of a network whose middle layers are one stacked unit, scanned
  (``ShardedUnits.scan``, and a hand-written ``lax.scan`` over ``jax.checkpoint`` of
  ``apply`` with ``reshard_after_forward=False``), against one JAX process training the
  unrolled network on the global batch: losses and final parameters within 1e-5
  relative (fp32); the layers' rows are ragged, a rank's rows empty at some sizes;
* the order the collectives run in: the forward gathers layer by layer, then per layer
  in reverse its re-gather and its reduce-scatter, the layer read from the gathered
  shard's contents; the same on every rank;
* errors, raised on every rank: stacked leaves without a layer axis or with two layer
  counts, bad ``stacked`` indices, ranks that disagree on ``stacked``, a layer's
  ``apply`` given the whole stack, ``scan`` of an unstacked unit.

Fresh seeds every run (drawn on rank 0). Runs on the host backend at any world size.
Skipped without JAX.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from tidearray import TideInvalid
from tidearray.fsdp import AdamW

from .._util import agree, on_rank_zero
from .test_jax_jit import _seed, cpu_jax  # noqa: F401 (a fixture)

jax = pytest.importorskip("jax")
jnp = jax.numpy
tj = pytest.importorskip("tidearray.jax")

pytestmark = pytest.mark.mpi
LAYERS, STEPS, BATCH = 3, 10, 4


def _model(seed: int, d: int, d_in: int = 5, d_out: int = 2) -> list[dict[str, np.ndarray]]:
    """``[input dense, LAYERS residual MLP blocks (stacked leaves), output dense]``."""
    rng = np.random.default_rng(seed)

    def dense(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    blocks = {"up": np.stack([dense(2 * d, d) for _ in range(LAYERS)]),
              "up_b": (0.1 * rng.standard_normal((LAYERS, 2 * d))).astype(np.float32),
              "down": np.stack([dense(d, 2 * d) for _ in range(LAYERS)])}
    return [{"w": dense(d, d_in), "b": np.zeros(d, np.float32)}, blocks,
            {"w": dense(d_out, d), "b": np.zeros(d_out, np.float32)}]


def _dense(p: dict, x: Any) -> Any:
    return jnp.tanh(x @ p["w"].T + p["b"])


def _block(p: dict, x: Any) -> Any:
    return x + jnp.tanh(x @ p["up"].T + p["up_b"]) @ p["down"].T


def _layer(tree: Any, k: int) -> Any:
    return jax.tree_util.tree_map(lambda a: a[k], tree)


def _unrolled_loss(units: list, x: Any, y: Any) -> Any:
    """The independent reference: plain JAX, the layers in a Python loop."""
    h = _dense(units[0], x)
    for k in range(LAYERS):
        h = _block(_layer(units[1], k), h)
    return jnp.mean((_dense(units[2], h) - y) ** 2)


def _scanned_loss(su: Any, how: str) -> Callable:
    def loss(shards: list, x: Any, y: Any) -> Any:
        h = su.apply(0, _dense, shards[0], x)
        if how == "scan":
            h = su.scan(1, _block, shards[1], h)
        else:  # what a MaxText- or Flax-style model writes itself
            body = jax.checkpoint(lambda h, p: (su.apply(1, _block, p, h), None))
            h = jax.lax.scan(body, h, shards[1])[0]
        return jnp.mean((su.apply(2, _dense, shards[2], h) - y) ** 2)
    return loss


def _step(loss: Callable, opt: Any) -> Any:
    def step(params, state, coef, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return (*opt.update(params, grads, state, coef), value)
    return jax.jit(step)


class _Trained:
    """A sharded training run and its params, every rank's shards reassembled."""

    def __init__(self, group: Any, step: Any, shards: Any, opt: Any, batches: list) -> None:
        state, self.losses = opt.init(shards), []
        for k, (x, y) in enumerate(batches):
            shards, state, loss = step(shards, state, opt.coefficients(k + 1), x, y)
            self.losses.append(group.comm.allreduce(float(loss)) / group.size)
        self.shards = jax.tree_util.tree_map(np.asarray, shards)


def _full(group: Any, shards: Any, like: Any, stacked: bool) -> Any:
    """Full parameters from every rank's padded shards (dim 0, or dim 1 under a layer axis)."""
    every = group.comm.allgather(shards)
    axis = 1 if stacked else 0

    def one(k: int, want: np.ndarray) -> np.ndarray:
        parts = [jax.tree_util.tree_leaves(s)[k] for s in every]
        return np.concatenate(parts, axis=axis)[(slice(None),) * axis + (slice(want.shape[axis]),)]

    leaves = jax.tree_util.tree_leaves(like)
    return [one(k, w) for k, w in enumerate(leaves)]


def _reference(units: list, opt: Any, data: list, targets: list) -> tuple[list, list]:
    """``(losses, final parameters)`` of one process training the unrolled network on every
    rank's samples."""
    params = jax.tree_util.tree_map(jnp.asarray, units)
    step = _step(_unrolled_loss, opt)
    state, losses = opt.init(params), []
    for k, (xs, ys) in enumerate(zip(data, targets)):
        params, state, loss = step(params, state, opt.coefficients(k + 1), np.concatenate(xs),
                                   np.concatenate(ys))
        losses.append(float(loss))
    return losses, [np.asarray(a) for a in jax.tree_util.tree_leaves(params)]


@pytest.mark.parametrize("how,reshard", [("scan", True), ("lax.scan+checkpoint", False)])
def test_scanned_step_matches_one_process(group, cpu_jax, how, reshard):  # noqa: F811
    """Ten steps of the scanned sharded network against one process training the unrolled one
    on every rank's samples: per-step losses and the final parameters. The hand-written scan
    runs at 1-2 ranks in CI (two cores): the same collectives in another loop."""
    if how != "scan" and group.size > 2:
        pytest.skip("CI's time: the hand-written scan at 1-2 ranks")
    W, rank, seed = group.size, group.rank, _seed(group.comm)
    units = _model(seed, d=2 * W + 1)  # ragged rows; at 4 ranks the last rank's are empty
    data = [[np.random.default_rng([seed, k % 3, r]).standard_normal((BATCH, 5))
             .astype(np.float32) for r in range(W)] for k in range(STEPS)]
    targets = [[np.sin(2 * x[:, :2]) for x in xs] for xs in data]
    opt = tj.ShardAdamW(AdamW(lr=1e-2, weight_decay=0.1))

    su = tj.shard_units(units, group=group, stacked=[1], reshard_after_forward=reshard)
    run = _Trained(group, _step(_scanned_loss(su, how), opt), su.shards, opt,
                   [(xs[rank], ys[rank]) for xs, ys in zip(data, targets)])
    got = [p for i, u in enumerate(units) for p in _full(group, run.shards[i], u, i == 1)]
    want_losses, want_params = on_rank_zero(group.comm, lambda: _reference(units, opt, data,
                                                                         targets))
    failures = [f"step {k}: loss {a!r} vs reference {b!r}"
                for k, (a, b) in enumerate(zip(run.losses, want_losses))
                if abs(a - b) > 1e-5 * abs(b)]
    for k, (a, b) in enumerate(zip(got, want_params)):
        err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        if a.shape != b.shape or not err <= 1e-5:
            failures.append(f"parameter {k} {b.shape}: got {a.shape}, relative error {err:.2e}")
    if not run.losses[-1] < run.losses[0]:
        failures.append(f"losses {run.losses} do not go down")
    agree(group.comm, failures, f"{how} vs one unrolled JAX process (seed {seed})")


def test_scan_collective_order(group, cpu_jax, monkeypatch):  # noqa: F811
    """Forward: the input unit's gather, the layers' in layer order, the output unit's; then
    per unit and layer in reverse its re-gather and its reduce-scatter; on every rank."""
    from tidearray.jax._runners import InPlace

    W, seed = group.size, _seed(group.comm)
    units = _model(seed, d=2 * W)  # every rank holds rows of every layer
    su = tj.shard_units(units, group=group, stacked=[1])
    mine = [np.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(_layer(su.shards[1], k))])
            for k in range(LAYERS)]
    log: list[str] = []
    real_ag, real_rs = InPlace.gather, InPlace.reduce

    def ag(self, index, shapes, sends, *args):
        flat = np.concatenate([np.asarray(a).ravel() for a in sends])
        layer = [k for k in range(LAYERS) if index == 1 and np.array_equal(flat, mine[k])]
        log.append(f"ag{index}" + (f"@{layer[0]}" if layer else ""))
        return real_ag(self, index, shapes, sends, *args)

    def rs(self, index, *args):
        log.append(f"rs{index}")
        return real_rs(self, index, *args)

    monkeypatch.setattr(InPlace, "gather", ag)
    monkeypatch.setattr(InPlace, "reduce", rs)
    grads = jax.jit(jax.grad(lambda s, x: jnp.sum(_scanned_loss(su, "scan")(s, x, 0.0))))
    jax.block_until_ready(grads(su.shards, jnp.ones((2, 5))))
    layers = [f"ag1@{k}" for k in range(LAYERS)]
    want = ["ag0", *layers, "ag2", "ag2", "rs2"]
    for k in reversed(range(LAYERS)):
        want += [layers[k], "rs1"]
    want += ["ag0", "rs0"]
    failures = [] if log == want else [f"collectives ran as {log}, expected {want}"]
    everyone = group.comm.allgather(log)
    if any(o != everyone[0] for o in everyone):
        failures.append(f"ranks ran their collectives in different orders: {everyone}")
    agree(group.comm, failures, "collective order of a scanned unit")


@pytest.mark.parametrize("bad,match", [
    ("flat leaf", "at least 2 dims"), ("two layer counts", "one number of layers"),
    ("index out of range", "distinct unit indices"), ("repeated index", "distinct unit indices")])
def test_bad_stacked_units(group, cpu_jax, bad, match):  # noqa: F811
    units, stacked = _model(0, d=4), [1]
    if bad == "flat leaf":
        units[1]["up_b"] = units[1]["up_b"][0]
    elif bad == "two layer counts":
        units[1]["down"] = units[1]["down"][:-1]
    else:
        stacked = [3] if bad == "index out of range" else [1, 1]
    with pytest.raises(TideInvalid, match=match):
        tj.shard_units(units, group=group, stacked=stacked)


@pytest.mark.mpi(min_size=2)
def test_ranks_disagree_on_stacked(group, cpu_jax):  # noqa: F811
    units = _model(0, d=4)
    units[0] = {"w": np.stack([units[0]["w"]] * 2)}  # 2-D leaves either way
    with pytest.raises(TideInvalid, match="shard_units"):
        tj.shard_units(units, group=group, stacked=[1] if group.rank else [0, 1])


def test_scan_misuse(group, cpu_jax):  # noqa: F811
    su = tj.shard_units(_model(0, d=4), group=group, stacked=[1])
    x = jnp.ones((2, 4))
    assert su.layers(1) == LAYERS and su.layers(0) is None
    with pytest.raises(TideInvalid, match="one layer's shards"):
        jax.jit(lambda s: su.apply(1, _block, s, x))(su.shards[1])
    with pytest.raises(TideInvalid, match="expected a stacked unit"):
        jax.jit(lambda s: su.scan(0, _dense, s, jnp.ones((2, 5))))(su.shards[0])
