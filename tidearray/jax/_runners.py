"""How a unit's callback runs its collective: on XLA's buffers in place, or through plans
built once over buffers of tidearray's (for XLA's command buffers); at one rank, XLA's
casts instead of callbacks.

[Note: in place or staged]
In place (the default): the gather reads XLA's shard buffers and the reduce-scatter
reads XLA's gradient buffers where they are and writes XLA's fp32 output buffers, by
eager plans, as :func:`tidearray.all_gather` and :func:`tidearray.reduce_scatter` run
them: a plan is built (validated, addresses resolved, tables uploaded) the first time
a unit's collective meets a set of addresses, and found again by them, with one
agreement across the ranks per call; XLA reuses its buffer assignment from step to
step, so after the first steps a call finds its plan. The base of a step's temporaries
is its allocator's, and may move from step to step: a unit keeps a few address sets per
collective (``ADDRESS_SETS``), so a base that comes back finds its plans, and a new one
costs a build (and, with unit graphs, a capture at the next find).

With ``Config.unit_graphs`` an in-place plan becomes a graph plan once every rank has
found it again ([Note: unit graphs] in ``fsdp._comm``; ``eager_plan``'s
``graph_after``): one graph launch on XLA's stream per call after that, instead of an
eager call's 150-250 us of host time. The decision rides on each call's agreement, so
every rank captures at the same call, also where one rank's address sets differ.

Staged (``command_buffer=True``): XLA records a command-buffer-compatible callback by
stream capture, at addresses it picks, and a capture cannot upload a new plan's
tables. So each unit's gather and reduce plans are built once, at
:func:`shard_units`, over buffers of tidearray's (one set, as large as the largest
unit, shared by every unit: calls follow each other on XLA's stream), and the
callback copies XLA's buffers in and out around the plan call: the shards in (``1/W``
of the unit), the gathered parameters out, the gradients in (the unit, in the compute
dtype) and the fp32 shard gradients out. Those copies are capture-safe memcpys; the
plan call is one of the library's capture-safe issues, once the plan has run outside
a capture (its tables upload at its first call): each runs once when it is built.

[Note: the gather's own rows]
A gather takes the fp32 shards as XLA holds them and rounds them itself (a cast
plan, ``Unit.gather_plan``'s ``cast``: one kernel, as the torch front end's gathers
do), in place straight into this rank's rows of XLA's output buffers ([Note:
gathering into the caller's buffers] in ``_all_gather``); only the peers' rows pass
through the slot. Cast by XLA first, the shards would cost a convert kernel and a
compute-dtype buffer in XLA, a copy into the slot and one out of it: at one rank
(whose rows are the whole unit) two reads and writes of every parameter more per
gather. Where the compute dtype is fp32 there is nothing to round, and the gather
copies the shards as they are. Staged plans cast into their own buffers.

[Note: the whole device]
XLA runs each callback on its stream and waits for it, with nothing of its own beside
it, so every plan here is ``alone``: its cast and its accumulate take the whole
device (two blocks per SM), not the half that leaves room for the compute a torch
step overlaps with its collectives. Both kernels are bound by memory bandwidth,
which half the SMs do not reach; at one rank they are the whole collective.

[Note: one rank]
A group of one rank has nothing to communicate: its gather is a cast of the fp32
shards (the whole parameters) to the compute dtype, and its reduce-scatter a cast of
the gradients to fp32 (the average of one). Run by a callback, each is a pass of its
own over XLA's buffers that XLA cannot fuse: the reduce-scatter writes fp32 gradients
that the optimizer then reads again, 8 bytes per parameter more than an unsharded
step, whose fusion reads the bf16 gradients straight into its update. So at one rank
(``shard_units``' ``xla_at_one_rank``, the default) the two casts are XLA's own ops:
the same roundings (to nearest even; an average of one), so in fp32 the callbacks'
values bit for bit. In a lower compute dtype XLA may keep more: where a gradient was
made in fp32 and rounded to the compute dtype only to be cast back, XLA's excess
precision (``xla_allow_excess_precision``, on by default) may drop the round trip, as
it does in an unsharded step, and the shards then differ from the plans' in their last
bits (a few fp32 ulps in a check of tied, rematerialized and accumulated units on CPU).
The gather's cast takes its operands through ``lax.optimization_barrier`` with
``after``, as a re-gather would wait for them: without it XLA could merge the
backward's cast of the shards with the forward's (the same op of the same operand)
and keep the full parameters through the step, which ``reshard_after_forward``
exists to release. ``jax.vmap`` is refused as the callbacks refuse it
(``custom_vmap``), so a program that runs at one rank runs at every size.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.custom_batching import custom_vmap

from .._arena import Region
from .._cache import BoundedCache
from .._errors import TideInvalid
from .._group import Group
from .._plan import GatherPlan, ReducePlan, Unit, eager_plan
from ._buffers import XlaBuffers

#: Address sets an in-place unit keeps a plan for, per collective: XLA's buffer
#: assignment repeats from step to step, so one or two are in use.
ADDRESS_SETS = 4
#: With ``unit_graphs``: the finds of a plan on every rank before it is captured (at
#: its second call: the addresses repeated once, as XLA's buffer assignment does).
GRAPH_AFTER = 1


class InPlace:
    """The collectives on XLA's own buffers ([Note: in place or staged]).

    Each unit's gather and reduce-scatter keep their eager plans here, a few address
    sets each, not in the group's cache of the latest 64 eager plans: a model of 30
    units issues about 90 collectives a step, which would push each other out of it
    and be built again at every step. A stacked unit keeps two more per layer: a
    ``lax.scan`` unrolled ``k`` times has ``k`` copies of its body, each at addresses
    of its own, forward and backward.

    Each call's agreement names its unit (``tag``): every block of a transformer has the
    same shapes, so ranks applying units in different orders would otherwise agree, and
    mix one unit's parameters with another's.

    Args:
        layers: per unit, its layers if stacked, else None.
        dtype: the units' compute dtype, which the gathers round the fp32 shards to.
    """

    def __init__(self, group: Group, slot: Region, buffers: XlaBuffers,
                 layers: Sequence[Optional[int]], dtype: Any) -> None:
        self.group, self.slot, self.buffers = group, slot, buffers
        self.cast_to = dtype if _casts(dtype) else None  # [Note: the gather's own rows]
        self._sets = [ADDRESS_SETS + 2 * (n or 0) for n in layers]
        self._plans: dict[tuple[str, int], BoundedCache] = {}
        self._graph_after = GRAPH_AFTER if group.config.unit_graphs else None

    def gather(self, index: int, shapes: Sequence[tuple], sends: list, outs: list,
               stream: Optional[int]) -> None:
        g, slot = self.group, self.slot
        send_key, out_key = g.backend.array_key(sends), g.backend.array_key(outs)
        key = None if send_key is None or out_key is None else (send_key, out_key)
        # Straight into XLA's buffers: [Note: gathering into the caller's buffers] in
        # tidearray/_all_gather.py.
        plan = eager_plan(g, key,
                          lambda: GatherPlan(g, sends, shapes, slot, cast_to=self.cast_to,
                                             eager=True, tag=(("unit", index),), out=outs,
                                             alone=True),
                          self._cache("gather", index), self._graph_after, stream)
        plan(stream=stream)

    def reduce(self, index: int, grads: list, outs: list, stream: Optional[int]) -> None:
        g, be = self.group, self.group.backend
        grad_key, out_key = be.array_key(grads), be.array_key(outs)
        key = None if grad_key is None or out_key is None else (grad_key, out_key)
        plan = eager_plan(g, key,
                          lambda: ReducePlan(g, grads, outs, "avg", self.slot, eager=True,
                                             tag=(("unit", index),), alone=True),
                          self._cache("reduce", index), self._graph_after, stream)
        plan(stream=stream)

    def _cache(self, kind: str, index: int) -> BoundedCache:
        cache = self._plans.get((kind, index))
        if cache is None:
            cache = self._plans[kind, index] = BoundedCache(self._sets[index])
        return cache


class Staged:
    """Plans built once over shared buffers of tidearray's; XLA's buffers copied in and
    out around each call ([Note: in place or staged]). Collective to make."""

    def __init__(self, group: Group, slot: Region, buffers: XlaBuffers,
                 units: Sequence[Unit]) -> None:
        self.buffers = buffers
        be = group.backend
        dtype = units[0].dtype
        cast = _casts(dtype)
        full = max(sum(int(np.prod(s)) for s in u.shapes) for u in units)
        shard = max(sum(int(np.prod(s)) for s in u.shard_shapes) for u in units)
        # One set for every unit: the callbacks run one after another on XLA's stream.
        sends = be.empty((shard,), np.float32)  # [Note: the gather's own rows]
        grads = be.empty((full,), dtype)
        outs = be.empty((shard,), np.float32)
        self.gathers: list[tuple[list, GatherPlan]] = []
        self.reduces: list[tuple[list, ReducePlan, list]] = []
        for u in units:
            send_views = _views(sends, u.shard_shapes)
            grad_views = _views(grads, u.shapes)
            out_views = _views(outs, u.shard_shapes)
            gather, reduce = (u.gather_plan(send_views, slot, cast=cast, alone=True),
                              u.reduce_plan(grad_views, out_views, staging=slot, alone=True))
            # A plan uploads its tables at its first call, which a capture cannot take:
            # one call each now, outside XLA's (on every rank, in the same order).
            gather()
            reduce()
            self.gathers.append((send_views, gather))
            self.reduces.append((grad_views, reduce, out_views))

    def gather(self, index: int, shapes: Sequence[tuple], sends: list, outs: list,
               stream: Optional[int]) -> None:
        send_views, plan = self.gathers[index]
        self.buffers.copy(send_views, sends, stream)
        params = plan(stream=stream)
        self.buffers.copy(outs, params, stream)

    def reduce(self, index: int, grads: list, outs: list, stream: Optional[int]) -> None:
        grad_views, plan, out_views = self.reduces[index]
        self.buffers.copy(grad_views, grads, stream)
        plan(stream=stream)
        self.buffers.copy(outs, out_views, stream)


def _casts(dtype: Any) -> bool:
    """Whether a gather in ``dtype`` rounds the fp32 shards ([Note: the gather's own
    rows]): not where they are fp32 already."""
    return np.dtype(dtype) != np.float32


def _views(flat: Any, shapes: Sequence[tuple]) -> list[Any]:
    """Consecutive views of ``flat`` with ``shapes``."""
    views, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        views.append(flat[at:at + n].reshape(s))
        at += n
    return views


def vmap_refused() -> TideInvalid:
    return TideInvalid("tidearray.jax: expected no jax.vmap over a sharded unit, got one: "
                       "batch inside the unit's function instead (its collectives gather "
                       "and reduce one copy of the parameters)")


@functools.cache
def cast_after(dtype_name: str) -> Callable[[list, list], list]:
    """``cast(shards, after)``: the shards in ``dtype_name``, cast once ``after`` exists,
    never merged with another cast of them; refuses ``jax.vmap`` ([Note: one rank])."""
    dtype = jax.numpy.dtype(dtype_name)

    @custom_vmap
    def cast(shards: list, after: list) -> list:
        shards, _ = jax.lax.optimization_barrier((shards, after))
        return [s.astype(dtype) for s in shards]

    @cast.def_vmap
    def _refuse(axis_size: int, in_batched: Any, shards: list, after: list) -> Any:
        raise vmap_refused()

    return cast
