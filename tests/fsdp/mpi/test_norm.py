"""The global gradient norm ([Note: global norm] in ``tidearray.fsdp._norm``): each rank's
float64 sum of squares, all-gathered by a gather plan and added in rank order.

Against an fp64 reference computed here from every rank's gradient (gathered over MPI),
to 1e-12 relative: the float64 sums of float32 squares carry rounding of about 1e-16 per
addition. Bitwise: every rank gets the same norm, and it is the rank-order sum of the
ranks' own sums. On cuda, the clip factor the device writes into a coefficient table (a
captured step's clip) against the host's ``clip_scale`` arithmetic, bit for bit. Fresh
data every run (a seed drawn on rank 0); outputs poisoned before each call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tidearray.fsdp import clip_scale
from tidearray.fsdp._norm import GlobalNorm

from ..._util import agree, fresh_seed, to_numpy, to_xp

pytestmark = pytest.mark.mpi
REL = 1e-12


def _grads(group, draws: int) -> list[np.ndarray]:
    """``draws`` float32 gradients of this rank: lengths differ by rank, values span
    decades so that the float64 sums round."""
    seed = fresh_seed(group.comm, bits=30)
    rng = np.random.default_rng([seed, group.rank])
    out = []
    for _ in range(draws):
        n = int(rng.integers(1, 300_000))
        g = rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))
        out.append(g.astype(np.float32))
    return out


def _reference(group, g: np.ndarray) -> float:
    """The fp64 norm of every rank's ``g`` together, from scratch."""
    every = np.concatenate(group.comm.allgather(g)).astype(np.float64)
    return math.sqrt(float(np.dot(every, every)))


def test_the_norm_is_the_fp64_norm_with_the_same_bits_on_every_rank(group, xp):
    norm = GlobalNorm(group if group.size > 1 else None, group.size, xp)
    failures = []
    for k, g in enumerate(_grads(group, 4)):
        scale = 1.0 / (group.size * (k + 1))
        norm.local[...] = np.nan  # poisoned: the call must write it
        got = norm.compute(to_xp(xp, g), scale)
        want = _reference(group, g) * scale
        if not got == pytest.approx(want, rel=REL):
            failures.append(f"draw {k}: norm {got!r}, fp64 reference {want!r}")
        every = group.comm.allgather(got)
        if len({np.float64(x).tobytes() for x in every}) != 1:
            failures.append(f"draw {k}: the ranks got different norms {every}")
        sums = group.comm.allgather(float(to_numpy(norm.local)[0]))  # left by compute
        total = 0.0
        for s in sums:  # rank order
            total += s
        if got != math.sqrt(total) * scale:
            failures.append(f"draw {k}: norm {got!r}, not the rank-order sum of the ranks' "
                            f"sums {math.sqrt(total) * scale!r}")
    agree(group.comm, failures, "global norm")


def test_a_zero_gradient_has_norm_zero(group, xp):
    norm = GlobalNorm(group if group.size > 1 else None, group.size, xp)
    got = norm.compute(xp.zeros(1000 + group.rank, np.float32), 0.5)
    agree(group.comm, [] if got == 0.0 else [f"norm of zeros: {got!r}"], "zero norm")


def test_the_device_clip_factor_is_the_hosts_bit_for_bit(group, xp):
    """The captured step's clip: ``clip_finish`` writes ``float32(scale * clip_scale(norm,
    max_norm))`` into each row's field of the table, computed as the eager step computes
    it on the host: clipped, unclipped (factor 1) and NaN gradients."""
    if xp is np:
        pytest.skip("the clip factor on the device is cuda's")
    norm = GlobalNorm(group if group.size > 1 else None, group.size, xp)
    rows, width, field = 3, 9, 8
    failures = []
    for k, g in enumerate(_grads(group, 3)):
        if k == 2 and group.rank == group.size - 1:
            g[len(g) // 2] = np.nan
        scale = 1.0 / (group.size * 2)
        for max_norm in (1e-3, 0.37, 1e30):
            table = xp.full(rows * width, -7.0, np.float32)  # poisoned
            norm.norm[...] = np.nan
            dev = norm.compute(to_xp(xp, g), scale, max_norm=max_norm, table=table,
                               table_shape=(rows, width, field))
            got_norm = float(to_numpy(dev)[0])
            eager = norm.compute(to_xp(xp, g), scale)
            want = np.float32(scale * clip_scale(eager, max_norm))
            t = to_numpy(table).reshape(rows, width)
            if np.float64(got_norm).tobytes() != np.float64(eager).tobytes():
                failures.append(f"draw {k}, max {max_norm}: device norm {got_norm!r}, eager "
                                f"{eager!r}")
            if t[:, field].tobytes() != np.full(rows, want, np.float32).tobytes():
                failures.append(f"draw {k}, max {max_norm}: factors {t[:, field]}, host "
                                f"{want!r}")
            rest = np.delete(t, field, axis=1)
            if (rest != -7.0).any():
                failures.append(f"draw {k}, max {max_norm}: the kernel wrote other fields")
    agree(group.comm, failures, "device clip factor")


def _model(group, xp, **kw):
    """A small Runtime of three units (sizes that shard unevenly), fp32."""
    from tidearray.fsdp import Runtime

    shapes = [[(7, 3), (5,)], [(11, 2)], [(4, 4), (3,)]]
    rng = np.random.default_rng(0)
    units = [[(f"{u}.{k}", rng.standard_normal(s).astype(np.float32))
              for k, s in enumerate(unit)] for u, unit in enumerate(shapes)]
    return Runtime(units, group=group, param_dtype=np.float32, **kw)


def _backward(sm, step: int, micro: int = 0) -> None:
    """A forward and backward through the hooks, writing gradients that differ by rank,
    step and micro-batch (the same ones in every run)."""
    rng = np.random.default_rng([step, micro, sm.group.rank])
    for i in range(sm.num_units):
        sm.pre_forward(i)
        sm.post_forward(i)
    for i in reversed(range(sm.num_units)):
        _, grads = sm.pre_backward(i)
        for g in grads:
            g[...] = sm.xp.asarray(rng.standard_normal(g.shape).astype(np.float32) * 3)
        sm.post_backward(i)


def _masters(sm) -> bytes:
    return to_numpy(sm.arena.master).tobytes()


@pytest.mark.parametrize("way", ["AdamW", "Runtime", "clip_grad_norm_"])
def test_every_way_to_clip_is_one_clip_and_finalizes_once(group, xp, monkeypatch, way):
    """The clip limit on the AdamW (earlier versions' spelling), on the runtime, or
    ``clip_grad_norm_`` before the step: the same masters and norms, bit for bit, with
    one ``finalize_grads`` per step; ``finalize_grads``' scale is the averaging times
    the clip rule."""
    from tidearray.fsdp import AdamW

    limit, failures = 0.5, []
    ref = _model(group, xp, optimizer=AdamW(max_grad_norm=limit))
    kw = {"AdamW": {"optimizer": AdamW(max_grad_norm=limit)},
          "Runtime": {"max_grad_norm": limit}, "clip_grad_norm_": {}}[way]
    sm = _model(group, xp, **kw)
    calls = []
    real = sm.finalize_grads
    monkeypatch.setattr(sm, "finalize_grads", lambda *a: calls.append(a) or real(*a))
    for step in range(3):
        for micro in range(2):
            _backward(ref, step, micro)
            _backward(sm, step, micro)
        want = ref.step()
        got = sm.clip_grad_norm_(limit) if way == "clip_grad_norm_" else None
        stepped = sm.step()
        if way == "clip_grad_norm_" and stepped != got:
            failures.append(f"step {step}: step() returned {stepped!r}, clip_grad_norm_ {got!r}")
        if not (stepped == want and isinstance(stepped, float) and stepped > limit):
            failures.append(f"step {step}: norm {stepped!r}, expected {want!r} (> {limit})")
        if len(calls) != step + 1:
            failures.append(f"step {step}: finalize_grads reached {len(calls) - step} times")
    if _masters(sm) != _masters(ref):
        failures.append("the masters differ from the AdamW-clipped run's")
    _backward(sm, 9)
    scale = real(limit)
    average = 1.0 / (sm.world * 1)
    if scale.factor != average * clip_scale(scale.norm, limit) or scale.on_device:
        failures.append(f"finalize_grads({limit}) gave {scale}, average {average}")
    if real() != (average, None, False):
        failures.append(f"finalize_grads() gave {real()}")
    sm.step()
    agree(group.comm, failures, f"clip via {way}")


def test_a_backward_between_clip_grad_norm_and_step_is_refused(group, xp):
    from tidearray import TideInvalid
    from tidearray.fsdp import AdamW

    sm = _model(group, xp)
    _backward(sm, 0)
    sm.clip_grad_norm_(1.0)
    _backward(sm, 0, 1)
    with pytest.raises(TideInvalid, match="no backward between clip_grad_norm_ and the step"):
        sm.step()
    _backward(sm, 1)
    sm.step()  # the refused clip is gone: the next step is plain
    with pytest.raises(TideInvalid, match="max_grad_norm: expected one clip limit"):
        _model(group, xp, optimizer=AdamW(max_grad_norm=1.0), max_grad_norm=2.0)
    with pytest.raises(TideInvalid, match="max_grad_norm: expected a finite real > 0"):
        _model(group, xp, max_grad_norm=0.0)


def test_clip_grad_norm_of_inf_takes_the_norm_without_clipping(group, xp):
    """``clip_grad_norm_(inf)``, torch's way to log the norm: the same norm, bit for bit, as
    a clip far above it, and the masters of a run that never clips (a factor of exactly 1);
    0, a negative or NaN limit are still refused."""
    from tidearray import TideInvalid

    plain, huge, inf = (_model(group, xp) for _ in range(3))
    failures = []
    for step in range(2):
        for sm in (plain, huge, inf):
            _backward(sm, step)
        want, got = huge.clip_grad_norm_(1e30), inf.clip_grad_norm_(float("inf"))
        if not (isinstance(got, float) and got == want and got > 0):
            failures.append(f"step {step}: norm {got!r}, expected {want!r}")
        for sm in (plain, huge, inf):
            sm.step()
    if _masters(inf) != _masters(plain):
        failures.append("clip_grad_norm_(inf) changed the step")
    _backward(inf, 5)
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        with pytest.raises(TideInvalid, match="max_norm: expected a real > 0"):
            inf.clip_grad_norm_(bad)
    inf.step()
    agree(group.comm, failures, "clip_grad_norm_(inf)")


def test_a_frozen_gradient_left_unwritten_counts_nothing(group, xp):
    """A frozen parameter of a partly trained unit whose gradient the backward leaves
    unwritten: its bytes in the shared gradient buffer last held another unit's (huge)
    gradients, and must count nothing in the clip norm. The norms and masters equal,
    bit for bit, a run that writes that gradient as zeros."""
    trainable = [[True, False], [True], [True, True]]  # unit 0 and unit 2 share a slot
    runs = {how: _model(group, xp, trainable=trainable, max_grad_norm=1.0)
            for how in ("unwritten", "zeros")}
    failures, norms = [], {}
    for how, sm in runs.items():
        norms[how] = []
        for step in range(3):
            rng = np.random.default_rng([step, sm.group.rank])
            for i in range(sm.num_units):
                sm.pre_forward(i)
                sm.post_forward(i)
            for i in reversed(range(sm.num_units)):
                _, grads = sm.pre_backward(i)
                for k, g in enumerate(grads):
                    if trainable[i][k]:
                        scale = 1e6 if i == 2 else 1.0  # what unit 0 finds in the buffer
                        g[...] = sm.xp.asarray(rng.standard_normal(g.shape).astype(np.float32)
                                               * scale)
                    elif how == "zeros":
                        g[...] = 0
                sm.post_backward(i)
            norms[how].append(sm.step())
    if norms["unwritten"] != norms["zeros"]:
        failures.append(f"norms {norms['unwritten']} with the gradient unwritten, "
                        f"{norms['zeros']} with it written as zeros")
    if _masters(runs["unwritten"]) != _masters(runs["zeros"]):
        failures.append("the masters differ")
    agree(group.comm, failures, "an unwritten frozen gradient")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["param_groups", "max_grad_norm", "prefetch", "trainable"])
def test_runtime_settings_must_agree(group, xp, differ):
    """Each rank steps and gathers its own rows: a setting that differs on one rank (a
    parameter group of another lr, a clip limit, the prefetch depth, a frozen parameter)
    would train one model by two rules. Every rank raises, naming the setting."""
    from tidearray import TideInvalid
    from tidearray.fsdp import AdamW

    last = group.rank == group.size - 1
    kw = {"param_groups": [(AdamW(lr=0.1), ["0.0"])] if last else [],
          "max_grad_norm": 2.0 if last else 1.0,
          "prefetch": 2 if last else 1,
          "trainable": [[True, not last], [True], [True, True]]}
    try:
        _model(group, xp, **{differ: kw[differ]})
        failures = ["expected TideInvalid, got none"]
    except TideInvalid as e:
        failures = [] if f"expected the same {differ} on every rank" in str(e) else [str(e)]
    agree(group.comm, failures, f"{differ} differing on one rank")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lr", ["one rank's", "a list on one rank"])
def test_a_step_lr_must_agree(group, xp, lr):
    """A scheduler that runs differently on one rank passes another lr to its ``step``: its
    rows would be stepped by it, silently (or, a list the optimizer refuses, it alone would
    raise and not step). Every rank raises, nothing steps, and the next step with the same
    lr everywhere goes on."""
    from tidearray import TideInvalid

    last = group.rank == group.size - 1
    sm = _model(group, xp)
    before = _masters(sm)
    _backward(sm, 0)
    mine = 1e-3 if not last else (2e-3 if lr == "one rank's" else [1e-3, 1e-3])
    failures = []
    try:
        sm.step(mine)
        failures.append("expected TideInvalid, got none")
    except TideInvalid as e:
        if "expected the same lr on every rank" not in str(e):
            failures.append(str(e))
    if _masters(sm) != before:
        failures.append("a refused step changed the masters")
    _backward(sm, 1)
    sm.step(np.float64(1e-3) if last else 1e-3)  # the same value, another type: agreed
    if _masters(sm) == before:
        failures.append("the step after did not step")
    agree(group.comm, failures, f"lr differing on one rank ({lr})")
