"""Helpers that cut full arrays into FSDP2 shards (copies, for setup and tests)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ._group import Group, default_group
from ._layout import ShardSpec, shard_spec
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


def gather_rows(comm: Any, spec: ShardSpec, world: int, rows: Any,
                root: Optional[int] = None) -> Any:
    """A full fp32 parameter on the host, from every rank's valid ``rows`` of it.

    Collective over ``comm`` (an mpi4py communicator of ``world`` ranks): one
    ``MPI_Allgatherv`` straight into the full shape, the result on every rank, or with
    ``root`` one ``MPI_Gatherv`` to that rank (None elsewhere). So beyond the result a rank
    holds its own rows alone. ``rows``: this rank's ``spec.valid_rows(rank)`` rows, a
    C-contiguous float32 NumPy array. ``world`` 1: every rank holds the whole parameter
    (``rows`` is it).
    """
    from mpi4py import MPI

    wanted = root is None or comm.rank == root
    if world == 1:
        return rows.reshape(spec.shape).copy() if wanted else None
    full = np.empty(spec.shape, np.float32) if wanted else None
    n = spec.row_numel
    counts = [spec.valid_rows(r) * n for r in range(world)]
    displs = [spec.rows(r)[0] * n for r in range(world)]
    recv = [full, counts, displs, MPI.FLOAT] if wanted else None
    if root is None:
        comm.Allgatherv([rows, MPI.FLOAT], recv)
    else:
        comm.Gatherv([rows, MPI.FLOAT], recv, root=root)
    return full
