"""Helpers that cut full arrays into FSDP2 shards (copies, for setup and tests)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._group import Group, default_group
from ._layout import shard_spec
from .backends import array_module


def shard_shape(shape: Sequence[int], world: int) -> tuple[int, ...]:
    """The padded shard shape ``(ceil(d0/world), *rest)`` of a parameter."""
    return shard_spec(shape, 1, world).shard_shape


def shard(full: Any, rank: Optional[int] = None, world: Optional[int] = None,
          group: Optional[Group] = None) -> Any:
    """``rank``'s padded shard of ``full`` (a new array, padding rows zero).

    Args:
        full: a NumPy or CuPy array of the full parameter.
        rank, world: default to the group's rank and size.
    """
    if rank is None or world is None:
        group = group or default_group()
        rank = group.rank if rank is None else rank
        world = group.size if world is None else world
    spec = shard_spec(full.shape, full.dtype.itemsize, world)
    start, stop = spec.rows(rank)
    xp = array_module(full)
    out = xp.zeros(spec.shard_shape, full.dtype)
    out[: stop - start] = full[start:stop]
    return out


def full_from_shards(shards: Sequence[Any], shape: Sequence[int]) -> Any:
    """Reassemble a full parameter from all ranks' padded shards (rank order)."""
    xp = array_module(shards[0])
    spec = shard_spec(shape, shards[0].dtype.itemsize, len(shards))
    parts = [s[: spec.valid_rows(r)] for r, s in enumerate(shards)]
    return xp.concatenate(parts, axis=0).reshape(shape)
