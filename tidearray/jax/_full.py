"""A model's full parameters from the ranks' shards, outside the jitted step.

What a user saves, evaluates in one process or hands to another library is the full
model, not this rank's rows. :func:`full_params` gathers it one parameter (one layer's,
stacked) at a time on the host, as the runtime's full state dict does
(:func:`tidearray._shard.gather_rows`: one ``MPI_Allgatherv``, or ``MPI_Gatherv`` to one
rank, straight into the full shape), so beyond the result a rank holds one parameter's
rows at once. fp32, as the shards are: the masters themselves, not the compute dtype's
rounding of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import jax
import numpy as np

from .. import _validate
from .._layout import ShardSpec
from .._shard import gather_rows

if TYPE_CHECKING:
    from ._units import ShardedUnits


def full_params(su: ShardedUnits, shards: Sequence[Any],
                root: Optional[int] = None) -> Optional[list]:
    """See :meth:`ShardedUnits.full_params`."""
    group = su.group
    errors: list[str] = []
    if root is not None and (not isinstance(root, (int, np.integer)) or isinstance(root, bool)
                             or not 0 <= root < group.size):
        errors.append(f"root: expected None or a rank in [0, {group.size}), got {root!r}")
        root = None
    units = _unit_leaves(su, shards, errors)
    _validate.check(group, "ShardedUnits.full_params", (("root", root),), errors)
    wanted = root is None or group.rank == root
    out = [[_gather_leaf(group, spec, col.layers, a, root, f"unit {col.index} leaf {k}")
            for k, (spec, a) in enumerate(zip(col.unit.layout.specs, leaves))]
           for col, leaves in zip(su._units, units)]
    if not wanted:
        return None
    return [jax.tree_util.tree_unflatten(col.treedef, leaves)
            for col, leaves in zip(su._units, out)]


def _unit_leaves(su: ShardedUnits, shards: Any, errors: list[str]) -> list[list[Any]]:
    """Each unit's shard leaves, if ``shards`` is structured and shaped as ``su.shards``
    and every leaf can be read (concrete arrays, not a jitted step's tracers nor deleted
    buffers); else none, appending to ``errors``. Checked before the ranks' agreement, so
    that a rank that cannot read its shards (a buffer donated to a step) raises with the
    others instead of leaving them in the gather."""
    if not isinstance(shards, (list, tuple)) or len(shards) != len(su):
        errors.append(f"shards: expected a list of {len(su)} units' shards (as "
                      f"ShardedUnits.shards), got {type(shards).__name__}"
                      + (f" of {len(shards)}" if isinstance(shards, (list, tuple)) else ""))
        return []
    units = []
    for col, unit_shards in zip(su._units, shards):
        leaves, treedef = jax.tree_util.tree_flatten(unit_shards)
        layers = () if col.layers is None else (col.layers,)
        want = [(*layers, *t.shape) for t in col.shard_types]
        got = [tuple(np.shape(a)) for a in leaves]
        if treedef != col.treedef or got != want:
            errors.append(f"unit {col.index}: expected shards structured as {col.treedef} "
                          f"and shaped {want}, got {treedef} shaped {got}")
        elif any(isinstance(a, jax.core.Tracer) for a in leaves):
            errors.append(f"unit {col.index}: expected concrete shards, got a jitted "
                          "function's traced values (call full_params outside jax.jit)")
        elif any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
            errors.append(f"unit {col.index}: cannot read its shards (deleted: a buffer "
                          "donated to a step?): pass the shards the step returned")
        units.append(leaves)
    return units if not errors else []


def _gather_leaf(group: Any, spec: ShardSpec, layers: Optional[int], shard: Any,
                 root: Optional[int], what: str) -> Optional[np.ndarray]:
    """One leaf's full fp32 value (``(layers, *spec.shape)``, stacked) on the host from
    this rank's padded ``shard``, read one layer at a time, or None off ``root``.

    Each read is agreed on before its gather: a rank whose read fails (a device error,
    host memory) raises with the others instead of leaving them in the gather. Found
    before the first agreement are only the failures that can be seen without reading
    (:func:`_unit_leaves`); reading every leaf first would hold the whole model at once."""
    valid = spec.valid_rows(group.rank)

    def gather(layer: Optional[int]) -> Optional[np.ndarray]:
        rows, errors = None, []
        try:
            one = shard if layer is None else shard[layer]
            rows = np.ascontiguousarray(np.asarray(one[:valid], np.float32))
        except Exception as e:  # noqa: BLE001 - any failure, raised on every rank below
            errors.append(f"{what}: could not read this rank's shard "
                          f"({type(e).__name__}: {e})")
        _validate.check(group, "ShardedUnits.full_params", (), errors)
        return gather_rows(group.comm, spec, group.size, rows, root)
    if layers is None:
        return gather(None)
    # Each layer into its place as it comes: the result, and one layer beside it, at once.
    full = np.empty((layers, *spec.shape), np.float32) if root in (None, group.rank) else None
    for layer in range(layers):
        value = gather(layer)
        if full is not None:
            full[layer] = value
    return full
