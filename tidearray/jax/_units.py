"""Sharded units for a jitted JAX step: TIDE-AG forward, TIDE-RS backward, on XLA's stream.

:func:`shard_units` cuts each unit (a pytree of parameters) into this rank's fp32
dim-0 shards, FSDP2's rule. Inside the user's ``jax.jit``, :meth:`ShardedUnits.apply`
runs one unit: a ``buffer_callback`` gathers its shards (rounded to the compute dtype
on the way: [Note: the gather's own rows] in ``_runners``) with a TIDE-AG plan into
XLA's output, the peers' rows through a slot; the unit's function runs on those
parameters; in backward, the unit's parameter gradients (compute dtype) are reduced
by :func:`tidearray.reduce_scatter`, read where XLA put them, into XLA's fp32 output
buffers: the shard gradients.

[Note: collective order in a jitted step]
Every rank must issue the same collectives in the same order, and on the host
backend a collective blocks its thread in MPI until the peers join: two collectives
that XLA may run in either order (or on two threads at once) can deadlock ranks.
So the callbacks are chained by data, never left to the scheduler:

* the gather of unit ``i`` takes the unit's input ``x`` as an (unread) operand, and
  ``x`` depends on unit ``i-1``'s parameters, hence on its gather;
* in backward, unit ``i``'s re-gather and reduce-scatter take the unit's forward
  output ``y`` (a residual: it is unit ``i+1``'s input, kept anyway) and the output
  cotangent; the reduce-scatter of unit ``i+1`` passes that unit's input cotangent
  through itself (``input_output_aliases``: the same buffer, no copy), so the
  cotangent exists only after unit ``i+1``'s reduce-scatter has run.

``y`` matters: a cotangent may be a constant (the last unit's, when the loss is
linear in it), and then only ``y`` keeps the last unit's backward after every
forward gather (``test_collective_order`` in ``tests/jax/mpi/test_jax_jit.py`` saw
XLA run that re-gather between the first two forward gathers without it). The
chain orders all of a step's collectives totally: forward gathers in unit order,
then per unit in reverse order its re-gather and its reduce-scatter. Units must
therefore be applied as a chain (each unit's input computed from the previous
unit's output), as the layers of a network are. The same chain keeps XLA from
hoisting gathers: a gather cannot start before its input exists.

[Note: memory of a unit]
A unit's full parameters are XLA buffers made by its gather. With
``reshard_after_forward`` (the default) the backward does not keep them: it saves
the unit's shards and input, re-gathers, and runs the unit's function again to take
its ``jax.vjp`` (activation checkpointing per unit: one more forward of the unit's
compute, and none of its activations kept). Without it, the pullback of the
forward is kept, parameters included, until the unit's backward: no second gather or
forward, but every unit's parameters are live at the end of the forward.

[Note: the slot]
One slot of symmetric memory serves every gather and every reduce-scatter's staging
(Slot-Reuse): each collective runs inside one callback on XLA's stream, and the
gather's copy of the peers' rows out of the slot is joined into that stream before
the callback returns, so the next collective's writes into the slot are ordered after it
(:func:`tidearray.all_gather`'s "Reusing a slot"). The callbacks call a runner
(``_runners``), in place on XLA's buffers or staged through plans.

[Note: stacked units under lax.scan]
A stacked unit (``shard_units(..., stacked=...)``) holds ``L`` layers of one
structure, its leaves ``(L, d0, *rest)``; each layer is sharded as a unit of its
own, and the layers' shards are stacked again, ``(L, ceil(d0/W), *rest)``. Every
layer has the same shapes, so one :class:`_UnitCollectives`, with one plan per
collective, serves them all: a ``lax.scan`` over the stacked shards hands
:meth:`ShardedUnits.apply` one layer's slice per iteration, and the callbacks
never need to know which layer it is (the layer index is the scan's, traced;
reading it in a callback would cost a device-to-host copy on GPUs). The scan's
body is one XLA computation whose buffers are assigned once, so its gathers and
reductions find the same addresses, hence the same in-place plans, at every
iteration. The chain of [Note: collective order in a jitted step] holds
through the loop: iteration ``l`` takes the carry that iteration ``l-1`` made,
and the transposed scan (backward, layers in reverse) takes the carry cotangent
that the previous iteration's reduce-scatter passed through. The scan's own
machinery adds what the unrolled loop has anyway: the layers' inputs and outputs
are stacked as residuals, and the shard gradients stacked as the scan's outputs.
The callbacks may sit inside ``lax.scan``, ``custom_vjp`` and ``jax.checkpoint``
because they carry no effect: without ``has_side_effect`` a ``buffer_callback``'s
abstract evaluation returns ``core.no_effects`` (jax 0.10.2,
``jax/_src/buffer_callback.py``). With it, its effect is allowed in control flow
but neither in ``custom_vjp`` nor under remat (it is not added to
``custom_derivatives_allowed_effects`` or ``remat_allowed_effects``), so the
collectives keep to data dependences for their order, here as everywhere.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import _dtypes, _validate
from .._arena import SlotArena
from .._errors import TideInvalid
from .._group import Group, default_group
from .._plan import Unit
from .._shard import shard
from ._buffers import HostClock, XlaBuffers
from ._full import full_params
from ._runners import InPlace, Staged, cast_after, vmap_refused

_COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class _UnitCollectives:
    """One unit's gather and reduce-scatter as ``buffer_callback`` s (see the Notes)."""

    def __init__(self, owner: ShardedUnits, index: int, unit: Unit, treedef: Any,
                 layers: Optional[int]) -> None:
        self.owner, self.index, self.unit, self.treedef = owner, index, unit, treedef
        self.layers = layers  # None: not stacked ([Note: stacked units under lax.scan])
        self.shapes = [tuple(s) for s in unit.shapes]
        self.full_types = [jax.ShapeDtypeStruct(s, owner.compute_dtype) for s in self.shapes]
        self.shard_types = [jax.ShapeDtypeStruct(s, jnp.float32) for s in unit.shard_shapes]
        # Whether XLA may record the callbacks into its command buffers: not a stacked
        # unit's, run inside lax.scan's loop, whose recorded graph XLA then failed to
        # update on one H200 at 3 and 4 ranks (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "Failed
        # to set CUDA graph child node params"); a stacked unit's callbacks run as plain
        # callbacks between XLA's command buffers instead ([Note: stacked units under
        # lax.scan]).
        self.recorded = owner.command_buffer and layers is None

    def gather(self, shards: Sequence[Any], after: Sequence[Any]) -> Any:
        """The unit's full parameters (a pytree), in the compute dtype; the callback runs
        after ``after`` exists ([Note: collective order in a jitted step])."""
        n = len(self.shapes)
        sends = [s.astype(jnp.float32) for s in shards]  # [Note: the gather's own rows] in _runners
        if self.owner.in_xla:  # [Note: one rank] in ``_runners``
            params = cast_after(np.dtype(self.owner.compute_dtype).name)(sends, list(after))
            return jax.tree_util.tree_unflatten(self.treedef, params)
        call = buffer_callback(self._gather_cb, self.full_types,
                               command_buffer_compatible=self.recorded)
        params = _bind(call, (*sends, *after))
        return jax.tree_util.tree_unflatten(self.treedef, params[:n])

    def reduce(self, grads: Any, passed: Sequence[Any],
               after: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """``(fp32 shard gradients, passed)``: the reduce-scatter of ``grads`` (a pytree
        in the compute dtype), run after ``after`` exists, with ``passed`` aliased
        through it ([Note: collective order in a jitted step])."""
        owner, n = self.owner, len(self.shapes)
        leaves = [g.astype(owner.compute_dtype) for g in jax.tree_util.tree_leaves(grads)]
        if owner.in_xla:  # an average of one ([Note: one rank] in ``_runners``)
            return [g.astype(jnp.float32) for g in leaves], list(passed)
        types = [*self.shard_types, *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in passed)]
        aliases = {n + k: n + k for k in range(len(passed))}
        call = buffer_callback(self._reduce_cb, types, input_output_aliases=aliases,
                               command_buffer_compatible=self.recorded)
        out = _bind(call, (*leaves, *passed, *after))
        return list(out[:n]), list(out[n:])

    def _gather_cb(self, ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
        xb, n = self.owner.buffers, len(self.shapes)
        if xb.runs(ctx):
            with self.owner.clock, xb.on_device():
                self.owner.runner.gather(self.index, self.shapes, xb.arrays(ins[:n]),
                                         xb.arrays(outs), xb.stream(ctx))

    def _reduce_cb(self, ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
        xb, n = self.owner.buffers, len(self.shapes)
        if xb.runs(ctx):
            with self.owner.clock, xb.on_device():
                self.owner.runner.reduce(self.index, xb.arrays(ins[:n]), xb.arrays(outs[:n]),
                                         xb.stream(ctx))


def _bind(call: Callable, operands: Sequence[Any]) -> Any:
    try:
        return call(*operands)
    except NotImplementedError as e:
        if "vmap" not in str(e):
            raise
        raise vmap_refused() from None


def _float_leaves(tree: Any) -> tuple[list[Any], list[int], list[Any]]:
    """``(float leaves, their indices, all leaves)`` of ``tree`` (a cotangent's float0
    and integer leaves carry no data to order by)."""
    leaves = jax.tree_util.tree_leaves(tree)
    idx = [k for k, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]
    return [leaves[k] for k in idx], idx, leaves


def _checked_leaves(col: _UnitCollectives, unit_shards: Any) -> list[Any]:
    """The leaves of ``unit_shards`` if they are structured and shaped as ``col``'s (one
    layer's) shards; else :class:`TideInvalid`."""
    leaves, treedef = jax.tree_util.tree_flatten(unit_shards)
    if treedef != col.treedef:
        raise TideInvalid(f"tidearray.jax: unit {col.index}: expected shards structured as "
                          f"{col.treedef}, got {treedef}")
    want = [t.shape for t in col.shard_types]
    got = [tuple(np.shape(a)) for a in leaves]
    if got == want:
        return leaves
    if col.layers is None:
        raise TideInvalid(f"tidearray.jax: unit {col.index}: expected shards shaped "
                          f"{want}, got {got}")
    raise TideInvalid(f"tidearray.jax: unit {col.index} is stacked over {col.layers} layers: "
                      f"expected one layer's shards, shaped {want}, as lax.scan over the "
                      f"unit's shards slices them (or ShardedUnits.scan), got {got}")


def _check_carry(col: _UnitCollectives, fn: Callable, x: Any) -> None:
    """:class:`TideInvalid` unless one layer's ``fn`` returns what it takes, ``x``'s
    structure, shapes and dtypes (``lax.scan``'s carry; traced abstractly, no compute)."""
    params = jax.tree_util.tree_unflatten(col.treedef, col.full_types)

    def kinds(tree: Any) -> tuple:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef, [(tuple(jnp.shape(a)), jnp.dtype(a.dtype)) for a in leaves]

    want, got = kinds(x), kinds(jax.eval_shape(fn, params, x))
    if got != want:
        raise TideInvalid(f"tidearray.jax: ShardedUnits.scan of unit {col.index}: expected fn "
                          f"to return its input's structure, shapes and dtypes (the scan's "
                          f"carry), {want}, got {got} (cast the output to the input's dtype)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _apply(col: _UnitCollectives, fn: Callable, shards: list, x: Any) -> Any:
    return fn(col.gather(shards, jax.tree_util.tree_leaves(x)), x)


def _apply_fwd(col: _UnitCollectives, fn: Callable, shards: list, x: Any) -> tuple:
    params = col.gather(shards, jax.tree_util.tree_leaves(x))
    if col.owner.reshard_after_forward:  # [Note: memory of a unit]
        y = fn(params, x)
        return y, (shards, y, x)
    y, pull = jax.vjp(fn, params, x)
    return y, (shards, y, pull)


def _apply_bwd(col: _UnitCollectives, fn: Callable, saved: tuple, ct_y: Any) -> tuple:
    shards, y, rest = saved
    # [Note: collective order in a jitted step]: after the forward (y) and the
    # backward so far (ct_y).
    after = [*_float_leaves(ct_y)[0], *jax.tree_util.tree_leaves(y)]
    if col.owner.reshard_after_forward:
        params = col.gather(shards, after)
        _, pull = jax.vjp(fn, params, rest)
    else:
        pull = rest
    dparams, dx = pull(ct_y)
    passed, idx, leaves = _float_leaves(dx)
    dshards, passed = col.reduce(dparams, passed, after)
    for k, a in zip(idx, passed):
        leaves[k] = a
    return dshards, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(dx), leaves)


_apply.defvjp(_apply_fwd, _apply_bwd)


class ShardedUnits:
    """A model's units, sharded over a group for a jitted JAX step. Made by
    :func:`shard_units`.

    Attributes:
        shards: this rank's fp32 shards, one pytree per unit (the structure of the unit
            given to :func:`shard_units`), each leaf a JAX array of the padded shard
            shape ``(ceil(d0/W), *rest)`` on :attr:`device`. Step them with any
            optimizer; pass them into the jitted step as an argument.
        device: the JAX device of this rank (the backend's GPU, or the CPU).
        compute_dtype: the dtype the parameters are gathered in and their gradients
            reduced from.
        group: the group the collectives run on.
    """

    def __init__(self, group: Group, units: list, treedefs: list, layers: list,
                 shard_arrays: list, device: Any, compute_dtype: Any, *,
                 reshard_after_forward: bool, command_buffer: bool,
                 xla_at_one_rank: bool) -> None:
        self.group, self.device, self.compute_dtype = group, device, compute_dtype
        self.reshard_after_forward = reshard_after_forward
        self.command_buffer = command_buffer
        self.in_xla = xla_at_one_rank and group.size == 1  # [Note: one rank] in ``_runners``
        self.buffers = XlaBuffers(group.backend)
        self.clock = HostClock()  # the callbacks' host time (callback_seconds)
        if not self.in_xla:
            size = max([max(u.nbytes, u.staging_nbytes) for u in units] + [4096])
            self.arena = SlotArena(size, num_slots=1, group=group)
            self.slot = self.arena[0]
            # [Note: in place or staged] in _runners
            self.runner = (Staged(group, self.slot, self.buffers, units) if command_buffer
                           else InPlace(group, self.slot, self.buffers, layers, units[0].dtype))
        self._units = [_UnitCollectives(self, i, u, t, n)
                       for i, (u, t, n) in enumerate(zip(units, treedefs, layers))]
        self.shards = [jax.tree_util.tree_unflatten(t, [jax.device_put(a, device) for a in arrs])
                       for t, arrs in zip(treedefs, shard_arrays)]

    def __len__(self) -> int:
        return len(self._units)

    @property
    def callback_seconds(self) -> float:
        """Host seconds this rank spent in the units' callbacks since :func:`shard_units`:
        the collectives' Python, agreement and launches (on the host backend their copies
        and sums too), summed over the threads XLA calls back on. Its growth over a step,
        against the step's host time, is what tidearray adds to the host's work (none at
        one rank, where XLA casts: ``shard_units``' ``xla_at_one_rank``)."""
        return self.clock.seconds

    def layers(self, index: int) -> Optional[int]:
        """The number of layers of unit ``index`` if it is stacked (``shard_units``'
        ``stacked``), else None."""
        return self._units[index].layers

    def apply(self, index: int, fn: Callable[[Any, Any], Any], unit_shards: Any, x: Any) -> Any:
        """``fn(params, x)`` with unit ``index``'s full parameters, differentiable in
        ``unit_shards`` and ``x``; call it inside the jitted step.

        Forward: TIDE-AG of the unit's shards (cast to :attr:`compute_dtype`) into full
        parameters. Backward: TIDE-RS of the parameters' gradients into fp32 shard
        gradients (averaged over the ranks), after a re-gather if the forward's
        parameters were released ([Note: memory of a unit] in ``tidearray.jax._units``).

        Args:
            index: the unit (its position in :func:`shard_units`' list).
            fn: the unit's computation, ``fn(params, x)``; ``params`` has the unit's
                pytree structure (one layer's, for a stacked unit). Pure JAX, traced
                once per ``apply`` call site.
            unit_shards: the unit's shards as the step received them
                (``shards[index]``, or what an optimizer made of it); for a stacked
                unit, one layer's, as ``lax.scan`` over ``shards[index]`` slices them
                (or use :meth:`scan`).
            x: the unit's input (any pytree). Units must be applied as a chain: each
                unit's input computed from the previous unit's output ([Note:
                collective order in a jitted step]).

        Raises:
            TideInvalid: under ``jax.vmap``, or inside a mesh context (one JAX device per
                rank is what runs; the ranks are the data-parallel dimension), or if
                ``unit_shards`` is not structured and shaped as the unit's (one layer's)
                shards.
        """
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            raise TideInvalid(f"tidearray.jax: expected no mesh context (one device per "
                              f"rank, the ranks sharding the data), got {mesh}")
        col = self._units[index]
        return _apply(col, fn, _checked_leaves(col, unit_shards), x)

    def scan(self, index: int, fn: Callable[[Any, Any], Any], unit_shards: Any, x: Any, *,
             unroll: int = 1) -> Any:
        """``fn`` of every layer of stacked unit ``index`` in turn, inside ``jax.lax.scan``:
        ``x`` through layer 0, its output through layer 1, and so on; call it inside the
        jitted step.

        Each iteration is an :meth:`apply` of one layer: its gather runs in the
        iteration, in layer order; in backward, its re-gather and reduce-scatter run in
        reverse layer order ([Note: stacked units under lax.scan] in
        ``tidearray.jax._units``). One compiled layer, whatever the depth.

        Args:
            index: a stacked unit (``shard_units(..., stacked=[index])``).
            fn: one layer's computation, ``fn(params, x)``, returning a pytree of the
                same structure, shapes and dtypes as ``x`` (the scan's carry).
            unit_shards: the unit's stacked shards (``shards[index]``): leaves
                ``(layers, ceil(d0/W), *rest)``.
            x: the first layer's input.
            unroll: ``jax.lax.scan``'s ``unroll``.

        Returns:
            The last layer's output.

        Raises:
            TideInvalid: unit ``index`` is not stacked, or ``fn`` does not return ``x``'s
                structure, shapes and dtypes, or as :meth:`apply`.
        """
        col = self._units[index]
        if col.layers is None:
            raise TideInvalid(f"tidearray.jax: ShardedUnits.scan of unit {index}: expected a "
                              f"stacked unit (shard_units(..., stacked=[{index}])), got an "
                              f"unstacked one (use apply)")
        _check_carry(col, fn, x)

        def layer(h: Any, layer_shards: Any) -> tuple[Any, None]:
            return self.apply(index, fn, layer_shards, h), None

        return jax.lax.scan(layer, x, unit_shards, unroll=unroll)[0]

    def full_params(self, shards: Sequence[Any], *, root: Optional[int] = None) -> Optional[list]:
        """Every unit's full fp32 parameters on the host, from every rank's ``shards``
        (those the step returned): to save the model whole, evaluate it in one process or
        hand it to another library. Collective; outside the jitted step.

        Returns:
            One pytree per unit, as given to :func:`shard_units`, of NumPy float32 arrays
            (a stacked unit's with its layer axis); with ``root``, on that rank only (None
            elsewhere). Gathered one parameter (one layer's) at a time.

        Raises:
            TideInvalid: on every rank, before any transfer, if a rank's ``shards`` are
                not structured and shaped as :attr:`shards`, cannot be read (a donated
                buffer), are a jitted function's traced values, or ``root`` is not a
                rank or differs between ranks.
        """
        return full_params(self, shards, root)

    def __repr__(self) -> str:
        return (f"ShardedUnits({len(self)} units, {np.dtype(self.compute_dtype).name}, "
                f"rank {self.group.rank} of {self.group.size}, {self.device})")


def shard_units(units: Sequence[Any], *, group: Optional[Group] = None,
                compute_dtype: Any = jnp.float32, reshard_after_forward: bool = True,
                command_buffer: bool = False, stacked: Sequence[int] = (),
                xla_at_one_rank: bool = True) -> ShardedUnits:
    """Shard a model's units over the group, for :meth:`ShardedUnits.apply` in a jitted step.

    Collective: every rank must call it with units of the same structure, shapes and
    dtypes, or every rank raises the same :class:`TideInvalid` before any transfer.

    Args:
        units: one pytree of full parameters per unit (NumPy or JAX arrays, floating,
            at least 1-D, the same values on every rank: each rank keeps its rows).
        group: the group (default: the last ``tidearray.init``).
        compute_dtype: ``jnp.float32``, ``jnp.bfloat16`` or ``jnp.float16``: the gathered
            parameters' dtype, and the gradients' dtype in the reduce-scatter (always
            reduced into fp32 shards).
        reshard_after_forward: release a unit's parameters after its forward, gather
            them again in backward (True; [Note: memory of a unit] in ``_units``).
        command_buffer: let XLA record the collectives into its command buffers on GPU
            (``buffer_callback(command_buffer_compatible=True)``): the callbacks' Python
            runs when XLA records, not every step, through plans built here over buffers
            of tidearray's, XLA's copied in and out (one unit's gradients more of memory:
            [Note: in place or staged] in ``tidearray.jax._runners``). A stacked unit's
            callbacks are never recorded (XLA failed to update a recorded scan loop on an
            H200 at 3-4 ranks).
        stacked: the indices of the units whose leaves stack per-layer parameters on a
            leading layer axis, ``(layers, d0, *rest)`` (MaxText's ``scan_layers``,
            Flax's ``nn.scan``): each layer sharded on its dim 0, the unit's shards
            ``(layers, ceil(d0/W), *rest)``, for :meth:`ShardedUnits.scan` ([Note:
            stacked units under lax.scan] in ``tidearray.jax._units``).
        xla_at_one_rank: at one rank, the gather and the reduce-scatter as XLA's casts,
            fused into the step (True, the default), or through tidearray's plans as at
            any size (False: a larger group's collectives' cost on one device); the same
            roundings ([Note: one rank] in ``tidearray.jax._runners``).

    Returns:
        The :class:`ShardedUnits`, whose ``shards`` hold this rank's fp32 shards.

    Raises:
        TideInvalid: on every rank, if a rank's units or ``stacked`` differ from rank 0's,
            or a leaf is not a floating array of at least one dimension (two, stacked, one
            number of layers per unit), or JAX's device does not fit the backend (CPU JAX
            for the host backend, a CUDA JAX for cuda).
    """
    group = group or default_group()
    errors: list[str] = []
    units = _unit_list(units, errors)
    device, dtype_name = _check_settings(group, compute_dtype, errors)
    stacked_set = _stacked_indices(stacked, len(units), errors)
    signature = [("compute_dtype", dtype_name), ("units", len(units)),
                 ("stacked", tuple(sorted(stacked_set)))]
    described = [_describe(i, unit, i in stacked_set, errors) for i, unit in enumerate(units)]
    signature += [d.signature for d in described]
    _validate.check(group, "tidearray.jax.shard_units", tuple(signature), errors)
    plans = [Unit(d.shapes, _dtypes.normalize(dtype_name), group=group) for d in described]
    return ShardedUnits(group, plans, [d.treedef for d in described],
                        [d.layers for d in described], [d.shards(group) for d in described],
                        device, _COMPUTE_DTYPES[dtype_name],
                        reshard_after_forward=reshard_after_forward,
                        command_buffer=command_buffer, xla_at_one_rank=xla_at_one_rank)


def _check_settings(group: Group, compute_dtype: Any, errors: list[str]) -> tuple[Any, str]:
    """JAX's device for the group's backend, and ``compute_dtype``'s name; what does not
    fit goes into ``errors`` (raised on every rank by the caller's agreement)."""
    device = _device(group, errors)
    dtype_name = np.dtype(compute_dtype).name
    if dtype_name not in _COMPUTE_DTYPES:
        errors.append(f"compute_dtype: expected one of {sorted(_COMPUTE_DTYPES)}, "
                      f"got {dtype_name}")
    return device, dtype_name


def _unit_list(units: Any, errors: list[str]) -> list:
    """``units`` as a list (none, appending to ``errors``, if not a list or a tuple: a
    model's whole parameter dict, say)."""
    if isinstance(units, (list, tuple)):
        return list(units)
    errors.append(f"units: expected a list of units (one pytree of parameters each), got "
                  f"{type(units).__name__}")
    return []


def _stacked_indices(stacked: Any, n: int, errors: list[str]) -> set[int]:
    """``stacked`` as a set of unit indices (appends to ``errors`` what is not one)."""
    try:
        given = list(stacked)
    except TypeError:
        errors.append(f"stacked: expected a sequence of unit indices, got {stacked!r}")
        return set()
    bad = [k for k in given if not isinstance(k, (int, np.integer)) or isinstance(k, bool)
           or not 0 <= k < n]
    if bad or len(set(given)) != len(given):
        errors.append(f"stacked: expected distinct unit indices in [0, {n}), got {given!r}")
        return set()
    return {int(k) for k in given}


class _Described(NamedTuple):
    """One unit as ``shard_units`` read it."""

    treedef: Any
    leaves: list
    layers: Optional[int]  # None: not stacked
    signature: tuple  # what must be equal on every rank

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The full shape of each parameter (of one layer, stacked)."""
        skip = 0 if self.layers is None else 1
        return [tuple(a.shape[skip:]) for a in self.leaves]

    def shards(self, group: Group) -> list[np.ndarray]:
        """This rank's fp32 shard of each leaf (each layer's, stacked)."""
        def one(a: Any) -> np.ndarray:
            return shard(np.asarray(a, np.float32), group=group)

        if self.layers is None:
            return [one(a) for a in self.leaves]
        return [np.stack([one(a[k]) for k in range(self.layers)]) for a in self.leaves]


def _describe(i: int, unit: Any, is_stacked: bool, errors: list[str]) -> _Described:
    """Unit ``i``'s structure, layers and signature (appends to ``errors`` its bad leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(unit)
    signature = (f"unit {i}", (str(treedef), tuple(_leaf_kind(a) for a in leaves)))
    least = 2 if is_stacked else 1
    bad = [(k, a) for k, a in enumerate(leaves) if not _is_array(a) or a.ndim < least
           or not jnp.issubdtype(a.dtype, jnp.floating)]
    errors += [f"unit {i} leaf {k}: expected a floating array of at least {least} dim"
               f"{'s (a leading layer axis: the unit is stacked)' if is_stacked else ''}, got "
               f"{''.join(map(str, _leaf_kind(a)))}" for k, a in bad]
    if bad:  # the leaves cannot be sharded: the caller raises
        return _Described(treedef, [], None, signature)
    if not is_stacked:
        return _Described(treedef, leaves, None, signature)
    counts = sorted({a.shape[0] for a in leaves if a.ndim})
    if len(counts) != 1 or counts[0] < 1:
        errors.append(f"unit {i} (stacked): expected every leaf to have one number of layers "
                      f">= 1 on its leading axis, got {counts}")
        return _Described(treedef, [], 1, signature)
    return _Described(treedef, leaves, counts[0], signature)


def _is_array(a: Any) -> bool:
    return all(hasattr(a, name) for name in ("shape", "dtype", "ndim"))


def _leaf_kind(a: Any) -> tuple:
    """What the ranks must agree on of a leaf: its dtype and shape, or, not an array, its
    type (a Python float, a string: refused, on every rank alike)."""
    if _is_array(a):
        return (str(a.dtype), tuple(a.shape))
    return (f"a {type(a).__name__} (not an array)",)


def _device(group: Group, errors: list[str]) -> Any:
    """This rank's JAX device for the group's backend (appends to ``errors`` if none)."""
    if jax.process_count() > 1:
        errors.append(f"expected one JAX process per rank (no jax.distributed), got "
                      f"{jax.process_count()} JAX processes")
    kind = group.backend.device_kind
    try:
        devices = jax.devices(kind)
    except RuntimeError:
        devices = []
    index = group.backend.device if kind == "gpu" else 0
    if index >= len(devices):
        errors.append(f"expected a JAX {kind} device {index} for the {group.backend.name} "
                      f"backend, got JAX devices {jax.devices()}")
        return None
    return devices[index]
