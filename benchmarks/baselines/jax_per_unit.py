"""JAX on ``Runtime`` outside ``jit``: one ``jax.vjp`` per unit, joined on the host.

What tidearray offered JAX before ``tidearray.jax``, kept as the baseline of
``benchmarks/steps/jax_step.py``. Python drives the units: for each, the runtime
gathers its parameters into a slot, the slot is viewed as JAX arrays through DLPack
(no copy), ``jax.vjp`` runs the unit and keeps its pullback. In backward the runtime
gathers the unit again into the *same* slot, the pullback gives the gradients, they
are copied into the runtime's gradient buffers, and the unit's reduce-scatter starts.
The fused AdamW steps the fp32 shards.

[Note: JAX and the slots, outside jit]
JAX assumes a buffer it imported never changes. A slot does change between units, so
a unit's arrays are used only while the slot holds that unit (``pre_forward`` to
``post_forward``, ``pre_backward`` to ``post_backward``; unit ``i`` lands in slot
``i % slots`` every time, so the pullback's arrays are right again in backward), and
results are made concrete (``block_until_ready``) before the slot is released. On
cuda XLA's stream is invisible to the runtime, so CuPy's stream is synchronized
before JAX reads a gathered unit: the host joins the two at every unit boundary.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

import tidearray as ta
from tidearray.fsdp import AdamW, Runtime


class Bridge:
    """Arrays between the runtime's backend and JAX on one device."""

    def __init__(self, jax: Any, g: ta.Group, device: Any) -> None:
        self.jax, self.xp, self.device = jax, g.backend.xp, device
        self.cuda = g.backend.name == "cuda"
        self.copies = 0  # parameters JAX could not take without a copy

    def ready_for_jax(self) -> None:
        """Work the runtime issued on CuPy's stream is done before XLA's stream reads it."""
        if self.cuda:
            self.xp.cuda.get_current_stream().synchronize()

    def to_jax(self, a: Any) -> Any:
        """A JAX array over ``a``'s memory (DLPack, no copy) where JAX can take it."""
        try:
            return self.jax.dlpack.from_dlpack(a)
        except Exception:  # noqa: BLE001 - NumPy's bf16 has no DLPack: a copy instead
            self.copies += 1
            return self.jax.device_put(a.get() if self.cuda else a, self.device)

    def copy_into(self, buf: Any, d: Any) -> None:
        """``buf[...] = d`` (a finished JAX array), on the runtime's side."""
        if self.cuda:
            self.xp.copyto(buf, self.xp.from_dlpack(d))
        else:
            np.copyto(buf, np.asarray(d))


class PerUnitTrainer:
    """The units of a JAX model on ``Runtime``, stepped unit by unit outside jit.

    Args:
        jax: the ``jax`` module.
        g: the group.
        units: one pytree of full fp32 parameters per unit (same on every rank).
        fns: each unit's ``fn(params, x)``.
        loss: ``loss(output, targets)``, a scalar.
        device: the JAX device of this rank.
        param_dtype: the gathered parameters' dtype.
        hp: AdamW's hyper-parameters.
    """

    def __init__(self, jax: Any, g: ta.Group, units: Sequence[Any], fns: Sequence[Callable],
                 loss: Callable, device: Any, param_dtype: Any, hp: AdamW) -> None:
        self.jax, self.g, self.fns = jax, g, list(fns)
        self.bridge = Bridge(jax, g, device)
        flat = [jax.tree_util.tree_flatten(u) for u in units]
        self.treedefs = [t for _, t in flat]
        named = [[(f"{i}.{k}", np.asarray(a)) for k, a in enumerate(leaves)]
                 for i, (leaves, _) in enumerate(flat)]
        self.sm = Runtime(named, group=g, param_dtype=param_dtype, optimizer=hp)
        self.loss_grad = jax.jit(jax.value_and_grad(loss))

    def step(self, x: Any, targets: Any, lr: Optional[float] = None) -> float:
        """One training step on this rank's samples (at ``lr``, default ``hp.lr``); returns
        this rank's loss."""
        jax, sm, bridge = self.jax, self.sm, self.bridge
        h, pullbacks = x, []
        for i, treedef in enumerate(self.treedefs):
            arrays = sm.pre_forward(i)
            bridge.ready_for_jax()  # [Note: JAX and the slots, outside jit]
            params = jax.tree_util.tree_unflatten(treedef, [bridge.to_jax(a) for a in arrays])
            h, pull = jax.vjp(self.fns[i], params, h)
            h.block_until_ready()
            pullbacks.append(pull)
            sm.post_forward(i)
        loss, dh = self.loss_grad(h, targets)
        for i in reversed(range(len(self.treedefs))):
            _, grads_out = sm.pre_backward(i)
            bridge.ready_for_jax()
            dparams, dh = jax.block_until_ready(pullbacks[i](dh))
            for buf, d in zip(grads_out, jax.tree_util.tree_leaves(dparams)):
                bridge.copy_into(buf, d)
            sm.post_backward(i)
        sm.step(lr=lr)
        return float(loss)

    def close(self) -> None:
        self.sm.synchronize()
