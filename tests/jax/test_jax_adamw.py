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
