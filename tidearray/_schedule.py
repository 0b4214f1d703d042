"""Pure planning: the all-gather and reduce-scatter schedules.

All-gather: which slot pieces a set of ranks owns (:func:`ag_pieces`) and the
inter-node exchange steps (:func:`internode_ag_steps`). Reduce-scatter: a unit's
shard rows cut into chunks and the staging buffers they need
(:func:`plan_reduce_scatter`, :class:`RsPlan`). Nothing here touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._errors import TideInvalid
from ._layout import ALIGN, UnitLayout, align_up
from ._topology import Topology

# -- all-gather ---------------------------------------------------------------


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
