"""The stream the runtime issues on: torch's current stream ([Note: torch front end] in
``_sharding``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..fsdp import Runtime


class TorchStream:
    """Points the runtime at torch's current stream, and hands out what the runtime
    computed on it as torch tensors.

    Args:
        runtime: the :class:`tidearray.fsdp.Runtime` whose ``stream`` this sets.
        device: the model's device.
        cuda: whether the runtime is on the cuda backend (on the host backend there is
            no stream to follow).
    """

    def __init__(self, runtime: Runtime, device: Any, cuda: bool) -> None:
        self.runtime = runtime
        self.device = device
        self.cuda = cuda
        self._stream: Any = None  # the torch stream the runtime issues on (None: the default)

    def follow(self) -> None:
        """The runtime issues on torch's current stream, read at each pass and step: a
        forward on a side stream, or inside ``torch.cuda.graph``'s capture, has its
        gathers and reductions on that stream ([Note: torch captured steps] in
        ``_graph``). The new stream waits for the old one, whose kernels may still read
        the slots, except while it captures: a capture cannot wait on uncaptured work,
        and ``torch.cuda.graph`` synchronizes the device before it begins."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        if self._stream is not None and stream == self._stream:
            return
        # Until the first pass, the runtime issued on the default stream (CuPy's current).
        old = self._stream if self._stream is not None else torch.cuda.default_stream(self.device)
        if stream != old and not torch.cuda.is_current_stream_capturing():
            stream.wait_stream(old)
        self._stream = stream
        self.runtime.stream = self.runtime.group.backend.stream(stream)

    def norm(self, norm: Any) -> Any:
        """A gradient norm as the runtime gave it (None, a float), or, from inside a
        capture (a device array), as a torch tensor on the same memory."""
        if norm is None or isinstance(norm, float):
            return norm
        # With CuPy's current stream the capturing one, the DLPack exchange orders
        # nothing (the same stream on both sides); from another stream it would make
        # the capture wait on work outside it.
        with self.runtime.group.backend.on_stream(self.runtime.stream):
            return torch.from_dlpack(norm)
