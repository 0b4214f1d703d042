"""What TIDE is measured against, written once.

* :class:`StockComm` (``stock.py``): FSDP2's flat path as a runtime comm factory,
  ``Runtime(comm=StockComm)``;
* :class:`LocalComm` (``local.py``): the no-communication floor, as a comm factory;
* ``pack``: FSDP2's layout conversions (fused copy-in, copy-out and fp32
  chunk-cat kernels: ``kernels/pack.cu``'s byte copies and ``pack_bf16_f32.cu``
  here) over a flat layout;
* ``nccl``: NCCL collectives through nccl4py's thin bindings, with the
  library's version and the kernels it may launch;
* ``impls_nccl`` / ``impls_torch``: the collective suites' baselines (``stock``,
  ``symm``, ``nccl-a2a``; ``fsdp2``), registered
  with the harness when it loads them.
"""

from .local import LocalComm
from .stock import StockComm

__all__ = ["LocalComm", "StockComm"]
