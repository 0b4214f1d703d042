"""One unit's inputs on this rank, and the checks of every implementation's outputs.

Parameters: element ``i`` of parameter ``p`` is ``values(1 + p)[i]`` rounded to
bf16 (the same on every rank). Gradients: rank ``r``'s gradient of ``p`` is
stream ``GRAD_SEED * (r + 1) + p``, scaled by a power of two drawn from
``2**-20 .. 2**5`` per element, then rounded to bf16: magnitudes that far apart
make fp32 sums of two ranks' terms inexact, so the fp64 check can tell fp32
paths from each other and from bf16 ones. Any rank can rebuild any rank's data,
so the fp64 reduce-scatter reference needs no communication.

:meth:`UnitData.renew` rewrites every input in place with the next round's
values: the verified call runs on inputs the timed calls never saw.
"""

from __future__ import annotations

from typing import Any, Sequence

from tests.support import Unit, values
from tidearray import bfloat16, float32
from tidearray.layout import ShardSpec, shard_spec

GRAD_SEED = 1_000_003
#: Seed offset of each :meth:`UnitData.renew` round; exponent range of the gradients.
ROUND_SEED = 7_919
EXP_LO, EXP_HI = -20, 5


class UnitData:
    """Padded bf16 shards (AG input) and full bf16 gradients (RS input) of ``unit``."""

    def __init__(self, unit: Unit, xp: Any, rank: int, world: int) -> None:
        self.unit, self.xp, self.rank, self.world = unit, xp, rank, world
        self.round = 0
        self.specs: tuple[ShardSpec, ...] = tuple(
            shard_spec(s, 2, world, i) for i, s in enumerate(unit.shapes))
        self.shards = [self._shard(p) for p in range(len(self.specs))]
        self.grads = [self._grad(rank, p, 0, s.numel).reshape(s.shape)
                      for p, s in enumerate(self.specs)]

    def renew(self) -> None:
        """The next round's inputs, written in place (prepared calls keep their arrays)."""
        self.round += 1
        for p, s in enumerate(self.specs):
            self.shards[p][...] = self._shard(p)
            self.grads[p][...] = self._grad(self.rank, p, 0, s.numel).reshape(s.shape)

    @property
    def input_nbytes(self) -> int:
        return sum(a.nbytes for a in self.shards) + sum(a.nbytes for a in self.grads)

    def _values(self, seed: int, start: int, count: int) -> Any:
        return values(self.xp, seed, start, count).astype(bfloat16)

    def _grad_seed(self, rank: int, p: int) -> int:
        return GRAD_SEED * (rank + 1) + p + ROUND_SEED * self.round

    def _grad(self, rank: int, p: int, start: int, count: int) -> Any:
        """Rank ``rank``'s gradient elements, magnitudes spread over 2**-20..2**5 (bf16)."""
        xp, seed = self.xp, self._grad_seed(rank, p)
        spread = values(xp, seed + 0x5BD1E995, start, count)  # [-1, 1): the exponent
        exp = xp.floor((spread + 1) * ((EXP_HI - EXP_LO) / 2)).astype(xp.int32) + EXP_LO
        return xp.ldexp(values(xp, seed, start, count), exp).astype(bfloat16)

    def _shard(self, p: int) -> Any:
        s = self.specs[p]
        out = self.xp.zeros(s.shard_shape, bfloat16)
        start, stop = s.rows(self.rank)
        n = (stop - start) * s.row_numel
        if n:
            out.reshape(-1)[:n] = self._values(self._param_seed(p), start * s.row_numel, n)
        return out

    def _param_seed(self, p: int) -> int:
        return 1 + p + ROUND_SEED * self.round

    def full_param(self, p: int) -> Any:
        s = self.specs[p]
        return self._values(self._param_seed(p), 0, s.numel).reshape(s.shape)

    def check_ag(self, outs: Sequence[Any]) -> tuple[bool, str]:
        """Bitwise equality of every gathered parameter with the reference."""
        if len(outs) != len(self.specs):
            return False, f"expected {len(self.specs)} outputs, got {len(outs)}"
        for p, o in enumerate(outs):
            ref = self.full_param(p)
            if tuple(o.shape) != ref.shape:
                return False, f"parameter {p}: expected shape {ref.shape}, got {o.shape}"
            if not bool((o.view(self.xp.uint16) == ref.view(self.xp.uint16)).all()):
                return False, f"parameter {p}: gathered values differ from the reference"
        return True, ""

    def rs_error(self, outs: Sequence[Any]) -> dict:
        """Errors of this rank's fp32 shards (op avg) against an fp64 reference.

        Returns ``max_abs``, ``mean_abs``, ``norm_rel`` (max abs error / max
        |reference|), ``elem_rel`` (max elementwise relative error where |ref| >=
        2**-10), ``nonfinite`` (NaN or inf results: a poisoned output left
        unwritten) and ``pad_nonzero`` (padding rows that are not zero).
        """
        xp = self.xp
        max_abs, max_ref, elem_rel, pad_bad = 0.0, 0.0, 0.0, 0
        sum_abs, count, nonfinite = 0.0, 0, 0
        for p, (o, s) in enumerate(zip(outs, self.specs)):
            start, stop = s.rows(self.rank)
            n = (stop - start) * s.row_numel
            flat = o.reshape(-1)
            pad_bad += int(xp.count_nonzero(flat[n:]))
            if not n:
                continue
            ref = xp.zeros(n, xp.float64)
            for r in range(self.world):
                ref += self._grad(r, p, start * s.row_numel, n).astype(xp.float64)
            ref /= self.world
            got = flat[:n].astype(xp.float64)
            nonfinite += int(xp.count_nonzero(~xp.isfinite(got)))
            err = xp.abs(xp.nan_to_num(got, nan=0.0, posinf=0.0, neginf=0.0) - ref)
            max_abs = max(max_abs, float(err.max()))
            sum_abs, count = sum_abs + float(err.sum()), count + n
            max_ref = max(max_ref, float(xp.abs(ref).max()))
            big = xp.abs(ref) >= 2.0**-10
            if bool(big.any()):
                elem_rel = max(elem_rel, float((err[big] / xp.abs(ref[big])).max()))
        return {"max_abs": max_abs, "mean_abs": sum_abs / count if count else 0.0,
                "norm_rel": max_abs / max_ref if max_ref else 0.0, "elem_rel": elem_rel,
                "nonfinite": nonfinite, "pad_nonzero": pad_bad}


def recv_nbytes(unit: Unit, world: int) -> int:
    """Bytes of the unit (bf16) that each rank receives from its peers: ``(W-1)/W`` of it.

    The same numerator for every implementation and both collectives, so
    bandwidth ratios equal time ratios (fp32 traffic of a baseline is its cost).
    """
    return unit.nbytes * (world - 1) // world


def as_f32_shards(xp: Any, flat: Any, offsets: Sequence[int], specs: Sequence[ShardSpec]) -> list:
    """Views of a flat fp32 buffer as each parameter's padded shard."""
    return [flat[o:o + s.shard_numel].reshape(s.shard_shape) for o, s in zip(offsets, specs)]


__all__ = ["UnitData", "recv_nbytes", "as_f32_shards", "float32"]
