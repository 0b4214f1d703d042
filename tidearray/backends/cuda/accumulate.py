"""The reduce-scatter's accumulate: one kernel launch per chunk, tables built on the host.

:func:`build_table` is pure NumPy (tested on CPU); :class:`Accumulator` uploads
a table and launches ``kernels/accumulate.cu`` on a lane stream, or, for 16-bit
sources into fp32 with ``Config.accum_kernel`` ``"bulk"`` or ``"narrow"``,
``kernels/accumulate_bulk.cu`` or ``kernels/accumulate_narrow.cu`` (the same table and
arguments, the same bits; sources streamed through shared memory by bulk async copies).

[Note: table lifetime]
A plan's pieces become an :class:`AccumTable` when the plan is built; its table
is uploaded in stream order at the first launch and stays on the device while
the plan lives, and when the plan goes the table is kept until its last kernel
has read it. Pieces passed raw (one call's) are tiled per launch and read from
device memory that an async H2D copy filled from pinned host memory, both on
the lane stream. Neither buffer may be reused until the kernel has run, so
those tables live in a small ring of slots, each guarded by an event recorded
after its kernel. Taking a slot waits (on the host) for its event; with
``RING`` slots that wait is only ever on work issued ``RING`` accumulates ago,
whose inputs are all issued already, so it cannot deadlock against a peer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ..._config import ACCUM_KERNELS
from ..._dtypes import normalize
from .._base import AccumPiece, Batch

#: Smallest tile, in elements: one block's unit of work (a multiple of every vector width).
TILE = 8192
#: Tiles per launch to aim for, per block of the grid: enough to balance load,
#: few enough that the host builds the table in microseconds.
TILES_PER_BLOCK = 4
#: Threads per block.
BLOCK = 512
#: Table slots in flight (see [Note: table lifetime]).
RING = 16
#: Threads per block of the bulk kernel (``THREADS`` in ``kernels/accumulate_bulk.cu``).
BULK_BLOCK = 256
#: Dynamic shared memory of the bulk kernel (``SMEM_BYTES`` there): 6 stages of two
#: 16 KB source slots, then an 8-byte mbarrier per stage. The kernel traps on less.
BULK_SMEM = 6 * 2 * 16384 + 6 * 8
#: The narrow kernel's (``kernels/accumulate_narrow.cu``): one warp, two stages of
#: 8 KB, then 512 bytes for the mbarriers, the stages' items and the walk's cursor.
NARROW_BLOCK = 32
NARROW_SMEM = 2 * 8192 + 512
#: Sources the narrow kernel takes (one rank's or two); a launch with more uses the
#: vector kernel. With four or eight, each source's part of an 8 KB stage is 2 or 1 KB,
#: and on one H200 the narrow kernel streamed at 0.58 and 0.29 elements per ns per SM,
#: against the vector kernel's 1.9 and 1.1 (``tests/gpu/narrow_probe.py``).
NARROW_MAX_SOURCES = 2
#: Per streaming kernel: its file, block and dynamic shared memory.
STREAMED = {"bulk": ("accumulate_bulk.cu", BULK_BLOCK, BULK_SMEM),
            "narrow": ("accumulate_narrow.cu", NARROW_BLOCK, NARROW_SMEM)}
#: Streaming kernel name per 16-bit source dtype (then ``_bulk`` or ``_narrow``); fp32 out.
STREAMED_KERNELS = {"bfloat16": "tide_accumulate_bf16", "float16": "tide_accumulate_fp16"}
#: Kernel name per (source dtype, output dtype).
KERNELS = {("bfloat16", "float32"): "tide_accumulate_bf16",
           ("float16", "float32"): "tide_accumulate_fp16",
           ("float32", "float32"): "tide_accumulate_fp32",
           ("float32", "bfloat16"): "tide_cast_bf16",
           ("float32", "float16"): "tide_cast_fp16"}


def choose_tile(total: int, max_grid: int) -> int:
    """Tile size for ``total`` elements: at least :data:`TILE`, about
    ``TILES_PER_BLOCK * max_grid`` tiles in all (plus one partial tile per piece)."""
    per = -(-total // (TILES_PER_BLOCK * max_grid))
    return max(TILE, -(-per // TILE) * TILE)


def build_table(pieces: Sequence[AccumPiece], tile: int = TILE) -> tuple[np.ndarray, int]:
    """The int64 table ``accumulate.cu`` walks, and its tile count.

    Layout: ``[out, numel, vec, first_tile] * n_pieces``, then ``n_src`` source
    pointers per piece. ``vec`` is 1 where the output and every source are
    16-byte aligned (vector loads and stores allowed). Piece ``p`` covers tiles
    ``[first_tile[p], first_tile[p+1])``; the kernel finds a tile's piece by
    binary search, so the table is O(pieces), cheap to build per launch.

    Args:
        pieces: non-empty pieces, all with the same number of sources.
        tile: elements per tile.
    """
    n_src = len(pieces[0].srcs)
    head: list[int] = []
    srcs: list[int] = []
    first = 0
    for p in pieces:
        assert len(p.srcs) == n_src and p.numel > 0, "pieces differ in source count"
        vec = p.out % 16 == 0 and all(s % 16 == 0 for s in p.srcs)
        head += (p.out, p.numel, int(vec), first)
        srcs += p.srcs
        first += -(-p.numel // tile)
    return np.array(head + srcs, np.int64), first


class _Slot:
    """Pinned host and device memory for one table, and the event after its kernel."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.host: Any = None
        self.host_view: Any = None
        self.dev: Any = None
        self.event: Any = None

    def take(self, nbytes: int) -> None:
        import cupy

        if self.event is not None and not self.event.done:
            self.event.synchronize()  # its previous kernel has read the table
        if nbytes > self.nbytes:
            size = max(nbytes, 2 * self.nbytes, 1 << 16)
            self.host = cupy.cuda.alloc_pinned_memory(size)
            self.host_view = np.frombuffer(self.host, np.uint8, size)
            self.dev = cupy.empty(size, np.uint8)
            self.nbytes = size


class AccumTable(Batch):
    """A plan's accumulate: its table, tiled for the grid, and its kernel, chosen once
    ([Note: compiled batches] in ``backends._base``). Uploaded at the first launch,
    in stream order ([Note: table lifetime])."""

    def __init__(self, table: np.ndarray, n_tiles: int, tile: int, n_pieces: int,
                 n_srcs: int, kernel: tuple, grid: int) -> None:
        self.table, self.n_tiles, self.tile = table, n_tiles, tile
        self.n_pieces, self.n_srcs = n_pieces, n_srcs
        self.kernel, self.grid = kernel, grid
        self.dev: Any = None
        self.event: Any = None

    def __len__(self) -> int:
        return self.n_pieces

    def __del__(self) -> None:
        # Its last kernel may still be reading the table: the pool must not reuse it yet.
        try:
            if self.event is not None and not self.event.done:
                self.event.synchronize()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the context is gone
            pass


class Accumulator:
    """Launches the accumulate kernel; owns the ring of table slots.

    Args:
        device: the CUDA device id.
        sm_count: multiprocessors.
        ctas: grid cap (``Config.accum_ctas``); None means half the SMs (one CTA per
            SM for ``"narrow"``). The accumulate of chunk k runs while chunk k+1 is
            still on the copy engines, so it needs to keep pace with them, not to
            fill the GPU: a small grid leaves the other SMs to concurrent compute.
        kernel: ``"vector"`` (``kernels/accumulate.cu``), ``"bulk"``
            (``kernels/accumulate_bulk.cu``) or ``"narrow"``
            (``kernels/accumulate_narrow.cu``); the last two for 16-bit sources into
            fp32, other dtype pairs keep the vector kernels, and so do narrow
            launches of more than :data:`NARROW_MAX_SOURCES` sources. See
            ``Config.accum_kernel``.
    """

    def __init__(self, device: int, sm_count: int, ctas: Optional[int] = None,
                 kernel: str = "vector") -> None:
        assert kernel in ACCUM_KERNELS, kernel  # Config.check refuses others
        self.device = device
        self.sm_count = sm_count
        self.kernel = kernel
        self._ring = [_Slot() for _ in range(RING)]
        self._next = 0
        self._kernels: dict = {}
        self.set_grid(ctas)

    def set_grid(self, ctas: Optional[int]) -> None:
        """Cap the grid at ``ctas`` (None: the default), for tables made from now on.
        ``max_grid`` is the configured kernel's cap, ``vector_grid`` that of launches
        the vector kernel takes instead (other dtypes, too many sources)."""
        self.max_grid = self._grid(ctas, self.kernel)
        self.vector_grid = self._grid(ctas, "vector")

    def _grid(self, ctas: Optional[int], kernel: str) -> int:
        """The grid cap: ``ctas``, else one narrow CTA per SM or half the SMs."""
        if ctas:
            return max(1, ctas)
        return self.sm_count if kernel == "narrow" else max(1, self.sm_count // 2)

    def table(self, pieces: Sequence[AccumPiece], src_dtype: Any,
              out_dtype: Any = "float32") -> AccumTable:
        """A plan's non-empty ``pieces`` (all with as many sources), tiled and with
        their kernel chosen, for :meth:`launch` call after call."""
        key = (src_dtype, out_dtype)
        if self.kernel == "narrow" and len(pieces[0].srcs) > NARROW_MAX_SOURCES:
            key += ("vector",)  # more sources than the narrow kernel takes
        kernel = self._kernel(*key)
        tile = choose_tile(sum(p.numel for p in pieces), self.max_grid)
        table, n_tiles = build_table(pieces, tile)
        grid = min(n_tiles, self.max_grid if kernel[1] == NARROW_BLOCK else self.vector_grid)
        return AccumTable(table, n_tiles, tile, len(pieces), len(pieces[0].srcs), kernel, grid)

    def launch(self, stream: Any, pieces: Any, src_dtype: Any, scale: float,
               out_dtype: Any = "float32") -> None:
        """``out = scale * sum(srcs)`` per piece, one launch on ``stream`` (a cupy Stream):
        fp32, rounded to ``out_dtype`` (bf16 or fp16 for fp32 sources only).
        ``pieces``: an :class:`AccumTable` (a plan's), or pieces of this call only."""
        import cupy

        if isinstance(pieces, AccumTable):
            t = pieces
            if t.dev is None:  # uploaded in stream order, before the launch reads it
                with stream:
                    t.dev = cupy.asarray(t.table)
                t.event = cupy.cuda.Event(block=False, disable_timing=True)
            dev, event = t.dev, t.event
        else:
            t = self.table(pieces, src_dtype, out_dtype)
            dev, event = self._upload(stream, t.table)
        kernel, block, smem = t.kernel
        with stream:
            kernel((t.grid,), (block,), (dev, np.int32(t.n_pieces), np.int32(t.n_srcs),
                                         np.int64(t.n_tiles), np.int64(t.tile),
                                         np.float32(scale), np.int32(np.float32(scale) != 1)),
                   shared_mem=smem)
        event.record(stream)

    def _upload(self, stream: Any, table: np.ndarray) -> tuple:
        """One call's table, through the ring ([Note: table lifetime])."""
        import cupy

        slot = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        slot.take(table.nbytes)
        slot.host_view[:table.nbytes] = table.view(np.uint8)
        cupy.cuda.runtime.memcpyAsync(slot.dev.data.ptr, slot.host.ptr, table.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        if slot.event is None:
            slot.event = cupy.cuda.Event(block=False, disable_timing=True)
        return slot.dev, slot.event

    def _kernel(self, src_dtype: Any, out_dtype: Any,
                which: Optional[str] = None) -> tuple[Any, int, int]:
        """The RawKernel for (source, output) dtypes, its block and its dynamic shared
        memory in bytes; kept under the dtypes as given too (when hashable). ``which``
        names a kernel other than the configured one (kept under its name, after the
        dtypes)."""
        src, out = normalize(src_dtype).name, normalize(out_dtype).name
        which = which or self.kernel
        key = (src, out) if which == self.kernel else (src, out, which)
        if key not in self._kernels:
            from . import kernels as _kernels

            if which in STREAMED and out == "float32" and src in STREAMED_KERNELS:
                file, block, smem = STREAMED[which]
                fn = _kernels.function(file, f"{STREAMED_KERNELS[src]}_{which}", self.device)
                fn.max_dynamic_shared_size_bytes = smem  # the bulk kernel's is above 48 KB
                # As much shared memory as the SM has (the split is set per SM, while
                # idle): a GEMM's CTA then fits beside a narrow one.
                fn.preferred_shared_memory_carveout = 100
                self._kernels[key] = (fn, block, smem)
            else:
                fn = _kernels.function("accumulate.cu", KERNELS[src, out], self.device)
                self._kernels[key] = (fn, BLOCK, 0)
        found = self._kernels[key]
        try:
            self._kernels[(src_dtype, out_dtype) + key[2:]] = found
        except TypeError:  # an unhashable spelling: normalized every time
            pass
        return found
