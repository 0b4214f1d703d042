"""Pure planning: shard specs, byte ranges, slot layout, RS chunking, schedules.

Nothing here touches a device. Plans are frozen dataclasses of sizes and
offsets, shared by every backend, so what the CPU tests check is exactly the
addressing the GPU executes.

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
from typing import Any, NamedTuple, Sequence

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


def shard_spec(shape: Sequence[int], itemsize: int, world: int, index: int = 0) -> ShardSpec:
    shape = tuple(operator.index(d) for d in shape)
    if len(shape) == 0:
        raise TideInvalid(f"parameter {index}: expected at least 1 dimension, got a 0-d shape")
    if any(d < 0 for d in shape):
        raise TideInvalid(f"parameter {index}: expected non-negative dims, got {shape}")
    return ShardSpec(shape, itemsize, world)


#: Shard offsets inside a rank's block of a flat layout are aligned to 16 bytes
#: (vector copies in the fused kernels).
FLAT_ALIGN_BYTES = 16


@dataclass(frozen=True)
class FlatLayout:
    """Padded shards of one unit, packed back to back per rank (elements)."""

    specs: tuple[ShardSpec, ...]
    offsets: tuple[int, ...]
    block_numel: int
    world: int

    @property
    def total_numel(self) -> int:
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


@dataclass(frozen=True)
class Topology:
    """Ranks as ``nodes x local_size``; global rank = node * local_size + local_rank."""

    world: int
    rank: int
    local_size: int

    def __post_init__(self) -> None:
        if self.local_size < 1 or self.world % self.local_size:
            raise TideInvalid(
                f"expected a local size that divides the world size {self.world}, "
                f"got {self.local_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world // self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    def global_rank(self, node: int, local_rank: int) -> int:
        return node * self.local_size + local_rank

    def column(self, local_rank: int) -> tuple[int, ...]:
        """Global ranks that share ``local_rank``, one per node, in node order."""
        return tuple(self.global_rank(m, local_rank) for m in range(self.num_nodes))


# -- all-gather ---------------------------------------------------------------

Copy = tuple[int, int, int]  # (dst, src, nbytes): addresses or offsets


def shared_devices(places: Sequence[tuple]) -> list[tuple[int, int]]:
    """Pairs of ranks that one communicator would put on one device.

    Args:
        places: per rank of the group, ``(communicator, host, device)``: which
            communicator the rank joins (e.g. its local rank, for the
            inter-node one), and where it runs.

    Returns:
        ``(first rank, later rank)`` for each rank whose place another rank of
        the same communicator already has (NCCL rejects such a communicator).
    """
    first: dict = {}
    pairs = []
    for r, place in enumerate(places):
        if place in first:
            pairs.append((first[place], r))
        else:
            first[place] = r
    return pairs


def coalesce(copies: Sequence[Copy]) -> list[Copy]:
    """Merge copies that continue each other in both source and destination."""
    out: list[Copy] = []
    for dst, src, n in copies:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            pdst, psrc, pn = out[-1]
            out[-1] = (pdst, psrc, pn + n)
        else:
            out.append((dst, src, n))
    return out


#: Cut points of split batches are multiples of this (keeps vector alignment).
SPLIT_ALIGN = 1 << 16


def split_copies(copies: Sequence[tuple[int, int, int]], parts: int) -> list[list]:
    """``copies`` cut into ``parts`` runs of about equal bytes, in order.

    A copy that straddles a cut is split in two at a multiple of
    :data:`SPLIT_ALIGN` bytes from its start (same allocation, so still valid).
    Runs can be empty when there are fewer bytes than cut granules.
    """
    total = sum(n for _, _, n in copies)
    share = -(-total // parts)
    runs: list[list] = [[] for _ in range(parts)]
    k, room = 0, share
    for dst, src, n in copies:
        while n:
            take = n if n <= room or k == parts - 1 else max(
                room // SPLIT_ALIGN * SPLIT_ALIGN, 0)
            if take == 0:  # the cut would be unaligned: move on to the next run
                k, room = k + 1, share
                continue
            runs[k].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room <= 0 and k < parts - 1:
                k, room = k + 1, share
    return runs


def cut_copies(copies: Sequence[tuple[int, int, int]], max_bytes: int) -> tuple:
    """Every copy longer than ``max_bytes`` cut into pieces of at most that many
    bytes, in order (each cut at a multiple of ``max_bytes`` from the copy's start,
    so a piece keeps its copy's alignment when ``max_bytes`` is a multiple of
    :data:`SPLIT_ALIGN`); ``max_bytes`` of 0 leaves them whole."""
    if max_bytes <= 0:
        return tuple(copies)
    return tuple((dst + o, src + o, min(max_bytes, n - o)) for dst, src, n in copies
                 for o in range(0, n, max_bytes) or (0,))


class Strided(NamedTuple):
    """``height`` rows of ``width`` bytes: row ``k`` from ``src + k*spitch`` to
    ``dst + k*dpitch`` (one 2D copy; ``height`` 1 is a plain copy)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


#: Largest pitch a 2D copy takes (cudaDevAttrMaxPitch on current GPUs).
MAX_PITCH = (1 << 31) - 1


def strided_runs(copies: Sequence[tuple[int, int, int]]) -> list[Strided]:
    """Consecutive copies of one size at constant destination and source
    strides, merged into 2D runs; every other copy is a run of height 1.

    A unit's pieces from one rank sit at a constant stride wherever its
    parameters repeat a shape (a MoE layer's experts), so a gather of hundreds
    of pieces becomes a few 2D copies. Strides must be at least the width (rows
    never overlap). Zero-byte copies are dropped. Whether the rows of a run lie
    in one allocation is for the caller to check.
    """
    runs: list[Strided] = []
    for dst, src, n in copies:
        if not n:
            continue
        if runs:
            r = runs[-1]
            if n == r.width:
                if r.height == 1:
                    dp, sp = dst - r.dst, src - r.src
                    if n <= dp <= MAX_PITCH and n <= sp <= MAX_PITCH:
                        runs[-1] = r._replace(dpitch=dp, spitch=sp, height=2)
                        continue
                elif (dst == r.dst + r.height * r.dpitch
                      and src == r.src + r.height * r.spitch):
                    runs[-1] = r._replace(height=r.height + 1)
                    continue
        runs.append(Strided(dst, n, src, n, n, 1))
    return runs


@dataclass(frozen=True)
class AgPiece:
    """Rank ``rank``'s contribution to parameter ``param``, at ``offset`` in the slot."""

    param: int
    rank: int
    offset: int
    nbytes: int


def ag_pieces(unit: UnitLayout, ranks: Sequence[int]) -> tuple[AgPiece, ...]:
    """Non-empty slot pieces owned by ``ranks``, in (param, rank) order."""
    pieces = []
    for i, (spec, base) in enumerate(zip(unit.specs, unit.offsets)):
        for r in ranks:
            off, n = spec.byte_range(r)
            if n:
                pieces.append(AgPiece(i, r, base + off, n))
    return tuple(pieces)


@dataclass(frozen=True)
class ExchangeStep:
    """One inter-node step: send what ``send_nodes`` own, receive ``recv_nodes``'."""

    send_peer: int
    send_nodes: tuple[int, ...]
    recv_peer: int
    recv_nodes: tuple[int, ...]


def internode_ag_steps(num_nodes: int, node: int) -> tuple[ExchangeStep, ...]:
    """Recursive doubling when ``num_nodes`` is a power of two, pairwise otherwise.

    In recursive doubling step k a node holds the aligned block of ``2**k``
    nodes around it, which is one contiguous range of every parameter when the
    local size is 1. Pairwise steps send only the node's own shards.
    """
    steps = []
    if num_nodes & (num_nodes - 1) == 0:
        k = 1
        while k < num_nodes:
            base = node & ~(k - 1)
            partner = node ^ k
            pbase = partner & ~(k - 1)
            steps.append(ExchangeStep(partner, tuple(range(base, base + k)),
                                      partner, tuple(range(pbase, pbase + k))))
            k *= 2
    else:
        for k in range(1, num_nodes):
            src = (node - k) % num_nodes
            steps.append(ExchangeStep((node + k) % num_nodes, (node,), src, (src,)))
    return tuple(steps)


# -- reduce-scatter -------------------------------------------------------------


@dataclass(frozen=True)
class RsPiece:
    """Shard rows ``[row_start, row_stop)`` of ``param`` inside one chunk.

    In a staging buffer, the piece for target node ``m`` from source slot ``j``
    sits at ``j * source_nbytes + m * block_nbytes + offset``. Across nodes, its
    fp32 partial sums for node ``m`` sit at element ``m * net_numel + offset //
    itemsize`` of the chunk's partial buffer (the same layout, counted in elements).
    """

    param: int
    row_start: int
    row_stop: int
    offset: int


@dataclass(frozen=True)
class RsChunk:
    pieces: tuple[RsPiece, ...]
    block_nbytes: int


@dataclass(frozen=True)
class RsPlan:
    """Chunks of a unit's reduce-scatter and the buffers it needs.

    A staging region holds, back to back: ``min(depth, chunks)`` node-local staging
    buffers; across nodes, as many fp32 partial-sum buffers (``num_nodes`` blocks of
    ``net_numel`` each) and one fp32 receive buffer (``num_nodes - 1`` blocks). All
    are bounded by the chunk and the depth, not by the world size
    ([Note: inter-node pipeline] in ``_reduce_scatter``).

    Attributes:
        chunks: chunks in issue order; chunk k uses staging buffer ``k % depth``.
        depth: staging buffers in flight (the two-phase pipeline depth).
        source_nbytes: one remote source's share of a staging buffer.
        buffer_nbytes: one staging buffer, for ``local_size - 1`` sources.
        out_offsets: fp32 element offset of each parameter's shard in a rank's
            block of results (the receive block without ``out=``).
        block_numel: fp32 elements of one rank's block of results.
        num_nodes: the nodes the plan reduces over.
        itemsize: bytes per gradient element.
        net_numel: fp32 elements of one node's block of a chunk's partial sums
            (the largest chunk's); 0 on one node.
    """

    chunks: tuple[RsChunk, ...]
    depth: int
    source_nbytes: int
    buffer_nbytes: int
    out_offsets: tuple[int, ...]
    block_numel: int
    num_nodes: int = 1
    itemsize: int = 2
    net_numel: int = 0

    @property
    def buffers(self) -> int:
        """Staging (and partial-sum) buffers in use: no more than there are chunks."""
        return min(self.depth, len(self.chunks))

    @property
    def local_nbytes(self) -> int:
        """Node-local staging: what peers push gradient rows into."""
        return self.buffers * self.buffer_nbytes

    @property
    def partial_nbytes(self) -> int:
        """fp32 node partial sums, one buffer per chunk in flight (across nodes)."""
        return self.buffers * self.num_nodes * self.net_numel * 4 if self.num_nodes > 1 else 0

    @property
    def receive_nbytes(self) -> int:
        """fp32 partial sums received from the other nodes, for one chunk (across nodes)."""
        return (self.num_nodes - 1) * self.net_numel * 4

    @property
    def partial_offset(self) -> int:
        return self.local_nbytes

    @property
    def receive_offset(self) -> int:
        return self.local_nbytes + self.partial_nbytes

    @property
    def staging_nbytes(self) -> int:
        return self.local_nbytes + self.partial_nbytes + self.receive_nbytes

    def buffer_of(self, chunk: int) -> int:
        return chunk % self.depth

    def chunk_numel(self, chunk: int) -> int:
        """fp32 elements of one node's block of chunk ``chunk``'s partial sums."""
        return self.chunks[chunk].block_nbytes // self.itemsize


def _chunk_pieces(unit: UnitLayout, budget: int) -> list[list[tuple[int, int, int]]]:
    """Split shard rows greedily into chunks of at most ``budget`` bytes, counting each
    piece aligned (one row minimum, so a single row larger than the budget still fits)."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for i, spec in enumerate(unit.specs):
        a, c, rb = 0, spec.rows_per_shard, spec.row_nbytes
        while a < c:
            if used and used + align_up(rb) > budget:
                chunks.append([])
                used = 0
            take = c - a if rb == 0 else min(c - a, (budget - used) // rb)
            while take > 1 and align_up(take * rb) > budget - used:
                take -= 1
            take = max(1, take)
            chunks[-1].append((i, a, a + take))
            used += align_up(take * rb)
            a += take
    return [ch for ch in chunks if ch]


def plan_reduce_scatter(
    unit: UnitLayout, topo: Topology, chunk_nbytes: int = 32 << 20, depth: int = 2
) -> RsPlan:
    """Plan a reduce-scatter of ``unit`` (itemsize = the gradient dtype's).

    ``chunk_nbytes`` bounds one remote source's bytes per chunk, summed over
    target nodes, so staging stays ``depth * (local_size-1) * chunk_nbytes``
    whatever the world size; across nodes the partial sums and the receive buffer
    are bounded by the chunk too (``RsPlan``).
    """
    if depth < 1:
        raise TideInvalid(f"expected a pipeline depth >= 1, got {depth}")
    nodes = topo.num_nodes
    itemsize = unit.specs[0].itemsize if unit.specs else 2
    budget = max(ALIGN, chunk_nbytes // nodes // ALIGN * ALIGN)
    raws = _chunk_pieces(unit, budget)
    if 1 < len(raws) <= depth:
        # As many chunks, evened out: the buffers are sized by the largest chunk, so a
        # unit of 1.2 chunks takes two of 0.6, not a full one and a sliver (with more
        # chunks than buffers, the largest is one of many: left as it is). Rows and
        # alignment may need a little more than the even share: a few budgets between
        # it and the full one are tried, the smallest that keeps the count wins.
        used = sum(align_up((b - a) * unit.specs[i].row_nbytes) for raw in raws
                   for i, a, b in raw)
        share = -(-used // len(raws))
        for slack in (1.0, 1.02, 1.1, 1.25):
            even = _chunk_pieces(unit, align_up(int(share * slack)))
            if len(even) == len(raws) and align_up(int(share * slack)) < budget:
                raws = even
                break
    chunks = []
    for raw in raws:
        pieces, cursor = [], 0
        for i, a, b in raw:
            pieces.append(RsPiece(i, a, b, cursor))
            cursor = align_up(cursor + (b - a) * unit.specs[i].row_nbytes)
        chunks.append(RsChunk(tuple(pieces), cursor))
    source = max((ch.block_nbytes * nodes for ch in chunks), default=0)
    out_offsets, cursor = [], 0
    for spec in unit.specs:
        out_offsets.append(cursor)
        cursor += align_up(spec.shard_numel * 4) // 4
    net = max((ch.block_nbytes for ch in chunks), default=0) // itemsize if nodes > 1 else 0
    return RsPlan(tuple(chunks), depth, source, source * (topo.local_size - 1),
                  tuple(out_offsets), cursor, nodes, itemsize, net)
