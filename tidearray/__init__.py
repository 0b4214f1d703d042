"""tidearray: layout-aware, zero-copy collectives for FSDP training.

Shards in, full parameters out (:func:`all_gather`); per-parameter gradients
in, fp32 shards out (:func:`reduce_scatter`). Runs on a group made by
:func:`init` over mpi4py, on the ``cuda`` backend (CuPy, copy engines, NCCL)
or the ``host`` backend (NumPy, MPI shared memory).

The public surface is ``__all__`` below and three submodules:

* :mod:`tidearray.layout`: the pure planning helpers (shard specs, unit layouts, sizes);
* :mod:`tidearray.fsdp`: the FSDP runtime over NumPy/CuPy parameters, imported on first
  use (``tidearray.fsdp.Runtime`` or ``import tidearray.fsdp``);
* :mod:`tidearray.torch`: the ``torch.nn.Module`` front end (``import tidearray.torch``).

``import tidearray`` needs NumPy, mpi4py and ml_dtypes only: it imports no backend, no
runtime and no framework, and changes no global state.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._arena import SlotArena
from ._config import Config
from ._dtypes import bfloat16, float16, float32
from ._errors import TideBackendError, TideError, TideInvalid
from ._group import Group, init
from ._plan import Unit, all_gather, reduce_scatter
from ._shard import shard
from ._work import Work

__version__ = "0.1.0"

__all__ = [
    "Config", "Group", "SlotArena", "TideBackendError", "TideError", "TideInvalid", "Unit",
    "Work", "all_gather", "bfloat16", "float16", "float32", "init", "reduce_scatter", "shard",
]

#: Submodules imported on first attribute access (``tidearray.fsdp``), not by ``import
#: tidearray``: the runtime is an optional layer over the collectives.
_LAZY = ("fsdp",)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
