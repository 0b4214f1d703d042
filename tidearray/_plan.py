"""Persistent plans: a unit's collectives resolved once, called every step.

A training loop issues the same few hundred collectives every step, on the
same buffers. A plan is built once, collectively, for one unit and one set of
buffers: building it resolves every array, validates across ranks (every rank
raises the same :class:`TideInvalid`), computes every address and makes every
table. Calling it only signals, copies and waits; nothing is checked again
unless ``Config.debug`` (``TIDE_DEBUG=1``) is on.

[Note: plan order]
Plan calls carry no per-call agreement: every rank must call the same plans in
the same order, as FSDP does. A rank that calls another unit's plan breaks the
grant/arrive protocol (``_arena``). ``Config.debug`` catches it: each call then
agrees on the plan's build number and raises on every rank if they differ.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

from . import _all_gather as ag
from . import _dtypes, _stamps, _validate
from . import _reduce_scatter as rs
from ._arena import Region, default_region
from ._errors import TideInvalid
from ._group import Group, default_group
from ._layout import RsPlan, UnitLayout, cached_unit, plan_reduce_scatter
from ._work import finish


class Unit:
    """One FSDP unit: its parameters' full shapes and dtype, laid out for a group.

    Collective: the shapes and dtype are checked on every rank and must agree,
    so a bad unit raises :class:`TideInvalid` on every rank.

    Args:
        shapes: each parameter's full shape.
        dtype: the dtype the parameters are gathered in (and gradients reduced
            from): bf16, fp16 or fp32.
        group: the group (default: the last ``init``).
        chunk_nbytes: reduce-scatter chunk (one source's staged bytes); the
            group's ``chunk_nbytes`` if None. Fewer, larger chunks issue fewer
            calls per reduction (host time); smaller ones start the accumulate
            sooner. :func:`slot_chunk_nbytes` fits them to a Slot-Reuse slot.

    Attributes:
        layout: the slot layout (:class:`UnitLayout`): offsets and shard specs.
        nbytes: slot bytes the full parameters take.
        staging_nbytes: staging bytes a reduce-scatter of this unit needs, with
            the group's ``chunk_nbytes`` and ``depth`` (size Slot-Reuse slots by
            ``max(nbytes, staging_nbytes)``).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: Any,
                 group: Optional[Group] = None, chunk_nbytes: Optional[int] = None) -> None:
        group = group or default_group()
        errors: list[str] = []
        try:
            self.shapes = tuple(tuple(operator.index(d) for d in s) for s in shapes)
        except TypeError:  # 2.5 is no dim
            self.shapes = ()
            errors.append(f"expected shapes as a list of int tuples, got {shapes!r}")
        try:
            self.dtype = _dtypes.normalize(dtype)
        except TideInvalid as e:
            self.dtype = None
            errors.append(str(e))
        layout = None
        if not errors:
            try:
                layout = cached_unit(self.shapes, self.dtype.itemsize, group.size)
            except TideInvalid as e:
                errors.append(str(e))
        cfg = group.config
        chunk = cfg.chunk_nbytes if chunk_nbytes is None else chunk_nbytes
        if not isinstance(chunk, int) or chunk < 4096:
            errors.append(f"chunk_nbytes: expected an int >= 4096, got {chunk!r}")
        _validate.check(group, "Unit", (("shapes", self.shapes), ("dtype", str(self.dtype)),
                                        ("chunk_nbytes", chunk)), errors)
        self.group = group
        self.layout: UnitLayout = layout
        self.chunk_nbytes = chunk
        self.rs_plan: RsPlan = plan_reduce_scatter(layout, group.topology, chunk, cfg.depth)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def staging_nbytes(self) -> int:
        return self.rs_plan.staging_nbytes

    @property
    def shard_shapes(self) -> list[tuple[int, ...]]:
        """This group's padded shard shape of each parameter."""
        return [s.shard_shape for s in self.layout.specs]

    def gather_plan(self, shards: Sequence[Any], slot: Region, *,
                    cast: bool = False) -> GatherPlan:
        """A plan that gathers ``shards`` into ``slot`` (collective).

        Args:
            shards: this rank's padded shard of each parameter, in the unit's
                dtype (float32 with ``cast``); they must stay alive and in place
                while the plan lives (the plan keeps a reference), and are read
                at every call.
            slot: the symmetric slot to gather into (a :class:`SlotArena` entry).
            cast: the shards are float32 (an optimizer's masters, say): each call
                first rounds them to nearest even into this rank's rows of the
                slot, then gathers from there, so no param-dtype copy of the
                shards needs to be kept (FSDP2's mixed precision casts the same
                way, in its copy-in). The cast is one kernel on the cuda backend.
        """
        return GatherPlan(self, shards, slot, cast)

    def reduce_plan(self, grads: Sequence[Any], out: Optional[Sequence[Any]] = None, *,
                    op: str = "avg", staging: Optional[Region] = None) -> ReducePlan:
        """A plan that reduces ``grads`` into fp32 shards ``out`` (collective).

        Args:
            grads: full-shape gradients in the unit's dtype, read in place at
                every call (write each step's gradients into them).
            out: float32 arrays of each shard's padded shape; made once if None.
            op: ``"avg"`` or ``"sum"``.
            staging: where peers stage their slices: a slot whose parameters are
                dead when the plan runs (Slot-Reuse), at least
                :attr:`staging_nbytes`; the group's own staging if None.
        """
        return ReducePlan(self, grads, out, op, staging)

    def __repr__(self) -> str:
        return f"Unit({len(self.shapes)} parameters, {self.dtype}, nbytes={self.nbytes})"


def slot_chunk_nbytes(slot_nbytes: int, group: Optional[Group] = None,
                      pipeline: int = 2) -> int:
    """The largest chunk whose staging fits ``slot_nbytes`` with ``pipeline`` chunks per
    staging buffer in flight (at least the group's ``chunk_nbytes``).

    Slot-Reuse stages in a slot sized for the biggest unit; chunks that fill
    it need fewer calls per reduction. ``pipeline=2`` keeps two chunks per
    buffer, so the accumulate of one overlaps the copies of the next.
    """
    group = group or default_group()
    cfg, L = group.config, group.local_size
    fit = slot_nbytes // (cfg.depth * max(L - 1, 1) * pipeline)
    return max(cfg.chunk_nbytes, fit // 4096 * 4096)


class _Plan:
    """What both plans share: the group, a build number and the debug re-check."""

    what = "plan"

    def __init__(self, unit: Unit, signature: tuple) -> None:
        self.unit = unit
        self.group = unit.group
        # Every rank of the group builds its plans in the same order, so numbers agree
        # ([Note: plan order]); per group, as other groups' plans are built on other ranks.
        self.group.plans_built += 1
        self.number = self.group.plans_built
        self._signature = (("plan", self.number), *signature)
        self._digest = _validate.digest(self._signature)

    def _recheck(self) -> None:
        if self.group.config.debug:
            _validate.check(self.group, self.what, self._signature, (),
                            known_digest=self._digest)


class GatherPlan(_Plan):
    """TIDE-AG of one unit's shards into one slot, resolved once. Made by
    :meth:`Unit.gather_plan`; call it to gather.

    Attributes:
        params: the full parameters, views into the slot (valid after a call).
    """

    what = "all_gather plan"

    def __init__(self, unit: Unit, shards: Sequence[Any], slot: Region,
                 cast: bool = False) -> None:
        group = unit.group
        errors = [] if isinstance(slot, Region) else [
            f"slot: expected a Region (a SlotArena entry), got {type(slot).__name__}"]
        resolved = ag.resolve(group, shards, self.what, errors)
        cast_to = unit.dtype if cast else None
        call = ag.check_call(group, resolved, unit.shapes, slot, cast_to)
        want = _dtypes.float32 if cast else unit.dtype
        if call.dtype != want:
            what = "float32 shards to cast" if cast else f"shards of the unit's dtype {want}"
            _validate.check(group, "all_gather plan", (), [
                f"expected {what}, got {call.dtype}"])
        super().__init__(unit, call.signature)
        self.slot = slot
        self._program = ag.build_program(group, unit.layout, [s.ptr for s in resolved], slot,
                                         cast_to)
        self._shards = [s.array for s in resolved]  # kept alive: the program holds addresses
        self.params = slot.views(unit.layout, unit.dtype)

    def __call__(self, *, stream: Any = None, async_op: bool = False) -> Any:
        """Gather. Returns the parameters (or a :class:`Work` of them if ``async_op``).

        Args:
            stream: the stream to order against (cuda; current if None): the
                gather starts after its earlier work, and ``wait`` orders it after.
            async_op: return a :class:`Work` instead of waiting on ``stream``.
        """
        self._recheck()
        group = self.group
        ex = group.backend.executor(stream)
        stamps = _stamps.start(group, self.what, group.local_size)
        ag.grant(group, ex, self.slot)
        ag.issue(group, ex, self._program, self.slot, stamps)
        return finish(ex, self.params, stream, async_op, stamps)

    def __repr__(self) -> str:
        return f"GatherPlan({self.unit!r}, slot={self.slot.id})"


class ReducePlan(_Plan):
    """TIDE-RS of one unit's gradients into fp32 shards, resolved once. Made by
    :meth:`Unit.reduce_plan`; call it to reduce.

    Attributes:
        out: the fp32 shards it writes (padding rows zero).
        staging: the region peers stage into.
    """

    what = "reduce_scatter plan"

    def __init__(self, unit: Unit, grads: Sequence[Any], out: Optional[Sequence[Any]],
                 op: str, staging: Optional[Region]) -> None:
        group, be = unit.group, unit.group.backend
        errors = [] if staging is None or isinstance(staging, Region) else [
            f"staging: expected a Region, got {type(staging).__name__}"]
        grads_r, outs = rs.resolve(group, grads, out, self.what, errors)
        call = rs.check_call(group, grads_r, outs, op, staging, unit.chunk_nbytes)
        if call.dtype != unit.dtype or call.unit != unit.layout:
            _validate.check(group, "reduce_scatter plan", (), [
                f"expected gradients of the unit's shapes and dtype {unit.dtype}, got "
                f"{[g.shape for g in grads_r]} {call.dtype}"])
        super().__init__(unit, call.signature)
        if staging is None:
            staging = default_region(group, "staging", call.plan.staging_nbytes)
        self.staging = staging
        if outs is None:
            outs = [be.resolve(be.empty(s.shard_shape, _dtypes.float32))
                    for s in unit.layout.specs]
        # Across nodes the node partial sums and the inter-node result need
        # buffers of their own, made once, here.
        self._final, self._partial = rs.receive_buffers(group, call.plan, own=False)
        final_ptr = None if self._final is None else be.resolve(self._final).ptr
        partial_ptr = None if self._partial is None else be.resolve(self._partial).ptr
        self._call = call
        self._program = rs.build_program(group, call, [g.ptr for g in grads_r],
                                         [o.ptr for o in outs], final_ptr, partial_ptr,
                                         staging)
        self._grads = [g.array for g in grads_r]
        self.out = [o.array for o in outs]
        self.scale = 1.0 / group.size if op == "avg" else 1.0

    def __call__(self, *, stream: Any = None, async_op: bool = False) -> Any:
        """Reduce. Returns the fp32 shards (or a :class:`Work` of them if ``async_op``).

        Args:
            stream: the stream to order against (cuda; current if None): the
                reduction reads the gradients after its earlier work.
            async_op: return a :class:`Work` instead of waiting on ``stream``.
        """
        self._recheck()
        ex = self.group.backend.executor(stream)
        stamps = rs.start_stamps(self.group, self._call)
        rs.issue(self.group, ex, self._call, self._program, self.staging, self.scale, stamps)
        return finish(ex, self.out, stream, async_op, stamps)

    def __repr__(self) -> str:
        return f"ReducePlan({self.unit!r}, staging={self.staging.id})"
