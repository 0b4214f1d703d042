"""Sharded checkpoints: one ``.npz`` per rank plus ``meta.json``; full-model export.

A checkpoint directory holds:

* ``meta.json``: format version, world size, comm kind, parameter names and
  full shapes per unit, param dtype and the optimizer step;
* ``rank00000.npz`` ...: that rank's flat fp32 master, both AdamW moments
  and the step.

Loading needs the same world size and the same units (checked on every rank,
which raise together). Send shards, where the path keeps them, are rebuilt
from the masters by the same round-to-nearest cast the optimizer uses (the
``tide`` gathers cast the masters themselves), so a resumed run continues bit
for bit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .. import _validate

FORMAT = 1


def _meta(model: Any) -> dict:
    return {"format": FORMAT, "world": model.world, "comm": model.kind,
            "names": model.names, "shapes": [[list(s) for s in u] for u in model.shapes],
            "param_dtype": model.param_dtype.name, "step": model.optimizer.step_count}


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.npz")


def save(model: Any, path: str) -> None:
    """Write ``model``'s sharded state under the directory ``path`` (collective)."""
    comm = model.group.comm
    model.synchronize()
    error = None
    try:
        os.makedirs(path, exist_ok=True)
        if comm.rank == 0:
            with open(os.path.join(path, "meta.json"), "w") as f:
                json.dump(_meta(model), f, indent=1)
        state = model.optimizer.state_dict()
        np.savez(_rank_file(path, comm.rank), master=_host(model.arena.master),
                 exp_avg=_host(state["exp_avg"]), exp_avg_sq=_host(state["exp_avg_sq"]),
                 step=np.int64(state["step"]),
                 param_steps=np.asarray(state.get("param_steps", ()), np.int64))
    except OSError as e:
        error = f"cannot write {path!r}: {e}"
    _validate.check(model.group, "save", (), [error] if error else [])


def load(model: Any, path: str) -> None:
    """Restore the state :func:`save` wrote, at the same world size (collective).

    Raises:
        TideInvalid: on every rank, if any rank's files are missing or do not match.
    """
    comm = model.group.comm
    errors, data = [], None
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        want = _meta(model)
        for key in ("format", "world", "names", "shapes", "param_dtype"):
            if meta.get(key) != want[key]:
                errors.append(f"checkpoint {path!r}: expected {key} {want[key]!r}, got "
                              f"{meta.get(key)!r}")
        if not errors:
            data = np.load(_rank_file(path, comm.rank))
            if data["master"].shape != model.arena.master.shape:
                errors.append(f"checkpoint {path!r}: expected a master of "
                              f"{model.arena.master.shape[0]} elements, got "
                              f"{data['master'].shape[0]}")
    except (OSError, ValueError, KeyError) as e:
        errors.append(f"cannot read checkpoint {path!r}: {e}")
    _validate.check(model.group, "load", (), errors)
    xp = model.xp
    model.synchronize()
    model.arena.master[...] = xp.asarray(data["master"])
    steps = data["param_steps"] if "param_steps" in data.files else None  # older files: none
    model.optimizer.load_state_dict({"step": int(data["step"]),
                                     "exp_avg": xp.asarray(data["exp_avg"]),
                                     "exp_avg_sq": xp.asarray(data["exp_avg_sq"]),
                                     **({"param_steps": steps} if steps is not None
                                        and steps.size else {})})
    model.arena.refresh_send()


def export(model: Any, path: str) -> None:
    """Gather every full fp32 parameter to rank 0 and write them, by name, to ``path``
    (one ``.npz``). Collective; the file is complete when every rank returns."""
    comm = model.group.comm
    model.synchronize()
    full: dict[str, np.ndarray] = {}
    for u, names in enumerate(model.names):
        lay = model.arena.layout.units[u]
        for name, spec, shard in zip(names, lay.specs, model.params(u)):
            rows = _host(shard[:spec.valid_rows(model.rank)])
            parts = [rows] if model.world == 1 else comm.gather(rows, root=0)
            if comm.rank == 0:
                full[name] = np.concatenate(parts).reshape(spec.shape)
    error = None
    if comm.rank == 0:
        try:
            np.savez(path, **full)
        except OSError as e:
            error = f"cannot write {path!r}: {e}"
    _validate.check(model.group, "export", (), [error] if error else [])
