"""Pure planning: shard specs, byte ranges, a unit's slot layout and FSDP2's flat layout.

Nothing here touches a device. Plans are frozen dataclasses of sizes and
offsets, shared by every backend, so what the CPU tests check is exactly the
addressing the GPU executes. The other pure planning modules build on these:
``_topology`` (ranks as nodes x local ranks), ``_copies`` (shaping copies for
the copy engines) and ``_schedule`` (the all-gather and reduce-scatter
schedules).

Sharding follows FSDP2 (``torch.chunk`` on dim 0): with ``c = ceil(d0 / W)``,
rank ``r`` owns rows ``[r*c, min((r+1)*c, d0))``, possibly empty, and its shard
is padded to ``c`` rows. A rank's rows are one contiguous byte range of the
full parameter, so padding is never transferred.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional, Sequence

from ._errors import TideInvalid

#: Byte alignment of every parameter inside a slot or a staging block.
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of ``shape`` is split over ``world`` ranks."""

    shape: tuple[int, ...]
    itemsize: int
    world: int

    @property
    def d0(self) -> int:
        return self.shape[0]

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @functools.cached_property
    def row_nbytes(self) -> int:
        return self.row_numel * self.itemsize

    @functools.cached_property
    def rows_per_shard(self) -> int:
        """``c = ceil(d0 / W)``: the padded shard's row count."""
        return -(-self.d0 // self.world)

    @functools.cached_property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows_per_shard, *self.shape[1:])

    @functools.cached_property
    def shard_numel(self) -> int:
        return self.rows_per_shard * self.row_numel

    @functools.cached_property
    def numel(self) -> int:
        return self.d0 * self.row_numel

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def rows(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of the full parameter that ``rank`` owns."""
        c = self.rows_per_shard
        start = min(rank * c, self.d0)
        return start, min(start + c, self.d0)

    def valid_rows(self, rank: int) -> int:
        start, stop = self.rows(rank)
        return stop - start

    def byte_range(self, rank: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of ``rank``'s rows inside the full parameter."""
        start, stop = self.rows(rank)
        return start * self.row_nbytes, (stop - start) * self.row_nbytes


def int_shapes(shapes: Any) -> tuple[tuple[int, ...], ...]:
    """``shapes`` as tuples of ints: each dimension through ``operator.index``, so 5.0
    is refused though it hashes and compares equal to 5. Plain ints (the usual case)
    are checked in one pass instead of converted one by one.

    Raises:
        TypeError: a shape is not a sequence, or a dimension is not an integer.
    """
    shapes = tuple(map(tuple, shapes))
    if set(map(type, chain.from_iterable(shapes))) <= _INT:
        return shapes
    return tuple(tuple(map(operator.index, s)) for s in shapes)


_INT = {int}


def parse_shapes(shapes: Any) -> tuple[Optional[tuple[tuple[int, ...], ...]], list[str]]:
    """``shapes`` as :func:`int_shapes` reads them and no error, or None and the error
    that says why, for a collective to raise with its others on every rank."""
    try:
        return int_shapes(shapes), []
    except (TypeError, ValueError):  # 2.5 is no dim; a shape that is not a sequence
        return None, [f"expected shapes as a list of int tuples, got {shapes!r}"]


def shard_spec(shape: Sequence[int], itemsize: int, world: int, index: int = 0) -> ShardSpec:
    shape = tuple(operator.index(d) for d in shape)
    if len(shape) == 0:
        raise TideInvalid(f"parameter {index}: expected at least 1 dimension, got a 0-d shape")
    if any(d < 0 for d in shape):
        raise TideInvalid(f"parameter {index}: expected non-negative dims, got {shape}")
    return ShardSpec(shape, itemsize, world)


@dataclass(frozen=True)
class UnitLayout:
    """One FSDP unit's parameters and where each lives inside a slot."""

    specs: tuple[ShardSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int

    def __len__(self) -> int:
        return len(self.specs)

    def __hash__(self) -> int:
        # Computed once: units key caches on every call, and hashing hundreds
        # of specs each time cost more than the lookups it served.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.specs, self.offsets, self.nbytes))
            object.__setattr__(self, "_hash", h)
        return h


def plan_unit(
    shapes: Sequence[Sequence[int]], itemsize: int, world: int, align: int = ALIGN
) -> UnitLayout:
    """Place a unit's full parameters back to back in a slot, each aligned."""
    specs = tuple(shard_spec(s, itemsize, world, i) for i, s in enumerate(shapes))
    offsets, cursor = [], 0
    for spec in specs:
        offsets.append(cursor)
        cursor = align_up(cursor + spec.nbytes, align)
    return UnitLayout(specs, tuple(offsets), cursor)


@functools.lru_cache(maxsize=512)
def cached_unit(shapes: tuple, itemsize: int, world: int) -> UnitLayout:
    """:func:`plan_unit` for normalized (hashable) shapes, cached: the collectives
    plan the same units call after call."""
    return plan_unit(shapes, itemsize, world)


#: Shard offsets inside a rank's block of a flat layout are aligned to 16 bytes
#: (vector copies in the fused kernels).
FLAT_ALIGN_BYTES = 16


@dataclass(frozen=True)
class FlatLayout:
    """FSDP2's flat rank-major layout of one unit, ``[r0: p0 p1 ..][r1: p0 p1 ..]``: padded
    shards back to back per rank (elements). The shard arena's units lie this way, and
    FSDP2's flat all-gather and reduce-scatter buffers."""

    specs: tuple[ShardSpec, ...]
    offsets: tuple[int, ...]
    block_numel: int
    world: int

    @property
    def total_numel(self) -> int:
        """Elements of the whole flat buffer: every rank's block."""
        return self.block_numel * self.world


def flat_layout(shapes: Sequence[Sequence[int]], world: int, itemsize: int = 2) -> FlatLayout:
    """Rank-major flat layout; each shard offset aligned to 16 bytes of ``itemsize``."""
    specs = tuple(shard_spec(s, itemsize, world, i) for i, s in enumerate(shapes))
    align = max(1, FLAT_ALIGN_BYTES // itemsize)
    offsets, cur = [], 0
    for s in specs:
        offsets.append(cur)
        cur += -(-s.shard_numel // align) * align
    return FlatLayout(specs, tuple(offsets), cur, world)
