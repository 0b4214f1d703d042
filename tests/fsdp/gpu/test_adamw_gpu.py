"""FusedAdamW's kernel (``kernels/adamw.cu``) against its NumPy path, on one GPU.

Both paths evaluate [Note: AdamW math] (``tidearray/_adamw.py``) in
float32 with every operation rounded to nearest even: the kernel through
``_rn`` intrinsics (never contracted into FMAs), NumPy through float32 ufuncs.
So master and moments are held to ``MAX_ULP`` = 0 units in the last place
(bitwise), and the send shard must be bitwise the master rounded to nearest
even (``astype``). Sizes: 1, a non-multiple of the block, ~10M (grid-stride),
an empty shard, and shards at odd element offsets inside a larger arena.
Parameter groups (the ``adamw_grouped_*`` kernels) are held to the grouped
NumPy path the same way, with several groups, a frozen one among them, and
each ``lr`` form (None, one float, one per group). So are parameters without
a gradient in some steps ([Note: absent gradients]): with and without
groups, with more rows than the by-value table holds (``adamw_table_*``
eagerly), and in a captured step (the ``adamw_table_*`` kernels reading the
device table, a clip writing its ``grad_scale``, replays staged by
``stage_step``), eager steps with another presence in between.

No group is needed (the optimizer does no communication), so this file skips on
its own instead of through conftest's ``cuda_group``: it runs where CuPy and a
GPU are present even without NCCL. Data is fresh each run (seed in messages).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytest

from tidearray import TideInvalid
from tidearray._adamw import MAX_GROUPS, AdamW, ParamGroup
from tidearray.fsdp._norm import GlobalNorm, clip_scale
from tidearray.fsdp._optim import BLOCK, FusedAdamW

from ..._util import BF16, DTYPES, bits, fresh_seed, stall

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
    seed = fresh_seed(bits=63)
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
          groups: Optional[list[ParamGroup]] = None,
          params: Optional[list[tuple[int, int]]] = None, late_s: float = 0.0):
    """A NumPy optimizer and a CuPy one on copies of ``master`` (and ``groups``,
    ``params``); the CuPy shards sit ``offset`` elements into larger arrays (as they do
    in the arena). ``late_s``: the current stream runs that late when the CuPy one is
    made, and nothing here waits for it after."""
    n = master.size
    # send starts as the rounded master, as the runtime starts it: a parameter absent at
    # every step keeps it.
    sent = None if dtype is None else master.astype(dtype)
    host = FusedAdamW(HP, master.copy(), None if sent is None else sent.copy(), np, groups,
                      params)
    big_m = cp.zeros(n + 2 * offset, np.float32)
    big_m[offset:offset + n] = cp.asarray(master)
    send = None
    if sent is not None:
        send = cp.zeros(n + 2 * offset, dtype)[offset:offset + n]
        send.view(np.uint16 if dtype.itemsize == 2 else np.uint32).set(bits(sent))
    cp.cuda.get_current_stream().synchronize()  # a side stream's step must see these writes
    stall(cp, late_s)
    return host, FusedAdamW(HP, big_m[offset:offset + n], send, cp, groups, params)


def _scheduled(k: int, steps: int) -> float:
    return HP.lr * (k + 1) / steps


def _steps(host: FusedAdamW, dev: FusedAdamW, cp: Any, grads: list[np.ndarray],
           offset: int = 0, stream: Any = None, lr: Callable[[int, int], Any] = _scheduled,
           present: Optional[np.ndarray] = None) -> None:
    """The runtime's sequence on both: norm, clip scale, step with a scheduled ``lr(k,
    steps)`` (one float by default) and ``present[k]`` (None: every parameter)."""
    for k, g in enumerate(grads):
        on = None if present is None else present[k].tolist()
        big = cp.zeros(g.size + 2 * offset, np.float32)
        big[offset:offset + g.size] = cp.asarray(g)
        g_dev = big[offset:offset + g.size]
        lr_k = lr(k, len(grads))
        scale_h = clip_scale(GlobalNorm(None, 1, np).compute(g, 1.0), HP.max_grad_norm)
        host.step(g, grad_scale=scale_h, lr=lr_k, present=on)
        # The same scale on both, so that any difference is the kernel's own.
        cp.cuda.get_current_stream().synchronize()  # g_dev, written on the current stream
        dev.step(g_dev, grad_scale=scale_h, lr=lr_k, stream=stream, present=on)
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


@pytest.mark.parametrize("grouped", [False, True])
def test_a_first_step_on_another_stream_waits_for_the_constructor(cp: Any, rng,
                                                                  grouped: bool) -> None:
    """The constructor zeroes the moments (and writes the group index) on the current
    stream, here 0.3 s late; a first step straight after, on a non-blocking stream that
    does not wait for it, must still start from zero moments ([Note: initialized memory]
    in ``backends.cuda.streams``)."""
    gen, seed = rng
    n = 100_003
    master = gen.standard_normal(n).astype(np.float32)
    groups = _groups(gen, n)[0] if grouped else None
    grads = _grads_n(gen, n, 1)
    g_dev = cp.asarray(grads[0])
    # The kernel loaded first: loading a module waits for the whole device, which would
    # hide the race.
    _pair(cp, master, BF16, groups=groups)[1].step(g_dev, lr=HP.lr)
    host, dev = _pair(cp, master, BF16, groups=groups, late_s=0.3)
    stream = cp.cuda.Stream(non_blocking=True)
    host.step(grads[0], lr=HP.lr)
    dev.step(g_dev, lr=HP.lr, stream=stream)
    cp.cuda.Device().synchronize()
    _compare(host, dev, seed)


def test_empty_shard(cp: Any) -> None:
    dev = FusedAdamW(HP, cp.zeros(0, np.float32), cp.zeros(0, BF16), cp)
    assert GlobalNorm(None, 1, cp).compute(cp.zeros(0, np.float32), 1.0) == 0.0
    dev.step(cp.zeros(0, np.float32))
    assert dev.step_count == 1


def test_sum_squares_float64(cp: Any, rng) -> None:
    gen, _ = rng
    g = _data(gen, 1_000_003)[1][0]
    norm = GlobalNorm(None, 1, cp)
    norm.compute(cp.asarray(g), 1.0)
    g64 = g.astype(np.float64)
    assert float(norm.local.get()[0]) == pytest.approx(float(np.dot(g64, g64)), rel=1e-12)


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
    assert dev._index is not None, "the grouped kernel"
    assert (dev._index.get() == label).all(), f"group index (seed {seed})"
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
    assert int(dev._index.get().max()) == MAX_GROUPS - 1
    _steps(host, dev, cp, grads)
    _compare(host, dev, seed)


def test_empty_groups_run_the_plain_kernel(cp: Any, rng) -> None:
    """Groups that hold none of this shard: no index, today's kernel, the same result."""
    gen, seed = rng
    master, grads = _data(gen, 4099)
    host, dev = _pair(cp, master, BF16, groups=[ParamGroup(GROUP_HPS[0], ((7, 7),))])
    assert dev._index is None and dev.num_groups == 2
    _steps(host, dev, cp, grads)
    _compare(host, dev, seed)


# -- absent gradients ----------------------------------------------------------------------

ABSENT_STEPS = 6


def _grads_n(gen: np.random.Generator, n: int, steps: int) -> list[np.ndarray]:
    mag = 10.0 ** gen.uniform(-9, 0, n)
    return [(gen.standard_normal(n) * mag).astype(np.float32) for _ in range(steps)]


def _params(gen: np.random.Generator, n: int, count: int = 12) -> list[tuple[int, int]]:
    """``count`` parameters over ``[0, n)`` with gaps between them (the implicit
    parameter), in a random order, one of them (not the first two) empty."""
    cuts = np.sort(gen.choice(np.arange(1, n), 2 * count - 1, replace=False))
    bounds = [0, *cuts.tolist(), n]
    ranges = [(bounds[2 * i], bounds[2 * i + 1]) for i in gen.permutation(count)]
    empty = int(gen.integers(2, count))
    ranges[empty] = (ranges[empty][0], ranges[empty][0])
    return ranges


def _presence(gen: np.random.Generator, count: int, steps: int) -> np.ndarray:
    """Parameter 0 never present, parameter 1 at all but the first step, the others at
    random."""
    present = gen.random((steps, count)) < 0.6
    present[:, 0] = False
    present[:, 1] = True
    present[0, 1] = False
    return present


def _kinds_run(dev: FusedAdamW) -> set[str]:
    """Which kinds of AdamW kernel ``dev`` has fetched (to launch them)."""
    kinds = {"adamw_grouped_": "grouped", "adamw_table_": "table"}
    return {next((v for k, v in kinds.items() if name.startswith(k)), "plain")
            for name in dev._kernels}


def _check_absent_unchanged(dev: FusedAdamW, master: np.ndarray, params: list,
                            seed: int) -> None:
    a, b = params[0]
    assert (bits(dev._master.get()[a:b]) == bits(master[a:b])).all(), f"seed {seed}"
    assert not dev.exp_avg[a:b].any() and not dev.exp_avg_sq[a:b].any(), f"seed {seed}"


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
@pytest.mark.parametrize("dtype", [*DTYPES, None], ids=lambda d: getattr(d, "name", "no-send"))
def test_absent_kernel_matches_numpy(cp: Any, rng, dtype: np.dtype, grouped: bool) -> None:
    gen, seed = rng
    n = 200_003
    master = gen.standard_normal(n).astype(np.float32)
    grads = _grads_n(gen, n, ABSENT_STEPS)
    params = _params(gen, n)
    groups = _groups(gen, n)[0] if grouped else None  # ranges that cut through parameters
    offset = 1 if grouped else 0  # shards at odd offsets too
    host, dev = _pair(cp, master, dtype, offset, groups=groups, params=params)
    present = _presence(gen, len(params), ABSENT_STEPS)
    _steps(host, dev, cp, grads, offset=offset, present=present)
    _compare(host, dev, seed)
    assert (host.param_steps == dev.param_steps).all()
    assert (dev.param_steps == present.sum(0)).all()
    _check_absent_unchanged(dev, master, params, seed)


def test_every_parameter_present_runs_the_plain_kernel(cp: Any, rng) -> None:
    """``params`` with every parameter present at equal counts and no groups: no index,
    the nine-float kernel, bitwise the same as without ``params``."""
    gen, seed = rng
    n = 100_003
    master = gen.standard_normal(n).astype(np.float32)
    grads = _grads_n(gen, n, 3)
    params = _params(gen, n)
    host, dev = _pair(cp, master, BF16, params=params)
    host_plain, plain = _pair(cp, master, BF16)
    _steps(host, dev, cp, grads, present=np.ones((3, len(params)), bool))
    _steps(host_plain, plain, cp, grads)
    assert dev._index is None and _kinds_run(dev) == {"plain"}
    _compare(host, dev, seed)
    for a, b in ((dev._master, plain._master), (dev._send, plain._send)):
        assert (bits(a.get()) == bits(b.get())).all(), f"params vs none (seed {seed})"


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
def test_rows_past_the_by_value_table(cp: Any, rng, grouped: bool) -> None:
    """24 parameters, each first present one step after the one before: 24 lags, more
    rows than the by-value table holds, so the eager step reads them from the device
    (``adamw_table_*``); bitwise the NumPy path."""
    gen, seed = rng
    count, n = 24, 60_001
    master = gen.standard_normal(n).astype(np.float32)
    params = _params(gen, n, count)
    groups = _groups(gen, n)[0] if grouped else None
    present = np.tril(np.ones((count + 2, count), bool))  # parameter i from step i on
    present[:, 0] = False
    host, dev = _pair(cp, master, BF16, groups=groups, params=params)
    _steps(host, dev, cp, _grads_n(gen, n, count + 2), present=present)
    assert "table" in _kinds_run(dev) and len(dev._row_of_pair) > MAX_GROUPS
    _compare(host, dev, seed)
    _check_absent_unchanged(dev, master, params, seed)


def _captured(cp: Any, dev: FusedAdamW, norm: GlobalNorm, g_buf: Any, scale: float,
              max_norm: float, present: Optional[list], stream: Any) -> Any:
    """What ``fsdp._graph`` captures: the clip into the device table, then the step."""
    dev.prepare_capture()
    cp.cuda.Device().synchronize()
    count = dev.step_count
    with stream:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        norm.compute(g_buf, scale, stream=stream, max_norm=max_norm, table=dev.coeff_dev,
                     table_shape=dev.table_layout)
        dev.step(g_buf, grad_scale=scale, lr=HP.lr, stream=stream, present=present)
        graph = stream.end_capture()
    assert dev.step_count == count  # a capture counts no step ([Note: step counts])
    return graph


@pytest.mark.parametrize("case", ["plain", "groups", "absent"])
def test_captured_step_matches_numpy(cp: Any, rng, case: str) -> None:
    """A captured step replayed with a changing lr, a clip inside, and eager steps of
    another presence in between: bitwise the NumPy path stepped the same way. "plain":
    no groups (no index, row 0); "groups": groups, every parameter present (the
    runtime's); "absent": groups and parameters absent at the capture, whose replays
    skip them while the others step at their own counts."""
    gen, seed = rng
    n = 100_003
    master = gen.standard_normal(n).astype(np.float32)
    params = _params(gen, n) if case == "absent" else None
    groups = None if case == "plain" else _groups(gen, n)[0]
    host, dev = _pair(cp, master, BF16, groups=groups, params=params)
    schedule = ["eager", "eager", "replay", "replay", "replay", "eager", "replay", "replay"]
    grads = _grads_n(gen, n, len(schedule))
    # Per step, then the capture's (None: no params).
    present = [None] * (len(schedule) + 1) if params is None else [
        p.tolist() for p in _presence(gen, len(params), len(schedule) + 1)]
    # Written by each step's upload alone: a zeroing memset on the default stream could
    # land after the upload on this non-blocking one.
    g_buf, ref, norm = cp.empty(n, np.float32), GlobalNorm(None, 1, cp), GlobalNorm(None, 1, cp)
    stream, scale, max_norm = cp.cuda.Stream(non_blocking=True), 0.5, 1.0
    graph = None
    for k, (kind, g) in enumerate(zip(schedule, grads)):
        lr = HP.lr * (k + 1) / len(schedule)
        with stream:
            g_buf.set(g, stream=stream)
            nrm = ref.compute(g_buf, scale, stream=stream)  # the eager clip's norm
        grad_scale = scale * clip_scale(nrm, max_norm)
        on = present[-1] if kind == "replay" else present[k]
        host.step(g, grad_scale=grad_scale, lr=lr, present=on)
        if kind == "eager":
            dev.step(g_buf, grad_scale=grad_scale, lr=lr, stream=stream, present=on)
            stream.synchronize()
            continue
        if graph is None:
            graph = _captured(cp, dev, norm, g_buf, scale, max_norm, present[-1], stream)
        dev.stage_step(lr, scale, stream)  # the grad_scale the capture issued
        graph.launch(stream)
        stream.synchronize()
        assert float(norm.norm.get()[0]) == nrm, f"the captured clip's norm (seed {seed})"
    assert dev.step_count == host.step_count == len(schedule)
    assert (dev.param_steps == host.param_steps).all(), f"seed {seed}"
    _compare(host, dev, seed)
    if params:
        _check_absent_unchanged(dev, master, params, seed)


def test_replay_of_one_row_refused_once_counts_drift_apart(cp: Any, rng) -> None:
    """A capture with every parameter present at one count reads one row and no index;
    after an eager step that leaves a parameter out, the next replay would need two rows:
    refused (capture again), nothing staged or counted."""
    gen, _ = rng
    n = 10_007
    master = gen.standard_normal(n).astype(np.float32)
    params = _params(gen, n)
    _, dev = _pair(cp, master, BF16, params=params)
    g_buf, stream = cp.asarray(_grads_n(gen, n, 1)[0]), cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()  # the upload, before the step's stream reads it
    dev.step(g_buf, stream=stream)
    graph = _captured(cp, dev, GlobalNorm(None, 1, cp), g_buf, 1.0, 1e9, None, stream)
    assert dev._captured.indexed is False
    dev.stage_step(HP.lr, 1.0, stream)  # the grad_scale the capture issued
    graph.launch(stream)
    dev.step(g_buf, stream=stream, present=[False] + [True] * (len(params) - 1))
    steps = dev.param_steps.copy()
    with pytest.raises(TideInvalid, match="stage_step: expected the parameters present"):
        dev.stage_step(HP.lr, 1.0, stream)
    assert (dev.param_steps == steps).all() and dev.step_count == 3
    stream.synchronize()
