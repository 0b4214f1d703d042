"""Plans: a unit's collectives resolved once, called every step; and the eager calls.

A training loop issues the same few hundred collectives every step, on the
same buffers. A plan is built once, collectively, for one unit and one set of
buffers: building it resolves every array, validates across ranks (every rank
raises the same :class:`TideInvalid`), computes every address and compiles every
batch for the backend ([Note: compiled batches] in ``backends._base``). Calling
it only signals, copies and waits; nothing is checked again unless
``Config.debug`` (``TIDE_DEBUG=1``) is on.

[Note: one pipeline]
Every collective goes one way: validate (``_all_gather.validate``,
``_reduce_scatter.validate``: one agreement across ranks), build the program
(every address, each batch compiled), issue it (``run``). A plan does the first
two once. The eager :func:`all_gather` and :func:`reduce_scatter` build the same
plans and keep the latest of them in the group (``Group.eager_plans``), by an explicit
key: the call's arguments and its arrays' addresses, shapes, dtypes and
contiguity (``Backend.array_key``, read straight from the backend's own arrays;
DLPack producers are resolved first). A call that finds its plan agrees with
the other ranks on the plan's signature (one agreement, as a build's
validation is), so ranks whose caches differ still pair their agreements.
Eager plans keep no references to the arrays: a plan's key is every address it
touches, so arrays freed and remade at the same addresses are the same call.

[Note: graph plans]
A plan made with ``graph=True`` runs once at build (outside any capture: its
tables are uploaded, its kernels compiled), then captures what one call
issues with ``Backend.capture``: a CUDA graph on the cuda backend
(``backends/cuda/graphs.py``), a recording replayed primitive by primitive on
the host backend. Every call then replays it. Its flags take the same values
on every call ([Note: replay-safe flags] in ``_arena``), so a replay is a call;
eager calls and other plans use the same protocol and may come between
replays. In debug mode each replay poisons and checks the stamps it was
captured with.

[Note: graph order]
Eager calls on the same lanes run in issue order; a graph's replay runs in its
stream's order instead, beside the lanes. So that a replay never overtakes
the collective before it on the same slot or staging (a grant landing before
the last call's was consumed would be lost), each region remembers its last
collective (``Region.last``): a replay waits on it unless it was this graph
(launches of one graph are ordered), and an eager call waits on it when it
was a graph. Only a switch costs a stream wait, and on cuda only a switch of
streams: a replay launched on the stream the last one's completion was recorded
on (launches beside the caller's stream share one lane) is in its order already.

[Note: plan order]
Plan calls carry no per-call agreement: every rank must call the same plans in
the same order, as FSDP does. A rank that calls another unit's plan breaks the
grant/arrive protocol (``_arena``). ``Config.debug`` catches it: each call then
agrees on the plan's build number and raises on every rank if they differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import _all_gather as ag
from . import _dtypes, _stamps, _validate
from . import _reduce_scatter as rs
from ._arena import Region, default_region, order_after, region_check
from ._cache import BoundedCache
from ._errors import TideInvalid
from ._group import Group, default_group
from ._layout import UnitLayout, cached_unit, parse_shapes
from ._schedule import RsPlan, plan_reduce_scatter
from ._work import Work, finish

if TYPE_CHECKING:
    from .backends import Executor

#: Programs an eager reduction without ``out=`` keeps, one per receive buffer: each
#: call returns new arrays, and the memory pool often hands back the same address.
FRESH_PROGRAMS = 8
#: What a graph plan counts in its call's agreement (``eager_plan``): more than any finds.
GRAPHED = 1 << 30


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
        staging_nbytes: staging bytes a reduce-scatter of this unit needs (size
            Slot-Reuse slots by ``max(nbytes, staging_nbytes)``).
        tag: ``(name, value)`` pairs its plans' agreement includes (a runtime sets
            ``(("unit", index),)``: units of one shape are otherwise alike).
    """

    tag: tuple = ()

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: Any,
                 group: Optional[Group] = None, chunk_nbytes: Optional[int] = None) -> None:
        group = group or default_group()
        parsed, errors = parse_shapes(shapes)
        self.shapes = () if parsed is None else parsed
        self.dtype = _dtypes.normalize(dtype) if _dtypes.is_supported(dtype) else None
        if self.dtype is None:
            errors.append(f"dtype: expected one of {sorted(_dtypes.SUPPORTED)}, got {dtype!r}")
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

    def gather_plan(self, shards: Sequence[Any], slot: Region, *, cast: bool = False,
                    graph: bool = False, out: Optional[Sequence[Any]] = None,
                    alone: bool = False) -> GatherPlan:
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
            graph: capture one call once and replay it at every call (one graph
                launch of host time on cuda); building runs the gather once
                ([Note: graph plans]).
            out: your buffers for the full parameters (each its shape and the unit's
                dtype, kept alive while the plan lives), to gather into ([Note:
                gathering into the caller's buffers] in ``_all_gather``).
            alone: nothing of yours runs beside the collective (your stream waits for
                it, as ``tidearray.jax``'s callbacks on XLA's stream do): its kernels
                may take the whole device (cuda: the accumulate, or the cast, on every
                SM instead of half of them, which leave room for compute beside it).
        """
        return GatherPlan(self.group, shards, self.shapes, slot,
                          cast_to=self.dtype if cast else None,
                          expect_dtype=_dtypes.float32 if cast else self.dtype, graph=graph,
                          tag=self.tag, out=out, alone=alone)

    def reduce_plan(self, grads: Sequence[Any], out: Optional[Sequence[Any]] = None, *,
                    op: str = "avg", staging: Optional[Region] = None,
                    graph: bool = False, alone: bool = False) -> ReducePlan:
        """A plan that reduces ``grads`` into fp32 shards ``out`` (collective).

        Args:
            grads: full-shape gradients in the unit's dtype, read in place at
                every call (write each step's gradients into them).
            out: float32 arrays of each shard's padded shape; made once if None.
            op: ``"avg"`` or ``"sum"``.
            staging: where peers stage their slices: a slot whose parameters are
                dead when the plan runs (Slot-Reuse), at least
                :attr:`staging_nbytes`; the group's own staging if None.
            graph: capture one call once and replay it at every call; building
                runs the reduction once ([Note: graph plans]).
            alone: as :meth:`gather_plan`'s (its accumulate on the whole device).
        """
        return ReducePlan(self.group, grads, out, op, staging, chunk_nbytes=self.chunk_nbytes,
                          expect=(self.layout, self.dtype), graph=graph, tag=self.tag,
                          alone=alone)

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
    per_chunk = cfg.depth * max(L - 1, 1)  # node-local staging, in chunks
    if group.topology.num_nodes > 1:
        # fp32 partial sums (depth buffers) and one receive buffer, each up to one
        # chunk of fp32 per chunk of (at narrowest, 2-byte) gradients.
        per_chunk += 2 * (cfg.depth + 1)
    fit = slot_nbytes // (per_chunk * pipeline)
    return max(cfg.chunk_nbytes, fit // 4096 * 4096)


class _Plan:
    """What both plans share: group, agreed signature, build number and debug re-check."""

    what = "plan"
    _graph_of: tuple[str, str]  # the attributes a graph's replay orders after and returns

    def __init__(self, group: Group, signature: tuple, digest: int, eager: bool) -> None:
        self.group = group
        self.eager = eager
        self.graph: Any = None  # the captured call ([Note: graph plans])
        self._graph_stamps: Optional[_stamps.Stamps] = None
        self.number: Optional[int] = None
        if not eager:
            # Every rank of the group builds its plans in the same order, so numbers
            # agree ([Note: plan order]); per group, as other groups' plans are built
            # on other ranks. Eager plans agree on every call instead.
            group.plans_built += 1
            self.number = group.plans_built
            signature = (("plan", self.number), *signature)
            digest = _validate.digest(signature)
        self._signature, self._digest = signature, digest
        self.found = 0  # an eager plan: the calls that found it in its cache so far

    def agree(self, count: int = 0) -> int:
        """One agreement across ranks on this plan's signature (raises on every rank if
        a rank called something else); returns the least ``count`` over the ranks."""
        return _validate.check(self.group, self.what, self._signature, (),
                               known_digest=self._digest, count=count)

    def __call__(self, *, stream: Any = None, async_op: bool = False) -> Any:
        """Run the collective. Returns its result (or a :class:`Work` of it if ``async_op``).

        Args:
            stream: the stream to order against (cuda; current if None): the
                collective starts after its earlier work, and ``wait`` orders it after.
            async_op: return a :class:`Work` instead of waiting on ``stream``.
        """
        if self.group.config.debug:
            self.agree()
        graph = self.graph
        if graph is None or self.group.backend.capturing(stream):
            return self._run(stream, async_op)  # inside a capture: its primitives, captured
        # A graph plan's call is one launch ([Note: graph plans]), here rather than in a
        # method of its own (a front end calls a plan per unit, several times per step):
        # on ``stream``, or beside it for ``async_op`` (as eager lanes run).
        region, stamps = self._graph_region, self._graph_stamps
        last = region.last  # [Note: graph order]
        after = None if last is None or last[0] is graph else last[1]
        if stamps is not None:
            stamps.poison()
        completion = graph.launch(stream, after=after, beside=async_op)
        region.last = (graph, completion)
        if stamps is not None:
            stamps.check()
        return Work(completion, self._graph_result) if async_op else self._graph_result

    def _run(self, stream: Any, async_op: bool) -> Any:
        raise NotImplementedError

    def _issue(self, ex: Executor, stamps: Optional[_stamps.Stamps]) -> Any:
        """Issue one call on ``ex``; returns what the issued work reads (its program)."""
        raise NotImplementedError

    def _stamps(self) -> Optional[_stamps.Stamps]:
        raise NotImplementedError

    def _eager_stamps(self, ex: Executor) -> Optional[_stamps.Stamps]:
        """A call's debug stamps, refused inside the user's stream capture: their check
        waits on the host after the call, which a capture cannot (a graph plan's
        replays keep them: [Note: graph plans])."""
        if ex.capture and self.group.config.debug:
            raise TideInvalid(f"{self.what}: expected no debug mode (TIDE_DEBUG=1) inside a "
                              "stream capture, got one: its stamps are checked on the host "
                              "after each call; capture with debug off, or use a graph plan "
                              "(graph=True), whose replays check them")
        return self._stamps()

    def to_graph(self, ran: bool = False, stream: Any = None) -> None:
        """Capture one call ([Note: graph plans]), after a run unless it ``ran`` on ``stream``."""
        if not ran:
            self._run(None, False)  # Backend.capture waits for it before capturing
        stamps = self._graph_stamps = self._stamps()
        self.graph = self.group.backend.capture(lambda ex: self._issue(ex, stamps), self.what,
                                                ran=ran, stream=stream)
        self._graph_region, self._graph_result = (getattr(self, a) for a in self._graph_of)


class GatherPlan(_Plan):
    """TIDE-AG of one unit's shards into one slot, resolved once. Made by
    :meth:`Unit.gather_plan`; call it to gather. ``tag``: more ``(name, value)`` pairs the
    ranks agree on (a front end's eager plans: which unit each call is for).

    ``out``: the caller's buffers to gather into (:meth:`Unit.gather_plan`).

    Attributes:
        params: the full parameters (valid after a call): views into the slot, or
            ``out``'s arrays.
    """

    what = "all_gather plan"
    _graph_of = ("slot", "params")

    def __init__(self, group: Group, shards: Sequence[Any], shapes: Any,
                 slot: Optional[Region], *, cast_to: Any = None, expect_dtype: Any = None,
                 eager: bool = False, graph: bool = False, tag: tuple = (),
                 out: Optional[Sequence[Any]] = None, alone: bool = False) -> None:
        if eager:
            self.what = "all_gather"
        _validate.check_open(group, self.what)
        errors = region_check(group, slot, "slot", optional=eager)
        g = ag.validate(group, shards, shapes, slot, cast_to, expect_dtype, self.what, errors,
                        tag, out)
        super().__init__(group, g.signature, g.digest, eager)
        self.layout, self.dtype, self.slot = g.layout, g.out_dtype, slot
        self._cast_to, self._shard_ptrs, self._out_ptrs = cast_to, g.shard_ptrs, g.out_ptrs
        self._out, self._alone = g.out_arrays, alone
        # A plan reads its shards at every call: it keeps them alive. An eager plan
        # is found by their addresses instead ([Note: one pipeline]).
        self._shards = None if eager else g.arrays
        self._programs = BoundedCache(4)  # per slot: the group's own slots take turns
        if slot is not None:
            self._program(slot)
        self.params = self._out or (slot.views(self.layout, self.dtype) if slot else None)
        if graph:
            self.to_graph()

    def _program(self, slot: Region) -> ag.Program:
        program = self._programs.get(slot.id)
        if program is None:
            program = self._programs.put(slot.id, ag.build_program(
                self.group, self.layout, self._shard_ptrs, slot, self._cast_to,
                self._out_ptrs, self._alone))
        return program

    def _run(self, stream: Any, async_op: bool) -> Any:
        group = self.group
        slot = self.slot
        if slot is None:
            slot = default_region(group, "slot", self.layout.nbytes, ring=2)
        order_after(slot, stream)
        ex = group.backend.executor(stream)
        stamps = self._eager_stamps(ex)
        self._issue(ex, stamps, slot)
        params = self.params if self.params is not None else slot.views(self.layout, self.dtype)
        return finish(ex, params, stream, async_op, stamps, slot)

    def _stamps(self) -> Optional[_stamps.Stamps]:
        return _stamps.start(self.group, self.what, self.group.local_size)

    def _issue(self, ex: Executor, stamps: Optional[_stamps.Stamps],
               slot: Optional[Region] = None) -> ag.Program:
        slot = slot or self.slot
        program = self._program(slot)
        # Grants only after the ranks agreed: a grant lets peers write our slot, and
        # a call that some rank rejects must leave every slot to its owner.
        ag.run(self.group, ex, program, slot, stamps)
        return program

    def __repr__(self) -> str:
        return (f"GatherPlan({len(self.layout.specs)} parameters, {self.dtype}, "
                f"slot={None if self.slot is None else self.slot.id})")


class ReducePlan(_Plan):
    """TIDE-RS of one unit's gradients into fp32 shards, resolved once. Made by
    :meth:`Unit.reduce_plan`; call it to reduce.

    Attributes:
        out: the fp32 shards it writes (padding rows zero).
        staging: the region peers stage into.
    """

    what = "reduce_scatter plan"
    _graph_of = ("staging", "out")

    def __init__(self, group: Group, grads: Sequence[Any], out: Optional[Sequence[Any]],
                 op: str, staging: Optional[Region], *, chunk_nbytes: Optional[int] = None,
                 expect: Optional[tuple] = None, eager: bool = False,
                 graph: bool = False, tag: tuple = (), alone: bool = False) -> None:
        if eager:
            self.what = "reduce_scatter"
        be = group.backend
        _validate.check_open(group, self.what)
        errors = region_check(group, staging, "staging", optional=True)
        red = rs.validate(group, grads, out, op, staging, chunk_nbytes, expect, self.what,
                          errors, tag)
        super().__init__(group, red.signature, red.digest, eager)
        self._red, self.staging, self._alone = red, staging, alone
        self.scale = 1.0 / group.size if op == "avg" else 1.0
        self._grads = None if eager else red.grads  # see GatherPlan
        # Without out=, an eager call returns new arrays each time: views of a receive
        # buffer of its own, so its program is found by that buffer's address.
        self._fresh = eager and out is None
        self.out = None
        out_ptrs = red.out_ptrs
        if out is None and not self._fresh:
            self.out = [be.empty(s.shard_shape, _dtypes.float32) for s in red.layout.specs]
            out_ptrs = tuple(be.resolve(o).ptr for o in self.out)
        elif out is not None:
            self.out = red.outs
        self._out_ptrs = out_ptrs
        self._programs = BoundedCache(FRESH_PROGRAMS if self._fresh else 4)
        if not eager:
            if staging is None:
                self.staging = default_region(group, "staging", red.plan.staging_nbytes)
            self._program(self.staging, None)
        if graph:
            self.to_graph()

    def _program(self, staging: Region, final_ptr: Optional[int]) -> rs.Program:
        key = (staging.id, final_ptr)
        program = self._programs.get(key)
        if program is None:
            program = self._programs.put(key, rs.build_program(
                self.group, self._red, None if self._fresh else self._out_ptrs, final_ptr,
                staging, self._alone))
        return program

    def _run(self, stream: Any, async_op: bool) -> Any:
        group, red = self.group, self._red
        plan = red.plan
        staging = self.staging
        if staging is None:
            staging = default_region(group, "staging", plan.staging_nbytes)
        final_ptr, results = None, self.out
        if self._fresh:
            be = group.backend
            final = be.empty((plan.block_numel,), _dtypes.float32)
            final_ptr = be.resolve(final).ptr
            results = [final[o:o + s.shard_numel].reshape(s.shard_shape)
                       for o, s in zip(plan.out_offsets, red.layout.specs)]
        order_after(staging, stream)
        ex = group.backend.executor(stream)
        stamps = self._eager_stamps(ex)
        self._issue(ex, stamps, staging, final_ptr)
        return finish(ex, results, stream, async_op, stamps, staging)

    def _stamps(self) -> Optional[_stamps.Stamps]:
        return rs.start_stamps(self.group, self._red.plan)

    def _issue(self, ex: Executor, stamps: Optional[_stamps.Stamps],
               staging: Optional[Region] = None, final_ptr: Optional[int] = None) -> rs.Program:
        staging = staging or self.staging
        program = self._program(staging, final_ptr)
        rs.run(self.group, ex, self._red.plan, program, staging, self.scale, stamps)
        return program

    def __repr__(self) -> str:
        return (f"ReducePlan({len(self._red.layout.specs)} parameters, {self._red.dtype}, "
                f"staging={None if self.staging is None else self.staging.id})")


def _shapes_key(shapes: Any) -> Optional[tuple]:
    """``shapes`` as int tuples for a key (``_layout.parse_shapes``), or None: validation
    will say why."""
    return parse_shapes(shapes)[0]


def _arrays_key(group: Group, arrays: Any, what: str) -> Optional[tuple]:
    """``Backend.array_key`` of ``arrays``, resolving what is not the backend's own
    (None where they do not resolve: validation will say why)."""
    be = group.backend
    key = be.array_key(arrays)
    if key is None:
        resolved, errors = _validate.resolve_all(be, arrays, what)
        if errors:
            return None
        key = tuple((r.ptr, r.shape, r.dtype, r.contiguous) for r in resolved)
    return key


def eager_plan(group: Group, key: Optional[tuple], build: Any,
               cache: Optional[BoundedCache] = None, graph_after: Optional[int] = None,
               stream: Any = None) -> Any:
    """The eager plan for ``key`` in ``cache`` (the group's by default), or one built now
    ([Note: one pipeline]); a front end's per-unit calls keep a cache of their own.
    ``graph_after``: it becomes a graph plan where every rank has found it that often or
    has a graph of it (each call's agreement carries the count), without a wait: it ran on
    ``stream`` before ([Note: capture inside a step] in ``backends.cuda.graphs``). In debug
    mode all ranks replay or none does: a replay's stamps are its capture's."""
    cache = group.eager_plans if cache is None else cache
    plan = None if key is None else cache.get(key)
    if plan is None:
        plan = build()
        if key is not None:
            cache.put(key, plan)
        return plan
    plan.found += 1
    fewest = plan.agree(plan.found if plan.graph is None else GRAPHED)
    if plan.graph is not None and fewest < GRAPHED and group.config.debug:
        plan.graph = None  # another rank runs it eager: this one too, or captures again
    if plan.graph is None and graph_after is not None and fewest >= graph_after:
        plan.to_graph(ran=True, stream=stream)
    return plan


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

    The call builds (or finds) the plan :meth:`Unit.gather_plan` would, and runs it
    ([Note: one pipeline]).
    """
    group = group or default_group()
    key = _shapes_key(shapes) if slot is None or isinstance(slot, Region) else None
    if key is not None:
        arrays = _arrays_key(group, shards, "shard")
        key = None if arrays is None else (
            "all_gather", key, None if slot is None else slot.id, arrays)
    plan = eager_plan(group, key, lambda: GatherPlan(group, shards, shapes, slot, eager=True))
    return plan._run(stream, async_op)


def reduce_scatter(grads: Sequence[Any], *, op: str = "avg", out: Optional[Sequence[Any]] = None,
                   group: Optional[Group] = None, staging: Optional[Region] = None,
                   stream: Any = None, async_op: bool = False) -> Any:
    """Reduce per-parameter gradients over the group into this rank's fp32 shards.

    Args:
        grads: full-shape gradients, one dtype (bf16, fp16 or fp32), contiguous,
            the same shapes on every rank. Read in place; never packed.
        op: ``"avg"`` (sum / world size, the scale fused in) or ``"sum"``.
        out: optional float32 arrays of each shard's padded shape
            ``(ceil(d0/W), *rest)``; new arrays each call if None (then a repeated
            call finds its program only when the memory pool hands back the same
            address: pass ``out=``, or use a plan, where that matters).
        group: the group (default: the last ``init``).
        staging: a slot to stage in (Slot-Reuse); by default the group's own
            staging, ``depth * (local_size-1) * chunk_nbytes`` bytes.
        stream: the stream to order against (cuda backend; current if None).
        async_op: return a :class:`Work` instead of the result.

    Returns:
        fp32 shards, padding rows zero. Sources are summed in a fixed order, so
        results are bitwise reproducible for the same inputs and topology.

    Raises:
        TideInvalid: on every rank, before any transfer, if any rank's input is bad.

    The call builds (or finds) the plan :meth:`Unit.reduce_plan` would, and runs it
    ([Note: one pipeline]).
    """
    group = group or default_group()
    key = None
    if isinstance(op, str) and (staging is None or isinstance(staging, Region)):
        key = _arrays_key(group, grads, "gradient")
    outs = None
    if key is not None and out is not None:
        outs = _arrays_key(group, out, "output")
        key = None if outs is None else key
    if key is not None:
        key = ("reduce_scatter", op, None if staging is None else staging.id, key, outs)
    plan = eager_plan(group, key, lambda: ReducePlan(group, grads, out, op, staging, eager=True))
    return plan._run(stream, async_op)
