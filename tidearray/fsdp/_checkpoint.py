"""Sharded checkpoints: one ``.npz`` per rank plus ``meta.json``; full parameters and
full-model export.

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

A full parameter (:func:`full_param`) is gathered from every rank's valid rows
with one ``MPI_Allgatherv`` (or ``MPI_Gatherv`` to one rank) straight into its
full shape, one parameter at a time, so beyond the result a rank holds one full
parameter at once: :func:`export` and the torch front end's full state dict
gather so.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Optional

import numpy as np

from .. import _validate
from .._shard import gather_rows

FORMAT = 1


def _meta(model: Any) -> dict:
    return {"format": FORMAT, "world": model.world, "comm": model.kind,
            "names": model.names, "shapes": [[list(s) for s in u] for u in model.shapes],
            "param_dtype": model.param_dtype.name, "step": model.optimizer.step_count}


def host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array: itself, or a CuPy array copied to the host (a sync)."""
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
        np.savez(_rank_file(path, comm.rank), master=host(model.arena.master),
                 exp_avg=host(state["exp_avg"]), exp_avg_sq=host(state["exp_avg_sq"]),
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
    errors: list[str] = []
    data: Optional[dict] = None
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        want = _meta(model)
        for key in ("format", "world", "names", "shapes", "param_dtype"):
            if meta.get(key) != want[key]:
                errors.append(f"checkpoint {path!r}: expected {key} {want[key]!r}, got "
                              f"{meta.get(key)!r}")
        if not errors:
            data = _read_rank(_rank_file(path, comm.rank), model.arena.master.shape,
                              meta.get("step"), errors)
    except (OSError, ValueError, KeyError) as e:
        errors.append(f"cannot read checkpoint {path!r}: {e}")
    # The ranks' files must be of one save: the same step, and the same step per parameter.
    steps = None if data is None else data.get("param_steps")
    _validate.check(model.group, "load", (
        ("step", None if data is None else int(data["step"])),
        ("param_steps", None if steps is None else zlib.crc32(steps.tobytes()))), errors)
    assert data is not None  # else the check raised
    xp = model.xp
    model.synchronize()
    model.arena.master[...] = xp.asarray(data["master"])
    model.optimizer.load_state_dict({"step": int(data["step"]),
                                     "exp_avg": xp.asarray(data["exp_avg"]),
                                     "exp_avg_sq": xp.asarray(data["exp_avg_sq"]),
                                     **({"param_steps": steps} if steps is not None
                                        and steps.size else {})})
    model.arena.refresh_send()
    model.group.synchronize()  # [Note: initialized memory] in backends.cuda.streams


def _read_rank(file: str, shape: tuple, step: Any, errors: list[str]) -> Optional[dict]:
    """This rank's arrays, every one read now (a damaged file fails here, on its rank,
    before the ranks' agreement), or None after appending to ``errors``."""
    try:
        with np.load(file) as npz:
            data = {key: npz[key] for key in npz.files}
    except Exception as e:  # noqa: BLE001 - a damaged file raises what zipfile or NumPy raise
        errors.append(f"cannot read checkpoint file {file!r}: {type(e).__name__}: {e}")
        return None
    missing = sorted({"master", "exp_avg", "exp_avg_sq", "step"} - set(data))
    if missing:
        errors.append(f"checkpoint file {file!r}: expected arrays {missing}, got none")
        return None
    bad = [f"{key} of shape {data[key].shape}" for key in ("master", "exp_avg", "exp_avg_sq")
           if data[key].shape != shape]
    if bad:
        errors.append(f"checkpoint file {file!r}: expected arrays of shape {shape}, got "
                      f"{', '.join(bad)}")
    if int(data["step"]) != step:
        errors.append(f"checkpoint file {file!r}: expected step {step} (meta.json's), got "
                      f"{int(data['step'])}: a file of another save")
    return None if bad or int(data["step"]) != step else data


def export(model: Any, path: str) -> None:
    """Gather every full fp32 parameter to rank 0 and write them, by name, to ``path``
    (one ``.npz``). Collective; the file is complete when every rank returns."""
    comm = model.group.comm
    model.synchronize()
    full: dict[str, np.ndarray] = {}
    for u, names in enumerate(model.names):
        for k, name in enumerate(names):
            value = full_param(model, u, k, root=0)
            if value is not None:
                full[name] = value
    error = None
    if comm.rank == 0:
        try:
            np.savez(path, **full)
        except OSError as e:
            error = f"cannot write {path!r}: {e}"
    _validate.check(model.group, "export", (), [error] if error else [])


def full_param(model: Any, unit: int, k: int, root: Optional[int] = None) -> Optional[np.ndarray]:
    """Parameter ``k`` of ``unit`` in full, fp32, on the host: on every rank, or with
    ``root`` on that rank only (None elsewhere). Collective; the caller has synchronized
    the model (its masters are read as they are)."""
    spec = model.arena.layout.units[unit].specs[k]
    mine = np.ascontiguousarray(host(model.params(unit)[k][:spec.valid_rows(model.rank)]))
    return gather_rows(model.group.comm, spec, model.world, mine, root)
