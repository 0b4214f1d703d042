"""``Sharding``: what a sharded ``torch.nn.Module`` holds (its ``model.sharding``): the runtime
that owns its units, and the rooms of the torch front end around it, which it builds.

[Note: torch front end]
The torch front end is rooms with one job each, around one
:class:`tidearray.fsdp.Runtime`. A room uses another's public names only (no
``obj._field`` of another class), and none keeps where a unit is in its pass:
that is the runtime's lifecycle ([Note: unit lifecycle] in
``tidearray.fsdp._lifecycle``), which the hooks drive through the runtime and
read (``runtime.life``) to decide.

============== ======================= ==============================================
module         room                    owns
============== ======================= ==============================================
``_sharding``  :class:`Sharding`       building: ``shard_module``'s arguments
                                       checked and translated (units, device,
                                       dtype, checks across ranks), the runtime and
                                       the rooms made and wired; the model's step,
                                       clip, ``zero_grad`` and ``close``
``_hooks``     ``Hooks``               the module and autograd hooks, which report
                                       events to the runtime ([Note: hooks])
``_storage``   ``ParamStorage``        what each parameter's ``.data`` and ``.grad``
                                       are: placeholder, views of the slot and of
                                       the gradient buffer, sentinel
                                       ([Note: parameter storage])
``_streams``   ``TorchStream``         the stream the runtime issues on (torch's
                                       current), and norms handed out on it
``_optimizer`` ``OptimizerBridge``     the fused AdamW or a torch optimizer over the
                                       fp32 shards ([Note: the optimizer bridge])
``_state``     state dicts,            full and sharded state dicts under the
               ``StateDictGuard``      model's names; submodules' refused
``_graph``     ``TorchCapturedStep``   a whole step captured as a CUDA graph
                                       ([Note: torch captured steps])
``_units``,    pure, read once while   which unit owns which parameter; first values
``_init``      building                (deferred init, checkpoints)
``_module``    ``shard_module``,       the class swap; the model's methods call
               ``ShardedModule``       ``Sharding`` and its rooms
============== ======================= ==============================================

One home for each fact:

* **Where each unit is in its pass** (used, running, open, done; whether a
  pass, or its backward, has begun; which modules of a list unit ran their
  forward): the runtime's ``UnitLifecycle``. The hooks read it without a call
  (plain attributes) and begin a pass, or queue the end-of-backward callback,
  at the event that finds it not begun.
* **Unit names and trainable flags**: the runtime's (``runtime.names``,
  ``runtime.trainable``, which its lifecycle shares); :attr:`Sharding.names`
  reads them. The parameters themselves (``Sharding.params``) are the
  storage's list.
* **What a parameter's tensors are**: the storage's. The runtime tells it when
  a unit's slot goes (``on_release``); the hooks, when a unit is gathered or
  opened. Only the storage assigns ``.data`` and ``.grad``.
* **The optimizer's kind and shards**: the bridge's (``bridge.kind``: the
  state dicts and the captured step ask it).

The hot path is the hooks' (several calls per unit per step): each is one
Dynamo-free callable made once ([Note: hooks and Dynamo] in ``_hooks``), reads
the lifecycle's attributes, and calls the runtime and the storage directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch

from .. import _dtypes, _validate
from .._errors import TideInvalid
from ..fsdp import FrontEnd, Runtime
from . import _init, _units
from ._hooks import Hooks
from ._optimizer import Optimizer, OptimizerBridge, runtime_groups, shard_tensors, split_optimizer
from ._state import StateDictGuard
from ._storage import ParamStorage
from ._streams import TorchStream

if TYPE_CHECKING:
    from .._group import Group


class Sharding:
    """What :func:`~tidearray.torch.shard_module` attaches to a module (its ``sharding``):
    the units, the runtime that gathers, reduces and steps them, and the rooms around it
    ([Note: torch front end]).

    Attributes:
        module: the sharded module (the one handle: ``shard_module`` returned it).
        runtime: the :class:`tidearray.fsdp.Runtime` the hooks drive.
        units: the units (``tidearray.torch._units.UnitSpec``), root first if any.
        params: per unit, its parameters (the storage's list).
        names: each unit's parameter names, as the module names them (the runtime's).
        shapes: each unit's parameters' full shapes (the parameters are placeholders).
        optimizer: the fused AdamW, or the torch optimizer ``optimizer=`` made (for
            learning-rate schedulers).
        group: the tidearray group; device: where gathered parameters live.
        storage, stream, hooks, bridge, guard: the rooms.
    """

    def __init__(self, module: torch.nn.Module, units: Optional[Sequence[Any]], *,
                 group: Optional[Group], param_dtype: Any, optimizer: Optimizer,
                 param_groups: Sequence[dict], prefetch: int, num_slots: Optional[int],
                 comm: Any, keep_param_shards: bool, init_fn: Any, checkpoint: Optional[str],
                 device: Any) -> None:
        from .._group import default_group

        self.group = group = group or default_group()
        self.module = module
        self.module_class = type(module)  # the class it had, before shard_module swapped it
        self.spec = spec = _units.resolve(module, units)
        self.units = list(spec.units)
        params = [list(u.params) for u in self.units]
        meta = any(_init.is_meta(p) for ps in params for p in ps)
        self.device = torch.device(device) if device is not None else (
            _default_device(group) if meta else params[0][0].device)
        values = _init.Values(spec, _init.default_init_fn(module, init_fn), checkpoint,
                              group.backend)
        dtype = _checked_dtype(group, spec, values, param_dtype)
        fused, make = split_optimizer(optimizer)
        self.storage = ParamStorage(params, dtype, self.device)
        self.params = self.storage.params
        names = [list(u.names) for u in self.units]  # the runtime keeps them
        groups = runtime_groups(param_groups, fused, spec.all_names, names,
                                torch_optimizer=make is not None)
        self.runtime = Runtime(
            [list(zip(ns, ss)) for ns, ss in zip(names, self.storage.shapes)], init=values,
            group=group, param_dtype=dtype, optimizer=fused, prefetch=prefetch, comm=comm,
            keep_param_shards=keep_param_shards, root=spec.root, num_slots=num_slots,
            trainable=[[bool(p.requires_grad) for p in ps] for ps in params],
            front_end=FrontEnd(report_grads=True, on_release=self.storage.use_placeholders,
                               accumulate="sum",  # as torch's .grad
                               fill_grads=self.storage.fill_grads),
            param_groups=groups)
        if meta or checkpoint is not None:
            _init.materialise_buffers(module, self.device, values)
        values.close()
        self.storage.take_over(spec.aliases, spec.all_names, meta)
        self.stream = TorchStream(self.runtime, self.device, group.backend.device_kind == "gpu")
        self.hooks = Hooks(module, self.units, self.runtime, self.storage, self.stream)
        self.guard = StateDictGuard()
        owners = {id(m): m for ps in self.params for p in ps for m, _ in spec.aliases[id(p)]}
        self._handles = self.hooks.register() + self.guard.register(owners.values())
        try:  # a torch optimizer refused: every rank raises there, so every rank closes
            self.bridge = OptimizerBridge(self.runtime, make, self.zero_grad, self._step,
                                          self._group_params([ns for _, ns in groups]))
        except TideInvalid:
            self.close()
            raise

    @property
    def names(self) -> list[list[str]]:
        """Each unit's parameter names, as the module names them."""
        return self.runtime.names

    @property
    def shapes(self) -> list[list[tuple[int, ...]]]:
        """Each unit's parameters' full shapes, in the order of :attr:`names`. The
        parameters themselves are empty placeholders (``numel()`` is 0), so a sharded
        model's parameters are counted from these."""
        return [list(ss) for ss in self.runtime.shapes]

    @property
    def optimizer(self) -> Any:
        """The fused AdamW as a torch optimizer (its groups, for torch's schedulers), or the
        torch optimizer ``optimizer=`` made ([Note: the optimizer bridge])."""
        return self.bridge.optimizer

    def _group_params(self, group_names: list[list[str]]) -> list[list]:
        """The parameters of each fused AdamW group, the default one (every parameter in
        no named group) first, then those named in ``group_names``."""
        by_name = {n: p for ns, ps in zip(self.names, self.params) for n, p in zip(ns, ps)}
        named = {n for ns in group_names for n in ns}
        default = list({id(p): p for n, p in by_name.items() if n not in named}.values())
        return [default, *([by_name[n] for n in ns] for ns in group_names)]

    # -- the step -------------------------------------------------------------------------

    def step(self, lr: Optional[float] = None) -> Any:
        """The model's ``step`` (:meth:`ShardedModule.step`): the fused AdamW (see
        :meth:`Runtime.step`), through its torch face's ``step()`` so that what torch
        hangs on an optimizer's step (a scheduler's bookkeeping, step hooks) sees it, or
        the torch optimizer ``optimizer=`` made, on the stream torch issues on now."""
        if self.bridge.kind == "fused":
            return self.bridge.optimizer.step_at(lr)
        return self._step(lr)

    def _step(self, lr: Any) -> Any:
        """One step of the bridge at ``lr`` (None, a real, or one per fused group)."""
        if not self.storage.clear_sentinels():  # (set: a backward's end checked them)
            self.hooks.check_grads_taken()
        self.stream.follow()
        return self.stream.norm(self.bridge.step(lr))

    def zero_grad(self) -> None:
        """The model's (and a torch ``optimizer=``'s) ``zero_grad()``: the gradients
        accumulated since the last step are dropped, as torch drops them
        (:meth:`Runtime.zero_grad`); no sentinel ``.grad`` is left."""
        if not self.storage.clear_sentinels():
            self.storage.stray_grads(drop=True)
        self.runtime.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> Union[float, torch.Tensor]:
        """The model's ``clip_grad_norm_`` (:meth:`ShardedModule.clip_grad_norm_`), on the
        stream torch issues on now."""
        self.stream.follow()
        return self.stream.norm(self.runtime.clip_grad_norm_(max_norm))

    def shard_parameters(self) -> list:
        """This rank's fp32 master shards as torch tensors (padded rows), each trained one
        with its fp32 gradient shard as ``.grad``: what a torch optimizer steps
        (``optimizer=``). The runtime sets the gradients to the gradient averaged over
        the ranks (summed over the backwards since the last step) before that step; a
        frozen shard has no ``.grad`` (and ``requires_grad=False``), nor, during a step,
        has a shard that no rank gave a gradient, so a torch optimizer leaves both
        bitwise unchanged ([Note: the optimizer bridge] in ``_optimizer``)."""
        return shard_tensors(self.runtime)

    def close(self) -> None:
        """Remove the hooks and release the runtime's communicators (collective); the
        parameters stay empty placeholders (take a state dict first)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.runtime.close()


def _checked_dtype(group: Group, spec: Any, values: Any, param_dtype: Any) -> np.dtype:
    """The param dtype, once every rank has checked that it built the same model, that a
    checkpoint holds every parameter and, without ``param_dtype``, that the parameters
    have one dtype (``TideInvalid`` on every rank)."""
    errors = [f"checkpoint: expected every parameter, got none for {n!r}"
              for n in values.missing()[:3]]
    if param_dtype is None:
        errors += _mixed_dtypes([u.names for u in spec.units], [u.params for u in spec.units])
    _validate.check(group, "shard_module", _units.signature(spec), errors)
    return _numpy_dtype(param_dtype if param_dtype is not None
                        else spec.units[0].params[0].dtype)


def _mixed_dtypes(names: list[list[str]], params: list[list[Any]]) -> list[str]:
    """The error, if any, of parameters of several dtypes without ``param_dtype``: every
    parameter is gathered in one dtype, so casting some silently (fp32 norms or LoRA
    adapters on a bf16 model gathered in bf16) is refused, as FSDP2 refuses mixed
    dtypes without a ``MixedPrecisionPolicy``."""
    first: dict[Any, str] = {}
    for ns, ps in zip(names, params):
        for n, p in zip(ns, ps):
            first.setdefault(p.dtype, n)
    if len(first) < 2:
        return []
    seen = ", ".join(f"{str(d).replace('torch.', '')} ({n!r}, ...)" for d, n in first.items())
    return [f"param_dtype: every parameter is gathered in one dtype; expected parameters of "
            f"one dtype or param_dtype= (the dtype to gather in), got {seen}"]


def _numpy_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).replace("torch.", "")
    if name not in _dtypes.SUPPORTED:
        raise TideInvalid(f"param_dtype: expected bfloat16, float16 or float32, got {dtype}")
    return _dtypes.SUPPORTED[name]


def _default_device(group: Group) -> torch.device:
    if group.backend.device_kind == "gpu":
        return torch.device("cuda", group.backend.device)
    return torch.device("cpu")
