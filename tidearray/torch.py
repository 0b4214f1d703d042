"""``tidearray.torch``: fully sharded ``torch.nn.Module`` training on tidearray's runtime.

An optional front end (``pip install 'tidearray[torch]'``); ``import tidearray``
never imports torch. :func:`shard_module` maps :class:`tidearray.fsdp.ShardedModel`'s
four hooks onto module hooks, where FSDP2 hooks in:

* a forward pre-hook of each unit gathers it (and prefetches the next) and points
  its parameters' ``.data`` at the gathered slot, zero-copy through DLPack;
* a forward hook frees the slot for the next gather (the last unit stays);
* a full backward pre-hook gathers the unit again, into the same slot, so the
  tensors autograd saved in forward see the same memory with the same values;
* each parameter's post-accumulate-grad hook copies its gradient into the
  runtime's gradient buffer; when all of a unit's are in, its reduce-scatter
  starts (bf16 in, fp32 shards out);
* :meth:`ShardedModule.step` runs the fused AdamW on the fp32 master shards.

Parameters are views of a slot only between a unit's pre-hook and its forward
hook (and again in its backward); elsewhere they are empty. Activation
checkpointing works: a forward recomputed during backward finds its unit
gathered already, and the forward hooks leave the runtime alone then. The gradient copy
costs one device copy per parameter, as FSDP2's copy-in does; the layout
conversions around the collectives are gone.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from . import _dtypes
from ._errors import TideInvalid
from .fsdp import AdamW, ShardedModel

if TYPE_CHECKING:
    from ._group import Group

# The first unit's backward pre-hook fires with no input gradients (its inputs are data):
# that is the point of the hook here, not a surprise worth a warning every step.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are "
                        "computed with respect to module outputs", category=UserWarning)


def shard_module(module: Any, units: Sequence[Any], *, group: Optional[Group] = None,
                 param_dtype: Any = None, optimizer: Optional[AdamW] = None,
                 prefetch: int = 1, comm: str = "tide",
                 keep_param_shards: bool = False) -> ShardedModule:
    """Shard ``module``'s parameters by ``units`` (submodules, in execution order).

    Args:
        module: the model; every parameter must belong to exactly one unit.
        units: submodules in the order their forward runs (e.g. embedding,
            each block, then the head).
        group: the tidearray group (default: the last ``init``).
        param_dtype: dtype of the gathered parameters and gradients (a torch or
            NumPy dtype; default: the parameters' own).
        optimizer: AdamW hyper-parameters for the fused optimizer.
        prefetch: units gathered ahead (1).
        comm: ``"tide"``, ``"stock"`` or ``"local"`` (see ``ShardedModel``).
        keep_param_shards: keep param-dtype shards instead of casting the fp32
            masters at every gather: no cast kernels, more memory (see ``ShardedModel``).

    Returns:
        The :class:`ShardedModule`; call the module as before, then ``.step()``.

    Raises:
        TideInvalid: a parameter in no unit or in two, or an unsupported dtype.
    """
    return ShardedModule(module, units, group=group, param_dtype=param_dtype,
                         optimizer=optimizer, prefetch=prefetch, comm=comm,
                         keep_param_shards=keep_param_shards)


class ShardedModule:
    """A module whose units are sharded by tidearray. Made by :func:`shard_module`."""

    def __init__(self, module: Any, units: Sequence[Any], *, group: Group, param_dtype: Any,
                 optimizer: Optional[AdamW], prefetch: int, comm: str,
                 keep_param_shards: bool = False) -> None:
        self.module = module
        self.units = list(units)
        self.params = [list(u.parameters()) for u in self.units]
        _check_cover(module, self.params)
        self.shapes = [[tuple(p.shape) for p in ps] for ps in self.params]
        self._index = {id(p): k for ps in self.params for k, p in enumerate(ps)}
        first = self.params[0][0]
        dtype = _numpy_dtype(param_dtype if param_dtype is not None else first.dtype)
        by_name = {f"{i}.{name}": p for i, u in enumerate(self.units)
                   for name, p in u.named_parameters()}
        named = [[(f"{i}.{name}", tuple(p.shape)) for name, p in u.named_parameters()]
                 for i, u in enumerate(self.units)]
        # One fp32 copy of one parameter at a time (``init``), not of the whole model.
        # Autograd may start unit i-1's backward before unit i's gradients are all in:
        # the runtime then defers unit i-2's prefetch until unit i's slot is free.
        self.model = ShardedModel(named, init=lambda name, shape: _host_or_device(by_name[name]),
                                  group=group, param_dtype=dtype, optimizer=optimizer,
                                  prefetch=prefetch, comm=comm,
                                  keep_param_shards=keep_param_shards)
        self.device = first.device
        self._empty = [[_placeholder(p, dtype) for p in ps] for ps in self.params]
        self._grads: dict[int, list] = {}
        self._views: dict[tuple[str, int], tuple[list, list]] = {}
        self._pending: dict[int, int] = {}
        for i, ps in enumerate(self.params):
            for p, e in zip(ps, self._empty[i]):
                p.data = e
        self._hooks = self._register()

    def _register(self) -> list:
        hooks = []
        for i, u in enumerate(self.units):
            hooks.append(u.register_forward_pre_hook(functools.partial(self._pre_forward, i)))
            hooks.append(u.register_forward_hook(functools.partial(self._post_forward, i)))
            hooks.append(u.register_full_backward_pre_hook(
                functools.partial(self._pre_backward, i)))
            for p in self.params[i]:
                hooks.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, i)))
        return hooks

    # -- hooks --------------------------------------------------------------------

    def _torch_views(self, what: str, i: int, arrays: list) -> list:
        """Torch views of unit ``i``'s ``arrays``, made again only when the runtime hands
        out other arrays: its gathers and gradient buffers are the same lists step after
        step (unit ``i`` always takes the same slot)."""
        hit = self._views.get((what, i))
        if hit is None or hit[0] is not arrays:
            hit = self._views[(what, i)] = (arrays, [_tensor(a, s) for a, s in
                                                     zip(arrays, self.shapes[i])])
        return hit[1]

    def _point(self, i: int, arrays: list) -> None:
        for p, t in zip(self.params[i], self._torch_views("params", i, arrays)):
            p.data = t

    def _pre_forward(self, i: int, module: Any, args: Any) -> None:
        if _in_backward():  # activation checkpointing recomputes the forward in backward:
            return  # the unit is gathered already (its backward pre-hook ran)
        self._point(i, self.model.pre_forward(i))

    def _post_forward(self, i: int, module: Any, args: Any, output: Any) -> None:
        if _in_backward():
            return
        self.model.post_forward(i)
        if i != len(self.units) - 1:
            for p, e in zip(self.params[i], self._empty[i]):
                p.data = e

    def _pre_backward(self, i: int, module: Any, grad_output: Any) -> None:
        params, grads = self.model.pre_backward(i)
        self._point(i, params)
        self._grads[i] = self._torch_views("grads", i, grads)
        self._pending[i] = len(self.params[i])

    def _grad_ready(self, i: int, param: Any) -> None:
        self._grads[i][self._index[id(param)]].copy_(param.grad)
        param.grad = None
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self.model.post_backward(i)
            for p, e in zip(self.params[i], self._empty[i]):
                p.data = e

    # -- the step -------------------------------------------------------------------

    def step(self, lr: Optional[float] = None) -> Optional[float]:
        """The fused AdamW on every shard (see :meth:`ShardedModel.step`)."""
        return self.model.step(lr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def remove(self) -> None:
        """Remove the hooks (the parameters stay empty; export the model first)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Remove the hooks and release the runtime's communicators (collective)."""
        self.remove()
        self.model.close()


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    import torch

    return torch._C._current_graph_task_id() != -1


def _check_cover(module: Any, params: list) -> None:
    seen: dict[int, int] = {}
    for i, ps in enumerate(params):
        if not ps:
            raise TideInvalid(f"unit {i}: expected a submodule with parameters, got none")
        for p in ps:
            if id(p) in seen:
                raise TideInvalid(f"expected each parameter in one unit, got one in units "
                                  f"{seen[id(p)]} and {i}")
            seen[id(p)] = i
    missing = [n for n, p in module.named_parameters() if id(p) not in seen]
    if missing:
        raise TideInvalid(f"expected every parameter in a unit, got {len(missing)} in none: "
                          f"{missing[:5]}")


def _numpy_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).replace("torch.", "")
    if name not in _dtypes.SUPPORTED:
        raise TideInvalid(f"param_dtype: expected bfloat16, float16 or float32, got {dtype}")
    return _dtypes.SUPPORTED[name]


def _host_or_device(p: Any) -> Any:
    """The parameter's values as an array tidearray can shard (fp32 on the host)."""
    import torch

    t = p.detach()
    if t.device.type == "cpu":
        return t.to(torch.float32).numpy()
    import cupy

    return cupy.from_dlpack(t.to(torch.float32))


def _placeholder(p: Any, dtype: np.dtype) -> Any:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype.name), device=p.device)


def _tensor(a: Any, shape: Any) -> Any:
    """A torch view of a tidearray array (NumPy or CuPy), no copy; bf16 included."""
    import torch

    if isinstance(a, np.ndarray):
        if a.dtype == _dtypes.bfloat16:  # NumPy's DLPack has no bf16: move the bits
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(a).reshape(shape)
    return torch.from_dlpack(a).reshape(shape)
