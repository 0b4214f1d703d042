"""``shard_module``: a ``torch.nn.Module`` sharded in place; the model is the one handle.

[Note: the sharded class]
As ``fully_shard`` mixes ``FSDPModule`` into a module's class, :func:`shard_module`
swaps the module's class for a subclass of :class:`ShardedModule` and of the class the
module had (made once per class). It keeps the class's name: tools that record a
model's class by name (Hugging Face's ``save_pretrained`` writes it into the config's
``architectures``, which loaders read) see the model's own. The user's ``model`` is then
the sharded model: ``isinstance(model, nn.Module)`` and of its own class holds, torch
utilities, ``torch.compile``, Hugging Face's ``generate`` and trainers take it, and it
also has what a sharded model needs: :meth:`~ShardedModule.step`,
:meth:`~ShardedModule.clip_grad_norm_`, a ``state_dict`` that gathers, a captured step,
and ``model.sharding`` (:class:`~tidearray.torch._sharding.Sharding`: the units, the
runtime, the optimizer). Everything the mixin adds has a name ``nn.Module`` does not
use, or keeps the semantics of ``nn.Module``'s own (``state_dict``, ``load_state_dict``,
``zero_grad``, ``_apply``): the attributes of the user's class stay untouched but for ``sharding``
and the names below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from .._errors import TideInvalid
from . import _init
from ._optimizer import Optimizer
from ._sharding import Sharding

if TYPE_CHECKING:
    from .._group import Group

#: The class each module class is swapped for, made once per class and refused set.
_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def shard_module(module: torch.nn.Module, units: Optional[Sequence[Any]] = None, *,
                 group: Optional[Group] = None, param_dtype: Any = None,
                 optimizer: Optimizer = None, param_groups: Sequence[dict] = (),
                 prefetch: int = 1, num_slots: Optional[int] = None, comm: Any = "tide",
                 keep_param_shards: bool = False, init_fn: Optional[_init.InitFn] = None,
                 checkpoint: Optional[str] = None, device: Any = None) -> Any:
    """Shard ``module``'s parameters by ``units``, as ``fully_shard`` on each unit and then
    on the model does, and return ``module`` itself, its class swapped for one that
    mixes :class:`ShardedModule` into it. Collective: every rank shards the same model.

    Args:
        module: the model (the root unit owns what no other unit owns).
        units: modules, or lists of modules, in the order their forwards begin
            (say each decoder layer); each owns its subtree's parameters that no
            nested unit owns. None: the whole model is one unit.
        group: the tidearray group (default: the last ``init``).
        param_dtype: dtype of the gathered parameters and gradients (a torch or
            NumPy dtype; default: the parameters' own, which must then be one dtype).
        optimizer: AdamW hyper-parameters for the fused optimizer (default
            ``AdamW()``), or ``make(params) -> torch.optim.Optimizer`` to step
            the fp32 shards with any torch optimizer.
        param_groups: torch-style groups for the fused AdamW: dicts with
            ``params`` (parameters or their names) and any of ``lr``, ``betas``,
            ``eps``, ``weight_decay``; the rest of the parameters use ``optimizer``.
        prefetch: units gathered ahead (1).
        num_slots: slots the units take turns in (``prefetch + 1`` if None); units in
            use at once (nested units) need more: the runtime says how many.
        comm: ``"tide"`` (default) or a comm factory (a ``UnitComm`` subclass;
            see ``Runtime``), such as the benchmarks' baselines.
        keep_param_shards: keep param-dtype shards instead of casting the fp32
            masters at every gather (see ``Runtime``).
        init_fn: for a model on the meta device: initialises one module
            materialised alone (default: a Hugging Face model's ``_init_weights``,
            else each module's ``reset_parameters()``).
        checkpoint: for a model on the meta device: a ``.safetensors`` file or a
            directory of them, read one tensor at a time.
        device: the device of the gathered parameters and buffers of a meta
            model (default: the group's GPU, or the CPU on the host backend).

    Returns:
        ``module``, still an instance of its own class (and of :class:`ShardedModule`):
        call it, ``.train()``/``.eval()`` it, ``torch.compile`` it or ``.generate()``
        with it as before, then ``.step()``.

    Raises:
        TideInvalid: on every rank: bad units, an unsupported dtype, or ranks
            whose models differ (unit count, parameter names, shapes, dtypes or
            which are trained), naming the unit and the parameter; a module sharded
            already.
    """
    if isinstance(module, ShardedModule):
        raise TideInvalid(f"shard_module: expected a module not sharded yet, got a "
                          f"{type(module).__name__} sharded already")
    module._tide_sharding = Sharding(
        module, units, group=group, param_dtype=param_dtype, optimizer=optimizer,
        param_groups=param_groups, prefetch=prefetch, num_slots=num_slots, comm=comm,
        keep_param_shards=keep_param_shards, init_fn=init_fn, checkpoint=checkpoint,
        device=device)
    module.__class__ = _sharded_class(type(module), _refused(module))
    return module


#: peft's calls that write the adapters into the base weights or hand out the base model
#: (a ``PeftModel`` forwards them to its tuner), and Hugging Face's, which reallocate a
#: weight. On a sharded model the weights are empty placeholders outside a unit's forward,
#: so each would merge into nothing, return a model without weights or give a weight that
#: no unit holds: the sharded class refuses those the model has.
_WEIGHT_EDITS = ("merge_and_unload", "merge_adapter", "unmerge_adapter", "unload",
                 "resize_token_embeddings")


def _refused(module: Any) -> tuple[str, ...]:
    """The calls of :data:`_WEIGHT_EDITS` that ``module`` has (its sharded class refuses)."""
    return tuple(name for name in _WEIGHT_EDITS if hasattr(module, name))


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TideInvalid(
            f"{name}(): expected a plain model, got a sharded {type(self).__name__} (its "
            "weights are shards in the runtime, empty placeholders outside forward): take "
            "model.state_dict() on every rank, load it into a plain model of the same "
            f"make and call {name}() there (or call it before shard_module)")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def _sharded_class(cls: type, refused: tuple[str, ...] = ()) -> type:
    sharded = _SHARDED_CLASSES.get((cls, refused))
    if sharded is None:
        sharded = _SHARDED_CLASSES[cls, refused] = type(cls.__name__, (ShardedModule, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            **{name: _refusal(name) for name in refused}})
    return sharded


class ShardedModule:
    """Mixed into a module's own class by :func:`shard_module` ([Note: the sharded class]):
    the sharded model's step, clip, state dicts and captured step, on the one handle."""

    def __deepcopy__(self, memo: dict) -> Any:
        raise TideInvalid(
            f"copy.deepcopy: expected a plain model, got a sharded {type(self).__name__}: its "
            "weights are shards in the runtime and its group's communicators cannot be "
            "copied. Copy the model before shard_module (an EMA or reference model), or "
            "load model.state_dict(), taken on every rank, into a plain model of the same make")

    @property
    def sharding(self) -> Sharding:
        """The units, the runtime, the hooks and the optimizer over the shards."""
        return self.__dict__["_tide_sharding"]

    def step(self, lr: Optional[float] = None) -> Any:
        """Step the optimizer on every shard (collective): the fused AdamW, or the torch
        optimizer ``optimizer=`` made; ``lr`` overrides the learning rate.

        Returns:
            The fused AdamW's gradient norm when it clips (as :meth:`clip_grad_norm_`
            returns it), else None.
        """
        return self.sharding.step(lr)

    def clip_grad_norm_(self, max_norm: float) -> Union[float, torch.Tensor]:
        """Clip the gradient (averaged over the ranks) to the global norm ``max_norm`` at the next
        :meth:`step`, as ``torch.nn.utils.clip_grad_norm_`` (collective).

        Returns:
            The total norm over every rank's shard, before clipping: a float, or,
            inside ``torch.cuda.graph``'s capture (a captured step), a 0-d float64
            tensor on the device, which each replay overwrites.
        """
        return self.sharding.clip_grad_norm_(max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last :meth:`step`, as torch's
        ``zero_grad`` does: a backward after it starts the step afresh (a skipped batch's
        gradients never reach a step). Before a backward, or right after a step, there
        is nothing to drop. Not inside a backward (``TideInvalid``)."""
        self.sharding.zero_grad()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def shard_parameters(self) -> list:
        """This rank's fp32 master shards as torch tensors, each trained one with its fp32
        gradient shard as ``.grad`` (see :meth:`Sharding.shard_parameters`)."""
        return self.sharding.shard_parameters()

    def capture_step(self, step: Callable[[], Any]) -> Any:
        """Capture ``step`` (one whole training step, ending in :meth:`step`) with
        ``torch.cuda.graph``; calling the result replays it ([Note: torch captured
        steps] in ``tidearray.torch._graph``)."""
        from ._graph import TorchCapturedStep

        return TorchCapturedStep(self.sharding, step)

    def state_dict(self, *, destination: Optional[dict] = None, prefix: str = "",
                   keep_vars: bool = False, full: bool = True, cpu: bool = True,
                   rank0_only: bool = False) -> dict:
        """The model's state dict under its own names, as ``nn.Module.state_dict`` gives
        it, gathered (collective): full tensors (``full=True``), on the CPU unless
        ``cpu=False``, on rank 0 only with ``rank0_only``; or, with ``full=False``, this
        rank's shards and the optimizer's state (see :mod:`tidearray.torch._state`).
        ``destination`` and ``prefix`` act as ``nn.Module``'s (a parent's state dict);
        the tensors are copies whatever ``keep_vars`` says."""
        from ._state import state_dict

        out = state_dict(self.sharding, full=full, cpu=cpu, rank0_only=rank0_only)
        if destination is None and not prefix:
            return out
        destination = {} if destination is None else destination
        destination.update((prefix + k, v) for k, v in out.items())
        return destination

    def load_state_dict(self, state_dict: dict, strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a full or sharded state dict (collective), as ``nn.Module``'s does.

        Returns:
            The keys missing and unexpected (``strict=False``), as torch returns them.

        Raises:
            TideInvalid: on every rank, for a state that does not fit; ``assign=True``
                (the parameters' storage is the runtime's).
        """
        from ._state import load_state_dict

        if assign:
            raise TideInvalid("load_state_dict(assign=True): expected assign=False, got True "
                              "(a sharded model's parameters live in the runtime's storage)")
        return load_state_dict(self.sharding, state_dict, strict=strict)

    def _apply(self, fn: Callable, recurse: bool = True) -> Any:
        """``to()``, ``cuda()``, ``half()`` and the like: the buffers follow; the sharded
        parameters' device and dtype are the runtime's, so a conversion that would change
        them is refused (a no-op one, ``model.to(its own device)``, passes)."""
        sharding = self.sharding
        # Every placeholder has the one device and param_dtype: one tells for all.
        e = sharding.storage.sample()
        moved = fn(e) if e is not None else None
        if moved is not None and (moved.device != e.device or moved.dtype != e.dtype):
            raise TideInvalid(
                f"{type(self).__name__}: expected a conversion that keeps the sharded "
                f"parameters on {e.device} in {e.dtype} (shard_module's device= and "
                f"param_dtype=), got one to {moved.device}, {moved.dtype}")
        with sharding.storage.sentinels_cleared():
            return super()._apply(fn, recurse)  # type: ignore[misc]

    def close(self) -> None:
        """Remove the hooks and release the runtime's communicators (collective); the
        parameters stay empty placeholders (take a state dict first)."""
        self.sharding.close()
