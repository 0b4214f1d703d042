"""The bulk-copy and narrow accumulate kernels, beside the library's vector kernel.

Both take the table and arguments of ``tide_accumulate_bf16`` / ``fp16`` in
``kernels/accumulate.cu`` and do the same arithmetic in the same order, so they give
the same bits; they stream 16-bit sources into shared memory by Hopper bulk async
copies (sm_90 or newer) and write fp32. They live here, not in the library, because
neither has a measured reason to be a user's choice:

- ``"bulk"`` (``accumulate_bulk.cu``): up to 192 KB in flight per CTA; no faster than
  the earlier vector kernel on 2xH200 (development record run10-accum, in git history;
  its per-CTA rate beside today's kernel: ``benchmarks/results/run13-bounds``), and
  its CTA's shared memory keeps anything else that needs some off its SM.
- ``"narrow"`` (``accumulate_narrow.cu``): one warp per CTA at 32 registers with 16 KB
  of shared memory, one CTA per SM, small enough to share every SM with a Hopper
  GEMM's CTA; one or two sources (more take the vector kernel). On one H200 a
  single-wave GEMM beside it ran within 3% of alone in most pairs, but it streams two
  sources at about 0.6 of the vector kernel's rate (``benchmarks/results/run16-one-h200``);
  not measured between two GPUs.

:class:`StreamedAccumulator` is the library's ``Accumulator`` with its ``_select`` seam
overridden; the harness's ``tide-narrow`` swaps it in for a group's accumulator.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

from tidearray.backends.cuda import kernels
from tidearray.backends.cuda.accumulate import Accumulator, Kernel

#: Where the variants' ``.cu`` files are, with ``bulk_copy.cuh``, the bulk-copy helpers
#: that only they use; their other headers are the library's (``kernels/``).
DIR = Path(__file__).resolve().parent
#: The include line of this folder's header, which the library's loader does not know.
_BULK_COPY = '#include "bulk_copy.cuh"'
#: Threads per block of the bulk kernel (``THREADS`` in ``accumulate_bulk.cu``).
BULK_BLOCK = 256
#: Dynamic shared memory of the bulk kernel (``SMEM_BYTES`` there): 6 stages of two
#: 16 KB source slots, then an 8-byte mbarrier per stage. The kernel traps on less.
BULK_SMEM = 6 * 2 * 16384 + 6 * 8
#: The narrow kernel's (``accumulate_narrow.cu``): one warp, two stages of 8 KB, then
#: 512 bytes for the mbarriers, the stages' items and the walk's cursor.
NARROW_BLOCK = 32
NARROW_SMEM = 2 * 8192 + 512
#: Sources the narrow kernel takes (one rank's or two); a launch with more uses the
#: vector kernel. With four or eight, each source's part of an 8 KB stage is 2 or 1 KB,
#: and on one H200 the narrow kernel streamed at 0.58 and 0.29 elements per ns per SM,
#: against the vector kernel's 1.9 and 1.1 (``benchmarks/probes/narrow_probe.py``).
NARROW_MAX_SOURCES = 2
#: Per streaming kernel: its file, block and dynamic shared memory.
STREAMED = {"bulk": ("accumulate_bulk.cu", BULK_BLOCK, BULK_SMEM),
            "narrow": ("accumulate_narrow.cu", NARROW_BLOCK, NARROW_SMEM)}
#: Streaming kernel name per 16-bit source dtype (then ``_bulk`` or ``_narrow``); fp32 out.
STREAMED_KERNELS = {"bfloat16": "tide_accumulate_bf16", "float16": "tide_accumulate_fp16"}


def source(kernel: str) -> str:
    """The text of variant ``kernel``'s ``.cu`` file: ``bulk_copy.cuh`` pasted in, then the
    library's headers inlined (``kernels.with_headers``)."""
    text = (DIR / STREAMED[kernel][0]).read_text()
    return kernels.with_headers(text.replace(_BULK_COPY, (DIR / "bulk_copy.cuh").read_text()))


@functools.cache
def module(kernel: str, device: int) -> Any:
    """``cupy.RawModule`` of variant ``kernel``, compiled once per ``device`` (CuPy compiles
    for the current device, as the library's ``kernels.module``)."""
    return kernels.compile_source(source(kernel), f"benchmarks/variants/{STREAMED[kernel][0]}")


class StreamedAccumulator(Accumulator):
    """The accumulate with the ``"bulk"`` or ``"narrow"`` kernel for 16-bit sources into
    fp32; other dtype pairs, and narrow launches of more than
    :data:`NARROW_MAX_SOURCES` sources, keep the vector kernel.

    Args:
        device: the CUDA device id.
        sm_count: multiprocessors.
        ctas: grid cap of every kernel; None means one CTA per SM for the narrow
            kernel and half the SMs otherwise (the vector kernel's default).
        kernel: ``"bulk"`` or ``"narrow"``.
    """

    def __init__(self, device: int, sm_count: int, ctas: Optional[int] = None,
                 kernel: str = "narrow") -> None:
        if kernel not in STREAMED:
            raise ValueError(f"kernel: expected one of {sorted(STREAMED)}, got {kernel!r}")
        self.kernel = kernel
        super().__init__(device, sm_count, ctas)

    def set_grid(self, ctas: Optional[int]) -> None:
        """As the library's; ``max_grid`` is then this kernel's cap, ``vector_grid``
        that of the launches the vector kernel takes."""
        super().set_grid(ctas)
        self.vector_grid = self.max_grid
        self.max_grid = self._cap(self.sm_count if self.kernel == "narrow"
                                  else self.sm_count // 2)

    def _select(self, src: str, out: str, n_srcs: int) -> Kernel:
        if (out != "float32" or src not in STREAMED_KERNELS
                or self.kernel == "narrow" and n_srcs > NARROW_MAX_SOURCES):
            return super()._select(src, out, n_srcs)
        _, block, smem = STREAMED[self.kernel]
        fn = module(self.kernel, self.device).get_function(
            f"{STREAMED_KERNELS[src]}_{self.kernel}")
        fn.max_dynamic_shared_size_bytes = smem  # the bulk kernel's is above 48 KB
        # As much shared memory as the SM has (the split is set per SM, while idle): a
        # GEMM's CTA then fits beside a narrow one.
        fn.preferred_shared_memory_carveout = 100
        return Kernel(fn, block, smem, self.max_grid)

    def _vector(self, src: str, out: str) -> Kernel:
        return super()._vector(src, out)._replace(grid=self.vector_grid)
