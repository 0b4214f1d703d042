"""``tidearray.jax.ShardAdamW`` (jnp, inside jit) against ``tidearray.fsdp.FusedAdamW``'s NumPy
path: the same coefficients and the same per-element operations, so the masters agree to a
few float32 roundings per step (XLA may fuse the operations; it is not bitwise). Fresh
data every run. Skipped without JAX."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
tj = pytest.importorskip("tidearray.jax")

from tidearray import TideInvalid  # noqa: E402
from tidearray.fsdp import AdamW, FusedAdamW  # noqa: E402

from .._util import fresh_seed  # noqa: E402

STEPS = 10


def test_shard_adamw_matches_fused_adamw():
    with jax.default_device(jax.devices("cpu")[0]):  # JAX's config left as it is
        _compare()


def _compare() -> None:
    rng = np.random.default_rng(fresh_seed())
    hp = AdamW(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    master = rng.standard_normal(257).astype(np.float32)
    grads = [rng.standard_normal(257).astype(np.float32) for _ in range(STEPS)]
    want = master.copy()  # FusedAdamW steps it in place
    fused = FusedAdamW(hp, want, None, np)
    opt = tj.ShardAdamW(hp)
    update = jax.jit(opt.update)
    shards = {"w": jax.numpy.asarray(master)}
    state = opt.init(shards)
    for k, g in enumerate(grads):
        fused.step(g.copy())
        shards, state = update(shards, {"w": g}, state, opt.coefficients(k + 1))
    got = np.asarray(shards["w"])
    # A few roundings a step, of numbers the size of the starting master (an update near
    # zero cancels, so a bound in ulps of the result would not hold).
    bound = 8 * STEPS * np.finfo(np.float32).eps * (np.abs(master) + 1)
    worst = float(np.max(np.abs(got - want) / bound))
    assert worst <= 1, f"ShardAdamW and FusedAdamW {worst:.2f}x the bound apart after {STEPS}"


def test_optax_adamws_defaults_spelled_out_are_optax_adamw():
    """``AdamW``'s defaults are not optax's (docs/jax.md): with ``optax.adamw``'s betas and
    weight decay spelled out, ShardAdamW steps as ``optax.adamw`` does (1e-5: a few fp32
    roundings per step on values up to about 4; the masters are not bitwise), and at
    its own defaults it does not (gradients of 1e-3, where beta2 weighs)."""
    optax = pytest.importorskip("optax")
    with jax.default_device(jax.devices("cpu")[0]):
        rng = np.random.default_rng(fresh_seed())
        start = {"w": rng.standard_normal((33, 7)).astype(np.float32),
                 "b": rng.standard_normal(7).astype(np.float32)}
        grads = [{k: 1e-3 * rng.standard_normal(v.shape).astype(np.float32)
                  for k, v in start.items()} for _ in range(STEPS)]
        far = {}
        for name, hp in (("spelled", AdamW(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-4)),
                         ("defaults", AdamW(lr=1e-2))):
            opt, tx = tj.ShardAdamW(hp), optax.adamw(1e-2)
            ours, theirs = start, start
            state, tx_state = opt.init(ours), tx.init(theirs)
            update = jax.jit(opt.update)
            for k, g in enumerate(grads):
                ours, state = update(ours, g, state, opt.coefficients(k + 1))
                step, tx_state = tx.update(g, tx_state, theirs)
                theirs = optax.apply_updates(theirs, step)
            far[name] = max(float(np.abs(np.asarray(ours[k]) - np.asarray(theirs[k])).max())
                            for k in start)
    assert far["spelled"] <= 1e-5 and far["defaults"] > 1e-4, far


def test_shard_adamw_without_clipping_needs_no_group():
    """A ShardAdamW that does not clip is made on one process alone (the references of the
    multi-rank tests are): only a clipping one is collective (tests/jax/mpi/test_jax_jit.py)."""
    opt = tj.ShardAdamW(AdamW(lr=1e-2))
    shards = {"w": jax.numpy.ones(3)}
    new, _ = opt.update(shards, {"w": jax.numpy.ones(3)}, opt.init(shards), opt.coefficients(1))
    assert np.all(np.asarray(new["w"]) < 1)
    with pytest.raises(TideInvalid, match="max_grad_norm"):  # AdamW's own check
        tj.ShardAdamW(AdamW(max_grad_norm=0.0))


@pytest.mark.parametrize("step, lr, match", [
    (0, None, "step: expected an integer >= 1"), (1.5, None, "step: expected an integer >= 1"),
    (True, None, "step: expected an integer >= 1"), (-3, None, "step: expected an integer"),
    (1, float("nan"), "lr: expected a finite real >= 0"), (1, -1e-3, "lr: expected"),
    (1, "1e-3", "lr: expected")])
def test_coefficients_refuse_a_bad_step_or_lr(step, lr, match):
    """Steps count from 1, as torch.optim.AdamW's do: step 0 would divide by zero in the
    bias correction, and a fractional step would bias-correct by a step that never ran."""
    opt = tj.ShardAdamW(AdamW(lr=1e-2))
    with pytest.raises(TideInvalid, match=match):
        opt.coefficients(step, lr)
    assert np.all(np.isfinite(np.asarray(opt.coefficients(np.int64(3), 0.0))))
