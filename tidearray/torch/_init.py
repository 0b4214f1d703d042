"""Where each parameter's first values come from: the module itself, or, for a model built on
the meta device, its own initialisation or a checkpoint, one module or tensor at a time.

[Note: deferred init]
The runtime asks for full parameters one at a time (``Runtime(init=...)``) and
keeps only this rank's rows. For a parameter on the meta device the module that
registers it is materialised alone (``to_empty(recurse=False)``: its own parameters
and buffers, nothing below it) on the CPU, initialised by ``init_fn(module)`` (by
default a Hugging Face model's own ``_init_weights``) or else its
``reset_parameters()``, and its values are handed out and dropped as the runtime
takes them; with a checkpoint, each tensor is read from the safetensors files when
asked for. So a rank holds at most one module's own parameters in full at once,
never the model. Every rank must draw the same values: seed torch's generator
alike on every rank before wrapping (the wrap checks a checksum of each unit's
values across ranks).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._errors import TideInvalid

if TYPE_CHECKING:
    from ..backends import Backend

InitFn = Callable[[Any], None]


def is_meta(t: Any) -> bool:
    return getattr(t, "is_meta", False)


class Values:
    """Full fp32 values of parameters, by name, one at a time.

    Args:
        model_units: the model's units (``_units.resolve``).
        init_fn: initialises one materialised module (its own parameters and buffers).
        checkpoint: a ``.safetensors`` file, or a directory of them (with the
            ``model.safetensors.index.json`` Hugging Face writes, or without).
        backend: the group's backend, which takes a device tensor's values.
    """

    def __init__(self, model_units: Any, init_fn: Optional[InitFn],
                 checkpoint: Optional[str], backend: Backend) -> None:
        self.units = model_units
        self.backend = backend
        self.init_fn = init_fn
        self.by_name = {n: p for u in model_units.units for n, p in zip(u.names, u.params)}
        self.files = _checkpoint_files(checkpoint) if checkpoint is not None else None
        self._cache: dict[int, Any] = {}  # id(param) -> full value, until taken
        self._open: dict[str, Any] = {}  # safetensors file -> its handle, while wrapping

    def read(self, key: str) -> Any:
        """Tensor ``key`` of the checkpoint (each file opened once: its header is parsed
        once, and its tensors are read from the mapping one at a time)."""
        file = self.files[key]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(key)

    def close(self) -> None:
        """Drop the checkpoint's handles (the wrap is done)."""
        self._open.clear()

    def missing(self) -> list[str]:
        """Parameters the checkpoint does not hold (under any of their names)."""
        if self.files is None:
            return []
        return [n for n, p in self.by_name.items()
                if not any(a in self.files for a in self.units.all_names[id(p)])]

    def __call__(self, name: str, shape: tuple) -> Any:
        import torch

        p = self.by_name[name]
        if self.files is not None:
            key = next(a for a in self.units.all_names[id(p)] if a in self.files)
            return self.read(key).to(torch.float32).numpy()
        if not is_meta(p):
            return _as_array(p.detach(), self.backend)
        if id(p) not in self._cache:
            self._materialise(p)
        return self._cache.pop(id(p))

    def _materialise(self, p: Any) -> None:
        """Materialise and initialise the module that registers ``p``, keeping its
        parameters' values until each is taken (a tied weight: its first module)."""
        import torch

        module, _ = self.units.aliases[id(p)][0]
        before = dict(module.named_parameters(recurse=False))
        module.to_empty(device="cpu", recurse=False)
        init_module(module, self.init_fn)
        for attr, old in before.items():
            new = getattr(module, attr)
            self._cache[id(old)] = _as_array(new.detach().to(torch.float32), self.backend)
            setattr(module, attr, old)  # the placeholder comes later, to every alias


def default_init_fn(model: Any, init_fn: Optional[InitFn]) -> Optional[InitFn]:
    """``init_fn``, else a Hugging Face model's own ``_init_weights`` (which also computes
    the rotary tables), else None (each module's ``reset_parameters``)."""
    if init_fn is not None:
        return init_fn
    return getattr(model, "_init_weights", None)


def init_module(module: Any, init_fn: Optional[InitFn]) -> None:
    """Initialise a module materialised alone."""
    if init_fn is not None:
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise TideInvalid(f"deferred init: expected a {type(module).__name__} with "
                          "reset_parameters(), or an init_fn (a Hugging Face model's "
                          "_init_weights, say), or a checkpoint, got none")


def materialise_buffers(model: Any, device: Any, values: Values) -> None:
    """Meta buffers (rotary tables, say) in full on ``device``: from the checkpoint where it
    holds them, else by ``init_fn`` or ``reset_parameters`` of their module."""
    import torch

    files = values.files or {}
    for prefix, module in model.named_modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if is_meta(b)]
        if not metas:
            continue
        params = dict(module.named_parameters(recurse=False))
        module.to_empty(device="cpu", recurse=False)
        for attr, old in params.items():
            setattr(module, attr, old)  # parameters stay as they are (the runtime's)
        loaded = [n for n in metas if f"{prefix}.{n}".lstrip(".") in files]
        for n in loaded:
            getattr(module, n).copy_(values.read(f"{prefix}.{n}".lstrip(".")))
        if len(loaded) < len(metas):
            with torch.no_grad():
                init_module(module, values.init_fn)
    for module in model.modules():  # modules materialised with their parameters too
        for n, b in module._buffers.items():
            if b is not None and b.device != torch.device(device):
                module._buffers[n] = b.to(device)


def _checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
    else:
        raise TideInvalid(f"checkpoint: expected a .safetensors file or a directory, got "
                          f"{path!r}")
    if not files:
        raise TideInvalid(f"checkpoint: expected .safetensors files in {path!r}, got none")
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update((k, file) for k in f.keys())
    return names


def _as_array(t: Any, backend: Backend) -> Any:
    """A tensor's values as an array tidearray can shard (fp32): NumPy for a CPU tensor,
    else the backend's (a CUDA tensor's memory through DLPack on the cuda backend)."""
    import torch

    t = t.to(torch.float32)
    if t.device.type == "cpu":
        return t.numpy()
    return backend.asarray(t)
