"""TIDE-AG and TIDE-RS on the cuda backend, on real models' unit shapes
(``tests.support.units``).

* all-gather: bitwise equal to the full parameters, gathered into a slot
  poisoned with all-ones bytes (a bf16 NaN that the data never holds);
* reduce-scatter bf16 -> fp32, ``avg``: against an fp64 reference of the sum
  over ranks. Tolerance, elementwise: ``|got - ref| <= W * 2**-23 * sum_r |g_r| / W``
  plus 1e-30, the bound of a sequential fp32 sum of W terms (the bf16 inputs
  are exact in fp32). Outputs start as NaN; padding rows must come out 0.

Data is fresh for every run: rank 0 draws a seed and broadcasts it. Every
rank rebuilds every rank's inputs from that seed on its GPU.
"""

from __future__ import annotations

import time
import traceback

import numpy as np
import pytest

import tidearray
from tidearray.layout import shard_shape, unit_nbytes

from ..._util import fresh_seed
from ._units import BF16, UNITS, bf16_normal, bf16_to_f64, padded_shard, shard_rows

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _seed(group) -> int:
    return fresh_seed(group.comm)


def _sync(cp, seconds: float = 30.0) -> None:
    """Wait for the current stream, but fail instead of hanging on a broken protocol."""
    ev = cp.cuda.Event(disable_timing=True)
    ev.record()
    deadline = time.monotonic() + seconds
    while not ev.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"device work not done after {seconds:g} s")
        time.sleep(1e-3)


def _guarded(fn, *args, **kw) -> list[str]:
    """``fn``'s failures, with any exception turned into one (so ranks still agree)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - report it collectively instead of desyncing ranks
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
        return [f"{type(e).__name__}: {e}\n{tb}"]


def _agree(group, failures: list[str], what: str) -> None:
    everything = group.comm.allgather(failures)
    lines = [f"rank {r}: {f}" for r, fs in enumerate(everything) for f in fs]
    assert not lines, what + ":\n" + "\n".join(lines[:20])


def gather_and_check(group, cp, shapes, stream=None, poison=True) -> list[str]:
    """All-gather fresh bf16 parameters; bitwise failures.

    With ``poison``, into a new slot filled with all-ones bytes first; else into
    the group's default slots.
    """
    seed = _seed(group)
    W, r = group.size, group.rank
    full = [bf16_normal(cp, seed + i, s) for i, s in enumerate(shapes)]
    shards = [padded_shard(cp, f, W, r) for f in full]
    slot = None
    if poison:
        nbytes = unit_nbytes(shapes, BF16, group=group)
        slot = tidearray.SlotArena(nbytes, 1, group=group)[0]
        slot.view(0, (slot.nbytes,), np.uint8).fill(0xFF)
    cp.cuda.runtime.deviceSynchronize()
    outs = tidearray.all_gather(shards, shapes, group=group, slot=slot, stream=stream)
    _sync(cp)
    bad = []
    for i, (o, f) in enumerate(zip(outs, full)):
        if o.shape != f.shape:
            bad.append(f"parameter {i}: shape {o.shape}, expected {f.shape}")
        elif not bool((o.view(cp.uint16) == f.view(cp.uint16)).all()):
            n = int((o.view(cp.uint16) != f.view(cp.uint16)).sum())
            bad.append(f"parameter {i} {f.shape}: {n} of {f.size} elements differ")
    return bad


def reduce_and_check(group, cp, shapes, op="avg") -> list[str]:
    """Reduce-scatter fresh bf16 gradients into NaN-poisoned fp32 shards; tolerance failures."""
    seed = _seed(group)
    W, r = group.size, group.rank
    grads = [bf16_normal(cp, seed + 1000 * r + i, s) for i, s in enumerate(shapes)]
    outs = [cp.full(shard_shape(s, W), np.nan, cp.float32) for s in shapes]
    res = tidearray.reduce_scatter(grads, op=op, out=outs, group=group)
    _sync(cp)
    scale = 1.0 / W if op == "avg" else 1.0
    bad = []
    for i, (s, got) in enumerate(zip(shapes, res)):
        start, stop = shard_rows(s[0], W, r)
        total = cp.zeros((stop - start, *s[1:]), cp.float64)
        mag = cp.zeros_like(total)
        for q in range(W):
            g = grads[i] if q == r else bf16_normal(cp, seed + 1000 * q + i, s)
            v = bf16_to_f64(cp, g[start:stop])
            total += v
            mag += cp.abs(v)
        ref, tol = total * scale, W * 2.0**-23 * mag * scale + 1e-30
        err = cp.abs(got[: stop - start].astype(cp.float64) - ref)
        if got is not outs[i]:
            bad.append(f"parameter {i}: result is not the given out array")
        if not bool((err <= tol).all()):  # NaN (an unwritten element) fails too
            bad.append(f"parameter {i} {s}: max error {float(cp.nanmax(err))}, "
                       f"{int((~(err <= tol)).sum())} elements out of tolerance")
        if stop - start < got.shape[0] and bool((got[stop - start:] != 0).any()):
            bad.append(f"parameter {i}: padding rows are not zero")
    return bad


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_all_gather_unit_bitwise(cuda_group, cp, unit):
    _agree(cuda_group, _guarded(gather_and_check, cuda_group, cp, UNITS[unit]()), f"AG {unit}")


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_reduce_scatter_unit_bf16_to_fp32(cuda_group, cp, unit):
    _agree(cuda_group, _guarded(reduce_and_check, cuda_group, cp, UNITS[unit]()), f"RS {unit}")


def test_reduce_scatter_sum_odd_shapes(cuda_group, cp):
    W = cuda_group.size
    shapes = [(W + 3, 5), (1,), (max(W - 1, 1), 7, 3), (0, 4), (4099,), (2 * W, 8)]
    _agree(cuda_group, _guarded(reduce_and_check, cuda_group, cp, shapes, op="sum"),
           "RS odd shapes")


def test_repeated_calls_reuse_slots(cuda_group, cp):
    """Back-to-back collectives on the default slots and staging (flag uses advance)."""
    shapes = [(257, 64), (31,), (1024, 1024)]
    bad = []
    for _ in range(5):
        bad += _guarded(gather_and_check, cuda_group, cp, shapes, poison=False)
        bad += _guarded(reduce_and_check, cuda_group, cp, shapes)
    _agree(cuda_group, bad, "repeated")

