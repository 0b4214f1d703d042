"""FusedAdamW's kernel (``kernels/adamw.cu``) against its NumPy path, on one GPU.

Both paths evaluate [Note: AdamW math] (``tidearray/fsdp/_optim.py``) in
float32 with every operation rounded to nearest even: the kernel through
``_rn`` intrinsics (never contracted into FMAs), NumPy through float32 ufuncs.
So master and moments are held to ``MAX_ULP`` = 0 units in the last place
(bitwise), and the send shard must be bitwise the master rounded to nearest
even (``astype``). Sizes: 1, a non-multiple of the block, ~10M (grid-stride),
an empty shard, and shards at odd element offsets inside a larger arena.
Parameter groups (the ``adamw_grouped_*`` kernels) are held to the grouped
NumPy path the same way, with several groups, a frozen one among them, and
each ``lr`` form (None, one float, one per group).

No group is needed (the optimizer does no communication), so this file skips on
its own instead of through conftest's ``cuda_group``: it runs where CuPy and a
GPU are present even without NCCL. Data is fresh each run (seed in messages).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import pytest

from tidearray.fsdp._optim import BLOCK, MAX_GROUPS, AdamW, FusedAdamW, ParamGroup, clip_scale

from .._util import BF16, DTYPES, bits

pytestmark = pytest.mark.gpu

#: Largest distance allowed between kernel and NumPy results, in float32 ulps.
MAX_ULP = 0
STEPS = 3
HP = AdamW(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def cp() -> Any:
    """CuPy on a usable GPU, else skip (overrides conftest's ``cp``, which needs a group)."""
    from tidearray.backends import cuda_usable

    ok, why = cuda_usable()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    import cupy

    return cupy


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy) % (1 << 63)
    return np.random.default_rng(seed), seed


def _data(gen: np.random.Generator, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    master = gen.standard_normal(n).astype(np.float32)
    mag = 10.0 ** gen.uniform(-9, 0, n)  # tiny to large: eps and sqrt(v) both matter
    return master, [(gen.standard_normal(n) * mag).astype(np.float32) for _ in range(STEPS)]


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance between two float32 arrays in units in the last place."""
    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return int(np.abs(ordered(a) - ordered(b)).max(initial=0))


def _pair(cp: Any, master: np.ndarray, dtype: np.dtype, offset: int = 0,
          groups: Optional[list[ParamGroup]] = None):
    """A NumPy optimizer and a CuPy one on copies of ``master`` (and ``groups``); the
    CuPy shards sit ``offset`` elements into larger arrays (as they do in the arena)."""
    n = master.size
    host = FusedAdamW(HP, master.copy(), None if dtype is None else np.zeros(n, dtype), np,
                      groups)
    big_m = cp.zeros(n + 2 * offset, np.float32)
    big_m[offset:offset + n] = cp.asarray(master)
    send = None if dtype is None else cp.zeros(n + 2 * offset, dtype)[offset:offset + n]
    dev = FusedAdamW(HP, big_m[offset:offset + n], send, cp, groups)
    cp.cuda.get_current_stream().synchronize()  # a side stream's step must see these writes
    return host, dev


def _scheduled(k: int, steps: int) -> float:
    return HP.lr * (k + 1) / steps


def _steps(host: FusedAdamW, dev: FusedAdamW, cp: Any, grads: list[np.ndarray],
           offset: int = 0, stream: Any = None, lr: Callable[[int, int], Any] = _scheduled
           ) -> None:
    """The runtime's sequence on both: norm, clip scale, step with a scheduled ``lr(k,
    steps)`` (one float by default)."""
    for k, g in enumerate(grads):
        big = cp.zeros(g.size + 2 * offset, np.float32)
        big[offset:offset + g.size] = cp.asarray(g)
        g_dev = big[offset:offset + g.size]
        lr_k = lr(k, len(grads))
        scale_h = clip_scale(math.sqrt(host.sum_squares(g)), HP.max_grad_norm)
        host.step(g, grad_scale=scale_h, lr=lr_k)
        # The same scale on both, so that any difference is the kernel's own.
        cp.cuda.get_current_stream().synchronize()  # g_dev, written on the current stream
        dev.step(g_dev, grad_scale=scale_h, lr=lr_k, stream=stream)
    cp.cuda.Device().synchronize()


def _compare(host: FusedAdamW, dev: FusedAdamW, seed: int) -> None:
    for what, h, d in (("master", host._master, dev._master.get()),
                       ("exp_avg", host.exp_avg, dev.exp_avg.get()),
                       ("exp_avg_sq", host.exp_avg_sq, dev.exp_avg_sq.get())):
        u = _ulps(h, d)
        assert u <= MAX_ULP, f"{what}: kernel and NumPy {u} ulp apart (seed {seed})"
    if dev._send is None:  # adamw_none: master and moments only
        return
    send = dev._send.get()
    rounded = dev._master.get().astype(send.dtype)
    assert (bits(send) == bits(rounded)).all(), f"{send.dtype} send (seed {seed})"
    assert (bits(send) == bits(host._send)).all(), f"{send.dtype} send vs NumPy (seed {seed})"


@pytest.mark.parametrize("n", [1, 3 * BLOCK + 17, 10_000_019])
@pytest.mark.parametrize("dtype", [*DTYPES, None], ids=lambda d: getattr(d, "name", "no-send"))
def test_kernel_matches_numpy(cp: Any, rng, dtype: np.dtype, n: int) -> None:
    gen, seed = rng
    master, grads = _data(gen, n)
    host, dev = _pair(cp, master, dtype)
    _steps(host, dev, cp, grads)
    assert host.step_count == dev.step_count == STEPS
    _compare(host, dev, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_odd_offsets_in_the_arena(cp: Any, rng, dtype: np.dtype) -> None:
    """Shards that start one element into their arrays (not 8- or 16-byte aligned)."""
    gen, seed = rng
    master, grads = _data(gen, 1001)
    host, dev = _pair(cp, master, dtype, offset=1)
    _steps(host, dev, cp, grads, offset=1)
    _compare(host, dev, seed)


class _StreamObj:
    """A foreign stream: only ``__cuda_stream__``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


@pytest.mark.parametrize("kind", ["cupy", "int", "cuda_stream", "torch"])
def test_side_stream(cp: Any, rng, kind: str) -> None:
    """Every kind of stream the collectives take (``backends.cuda.streams``) runs the step."""
    gen, seed = rng
    master, grads = _data(gen, 100_003)
    host, dev = _pair(cp, master, BF16)
    s = cp.cuda.Stream(non_blocking=True)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
        stream: Any = torch.cuda.Stream()
    else:
        stream = {"cupy": s, "int": s.ptr, "cuda_stream": _StreamObj(s.ptr)}[kind]
    _steps(host, dev, cp, grads, stream=stream)
    _compare(host, dev, seed)


def test_empty_shard(cp: Any) -> None:
    dev = FusedAdamW(HP, cp.zeros(0, np.float32), cp.zeros(0, BF16), cp)
    assert dev.sum_squares(cp.zeros(0, np.float32)) == 0.0
    dev.step(cp.zeros(0, np.float32))
    assert dev.step_count == 1


def test_sum_squares_float64(cp: Any, rng) -> None:
    gen, _ = rng
    g = _data(gen, 1_000_003)[1][0]
    dev = FusedAdamW(HP, cp.zeros(g.size, np.float32), cp.zeros(g.size, BF16), cp)
    g64 = g.astype(np.float64)
    assert dev.sum_squares(cp.asarray(g)) == pytest.approx(float(np.dot(g64, g64)), rel=1e-12)


def test_state_moves_between_gpu_and_host(cp: Any, rng) -> None:
    """A GPU state_dict loads into a NumPy optimizer, and both continue bitwise alike."""
    gen, seed = rng
    master, grads = _data(gen, 4099)
    host, dev = _pair(cp, master, BF16)
    _steps(host, dev, cp, grads)
    again = FusedAdamW(HP, dev._master.get(), np.zeros(master.size, BF16), np)
    again.load_state_dict(dev.state_dict())
    _steps(again, dev, cp, grads)
    _compare(again, dev, seed)


# -- parameter groups ----------------------------------------------------------------------

#: No decay with other betas and eps (norms, biases); frozen; another lr and decay.
GROUP_HPS = (AdamW(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
             AdamW(lr=0.0, weight_decay=0.0),
             AdamW(lr=1e-3, betas=(0.95, 0.999), eps=1e-7, weight_decay=0.3))
FROZEN = 2  # GROUP_HPS[1]'s index as a group


def _groups(gen: np.random.Generator, n: int) -> tuple[list[ParamGroup], np.ndarray]:
    """``GROUP_HPS`` over random consecutive pieces of ``[0, n)`` (some left to the
    default group), every group given at least one, and each element's group."""
    pieces = max(8, n // 2000)
    cuts = np.concatenate([[0], np.sort(gen.choice(np.arange(1, n), pieces - 1, replace=False)),
                           [n]])
    every = len(GROUP_HPS) + 1
    owners = gen.permutation(np.concatenate([np.arange(every),
                                             gen.integers(0, every, pieces - every)]))
    label = np.zeros(n, np.uint8)
    ranges: list[list[tuple[int, int]]] = [[] for _ in GROUP_HPS]
    for a, b, j in zip(cuts[:-1], cuts[1:], owners):
        j = int(j)
        label[a:b] = j
        if j:
            ranges[j - 1].append((int(a), int(b)))
    return [ParamGroup(hp, tuple(r)) for hp, r in zip(GROUP_HPS, ranges)], label


def _per_group(k: int, steps: int) -> list[float]:
    """One lr per group, not in the ratio of the groups' own (the frozen one stays 0)."""
    return [h.lr * (k + 1) / steps * (j + 1) for j, h in enumerate((HP, *GROUP_HPS))]


@pytest.mark.parametrize("lr", [_scheduled, lambda k, steps: None, _per_group],
                         ids=["float", "none", "per-group"])
@pytest.mark.parametrize("n", [3 * BLOCK + 17, 1_000_003])
@pytest.mark.parametrize("dtype", [*DTYPES, None], ids=lambda d: getattr(d, "name", "no-send"))
def test_grouped_kernel_matches_numpy(cp: Any, rng, dtype: np.dtype, n: int, lr) -> None:
    gen, seed = rng
    master, grads = _data(gen, n)
    groups, label = _groups(gen, n)
    host, dev = _pair(cp, master, dtype, groups=groups)
    assert dev._group_index is not None, "the grouped kernel"
    assert (dev._group_index.get() == label).all(), f"group index (seed {seed})"
    _steps(host, dev, cp, grads, lr=lr)
    _compare(host, dev, seed)
    frozen = label == FROZEN
    assert (bits(dev._master.get())[frozen] == bits(master)[frozen]).all(), (
        f"frozen masters (seed {seed})")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_grouped_odd_offsets_and_side_stream(cp: Any, rng, dtype: np.dtype) -> None:
    gen, seed = rng
    master, grads = _data(gen, 100_003)
    groups, _ = _groups(gen, master.size)
    host, dev = _pair(cp, master, dtype, offset=1, groups=groups)
    _steps(host, dev, cp, grads, offset=1, stream=cp.cuda.Stream(non_blocking=True))
    _compare(host, dev, seed)


def test_most_groups(cp: Any, rng) -> None:
    """``MAX_GROUPS`` groups, each its own lr and decay: the table's last row is read too."""
    gen, seed = rng
    n = 50_000
    master, grads = _data(gen, n)
    cuts = np.linspace(0, n, MAX_GROUPS, dtype=np.int64)
    groups = [ParamGroup(AdamW(lr=1e-3 * (j + 1), weight_decay=0.01 * j),
                         ((int(cuts[j]), int(cuts[j + 1])),)) for j in range(MAX_GROUPS - 1)]
    host, dev = _pair(cp, master, BF16, groups=groups)
    assert int(dev._group_index.get().max()) == MAX_GROUPS - 1
    _steps(host, dev, cp, grads)
    _compare(host, dev, seed)


def test_empty_groups_run_the_plain_kernel(cp: Any, rng) -> None:
    """Groups that hold none of this shard: no index, today's kernel, the same result."""
    gen, seed = rng
    master, grads = _data(gen, 4099)
    host, dev = _pair(cp, master, BF16, groups=[ParamGroup(GROUP_HPS[0], ((7, 7),))])
    assert dev._group_index is None and dev.num_groups == 2
    _steps(host, dev, cp, grads)
    _compare(host, dev, seed)
