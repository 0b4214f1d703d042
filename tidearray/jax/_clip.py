"""Clipping shard gradients by their global norm inside a jitted JAX step.

[Note: the global norm in a jitted step]
The norm spans every rank's shard, so no rank can compute it alone (``optax``'s
``clip_by_global_norm`` on shards would clip each rank by its own part). Each
rank's sum of squares is one float32 that XLA computes from its shards (leaf
by leaf, in the tree's order; padding rows are zeros and add nothing). A
``buffer_callback`` gathers the ranks' sums with a TIDE gather plan built once,
at construction, over one float32 of tidearray's per rank (rank ``r``'s shard
is row ``r`` of a ``(W,)`` parameter), into a small slot of its own; around the
plan call it copies XLA's sum in and the gathered sums out, on XLA's stream, as
the staged runner does ([Note: in place or staged] in ``_runners``): no host
synchronization. XLA then adds the sums in rank order: every rank adds the same
bits in the same order, so every rank gets the same norm, hence the same clip
and the same step. At one rank the norm is the rank's own: XLA takes the root of
its sum, and no callback runs (as the units' collectives at one rank: [Note: one
rank] in ``_runners``).

Order: the gather takes the local sum as its operand, so it runs after the
reduce-scatters that made the gradients, and what is clipped runs after it;
it is ordered with the units' collectives by data ([Note: collective order in
a jitted step] in ``_units``). Two norms taken of the same gradients side by
side would have no order between them (on CPU XLA may run them at once): take
one norm per set of gradients, as a chain of transforms does (each one's input
is the previous one's output).

The clip is torch's ``clip_grad_norm_``: the gradients are multiplied by
``min(1, max_norm / (norm + 1e-6))``, in float32; a NaN or infinite norm makes
NaN or zero gradients, as in torch.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import _dtypes, _validate
from .._arena import SlotArena
from .._errors import TideInvalid
from .._group import Group, default_group
from .._plan import Unit
from ._buffers import XlaBuffers

#: torch's ``clip_grad_norm_`` adds this to the norm before dividing.
CLIP_EPS = 1e-6


class GlobalNorm:
    """The L2 norm of shard gradients over every rank of a group, inside ``jax.jit``
    ([Note: the global norm in a jitted step] in ``tidearray.jax._clip``).

    Collective to make: it builds a gather plan and a small slot of symmetric memory (none
    at one rank, whose norm is its own).

    Args:
        group: the group the shards are spread over (default: the last ``tidearray.init``).
    """

    def __init__(self, group: Optional[Group] = None) -> None:
        group = group or default_group()
        self.group, self.buffers = group, XlaBuffers(group.backend)
        if group.size == 1:  # the rank's own sum is the whole: nothing to gather
            return
        unit = Unit([(group.size,)], _dtypes.float32, group)
        self._arena = SlotArena(max(unit.nbytes, 4096), num_slots=1, group=group)
        self._send = group.backend.empty((1,), np.float32)
        self._plan = unit.gather_plan([self._send], self._arena[0])
        # A plan uploads its tables at its first call, which XLA's capture could not take:
        # one call now, on every rank.
        self._plan()
        self._sums_type = [jax.ShapeDtypeStruct((group.size,), jnp.float32)]

    def __call__(self, grads: Any) -> jax.Array:
        """The global norm (a float32 scalar, the same bits on every rank) of the gradient
        whose shards on this rank are ``grads`` (a pytree of floating arrays); call it
        inside the jitted step.

        Raises:
            TideInvalid: a leaf of ``grads`` is not a floating array.
        """
        leaves = jax.tree_util.tree_leaves(grads)
        bad = [f"leaf {k}: {jnp.result_type(a)}" for k, a in enumerate(leaves)
               if not jnp.issubdtype(jnp.result_type(a), jnp.floating)]
        if bad:
            raise TideInvalid(f"tidearray.jax global norm: expected floating gradient shards, "
                              f"got {', '.join(bad)}")
        squares = [jnp.sum(jnp.square(jnp.asarray(a, jnp.float32))) for a in leaves]
        local = functools.reduce(operator.add, squares, jnp.zeros((), jnp.float32))
        if self.group.size == 1:
            return jnp.sqrt(local)
        call = buffer_callback(self._gather_cb, self._sums_type)
        sums = call(local.reshape(1))[0]
        total = functools.reduce(operator.add, [sums[r] for r in range(self.group.size)])
        return jnp.sqrt(total)

    def _gather_cb(self, ctx: Any, outs: Any, local: Any) -> None:
        xb = self.buffers
        if xb.runs(ctx):
            with xb.on_device():
                stream = xb.stream(ctx)
                xb.copy([self._send], xb.arrays([local]), stream)
                xb.copy(xb.arrays(outs), self._plan(stream=stream), stream)


def clip_factor(norm: jax.Array, max_norm: float) -> jax.Array:
    """torch's ``clip_grad_norm_`` factor, ``min(1, max_norm / (norm + 1e-6))``, float32."""
    coef = jnp.float32(max_norm) / (norm + jnp.float32(CLIP_EPS))
    return jnp.minimum(coef, jnp.float32(1.0))


def checked_clip(group: Optional[Group], what: str, max_norm: Any,
                 signature: tuple = ()) -> GlobalNorm:
    """The :class:`GlobalNorm` for clipping to ``max_norm``, after every rank agreed that
    ``max_norm`` is a finite real > 0, the same on every rank (and so is ``signature``).

    Raises:
        TideInvalid: on every rank, before any transfer, if a rank's ``max_norm`` is bad or
            differs from rank 0's.
    """
    group = group or default_group()
    real = isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool)
    errors = [] if real and math.isfinite(max_norm) and max_norm > 0 else [
        f"max_norm: expected a finite real > 0, got {max_norm!r}"]
    key = repr(float(max_norm)) if real else repr(max_norm)  # NaN's hash is not stable
    _validate.check(group, what, (("max_norm", key), *signature), errors)
    return GlobalNorm(group)


class ClipByGlobalNormState(NamedTuple):
    """The state of :func:`clip_by_global_norm`."""

    #: The global norm of the last update's gradients, before clipping (float32; 0 before
    #: the first): log it from the step's output state.
    norm: jax.Array


class GradientTransformation(NamedTuple):
    """optax's protocol (``optax.GradientTransformation``): ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, pure functions for jit."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


def clip_by_global_norm(max_norm: float, *,
                        group: Optional[Group] = None) -> GradientTransformation:
    """Clip shard gradients by the global norm of the whole gradient, for ``optax.chain``.

    The norm spans every rank's shard ([Note: the global norm in a jitted step] in
    ``tidearray.jax._clip``), so the result is the shards of the full gradient clipped by
    its norm, as one process would clip it: ``optax.clip_by_global_norm`` on shards would
    clip each rank by its own part. The factor is torch's ``clip_grad_norm_``. Needs no
    optax: the result follows its ``init``/``update`` protocol.

    Collective: every rank calls it with the same ``max_norm``; the updates it clips must
    be shards of the group's gradients (a replicated leaf would count once per rank).

    Args:
        max_norm: the norm to clip to, a finite real > 0.
        group: the group the shards are spread over (default: the last ``tidearray.init``).

    Returns:
        A :class:`GradientTransformation` whose state, :class:`ClipByGlobalNormState`, holds
        the last norm before clipping.

    Raises:
        TideInvalid: on every rank, before any transfer, if ``max_norm`` is not a finite
            real > 0 or differs between ranks.
    """
    norm_of = checked_clip(group, "tidearray.jax.clip_by_global_norm", max_norm)
    limit = float(max_norm)

    def init(params: Any) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState(jnp.zeros((), jnp.float32))

    def update(updates: Any, state: ClipByGlobalNormState,
               params: Any = None) -> tuple[Any, ClipByGlobalNormState]:
        del state, params
        norm = norm_of(updates)
        factor = clip_factor(norm, limit)
        clipped = jax.tree_util.tree_map(lambda g: (g * factor).astype(g.dtype), updates)
        return clipped, ClipByGlobalNormState(norm)

    return GradientTransformation(init, update)
