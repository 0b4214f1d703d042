"""The shard arena: every parameter's fp32 master shard, fp32 gradient shard and
param-dtype send shard, each kind in one flat array.

Units are laid out one after another; inside a unit, shards sit at the offsets
of the unit's flat rank-major block (``tidearray.layout.flat_layout``, FSDP2's
layout: 16-byte aligned offsets), so a flat reduce-scatter (the ``stock`` baseline) writes a unit's
fp32 gradients straight into the arena, and one fused AdamW launch covers every
parameter. Padding rows stay zero: the reduce-scatter zeroes them in the
gradient, so AdamW keeps them zero in the master and the send shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .._dtypes import float32
from .._layout import FlatLayout, flat_layout


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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.master, self.grad, self.send) if a is not None)
