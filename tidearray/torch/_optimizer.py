"""The optimizer over the shards: the runtime's fused AdamW, or any torch optimizer over torch
views of the fp32 shards ([Note: torch front end] in ``_sharding``).

[Note: the optimizer bridge]
``optimizer=`` is the fused AdamW's settings (the runtime steps it; torch-style
``param_groups`` become the runtime's ``(AdamW, names)`` pairs), or
``make(params)``: a torch optimizer made over :func:`shard_tensors`, the fp32
master shards as torch Parameters whose ``.grad`` is the runtime's gradient
shard. The runtime averages (and clips) the gradients, then
:meth:`OptimizerBridge.step` runs the torch optimizer with no ``.grad`` on a
shard that no rank gave a gradient (torch's optimizers skip those, as in one
process) and every other trained shard's ``.grad`` set back to the gradient
shard if anything replaced it. The torch optimizer's ``zero_grad()`` is routed
to the model's, which drops the accumulated gradients as torch does, instead of
setting the shards' ``.grad`` to None.

With the fused AdamW, ``model.sharding.optimizer`` is :class:`FusedAsTorch`, a
``torch.optim.Optimizer`` whose ``param_groups`` are the fused AdamW's groups (the
default first, then ``param_groups=``'s, each with the model's parameters), so
that torch's learning-rate schedulers, which edit ``group["lr"]``, drive it: a step
with no ``lr=`` takes each group's lr from there (the sequence form of
``FusedAdamW.step``'s ``lr``). Its betas, eps and weight decay are fixed when the
model is sharded: a change to them (``OneCycleLR`` cycles the betas by default)
raises instead of being ignored. Its own state is the model's
(``model.state_dict(full=False)`` holds the moments), so its ``state_dict()``
raises rather than save nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from .._errors import TideInvalid
from .._validate import check
from ..fsdp import AdamW
from ._storage import as_tensor

if TYPE_CHECKING:
    from ..fsdp import Runtime

#: ``optimizer=``: the fused AdamW's settings, or a function making any torch optimizer
#: from the fp32 shards (see :func:`shard_tensors`).
Optimizer = Union[AdamW, Callable[[list], Any], None]


def split_optimizer(optimizer: Optimizer) -> tuple[Optional[AdamW], Optional[Callable]]:
    """``optimizer=`` as the fused AdamW's settings or a torch optimizer's maker (one is
    None)."""
    if optimizer is None or isinstance(optimizer, AdamW):
        return optimizer, None
    if callable(optimizer):
        return None, optimizer
    kind = type(optimizer)
    made = (f"a {kind.__module__}.{kind.__qualname__} made already (over the model's "
            "parameters, which sharding empties): pass the function that makes it, "
            "optimizer=lambda shards: ...(shards, ...)"
            if isinstance(optimizer, torch.optim.Optimizer) else kind.__qualname__)
    raise TideInvalid("optimizer: expected a tidearray.fsdp.AdamW or a function making a "
                      f"torch optimizer from a list of tensors, got {made}")


_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay"}


def runtime_groups(groups: Sequence[dict], fused: Optional[AdamW], all_names: dict,
                   names: list, *, torch_optimizer: bool = False) -> list:
    """Torch-style groups as the runtime's ``(AdamW, names)`` pairs (``all_names``:
    ``id(param)`` -> its names; ``names``: per unit, its parameters' names). They configure
    the fused AdamW: with a torch optimizer (``torch_optimizer``) they would be ignored."""
    if torch_optimizer and groups:
        raise TideInvalid(f"param_groups: expected none with a torch optimizer (optimizer= a "
                          f"function), got {len(groups)} group(s): they configure the fused "
                          "AdamW; make the torch optimizer's groups in the function, from the "
                          "tensors it is given")
    base = fused or AdamW()
    known = {n for ns in names for n in ns}
    out = []
    for j, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g or set(g) - _GROUP_KEYS:
            raise TideInvalid(f"param_groups[{j}]: expected a dict with 'params' and any of "
                              f"lr, betas, eps, weight_decay, got {g!r}"[:300])
        chosen = []
        for p in g["params"]:
            name = p if isinstance(p, str) else all_names.get(id(p), (None,))[0]
            if name not in known:
                raise TideInvalid(f"param_groups[{j}]: expected parameters of the model (or "
                                  f"their names), got {p if isinstance(p, str) else type(p)}")
            chosen.append(name)
        opts = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
        out.append((replace(base, max_grad_norm=None, **opts), chosen))
    return out


def shard_tensors(runtime: Runtime) -> list:
    """This rank's fp32 master shards as torch tensors (padded rows), each trained one
    with its fp32 gradient shard as ``.grad``; a frozen shard has no ``.grad`` (and
    ``requires_grad=False``)."""
    out = []
    for u in range(runtime.num_units):
        trainable = runtime.trainable[u]
        for k, (m, g) in enumerate(zip(runtime.params(u), runtime.grads(u))):
            t = torch.nn.Parameter(as_tensor(m, m.shape), requires_grad=trainable[k])
            if trainable[k]:
                t.grad = as_tensor(g, g.shape)
            out.append(t)
    return out


class OptimizerBridge:
    """The optimizer a sharded model steps ([Note: the optimizer bridge]).

    Args:
        runtime: the runtime (its fused AdamW, or its shards for a torch optimizer).
        make: ``make(shards)`` -> a torch optimizer, or None (the fused AdamW).
        zero_grad: the model's ``zero_grad``, which the torch optimizer's calls.

    Attributes:
        kind: ``"fused"`` or ``"torch"``.
        optimizer: the fused AdamW, or the torch optimizer ``make`` returned.
    """

    def __init__(self, runtime: Runtime, make: Optional[Callable[[list], Any]],
                 zero_grad: Callable[[], None], step: Callable[[Optional[float]], Any],
                 groups: Sequence[list]) -> None:
        self.runtime = runtime
        self.kind = "fused" if make is None else "torch"
        self._shards = shard_tensors(runtime) if make is not None else []
        self._shard_grads = [t.grad for t in self._shards]  # the runtime's, set back each step
        if make is None:
            fused = runtime.optimizer
            hps = [fused.hp, *(g.hp for g in fused.groups)]
            self.optimizer: Any = FusedAsTorch(list(zip(hps, groups)), fused, step, zero_grad)
        else:
            self.optimizer = make(self._shards)
            check(runtime.group, "shard_module: optimizer=",
                  (("type", type(self.optimizer).__qualname__),),
                  _reads_across(self.optimizer, runtime))
            _route_zero_grad(self.optimizer, zero_grad)

    def step(self, lr: Any) -> Any:
        """One step: the fused AdamW's at ``lr`` (its norm when it clips, else None;
        :class:`FusedAsTorch` resolves the lr), or the torch optimizer's over the averaged
        gradients (None)."""
        if self.kind == "fused":
            return self.runtime.step(lr)
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        self.runtime.apply_step(self._torch_step,  # each group's lr, agreed across ranks
                                lr=[g["lr"] for g in self.optimizer.param_groups])
        return None

    def _torch_step(self, present: Any) -> None:
        """The torch optimizer's step over the shards, with no ``.grad`` on a parameter that
        no rank gave a gradient. Each other trained shard's ``.grad`` is the runtime's
        gradient shard, set back if anything replaced it (the optimizer's ``zero_grad()``
        goes to the model's and leaves them; a ``p.grad = None`` of the user's does not
        skip a parameter that got a gradient)."""
        # Set only what differs: a step of a large model touches few ``.grad``s.
        for t, g, ok in zip(self._shards, self._shard_grads, present):
            want = g if ok else None
            if t.grad is not want:
                t.grad = want
        try:
            self.optimizer.step()
        finally:
            for t, g in zip(self._shards, self._shard_grads):
                if t.grad is not g:
                    t.grad = g


class FusedAsTorch(torch.optim.Optimizer):
    """The fused AdamW as a ``torch.optim.Optimizer``, for torch's learning-rate schedulers
    ([Note: the optimizer bridge]): ``step()`` and ``zero_grad()`` are the model's.

    The model's ``step(lr)`` comes through here too (:meth:`step_at`), so that what torch
    hangs on an optimizer's ``step`` (a scheduler's check that the optimizer stepped,
    ``register_step_post_hook``) sees every step, whichever of the two the loop calls.

    Args:
        groups: per group of the fused AdamW (the default first), its hyper-parameters
            and the model's parameters in it.
        fused: the runtime's ``FusedAdamW``.
        step: one step of the model at an lr (None, a real, or one per group); returns
            the clip's norm or None.
        zero_grad: the model's ``zero_grad``.

    Attributes:
        norm: what the last step returned (the global gradient norm when it clipped).
    """

    #: The group keys only the model's sharding sets (a change is refused).
    FIXED = ("betas", "eps", "weight_decay")

    def __init__(self, groups: Sequence[tuple[AdamW, list]], fused: Any,
                 step: Callable[[Optional[float]], Any], zero_grad: Callable[[], None]) -> None:
        super().__init__([{"params": params, **_torch_hp(hp)} for hp, params in groups],
                         _torch_hp(groups[0][0]))
        self._hps = [hp for hp, _ in groups]
        #: The runtime's ``FusedAdamW`` (its moments, step counts, groups).
        self.fused = fused
        self.norm: Any = None
        self._lr: Any = None  # step_at's lr, for the step it calls
        self._model_step, self._model_zero_grad = step, zero_grad

    def scheduled_lrs(self) -> Optional[list[float]]:
        """Each group's lr, the default group's first, where one differs from the lr the
        model was sharded with (a scheduler's); else None (each group's own).

        Raises:
            TideInvalid: a group's betas, eps or weight decay changed.
        """
        changed = False
        for j, (group, hp) in enumerate(zip(self.param_groups, self._hps)):
            for key in self.FIXED:
                want, got = getattr(hp, key), group[key]
                if (tuple(got) if key == "betas" else got) != want:
                    raise TideInvalid(
                        f"optimizer.param_groups[{j}][{key!r}]: expected {want!r} (the fused "
                        f"AdamW takes a new lr each step, its {key} is fixed when the model "
                        f"is sharded), got {got!r}; a scheduler that cycles momentum "
                        "(OneCycleLR, CyclicLR) needs cycle_momentum=False")
            changed = changed or group["lr"] != hp.lr
        return [group["lr"] for group in self.param_groups] if changed else None

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The model's step at the groups' lrs (or :meth:`step_at`'s); returns
        ``closure()``'s loss, as torch's."""
        lr, self._lr = self._lr, None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group_lrs = self.scheduled_lrs()  # (also checks what may not change)
        self.norm = self._model_step(group_lrs if lr is None else lr)
        return loss

    def step_at(self, lr: Optional[float]) -> Any:
        """The model's ``step(lr)``: :meth:`step` as torch calls it (its wrappers and
        hooks around it), at ``lr`` if given; returns the clip's norm or None."""
        self._lr = lr
        self.step()
        return self.norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._model_zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_hps"):  # after the constructor's own calls
            raise TideInvalid("optimizer.add_param_group: the fused AdamW's groups are fixed "
                              "when the model is sharded (shard_module's param_groups=)")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        raise TideInvalid("optimizer.state_dict(): the fused AdamW's state (its moments and "
                          "step counts) is in the model's sharded state dict: "
                          "model.state_dict(full=False)")

    def load_state_dict(self, state_dict: dict) -> None:
        raise TideInvalid("optimizer.load_state_dict(): the fused AdamW's state loads with "
                          "the model's sharded state dict: model.load_state_dict(state)")


def _torch_hp(hp: AdamW) -> dict:
    return {"lr": hp.lr, "betas": hp.betas, "eps": hp.eps, "weight_decay": hp.weight_decay}


def _reads_across(optimizer: Any, runtime: Runtime) -> list[str]:
    """This rank's finding if ``optimizer`` is one of torch's whose update of a parameter
    reads across its elements (Adafactor's factored moments: row and column means) while
    the parameters are sharded: over a rank's rows it would step otherwise than over the
    whole parameter, silently. Optimizers of other libraries are not told apart."""
    adafactor = getattr(torch.optim, "Adafactor", None)  # torch >= 2.5
    if runtime.world > 1 and adafactor is not None and isinstance(optimizer, adafactor):
        return [f"expected an optimizer that updates element by element (SGD, Adam, AdamW, "
                f"...), got {type(optimizer).__name__}, whose factored moments over this "
                f"rank's rows would differ from those of the whole parameter"]
    return []


def _route_zero_grad(optimizer: Any, zero_grad: Callable[[], None]) -> None:
    """``optimizer.zero_grad()`` (the torch optimizer over the shards) drops the accumulated
    gradients through ``zero_grad``, as in torch, instead of setting the shards' ``.grad``
    to None (the runtime's gradient shards, which the optimizer must keep seeing)."""
    if not callable(getattr(optimizer, "zero_grad", None)):
        return

    def routed(set_to_none: bool = True) -> None:
        zero_grad()

    optimizer.zero_grad = routed
