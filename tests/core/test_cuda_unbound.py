"""The cuda backend bound to no group (``backends.array_backend(cupy)``: the optimizer's and
the gradient norm's), without a GPU: what it answers must not need the lanes a group's
setup makes."""

from __future__ import annotations

from tidearray.backends.cuda import backend as cuda_backend


def test_capturing_without_lanes_asks_the_driver(monkeypatch):
    """``capturing(stream)`` of a backend with no lanes queries ``cuStreamIsCapturing``
    itself (every fused AdamW step on cuda asks it), for the stream given."""
    unbound = cuda_backend.CudaBackend(None)
    assert unbound.lanes is None
    asked = []
    monkeypatch.setattr(cuda_backend.streams, "stream_ptr", lambda stream: 4096 + (stream or 0))
    monkeypatch.setattr(cuda_backend, "_is_capturing",
                        lambda: lambda ptr: asked.append(ptr) or ptr == 4097)
    assert unbound.capturing() is False
    assert unbound.capturing(1) is True
    assert asked == [4096, 4097]
