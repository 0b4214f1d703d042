"""Flat rank-major layouts and the fused copy kernels of the baselines (the library's
``kernels/pack.cu`` for bytes, ``pack_bf16_f32.cu`` here for the fp32 chunk-cat).

FSDP2's collectives work on flat buffers ``[r0: p0 p1 ..][r1: p0 p1 ..]`` of
padded shards. This module plans that layout, builds the segment tables of
the three conversions (copy-in, copy-out, chunk-cat), and runs them:

* on the GPU with one fused kernel per conversion per unit (tables uploaded
  once, at setup);
* on the host with ``memmove``/NumPy over the same tables, so CPU runs check
  the table logic that the GPU executes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tidearray.backends.cuda import kernels
from tidearray.backends.cuda.kernels import PACK_BYTES_TILE as BYTES_TILE
from tidearray.backends.cuda.kernels import pack_table as seg_table
from tidearray.layout import FlatLayout, flat_layout  # noqa: F401  (re-exported)

THREADS = 512
#: Tile size of ``pack_bf16_f32.cu`` (``CVT_TILE`` there), in elements.
CVT_TILE = 32768
#: The bf16 -> fp32 chunk-cat kernel's source, beside this module.
CVT_SOURCE = Path(__file__).resolve().parent / "pack_bf16_f32.cu"
MAX_GRID = 2**31 - 1


Seg = tuple  # (dst, src, valid, total): addresses in bytes, counts in units


def copy_in_segs(lay: FlatLayout, shard_ptrs: Sequence[int], flat_ptr: int, rank: int,
                 itemsize: int) -> list[Seg]:
    """Local padded shards into this rank's block of the flat buffer (bytes)."""
    base = flat_ptr + rank * lay.block_numel * itemsize
    return [(base + off * itemsize, p, s.shard_numel * itemsize, s.shard_numel * itemsize)
            for s, off, p in zip(lay.specs, lay.offsets, shard_ptrs)]


def copy_out_segs(lay: FlatLayout, flat_ptr: int, param_ptrs: Sequence[int],
                  itemsize: int) -> list[Seg]:
    """Every rank's valid rows from the flat buffer into each parameter (bytes)."""
    segs = []
    for r in range(lay.world):
        for s, off, p in zip(lay.specs, lay.offsets, param_ptrs):
            n = s.valid_rows(r) * s.row_numel * itemsize
            segs.append((p + r * s.shard_numel * itemsize,
                         flat_ptr + (r * lay.block_numel + off) * itemsize, n, n))
    return segs


def chunk_cat_segs(lay: FlatLayout, grad_ptrs: Sequence[int], flat_ptr: int, in_itemsize: int,
                   out_itemsize: int) -> list[Seg]:
    """Each gradient's rank-r rows into block r of the flat buffer, padding zeroed (elements)."""
    segs = []
    for r in range(lay.world):
        for s, off, g in zip(lay.specs, lay.offsets, grad_ptrs):
            segs.append((flat_ptr + (r * lay.block_numel + off) * out_itemsize,
                         g + r * s.shard_numel * in_itemsize,
                         s.valid_rows(r) * s.row_numel, s.shard_numel))
    return segs


def ptr(a: Any) -> int:
    """The address of a NumPy or CuPy array's first element."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def to_bytes(segs: list[Seg], itemsize: int) -> list[Seg]:
    return [(d, s, v * itemsize, t * itemsize) for d, s, v, t in segs]


class HostCopy:
    """A conversion on the host: the table executed with memmove / NumPy."""

    ctas = 0

    def __init__(self, segs: list[Seg], kind: str) -> None:
        self.segs = [s for s in segs if s[3] > 0]
        self.kind = kind

    def __call__(self, stream: Any = None) -> None:
        for d, s, v, t in self.segs:
            if self.kind == "bytes":
                ctypes.memmove(d, s, v)
                if t > v:
                    ctypes.memset(d + v, 0, t - v)
                continue
            out = np.frombuffer((ctypes.c_char * (t * 4)).from_address(d), np.float32)
            src = np.frombuffer((ctypes.c_char * (v * 2)).from_address(s), np.uint16) if v else \
                np.empty(0, np.uint16)
            out[:v] = (src.astype(np.uint32) << 16).view(np.float32)
            out[v:] = 0


class GpuCopy:
    """A conversion on the GPU: one launch of a kernel of pack.cu over an uploaded table."""

    def __init__(self, segs: list[Seg], kind: str) -> None:
        import cupy

        tile = BYTES_TILE if kind == "bytes" else CVT_TILE
        table, self.ntiles = seg_table(segs, tile)
        self.nseg = len(table)
        self.table = cupy.asarray(table)
        self.kernel = _function("pack_bytes" if kind == "bytes" else "pack_bf16_f32")
        # One CTA per tile: a grid-stride grid larger than what fits on the SMs at
        # once leaves a slow tail wave (measured: 2x slower bf16->fp32 packs).
        self.ctas = int(min(self.ntiles, MAX_GRID))

    def __call__(self, stream: Any) -> None:
        if not self.ntiles:
            return
        with stream:
            self.kernel((self.ctas,), (THREADS,),
                        (self.table, np.int32(self.nseg), np.int64(self.ntiles)))


def chunk_cat(cuda: bool, lay: FlatLayout, grads: Sequence[Any], flat: Any) -> Any:
    """The conversion of a unit's gradients (``grads``, its full parameters, all of one
    dtype) into ``flat``, its fp32 flat buffer laid out as ``lay``, padding zeroed: bf16
    by the bf16 -> fp32 kernel, fp32 by the byte copy; None for other dtypes."""
    ptrs, dtype = [ptr(g) for g in grads], grads[0].dtype if grads else np.float32
    if dtype == np.float32:
        return make_copy(cuda, to_bytes(chunk_cat_segs(lay, ptrs, ptr(flat), 4, 4), 4), "bytes")
    if dtype.name == "bfloat16":
        return make_copy(cuda, chunk_cat_segs(lay, ptrs, ptr(flat), 2, 4), "bf16_f32")
    return None


def make_copy(cuda: bool, segs: list[Seg], kind: str) -> Any:
    """``kind`` is ``"bytes"`` (segments in bytes) or ``"bf16_f32"`` (in elements)."""
    return GpuCopy(segs, kind) if cuda else HostCopy(segs, kind)


def _function(name: str) -> Any:
    """``pack_bytes`` of the library's ``kernels/pack.cu``, or ``pack_bf16_f32`` of
    :data:`CVT_SOURCE` (its segment header the library's), compiled once per device."""
    import cupy

    device = cupy.cuda.Device().id
    if name == "pack_bytes":
        return kernels.function("pack.cu", name, device)
    return _cvt_module(device).get_function(name)


@functools.cache
def _cvt_module(device: int) -> Any:
    return kernels.compile_source(kernels.with_headers(CVT_SOURCE.read_text()),
                                  "benchmarks/baselines/pack_bf16_f32.cu")
