"""State dicts of a model sharded by :func:`~tidearray.torch.shard_module`, under its own
names.

[Note: state dicts]
Two kinds, as FSDP2's ``get_model_state_dict`` has them:

* **full** (``full=True``): every key the plain module's ``state_dict()`` has,
  a tied parameter under each of its names (one tensor, as torch gives it),
  persistent buffers and extra states as the module holds them. Parameters are
  gathered one at a time (``Allgatherv``, or ``Gatherv`` to rank 0 with
  ``rank0_only``), so beyond the result a rank holds one full parameter at once.
  They are the **fp32 masters**, whatever ``param_dtype`` is: exact (an fp32
  model round-trips bitwise), and a plain module's ``load_state_dict`` casts
  them to its own dtype (round to nearest, as the gathers do). The dtype a
  parameter had before wrapping is not kept: ``param_dtype`` is the gathered
  dtype, for every parameter. No optimizer state: a full state dict is a model
  (for Hugging Face's ``save_pretrained(state_dict=...)``, ``torch.save``, or
  a plain module), and moves between world sizes.
* **sharded** (``full=False``): this rank's own rows of each parameter's fp32
  master (valid rows, no padding), under its first name; the buffers; and under
  :data:`SHARDING_KEY` a plain dict: format, world size, rank, each
  parameter's full shape and row range, and the optimizer's state (the fused
  AdamW's moments, the same rows of each parameter, and its step; or a copy of
  the torch optimizer's ``state_dict()``). Loading it on a model wrapped alike,
  at the same world size and rank, continues training bit for bit.

Every tensor returned is a copy (training on does not change a state dict
taken), on the CPU with ``cpu=True`` (else on the module's device). Loading
copies too: a loaded state dict can be reused. Buffers are not sharded: each
rank returns and loads its own (BatchNorm statistics drawn from each rank's
samples differ, as under FSDP).

Both calls are collective and check together (``_validate.check``) before any
transfer or change: a bad key, shape, world size or rank on any rank raises the
same ``TideInvalid`` on every rank, and nothing is loaded anywhere.

A submodule's own ``state_dict()`` or ``load_state_dict()`` would see the empty
placeholders ([Note: parameter storage] in ``_storage``): :class:`StateDictGuard`
refuses them, naming the sharded model's, whose calls pass (``allowed``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, NamedTuple, Optional

import numpy as np
import torch

from .. import _validate
from .._errors import TideInvalid

if TYPE_CHECKING:
    from ._sharding import Sharding

#: The sharded state dict's entry describing the sharding (and holding the optimizer state).
SHARDING_KEY = "_tidearray"
#: Version of that entry.
FORMAT = 1
#: Keys named in an error message, at most.
_SHOWN = 5


class LoadResult(NamedTuple):
    """What :func:`load_state_dict` skipped with ``strict=False`` (as torch's
    ``_IncompatibleKeys``)."""

    missing_keys: list[str]
    """Parameters (by first name) and buffers the state did not hold; they keep their
    values."""
    unexpected_keys: list[str]
    """Keys of the state that name nothing of the model."""


# -- taking ----------------------------------------------------------------------------


def state_dict(sm: Sharding, *, full: bool = True, cpu: bool = True,
               rank0_only: bool = False) -> dict:
    """The module's state dict, full or this rank's shards ([Note: state dicts]).

    Collective: every rank calls it alike.

    Args:
        sm: the sharded module.
        full: every parameter gathered in full (fp32), under every name; else this
            rank's fp32 rows, the sharding and the optimizer's state.
        cpu: tensors on the CPU (True), else on the module's device.
        rank0_only: ``full`` only: rank 0 gets the dict, the others ``{}`` (and
            never hold a full parameter).

    Returns:
        The state dict (``{}`` on ranks other than 0 with ``rank0_only``).

    Raises:
        TideInvalid: on every rank, if ranks disagree on ``full`` or ``rank0_only``.

    See Also:
        ``MPI_Allgatherv`` / ``MPI_Gatherv`` (one per parameter, full only).
    """
    _validate.check(sm.group, "state_dict",
                    (("full", bool(full)), ("rank0_only", bool(rank0_only))), [])
    sm.runtime.synchronize()
    own, where = _own_state(sm), _where(sm)
    if full:
        root = 0 if rank0_only else None
        gathered = {uk: _gather(sm, *uk, root, cpu) for uk in _every_param(sm)}
        if rank0_only and sm.group.rank != 0:
            return {}
        return {key: gathered[where[key]] if key in where else _copy(value, cpu)
                for key, value in own.items()}
    out: dict[str, Any] = {}
    for key, value in own.items():
        if key not in where:
            out[key] = _copy(value, cpu)
        elif sm.names[where[key][0]][where[key][1]] == key:
            out[key] = _copy(_rows(sm, sm.runtime.params(where[key][0]), *where[key]), cpu)
    out[SHARDING_KEY] = _sharding(sm, cpu)
    return out


def _sharding(sm: Sharding, cpu: bool) -> dict:
    """The :data:`SHARDING_KEY` entry: where this rank's rows lie, and the optimizer."""
    model = sm.runtime
    params = {}
    for u, k in _every_param(sm):
        spec = _spec(sm, u, k)
        params[sm.names[u][k]] = {"shape": list(spec.shape), "rows": list(spec.rows(model.rank))}
    return {"format": FORMAT, "world": model.world, "rank": model.rank, "params": params,
            "optimizer": _optim_state(sm, cpu)}


def _optim_state(sm: Sharding, cpu: bool) -> dict:
    if sm.bridge.kind == "torch":
        return {"kind": "torch", "state": _copy(sm.optimizer.state_dict(), cpu)}
    opt, model = sm.runtime.optimizer, sm.runtime
    moments = {}
    for what, flat in (("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
        moments[what] = {sm.names[u][k]: _copy(_rows(sm, model.arena.views(flat, u), u, k), cpu)
                         for u, k in _every_param(sm)}
    steps = opt.param_steps  # each parameter's own count (torch's per-parameter "step")
    own = {sm.names[u][k]: int(steps[j]) for j, (u, k) in enumerate(_every_param(sm))}
    return {"kind": "fused", "step": int(opt.step_count), "param_steps": own, **moments}


def _gather(sm: Sharding, u: int, k: int, root: Optional[int], cpu: bool) -> Any:
    """Parameter ``k`` of unit ``u`` in full (fp32), on every rank or on ``root`` only
    (None elsewhere)."""
    full = sm.runtime.full_param(u, k, root)
    if full is None:
        return None
    t = torch.from_numpy(full)
    return t if cpu else t.to(sm.device)


# -- loading ---------------------------------------------------------------------------


def load_state_dict(sm: Sharding, state: Mapping, *, strict: bool = True) -> LoadResult:
    """Load a full or a sharded state dict (sharded: it holds :data:`SHARDING_KEY`).

    Collective. A full state dict may name a tied parameter by any of its names
    (say a Hugging Face checkpoint without ``lm_head.weight``); each rank takes its
    rows of each parameter (every rank passes the whole dict). A sharded one must
    come from the same rank at the same world size, of a model wrapped alike, and
    restores the optimizer too ([Note: state dicts]).

    Args:
        sm: the sharded module.
        state: what :func:`state_dict` (or a plain module's ``state_dict()``) gave.
        strict: missing and unexpected keys are errors (else skipped and returned).

    Returns:
        The keys skipped (both lists empty with ``strict=True``).

    Raises:
        TideInvalid: on every rank, before anything changes anywhere: a missing or
            unexpected key (strict), a shape that differs (naming the parameter or
            buffer), a sharded state of another world size, rank or optimizer, or a
            backward in progress.
    """
    errors: list[str] = []
    sharded = isinstance(state, Mapping) and SHARDING_KEY in state
    if not isinstance(state, Mapping):
        errors.append(f"state: expected a dict, got {type(state).__name__}")
        state = {}
    if sm.runtime.in_backward:
        errors.append("expected no backward in progress, got one begun and not done")
    own = _own_state(sm, keep_vars=True)
    where = _where(sm)
    taken, buffers, skipped = _match(sm, state, own, where, strict, errors)
    meta = state.get(SHARDING_KEY) if sharded else None
    if not (sharded and _check_sharding(sm, meta, strict, errors)):
        _check_values(sm, taken, buffers, own, sharded, errors)
    _validate.check(sm.group, "load_state_dict",
                    (("sharded", sharded), ("strict", bool(strict))), errors)
    _apply(sm, taken, buffers, own, sharded)
    if sharded and isinstance(meta.get("optimizer"), Mapping):
        _load_optim(sm, meta["optimizer"])
    sm.runtime.arena.refresh_send()
    sm.runtime.synchronize()
    return skipped


def _match(sm: Sharding, state: Mapping, own: dict, where: dict, strict: bool,
           errors: list[str]) -> tuple[dict, dict, LoadResult]:
    """The state's value for each parameter (first name found) and each buffer, and the
    keys missing or unexpected (errors with ``strict``)."""
    taken: dict[tuple[int, int], tuple[str, Any]] = {}
    buffers: dict[str, Any] = {}
    unexpected = []
    for key, value in state.items():
        if key == SHARDING_KEY:
            continue
        if key in where:
            taken.setdefault(where[key], (key, value))
        elif key in own:
            buffers[key] = value
        else:
            unexpected.append(str(key))
    missing = [sm.names[u][k] for u, k in _every_param(sm) if (u, k) not in taken]
    missing += [key for key in own if key not in where and key not in buffers]
    if strict and missing:
        hint = " (a rank0_only state dict? every rank passes the whole one)" if not state else ""
        errors.append(f"state: expected every parameter and persistent buffer, got "
                      f"{len(missing)} missing: {_show(missing)}{hint}")
    if strict and unexpected:
        errors.append(f"state: expected only the model's keys, got {len(unexpected)} "
                      f"unexpected: {_show(unexpected)}")
    return taken, buffers, LoadResult(missing, unexpected)


def _check_values(sm: Sharding, taken: dict, buffers: dict, own: dict, sharded: bool,
                  errors: list[str]) -> None:
    """Each parameter's value has its full shape (sharded: this rank's rows), each
    buffer its buffer's."""
    for (u, k), (key, value) in taken.items():
        spec = _spec(sm, u, k)
        want = spec.shape if not sharded else (spec.valid_rows(sm.runtime.rank), *spec.shape[1:])
        _check_shape(f"parameter {key!r}" + (" (this rank's rows)" if sharded else ""),
                     value, want, errors)
    for key, value in buffers.items():
        if torch.is_tensor(own[key]):
            _check_shape(f"buffer {key!r}", value, tuple(own[key].shape), errors)


def _check_sharding(sm: Sharding, meta: Any, strict: bool, errors: list[str]) -> bool:
    """A sharded state's :data:`SHARDING_KEY` entry against this rank's sharding; True
    if it is of another format, world size or rank (nothing else is worth checking)."""
    model = sm.runtime
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
        errors.append(f"state[{SHARDING_KEY!r}]: expected format {FORMAT}, got {got!r}")
        return True
    if meta.get("world") != model.world:
        errors.append(f"state[{SHARDING_KEY!r}]: expected world size {model.world}, got "
                      f"{meta.get('world')!r} (a sharded state dict loads at its own world "
                      "size; take a full one to change it)")
        return True
    if meta.get("rank") != model.rank:
        errors.append(f"state[{SHARDING_KEY!r}]: expected rank {model.rank}'s shards, got "
                      f"rank {meta.get('rank')!r}'s")
        return True
    params = meta.get("params") if isinstance(meta.get("params"), Mapping) else {}
    for u, k in _every_param(sm):
        spec, name = _spec(sm, u, k), sm.names[u][k]
        want = {"shape": list(spec.shape), "rows": list(spec.rows(model.rank))}
        got = params.get(name)
        if got is not None and (not isinstance(got, Mapping) or {
                "shape": list(got.get("shape", ())), "rows": list(got.get("rows", ()))} != want):
            errors.append(f"parameter {name!r}: expected shape {spec.shape} and rows "
                          f"{tuple(want['rows'])}, got {got}")
    _check_optim(sm, meta.get("optimizer"), strict, errors)
    return False


def _check_optim(sm: Sharding, saved: Any, strict: bool, errors: list[str]) -> None:
    if saved is None:
        if strict:
            errors.append(f"state[{SHARDING_KEY!r}]: expected the optimizer's state, got none")
        return
    kind = sm.bridge.kind
    if not isinstance(saved, Mapping) or saved.get("kind") != kind:
        got = saved.get("kind") if isinstance(saved, Mapping) else type(saved).__name__
        errors.append(f"optimizer: expected the state of a {kind} optimizer, got {got!r}")
        return
    if kind == "torch":
        want = [len(g["params"]) for g in sm.optimizer.state_dict()["param_groups"]]
        inner = saved.get("state") if isinstance(saved.get("state"), Mapping) else {}
        got = [len(g.get("params", ())) for g in inner.get("param_groups", [])]
        if got != want:
            errors.append(f"optimizer: expected param groups of {want} parameters, got {got}")
        return
    step = saved.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        errors.append(f"optimizer: expected a step count (an int >= 0), got {step!r}")
    for what in ("exp_avg", "exp_avg_sq"):
        moments = saved.get(what) if isinstance(saved.get(what), Mapping) else {}
        for u, k in _every_param(sm):
            spec, name = _spec(sm, u, k), sm.names[u][k]
            _check_shape(f"optimizer {what} of {name!r}", moments.get(name),
                         (spec.valid_rows(sm.runtime.rank), *spec.shape[1:]), errors)


def _apply(sm: Sharding, taken: dict, buffers: dict, own: dict, sharded: bool) -> None:
    """Write the checked values: each parameter's rows into the masters, the buffers."""
    model = sm.runtime
    model.synchronize()
    model.release()  # gathered units would hold the old values
    sources: list = []
    for (u, k), (_, value) in taken.items():
        start, stop = _spec(sm, u, k).rows(model.rank)
        rows = value if sharded else value[start:stop]
        _write_rows(model, model.params(u)[k], rows, sources)
    _settle_sources(model, sources)
    with torch.no_grad():
        for key, value in buffers.items():
            if torch.is_tensor(own[key]):
                own[key].copy_(torch.as_tensor(value))
            else:  # a module's extra state (get_extra_state)
                prefix = key[:-len("_extra_state")].rstrip(".")
                sm.module.get_submodule(prefix).set_extra_state(value)


def _load_optim(sm: Sharding, saved: Mapping) -> None:
    if sm.bridge.kind == "torch":
        sm.optimizer.load_state_dict(_copy(saved["state"], cpu=False))  # its own tensors
        return
    opt, model = sm.runtime.optimizer, sm.runtime
    sources: list = []
    for what, flat in (("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
        for u, k in _every_param(sm):
            _write_rows(model, model.arena.views(flat, u)[k], saved[what][sm.names[u][k]],
                        sources)
        _settle_sources(model, sources)  # per moment: one moment's sources held at most
    step, own = int(saved["step"]), saved.get("param_steps")  # older states: every count step
    steps = None if not isinstance(own, Mapping) else [
        int(own.get(sm.names[u][k], step)) for u, k in _every_param(sm)]
    opt.load_state_dict({"step": step, "exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq,
                         **({"param_steps": steps} if steps is not None else {})})


# -- the guard -------------------------------------------------------------------------


class StateDictGuard:
    """Refuses ``state_dict()`` and ``load_state_dict()`` of the modules that register
    sharded parameters, except inside :meth:`allowed` (the sharded model's own)."""

    def __init__(self) -> None:
        self._allowed = False

    def register(self, modules: Iterable[torch.nn.Module]) -> list:
        """Guard ``modules``; returns the hooks' handles."""
        handles = []
        for m in modules:
            handles.append(m.register_state_dict_pre_hook(self._refuse_state_dict))
            handles.append(m.register_load_state_dict_pre_hook(self._refuse_load))
        return handles

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """The sharded model's own state dict is being taken or loaded."""
        before = self._allowed
        self._allowed = True
        try:
            yield
        finally:
            self._allowed = before

    def _refuse_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        if not self._allowed:
            raise TideInvalid("state_dict() of a submodule of a model sharded by tidearray: "
                              "expected the sharded model's own state_dict() (full or "
                              "sharded), got a submodule's, whose parameters are empty "
                              "placeholders")

    def _refuse_load(self, *args: Any) -> None:
        if not self._allowed:
            raise TideInvalid("load_state_dict() of a submodule of a model sharded by "
                              "tidearray: expected the sharded model's own load_state_dict() "
                              "(full or sharded), got a submodule's, whose parameters are "
                              "empty placeholders")


# -- helpers ---------------------------------------------------------------------------


def _own_state(sm: Sharding, keep_vars: bool = False) -> dict:
    """The module's own ``state_dict()`` (parameters as their empty placeholders)."""
    with sm.guard.allowed():
        # The state dict of the module's own class (the swapped class's gathers).
        return sm.module_class.state_dict(sm.module, keep_vars=keep_vars)


def _where(sm: Sharding) -> dict[str, tuple[int, int]]:
    """Every name of every parameter -> (unit, index in the unit)."""
    return {name: (u, k) for u, ps in enumerate(sm.params) for k, p in enumerate(ps)
            for name in sm.spec.all_names[id(p)]}


def _every_param(sm: Sharding) -> list[tuple[int, int]]:
    """(unit, index) of every parameter, in the runtime's order (the same on every rank)."""
    return [(u, k) for u, ps in enumerate(sm.params) for k in range(len(ps))]


def _spec(sm: Sharding, u: int, k: int) -> Any:
    """Parameter ``k`` of unit ``u`` as the runtime shards it: its full shape, and its
    rows on each rank (``_layout.ShardSpec``)."""
    return sm.runtime.arena.layout.units[u].specs[k]


def _rows(sm: Sharding, views: list, u: int, k: int) -> Any:
    """This rank's valid rows of parameter ``k`` of unit ``u`` in padded shard ``views``."""
    return views[k][:_spec(sm, u, k).valid_rows(sm.runtime.rank)]


def _write_rows(model: Any, shard: Any, rows: Any, sources: list) -> None:
    """``rows`` (a tensor or array) into the first rows of padded ``shard``; padding zeroed.
    A CUDA source tensor is appended to ``sources``: the caller keeps it until the copies
    have run (``_settle_sources``)."""
    n = int(rows.shape[0])
    t = torch.as_tensor(rows).detach().to(torch.float32).contiguous()
    shard[:n] = model.group.backend.asarray(t)
    shard[n:] = 0
    if t.is_cuda:
        sources.append(t)


def _settle_sources(model: Any, sources: list) -> None:
    """Wait for the copies out of ``sources`` (CUDA tensors), then let them go.

    The copies run on CuPy's stream, and a source (often a temporary of ``.to``) goes back
    to torch's allocator once dropped: torch may hand its memory out again on its own
    stream before the copy has read it. So every source is kept until one wait after the
    last copy of a batch (a load is rare; one wait per batch, not one per parameter). A
    batch holds at most one fp32 copy of this rank's rows (the masters' or a moment's)."""
    if sources:
        model.group.backend.settle()
        sources.clear()


def _copy(value: Any, cpu: bool) -> Any:
    """A copy of ``value`` (a tensor, an array, or dicts and lists of them) as torch
    tensors, on the CPU with ``cpu``; other values as they are."""
    if torch.is_tensor(value):
        value = value.detach()
        return value.to("cpu", copy=True) if cpu else value.clone()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    if hasattr(value, "__dlpack__") and hasattr(value, "get"):  # a CuPy array
        return torch.from_numpy(value.get()) if cpu else torch.from_dlpack(value.copy())
    if isinstance(value, Mapping):
        return {k: _copy(v, cpu) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v, cpu) for v in value)
    return value


def _check_shape(what: str, value: Any, want: tuple, errors: list[str]) -> None:
    shape = getattr(value, "shape", None)
    if shape is None:
        errors.append(f"{what}: expected a tensor of shape {tuple(want)}, got "
                      f"{type(value).__name__}")
    elif tuple(shape) != tuple(want):
        errors.append(f"{what}: expected shape {tuple(want)}, got {tuple(shape)}")


def _show(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(repr(k) for k in keys[:_SHOWN]) + more
