"""The Llama example (``examples/llama.py``): gradients, learnability, data, dtypes.

Single-process, NumPy only. Random choices (finite-difference entries, data seeds)
come from a fresh seed per run (``_util.fresh_seed``), printed in every failure message; set
``TIDE_TEST_SEED`` to replay one.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from .._util import fresh_seed
from ..support import example

llama = example("llama")

TINY = llama.MODELS["tiny"]
#: Finite differences: the 4-point central stencil (error O(step**4)) in float64. At 1e-3
#: its truncation reached 8.7e-7 of FD_RTOL's 1e-6 (seed 5215, worst of 400); at 2.5e-4
#: round-off grew to 1.3e-7 (40 seeds); 5e-4 balances them: worst 5.4e-8 over 40 seeds.
FD_STEP = 5e-4
#: Largest accepted |analytic - numeric| / max(|numeric|, floor), where floor is 1e-3 x the
#: largest analytic gradient entry of that array (entries far below the array's scale are
#: judged at that scale, not against their own rounding noise). Observed: ~1e-8 (median),
#: 5.4e-8 (worst of 40 seeds).
FD_RTOL = 1e-6
FD_ENTRIES = 4


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run (or ``TIDE_TEST_SEED``); quote it in failure messages."""
    return fresh_seed()


def forward_all(model: llama.Llama, params: list, tokens, targets, *, start: int = 0,
                inputs=None) -> tuple[np.ndarray, list]:
    """Run units ``start..last`` (unit ``start`` gets ``inputs``); ``(loss, saved)``."""
    h = tokens if start == 0 else inputs
    saved = []
    for u in range(start, model.num_units):
        h, s = model.forward(u, params[u], (h, targets) if u == model.num_units - 1 else h)
        saved.append(s)
    return h, saved


def backward_all(model: llama.Llama, params: list, saved: list) -> tuple[list, list]:
    """Backward from the last unit to the first; ``(param grads, input grads)`` per unit."""
    grads, inputs = [None] * model.num_units, [None] * model.num_units
    g = 1.0
    for u in reversed(range(model.num_units)):
        g, grads[u] = model.backward(u, params[u], saved[u], g)
        inputs[u] = g
    return grads, inputs


def fd_params(cfg: llama.ModelConfig, rng: np.random.Generator) -> list:
    """float64 parameters away from the near-uniform attention of a fresh init."""
    units = [[p.astype(np.float64) for p in u] for u in llama.init_params(cfg, seed=7)]
    for u in units:
        for i, p in enumerate(u):
            u[i] = 1.0 + 0.5 * rng.standard_normal(p.shape) if p.ndim == 1 else 5.0 * p
    return units


def numeric(loss, array: np.ndarray, index: int) -> float:
    """d loss / d array.flat[index] by the 4-point central stencil (restores the entry)."""
    old = array.flat[index]
    f = {}
    for k in (-2, -1, 1, 2):
        array.flat[index] = old + k * FD_STEP
        f[k] = float(loss())
    array.flat[index] = old
    return (8.0 * (f[1] - f[-1]) - (f[2] - f[-2])) / (12.0 * FD_STEP)


def fd_errors(loss, array: np.ndarray, grad: np.ndarray, indices) -> list[tuple[int, float]]:
    """``(index, relative error)`` of ``grad`` against finite differences of ``loss``."""
    assert grad.shape == array.shape and grad.dtype == array.dtype
    floor = 1e-3 * float(np.abs(grad).max())
    out = []
    for i in indices:
        n = numeric(loss, array, int(i))
        out.append((int(i), abs(float(grad.flat[i]) - n) / max(abs(n), floor, 1e-300)))
    return out


def reference_loss(cfg: llama.ModelConfig, params: list, tokens, targets) -> float:
    """The model written out plainly (float64, a loop per head): the forward's semantics."""
    hd, group = cfg.head_dim, cfg.heads // cfg.kv_heads
    half, seq = hd // 2, tokens.shape[1]
    ang = np.arange(seq)[:, None] * cfg.rope_theta ** (-2.0 * np.arange(half) / hd)
    cos, sin = np.cos(ang), np.sin(ang)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * w

    def rope(x):  # (S, hd): rotate pairs (j, j + hd/2) by pos * theta**(-2j/hd)
        a, b = x[:, :half], x[:, half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)

    h = params[0][0][tokens]
    for an, wq, wk, wv, wo, mn, wg, wu, wd in params[1:-1]:
        x = rms(h, an)
        q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
        o = np.zeros_like(q)
        for bi in range(tokens.shape[0]):
            for n in range(cfg.heads):
                kvh = slice(n // group * hd, (n // group + 1) * hd)
                sc = rope(q[bi, :, n * hd:(n + 1) * hd]) @ rope(k[bi, :, kvh]).T / math.sqrt(hd)
                sc = np.where(np.tril(np.ones((seq, seq), bool)), sc, -np.inf)
                pr = np.exp(sc - sc.max(-1, keepdims=True))
                o[bi, :, n * hd:(n + 1) * hd] = pr / pr.sum(-1, keepdims=True) @ v[bi, :, kvh]
        h = h + o @ wo.T
        x = rms(h, mn)
        g = x @ wg.T
        h = h + (g / (1 + np.exp(-g)) * (x @ wu.T)) @ wd.T
    logits = rms(h, params[-1][0]) @ params[-1][1].T
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    return float((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean())


def test_forward_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(TINY, seq=12, rope_theta=float(rng.choice([100.0, 500000.0])))
    params = fd_params(cfg, rng)
    data = llama.batch(cfg, step=0, batch_size=3, first_sample=0, seed=seed)
    got = float(forward_all(llama.Llama(cfg), params, *data)[0])
    want = reference_loss(cfg, params, *data)
    assert abs(got - want) < 1e-12 * want, f"seed {seed}: {got} vs reference {want}"


def test_backward_matches_finite_differences(seed: int) -> None:
    cfg = dataclasses.replace(TINY, seq=8)
    rng = np.random.default_rng(seed)
    model = llama.Llama(cfg)
    params = fd_params(cfg, rng)
    tokens, targets = llama.batch(cfg, step=int(rng.integers(100)), batch_size=2,
                                  first_sample=0, seed=seed)
    tokens[1, -1] = tokens[0, 0]  # a repeated token: its embedding gradient sums two terms
    loss, saved = forward_all(model, params, tokens, targets)
    grads, input_grads = backward_all(model, params, saved)
    # The inputs each unit saw, to perturb them and rerun the rest of the model.
    acts = [tokens] + [s.h for s in saved[1:]]
    bad = []
    for u, spec in enumerate(llama.unit_specs(cfg)):
        for (name, _), p, g in zip(spec, params[u], grads[u]):
            # The embedding's gradient is nonzero only on rows of tokens in the batch.
            rows = (np.append(tokens[0, :1], rng.choice(tokens.reshape(-1), FD_ENTRIES - 1))
                    if name == "embed" else None)
            picks = (rows * cfg.hidden + rng.integers(cfg.hidden, size=FD_ENTRIES)
                     if rows is not None else rng.choice(p.size, FD_ENTRIES, replace=False))
            errs = fd_errors(lambda: forward_all(model, params, tokens, targets)[0], p, g, picks)
            bad += [(u, name, i, e) for i, e in errs if not e < FD_RTOL]
        if u == 0:
            continue
        h = acts[u].copy()
        errs = fd_errors(lambda u=u, h=h: forward_all(model, params, tokens, targets, start=u,
                                                      inputs=h)[0],
                         h, input_grads[u], rng.choice(h.size, FD_ENTRIES, replace=False))
        bad += [(u, "input", i, e) for i, e in errs if not e < FD_RTOL]
    assert not bad, f"seed {seed}: (unit, array, flat index, rel error) over {FD_RTOL}: {bad}"
    assert loss.dtype == np.float64 and loss.shape == ()


def test_initial_loss_and_learning(seed: int) -> None:
    """Fresh init predicts ~uniformly; ~60 Adam steps learn the successor rule."""
    cfg = TINY
    model = llama.Llama(cfg)
    params = llama.init_params(cfg, seed=seed)
    bsz = 16
    held_out = llama.batch(cfg, step=10**6, batch_size=bsz, first_sample=0, seed=seed)
    first = float(forward_all(model, params, *held_out)[0])
    # Over 300 seeds the initial loss minus ln(vocab) was 0.007 +- 0.0145 (max 0.042);
    # 0.1 is about 6 sigma: a bound on "about uniform" that random seeds do not trip.
    assert abs(first - math.log(cfg.vocab)) < 0.1, f"seed {seed}: initial loss {first}"
    m1 = [[np.zeros_like(p) for p in u] for u in params]
    m2 = [[np.zeros_like(p) for p in u] for u in params]
    lr, b1, b2 = 1e-2, 0.9, 0.99
    for step in range(60):
        loss, saved = forward_all(model, params, *llama.batch(
            cfg, step=step, batch_size=bsz, first_sample=0, seed=seed))
        grads, _ = backward_all(model, params, saved)
        for p, g, a, b in zip(sum(params, []), sum(grads, []), sum(m1, []), sum(m2, [])):
            a += (1 - b1) * (g - a)
            b += (1 - b2) * (g * g - b)
            ahat, bhat = a / (1 - b1 ** (step + 1)), b / (1 - b2 ** (step + 1))
            p -= (lr * ahat / (np.sqrt(bhat) + 1e-8)).astype(p.dtype)
    last = float(forward_all(model, params, *held_out)[0])
    floor = llama.optimal_loss(cfg)
    assert last < 0.4 * math.log(cfg.vocab), (
        f"seed {seed}: held-out loss {first:.3f} -> {last:.3f} after 60 Adam steps "
        f"(ln vocab {math.log(cfg.vocab):.3f}, data entropy {floor:.3f})")


def test_batch_is_the_same_split_across_ranks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(TINY, seq=int(rng.integers(1, 40)))
    world, bsz, step = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1000))
    tokens, targets = llama.batch(cfg, step=step, batch_size=world * bsz, first_sample=0,
                                  seed=seed)
    assert tokens.shape == targets.shape == (world * bsz, cfg.seq)
    assert tokens.dtype == targets.dtype == np.int32
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])
    assert 0 <= tokens.min() and max(tokens.max(), targets.max()) < cfg.vocab
    for r in range(world):
        mine = llama.batch(cfg, step=step, batch_size=bsz, first_sample=r * bsz, seed=seed)
        assert np.array_equal(mine[0], tokens[r * bsz:(r + 1) * bsz]), f"seed {seed}, rank {r}"
        assert np.array_equal(mine[1], targets[r * bsz:(r + 1) * bsz]), f"seed {seed}, rank {r}"
    other = llama.batch(cfg, step=step + 1, batch_size=world * bsz, first_sample=0, seed=seed)
    assert not np.array_equal(other[1], targets), f"seed {seed}: steps must differ"


def test_batch_follows_the_successor_rule(seed: int) -> None:
    cfg = llama.MODELS["small"]
    tokens, targets = llama.batch(cfg, step=3, batch_size=16, first_sample=5, seed=seed)
    perm = np.random.default_rng(seed).permutation(cfg.vocab)
    hit = float((perm[tokens] == targets).mean())
    # ``hit`` is a mean of 1024 draws that follow with probability FOLLOW (0.9): its
    # standard deviation is 0.0094, so 0.05 is 5.3 of them (0.03, 3.2 of them, fails about
    # 1 run in 700);
    # a broken rule follows at about 1 / vocab.
    assert abs(hit - llama.FOLLOW) < 0.05, f"seed {seed}: follow rate {hit}"


def test_bfloat16_close_to_float32(seed: int) -> None:
    """bf16 parameters run end to end in bf16 and track float32 (observed: loss ~1e-4
    relative, per-parameter gradient cosine ~0.9999)."""
    model = llama.Llama(TINY)
    p32 = [[p.astype(np.float32) for p in u]
           for u in fd_params(TINY, np.random.default_rng(seed))]
    p16 = [[p.astype(ml_dtypes.bfloat16) for p in u] for u in p32]
    data = llama.batch(TINY, step=0, batch_size=4, first_sample=0, seed=seed)
    assert model.forward(0, p16[0], data[0])[0].dtype == ml_dtypes.bfloat16
    loss32, saved32 = forward_all(model, p32, *data)
    loss16, saved16 = forward_all(model, p16, *data)
    assert loss16.dtype == np.float32 and loss16.shape == ()
    assert abs(float(loss16) / float(loss32) - 1) < 0.02, f"seed {seed}: {loss16} vs {loss32}"
    g32, _ = backward_all(model, p32, saved32)
    g16, _ = backward_all(model, p16, saved16)
    for name, a, b, p in zip([n for spec in llama.unit_specs(TINY) for n, _ in spec],
                             sum(g16, []), sum(g32, []), sum(p16, [])):
        assert a.dtype == p.dtype and a.shape == p.shape, f"{name}: {a.dtype}{a.shape}"
        a = a.astype(np.float32).ravel()
        cos = a @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b))
        assert np.isfinite(a).all() and cos > 0.99, f"seed {seed}: {name} cosine {cos}"
    # A float32 gradient reaching a bf16 layer is cast on entry: its gradients stay bf16.
    _, g = model.backward(1, p16[1], saved16[1], np.ones(saved16[1].h.shape, np.float32))
    assert [x.dtype for x in g] == [ml_dtypes.bfloat16] * len(g)


def test_saved_state_survives_overwritten_params(seed: int) -> None:
    """Backward gets freshly gathered params; what forward saved must not alias the old ones.

    The float32 NumPy path must also be deterministic: two runs agree bit for bit, the
    second writing into ``grads_out`` buffers as the FSDP runtime passes them.
    """
    cfg = TINY
    model = llama.Llama(cfg)
    params = llama.init_params(cfg, seed=seed)
    data = llama.batch(cfg, step=1, batch_size=2, first_sample=0, seed=seed)
    slots = [[p.copy() for p in u] for u in params]  # stand-ins for gathered views
    loss, saved = forward_all(model, slots, *data)
    for p in sum(slots, []):
        p.fill(np.nan)
    grads, inputs = backward_all(model, params, saved)
    loss_again, saved_again = forward_all(model, params, *data)
    # Second run: into runtime-style gradient buffers (poisoned, so every entry must be written).
    grads_again, g = [None] * model.num_units, 1.0
    for u in reversed(range(model.num_units)):
        buffers = [np.full_like(p, np.nan) for p in params[u]]
        g, grads_again[u] = model.backward(u, params[u], saved_again[u], g, grads_out=buffers)
        assert all(a is b for a, b in zip(grads_again[u], buffers))
    assert loss.dtype == np.float32 and loss.shape == () and loss == loss_again
    for g, h in zip(sum(grads, []), sum(grads_again, [])):
        assert np.isfinite(g).all() and np.array_equal(g, h), f"seed {seed}"
    assert inputs[0] is None


def test_specs_and_init() -> None:
    for cfg in llama.MODELS.values():
        specs = llama.unit_specs(cfg)
        assert len(specs) == llama.Llama(cfg).num_units == cfg.layers + 2
        assert specs[0] == [("embed", (cfg.vocab, cfg.hidden))]
        assert specs[-1] == [("final_norm", (cfg.hidden,)), ("lm_head", (cfg.vocab, cfg.hidden))]
    small = llama.MODELS["small"]
    a, b = llama.init_params(small, seed=3), llama.init_params(small, seed=3)
    for spec, ua, ub in zip(llama.unit_specs(small), a, b):
        for (name, shape), pa, pb in zip(spec, ua, ub):
            assert pa.shape == shape and pa.dtype == np.float32 and np.array_equal(pa, pb)
            if name.endswith("norm"):
                assert (pa == 1).all()
    model = llama.Llama(TINY)
    tokens, _ = llama.batch(TINY, step=0, batch_size=1, first_sample=0)
    h, saved = model.forward(0, llama.init_params(TINY)[0], tokens)
    with pytest.raises(ValueError, match="grads_out"):
        model.backward(0, [np.ones((TINY.vocab, TINY.hidden), np.float32)], saved, h,
                       grads_out=[np.empty((1, TINY.hidden), np.float32)])
    with pytest.raises(ValueError, match="kv_heads"):
        llama.ModelConfig(vocab=8, hidden=32, layers=1, heads=4, kv_heads=3, ffn=8, seq=4)
