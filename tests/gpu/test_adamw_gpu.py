"""FusedAdamW's kernel (``kernels/adamw.cu``) against its NumPy path, on one GPU.

Both paths evaluate [Note: AdamW math] (``tidearray/fsdp/_optim.py``) in
float32 with every operation rounded to nearest even: the kernel through
``_rn`` intrinsics (never contracted into FMAs), NumPy through float32 ufuncs.
So master and moments are held to ``MAX_ULP`` = 0 units in the last place
(bitwise), and the send shard must be bitwise the master rounded to nearest
even (``astype``). Sizes: 1, a non-multiple of the block, ~10M (grid-stride),
an empty shard, and shards at odd element offsets inside a larger arena.

No group is needed (the optimizer does no communication), so this file skips on
its own instead of through conftest's ``cuda_group``: it runs where CuPy and a
GPU are present even without NCCL. Data is fresh each run (seed in messages).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tidearray.fsdp._optim import BLOCK, AdamW, FusedAdamW, clip_scale

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


def _pair(cp: Any, master: np.ndarray, dtype: np.dtype, offset: int = 0):
    """A NumPy optimizer and a CuPy one on copies of ``master``; the CuPy shards sit
    ``offset`` elements into larger arrays (as they do in the arena)."""
    n = master.size
    host = FusedAdamW(HP, master.copy(), None if dtype is None else np.zeros(n, dtype), np)
    big_m = cp.zeros(n + 2 * offset, np.float32)
    big_m[offset:offset + n] = cp.asarray(master)
    send = None if dtype is None else cp.zeros(n + 2 * offset, dtype)[offset:offset + n]
    dev = FusedAdamW(HP, big_m[offset:offset + n], send, cp)
    cp.cuda.get_current_stream().synchronize()  # a side stream's step must see these writes
    return host, dev


def _steps(host: FusedAdamW, dev: FusedAdamW, cp: Any, grads: list[np.ndarray],
           offset: int = 0, stream: Any = None) -> None:
    """The runtime's sequence on both: norm, clip scale, step with a scheduled lr."""
    for k, g in enumerate(grads):
        big = cp.zeros(g.size + 2 * offset, np.float32)
        big[offset:offset + g.size] = cp.asarray(g)
        g_dev = big[offset:offset + g.size]
        lr = HP.lr * (k + 1) / len(grads)
        scale_h = clip_scale(math.sqrt(host.sum_squares(g)), HP.max_grad_norm)
        host.step(g, grad_scale=scale_h, lr=lr)
        # The same scale on both, so that any difference is the kernel's own.
        cp.cuda.get_current_stream().synchronize()  # g_dev, written on the current stream
        dev.step(g_dev, grad_scale=scale_h, lr=lr, stream=stream)
    (stream or cp.cuda.get_current_stream()).synchronize()


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


def test_side_stream(cp: Any, rng) -> None:
    gen, seed = rng
    master, grads = _data(gen, 100_003)
    host, dev = _pair(cp, master, BF16)
    _steps(host, dev, cp, grads, stream=cp.cuda.Stream(non_blocking=True))
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
