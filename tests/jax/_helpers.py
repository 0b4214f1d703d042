"""Helpers shared by the JAX tests: a fresh seed every rank agrees on (``tests._util``'s),
and full parameters put back together from every rank's shards (for comparing with one
unsharded process)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._util import fresh_seed

__all__ = ["fresh_seed", "full_leaves"]


def full_leaves(group: Any, shards: Any, like: Any, stacked: bool) -> list[np.ndarray]:
    """Full parameters of one unit from every rank's padded shards (cut on dim 0, or on dim 1
    under a leading layer axis), in the order of ``like``'s leaves, each cut to the shape of
    ``like``'s (collective)."""
    import jax

    every = group.comm.allgather(jax.tree_util.tree_map(np.asarray, shards))
    axis = 1 if stacked else 0

    def one(k: int, want: Any) -> np.ndarray:
        parts = [jax.tree_util.tree_leaves(s)[k] for s in every]
        return np.concatenate(parts, axis=axis)[(slice(None),) * axis + (slice(want.shape[axis]),)]

    return [one(k, w) for k, w in enumerate(jax.tree_util.tree_leaves(like))]
