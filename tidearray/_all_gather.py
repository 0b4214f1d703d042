"""TIDE-AG: each rank's shard goes straight into every peer's parameter storage.

Node-local peers receive by copy-engine pushes into their slot at the byte
offset the shard occupies in the full parameter; no flat buffer, no copy-out.
Across nodes, ranks with the same local rank first exchange shards by
recursive doubling (pairwise for a node count that is not a power of two),
straight into their slots; then each rank pushes everything its column holds
to its node-local peers.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from . import _dtypes, _validate
from ._arena import AG_CHANNEL, ARRIVED, FREE, Region, default_region
from ._errors import TideInvalid
from ._group import Group, default_group
from ._layout import UnitLayout, ag_pieces, internode_ag_steps, plan_unit
from ._work import Work


@functools.lru_cache(maxsize=1024)
def _pieces(unit: UnitLayout, ranks: tuple[int, ...]) -> tuple:
    return ag_pieces(unit, ranks)


@functools.lru_cache(maxsize=512)
def _unit(shapes: tuple, itemsize: int, world: int) -> UnitLayout:
    return plan_unit(shapes, itemsize, world)


def unit_nbytes(shapes: Sequence[Sequence[int]], dtype: Any, group: Optional[Group] = None,
                world: Optional[int] = None) -> int:
    """Slot bytes that the full parameters of ``shapes`` need (with alignment)."""
    world = world or (group or default_group()).size
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    return _unit(shapes, _dtypes.normalize(dtype).itemsize, world).nbytes


def _check(group: Group, shards: list, shapes: tuple, slot: Optional[Region]) -> UnitLayout:
    errors = []
    if len(shards) != len(shapes):
        errors.append(f"expected one shard per shape ({len(shapes)}), got {len(shards)}")
    dtypes = [s.dtype for s in shards]
    dtype = dtypes[0] if dtypes else _dtypes.bfloat16
    for i, s in enumerate(shards):
        if not _dtypes.is_supported(s.dtype):
            errors.append(f"parameter {i}: expected dtype in {sorted(_dtypes.SUPPORTED)}, "
                          f"got {s.dtype}")
        elif s.dtype != dtype:
            errors.append(f"parameter {i}: expected the unit's dtype {dtype}, got {s.dtype}")
        if not s.contiguous:
            errors.append(f"parameter {i}: expected a C-contiguous shard, got strides of a "
                          f"non-contiguous view of shape {s.shape}")
    try:
        unit = _unit(shapes, dtype.itemsize, group.size)
    except TideInvalid as e:
        errors.append(str(e))
        unit = None
    if unit is not None and not errors:
        for i, (s, spec) in enumerate(zip(shards, unit.specs)):
            if s.nbytes != spec.shard_numel * dtype.itemsize:
                errors.append(f"parameter {i}: expected a shard of shape {spec.shard_shape} "
                              f"for full shape {spec.shape} on {group.size} ranks, got {s.shape}")
        if slot is not None:
            if slot.nbytes < unit.nbytes:
                errors.append(f"expected a slot of at least {unit.nbytes} bytes, got "
                              f"{slot.nbytes}")
            for i, s in enumerate(shards):
                if slot.contains(s.ptr, s.nbytes):
                    errors.append(f"parameter {i}: expected a shard outside the output slot, "
                                  "got one that aliases it")
    signature = (("shapes", shapes), ("dtype", str(dtype)),
                 ("slot", None if slot is None else slot.id))
    _validate.check(group, "all_gather", signature, errors)
    return unit


def all_gather(shards: Sequence[Any], shapes: Sequence[Sequence[int]], *,
               group: Optional[Group] = None, slot: Optional[Region] = None,
               stream: Any = None, async_op: bool = False) -> Any:
    """Gather each parameter's shards into its full storage on every rank.

    Args:
        shards: this rank's padded shard of each parameter, shape
            ``(ceil(d0/W), *rest)``, one dtype (bf16, fp16 or fp32), contiguous.
            Arrays of the backend, or any DLPack producer on the same device.
        shapes: each parameter's full shape, the same on every rank.
        group: the group (default: the last ``init``).
        slot: the symmetric slot to gather into (a :class:`SlotArena` entry); by
            default one of the group's own two slots, in turn.
        stream: the stream to order against (cuda backend; current if None).
        async_op: return a :class:`Work` instead of the result.

    Returns:
        The full parameters, as arrays that are views into the slot.

    Raises:
        TideInvalid: on every rank, before any transfer, if any rank's input is bad.

    See Also:
        ``cudaMemcpyBatchAsync``, ``cuStreamWriteValue32``, ``cuStreamWaitValue32``.
    """
    group = group or default_group()
    be = group.backend
    shards, errors = _validate.resolve_all(be, shards, "shard")
    if errors:
        _validate.check(group, "all_gather", (("inputs", "unresolvable"),), errors)
    try:
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    except TypeError:
        _validate.check(group, "all_gather", (("shapes", repr(shapes)),),
                        [f"expected shapes as a list of int tuples, got {shapes!r}"])
    unit = _check(group, shards, shapes, slot)
    dtype = shards[0].dtype if shards else _dtypes.bfloat16
    if slot is None:
        slot = default_region(group, "slot", unit.nbytes, ring=2)
    ex = be.executor(stream)
    _issue(group, ex, unit, [s.ptr for s in shards], slot)
    outs = slot.views(unit, dtype)
    work = Work(ex.finish(), outs)
    return work if async_op else work.wait(stream)


def _issue(group: Group, ex: Any, unit: UnitLayout, shard_ptrs: list[int], slot: Region) -> None:
    topo = group.topology
    me, L = topo.local_rank, topo.local_size
    use = slot.uses[AG_CHANNEL] = slot.uses[AG_CHANNEL] + 1
    base = slot.ptr(me)
    peers = [(me + k) % L for k in range(1, L)]
    for p in peers:  # grants first: no rank waits before it has granted
        ex.signal(ex.COMPUTE, slot.flag(p, AG_CHANNEL, FREE, me), use)

    def src(piece: Any) -> int:
        return shard_ptrs[piece.param] if piece.rank == topo.rank else base + piece.offset

    for step in internode_ag_steps(topo.num_nodes, topo.node):
        col_s = tuple(topo.global_rank(m, me) for m in step.send_nodes)
        col_r = tuple(topo.global_rank(m, me) for m in step.recv_nodes)
        ex.exchange(ex.NET,
                    [(step.send_peer, src(pc), pc.nbytes) for pc in _pieces(unit, col_s)],
                    [(step.recv_peer, base + pc.offset, pc.nbytes)
                     for pc in _pieces(unit, col_r)])
    column = _pieces(unit, topo.column(me))
    if slot.buffer.multicast:
        _multicast_push(ex, slot, column, src, me, peers, use, topo.num_nodes > 1)
    else:
        _unicast_push(ex, slot, column, src, me, peers, use, topo)
    for q in peers:
        ex.wait(ex.COMPUTE, slot.flag(me, AG_CHANNEL, ARRIVED, q), use)


def _unicast_push(ex: Any, slot: Region, column: tuple, src: Any, me: int, peers: list,
                  use: int, topo: Any) -> None:
    """One copy-engine batch per peer, on that peer's lane."""
    own = [pc for pc in column if pc.rank == topo.rank]
    for p in [me] + peers:
        if topo.num_nodes > 1:
            ex.depend(p, ex.NET)
        dst = slot.ptr(p)
        if p == me:
            # After COMPUTE's earlier work: a reduce-scatter may still be reading
            # staging that lives in this slot (Slot-Reuse).
            ex.depend(p, ex.COMPUTE)
            ex.copy(p, [(dst + pc.offset, src(pc), pc.nbytes) for pc in own])
            continue
        ex.wait(p, slot.flag(me, AG_CHANNEL, FREE, p), use)
        ex.copy(p, [(dst + pc.offset, src(pc), pc.nbytes) for pc in column])
        ex.signal(p, slot.flag(p, AG_CHANNEL, ARRIVED, me), use)


def _multicast_push(ex: Any, slot: Region, column: tuple, src: Any, me: int, peers: list,
                    use: int, after_net: bool) -> None:
    """Each piece written once, to the multicast address: every peer's slot gets it."""
    ex.depend(me, ex.COMPUTE)  # see _unicast_push
    if after_net:
        ex.depend(me, ex.NET)
    for p in peers:  # every peer must have granted before the single write
        ex.wait(me, slot.flag(me, AG_CHANNEL, FREE, p), use)
    ex.multicast_copy(me, slot.buffer, [(pc.offset, src(pc), pc.nbytes) for pc in column])
    for p in peers:
        ex.signal(me, slot.flag(p, AG_CHANNEL, ARRIVED, me), use)
