"""The cuda copier's cutting of a batch into runs (pure Python: no GPU needed), and the
attributes its batch call passes (cuda.bindings, where installed; no GPU needed either)."""

from __future__ import annotations

import pytest

from tidearray.backends.cuda.copies import Copier


def _copies(n: int, size: int) -> tuple:
    return tuple(((1 << 40) + k * size, (1 << 41) + k * size, size) for k in range(n))


def test_one_part_is_the_batch_itself():
    """With one stream per lane (the default) the batch passes through unchanged,
    the same object, so the copy plans keyed by its identity still find it."""
    copies = _copies(5, 4096)
    runs = Copier(None).runs(copies, 1, min_bytes=0)
    assert len(runs) == 1 and runs[0] is copies


def test_parts_cover_the_batch_once():
    copies = _copies(6, 1 << 20)
    c = Copier(None)
    runs = c.runs(copies, 2, min_bytes=1)
    assert len(runs) == 2
    assert sorted(x for run in runs for x in run) == sorted(copies)
    assert c.runs(copies, 2, min_bytes=1) is runs  # cut once, by the tuple's identity


def test_small_batches_stay_whole():
    copies = _copies(4, 4096)
    runs = Copier(None).runs(copies, 3, min_bytes=1 << 20)
    assert len(runs) == 1 and runs[0] is copies


def test_batch_attributes_come_from_cuda_bindings():
    """The struct the ctypes batch call gets: stream-ordered sources, everything else zero,
    24 bytes (CUDA's ``CUmemcpyAttributes``), as cuda.bindings lays it out."""
    import ctypes

    pytest.importorskip("cuda.bindings.driver")
    from tidearray.backends.cuda.copies import stream_order_attrs

    attrs = stream_order_attrs()
    raw = bytes((ctypes.c_uint8 * 24).from_address(attrs.getPtr()))
    assert raw == (1).to_bytes(4, "little") + bytes(20)
