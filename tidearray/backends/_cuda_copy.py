"""Copy-engine transfers: one ``cudaMemcpyBatchAsync`` per call, or one memcpy per copy.

A separate ``cudaMemcpyAsync`` costs about 3.5 us to issue, which caps a unit of
small parameters at a fraction of the link; a batch is one call for any
number of copies (DESIGN.md, "Measured facts"). The batch takes plain integer
addresses and one attribute set (source read in stream order) for every copy.
Peer addresses are IPC mappings, so the copies are peer-to-peer over NVLink,
done by copy engines: no SM is used.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .._errors import TideBackendError

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
class Copier:
    """Issues batches of ``(dst, src, nbytes)`` device copies on a stream.

    Args:
        want_batch: ``Config.batch_copies``: False forces one memcpy per copy,
            None means batch where the probe succeeds.
    """

    def __init__(self, want_batch: Optional[bool]) -> None:
        self.want_batch = want_batch
        self.batched = False
        self.reason = "not probed yet"
        self._attrs: Any = None
        self._cudart: Any = None

    def probe(self, stream_ptr: int) -> tuple[bool, str]:
        """Decide between batched and single copies by trying a small batch.

        Returns:
            (batched, reason), also kept as ``self.batched`` / ``self.reason``.
        """
        if self.want_batch is False:
            self.batched, self.reason = False, "off: Config.batch_copies / TIDE_BATCH_COPIES=0"
            return self.batched, self.reason
        try:
            self._setup_batch()
            self._trial(stream_ptr)
            self.batched, self.reason = True, "cudaMemcpyBatchAsync, one call per lane and step"
        except Exception as e:  # noqa: BLE001 - ImportError, missing symbol, old driver: fall back, say why
            self.batched = False
            self.reason = (f"off: cudaMemcpyBatchAsync unavailable ({type(e).__name__}: {e}); "
                           "one cudaMemcpyAsync per copy")
            if self.want_batch:
                raise TideBackendError(f"batch_copies=True, but {self.reason}") from e
        return self.batched, self.reason

    def _setup_batch(self) -> None:
        from cuda.bindings import runtime as cudart

        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._cudart, self._attrs = cudart, attrs

    def _trial(self, stream_ptr: int) -> None:
        import cupy

        src = cupy.arange(64, dtype=cupy.int32)
        dst = cupy.zeros(64, dtype=cupy.int32)
        cupy.cuda.get_current_stream().synchronize()
        self._batch(stream_ptr, [(dst.data.ptr, src.data.ptr, 128),
                                 (dst.data.ptr + 128, src.data.ptr + 128, 128)])
        cupy.cuda.runtime.streamSynchronize(stream_ptr)
        if not bool((dst == src).all()):
            raise RuntimeError("a trial batch copied the wrong bytes")

    def copy(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]]) -> None:
        """Issue ``copies`` on the stream, in one batch when batching is on."""
        if self.batched:
            self._batch(stream_ptr, copies)
            return
        import cupy

        for dst, src, n in copies:
            cupy.cuda.runtime.memcpyAsync(dst, src, n, _MEMCPY_DEFAULT, stream_ptr)

    def _batch(self, stream_ptr: int, copies: Sequence[tuple[int, int, int]]) -> None:
        dsts, srcs, sizes = (list(c) for c in zip(*copies))
        res = self._cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [self._attrs],
                                                [0], 1, stream_ptr)
        err = res[0]
        if err != self._cudart.cudaError_t.cudaSuccess:
            fail = res[1] if len(res) > 1 else None
            raise TideBackendError(f"cudaMemcpyBatchAsync of {len(sizes)} copies failed: "
                                   f"{err} (failing copy index {fail})")
