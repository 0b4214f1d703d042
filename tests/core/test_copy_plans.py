"""The cuda copier's planning of a batch into runs (pure Python: no GPU needed), and the
attributes its batch call passes (cuda.bindings, where installed; no GPU needed either)."""

from __future__ import annotations

import pytest

from tidearray.backends.cuda.copies import Copier


def _copies(n: int, size: int) -> tuple:
    return tuple(((1 << 40) + k * size, (1 << 41) + k * size, size) for k in range(n))


def _planned(copies: tuple, parts: int) -> list:
    c = Copier(None)
    c.strided = False  # no 2D runs: each run's copies are its batch
    batch = c.plan(copies, parts=parts)
    assert len(batch) == sum(1 for x in copies if x[2])
    return [run.strided + run.large + run.rest for run in batch.runs]


def test_one_part_is_the_batch_itself():
    """With one stream per lane (the default) the batch is one run, its copies in order."""
    copies = _copies(5, 4096)
    assert _planned(copies, 1) == [copies]


def test_parts_cover_the_batch_once():
    copies = _copies(16, 1 << 20)  # 16 MiB: past SPLIT_MIN_BYTES
    runs = _planned(copies, 2)
    assert len(runs) == 2
    assert sorted(x for run in runs for x in run) == sorted(copies)


def test_small_batches_stay_whole():
    copies = _copies(4, 4096)
    assert _planned(copies, 3) == [copies]


def test_batch_attributes_come_from_cuda_bindings():
    """The struct the ctypes batch call gets: stream-ordered sources, everything else zero,
    24 bytes (CUDA's ``CUmemcpyAttributes``), as cuda.bindings lays it out."""
    import ctypes

    pytest.importorskip("cuda.bindings.driver")
    from tidearray.backends.cuda.copies import stream_order_attrs

    attrs = stream_order_attrs()
    raw = bytes((ctypes.c_uint8 * 24).from_address(attrs.getPtr()))
    assert raw == (1).to_bytes(4, "little") + bytes(20)
