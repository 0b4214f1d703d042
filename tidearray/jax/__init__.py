"""``tidearray.jax``: fully sharded training inside one ``jax.jit`` step.

:func:`shard_units` shards a model's units (pytrees of parameters) over a group, fp32
masters, FSDP2's dim-0 rule. Inside the user's jitted step,
:meth:`ShardedUnits.apply` runs a unit on its full parameters, gathered by TIDE-AG in
the compute dtype; ``jax.grad`` of the step gives fp32 shard gradients, reduced by
TIDE-RS from the compute-dtype gradients; :class:`ShardAdamW` steps the shards inside
the same jit. A stacked unit (per-layer parameters on a leading axis) runs its layers
inside ``jax.lax.scan`` (:meth:`ShardedUnits.scan`). :func:`clip_by_global_norm` (an
optax-style transform) and ``ShardAdamW``'s ``max_grad_norm`` clip the shard gradients
by the whole gradient's norm (:class:`GlobalNorm`). The collectives run inside
``jax.experimental.buffer_callback`` on XLA's buffers and, on GPUs, on XLA's stream.
See ``docs/jax.md``.

Needs JAX (``pip install 'tidearray[jax]'``); ``import tidearray`` does not import it.
"""

from __future__ import annotations

from ._adamw import AdamWState, ShardAdamW
from ._clip import ClipByGlobalNormState, GlobalNorm, clip_by_global_norm
from ._units import ShardedUnits, shard_units

__all__ = ["AdamWState", "ClipByGlobalNormState", "GlobalNorm", "ShardAdamW", "ShardedUnits",
           "clip_by_global_norm", "shard_units"]
