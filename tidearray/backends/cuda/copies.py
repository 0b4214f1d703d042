"""Device copies: one batched memcpy per call, or one memcpy per copy.

A separate ``cudaMemcpyAsync`` costs microseconds to issue, which caps a unit of
small parameters at a fraction of the link; a batch is one call for any
number of copies (measured on H200s). Peer addresses are mappings
of peers' memory (VMM or IPC), so the copies are peer-to-peer over NVLink,
done by copy engines.

[Note: copy plans]
A batch is one call, but not free: the driver spends microseconds per entry
on every call, and the copy engine more per entry; equal rows as one 2D copy
moved faster and cost the host a small fraction of the same rows as batch
entries (development record run3, in git history). So each batch a collective passes is planned
once, when its plan is built (a :class:`CudaBatch`, which the plan owns:
[Note: compiled batches] in ``backends._base``):

* runs of ``STRIDED_MIN_ROWS`` or more equal-sized copies at constant
  strides (``_copies.strided_runs``), rows within one allocation on both sides
  (``cuMemGetAddressRange``), become one ``cudaMemcpy2DAsync`` each: the pieces
  of repeated shapes, e.g. experts;
* the rest go in one ``cuMemcpyBatchAsync``, its addresses packed once into
  ``uint64`` arrays and passed through ctypes (``driver``): cuda-python
  converts list arguments element by element on every call. Large copies too:
  sending them alone was no faster (the quick bench's ``tide_ag_singles``).
  ``configure(large_min=...)`` sends large copies alone.

[Note: same-device copies]
A copy between two buffers of one device is not done by a copy engine: the
driver runs it on the SMs. On H200 every same-device copy, one
``cudaMemcpyAsync``, a batch or a 2D copy, waited for a kernel that held every
SM and ran as soon as it ended, while a host-to-device copy ran beside it; CUPTI
still reports such copies as memcpys ("Memcpy DtoD"), not as kernels
(``benchmarks/probes/hw_bounds.py``). How they are cut decides what they cost a
concurrent kernel: one large copy slowed a single-wave GEMM most, pieces sent as
2D copies less, and pieces of at most 8 MiB in one batch least (development record
run13-bounds). So copies a caller marks ``local`` are cut into pieces of at most
``Config.local_copy_max`` bytes and go in the batch, never as 2D copies.

Each such copy also costs the host microseconds to issue, in a batch or not, far
more than the same copies from or into pinned host memory (development record
run13-issue, in git history). So an own copy of many separate arrays (Qwen3-30B-A3B's layer: 393)
bound a gather by its issue, not by the link. A plan's batch of at least
``Config.local_copy_kernel_min`` such copies goes instead as one launch of
``pack_bytes`` (``kernels/pack.cu``) over a segment table uploaded once, on
``ctas`` CTAs (a quarter of the SMs, which ran them about as fast as twice as
many and twice as fast as half: run13-issue, in git history): the same SM work the driver would
do, in one launch.

Asking for a copy engine does not help: a batch within one GPU with
``PREFER_OVERLAP_WITH_COMPUTE`` still waited for a kernel that held every SM, ran
as long and cost the host as much (run13-bounds; run13-issue, in git history).

Copies to and from a peer's memory go over NVLink by copy engine.

[Note: issue in parts]
A copy to a peer costs the host microseconds per batch entry, and a batch's copies
start only after the call that issued them returns: a gather of many separate
parameters ran longer on the device than the same work issued before its stream
could start (``benchmarks/probes/host_profile.py``; run13-issue, in git history). So a planned
batch of more than ``batch_max`` copies goes as several calls, in order on the
same stream: the copy engines start on the first part while the host issues the
next, which shortened the gather (run14-sweeps).
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from ..._copies import Strided, cut_copies, split_copies, strided_runs
from ..._errors import TideBackendError
from .._base import Batch
from . import driver
from .streams import check_uploaded, cupy_stream, keep_until_read

#: Runs of at least this many equal, evenly spaced copies become one 2D copy:
#: a pair is cheaper as two batch entries.
STRIDED_MIN_ROWS = 3
#: Threads per CTA of the same-device copy kernel (``pack_bytes``).
KERNEL_THREADS = 512
#: Copies to a peer smaller than this stay on one stream (the split's events cost more).
SPLIT_MIN_BYTES = 8 << 20


class _Run(NamedTuple):
    """Copies planned for one stream: 2D runs, large copies alone, the rest (one batch,
    packed for the driver in calls of at most ``batch_max``, or None without it)."""

    strided: tuple
    large: tuple
    rest: tuple
    packs: Optional[tuple]


class CudaBatch(Batch):
    """A plan's copies, planned once ([Note: copy plans]): one run per copy-engine stream
    (several where a push to a peer is split: [Note: split pushes] in ``executor``),
    each a :class:`_Run` or, for many same-device copies, a :class:`KernelCopy`."""

    def __init__(self, runs: tuple, count: int) -> None:
        self.runs, self.count = runs, count

    def __len__(self) -> int:
        return self.count


def stream_order_attrs(flags: int = 0) -> Any:
    """``CUmemcpyAttributes`` asking for sources read in stream order, with
    ``CUmemcpyFlags`` ``flags``, laid out by cuda.bindings (its ``getPtr()`` is
    what the ctypes call passes)."""
    from cuda.bindings import driver as cu

    attrs = cu.CUmemcpyAttributes()
    attrs.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs.flags = flags
    return attrs


class _DriverBatch:
    """``cuMemcpyBatchAsync`` (CUDA 12.8 ABI) through ctypes, on packed address arrays."""

    def __init__(self, flags: int = 0) -> None:
        self._fn = driver.memcpy_batch_async()
        self._attrs = stream_order_attrs(flags)  # kept: the call takes its address
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        self._args = (self._attrs.getPtr(), ctypes.addressof(self._idx), 1,
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


class Copier:
    """Issues batches of ``(dst, src, nbytes)`` device copies on a stream.

    Args:
        want_batch: ``Config.batch_copies``: False forces one memcpy per copy,
            None means batch where the probe succeeds.
        local_max: ``Config.local_copy_max``: same-device copies are cut into
            pieces of at most this many bytes (0: left whole).
        kernel_min: ``Config.local_copy_kernel_min``: a tuple of at least this
            many same-device copies goes as one copy kernel (0: never).
        device: the CUDA device (for the copy kernel).
        ctas: the copy kernel's grid.
        batch_max: ``Config.copy_batch_max``: the most copies in one driver call
            (0: any number).

    Attributes:
        large_min: copies of at least this many bytes go alone (None: none do).
        strided: merge strided runs within one allocation into 2D copies.
        min_rows: the fewest rows a run needs to become a 2D copy.
        local_max: the largest piece of a same-device copy (0: none cut).
        (All through :meth:`configure`, which drops the plans made so far.)
    """

    def __init__(self, want_batch: Optional[bool], local_max: int = 0, kernel_min: int = 0,
                 device: int = 0, ctas: int = 16, batch_max: int = 0) -> None:
        self.want_batch = want_batch
        self.batch_max = batch_max
        self.local_max = self._local_max_made = local_max
        self.kernel_min, self.device, self.ctas = kernel_min, device, ctas
        self.batched = False
        self.reason = "not probed yet"
        self.large_min: Optional[int] = None
        self.strided = True
        self.min_rows = STRIDED_MIN_ROWS
        self._driver: Optional[_DriverBatch] = None
        self._attrs: Any = None
        self._cudart: Any = None
        self._range: Any = None

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
            warnings.warn(f"tidearray: batched copies are unavailable, so each copy is its "
                          f"own cudaMemcpyAsync (slower for small parameters): {self.reason}",
                          RuntimeWarning, stacklevel=2)
        return self.batched, self.reason

    def _setup_runtime(self) -> None:
        from cuda.bindings import runtime as cudart

        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._cudart, self._attrs = cudart, attrs

    def _trial(self, stream_ptr: int) -> None:
        import cupy

        src = cupy.arange(64, dtype=cupy.int32)
        dst = cupy.zeros(64, dtype=cupy.int32)
        cupy.cuda.get_current_stream().synchronize()
        self._batch(stream_ptr, ((dst.data.ptr, src.data.ptr, 128),
                                 (dst.data.ptr + 128, src.data.ptr + 128, 128)))
        cupy.cuda.runtime.streamSynchronize(stream_ptr)
        if not bool((dst == src).all()):
            raise RuntimeError("a trial batch copied the wrong bytes")

    def configure(self, large_min: Optional[int] = None, strided: bool = True,
                  min_rows: int = STRIDED_MIN_ROWS, local_max: Optional[int] = None) -> None:
        """Set how batches are planned ([Note: copy plans]): plans built later (and
        copies passed raw) follow it. ``local_max`` None restores the value the
        copier was made with."""
        self.large_min, self.strided, self.min_rows = large_min, strided, min_rows
        self.local_max = self._local_max_made if local_max is None else local_max

    def plan(self, copies: Sequence[tuple[int, int, int]], local: bool = False,
             parts: int = 1, kernel: bool = True) -> CudaBatch:
        """``copies`` planned for issue ([Note: copy plans]).

        Args:
            local: every copy is within this device: cut and batched, or one copy
                kernel ([Note: same-device copies]).
            parts: copy-engine streams to spread a batch of at least
                :data:`SPLIT_MIN_BYTES` over (runs of about equal bytes).
            kernel: many same-device copies may become a copy kernel, whose table
                is uploaded once: for a plan's batches, not for copies of one call.
        """
        count = sum(1 for c in copies if c[2])
        if local:
            return CudaBatch((self._local_plan(copies, kernel),), count)
        runs = (copies,)
        if parts > 1 and sum(n for _, _, n in copies) >= SPLIT_MIN_BYTES:
            runs = [run for run in split_copies(copies, parts) if run]
        return CudaBatch(tuple(self._plan(run) for run in runs), count)

    def copy(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]],
             local: bool = False, stream: Any = None, capture: bool = False) -> None:
        """Plan ``copies`` for this call only and issue them on one stream."""
        if copies:
            self.issue(stream_ptr, self.plan(copies, local, kernel=False).runs[0], stream,
                       capture)

    def issue(self, stream_ptr: int, run: Any, stream: Any = None,
              capture: bool = False) -> None:
        """Issue one planned run on the stream: 2D runs, large copies alone, then the
        rest in one batch; or the copy kernel, on ``stream`` (the CuPy stream of
        ``stream_ptr``; else made from it). ``capture``: the stream is capturing a
        graph, which takes no batched copy, so the rest go one ``cudaMemcpyAsync``
        each ([Note: graph plans on cuda] in ``graphs``)."""
        import cupy

        if isinstance(run, KernelCopy):
            run(stream if stream is not None else cupy_stream(stream_ptr), capture)
            return
        rt = cupy.cuda.runtime
        for r in run.strided:
            rt.memcpy2DAsync(r.dst, r.dpitch, r.src, r.spitch, r.width, r.height,
                             rt.memcpyDefault, stream_ptr)
        for dst, src, n in run.large:
            rt.memcpyAsync(dst, src, n, rt.memcpyDefault, stream_ptr)
        if not run.rest:
            return
        if self.batched and not capture:
            self._batch(stream_ptr, run.rest, run.packs)
            return
        for dst, src, n in run.rest:
            rt.memcpyAsync(dst, src, n, rt.memcpyDefault, stream_ptr)

    def _plan(self, copies: Sequence[tuple[int, int, int]]) -> _Run:
        strided, large, rest = [], [], []
        alone = self.large_min
        for r in strided_runs(copies):
            if r.height >= self.min_rows and self.strided and self._one_allocation(r):
                strided.append(r)
                continue
            for k in range(r.height):
                c = (r.dst + k * r.dpitch, r.src + k * r.spitch, r.width)
                (large if alone is not None and r.width >= alone else rest).append(c)
        return self._packed(tuple(strided), tuple(large), tuple(rest))

    def _local_plan(self, copies: Sequence[tuple[int, int, int]], kernel: bool) -> Any:
        """Same-device copies: one copy kernel for a plan's batch of many, else cut,
        all in the batch ([Note: same-device copies])."""
        live = [c for c in copies if c[2]]
        if kernel and self.kernel_min and len(live) >= self.kernel_min:
            return KernelCopy(live, self.device, self.ctas)
        return self._packed((), (), tuple(c for c in cut_copies(copies, self.local_max) if c[2]))

    def _packed(self, strided: tuple, large: tuple, rest: tuple) -> _Run:
        """The plan, the rest packed for the driver: one array per call of at most
        ``batch_max`` copies ([Note: issue in parts]), or None without the driver."""
        packs = None
        if rest and self._driver is not None:
            m = self.batch_max or len(rest)
            packs = tuple(_DriverBatch.pack(rest[i:i + m]) for i in range(0, len(rest), m))
        return _Run(strided, large, rest, packs)

    def _one_allocation(self, r: Strided) -> bool:
        """Whether every row's source, and every row's destination, lies in one
        allocation (a 2D copy may not cross allocations)."""
        if self._range is None:
            try:
                self._range = driver.address_range()
            except (OSError, RuntimeError):
                self._range = lambda ptr: (0, 0)
        for first, pitch in ((r.dst, r.dpitch), (r.src, r.spitch)):
            base, size = self._range(first)
            if not size or first + pitch * (r.height - 1) + r.width > base + size:
                return False
        return True

    def _batch(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]],
               packs: Optional[tuple] = None) -> None:
        if self._driver is not None:
            for packed in packs or (_DriverBatch.pack(copies),):
                self._driver(stream_ptr, packed)
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


class KernelCopy:
    """Same-device copies as one launch of ``pack_bytes`` (``kernels/pack.cu``), its
    segment table uploaded at the first call, on the stream of that call
    ([Note: same-device copies]). Owned by a plan's batch; when that goes, the table
    is kept until the last launch has read it."""

    def __init__(self, copies: Sequence[tuple[int, int, int]], device: int, ctas: int) -> None:
        from . import kernels

        self.table, self.ntiles = kernels.pack_table([(d, s, n, n) for d, s, n in copies],
                                                     kernels.PACK_BYTES_TILE)
        self.grid = max(1, min(self.ntiles, ctas))
        self.fn = kernels.function("pack.cu", "pack_bytes", device)
        self.dev: Any = None
        self.event: Any = None

    def __call__(self, stream: Any, capture: bool = False) -> None:
        import cupy

        with stream:
            if self.dev is None:  # uploaded in stream order, before the launch reads it
                check_uploaded(capture)
                self.dev = cupy.asarray(self.table)
                self.event = cupy.cuda.Event(block=False, disable_timing=True)
                keep_until_read(self, (self.event,), self.dev)  # its last launch may read it
            self.fn((self.grid,), (KERNEL_THREADS,),
                    (self.dev, np.int32(len(self.table)), np.int64(self.ntiles)))
        if not capture:  # a graph keeps its own tables alive ([Note: graph plans])
            self.event.record(stream)
