"""Run one all-gather or reduce-scatter and list what is wrong with it (no asserts).

Every rank builds the same inputs from a shared seed: the full parameters for
all-gather, and every rank's gradients for reduce-scatter, so each rank holds
an independent reference. Checks return failure strings, and the tests pass
them to ``_util.agree`` so every rank fails together.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

import tidearray
from tidearray.layout import shard_shape

from ..._util import (
    agree,
    bits,
    compare_bits,
    padded_shard,
    random_bits,
    random_values,
    stall,
    to_numpy,
    to_xp,
)

#: Outputs are filled with all-ones bytes before each run; data never holds this pattern.
POISON_BYTE = 0xFF


def poison_pattern(dtype: np.dtype) -> int:
    return int.from_bytes(bytes([POISON_BYTE]) * dtype.itemsize, "little")


def full_params(shapes: Sequence[tuple], dtype: np.dtype, seed: int) -> list[np.ndarray]:
    """The unit's full parameters, random bits, identical on every rank."""
    rng = np.random.default_rng(seed)
    return [random_bits(rng, s, dtype, avoid=poison_pattern(dtype)) for s in shapes]


def rank_grads(shapes: Sequence[tuple], dtype: np.dtype, seed: int, rank: int) -> list:
    """Rank ``rank``'s gradients; any rank can regenerate any other rank's."""
    rng = np.random.default_rng([seed, rank])
    return [random_values(rng, s, dtype) for s in shapes]


def slot_bytes(slot: Any) -> Any:
    return slot.view(0, (slot.nbytes,), np.uint8)


def poison(slot: Any) -> None:
    slot_bytes(slot).fill(POISON_BYTE)


def ptr(group: Any, a: Any) -> int:
    return group.backend.resolve(a).ptr


def _stray_writes(group: Any, slot: Any, outs: Sequence[Any]) -> list[str]:
    """Bytes of ``slot`` outside every output that are no longer poisoned."""
    raw = to_numpy(slot_bytes(slot)).copy()
    base = slot.ptr(group.local_rank)
    for o in outs:
        lo = ptr(group, o) - base
        raw[lo:lo + o.nbytes] = POISON_BYTE
    bad = np.flatnonzero(raw != POISON_BYTE)
    return [f"{bad.size} slot bytes outside the parameters were written, first at "
            f"offset {bad[0]}"] if bad.size else []


def _placement(group: Any, slot: Any, outs: Sequence[Any]) -> list[str]:
    """Outputs must be views inside the slot (zero copy), pairwise disjoint."""
    base, failures = slot.ptr(group.local_rank), []
    spans = sorted((ptr(group, o) - base, o.nbytes, i) for i, o in enumerate(outs) if o.nbytes)
    for lo, n, i in spans:
        if lo < 0 or lo + n > slot.nbytes:
            failures.append(f"parameter {i}: output at slot offset {lo} is not inside the slot")
    for (lo, n, i), (lo2, _, j) in zip(spans, spans[1:]):
        if lo + n > lo2:
            failures.append(f"parameters {i} and {j} overlap in the slot")
    return failures


def same_everywhere(comm: Any, *drawn: Any) -> None:
    """Fail on every rank, clearly, if ranks drew different examples (seed not shared)."""
    mine = repr(drawn)
    agree(comm, [] if len(set(comm.allgather(mine))) == 1 else
          [f"Hypothesis drew different examples on different ranks; this rank drew {mine}"])


def run_all_gather(group: Any, shapes: Sequence[tuple], dtype: np.dtype, seed: int, *,
                   slot: Any = None, async_op: bool = False,
                   late: float = 0.0) -> tuple[list[str], list]:
    """Gather a unit (into a poisoned ``slot`` if given); returns (failures, outputs).

    ``late``: seconds this rank's queue stalls before poisoning its slot; peers that
    wrote without waiting for its grant would have their data overwritten by the poison.
    """
    same_everywhere(group.comm, shapes, str(dtype), seed, async_op)
    xp, W, r = group.backend.xp, group.size, group.rank
    fulls = full_params(shapes, dtype, seed)
    shards = [tidearray.shard(to_xp(xp, f), rank=r, world=W) for f in fulls]
    failures = []
    for i, (s, f) in enumerate(zip(shards, fulls)):  # the input helper, against NumPy
        failures += compare_bits(s, padded_shard(f, W, r), f"shard() of parameter {i}")
    if slot is not None:
        stall(xp, late)
        poison(slot)
    res = tidearray.all_gather(shards, shapes, group=group, slot=slot, async_op=async_op)
    if async_op:
        assert isinstance(res, tidearray.Work)
        res = res.wait()
    if len(res) != len(shapes):
        return failures + [f"expected {len(shapes)} outputs, got {len(res)}"], res
    for i, (o, f) in enumerate(zip(res, fulls)):
        failures += compare_bits(o, f, f"parameter {i} of shape {f.shape}")
    for i, (s, f) in enumerate(zip(shards, fulls)):
        failures += compare_bits(s, padded_shard(f, W, r), f"input shard {i} (modified)")
    if slot is not None:
        failures += _placement(group, slot, res) + _stray_writes(group, slot, res)
    return failures, res


def check_gathered(outs: Sequence[Any], shapes: Sequence[tuple], dtype: np.dtype, seed: int,
                   label: str) -> list[str]:
    """Outputs of an earlier gather still hold that gather's data."""
    fulls = full_params(shapes, dtype, seed)
    return [f for i, (o, w) in enumerate(zip(outs, fulls))
            for f in compare_bits(o, w, f"{label}: parameter {i}")]


def rs_reference(shapes: Sequence[tuple], dtype: np.dtype, seed: int, world: int, rank: int,
                 op: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """fp64 reference shards and per-element error bounds for ``rank``.

    Bound: bf16/fp16/fp32 -> fp32 is exact, so each output element is an fp32
    sum of ``W`` exact terms rounded at most ``W - 1`` times (any order or
    tree), then scaled by fp32(1/W) (for avg: one rounding of 1/W, one of the
    product). To first order
    ``|out - ref| <= (W + 1) * 2**-24 * scale * sum_r |g_r|``; we allow
    ``(W + 2)``, elementwise. Padding rows have bound -0.0 (a real element whose
    terms are all zero has +0.0, and may sum to -0.0) and must be +0.0.
    """
    grads = [rank_grads(shapes, dtype, seed, q) for q in range(world)]
    scale = 1.0 / world if op == "avg" else 1.0
    refs, bounds = [], []
    for i in range(len(shapes)):
        total = sum(g[i].astype(np.float64) for g in grads) * scale
        mag = sum(np.abs(g[i].astype(np.float64)) for g in grads) * scale
        refs.append(padded_shard(np.asarray(total, np.float64), world, rank))
        bound = padded_shard(np.asarray(mag * (world + 2) * 2.0**-24), world, rank)
        bound[padded_shard(np.ones(shapes[i]), world, rank) == 0] = -0.0
        bounds.append(bound)
    return refs, bounds


def compare_rs(results: Sequence[Any], refs: Sequence[np.ndarray],
               bounds: Sequence[np.ndarray]) -> list[str]:
    failures = []
    for i, (res, ref, bound) in enumerate(zip(results, refs, bounds)):
        got = to_numpy(res)
        if got.dtype != np.float32 or got.shape != ref.shape:
            failures.append(f"parameter {i}: expected float32{ref.shape}, got "
                            f"{got.dtype}{got.shape}")
            continue
        err = np.abs(got.astype(np.float64) - ref)
        bad = np.flatnonzero(~(err <= bound))  # NaN (poison left over) counts as bad
        if bad.size:
            k = bad[0]
            failures.append(f"parameter {i}: {bad.size} of {ref.size} elements off, first at "
                            f"flat {k}: got {got.flat[k]!r}, expected {ref.flat[k]!r} "
                            f"+- {bound.flat[k]:.3g}")
        pad = (bound == 0) & np.signbit(bound)
        if (bits(got)[pad] != 0).any():
            failures.append(f"parameter {i}: padding rows are not exactly +0.0")
    return failures


def run_reduce_scatter(group: Any, shapes: Sequence[tuple], dtype: np.dtype, seed: int,
                       op: str, *, out: bool = True, staging: Any = None,
                       async_op: bool = False) -> tuple[list[str], list]:
    """Reduce-scatter a unit (into poisoned ``out`` arrays if ``out``); (failures, results)."""
    same_everywhere(group.comm, shapes, str(dtype), seed, op, out, async_op)
    xp, W, r = group.backend.xp, group.size, group.rank
    mine = rank_grads(shapes, dtype, seed, r)
    grads = [to_xp(xp, g) for g in mine]
    outs: Optional[list] = None
    if out:
        outs = [xp.full(shard_shape(s, W), np.nan, np.float32) for s in shapes]
    res = tidearray.reduce_scatter(grads, op=op, out=outs, group=group, staging=staging,
                                   async_op=async_op)
    if async_op:
        assert isinstance(res, tidearray.Work)
        res = res.wait()
    failures = compare_rs(res, *rs_reference(shapes, dtype, seed, W, r, op))
    if outs is not None:
        failures += [f"parameter {i}: result is not the out= array" for i, (a, b) in
                     enumerate(zip(res, outs)) if a.size and ptr(group, a) != ptr(group, b)]
    for i, (g, m) in enumerate(zip(grads, mine)):
        failures += compare_bits(g, m, f"gradient {i} (modified)")
    return failures, res


#: A unit with the awkward cases: ragged, d0 < W-ish, 1-D, a single element.
def small_unit(world: int) -> list[tuple]:
    return [(4 * world + 1, 3), (3 * world, 2), (max(world - 1, 1),), (1, 1)]


def check_usable(group: Any, seed: int = 7) -> list[str]:
    """A good all-gather and reduce-scatter, to prove the group survived an error."""
    shapes = small_unit(group.size)
    bf16 = tidearray.bfloat16
    failures, _ = run_all_gather(group, shapes, bf16, seed)
    f2, _ = run_reduce_scatter(group, shapes, bf16, seed, "avg")
    return failures + f2


def documented_sum(grads: Sequence[np.ndarray], topo: Any, scale: float) -> np.ndarray:
    """One parameter's gradients (one per rank, in rank order) reduced in the documented
    order: on each node its ranks' in local-rank order in fp32, times ``scale``; then
    the nodes' partial sums in node order (docs/topology.md)."""
    L = topo.local_size
    parts = []
    for m in range(topo.num_nodes):
        acc = grads[m * L].astype(np.float32)
        for q in range(1, L):
            acc = acc + grads[m * L + q].astype(np.float32)
        if scale != 1:
            acc = acc * np.float32(scale)
        parts.append(acc)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total
