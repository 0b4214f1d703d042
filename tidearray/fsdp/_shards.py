"""The model's parameters and their shard arena: every parameter's fp32 master shard,
fp32 gradient shard and param-dtype send shard, each kind in one flat array.

The runtime's units, as given, are checked and described here (names, shapes,
trainable flags), and each parameter, found by its unit and index or by its name,
is an element range of the arena: what the optimizer's parameter groups and
per-parameter step counts are made of.

Units are laid out one after another; inside a unit, shards sit at the offsets
of the unit's flat rank-major block (``tidearray.layout.flat_layout``, FSDP2's
layout: 16-byte aligned offsets), so a flat reduce-scatter (the ``stock`` baseline) writes a unit's
fp32 gradients straight into the arena, and one fused AdamW launch covers every
parameter. Padding rows stay zero: the reduce-scatter zeroes them in the
gradient, so AdamW keeps them zero in the master and the send shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from .._adamw import AdamW, ParamGroup
from .._dtypes import float32
from .._errors import TideInvalid
from .._layout import FlatLayout, flat_layout
from ._optim import FusedAdamW

#: ``init(name, shape)``: a full parameter (any array), made one at a time.
Init = Callable[[str, tuple], Any]


class DescribedUnits(NamedTuple):
    """``Runtime``'s ``units``, per unit, per parameter."""

    names: list[list[str]]
    shapes: list[list[tuple]]
    #: ``(name, value)`` pairs: full parameters, or with ``init`` their shapes.
    values: list[list[tuple[str, Any]]]


def describe_units(units: Sequence[Sequence[tuple[str, Any]]],
                   init: Optional[Init]) -> DescribedUnits:
    """Per unit, its parameters' names, shapes and ``(name, value)`` pairs (``Runtime``'s
    ``units``: the values are full parameters, or with ``init`` their shapes).

    Raises:
        TideInvalid: a name given twice, or no unit, or a unit without parameters.
    """
    names: list[list[str]] = []
    shapes: list[list[tuple]] = []
    values: list[list] = []
    seen: set = set()
    for u, unit in enumerate(units):
        names.append([]), shapes.append([]), values.append([])
        for entry in unit:
            name, value = entry
            if name in seen:
                raise TideInvalid(f"unit {u}: expected unique parameter names, got {name!r} "
                                  "twice")
            seen.add(name)
            shape = tuple(int(d) for d in (value if init is not None else value.shape))
            names[-1].append(name)
            shapes[-1].append(shape)
            values[-1].append((name, value))
    if not shapes or not all(shapes):
        raise TideInvalid("units: expected at least one unit, each with parameters, got "
                          f"{[len(s) for s in shapes]}")
    return DescribedUnits(names, shapes, values)


def trainable_flags(trainable: Optional[Sequence[Sequence[bool]]],
                    shapes: list) -> list[list[bool]]:
    """Per unit, per parameter, whether it is trained (every one where ``trainable`` is None).

    Raises:
        TideInvalid: not one flag per parameter.
    """
    if trainable is None:
        return [[True] * len(s) for s in shapes]
    got = [len(t) for t in trainable]
    if got != [len(s) for s in shapes]:
        raise TideInvalid(f"trainable: expected a flag per parameter, {[len(s) for s in shapes]}"
                          f" per unit, got {got}")
    return [[bool(x) for x in t] for t in trainable]


@dataclass(frozen=True)
class ArenaLayout:
    """Where each unit's block starts in the flat arena (elements)."""

    units: tuple[FlatLayout, ...]
    starts: tuple[int, ...]
    numel: int


def arena_layout(unit_shapes: Sequence[Sequence[Sequence[int]]], world: int) -> ArenaLayout:
    """Blocks of every unit, back to back (pure: no device)."""
    units = tuple(flat_layout(shapes, world) for shapes in unit_shapes)
    starts, cur = [], 0
    for lay in units:
        starts.append(cur)
        cur += lay.block_numel
    return ArenaLayout(units, tuple(starts), cur)


class ShardArena:
    """The flat arrays of one rank's shards (persistent for the whole run).

    Args:
        layout: where each unit's shards sit.
        xp: the array module.
        param_dtype: the send shards' dtype.
        send: keep send shards; without them (``tide``: its gathers cast the
            masters into the slots) the arena is a fifth smaller in bf16.

    Attributes:
        master: fp32 master shards, updated by the optimizer.
        grad: fp32 gradient shards, written by the reduce-scatters.
        send: param-dtype shards, written by the optimizer, read by the
            all-gathers; None without send shards.
    """

    def __init__(self, layout: ArenaLayout, xp: Any, param_dtype: Any,
                 send: bool = True) -> None:
        self.layout = layout
        self.xp = xp
        n = max(layout.numel, 1)
        self.master = xp.zeros(n, float32)
        self.grad = xp.zeros(n, float32)
        self.send = xp.zeros(n, param_dtype) if send else None

    def refresh_send(self) -> None:
        """The send shards from the masters, rounded to nearest as the optimizer writes
        them (after initialisation or a checkpoint load); nothing without send shards."""
        if self.send is not None:
            self.send[...] = self.master.astype(self.send.dtype)

    def views(self, flat: Any, unit: int) -> list:
        """Per-parameter padded shard views of ``flat`` for ``unit``."""
        lay, start = self.layout.units[unit], self.layout.starts[unit]
        return [flat[start + off:start + off + s.shard_numel].reshape(s.shard_shape)
                for s, off in zip(lay.specs, lay.offsets)]

    def block(self, flat: Any, unit: int) -> Any:
        """``unit``'s whole block of ``flat`` (shards and alignment gaps)."""
        start = self.layout.starts[unit]
        return flat[start:start + self.layout.units[unit].block_numel]

    def param_range(self, u: int, k: int) -> tuple[int, int]:
        """Parameter ``k`` of unit ``u``: its elements of this rank's shard arena."""
        lay = self.layout.units[u]
        start = self.layout.starts[u] + lay.offsets[k]
        return start, start + lay.specs[k].shard_numel

    def fill_masters(self, values: list, init: Optional[Init], rank: int) -> None:
        """Write rank ``rank``'s rows of every full parameter into the masters (then the
        send shards): ``values`` as :func:`describe_units` gives them, each full
        parameter made by ``init`` where given, one at a time.

        Raises:
            TideInvalid: a full parameter whose shape is not the one described.
        """
        xp, r = self.xp, rank
        for u, unit_values in enumerate(values):
            lay = self.layout.units[u]
            for spec, master, (name, value) in zip(
                    lay.specs, self.views(self.master, u), unit_values):
                full = init(name, spec.shape) if init is not None else value
                if tuple(full.shape) != spec.shape:
                    raise TideInvalid(f"parameter {name!r}: expected shape {spec.shape}, got "
                                      f"{tuple(full.shape)}")
                start, stop = spec.rows(r)
                if stop > start:
                    master[:stop - start] = xp.asarray(full[start:stop], dtype=np.float32)
        self.refresh_send()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.master, self.grad, self.send) if a is not None)


def arena_groups(arena: ShardArena, names: list[list[str]],
                 param_groups: Sequence[tuple[AdamW, Sequence[str]]]) -> list[ParamGroup]:
    """``Runtime``'s ``param_groups`` (hyper-parameters, parameter names) as the
    optimizer's groups: element ranges of this rank's shards.

    Raises:
        TideInvalid: a name that is no parameter of ``names``, or one in two groups.
    """
    where = {name: (u, k) for u, unit_names in enumerate(names)
             for k, name in enumerate(unit_names)}
    groups, taken = [], set()
    for j, (group_hp, group_names) in enumerate(param_groups):
        ranges = []
        for name in group_names:
            if name not in where:
                raise TideInvalid(f"param_groups[{j}]: expected parameter names of the "
                                  f"model, got {name!r}")
            if name in taken:
                raise TideInvalid(f"param_groups[{j}]: expected each parameter in one "
                                  f"group, got {name!r} twice")
            taken.add(name)
            ranges.append(arena.param_range(*where[name]))
        groups.append(ParamGroup(group_hp, tuple(ranges)))
    return groups


def arena_adamw(hp: AdamW, arena: ShardArena, names: list[list[str]],
                param_groups: Sequence[tuple[AdamW, Sequence[str]]]) -> FusedAdamW:
    """The fused AdamW over the arena's masters (and send shards), with ``Runtime``'s
    ``param_groups`` and one element range per parameter, units in order."""
    return FusedAdamW(hp, arena.master, arena.send, arena.xp,
                      groups=arena_groups(arena, names, param_groups),
                      params=[arena.param_range(u, k) for u, ns in enumerate(names)
                              for k in range(len(ns))])
