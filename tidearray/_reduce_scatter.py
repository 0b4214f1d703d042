"""TIDE-RS: per-parameter gradients (bf16/fp16/fp32) in, fp32 shards out.

Gradients are read where they are. For each chunk of the plan, every rank
pushes, by copy engine, each node-local peer's slice of each gradient into
that peer's staging buffer; the peer then runs one short accumulate over its
sources in local-rank order (its own slice read in place), with the scale
fused in. Chunk ``k`` uses staging buffer ``k % depth``, so pushes of chunk
``k+1`` overlap the accumulate of chunk ``k`` (the two-phase pipeline).

Across nodes, the accumulate writes node partial sums for every node's rank of
this column, chunk by chunk, and each chunk crosses the network as soon as its
partial sums are complete.

[Note: inter-node pipeline]
Chunk ``k``'s node partial sums (one fp32 block per node) land in partial buffer
``k % depth`` of the staging region. The NET lane then sends block ``m`` to node
``m`` and receives every other node's block for our rows into the receive
buffer, one grouped exchange over ``inter_comm``, while COMPUTE goes on to
chunk ``k+1``. Once the exchange is done, COMPUTE sums chunk ``k``'s blocks into
our outputs, before the next chunk's exchange reuses the receive buffer. So

  COMPUTE:  acc(0)  acc(1) sum(0)  acc(2) sum(1)  ...  sum(n-1)
  NET:             xchg(0)        xchg(1)        xchg(2) ...

Lanes are ordered by marks and dependencies (events on cuda), never by host
waits. Every buffer is one chunk's, so the reduce-scatter's memory stays
``depth`` staging buffers, ``depth`` partial buffers and one receive buffer,
whatever the world size (``RsPlan``).

The summation order is fixed and does not depend on chunking, depth, backend
or library: each node sums its ``local_size`` sources in local-rank order in
fp32, scaled once (``avg``); then the ``num_nodes`` partial sums are added in
node order. A sum of our own (not NCCL's or MPI's reduce-scatter, whose order
depends on their algorithm and message size) keeps that order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import _dtypes, _stamps, _validate
from ._arena import ARRIVED, FREE, RS_CHANNEL0, Region
from ._errors import TideInvalid
from ._group import Group
from ._layout import ShardSpec, UnitLayout, cached_unit
from ._schedule import RsChunk, RsPiece, RsPlan, plan_reduce_scatter
from ._topology import Topology
from ._validate import overlaps
from .backends import AccumPiece

if TYPE_CHECKING:
    from .backends import Executor

OPS = ("sum", "avg")


@functools.lru_cache(maxsize=512)
def _plan(unit: UnitLayout, topo: Topology, chunk_nbytes: int, depth: int) -> RsPlan:
    return plan_reduce_scatter(unit, topo, chunk_nbytes, depth)


@dataclass(frozen=True)
class Reduce:
    """A reduction every rank accepted: what :func:`validate` found.

    Attributes:
        layout: the unit's slot layout; ``plan`` its chunks and staging.
        dtype: the gradients' dtype.
        grad_ptrs, grads: each gradient's address, and the gradients as the
            backend's arrays; ``out_ptrs`` and ``outs`` the same for ``out``
            (None without it).
        signature: what every rank agreed on (``_validate``), and its ``digest``.
    """

    layout: UnitLayout
    plan: RsPlan
    dtype: Any
    grad_ptrs: tuple
    grads: list
    out_ptrs: Optional[tuple]
    outs: Optional[list]
    signature: tuple
    digest: int


def validate(group: Group, grads: Any, out: Any, op: str, staging: Optional[Region],
             chunk_nbytes: Optional[int] = None, expect: Optional[tuple] = None,
             what: str = "reduce_scatter", errors: Sequence[str] = (),
             tag: tuple = ()) -> Reduce:
    """Resolve and check a reduction of ``grads`` (into ``out`` if given) in one
    agreement: any rank's bad input raises on every rank.

    Args:
        chunk_nbytes: the chunk (the group's if None).
        expect: ``(layout, dtype)`` the gradients must have (a plan's unit's), if any.
        errors: the caller's own findings, raised with these.
        tag: ``(name, value)`` pairs the ranks must agree on too (``_all_gather.validate``).
    """
    be = group.backend
    grads_r, more = _validate.resolve_all(be, grads, "gradient")
    errors = [*errors, *more]
    outs = None
    if out is not None:
        outs, more = _validate.resolve_all(be, out, "output")
        errors += more
    dtype, more = _validate.check_arrays(grads_r, "gradient")
    errors += more
    if op not in OPS:
        errors.insert(0, f"expected op in {OPS}, got {op!r}")
    shapes = tuple(g.shape for g in grads_r)
    try:
        unit = cached_unit(shapes, dtype.itemsize, group.size)
    except TideInvalid as e:
        errors.append(str(e))
        unit = None
    plan = None
    if expect is not None and (unit != expect[0] or dtype != expect[1]):
        errors.append(f"expected gradients of the unit's shapes and dtype {expect[1]}, got "
                      f"{list(shapes)} {dtype}")
    if not (isinstance(staging, Region) and staging.group is group):
        staging = None  # none given, or refused by the caller (``_arena.region_check``)
    if unit is not None:
        cfg = group.config
        plan = _plan(unit, group.topology, chunk_nbytes or cfg.chunk_nbytes, cfg.depth)
        if outs is not None:
            errors += _check_outs(unit, grads_r, outs, out, staging)
        if staging is not None:
            if staging.nbytes < plan.staging_nbytes:
                errors.append(f"expected a staging region of at least {plan.staging_nbytes} "
                              f"bytes, got {staging.nbytes}")
            errors += [f"parameter {i}: expected a gradient outside the staging region, got "
                       "one that aliases it" for i, g in enumerate(grads_r)
                       if staging.contains(g.ptr, g.nbytes)]
    signature = (("call", what), *tag, ("shapes", shapes), ("dtype", str(dtype)), ("op", op),
                 ("out", outs is not None), ("staging", _validate.region_key(staging)))
    digest = _validate.digest(signature)
    _validate.check(group, what, signature, errors, known_digest=digest)
    return Reduce(unit, plan, dtype, tuple(g.ptr for g in grads_r), [g.array for g in grads_r],
                  None if outs is None else tuple(o.ptr for o in outs),
                  None if outs is None else [o.array for o in outs], signature, digest)


def _check_outs(unit: UnitLayout, grads: list, outs: list, given: Sequence[Any],
                staging: Optional[Region]) -> list[str]:
    """Errors of the outputs ``outs`` (resolved from ``given``): shapes, dtype, whether
    they can be written, and every overlap (with a gradient, with each other, with the
    staging region): a reduction writes its outputs while it still reads the others."""
    if len(outs) != len(grads):
        return [f"expected one output per gradient ({len(grads)}), got {len(outs)}"]
    errors = []
    for i, (o, spec) in enumerate(zip(outs, unit.specs)):
        if o.dtype != _dtypes.float32 or o.shape != spec.shard_shape or not o.contiguous:
            errors.append(f"parameter {i}: expected a contiguous float32 output of shape "
                          f"{spec.shard_shape}, got {o.dtype} {o.shape}"
                          + ("" if o.contiguous else " (non-contiguous)"))
    errors += [f"parameter {i}: expected a writable output, got a read-only "
               f"{type(g).__name__} (JAX arrays are immutable: pass an array of the backend)"
               for i, (o, g) in enumerate(zip(outs, given))
               if not o.writable or type(g).__module__.split(".")[0] in ("jax", "jaxlib")]
    ranges = [(o.ptr, o.nbytes, i) for i, o in enumerate(outs)]
    hits = overlaps(ranges, [(g.ptr, g.nbytes, j) for j, g in enumerate(grads)])
    errors += [f"parameter {i}: expected an output that does not alias an input, got one "
               f"overlapping gradient {j}" for i, j in sorted(hits)]
    errors += [f"parameter {i}: expected outputs that do not overlap, got one overlapping "
               f"output {j}" for i, j in sorted(set(overlaps(ranges, ranges))) if i < j]
    if staging is not None:
        errors += [f"parameter {i}: expected an output outside the staging region, got one "
                   "inside it" for i, o in enumerate(outs) if staging.contains(o.ptr, o.nbytes)]
    return errors


def start_stamps(group: Group, plan: RsPlan) -> Optional[_stamps.Stamps]:
    """Debug stamps for one call: one per peer and chunk ([Note: stamps])."""
    return _stamps.start(group, "reduce_scatter", len(plan.chunks) * (group.local_size - 1))


@dataclass(frozen=True)
class NetStage:
    """One chunk's inter-node phase: its partial sums sent to every other node, the
    other nodes' partial sums for our shard received, and their sum.

    Attributes:
        sends, recvs: ``(node, addr, nbytes)`` of the grouped exchange over
            ``inter_comm`` (node index = inter-node rank).
        sums: the compiled accumulate pieces: ``out = sum over nodes in node order``
            of the partial sums for our rows (our own node's read in place).
    """

    sends: tuple
    recvs: tuple
    sums: Any


@dataclass(frozen=True)
class Program:
    """Every address a reduce-scatter touches for one set of buffers, computed once;
    each batch in its backend's form ([Note: compiled batches] in ``backends._base``).

    Attributes:
        chunks: per chunk, ``(pushes, pieces, net)``: copies into each node-local
            peer's staging, the accumulate pieces of our own shard rows (node
            partial sums across nodes), and the chunk's :class:`NetStage` (None on
            one node).
        zeros: ``(addr, nbytes)`` of padding rows in the outputs.
        dtype: the gradients' dtype (the accumulate's sources).
    """

    chunks: tuple
    zeros: tuple
    dtype: Any


def build_program(group: Group, red: Reduce, outs: Optional[Sequence[int]],
                  final_ptr: Optional[int], staging: Region, alone: bool = False) -> Program:
    """Every copy, accumulate and exchange of ``red`` staged in ``staging``, compiled
    for the group's backend. ``outs``: the addresses of fp32 outputs (validated: each
    its shard's shape), or None (into ``final_ptr``, a receive block). ``alone``: the
    caller runs nothing beside it (``Backend.compile_pieces``)."""
    be, topo, unit, plan = group.backend, group.topology, red.layout, red.plan
    grad_ptrs = red.grad_ptrs
    me, L, nodes = topo.local_rank, topo.local_size, topo.num_nodes
    if final_ptr is None:
        out_ptrs = list(outs)
    else:
        out_ptrs = [final_ptr + o * 4 for o in plan.out_offsets]
    chunks = []
    for k, chunk in enumerate(plan.chunks):
        b = plan.buffer_of(k)
        boff = b * plan.buffer_nbytes
        pushes = {p: be.compile_copies(_push_copies(
            unit, chunk, topo, p, grad_ptrs,
            staging.ptr(p) + boff + ((me - p) % L - 1) * plan.source_nbytes), split=True)
                  for p in range(L) if p != me}
        src_base = {q: staging.ptr(me) + boff + ((q - me) % L - 1) * plan.source_nbytes
                    for q in range(L) if q != me}
        net = None
        if nodes == 1:
            out = functools.partial(_into_shards, out_ptrs)
        else:
            partial = (staging.ptr(me) + plan.partial_offset
                       + b * nodes * plan.net_numel * 4)
            out = functools.partial(_into_partials, plan, partial)
            net = _net_stage(group, unit, plan, k, partial, staging.ptr(me) + plan.receive_offset,
                             out_ptrs, alone)
        pieces = accum_pieces(unit, chunk, topo, grad_ptrs, out, src_base)
        chunks.append((pushes, be.compile_pieces(pieces, red.dtype, alone=alone), net))
    zeros = []
    for spec, ptr in zip(unit.specs, out_ptrs):  # padding rows: nobody contributes
        v = spec.valid_rows(topo.rank)
        if v < spec.rows_per_shard:
            zeros.append((ptr + v * spec.row_numel * 4,
                          (spec.rows_per_shard - v) * spec.row_numel * 4))
    return Program(tuple(chunks), tuple(zeros), red.dtype)


def _net_stage(group: Group, unit: UnitLayout, plan: RsPlan, k: int, partial: int,
               receive: int, out_ptrs: list[int], alone: bool) -> NetStage:
    """Chunk ``k``'s exchange of node partial sums and their sum into our outputs."""
    topo = group.topology
    node, nodes, block = topo.node, topo.num_nodes, plan.net_numel * 4
    nbytes = plan.chunk_numel(k) * 4

    def received(m: int) -> int:  # node m's block in the receive buffer (ours is not there)
        return receive + (m - (m > node)) * block

    others = [m for m in range(nodes) if m != node]
    sends = tuple((m, partial + m * block, nbytes) for m in others)
    recvs = tuple((m, received(m), nbytes) for m in others)
    sums = []
    for pc in plan.chunks[k].pieces:
        spec = unit.specs[pc.param]
        _, n = _slice(spec, topo.rank, pc.row_start, pc.row_stop)
        off = pc.offset // plan.itemsize * 4
        srcs = tuple(partial + node * block + off if m == node else received(m) + off
                     for m in range(nodes))
        sums.append(AccumPiece(out_ptrs[pc.param] + pc.row_start * spec.row_numel * 4, srcs,
                               n * spec.row_numel))
    return NetStage(sends, recvs, group.backend.compile_pieces(sums, _dtypes.float32,
                                                               alone=alone))


def run(group: Group, ex: Executor, plan: RsPlan, program: Program, staging: Region,
        scale: float, stamps: Optional[_stamps.Stamps] = None) -> None:
    """Issue one reduction: CE pushes into peers' staging, accumulate from ours; across
    nodes, each chunk's exchange and sum as soon as its partial sums are complete
    ([Note: inter-node pipeline]). ``stamps``: debug mode's ([Note: stamps])."""
    me, L = group.topology.local_rank, group.topology.local_size
    peers = [(me + k) % L for k in range(1, L)]
    n_chunks = len(plan.chunks)
    for b in range(plan.buffers):  # grant this call's first use of each buffer
        for p in peers:
            ex.signal(ex.COMPUTE, staging.flag(p, RS_CHANNEL0 + b, FREE, me), 1)
    # With one partial buffer, chunk k's partial sums may be written only once chunk
    # k-1's have been sent: its sum (which waits for that exchange) goes first.
    sum_first = plan.depth == 1
    sent: list = []  # per chunk: the NET lane's mark after its exchange

    def net_sum(j: int) -> None:
        ex.after(ex.COMPUTE, sent[j])
        ex.accumulate(ex.COMPUTE, program.chunks[j][2].sums, _dtypes.float32, 1.0)

    for k, (pushes, pieces, net) in enumerate(program.chunks):
        ch = RS_CHANNEL0 + plan.buffer_of(k)
        use = staging.uses[ch] = staging.uses[ch] + 1
        for p in peers:
            ex.consume(p, staging.flag(me, ch, FREE, p), 1)
            ex.copy(p, pushes[p])
            if stamps is not None:
                stamps.send(ex, p, staging, ch, p, use)
            ex.signal(p, staging.flag(p, ch, ARRIVED, me), 1)
        for q in peers:
            ex.consume(ex.COMPUTE, staging.flag(me, ch, ARRIVED, q), 1)
        if stamps is not None:
            stamps.snapshot(ex, ex.COMPUTE, staging, ch, peers, use,
                            f"staging {staging.id}, chunk {k}")
        if net is not None and sum_first and k:
            net_sum(k - 1)
        ex.accumulate(ex.COMPUTE, pieces, program.dtype, scale)
        if k + plan.depth < n_chunks:
            for p in peers:
                ex.signal(ex.COMPUTE, staging.flag(p, ch, FREE, me), 1)
        if net is None:
            continue
        if not sum_first and k:
            net_sum(k - 1)  # before the exchange that reuses its receive buffer
        # After COMPUTE so far: this chunk's partial sums, and the sum that read the
        # receive buffer last.
        ex.depend(ex.NET, ex.COMPUTE)
        ex.exchange(ex.NET, net.sends, net.recvs)
        sent.append(ex.mark(ex.NET))
    if sent:
        net_sum(n_chunks - 1)
    for addr, nbytes in program.zeros:
        ex.zero(ex.COMPUTE, addr, nbytes)


def _slice(spec: ShardSpec, target: int, a: int, b: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of ``target``'s shard clipped to real rows: (first full row, count)."""
    start, stop = spec.rows(target)
    n = max(0, min(b, stop - start) - a)
    return start + a, n


def _push_copies(unit: UnitLayout, chunk: RsChunk, topo: Topology, p: int, grad_ptrs: list[int],
                 base: int) -> tuple:
    copies = []
    for m in range(topo.num_nodes):
        target = topo.global_rank(m, p)
        for pc in chunk.pieces:
            spec = unit.specs[pc.param]
            row, n = _slice(spec, target, pc.row_start, pc.row_stop)
            copies.append((base + m * chunk.block_nbytes + pc.offset,
                           grad_ptrs[pc.param] + row * spec.row_nbytes, n * spec.row_nbytes))
    return tuple(copies)


def _into_shards(out_ptrs: list[int], m: int, pc: RsPiece, spec: ShardSpec) -> int:
    """Where a node-local sum goes on one node: the piece's rows of our output shard."""
    return out_ptrs[pc.param] + pc.row_start * spec.row_numel * 4


def _into_partials(plan: RsPlan, partial: int, m: int, pc: RsPiece, spec: ShardSpec) -> int:
    """Where a node-local sum goes across nodes: node ``m``'s block of the partial sums."""
    return partial + (m * plan.net_numel + pc.offset // plan.itemsize) * 4


def accum_pieces(unit: UnitLayout, chunk: RsChunk, topo: Topology, grad_ptrs: list[int],
                 out: Any, src_base: dict) -> list[AccumPiece]:
    """The node-local sums of ``chunk``: for each node's rank of our column (only us on
    one node), our node's sources in local-rank order, into ``out(node, piece, spec)``."""
    me, L = topo.local_rank, topo.local_size
    pieces = []
    for m in range(topo.num_nodes):
        target = topo.global_rank(m, me)
        for pc in chunk.pieces:
            spec = unit.specs[pc.param]
            row, n = _slice(spec, target, pc.row_start, pc.row_stop)
            srcs = tuple(grad_ptrs[pc.param] + row * spec.row_nbytes if q == me else
                         src_base[q] + m * chunk.block_nbytes + pc.offset for q in range(L))
            pieces.append(AccumPiece(out(m, pc, spec), srcs, n * spec.row_numel))
    return pieces
