"""TIDE-AG: each rank's shard lands straight in every peer's parameter storage.

Every byte goes to the offset it occupies in the full parameter inside a slot; no
flat buffer, no copy-out. Node-local transports, by copy engine between GPUs (the
own copy, within the GPU, the driver runs on the SMs: [Note: same-device copies]):
pushes (one batch per peer, straight from the shards into its slot), or multicast
slots (one write reaches every peer). Across nodes, ranks with the same local rank
first exchange shards by recursive doubling (pairwise for a node count that is not a
power of two), straight into their slots; the node-local transport then spreads
everything the column holds.

[Note: gathering into the caller's buffers]
Peers write a rank's slot, so the slot is where a gather's pieces land; a caller
whose parameters must live in buffers of its own (XLA's, in ``tidearray.jax``) would
copy the whole unit out of the slot after each gather. Given those buffers
(``out``), a gather writes this rank's own rows straight into them (its own copy, or
its cast from fp32), pushes from there, and copies only the other ranks' rows out of
the slot once they arrived: at ``W`` ranks ``(W-1)/W`` of the unit instead of all of
it, at one rank nothing. The slot's own rows stay unwritten (but for a multicast
slot's, which its writes reach).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import _dtypes, _stamps, _validate
from ._arena import AG_CHANNEL, ARRIVED, FREE, Region
from ._errors import TideInvalid
from ._group import Group, default_group
from ._layout import UnitLayout, cached_unit, int_shapes, parse_shapes
from ._schedule import ag_pieces, internode_ag_steps
from .backends import AccumPiece

if TYPE_CHECKING:
    from .backends import Executor


@functools.lru_cache(maxsize=1024)
def _pieces(unit: UnitLayout, ranks: tuple[int, ...]) -> tuple:
    return ag_pieces(unit, ranks)


def unit_nbytes(shapes: Sequence[Sequence[int]], dtype: Any, group: Optional[Group] = None,
                world: Optional[int] = None) -> int:
    """Slot bytes that the full parameters of ``shapes`` need (with alignment), on
    ``world`` ranks (the group's size if None). A size query: never collective."""
    world = world or (group or default_group()).size
    return cached_unit(int_shapes(shapes), _dtypes.normalize(dtype).itemsize, world).nbytes


@dataclass(frozen=True)
class Gather:
    """A gather every rank accepted: what :func:`validate` found.

    Attributes:
        layout: the slot layout of the full parameters.
        dtype: the shards' dtype; ``out_dtype`` the slot's (they differ for a cast).
        shard_ptrs: each shard's address.
        arrays: the shards as the backend's arrays.
        out_ptrs, out_arrays: the caller's buffers for the parameters, if given.
        signature: what every rank agreed on (``_validate``), and its ``digest``.
    """

    layout: UnitLayout
    dtype: Any
    out_dtype: Any
    shard_ptrs: tuple
    arrays: list
    signature: tuple
    digest: int
    out_ptrs: Optional[tuple] = None
    out_arrays: Optional[list] = None


def validate(group: Group, shards: Any, shapes: Any, slot: Optional[Region],
             out_dtype: Any = None, expect_dtype: Any = None, what: str = "all_gather",
             errors: Sequence[str] = (), tag: tuple = (), out: Any = None) -> Gather:
    """Resolve and check a gather of ``shards`` into ``slot`` (the group's own slots if
    None), in one agreement: any rank's bad input raises on every rank.

    Args:
        out_dtype: the slot's dtype when the shards are cast into it (a cast plan).
        expect_dtype: the dtype the shards must have (a plan's unit's), if any.
        errors: the caller's own findings, raised with these.
        tag: ``(name, value)`` pairs the ranks must agree on too (which unit a front
            end's call is for: units of one shape are otherwise alike).
        out: the caller's buffers for the full parameters, if any ([Note: gathering
            into the caller's buffers]).
    """
    resolved, unresolved = _validate.resolve_all(group.backend, shards, "shard")
    shapes, bad_shapes = parse_shapes(shapes)
    errors = [*errors, *bad_shapes, *unresolved]
    dtype, more = _validate.check_arrays(resolved, "shard")
    errors += more
    if expect_dtype is not None and dtype != expect_dtype and not more:
        want = ("float32 shards to cast" if out_dtype is not None else
                f"shards of the unit's dtype {expect_dtype}")
        errors.append(f"expected {want}, got {dtype}")
    out_dt = dtype if out_dtype is None else _dtypes.normalize(out_dtype)
    layout = None
    if shapes is not None:
        if len(resolved) != len(shapes) and not bad_shapes and not unresolved:
            errors.insert(0, f"expected one shard per shape ({len(shapes)}), got "
                             f"{len(resolved)}")
        try:
            layout = cached_unit(shapes, out_dt.itemsize, group.size)
        except TideInvalid as e:
            errors.append(str(e))
    if layout is not None and not errors:
        errors += _check_shards(group, layout, resolved, dtype, slot)
    outs: list = []
    if out is not None:
        outs, unresolved = _validate.resolve_all(group.backend, out, "out")
        errors += unresolved or _check_out(outs, shapes or [], out_dt, slot)
    signature = (("call", what), *tag, ("shapes", shapes), ("dtype", str(dtype)),
                 ("slot", _validate.region_key(slot)), ("out", str(out_dt)))
    digest = _validate.digest(signature)
    _validate.check(group, what, signature, errors, known_digest=digest)
    return Gather(layout, dtype, out_dt, tuple(s.ptr for s in resolved),
                  [s.array for s in resolved], signature, digest,
                  tuple(o.ptr for o in outs) if out is not None else None,
                  [o.array for o in outs] if out is not None else None)


def _check_out(outs: list, shapes: Sequence[tuple], dtype: Any,
               slot: Optional[Region]) -> list[str]:
    """Errors of the caller's buffers for the full parameters: one per parameter, of its
    full shape and the gather's dtype, contiguous, none inside the slot."""
    if len(outs) != len(shapes):
        return [f"out: expected one buffer per parameter ({len(shapes)}), got {len(outs)}"]
    errors = []
    for i, (o, shape) in enumerate(zip(outs, shapes)):
        if tuple(o.shape) != tuple(shape) or o.dtype != dtype or not o.contiguous:
            errors.append(f"out {i}: expected a C-contiguous {dtype} array of shape "
                          f"{tuple(shape)}, got {o.dtype} {tuple(o.shape)}"
                          f"{'' if o.contiguous else ' (non-contiguous)'}")
        elif slot is not None and slot.contains(o.ptr, o.nbytes):
            errors.append(f"out {i}: expected a buffer outside the slot, got one inside it")
    return errors


def _check_shards(group: Group, layout: UnitLayout, shards: list, dtype: Any,
                  slot: Optional[Region]) -> list[str]:
    errors = []
    for i, (s, spec) in enumerate(zip(shards, layout.specs)):
        if s.nbytes != spec.shard_numel * dtype.itemsize:
            errors.append(f"parameter {i}: expected a shard of shape {spec.shard_shape} "
                          f"for full shape {spec.shape} on {group.size} ranks, got {s.shape}")
    if slot is not None:
        if slot.nbytes < layout.nbytes:
            errors.append(f"expected a slot of at least {layout.nbytes} bytes, got "
                          f"{slot.nbytes}")
        for i, s in enumerate(shards):
            if slot.contains(s.ptr, s.nbytes):
                errors.append(f"parameter {i}: expected a shard outside the output slot, "
                              "got one that aliases it")
    return errors


@dataclass(frozen=True)
class Program:
    """Every address an all-gather into one slot touches, computed once; the copies
    compiled to the backend's form ([Note: compiled batches] in ``backends._base``).

    Attributes:
        exchanges: inter-node steps as (sends, recvs) of (peer, addr, nbytes).
        column: (offset, src, nbytes) of everything this rank's column holds,
            for a multicast write, in arrival groups: our own shards, then what
            each inter-node step delivers (one group on one node).
        cast: for a cast plan, the compiled pieces that round this rank's fp32
            shards into its rows of the slot (then the gather runs in place: no
            own copies); None otherwise.
        out_dtype: the slot's dtype (what ``cast`` rounds to).
        own: the compiled copies of this rank's shards into its own rows of the
            parameters (a push gather's; a multicast slot writes ``column`` instead).
        pushes: per node-local peer, the compiled copies into that peer's slot in
            arrival groups, as ``column``.
        copy_out: for a gather into buffers of the caller's ([Note: gathering into
            the caller's buffers]), the compiled copies of the other ranks' rows from
            the slot into them, once they arrived; None otherwise.
    """

    exchanges: tuple
    column: tuple
    cast: Any
    out_dtype: Any
    own: Any
    pushes: dict
    copy_out: Any = None


def build_program(group: Group, unit: UnitLayout, shard_ptrs: Sequence[int],
                  slot: Region, cast_to: Any = None,
                  out_ptrs: Optional[Sequence[int]] = None, alone: bool = False) -> Program:
    """Every copy of a gather into ``slot``, compiled for the group's backend. With
    ``cast_to`` (the slot's dtype), ``shard_ptrs`` are fp32 shards, rounded into this
    rank's rows of the parameters first; every copy then reads those rows (an in-place
    gather). With ``out_ptrs`` the parameters are the caller's buffers, one per
    parameter ([Note: gathering into the caller's buffers]). ``alone``: the caller runs
    nothing beside it (``Backend.compile_pieces``)."""
    be, topo = group.backend, group.topology
    me, L = topo.local_rank, topo.local_size
    base = slot.ptr(me)

    def dst(piece: Any) -> int:  # where a piece of the full parameters lives here
        if out_ptrs is None:
            return base + piece.offset
        return out_ptrs[piece.param] + piece.offset - unit.offsets[piece.param]

    cast = None
    if cast_to is not None:
        mine = _pieces(unit, (topo.rank,))
        cast = be.compile_pieces([AccumPiece(dst(pc), (shard_ptrs[pc.param],),
                                             pc.nbytes // cast_to.itemsize) for pc in mine],
                                 _dtypes.float32, cast_to, alone)
        shard_ptrs = list(shard_ptrs)
        for pc in mine:
            shard_ptrs[pc.param] = dst(pc)

    def src(piece: Any) -> int:
        return shard_ptrs[piece.param] if piece.rank == topo.rank else base + piece.offset

    exchanges = []
    for step in internode_ag_steps(topo.num_nodes, topo.node):
        col_s = tuple(topo.global_rank(m, me) for m in step.send_nodes)
        col_r = tuple(topo.global_rank(m, me) for m in step.recv_nodes)
        exchanges.append(
            ([(step.send_peer, src(pc), pc.nbytes) for pc in _pieces(unit, col_s)],
             [(step.recv_peer, base + pc.offset, pc.nbytes) for pc in _pieces(unit, col_r)]))
    column = _pieces(unit, topo.column(me))
    groups = _arrival_groups(column, topo)
    own = tuple((dst(pc), src(pc), pc.nbytes) for pc in column
                if pc.rank == topo.rank and dst(pc) != src(pc))
    pushes = {p: tuple(be.compile_copies(tuple((slot.ptr(p) + pc.offset, src(pc), pc.nbytes)
                                               for pc in group), split=True)
                       for group in groups)
              for p in range(L) if p != me}
    copy_out = None
    if out_ptrs is not None:
        others = tuple((dst(pc), base + pc.offset, pc.nbytes)
                       for pc in _pieces(unit, tuple(range(topo.world))) if pc.rank != topo.rank)
        if slot.buffer.multicast:  # which writes our slot's rows, not ``own``'s copies
            others += own
        copy_out = be.compile_copies(others, local=True) if others else None
    return Program(tuple(exchanges),
                   tuple(tuple((pc.offset, src(pc), pc.nbytes) for pc in group)
                         for group in groups),
                   cast, cast_to, be.compile_copies(own, local=True), pushes, copy_out)


def _arrival_groups(column: tuple, topo: Any) -> tuple:
    """The column's pieces in the order they reach us: our own shards, then those of
    the nodes each inter-node step delivers (every piece, in one group, on one node)."""
    if topo.num_nodes == 1:
        return (column,)
    arrivals = [(topo.node,)] + [step.recv_nodes
                                 for step in internode_ag_steps(topo.num_nodes, topo.node)]
    L = topo.local_size
    return tuple(tuple(pc for pc in column if pc.rank // L in nodes) for nodes in arrivals)


def grant(group: Group, ex: Executor, slot: Region) -> None:
    """Tell every node-local peer that our slot may take its next gather.

    A grant moves no data: it lets peers write our slot once our stream's
    earlier work (which may still read the slot) is done. It is issued only for
    a call every rank accepted: a rejected call must leave the slot to its owner,
    who may write it before the next call.
    """
    topo = group.topology
    me, L = topo.local_rank, topo.local_size
    # On COMPUTE: after its earlier work, which may still read staging that a
    # reduce-scatter kept in this slot (Slot-Reuse).
    for k in range(1, L):
        ex.signal(ex.COMPUTE, slot.flag((me + k) % L, AG_CHANNEL, FREE, me), 1)


def run(group: Group, ex: Executor, program: Program, slot: Region,
        stamps: Optional[_stamps.Stamps] = None) -> None:
    """Issue one gather: the grants, then everything else. ``stamps``: debug mode's
    ([Note: stamps])."""
    grant(group, ex, slot)
    issue(group, ex, program, slot, stamps)


def issue(group: Group, ex: Executor, program: Program, slot: Region,
          stamps: Optional[_stamps.Stamps] = None) -> None:
    """Everything after the grants (issued first, by :func:`grant`: no rank
    waits before it has granted)."""
    topo = group.topology
    me, L = topo.local_rank, topo.local_size
    use = slot.uses[AG_CHANNEL] = slot.uses[AG_CHANNEL] + 1
    peers = [(me + k) % L for k in range(1, L)]
    if program.cast:
        # On COMPUTE, after its earlier work: our rows may hold staging that a
        # reduce-scatter still reads (Slot-Reuse). Every copy that reads them
        # depends on COMPUTE from here on.
        ex.accumulate(ex.COMPUTE, program.cast, _dtypes.float32, 1.0, program.out_dtype)
    if program.exchanges:
        # The exchanges write our slot, which may still hold staging that a
        # reduce-scatter reads on COMPUTE (Slot-Reuse), and send the cast's rows.
        ex.depend(ex.NET, ex.COMPUTE)
    if slot.buffer.multicast:
        _push_multicast(ex, slot, program, me, peers, use, stamps)
    else:
        _push_per_peer(ex, slot, program, me, peers, use, stamps)
    for q in peers:
        ex.consume(ex.COMPUTE, slot.flag(me, AG_CHANNEL, ARRIVED, q), 1)
    if stamps is not None:
        stamps.snapshot(ex, ex.COMPUTE, slot, AG_CHANNEL, peers, use, f"slot {slot.id}")
    if program.copy_out is not None:  # every piece is in our slot: from there to the caller's
        if program.exchanges:
            ex.depend(ex.COMPUTE, ex.NET)
        ex.depend(me, ex.COMPUTE)
        ex.copy(me, program.copy_out)


def _start(ex: Executor, lane: int) -> None:
    # After COMPUTE's earlier work: a reduce-scatter may still be reading
    # staging that lives in this slot (Slot-Reuse).
    ex.depend(lane, ex.COMPUTE)


def _in_steps(ex: Executor, program: Program, deliver: Any) -> None:
    """``deliver(0)``: spread what we hold already (our own shards); then, after each
    inter-node step ``s``, ``deliver(s + 1)``: what that step brought, while the next
    step's exchange runs ([Note: inter-node pipeline] in ``_reduce_scatter``)."""
    deliver(0)
    for s, (sends, recvs) in enumerate(program.exchanges):
        ex.exchange(ex.NET, sends, recvs)
        deliver(s + 1)


def _push_per_peer(ex: Executor, slot: Region, program: Program, me: int, peers: list, use: int,
                   stamps: Optional[_stamps.Stamps]) -> None:
    """One copy-engine batch per peer and arrival group, each on that peer's lane; our
    own copy after the first group.

    The pushes are issued first: they are the long pole, and the own copy (a
    local copy at several times the link's rate) overlaps them.
    """
    for p in peers:
        if program.cast:
            ex.depend(p, ex.COMPUTE)
        ex.consume(p, slot.flag(me, AG_CHANNEL, FREE, p), 1)

    def deliver(group: int) -> None:
        for p in peers:
            if group:  # what the exchange just issued brings
                ex.depend(p, ex.NET)
            ex.copy(p, program.pushes[p][group])
        if group == 0 and program.own:  # none when the cast wrote our rows in place
            _start(ex, me)
            ex.copy(me, program.own)

    _in_steps(ex, program, deliver)
    for p in peers:
        if stamps is not None:
            stamps.send(ex, p, slot, AG_CHANNEL, p, use)
        ex.signal(p, slot.flag(p, AG_CHANNEL, ARRIVED, me), 1)


def _push_multicast(ex: Executor, slot: Region, program: Program, me: int, peers: list, use: int,
                    stamps: Optional[_stamps.Stamps]) -> None:
    """Each piece written once, to the multicast address: every peer's slot gets it."""
    _start(ex, me)
    for p in peers:  # every peer must have granted before the first write
        ex.consume(me, slot.flag(me, AG_CHANNEL, FREE, p), 1)

    # Across nodes the pieces from other nodes are already in our slot: they are
    # written from there to the multicast address, which also maps our slot, so
    # those bytes are rewritten in place with the same values.
    def deliver(group: int) -> None:
        if group:
            ex.depend(me, ex.NET)
        ex.multicast_copy(me, slot.buffer, program.column[group])

    _in_steps(ex, program, deliver)
    _arrive(ex, me, slot, peers, use, stamps)


def _arrive(ex: Executor, me: int, slot: Region, peers: list, use: int,
            stamps: Optional[_stamps.Stamps]) -> None:
    """After lane ``me``'s write reached every peer: stamp it (debug), signal arrival."""
    for p in peers:
        if stamps is not None:
            stamps.send(ex, me, slot, AG_CHANNEL, p, use)
        ex.signal(me, slot.flag(p, AG_CHANNEL, ARRIVED, me), 1)

