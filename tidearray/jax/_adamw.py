"""AdamW on fp32 shards inside a jitted JAX step, with the fused optimizer's coefficients.

The update is the one of ``tidearray.fsdp.FusedAdamW`` ([Note: AdamW math] in
``tidearray.fsdp._adamw``): the step's scalars are computed once on the host in
float64 and rounded to float32 (:func:`tidearray.fsdp._adamw.coefficients`), then
every element is updated in float32 by XLA. Passing the scalars as an argument keeps
one compiled step for every step count and learning rate. XLA may fuse the element
operations (on GPU, contract a multiply and an add), so results agree with the fused
optimizer to a few float32 roundings, not bitwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import TideInvalid
from ..fsdp._adamw import AdamW as AdamWConfig
from ..fsdp._adamw import Coefficients, coefficients


class AdamWState(NamedTuple):
    """The moments of every shard (pytrees shaped like the shards, fp32)."""

    exp_avg: Any
    exp_avg_sq: Any


class ShardAdamW:
    """AdamW over fp32 shard pytrees, for use inside ``jax.jit``.

    Args:
        hp: the hyper-parameters (:class:`tidearray.fsdp.AdamW`); ``max_grad_norm``
            must be None (a global norm needs a collective of its own).

    Raises:
        TideInvalid: ``hp`` clips.
    """

    def __init__(self, hp: Optional[AdamWConfig] = None) -> None:
        hp = hp or AdamWConfig()
        if hp.max_grad_norm is not None:
            raise TideInvalid(f"tidearray.jax.ShardAdamW: expected max_grad_norm None, got "
                              f"{hp.max_grad_norm!r} (clip the shard gradients in the step)")
        self.hp = hp

    def init(self, shards: Any) -> AdamWState:
        """Zero moments shaped like ``shards``."""
        zeros = jax.tree_util.tree_map(jnp.zeros_like, shards)
        return AdamWState(zeros, jax.tree_util.tree_map(jnp.zeros_like, shards))

    def coefficients(self, step: int, lr: Optional[float] = None) -> jax.Array:
        """The float32 scalars of step ``step`` (1-based), on the host: pass them to the
        jitted step, then to :meth:`update`."""
        c = coefficients(self.hp, step, self.hp.lr if lr is None else lr, 1.0)
        return jnp.asarray(np.array(c, np.float32))

    def update(self, shards: Any, grads: Any, state: AdamWState,
               coef: jax.Array) -> tuple[Any, AdamWState]:
        """``(new shards, new state)``: one AdamW step of every shard (inside jit)."""
        c = Coefficients(*(coef[k] for k in range(len(Coefficients._fields))))

        def one(p, g, m, v):
            g = g * c.grad_scale
            p = p * c.decay
            m = c.beta1 * m + c.omb1 * g
            v = c.beta2 * v + c.omb2 * (g * g)
            denom = jnp.sqrt(v) / c.bc2_sqrt + c.eps
            return p - c.step_size * (m / denom), m, v

        flat = jax.tree_util.tree_map(one, shards, grads, state.exp_avg, state.exp_avg_sq)
        treedef = jax.tree_util.tree_structure(shards)
        parts = treedef.flatten_up_to(flat)
        new = [jax.tree_util.tree_unflatten(treedef, [t[k] for t in parts]) for k in range(3)]
        return new[0], AdamWState(new[1], new[2])
