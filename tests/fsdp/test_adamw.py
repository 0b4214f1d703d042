"""FusedAdamW's NumPy path (CPU): math, rounding of the send shard, state, validation,
and parameter groups.

References, written here from scratch:

* a float64 AdamW in torch's formulation (decoupled decay, bias corrections,
  clipping by torch's ``clip_grad_norm_`` rule). Tolerance after ``STEPS``
  steps, elementwise, ``|got - ref| <= rtol * scale + atol``:
  - master: ``rtol = 3 * STEPS * 2**-24`` (1.8e-6), ``scale = |p_0| + |ref|``
    (covers ``|p|`` on every step, also where ``p`` crosses zero),
    ``atol = 1e-6 * lr``. Each step adds three float32 roundings of at most
    2**-25, 2**-24 and 2**-24 of ``|p|`` (the decay factor, ``p * decay``,
    ``p - update``), and the update, at most a few ``lr``, carries about ten
    roundings of 2**-24: well under ``1e-6 * lr`` over ten steps;
  - moments: ``rtol = 1e-6``, ``scale = |ref|``, ``atol = 1e-6`` times the
    largest term (``max|g|``, ``max g**2``): a few roundings a step, each
    shrunk by ``beta`` in later steps;
* the documented float32 formula ([Note: AdamW math]) evaluated one element at
  a time with NumPy float32 scalars: the path must equal it bitwise, which is
  what the GPU kernel is held to as well.

Parameter groups are held to torch.optim.AdamW with the same param groups (the
tolerance above, with each element's own lr), bitwise to one ungrouped
optimizer per group over that group's elements, and a frozen group (lr 0,
weight decay 0) to no change at all.

Parameters without a gradient in some steps (``params`` and ``present``,
[Note: absent gradients]) are held to torch.optim.AdamW with ``.grad = None``
for them (``RTOL_TORCH``, below: torch's CPU path rounds in another order, so
not bitwise), with and without groups and under a scheduled lr: the step
counts equal torch's ``state['step']``, and an absent parameter's master,
moments and send stay bitwise as they were. Bitwise: to one ungrouped
optimizer per parameter stepped only when it is present, and, with every
parameter present, to no ``params`` at all.

Data is fresh each run (the seed is in every failure message).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidearray import TideBackendError, TideInvalid
from tidearray._adamw import HOST_CHUNK, MAX_GROUPS, AdamW, ParamGroup, coefficients
from tidearray.fsdp._norm import GlobalNorm, clip_scale, host_sum_squares
from tidearray.fsdp._optim import FusedAdamW
from tidearray.fsdp._rows import MAX_ROWS, group_runs

from .._util import BF16, DTYPES, FP32, bits, fresh_seed

STEPS = 10
RTOL_MASTER = 3 * STEPS * 2**-24
ATOL_LR = 1e-6
RTOL = 1e-6


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = fresh_seed(bits=63)
    return np.random.default_rng(seed), seed


def _shards(rng: np.random.Generator, n: int, send_dtype: np.dtype = BF16):
    master = rng.standard_normal(n).astype(np.float32)
    return master, np.zeros(n, send_dtype)


def _grads(rng: np.random.Generator, n: int, steps: int) -> list[np.ndarray]:
    """Gradients spanning magnitudes, so both ``eps`` and ``sqrt(v)`` matter."""
    mag = 10.0 ** rng.uniform(-9, 0, n)
    return [(rng.standard_normal(n) * mag).astype(np.float32) for _ in range(steps)]


def _reference(master: np.ndarray, grads: list[np.ndarray], lrs: list[float], hp: AdamW):
    """float64 AdamW as torch computes it, clipping each step's gradient first."""
    p = master.astype(np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    b1, b2 = hp.betas
    for t, (g32, lr) in enumerate(zip(grads, lrs), start=1):
        g = g32.astype(np.float64)
        if hp.max_grad_norm is not None:
            coef = hp.max_grad_norm / (math.sqrt(np.dot(g, g)) + 1e-6)
            g = g * min(coef, 1.0)
        p = p * (1.0 - lr * hp.weight_decay)
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        denom = np.sqrt(v) / math.sqrt(1.0 - b2**t) + hp.eps
        p = p - lr / (1.0 - b1**t) * m / denom
    return p, m, v


def _clip_factor(g: np.ndarray, max_norm: Optional[float]) -> float:
    """The runtime's clip factor of ``g`` on one rank (its global norm, then the rule)."""
    return clip_scale(GlobalNorm(None, 1, np).compute(g, 1.0), max_norm)


def _run(opt: FusedAdamW, grads: list[np.ndarray], lrs: list[float]) -> None:
    """Steps the way the runtime will: global norm (one rank here), clip scale, step."""
    for g, lr in zip(grads, lrs):
        opt.step(g, grad_scale=_clip_factor(g, opt.hp.max_grad_norm), lr=lr)


def _assert_close(got: np.ndarray, ref: np.ndarray, rtol: float, atol: float, what: str,
                  seed: int, start: Optional[np.ndarray] = None) -> None:
    """``|got - ref| <= rtol * (|ref| + |start|) + atol`` elementwise (``start``: 0 if None)."""
    err = np.abs(got.astype(np.float64) - ref)
    scale = np.abs(ref) if start is None else np.abs(ref) + np.abs(start.astype(np.float64))
    bound = rtol * scale + atol
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (f"{what}: element {worst} off by {err[worst]:.3g} > "
                                  f"{bound[worst]:.3g} (seed {seed})")


@pytest.mark.parametrize("n", [1, 1000, 2 * HOST_CHUNK + 123])
def test_matches_float64_reference(rng, n: int) -> None:
    gen, seed = rng
    hp = AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
    master, send = _shards(gen, n)
    grads = _grads(gen, n, STEPS)
    lrs = [hp.lr * (0.5 + 0.5 * k / STEPS) for k in range(STEPS)]  # a warm-up schedule
    opt = FusedAdamW(hp, master.copy(), send, np)
    p_ref, m_ref, v_ref = _reference(master, grads, lrs, hp)
    _run(opt, grads, lrs)
    assert opt.step_count == STEPS
    g_max = max(float(np.abs(g).max()) for g in grads)
    _assert_close(opt._master, p_ref, RTOL_MASTER, ATOL_LR * hp.lr, "master", seed, master)
    _assert_close(opt.exp_avg, m_ref, RTOL, RTOL * g_max, "exp_avg", seed)
    _assert_close(opt.exp_avg_sq, v_ref, RTOL, RTOL * g_max**2, "exp_avg_sq", seed)


def _formula_f32(p: float, m: float, v: float, g: float, c) -> tuple:
    """[Note: AdamW math] for one element, in NumPy float32 scalars (each op rounds)."""
    f = np.float32
    g = f(g) * c.grad_scale
    p = f(p) * c.decay
    m = c.beta1 * f(m) + c.omb1 * g
    v = c.beta2 * f(v) + c.omb2 * (g * g)
    denom = np.sqrt(v) / c.bc2_sqrt + c.eps
    p = p - c.step_size * (m / denom)
    return p, m, v


def test_bitwise_equal_to_the_documented_float32_formula(rng) -> None:
    gen, seed = rng
    n = 300
    hp = AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    master, send = _shards(gen, n, FP32)
    opt = FusedAdamW(hp, master.copy(), send, np)
    p, m, v = master.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t, g in enumerate(_grads(gen, n, 4), start=1):
        c = coefficients(hp, t, hp.lr, 0.75)
        assert all(type(x) is np.float32 for x in c)
        for i in range(n):
            p[i], m[i], v[i] = _formula_f32(p[i], m[i], v[i], g[i], c)
        opt.step(g, grad_scale=0.75)
        for got, want, what in ((opt._master, p, "master"), (opt.exp_avg, m, "exp_avg"),
                                (opt.exp_avg_sq, v, "exp_avg_sq")):
            assert (bits(got) == bits(want)).all(), f"{what} at step {t} (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_send_is_the_rounded_master(rng, dtype: np.dtype) -> None:
    gen, seed = rng
    n = HOST_CHUNK + 7
    master, send = _shards(gen, n, dtype)
    opt = FusedAdamW(AdamW(lr=1e-2, weight_decay=0.01), master, send, np)
    for t, g in enumerate(_grads(gen, n, 3), start=1):
        opt.step(g)
        want = master.astype(dtype)  # RNE, as ml_dtypes and NumPy cast
        assert (bits(send) == bits(want)).all(), f"{dtype} send at step {t} (seed {seed})"


def test_no_send_shard_updates_the_same_master(rng) -> None:
    """``send=None`` (gathers that cast the masters) changes nothing but the send write."""
    gen, seed = rng
    n = 1000
    master, send = _shards(gen, n)
    with_send = FusedAdamW(AdamW(lr=1e-2, weight_decay=0.01), master.copy(), send, np)
    without = FusedAdamW(AdamW(lr=1e-2, weight_decay=0.01), master.copy(), None, np)
    for g in _grads(gen, n, 3):
        with_send.step(g)
        without.step(g)
    for a, b, what in ((with_send._master, without._master, "master"),
                       (with_send.exp_avg_sq, without.exp_avg_sq, "exp_avg_sq")):
        assert (bits(a) == bits(b)).all(), f"{what} (seed {seed})"
    assert not (bits(master) == bits(without._master)).all(), "the step did nothing"


def test_bf16_cast_rounds_to_nearest_even() -> None:
    """The cast the NumPy path relies on (and the kernel copies) is RNE, ties to even."""
    u = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF], np.uint32)
    got = u.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert list(got) == [0x3F80, 0x3F82, 0x3F81, 0x7F80]


def test_grad_scale_is_applied_first(rng) -> None:
    gen, _ = rng
    n, scale = 513, np.float32(0.37)
    master, _ = _shards(gen, n)
    grads = _grads(gen, n, 3)
    a = FusedAdamW(AdamW(weight_decay=0.1), master.copy(), np.zeros(n, BF16), np)
    b = FusedAdamW(AdamW(weight_decay=0.1), master.copy(), np.zeros(n, BF16), np)
    for g in grads:
        a.step(g, grad_scale=float(scale))
        b.step(g * scale)  # the same float32 product, made outside
    for x, y in ((a._master, b._master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
        assert (bits(x) == bits(y)).all()


@pytest.mark.parametrize("norm, max_norm, want", [
    (3.0, None, 1.0),
    (0.5, 1.0, 1.0),
    (1.0, 1.0, 1.0 / (1.0 + 1e-6)),  # clipped by a hair, as in torch
    (4.0, 1.0, 1.0 / (4.0 + 1e-6)),
    (0.0, 2.0, 1.0),
    (math.inf, 1.0, 0.0),
])
def test_clip_scale_rule(norm: float, max_norm: Optional[float], want: float) -> None:
    assert clip_scale(norm, max_norm) == want


def test_clip_scale_nan_propagates() -> None:
    assert math.isnan(clip_scale(math.nan, 1.0))


def test_sum_squares_in_float64(rng) -> None:
    gen, _ = rng
    n = 3 * HOST_CHUNK + 5
    g = _grads(gen, n, 1)[0]
    want = math.fsum(float(x) * float(x) for x in g)
    assert host_sum_squares(g) == pytest.approx(want, rel=1e-12)
    norm = GlobalNorm(None, 1, np)
    assert norm.compute(g, 0.5) == math.sqrt(host_sum_squares(g)) * 0.5
    assert norm.local[0] == host_sum_squares(g)  # this rank's sum, left by the call


def test_state_dict_round_trip_is_bitwise(rng) -> None:
    gen, _ = rng
    n = 777
    hp = AdamW(weight_decay=0.1)
    master, send = _shards(gen, n)
    grads = _grads(gen, n, 5)
    a = FusedAdamW(hp, master, send, np)
    for g in grads[:3]:
        a.step(g)
    state, saved = a.state_dict(), master.copy()
    b = FusedAdamW(hp, saved, np.zeros(n, BF16), np)
    b.load_state_dict(state)
    assert b.step_count == 3
    for g in grads[3:]:
        a.step(g)
        b.step(g)
    for x, y in ((a._master, b._master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq),
                 (send, b._send)):
        assert (bits(x) == bits(y)).all()


def test_state_dict_is_a_copy(rng) -> None:
    gen, _ = rng
    opt = FusedAdamW(AdamW(), *_shards(gen, 16), np)
    state = opt.state_dict()
    opt.step(_grads(gen, 16, 1)[0])
    assert state["step"] == 0 and not state["exp_avg"].any()


@pytest.mark.parametrize("kw", [
    {"lr": -1.0}, {"lr": math.nan}, {"lr": math.inf}, {"lr": "0.1"}, {"lr": True},
    {"betas": (1.0, 0.9)}, {"betas": (0.9, -0.1)}, {"betas": (0.9,)}, {"betas": 0.9},
    {"eps": -1e-8}, {"weight_decay": -0.1}, {"weight_decay": math.nan},
    {"max_grad_norm": 0.0}, {"max_grad_norm": -1.0}, {"max_grad_norm": math.inf},
])
def test_bad_hyper_parameters(kw: dict) -> None:
    with pytest.raises(TideInvalid, match="expected"):
        AdamW(**kw)


def test_hyper_parameters_normalised() -> None:
    hp = AdamW(betas=[0.8, 0.9])
    assert hp.betas == (0.8, 0.9) and hash(hp) == hash(AdamW(betas=(0.8, 0.9)))


def _bad_constructions() -> list:
    m = np.zeros(8, np.float32)
    return [
        ("master", (np.zeros(8, np.float64), np.zeros(8, BF16))),
        ("master", (np.zeros((2, 4), np.float32), np.zeros(8, BF16))),
        ("master", (np.zeros(16, np.float32)[::2], np.zeros(8, BF16))),
        ("master", ([0.0] * 8, np.zeros(8, BF16))),
        ("send", (np.zeros(8, np.float32), np.zeros(7, BF16))),
        ("send", (np.zeros(8, np.float32), np.zeros(8, np.int32))),
        ("send", (m, m)),
        ("send", (m, m.view(np.float32)[:])),
    ]


@pytest.mark.parametrize("case", range(len(_bad_constructions())))
def test_bad_construction(case: int) -> None:
    what, (master, send) = _bad_constructions()[case]
    with pytest.raises(TideInvalid, match=f"{what}: expected"):
        FusedAdamW(AdamW(), master, send, np)


def test_bad_module_and_hp() -> None:
    with pytest.raises(TideInvalid, match="xp: expected"):
        FusedAdamW(AdamW(), np.zeros(4, np.float32), np.zeros(4, BF16), math)
    with pytest.raises(TideInvalid, match="hp: expected"):
        FusedAdamW({"lr": 1e-3}, np.zeros(4, np.float32), np.zeros(4, BF16), np)


def test_bad_step_arguments() -> None:
    opt = FusedAdamW(AdamW(), np.zeros(8, np.float32), np.zeros(8, BF16), np)
    for grad, kw, what in [(np.zeros(7, np.float32), {}, "grad"),
                           (np.zeros(8, BF16), {}, "grad"),
                           (np.zeros(8, np.float32), {"lr": -1.0}, "lr"),
                           (np.zeros(8, np.float32), {"grad_scale": "2"}, "grad_scale")]:
        with pytest.raises(TideInvalid, match=f"{what}: expected"):
            opt.step(grad, **kw)
    assert opt.step_count == 0  # nothing ran


def test_bad_state() -> None:
    opt = FusedAdamW(AdamW(), np.zeros(8, np.float32), np.zeros(8, BF16), np)
    ok = {"step": 2, "exp_avg": np.ones(8, np.float32), "exp_avg_sq": np.ones(8, np.float32)}
    for bad, what in [({k: ok[k] for k in ("step", "exp_avg")}, "state"),
                      ({**ok, "step": -1}, "state\\['step'\\]"),
                      ({**ok, "step": 1.5}, "state\\['step'\\]"),
                      ({**ok, "exp_avg_sq": np.ones(9, np.float32)}, "state\\['exp_avg_sq'\\]")]:
        with pytest.raises(TideInvalid, match=f"{what}: expected"):
            opt.load_state_dict(bad)
    assert opt.step_count == 0 and not opt.exp_avg.any()  # nothing was copied
    opt.load_state_dict(ok)
    assert opt.step_count == 2 and (opt.exp_avg == 1).all()


def test_matches_torch_adamw(rng) -> None:
    """torch.optim.AdamW on the same float32 data. Twice the reference's tolerance: both
    round in float32, in different orders (torch uses ``lerp`` for the first moment)."""
    torch = pytest.importorskip("torch")
    gen, seed = rng
    n = 4099
    hp = AdamW(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
    start, send = _shards(gen, n)
    master = start.copy()
    grads = _grads(gen, n, STEPS)
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    ref = torch.optim.AdamW([param], lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    opt = FusedAdamW(hp, master, send, np)
    # One thread: torch's CPU result with several varied from process to process on the
    # same inputs (by up to ~1e-4 of an element, in about one run in three), ours did not.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for g in grads:
            param.grad = torch.from_numpy(g.copy())
            torch.nn.utils.clip_grad_norm_([param], hp.max_grad_norm)
            ref.step()
    finally:
        torch.set_num_threads(threads)
    _run(opt, grads, [hp.lr] * STEPS)
    want = param.detach().numpy().astype(np.float64)
    _assert_close(master, want, 2 * RTOL_MASTER, 2 * ATOL_LR * hp.lr, "master vs torch", seed,
                  start)
    st = ref.state[param]
    g_max = max(float(np.abs(g).max()) for g in grads)
    _assert_close(opt.exp_avg, st["exp_avg"].numpy().astype(np.float64), 2 * RTOL,
                  2 * RTOL * g_max, "exp_avg vs torch", seed)


# -- parameter groups ----------------------------------------------------------------------

#: The default group decays and clips; group 1 is the norms and biases (no decay, its own
#: lr, betas and eps); group 2 a frozen one; group 3 another lr and decay.
GROUP_HP = AdamW(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
GROUP_HPS = (AdamW(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
             AdamW(lr=0.0, weight_decay=0.0),
             AdamW(lr=1e-3, betas=(0.95, 0.999), eps=1e-7, weight_decay=0.3))


def _segments(gen: np.random.Generator, count: int = 14) -> list[tuple[int, int, int]]:
    """Consecutive ``(start, stop, group)`` pieces of an arena, like parameters laid out
    one after another; each piece in a random group (0: the default)."""
    sizes = gen.integers(1, 700, count)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    groups = gen.integers(0, len(GROUP_HPS) + 1, count)
    return [(int(a), int(b), int(j)) for a, b, j in zip(starts[:-1], starts[1:], groups)]


def _param_groups(segments: list[tuple[int, int, int]]) -> list[ParamGroup]:
    return [ParamGroup(hp, tuple((a, b) for a, b, j in segments if j == k))
            for k, hp in enumerate(GROUP_HPS, start=1)]


def _lr_arg(mode: str, k: int):
    """Step ``k``'s ``lr`` argument: None, a warm-up factor as one float, or per group."""
    factor = 0.5 + 0.5 * k / STEPS
    if mode == "none":
        return None
    if mode == "float":
        return GROUP_HP.lr * factor
    return [h.lr * factor * (1 + j) for j, h in enumerate((GROUP_HP, *GROUP_HPS))]


def _group_lrs(mode: str, k: int) -> list[float]:
    """What each group's lr is at step ``k`` under ``mode``, by the documented rule."""
    lr = _lr_arg(mode, k)
    hps = (GROUP_HP, *GROUP_HPS)
    if lr is None:
        return [h.lr for h in hps]
    if mode == "float":
        return [lr] + [h.lr * (lr / GROUP_HP.lr) for h in GROUP_HPS]
    return lr


def test_groups_match_torch_adamw(rng) -> None:
    """torch.optim.AdamW with one torch param group per ParamGroup, each piece of the arena
    a parameter, clipped over all of them, a scheduler scaling every group's lr."""
    torch = pytest.importorskip("torch")
    gen, seed = rng
    segments = _segments(gen)
    n = segments[-1][1]
    start, send = _shards(gen, n)
    master = start.copy()
    grads = _grads(gen, n, STEPS)
    params = [torch.nn.Parameter(torch.from_numpy(start[a:b].copy())) for a, b, _ in segments]
    hps = (GROUP_HP, *GROUP_HPS)
    ref = torch.optim.AdamW(
        [{"params": [p for p, (_, _, j) in zip(params, segments) if j == k], "lr": h.lr,
          "betas": h.betas, "eps": h.eps, "weight_decay": h.weight_decay}
         for k, h in enumerate(hps)], foreach=False)
    opt = FusedAdamW(GROUP_HP, master, send, np, _param_groups(segments))
    for k, g in enumerate(grads):
        for p, (a, b, _) in zip(params, segments):
            p.grad = torch.from_numpy(g[a:b].copy())
        for group, lr in zip(ref.param_groups, _group_lrs("float", k)):
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(params, GROUP_HP.max_grad_norm)
        ref.step()
        opt.step(g, grad_scale=_clip_factor(g, GROUP_HP.max_grad_norm), lr=_lr_arg("float", k))
    want = np.concatenate([p.detach().numpy() for p in params]).astype(np.float64)
    lr_of = np.concatenate([np.full(b - a, max(hps[j].lr, 1e-30)) for a, b, j in segments])
    _assert_close(master, want, 2 * RTOL_MASTER, 2 * ATOL_LR * lr_of, "master vs torch", seed,
                  start)
    m_ref = np.concatenate([ref.state[p]["exp_avg"].numpy() for p in params])
    g_max = max(float(np.abs(g).max()) for g in grads)
    _assert_close(opt.exp_avg, m_ref.astype(np.float64), 2 * RTOL, 2 * RTOL * g_max,
                  "exp_avg vs torch", seed)


@pytest.mark.parametrize("mode", ["none", "float", "sequence"])
def test_groups_bitwise_equal_one_optimizer_per_group(rng, mode: str) -> None:
    """Each run of one group steps exactly as an ungrouped optimizer with that group's
    hyper-parameters and lr would (same step count, same grad_scale)."""
    gen, seed = rng
    segments = _segments(gen)
    n = segments[-1][1]
    master, send = _shards(gen, n)
    opt = FusedAdamW(GROUP_HP, master.copy(), send, np, _param_groups(segments))
    assert opt.num_groups == len(GROUP_HPS) + 1 and len(opt.groups) == len(GROUP_HPS)
    hps = (dataclasses.replace(GROUP_HP, max_grad_norm=None), *GROUP_HPS)
    alone = [FusedAdamW(hps[j], master[a:b].copy(), np.zeros(b - a, BF16), np)
             for a, b, j in segments]
    for k, g in enumerate(_grads(gen, n, 4)):
        opt.step(g, grad_scale=0.75, lr=_lr_arg(mode, k))
        lrs = _group_lrs(mode, k)
        for o, (a, b, j) in zip(alone, segments):
            o.step(g[a:b].copy(), grad_scale=0.75, lr=lrs[j])
    for o, (a, b, _) in zip(alone, segments):
        for got, want, what in ((opt._master[a:b], o._master, "master"),
                                (opt.exp_avg[a:b], o.exp_avg, "exp_avg"),
                                (opt.exp_avg_sq[a:b], o.exp_avg_sq, "exp_avg_sq"),
                                (send[a:b], o._send, "send")):
            assert (bits(got) == bits(want)).all(), f"{what} of [{a}, {b}) (seed {seed})"


@pytest.mark.parametrize("dtype", [*DTYPES, None], ids=lambda d: getattr(d, "name", "no-send"))
def test_frozen_group_is_bitwise_unchanged(rng, dtype: Optional[np.dtype]) -> None:
    gen, seed = rng
    n = 2 * HOST_CHUNK + 77
    master = gen.standard_normal(n).astype(np.float32)
    master[gen.integers(0, n, 50)] = 0.0  # zero-initialised biases stay +0.0 too
    send = None if dtype is None else master.astype(dtype)  # as the runtime starts it
    frozen = ((5, 900), (HOST_CHUNK - 3, HOST_CHUNK + 4000), (n - 10, n))
    groups = [ParamGroup(AdamW(lr=0.0, weight_decay=0.0), frozen),
              ParamGroup(AdamW(lr=1e-2, weight_decay=0.0), ((900, 2000),))]
    before = master.copy(), None if send is None else send.copy()
    opt = FusedAdamW(AdamW(lr=1e-2, weight_decay=0.1), master, send, np, groups)
    for k, g in enumerate(_grads(gen, n, 5)):
        opt.step(g, lr=None if k % 2 else 1e-2 * (k + 1))
    inside = np.zeros(n, bool)
    for a, b in frozen:
        inside[a:b] = True
    for got, want, what in ((master, before[0], "master"), (send, before[1], "send")):
        if got is None:
            continue
        assert (bits(got)[inside] == bits(want)[inside]).all(), f"frozen {what} (seed {seed})"
        assert (bits(got)[~inside] != bits(want)[~inside]).mean() > 0.5, f"{what}: no step"
    assert opt.exp_avg[inside].any(), "a frozen group's moments advance, as in torch"


def test_no_groups_is_one_default_group(rng) -> None:
    """``groups=None``, ``[]``, and groups whose ranges are all empty step alike."""
    gen, _ = rng
    n = 1000
    master, _ = _shards(gen, n)
    hp = AdamW(lr=1e-2, weight_decay=0.05)
    opts = [FusedAdamW(hp, master.copy(), np.zeros(n, BF16), np, groups)
            for groups in (None, [], [ParamGroup(AdamW(lr=0.5), ((3, 3),)),
                                      ParamGroup(AdamW(), ())])]
    for g in _grads(gen, n, 3):
        for o in opts:
            o.step(g, lr=5e-3)
    assert [o.num_groups for o in opts] == [1, 1, 3]
    for o in opts[1:]:
        assert (bits(o._master) == bits(opts[0]._master)).all()
        assert (bits(o._send) == bits(opts[0]._send)).all()


def test_lr_sequence_of_one_without_groups(rng) -> None:
    gen, _ = rng
    master, _ = _shards(gen, 64)
    a = FusedAdamW(AdamW(), master.copy(), None, np)
    b = FusedAdamW(AdamW(), master.copy(), None, np)
    g = _grads(gen, 64, 1)[0]
    a.step(g, lr=3e-3)
    b.step(g, lr=(3e-3,))
    assert (bits(a._master) == bits(b._master)).all()


def test_float_lr_with_zero_default_lr() -> None:
    """No ratio to scale by: refused with groups; without, the float is the lr, as before."""
    m = np.zeros(8, np.float32)
    with_groups = FusedAdamW(AdamW(lr=0.0), m.copy(), None, np, [ParamGroup(AdamW(), ((0, 4),))])
    with pytest.raises(TideInvalid, match="lr: expected None or 2 reals"):
        with_groups.step(np.ones(8, np.float32), lr=1e-3)
    with_groups.step(np.ones(8, np.float32), lr=[0.0, 1e-3])
    alone = FusedAdamW(AdamW(lr=0.0), m.copy(), None, np)
    alone.step(np.ones(8, np.float32), lr=1e-3)
    assert alone._master.any()


run_lists = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20), st.integers(0, 3)),
                     max_size=8)


@given(run_lists, st.integers(0, 30))
def test_group_runs_label_every_element(pieces: list, tail: int) -> None:
    """``group_runs`` against a per-element labelling: maximal, ordered, covering runs."""
    groups: list[list[tuple[int, int]]] = [[], [], []]
    pos, label = 0, []
    for gap, size, j in pieces:  # a gap of default elements, then a piece of group j
        label += [0] * gap + [j] * size
        if j:
            groups[j - 1].append((pos + gap, pos + gap + size))
        pos += gap + size
    size = pos + tail
    label += [0] * tail
    runs = group_runs(size, [ParamGroup(AdamW(), tuple(r)) for r in groups])
    assert [j for a, b, j in runs for _ in range(a, b)] == label
    assert all(a < b for a, b, _ in runs)
    assert all(r[1] == s[0] and r[2] != s[2] for r, s in zip(runs, runs[1:]))


@pytest.mark.parametrize("kw, what", [
    ({"hp": AdamW(max_grad_norm=1.0), "ranges": ()}, "ParamGroup.hp.max_grad_norm"),
    ({"hp": {"lr": 1.0}, "ranges": ()}, "ParamGroup.hp"),
    ({"hp": AdamW(), "ranges": ((3, 2),)}, "ParamGroup.ranges\\[0\\]"),
    ({"hp": AdamW(), "ranges": ((0, 1), (-1, 2))}, "ParamGroup.ranges\\[1\\]"),
    ({"hp": AdamW(), "ranges": ((0.0, 2),)}, "ParamGroup.ranges\\[0\\]"),
    ({"hp": AdamW(), "ranges": ((True, 2),)}, "ParamGroup.ranges\\[0\\]"),
    ({"hp": AdamW(), "ranges": ((1,),)}, "ParamGroup.ranges\\[0\\]"),
    ({"hp": AdamW(), "ranges": (1, 2)}, "ParamGroup.ranges\\[0\\]"),
    ({"hp": AdamW(), "ranges": 5}, "ParamGroup.ranges"),
])
def test_bad_param_group(kw: dict, what: str) -> None:
    with pytest.raises(TideInvalid, match=f"{what}: expected"):
        ParamGroup(**kw)


def test_param_group_normalised() -> None:
    g = ParamGroup(AdamW(), [[np.int64(1), 3], (5, 5)])
    assert g.ranges == ((1, 3), (5, 5)) and type(g.ranges[0][0]) is int and hash(g)


@pytest.mark.parametrize("groups, what", [
    ([ParamGroup(AdamW(), ((0, 11),))], "groups\\[0\\].ranges"),
    ([ParamGroup(AdamW(), ((11, 11),))], "groups\\[0\\].ranges"),
    ([ParamGroup(AdamW(), ((0, 4),)), ParamGroup(AdamW(), ((3, 6),))], "groups\\[1\\].ranges"),
    ([ParamGroup(AdamW(), ((2, 8),)), ParamGroup(AdamW(), ((0, 1), (4, 5)))],
     "groups\\[1\\].ranges"),
    ([ParamGroup(AdamW(), ((0, 4), (6, 8), (3, 5)))], "groups\\[0\\].ranges"),
    ([ParamGroup(AdamW(), ((0, 1),))] * 2, "groups\\[1\\].ranges"),
    ([ParamGroup(AdamW(), ())] * MAX_GROUPS, "groups"),
    ([ParamGroup(AdamW(), ()), {"hp": AdamW()}], "groups\\[1\\]"),
    (ParamGroup(AdamW(), ()), "groups"),
])
def test_bad_groups(groups, what: str) -> None:
    with pytest.raises(TideInvalid, match=f"{what}: expected"):
        FusedAdamW(AdamW(), np.zeros(10, np.float32), None, np, groups)


def test_most_groups() -> None:
    groups = [ParamGroup(AdamW(lr=1e-3 * j), ((j, j + 1),)) for j in range(MAX_GROUPS - 1)]
    opt = FusedAdamW(AdamW(), np.ones(20, np.float32), None, np, groups)
    assert opt.num_groups == MAX_GROUPS
    opt.step(np.ones(20, np.float32))
    assert opt._master[0] == 1.0 and (opt._master[1:] < 1.0).all()  # group 1 has lr 0


@pytest.mark.parametrize("lr, what", [
    ([1e-3], "lr"), ([1e-3, 1e-3, 1e-3, 1e-3], "lr"), ((1e-3, -1.0, 0.0), "lr\\[1\\]"),
    ([1e-3, math.nan, 0.0], "lr\\[1\\]"), ([1e-3, 0.0, "0.1"], "lr\\[2\\]"),
    ("0.1", "lr"), (np.array([1e-3, 0.0, 0.0]), "lr"),
])
def test_bad_group_lr(lr, what: str) -> None:
    groups = [ParamGroup(AdamW(), ((0, 2),)), ParamGroup(AdamW(), ((4, 6),))]
    opt = FusedAdamW(AdamW(), np.zeros(8, np.float32), None, np, groups)
    with pytest.raises(TideInvalid, match=f"{what}: expected"):
        opt.step(np.zeros(8, np.float32), lr=lr)
    assert opt.step_count == 0  # nothing ran


# -- absent gradients: per-parameter step counts ----------------------------------------

#: torch.optim.AdamW's CPU path rounds in another order (``lerp`` for the first moment,
#: ``addcmul``, ``addcdiv``), so not bitwise: over ``ABSENT_STEPS`` steps the masters
#: agree within ``RTOL_TORCH * (|p_0| + |ref|) + ATOL_LR * lr`` (the second term for
#: elements near zero, whose updates of about ``lr`` carry the roundings; seen: about
#: 2.3e-7 and 0.07e-6 of those).
RTOL_TORCH = 1e-6
ABSENT_STEPS = 12
#: Group 1 decays, group 2 has half the default lr (a scheduler keeps the ratio).
ABSENT_HP = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
ABSENT_HPS = (AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
              AdamW(lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01))


class _Layout:
    """Parameters of odd sizes with gaps between them (the implicit parameter), in a
    random order, one of them empty; each in a random group (0 without groups); and
    which are present at each step: parameter 0 at none, parameter 1 at all but the
    first, the others at random."""

    def __init__(self, gen: np.random.Generator, grouped: bool, count: int = 8) -> None:
        sizes, gaps = gen.integers(1, 400, count), gen.integers(0, 40, count + 1)
        sizes[gen.integers(2, count)] = 0  # a parameter with none of this shard
        bounds, pos = [], 0
        for size, gap in zip(sizes.tolist(), gaps.tolist()):
            bounds.append((pos + gap, pos + gap + size))
            pos += gap + size
        self.n = pos + int(gaps[-1])
        order = gen.permutation(count)
        self.params = [bounds[i] for i in order]  # given in any order
        self.group = gen.integers(0, 3, count) if grouped else np.zeros(count, np.int64)
        self.present = gen.random((ABSENT_STEPS, count)) < 0.65
        self.present[:, 0] = False
        self.present[:, 1] = True
        self.present[0, 1] = False
        implicit = np.ones(self.n, bool)
        for a, b in self.params:
            implicit[a:b] = False
        self.implicit = implicit

    def groups(self) -> Optional[list[ParamGroup]]:
        if not self.group.any():
            return None
        return [ParamGroup(hp, tuple(r for r, j in zip(self.params, self.group) if j == k))
                for k, hp in enumerate(ABSENT_HPS, start=1)]

    def lr(self, k: int) -> float:
        """The scheduled lr of step ``k`` (a warm-up, then a decay)."""
        return ABSENT_HP.lr * min(1.0, (k + 1) / 4) * (1.0 - k / (2 * ABSENT_STEPS))


def _absent_grads(gen: np.random.Generator, n: int) -> list[np.ndarray]:
    return _grads(gen, n, ABSENT_STEPS)


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
def test_absent_parameters_match_torch_adamw(rng, grouped: bool) -> None:
    """torch.optim.AdamW with ``.grad = None`` for the absent parameters: the masters within
    ``RTOL_TORCH``, the counts equal to torch's ``state['step']``, and an absent
    parameter's master, moments and send bitwise unchanged by the step."""
    torch = pytest.importorskip("torch")
    gen, seed = rng
    lay = _Layout(gen, grouped)
    start, send = _shards(gen, lay.n)
    master = start.copy()
    grads = _absent_grads(gen, lay.n)
    opt = FusedAdamW(ABSENT_HP, master, send, np, lay.groups(), params=lay.params)
    tensors = [torch.nn.Parameter(torch.from_numpy(start[a:b].copy())) for a, b in lay.params]
    rest = torch.nn.Parameter(torch.from_numpy(start[lay.implicit].copy()))
    hps = (ABSENT_HP, *ABSENT_HPS)
    ref = torch.optim.AdamW(
        [{"params": [t for t, j in zip(tensors, lay.group) if j == k] + ([rest] if k == 0 else []),
          "lr": h.lr, "betas": h.betas, "eps": h.eps, "weight_decay": h.weight_decay}
         for k, h in enumerate(hps)], foreach=False, fused=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_matches_torch_adamw
    try:
        for k, g in enumerate(grads):
            for t, (a, b), on in zip(tensors, lay.params, lay.present[k]):
                t.grad = torch.from_numpy(g[a:b].copy()) if on else None
            rest.grad = torch.from_numpy(g[lay.implicit].copy())
            for group, h in zip(ref.param_groups, hps):
                group["lr"] = h.lr * lay.lr(k) / ABSENT_HP.lr
            ref.step()
            before = [x.copy() for x in (master, opt.exp_avg, opt.exp_avg_sq, send)]
            opt.step(g, lr=lay.lr(k), present=lay.present[k].tolist())
            for (a, b), on in zip(lay.params, lay.present[k]):
                for x, y, what in zip(before, (master, opt.exp_avg, opt.exp_avg_sq, send),
                                      ("master", "exp_avg", "exp_avg_sq", "send")):
                    assert on or (bits(x[a:b]) == bits(y[a:b])).all(), (
                        f"absent [{a}, {b}) {what} changed at step {k + 1} (seed {seed})")
    finally:
        torch.set_num_threads(threads)
    steps = [int(ref.state[t]["step"]) if t in ref.state else 0 for t in tensors]
    assert opt.param_steps.tolist() == steps, f"seed {seed}"
    assert opt.param_steps[0] == 0 and opt.param_steps[1] == ABSENT_STEPS - 1
    want = np.empty(lay.n)
    for t, (a, b) in zip(tensors, lay.params):
        want[a:b] = t.detach().numpy()
    want[lay.implicit] = rest.detach().numpy()
    _assert_close(master, want, RTOL_TORCH, ATOL_LR * ABSENT_HP.lr, "master vs torch", seed,
                  start)
    a, b = lay.params[0]
    assert (bits(master[a:b]) == bits(start[a:b])).all() and not opt.exp_avg_sq[a:b].any()


def _alone(lay: _Layout, start: np.ndarray, i: int) -> FusedAdamW:
    """Parameter ``i`` alone: an ungrouped optimizer with its group's hyper-parameters."""
    a, b = lay.params[i]
    hp = (ABSENT_HP, *ABSENT_HPS)[int(lay.group[i])]
    return FusedAdamW(hp, start[a:b].copy(), np.zeros(b - a, BF16), np)


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
def test_absent_parameters_bitwise_equal_one_optimizer_per_parameter(rng, grouped) -> None:
    """Each parameter steps bitwise as an optimizer of its own that is stepped only when
    the parameter is present (its step count is its own), at its group's lr; the
    implicit elements as one stepped every time."""
    gen, seed = rng
    lay = _Layout(gen, grouped)
    start, send = _shards(gen, lay.n)
    opt = FusedAdamW(ABSENT_HP, start.copy(), send, np, lay.groups(), params=lay.params)
    alone = [_alone(lay, start, i) for i in range(len(lay.params))]
    rest = FusedAdamW(ABSENT_HP, start[lay.implicit].copy(), None, np)
    for k, g in enumerate(_absent_grads(gen, lay.n)):
        opt.step(g, grad_scale=0.5, lr=lay.lr(k), present=np.asarray(lay.present[k]))
        rest.step(g[lay.implicit].copy(), grad_scale=0.5, lr=lay.lr(k))
        for o, (a, b), j, on in zip(alone, lay.params, lay.group, lay.present[k]):
            if on:
                lr = (ABSENT_HP, *ABSENT_HPS)[j].lr * lay.lr(k) / ABSENT_HP.lr
                o.step(g[a:b].copy(), grad_scale=0.5, lr=lr)
    assert opt.param_steps.tolist() == [o.step_count for o in alone]
    assert opt.step_count == ABSENT_STEPS
    for o, (a, b) in zip(alone, lay.params):
        for got, want, what in ((opt._master[a:b], o._master, "master"),
                                (opt.exp_avg[a:b], o.exp_avg, "exp_avg"),
                                (opt.exp_avg_sq[a:b], o.exp_avg_sq, "exp_avg_sq"),
                                (send[a:b], o._send, "send")):
            assert (bits(got) == bits(want)).all(), f"{what} of [{a}, {b}) (seed {seed})"
    assert (bits(opt._master[lay.implicit]) == bits(rest._master)).all(), f"seed {seed}"


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
def test_every_parameter_present_is_bitwise_params_none(rng, grouped: bool) -> None:
    """``params`` with every parameter present (``present`` None or all True) steps
    bitwise as no ``params`` at all: one row per group, the rows of groups alone."""
    gen, seed = rng
    lay = _Layout(gen, grouped)
    start, _ = _shards(gen, lay.n)
    opts = [FusedAdamW(ABSENT_HP, start.copy(), np.zeros(lay.n, BF16), np, lay.groups(),
                       params=params) for params in (None, lay.params, lay.params)]
    for k, g in enumerate(_grads(gen, lay.n, 4)):
        opts[0].step(g, lr=lay.lr(k))
        opts[1].step(g, lr=lay.lr(k))
        opts[2].step(g, lr=lay.lr(k), present=[True] * len(lay.params))
    for o in opts[1:]:
        assert o.param_steps.tolist() == [4] * len(lay.params)
        for x, y in ((o._master, opts[0]._master), (o._send, opts[0]._send),
                     (o.exp_avg, opts[0].exp_avg), (o.exp_avg_sq, opts[0].exp_avg_sq)):
            assert (bits(x) == bits(y)).all(), f"seed {seed}"
    held = set(opts[1]._pieces.group.tolist())  # the groups with elements here
    assert opts[1]._row_of_pair == {j: j for j in held}, "group j at lag 0 is row j"


def test_state_dict_round_trip_with_param_steps(rng) -> None:
    gen, seed = rng
    lay = _Layout(gen, grouped=True)
    start, _ = _shards(gen, lay.n)
    grads = _absent_grads(gen, lay.n)
    a = FusedAdamW(ABSENT_HP, start.copy(), np.zeros(lay.n, BF16), np, lay.groups(),
                   params=lay.params)
    for k in range(5):
        a.step(grads[k], present=lay.present[k].tolist())
    state = a.state_dict()
    assert state["param_steps"].dtype == np.int64
    assert state["param_steps"].tolist() == lay.present[:5].sum(0).tolist()
    b = FusedAdamW(ABSENT_HP, a._master.copy(), np.zeros(lay.n, BF16), np, lay.groups(),
                   params=lay.params)
    b.load_state_dict(state)
    assert b.step_count == 5 and (b.param_steps == a.param_steps).all()
    for k in range(5, ABSENT_STEPS):
        a.step(grads[k], present=lay.present[k].tolist())
        b.step(grads[k], present=lay.present[k].tolist())
    for x, y in ((a._master, b._master), (a.exp_avg, b.exp_avg), (a._send, b._send)):
        assert (bits(x) == bits(y)).all(), f"seed {seed}"
    assert "param_steps" not in FusedAdamW(AdamW(), start, None, np).state_dict()


def test_old_state_sets_every_count_to_step(rng) -> None:
    """A state without ``param_steps`` (saved before them) loads with every parameter at
    ``step``: as if each had been present at every step."""
    gen, seed = rng
    lay = _Layout(gen, grouped=False)
    start, _ = _shards(gen, lay.n)
    grads = _absent_grads(gen, lay.n)
    old = FusedAdamW(ABSENT_HP, start.copy(), None, np)  # no params: an old-style state
    for g in grads[:3]:
        old.step(g)
    new = FusedAdamW(ABSENT_HP, old._master.copy(), None, np, params=lay.params)
    new.load_state_dict(old.state_dict())
    assert new.param_steps.tolist() == [3] * len(lay.params)
    full = FusedAdamW(ABSENT_HP, start.copy(), None, np, params=lay.params)
    for g in grads[:3]:
        full.step(g)
    for k in range(3, 8):
        new.step(grads[k], present=lay.present[k].tolist())
        full.step(grads[k], present=lay.present[k].tolist())
    assert (new.param_steps == full.param_steps).all()
    assert (bits(new._master) == bits(full._master)).all(), f"seed {seed}"


@pytest.mark.parametrize("params, what", [
    ([(0, 4), (3, 6)], "params\\[1\\]"),
    ([(5, 8), (0, 6)], "params\\[0\\]"),
    ([(0, 11)], "params\\[0\\]"),
    ([(4, 3)], "params\\[0\\]"),
    ([(-1, 3)], "params\\[0\\]"),
    ([(0.0, 3)], "params\\[0\\]"),
    ([(True, 3)], "params\\[0\\]"),
    ([(1, 2, 3)], "params\\[0\\]"),
    ([3], "params\\[0\\]"),
    (5, "params"),
    ("01", "params"),
])
def test_bad_params(params, what: str) -> None:
    with pytest.raises(TideInvalid, match=f"{what}: expected"):
        FusedAdamW(AdamW(), np.zeros(10, np.float32), None, np, params=params)


def test_bad_present() -> None:
    opt = FusedAdamW(AdamW(), np.ones(10, np.float32), None, np, params=[(0, 4), (4, 4)])
    g = np.ones(10, np.float32)
    for present, what in [([True], "present"), ([True, True, True], "present"),
                          ([True, 1], "present\\[1\\]"), (["yes", True], "present\\[0\\]"),
                          (np.array([1, 0]), "present\\[0\\]"), (True, "present"),
                          ("ab", "present")]:
        with pytest.raises(TideInvalid, match=f"{what}: expected"):
            opt.step(g, present=present)
    assert opt.step_count == 0 and (opt._master == 1).all()  # nothing ran
    with pytest.raises(TideInvalid, match="present: expected None or 0 bools"):
        FusedAdamW(AdamW(), np.ones(10, np.float32), None, np).step(g, present=[True])
    opt.step(g, present=np.array([False, True]))
    assert opt.param_steps.tolist() == [0, 1] and (opt._master[:4] == 1).all()


def test_bad_param_steps() -> None:
    opt = FusedAdamW(AdamW(), np.zeros(8, np.float32), None, np, params=[(0, 4), (4, 8)])
    ok = {"step": 3, "exp_avg": np.ones(8, np.float32), "exp_avg_sq": np.ones(8, np.float32)}
    for bad in ([1], [1, 2, 3], [1, 4], [-1, 2], [1.0, 2.0], np.array([[1, 2]])):
        with pytest.raises(TideInvalid, match="state\\['param_steps'\\]: expected 2 integers"):
            opt.load_state_dict({**ok, "param_steps": bad})
    assert opt.step_count == 0 and not opt.exp_avg.any()  # nothing was copied
    opt.load_state_dict({**ok, "param_steps": [0, 3]})
    assert opt.param_steps.tolist() == [0, 3]


def test_too_many_rows_is_refused() -> None:
    """More distinct (group, count) pairs than ``MAX_ROWS`` in one step: refused, and the
    optimizer is as it was; one fewer steps."""
    count = MAX_ROWS + 1
    n = 2 * count
    params = [(2 * i, 2 * i + 2) for i in range(count)]
    opt = FusedAdamW(AdamW(), np.ones(n, np.float32), None, np, params=params)
    state = opt.state_dict()
    opt.load_state_dict({**state, "step": 400, "param_steps": 400 - np.arange(count)})
    g = np.full(n, 0.5, np.float32)
    with pytest.raises(TideInvalid, match=f"present: expected at most {MAX_ROWS} distinct"):
        opt.step(g)
    assert opt.step_count == 400 and (opt._master == 1).all()
    opt.step(g, present=[True] * MAX_ROWS + [False])
    assert opt.param_steps[-1] == 400 - MAX_ROWS and (opt._master[-2:] == 1).all()
    assert (opt._master[:-2] != 1).all()


def test_rows_keep_their_numbers_and_free_ones_are_reused() -> None:
    """A pair keeps its row while in use; a new pair takes the lowest free number."""
    opt = FusedAdamW(AdamW(), np.ones(6, np.float32), None, np,
                     params=[(0, 2), (2, 4), (4, 6)])
    g = np.ones(6, np.float32)
    opt.step(g, present=[False, True, True])  # every pair is (0, 0): row 0
    assert opt._row_of_pair == {0: 0}
    opt.step(g, present=[True, True, True])  # parameter 0 lags by one: (0, 1) gets row 1
    assert opt._row_of_pair == {0: 0, 1: 1}
    opt.step(g, present=[True, False, False])  # (0, 0) unused: row 0 freed
    assert opt._row_of_pair == {1: 1}
    opt.step(g, present=[True, True, False])  # parameters 0 and 1 both lag by one
    assert opt._row_of_pair == {1: 1}
    opt.step(g, present=[False, False, True])  # parameter 2 lags by 2: a new pair, row 0
    assert opt._row_of_pair == {2: 0}
    assert opt.param_steps.tolist() == [3, 3, 3] and opt.step_count == 5


def test_the_host_backend_answers_the_device_methods():
    """What the optimizer and the norm ask the backend ([Note: backend interface] in
    ``backends/_base``): on the host, no-op streams and settles, a NumPy upload, wrap,
    asarray and copy, completions done at once, and no kernels or graphs."""
    from tidearray.backends import array_backend

    be = array_backend(np)
    assert be is array_backend(np) and be.name == "host"
    with be.on_stream(None), be.on_device(np.zeros(1)):
        be.settle()
        assert not be.capturing()
    dst = np.zeros(4, np.float32)
    be.uploader()(dst, np.arange(3, dtype=np.float32))
    assert dst.tolist() == [0.0, 1.0, 2.0, 0.0]
    buf = np.arange(5)
    assert np.shares_memory(be.wrap(buf), buf)
    with pytest.raises(TideBackendError, match="no kernels"):
        be.kernel("adamw.cu", "adamw_f32", dst)
    assert be.stream(None) is None and be.completion(None).query()
    assert type(be.asarray([1.0, 2.0])) is np.ndarray and be.asarray(dst) is dst
    out = np.zeros(3, np.float32)
    be.copy_arrays([out], [dst[1:]], None)
    assert out.tolist() == [1.0, 2.0, 0.0]
    assert not be.graphs and be.device_kind == "cpu"
    with pytest.raises(TideBackendError, match="captures no graphs"):
        be.step_pool()
