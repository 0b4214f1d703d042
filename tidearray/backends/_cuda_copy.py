"""Copy-engine transfers: one batched memcpy per call, or one memcpy per copy.

A separate ``cudaMemcpyAsync`` costs about 3.5 us to issue, which caps a unit of
small parameters at a fraction of the link; a batch is one call for any
number of copies (DESIGN.md, "Measured facts"). Peer addresses are IPC
mappings, so the copies are peer-to-peer over NVLink, done by copy engines:
no SM is used.

[Note: packed batches]
cuda-python's ``cudaMemcpyBatchAsync`` takes Python lists and converts every
address on every call, about 2 us per copy (run 1's calibration): 1.6 ms for
the 800 copies of a 393-parameter gather. Collectives pass copies as tuples
that live in their cached issue programs, so the addresses are packed once
into ``uint64`` arrays (kept by the tuple's identity, the tuple held so its id
is not reused) and the driver's ``cuMemcpyBatchAsync`` is called through
ctypes on those arrays: one C call per batch whatever its length. The entry
point is taken with ``cuGetProcAddress`` at the CUDA 12.8 ABI, the first
with batches; where that fails, the cuda-python runtime call is the fallback.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import numpy as np

from .._errors import TideBackendError
from .._layout import split_copies
from . import _cuda_driver

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
#: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order.
_SRC_ORDER_STREAM = 1
#: Packed batches and split runs kept (programs are cached; this bounds the rest).
CACHE_ENTRIES = 4096
#: Executable copy graphs kept.
GRAPHS = 512


class IdentityCache:
    """Values derived from immutable tuples, kept by the tuple's identity.

    Each entry holds its tuple, so the tuple's id cannot be reused while the
    entry lives; oldest entries go first.
    """

    def __init__(self, size: int = CACHE_ENTRIES, evict: Any = None) -> None:
        self._size = size
        self._evict = evict
        self._entries: dict[int, tuple[Any, Any]] = {}

    def get(self, key: Any, make: Any) -> Any:
        entry = self._entries.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1]
        value = make(key)
        if isinstance(key, tuple):  # lists may change: never cached
            if len(self._entries) >= self._size:
                _, old = self._entries.pop(next(iter(self._entries)))
                if self._evict is not None:
                    self._evict(old)
            self._entries[id(key)] = (key, value)
        return value


class _DriverBatch:
    """``cuMemcpyBatchAsync`` (CUDA 12.8 ABI) through ctypes, on packed address arrays."""

    def __init__(self) -> None:
        self._fn = _cuda_driver.memcpy_batch_async()
        # CUmemcpyAttributes: srcAccessOrder, srcLocHint{type,id}, dstLocHint{type,id}, flags
        self._attrs = (ctypes.c_uint32 * 6)(_SRC_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        self._args = (ctypes.addressof(self._attrs), ctypes.addressof(self._idx), 1,
                      ctypes.addressof(self._fail))

    @staticmethod
    def pack(copies: Sequence[tuple[int, int, int]]) -> tuple:
        rows = np.array(copies, dtype=np.uint64).reshape(-1, 3)
        cols = np.ascontiguousarray(rows[rows[:, 2] > 0].T)  # a batch rejects empty copies
        n = cols.shape[1]
        base = cols.ctypes.data
        return cols, base, base + 8 * n, base + 16 * n, n

    def __call__(self, stream_ptr: int, packed: tuple) -> None:
        _, dsts, srcs, sizes, n = packed
        if not n:
            return
        err = self._fn(dsts, srcs, sizes, n, *self._args, stream_ptr)
        if err:
            raise TideBackendError(f"cuMemcpyBatchAsync of {n} copies failed: CUresult {err} "
                                   f"(failing copy index {self._fail.value})")


class _CopyGraphs:
    """Cached batches replayed from CUDA graphs: one launch per batch, any length.

    A graph of independent memcpy nodes (cudaMemcpyDefault: peer addresses are
    IPC mappings) is built and instantiated once per program batch; launching
    it costs about as much as one copy. An executable graph that is evicted
    while in flight is freed by the driver once it completes.
    """

    def __init__(self) -> None:
        from cuda.bindings import runtime as rt

        self._rt = rt
        self._launch = _cuda_driver.entry("cuGraphLaunch", _cuda_driver.CUDA_12_0,
                                          ctypes.c_void_p, ctypes.c_void_p)
        self._cache = IdentityCache(GRAPHS, evict=self._destroy)

    def _check(self, res: Any, what: str) -> Any:
        err = res[0] if isinstance(res, tuple) else res
        if err != self._rt.cudaError_t.cudaSuccess:
            raise TideBackendError(f"{what} failed: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def _build(self, copies: Sequence[tuple[int, int, int]]) -> tuple:
        rt = self._rt
        graph = self._check(rt.cudaGraphCreate(0), "cudaGraphCreate")
        for dst, src, n in copies:
            if n:
                self._check(rt.cudaGraphAddMemcpyNode1D(graph, None, 0, dst, src, n,
                                                        rt.cudaMemcpyKind.cudaMemcpyDefault),
                            "cudaGraphAddMemcpyNode1D")
        exe = self._check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        return graph, exe, int(exe)

    def _destroy(self, entry: tuple) -> None:
        graph, exe, _ = entry
        self._rt.cudaGraphExecDestroy(exe)
        self._rt.cudaGraphDestroy(graph)

    def __call__(self, stream_ptr: int, copies: tuple) -> None:
        err = self._launch(self._cache.get(copies, self._build)[2], stream_ptr)
        if err:
            raise TideBackendError(f"cuGraphLaunch of {len(copies)} copies failed: "
                                   f"CUresult {err}")


class Copier:
    """Issues batches of ``(dst, src, nbytes)`` device copies on a stream.

    Args:
        want_batch: ``Config.batch_copies``: False forces one memcpy per copy,
            None means batch where the probe succeeds.
        graph_min: ``Config.copy_graph_min``: cached batches (tuples) of at
            least this many copies are replayed from a graph; 0: never.
    """

    def __init__(self, want_batch: Optional[bool], graph_min: int = 0) -> None:
        self.want_batch = want_batch
        self.batched = False
        self.reason = "not probed yet"
        self.graph_min = graph_min
        self.graphs: Optional[_CopyGraphs] = None
        self.graph_reason = "off: Config.copy_graph_min = 0"
        self._driver: Optional[_DriverBatch] = None
        self._attrs: Any = None
        self._cudart: Any = None
        self._packed = IdentityCache()
        self._runs = IdentityCache()

    def probe(self, stream_ptr: int) -> tuple[bool, str]:
        """Decide between batched and single copies by trying a small batch.

        Returns:
            (batched, reason), also kept as ``self.batched`` / ``self.reason``.
        """
        if self.want_batch is False:
            self.batched, self.reason = False, "off: Config.batch_copies / TIDE_BATCH_COPIES=0"
            return self.batched, self.reason
        why = ""
        try:
            self._driver = _DriverBatch()
            self._trial(stream_ptr)
            self.batched, self.reason = True, ("cuMemcpyBatchAsync (driver, packed addresses), "
                                               "one call per lane and step")
            return self.batched, self.reason
        except Exception as e:  # noqa: BLE001 - no symbol, old driver: try the runtime's
            self._driver, why = None, f"driver entry point: {type(e).__name__}: {e}; "
        try:
            self._setup_runtime()
            self._trial(stream_ptr)
            self.batched, self.reason = True, (f"cudaMemcpyBatchAsync (cuda-python), one call "
                                               f"per lane and step ({why.rstrip('; ')})")
        except Exception as e:  # noqa: BLE001 - ImportError, missing symbol, old driver: fall back, say why
            self.batched = False
            self.reason = (f"off: {why}cudaMemcpyBatchAsync unavailable ({type(e).__name__}: "
                           f"{e}); one cudaMemcpyAsync per copy")
            if self.want_batch:
                raise TideBackendError(f"batch_copies=True, but {self.reason}") from e
        return self.batched, self.reason

    def probe_graphs(self, stream_ptr: int) -> tuple[bool, str]:
        """Decide whether cached batches replay from graphs, by trying one."""
        if not self.graph_min:
            return False, self.graph_reason
        try:
            self.graphs = _CopyGraphs()
            self._trial(stream_ptr, graph=True)
            self.graph_reason = (f"cached batches of >= {self.graph_min} copies replay a CUDA "
                                 "graph (TIDE_COPY_GRAPH_MIN)")
        except Exception as e:  # noqa: BLE001 - no graph support for these copies: batches
            self.graphs = None
            self.graph_reason = f"off ({type(e).__name__}: {e}); batches instead"
        return self.graphs is not None, self.graph_reason

    def _setup_runtime(self) -> None:
        from cuda.bindings import runtime as cudart

        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._cudart, self._attrs = cudart, attrs

    def _trial(self, stream_ptr: int, graph: bool = False) -> None:
        import cupy

        src = cupy.arange(64, dtype=cupy.int32)
        dst = cupy.zeros(64, dtype=cupy.int32)
        cupy.cuda.get_current_stream().synchronize()
        copies = ((dst.data.ptr, src.data.ptr, 128), (dst.data.ptr + 128, src.data.ptr + 128, 128))
        if graph:
            self.graphs(stream_ptr, copies)
        else:
            self._batch(stream_ptr, copies)
        cupy.cuda.runtime.streamSynchronize(stream_ptr)
        if not bool((dst == src).all()):
            raise RuntimeError("a trial batch copied the wrong bytes")

    def runs(self, copies: Sequence[tuple[int, int, int]], parts: int,
             min_bytes: int = 0) -> tuple:
        """``copies`` cut into ``parts`` runs of about equal bytes, or one run if
        they hold fewer than ``min_bytes`` (cached for tuples)."""
        by_parts = self._runs.get(copies, lambda c: {0: sum(n for _, _, n in c)})
        if by_parts[0] < min_bytes or parts <= 1:
            return (copies,)
        if parts not in by_parts:
            by_parts[parts] = tuple(tuple(run) for run in split_copies(copies, parts) if run)
        return by_parts[parts]

    def copy(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]]) -> None:
        """Issue ``copies`` on the stream, in one batch when batching is on."""
        if not copies:
            return
        if self.graphs is not None and len(copies) >= self.graph_min and type(copies) is tuple:
            self.graphs(stream_ptr, copies)
            return
        if self.batched:
            self._batch(stream_ptr, copies)
            return
        import cupy

        for dst, src, n in copies:
            cupy.cuda.runtime.memcpyAsync(dst, src, n, _MEMCPY_DEFAULT, stream_ptr)

    def _batch(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]]) -> None:
        if self._driver is not None:
            self._driver(stream_ptr, self._packed.get(copies, _DriverBatch.pack))
            return
        copies = [c for c in copies if c[2]]
        if not copies:
            return
        dsts, srcs, sizes = (list(c) for c in zip(*copies))
        res = self._cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [self._attrs],
                                                [0], 1, stream_ptr)
        err = res[0]
        if err != self._cudart.cudaError_t.cudaSuccess:
            fail = res[1] if len(res) > 1 else None
            raise TideBackendError(f"cudaMemcpyBatchAsync of {len(sizes)} copies failed: "
                                   f"{err} (failing copy index {fail})")
