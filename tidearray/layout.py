"""``tidearray.layout``: the planning helpers, pure sizes and offsets.

How a parameter is cut into padded shards and how a unit's full parameters lie in a
slot: frozen dataclasses and functions that do no device work and are never collective
(docs/sharding.md). Only the sizes that depend on a group read one (``group=``, or the
open group of :func:`tidearray.init`); ``unit_nbytes(..., world=W)`` needs none. The
collectives and plans in :mod:`tidearray` are built on these; use them to size arenas,
check a layout, or reassemble arrays in set-up and tests.

* :func:`shard_spec` / :class:`ShardSpec`: one parameter's padded shard on ``world``
  ranks (rows per shard, byte ranges, valid rows).
* :func:`plan_unit` / :class:`UnitLayout`: a unit's parameters back to back in a slot,
  each aligned to 256 bytes (``offsets``, ``nbytes``).
* :func:`flat_layout` / :class:`FlatLayout`: FSDP2's flat rank-major layout of a unit,
  padded shards back to back per rank (the FSDP runtime's shard arena, and what a comm
  that runs FSDP2's flat collectives moves).
* :func:`unit_nbytes`: the slot bytes a unit needs (``world=`` or a group's size).
* :func:`memory_report` / :class:`MemoryReport`: per-rank bytes of a unit's slot and
  reduce-scatter buffers on ``world`` ranks of ``local_size`` per node, beside stock
  FSDP2's for the same unit (docs/memory.md).
* :func:`slot_chunk_nbytes`: the largest reduce-scatter chunk whose staging fits a slot
  (on a group).
* :func:`shard_shape`, :func:`full_from_shards`: the padded shard shape, and a full
  array put back together from every rank's shards (a copy).
"""

from ._all_gather import unit_nbytes
from ._layout import ALIGN, FlatLayout, ShardSpec, UnitLayout, flat_layout, plan_unit, shard_spec
from ._memory import MemoryReport, memory_report
from ._plan import slot_chunk_nbytes
from ._shard import full_from_shards, shard_shape

__all__ = ["ALIGN", "FlatLayout", "MemoryReport", "ShardSpec", "UnitLayout", "flat_layout",
           "full_from_shards", "memory_report", "plan_unit", "shard_shape", "shard_spec",
           "slot_chunk_nbytes", "unit_nbytes"]
