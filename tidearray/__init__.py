"""tidearray: layout-aware, zero-copy collectives for FSDP training.

Shards in, full parameters out (:func:`all_gather`); per-parameter gradients
in, fp32 shards out (:func:`reduce_scatter`). Runs on a group made by
:func:`init` over mpi4py, on the ``cuda`` backend (CuPy, copy engines, NCCL)
or the ``host`` backend (NumPy, MPI shared memory).
"""

from ._all_gather import all_gather, unit_nbytes
from ._arena import Region, SlotArena
from ._config import Config
from ._dtypes import bfloat16, float16, float32
from ._errors import TideBackendError, TideError, TideInvalid
from ._group import Group, default_group, init
from ._layout import ShardSpec, UnitLayout, plan_unit, shard_spec
from ._plan import GatherPlan, ReducePlan, Unit, slot_chunk_nbytes
from ._reduce_scatter import reduce_scatter
from ._shard import full_from_shards, shard, shard_shape
from ._work import Work

__version__ = "0.1.0"

__all__ = [
    "Config", "GatherPlan", "Group", "ReducePlan", "Region", "ShardSpec", "SlotArena",
    "TideBackendError", "TideError", "TideInvalid", "Unit", "UnitLayout", "Work", "all_gather",
    "bfloat16", "default_group", "float16", "float32", "fsdp", "full_from_shards", "init",
    "plan_unit", "reduce_scatter", "shard", "shard_shape", "shard_spec", "slot_chunk_nbytes",
    "unit_nbytes",
]

from . import fsdp  # noqa: E402  (the runtime builds on the names above)
