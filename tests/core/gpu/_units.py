"""Unit shapes (from the benchmark's workloads) and GPU-side data helpers for the cuda tests.

Data is made on the GPU from seeds, so every rank can rebuild every other
rank's inputs locally (no GiB-sized MPI traffic) and references stay cheap.
bf16 values are made by truncating fp32 bits, so no bf16 arithmetic is needed
from CuPy.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def _from_workloads() -> dict:
    """The benchmark's own unit shapes (``tests/support.py``): one definition."""
    from tests import support as workloads

    wanted = ("llama3.1-8b", "qwen3-30b-a3b")
    return {u.name: (lambda u=u: [tuple(s) for s in u.shapes])
            for u in workloads.units(1) if u.name in wanted}


#: name -> function returning the unit's full shapes (Llama-3.1-8B: 416 MiB bf16;
#: Qwen3-30B-A3B: 393 parameters, 1188 MiB).
UNITS = _from_workloads()


def nbytes(shapes: Sequence[Sequence[int]], itemsize: int = 2) -> int:
    return sum(math.prod(s) for s in shapes) * itemsize


def bf16_normal(cp: Any, seed: int, shape: Sequence[int]) -> Any:
    """Standard-normal bf16 values (fp32 bits truncated), never the all-ones NaN pattern."""
    x = cp.random.RandomState(seed).standard_normal(tuple(shape), dtype=cp.float32)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16).view(BF16)


def bf16_to_f64(cp: Any, a: Any) -> Any:
    """Exact bf16 -> fp64 through the bit pattern."""
    return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)


def shard_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk rows of ``rank``: ``[r*c, min((r+1)*c, d0))`` with ``c = ceil(d0/W)``."""
    c = -(-d0 // world)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


def padded_shard(cp: Any, full: Any, world: int, rank: int) -> Any:
    c = -(-full.shape[0] // world)
    start, stop = shard_rows(full.shape[0], world, rank)
    out = cp.zeros((c, *full.shape[1:]), full.dtype)
    if stop > start:
        out.view(cp.uint16)[: stop - start] = full.view(cp.uint16)[start:stop]
    return out
