"""AdamW on fp32 shards inside a jitted JAX step, with the fused optimizer's coefficients.

The update is the one of ``tidearray.fsdp.FusedAdamW`` ([Note: AdamW math] in
``tidearray/_adamw.py``): the step's scalars are computed once on the host in
float64 and rounded to float32 (:func:`tidearray._adamw.coefficients`), then
every element is updated in float32 by XLA. Passing the scalars as an argument keeps
one compiled step for every step count and learning rate. XLA may fuse the element
operations (on GPU, contract a multiply and an add), so results agree with the fused
optimizer to a few float32 roundings, not bitwise.

With ``max_grad_norm`` the shard gradients are clipped by the global norm of the whole
gradient ([Note: the global norm in a jitted step] in ``_clip``): the clip factor
multiplies into ``grad_scale``, as the fused optimizer takes the runtime's clip.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._adamw import AdamW, Coefficients, check_real, coefficients, is_int, is_real
from .._group import Group
from ._clip import GlobalNorm, checked_clip, clip_factor


class AdamWState(NamedTuple):
    """The moments of every shard (pytrees shaped like the shards, fp32)."""

    exp_avg: Any
    exp_avg_sq: Any


class ShardAdamW:
    """AdamW over fp32 shard pytrees, for use inside ``jax.jit``.

    Args:
        hp: the hyper-parameters (:class:`tidearray.fsdp.AdamW`). With ``max_grad_norm``
            each :meth:`update` first clips the gradients by the global norm of the whole
            gradient, over every rank's shards (torch's ``clip_grad_norm_``; [Note: the
            global norm in a jitted step] in ``tidearray.jax._clip``).
        group: the group the shards are spread over, where ``hp`` clips (default: the
            last ``tidearray.init``); unused otherwise.

    Raises:
        TideInvalid: on every rank, before any transfer, where ``hp`` clips and the ranks'
            ``hp`` differ. Constructing a clipping ShardAdamW is collective; one that does
            not clip is not.
    """

    def __init__(self, hp: Optional[AdamW] = None, *,
                 group: Optional[Group] = None) -> None:
        self.hp = hp or AdamW()
        self._norm: Optional[GlobalNorm] = None
        if self.hp.max_grad_norm is not None:
            self._norm = checked_clip(group, "tidearray.jax.ShardAdamW", self.hp.max_grad_norm,
                                      (("hp", repr(self.hp)),))

    def init(self, shards: Any) -> AdamWState:
        """Zero moments shaped like ``shards``."""
        zeros = jax.tree_util.tree_map(jnp.zeros_like, shards)
        return AdamWState(zeros, jax.tree_util.tree_map(jnp.zeros_like, shards))

    def coefficients(self, step: int, lr: Optional[float] = None) -> jax.Array:
        """The float32 scalars of step ``step`` (1-based), on the host: pass them to the
        jitted step, then to :meth:`update`.

        Raises:
            TideInvalid: ``step`` is not an integer >= 1 (the first step is 1, as in
                ``torch.optim.AdamW``), or ``lr`` is not a finite real >= 0.
        """
        check_real("ShardAdamW.coefficients: step", step,
                   "an integer >= 1 (the first step is 1)", is_int(step) and step >= 1)
        lr = self.hp.lr if lr is None else lr
        check_real("ShardAdamW.coefficients: lr", lr, "a finite real >= 0", is_real(lr) and lr >= 0)
        c = coefficients(self.hp, int(step), float(lr), 1.0)
        return jnp.asarray(np.array(c, np.float32))

    def update(self, shards: Any, grads: Any, state: AdamWState,
               coef: jax.Array) -> tuple[Any, AdamWState]:
        """``(new shards, new state)``: one AdamW step of every shard (inside jit), after
        clipping ``grads`` where ``hp.max_grad_norm`` is set."""
        c = Coefficients(*(coef[k] for k in range(len(Coefficients._fields))))
        if self._norm is not None:
            factor = clip_factor(self._norm(grads), self.hp.max_grad_norm)
            c = c._replace(grad_scale=c.grad_scale * factor)

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
