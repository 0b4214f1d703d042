"""A batch of copies that asks the driver for a copy engine, for the probes."""

from __future__ import annotations

from typing import Sequence

from tidearray.backends.cuda import copies

#: ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``: the library does not pass it, since it
#: left same-device copies on the SMs ([Note: same-device copies] in its ``copies``).
PREFER_OVERLAP_WITH_COMPUTE = 1


class FlaggedBatch:
    """``cuMemcpyBatchAsync`` with ``PREFER_OVERLAP_WITH_COMPUTE``, copies packed once
    per tuple (as the copier packs its cached batches)."""

    def __init__(self) -> None:
        self.batch = copies._DriverBatch(PREFER_OVERLAP_WITH_COMPUTE)
        self._packed: dict = {}

    def copy(self, stream_ptr: int, batch: Sequence[tuple[int, int, int]],
             local: bool = True) -> None:  # ``local``: the copier's signature, unused
        key = id(batch)
        if key not in self._packed:
            self._packed[key] = (batch, copies._DriverBatch.pack(batch))
        self.batch(stream_ptr, self._packed[key][1])
