"""The reduce-scatter's accumulate: one kernel launch per chunk, tables built on the host.

:func:`build_table` is pure NumPy (tested on CPU); :class:`Accumulator` uploads
a table and launches ``kernels/accumulate.cu`` on a lane stream: the library's one
accumulate (other kernels were measured and retired: docs/backends.md).

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

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from ..._dtypes import normalize
from .._base import AccumPiece, Batch
from .streams import check_uploaded, keep_until_read

#: Smallest tile, in elements: one block's unit of work (a multiple of every vector width).
TILE = 8192
#: Tiles per launch to aim for, per block of the grid: enough to balance load,
#: few enough that the host builds the table in microseconds.
TILES_PER_BLOCK = 4
#: Threads per block.
BLOCK = 512
#: Blocks per SM of a launch that has the device alone (``Accumulator.table``'s ``alone``).
ALONE_PER_SM = 2
#: Table slots in flight (see [Note: table lifetime]).
RING = 16
#: Kernel name per (source dtype, output dtype).
KERNELS = {("bfloat16", "float32"): "tide_accumulate_bf16",
           ("float16", "float32"): "tide_accumulate_fp16",
           ("float32", "float32"): "tide_accumulate_fp32",
           ("float32", "bfloat16"): "tide_cast_bf16",
           ("float32", "float16"): "tide_cast_fp16"}


class Kernel(NamedTuple):
    """One accumulate kernel, as :meth:`Accumulator.launch` launches it."""

    fn: Any
    """The ``cupy.RawKernel``: arguments and table as ``tide_accumulate_*`` in
    ``kernels/accumulate.cu``."""
    block: int
    """Threads per block."""
    smem: int
    """Dynamic shared memory per block, in bytes."""
    grid: int
    """Grid cap: a launch takes ``min(tiles, grid)`` blocks, and its tiles are sized
    for about ``TILES_PER_BLOCK * grid`` (:func:`choose_tile`)."""


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
                 n_srcs: int, kernel: Kernel, grid: int) -> None:
        self.table, self.n_tiles, self.tile = table, n_tiles, tile
        self.n_pieces, self.n_srcs = n_pieces, n_srcs
        self.kernel, self.grid = kernel, grid
        self.dev: Any = None
        self.event: Any = None

    def __len__(self) -> int:
        return self.n_pieces


class Accumulator:
    """Launches the accumulate kernel; owns the ring of table slots.

    Args:
        device: the CUDA device id.
        sm_count: multiprocessors.
        ctas: grid cap (``Config.accum_ctas``); None means half the SMs. The
            accumulate of chunk k runs while chunk k+1 is still on the copy engines,
            so it needs to keep pace with them, not to fill the GPU: a small grid
            leaves the other SMs to concurrent compute. A plan whose caller runs
            nothing beside it (``alone``) has no compute to leave room for, and its
            kernel is bound by memory bandwidth, which half the SMs do not reach (a
            one-rank reduce-scatter or a gather's cast is that kernel alone):
            ``ALONE_PER_SM`` blocks per SM, unless ``ctas`` is given.

    Attributes:
        max_grid: the grid cap of a table that shares the device.
        alone_grid: the grid cap of a table that has it alone.
    """

    def __init__(self, device: int, sm_count: int, ctas: Optional[int] = None) -> None:
        self.device = device
        self.sm_count = sm_count
        self._ring = [_Slot() for _ in range(RING)]
        self._next = 0
        self._kernels: dict = {}
        self.max_grid = max(1, ctas) if ctas else max(1, sm_count // 2)
        self.alone_grid = max(1, ctas) if ctas else max(1, ALONE_PER_SM * sm_count)

    def table(self, pieces: Sequence[AccumPiece], src_dtype: Any,
              out_dtype: Any = "float32", alone: bool = False) -> AccumTable:
        """A plan's non-empty ``pieces`` (all with as many sources), tiled and with
        their kernel chosen, for :meth:`launch` call after call; ``alone``: its
        launches have the device to themselves (``alone_grid``)."""
        n_srcs = len(pieces[0].srcs)
        kernel = self._kernel(src_dtype, out_dtype, n_srcs)
        grid = self.alone_grid if alone else kernel.grid
        tile = choose_tile(sum(p.numel for p in pieces), grid)
        table, n_tiles = build_table(pieces, tile)
        return AccumTable(table, n_tiles, tile, len(pieces), n_srcs, kernel,
                          min(n_tiles, grid))

    def launch(self, stream: Any, pieces: Any, src_dtype: Any, scale: float,
               out_dtype: Any = "float32", capture: bool = False) -> None:
        """``out = scale * sum(srcs)`` per piece, one launch on ``stream`` (a cupy Stream):
        fp32, rounded to ``out_dtype`` (bf16 or fp16 for fp32 sources only).
        ``pieces``: an :class:`AccumTable` (a plan's), or pieces of this call only.
        ``capture``: the stream is capturing a graph, which keeps the table alive."""
        import cupy

        if isinstance(pieces, AccumTable):
            t = pieces
            if t.dev is None:  # uploaded in stream order, before the launch reads it
                check_uploaded(capture)
                with stream:
                    t.dev = cupy.asarray(t.table)
                t.event = cupy.cuda.Event(block=False, disable_timing=True)
                keep_until_read(t, (t.event,), t.dev)  # its last kernel may read it
            dev, event = t.dev, t.event
        else:
            check_uploaded(capture, "an accumulate of raw pieces")
            t = self.table(pieces, src_dtype, out_dtype)
            dev, event = self._upload(stream, t.table)
        k = t.kernel
        with stream:
            k.fn((t.grid,), (k.block,), (dev, np.int32(t.n_pieces), np.int32(t.n_srcs),
                                         np.int64(t.n_tiles), np.int64(t.tile),
                                         np.float32(scale), np.int32(np.float32(scale) != 1)),
                   shared_mem=k.smem)
        if not capture:
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

    def _kernel(self, src_dtype: Any, out_dtype: Any, n_srcs: int) -> Kernel:
        """The kernel for ``n_srcs`` sources of ``src_dtype`` into ``out_dtype``, loaded
        once per normalized triple and kept under the dtypes as given too (when
        hashable), so the next launch normalizes nothing."""
        given = (src_dtype, out_dtype, n_srcs)
        try:
            return self._kernels[given]
        except (KeyError, TypeError):
            pass
        key = (normalize(src_dtype).name, normalize(out_dtype).name, n_srcs)
        if key not in self._kernels:
            self._kernels[key] = self._load(key[0], key[1])
        found = self._kernels[key]
        try:
            self._kernels[given] = found
        except TypeError:  # an unhashable spelling: normalized every time
            pass
        return found

    def _load(self, src: str, out: str) -> Kernel:
        """``kernels/accumulate.cu``'s kernel for (``src``, ``out``: normalized names,
        e.g. ``"bfloat16"``), capped at ``max_grid``."""
        from . import kernels as _kernels

        return Kernel(_kernels.function("accumulate.cu", KERNELS[src, out], self.device),
                      BLOCK, 0, self.max_grid)
