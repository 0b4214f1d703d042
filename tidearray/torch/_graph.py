"""A torch model's whole training step captured with ``torch.cuda.graph``, then replayed.

[Note: torch captured steps]
:class:`TorchCapturedStep` (what a sharded model's ``capture_step`` returns) is
:class:`tidearray.fsdp.CapturedStep` with torch's
capture in place of CuPy's, because torch must know of the capture: its
caching allocator then serves what the step allocates (activations, autograd's
gradients, the loss) from the graph's private pool, which the replays reuse at
the same addresses. Everything else is the CuPy trainer's captured step
([Note: captured steps] in ``tidearray.fsdp._graph``):

* the module's hooks run once, during the capture; the gathers and reductions
  they issue are captured on the capturing stream, which the runtime follows as
  it follows any torch current stream (``TorchStream.follow`` in ``_streams``);
* the fused AdamW reads the step's coefficients (learning rate, bias
  corrections) from a device table that each call writes, on torch's current
  stream, before ``CUDAGraph.replay()`` launches on that stream;
* the capture is relaxed (``capture_error_mode="relaxed"``), as the CuPy one,
  so that a pool may grow while capturing.

A torch optimizer (``optimizer=make``) is refused: its learning rate and step
count live on the host unless it was made capturable, which this does not
check. A clip (``max_grad_norm``, or the model's ``clip_grad_norm_`` in the
step function) is captured as in the CuPy trainer; the norm it returns is then
a 0-d float64 tensor that each replay overwrites.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .._errors import TideInvalid
from ..fsdp import CapturedStep

if TYPE_CHECKING:
    from ._sharding import Sharding


class TorchCapturedStep(CapturedStep):
    """A sharded model's whole training step captured with ``torch.cuda.graph`` (made by
    its ``capture_step``); calling this replays it with the next learning rate.

    Args:
        sharding: a sharded model's ``sharding``, on the cuda backend, with the fused
            AdamW, that has stepped eagerly at least once.
        step: a function that runs one whole step (every micro-batch's forward and
            backward, then ``model.step()``) on tensors the caller refills in place
            before each replay, and returns what the caller reads (the losses, as
            tensors: each replay overwrites them).

    Raises:
        TideInvalid: on the host backend, with a torch optimizer, in debug mode,
            or before any eager step.
    """

    def __init__(self, sharding: Sharding, step: Callable[[], Any]) -> None:
        if not sharding.group.backend.graphs:
            raise TideInvalid("capture_step: expected a model on the cuda backend (a CUDA "
                              f"graph), got the {sharding.group.backend.name} backend")
        if sharding.bridge.kind != "fused":
            raise TideInvalid("capture_step: expected the fused AdamW (a replay reads its "
                              "learning rate from the device), got a torch optimizer "
                              "(optimizer=make)")
        self.device = sharding.device
        super().__init__(sharding.runtime, step)

    def _capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        failed: BaseException | None = None
        try:
            with torch.cuda.device(self.device), \
                    torch.cuda.graph(graph, capture_error_mode="relaxed"):
                try:
                    result = step()
                except BaseException as e:
                    failed = e
                    raise
        except BaseException:
            if failed is not None:  # the step's error broke the capture (its lanes were left
                raise failed  # noqa: B904 - unjoined): the user's error, not the ending's
            raise
        return graph, result

    def _launch(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()  # on torch's current stream, after the staged table

    def _replay_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)
