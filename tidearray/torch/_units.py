"""Which parameters each unit owns, as ``fully_shard`` applied bottom-up decides it.

Pure bookkeeping over a module tree; nothing here is collective or touches data.

A unit is a module or a list of modules. It owns the parameters of its
subtree(s) that no unit nested inside it owns. A parameter registered in
several places (a weight tied between the embedding and the head) belongs to
the innermost unit whose subtree holds every place it is registered; where no
unit holds them all, and for every parameter no unit owns, the root owns it:
the model itself, gathered for the whole forward and backward, as FSDP2 keeps
its root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .._errors import TideInvalid


@dataclass(frozen=True)
class UnitSpec:
    """One unit: the modules whose forward hooks gather it and the parameters it owns."""

    modules: tuple
    """The modules of the unit (for the root: the model itself)."""
    names: tuple[str, ...]
    """Each owned parameter's name in the model (its first name, as
    ``named_parameters()`` gives it)."""
    params: tuple
    """The owned parameters, in the order of ``names``."""


@dataclass(frozen=True)
class ModelUnits:
    """A model's units in the runtime's order: the root first where it owns anything."""

    units: tuple[UnitSpec, ...]
    root: bool
    """Whether ``units[0]`` is the root."""
    aliases: dict
    """``id(param)`` -> every ``(module, attribute)`` the parameter is registered under."""
    all_names: dict
    """``id(param)`` -> every name the parameter has in the model."""


def resolve(model: Any, units: Optional[Sequence[Any]]) -> ModelUnits:
    """The units of ``model``: ``units`` in the order their forwards begin, then the root.

    Raises:
        TideInvalid: a unit that is not a submodule of ``model``, a module in two
            units, or a unit that owns no parameter.
    """
    members = _members(model, units)
    # Every module's subtree size, and for every module the units whose subtrees hold it.
    holders: dict[int, list[int]] = {}
    size = []
    for j, ms in enumerate(members):
        sub = {id(s) for m in ms for s in m.modules()}
        size.append(len(sub))
        for s in sub:
            holders.setdefault(s, []).append(j)
    by_module = {name: m for name, m in model.named_modules(remove_duplicate=False)}
    aliases: dict[int, list] = {}
    all_names: dict[int, list[str]] = {}
    params: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        aliases.setdefault(id(p), []).append((by_module[owner_name], attr))
        all_names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    owned: list[list[int]] = [[] for _ in members]
    rest: list[int] = []
    for pid in params:
        places = [set(holders.get(id(m), ())) for m, _ in aliases[pid]]
        common = set.intersection(*places)
        if common:
            owned[min(common, key=lambda j: size[j])].append(pid)
        else:
            rest.append(pid)
    for j, pids in enumerate(owned):
        if not pids:
            raise TideInvalid(f"unit {j}: expected a unit that owns parameters, got none "
                              f"(every parameter of its {type(members[j][0]).__name__} is "
                              "owned by a unit nested in it, or it has none)")
    specs = [UnitSpec(ms, tuple(all_names[p][0] for p in pids), tuple(params[p] for p in pids))
             for ms, pids in zip(members, owned)]
    root = bool(rest)
    if root:
        specs.insert(0, UnitSpec((model,), tuple(all_names[p][0] for p in rest),
                                 tuple(params[p] for p in rest)))
    if not specs:
        raise TideInvalid("expected a model with parameters, got none")
    return ModelUnits(tuple(specs), root, {k: tuple(v) for k, v in aliases.items()},
                      {k: tuple(v) for k, v in all_names.items()})


def _members(model: Any, units: Optional[Sequence[Any]]) -> list[tuple]:
    """Each unit's modules, checked: submodules of ``model``, each in one unit."""
    import torch

    modules = {id(m): m for m in model.modules()}
    members: list[tuple] = []
    seen: dict[int, int] = {}
    for j, u in enumerate(units or []):
        ms = tuple(u) if isinstance(u, (list, tuple)) else (u,)
        if not ms or not all(isinstance(m, torch.nn.Module) for m in ms):
            raise TideInvalid(f"unit {j}: expected a module or a list of modules, got "
                              f"{type(u).__name__}")
        for m in ms:
            if id(m) not in modules or m is model:
                raise TideInvalid(f"unit {j}: expected a submodule of the model (the model "
                                  f"itself is the root), got a {type(m).__name__} outside it")
            if id(m) in seen:
                raise TideInvalid(f"expected each module in one unit, got a "
                                  f"{type(m).__name__} in units {seen[id(m)]} and {j}")
            seen[id(m)] = j
        members.append(ms)
    return members


def signature(model_units: ModelUnits) -> tuple:
    """What must be equal on every rank: per unit, each parameter's name, shape, dtype and
    whether it is trained (``_validate.check`` names the first difference)."""
    sig: list[tuple] = [("units", len(model_units.units)), ("root", model_units.root)]
    for i, u in enumerate(model_units.units):
        sig.append((f"unit {i} parameters",
                    tuple((n, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                           bool(p.requires_grad)) for n, p in zip(u.names, u.params))))
    return tuple(sig)
