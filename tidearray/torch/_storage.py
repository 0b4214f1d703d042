"""What each sharded parameter's ``.data`` and ``.grad`` are, between the runtime's arrays and
torch's tensors ([Note: torch front end] in ``_sharding``).

[Note: parameter storage]
A sharded parameter keeps its ``torch.nn.Parameter`` (the module's, under every
name it has), and only its storage changes:

* outside its unit's gather, ``.data`` is an empty placeholder (one per
  parameter, made once, in the param dtype on the model's device), so the
  model holds no weights, and a use outside the unit fails loudly: a weight
  penalty over the parameters after the forward gets autograd's shape error.
  Left viewing its slot from its forward's release to its backward (which
  regathers it there), a unit would save two swaps a step (18 ``.data``
  assignments for a decoder layer), but that penalty would then read, and
  train on, whatever unit the slot holds by then;
* while its unit is used, ``.data`` is a torch view (DLPack, zero-copy) of the
  parameter in the unit's slot, made again only when the runtime hands out
  other arrays (a unit takes the same slot step after step);
* while its unit's backward is open, a trained parameter's ``.grad`` is
  autograd's own tensor (autograd takes the first gradient as it comes, and
  adds a use's later ones to it); just before the runtime reduces the unit
  (``fill_grads``: it closes, or loses its slot while open) they are copied into
  its gradient buffer in one batched copy, zeros where a parameter got none,
  and each ``.grad`` is dropped. (Pointing ``.grad`` at the buffer instead
  costs a kernel per parameter on cuda, autograd's in-place add, and a Python
  hook per parameter to learn which got one.) The runtime releasing the slot
  (``on_release``) puts the placeholder back;
* after a backward, each trained placeholder's ``.grad`` is a sentinel
  (:class:`_ShardedGrad`, made once) that raises when used, so that torch's
  own tools cannot silently see nothing
  (``torch.nn.utils.clip_grad_norm_(model.parameters())`` names the model's
  ``clip_grad_norm_`` instead of returning 0); the next pass, step or
  ``zero_grad`` clears it.

:class:`ParamStorage` owns these tensors and the two facts about them: which
units' parameters point at their slot, and whether the sentinels are set. Where
a unit is in its pass is the runtime's ([Note: unit lifecycle]).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .. import _dtypes
from .._errors import TideInvalid


class ParamStorage:
    """The sharded parameters' tensors ([Note: parameter storage]).

    Args:
        params: per unit, its ``torch.nn.Parameter`` objects (meta ones included:
            :meth:`take_over` replaces those).
        dtype: the param dtype (NumPy).
        device: where gathered parameters live.

    Attributes:
        params: per unit, the parameters (after :meth:`take_over`, the real ones).
        shapes: per unit, each parameter's full shape.
    """

    def __init__(self, params: list[list[Any]], dtype: np.dtype, device: Any) -> None:
        self.params = params
        self.shapes = [[tuple(p.shape) for p in ps] for ps in params]
        torch_dtype = getattr(torch, dtype.name)
        self._empty = [[torch.empty(0, dtype=torch_dtype, device=device) for _ in ps]
                       for ps in params]
        # Per unit, the runtime's arrays last seen and torch views of them: of its slot's
        # parameters, and of its gradient buffer (ParamStorage._views).
        self._param_views: list[tuple[Any, list]] = [(None, [])] * len(params)
        self._grad_views: list[tuple[Any, list]] = [(None, [])] * len(params)
        self._live = [False] * len(params)  # parameters pointed at the unit's slot
        self._sentinel_grads: list[tuple[int, int, Any, Any]] = []  # (unit, index, p, s)
        self._sentinels = False

    def take_over(self, aliases: dict, all_names: dict, meta: bool) -> None:
        """Every parameter's ``.data`` becomes its placeholder (the runtime holds the
        values now). With ``meta`` (a model on the meta device), each parameter is
        replaced by a new one on the device, under every name it had (``aliases``,
        ``all_names``: the ``ModelUnits``'s, updated)."""
        for ps, es in zip(self.params, self._empty):
            if meta:
                ps[:] = [_replace_param(aliases, all_names, p, e) for p, e in zip(ps, es)]
            for p, e in zip(ps, es):
                p.data = e
        # Made once: each backward only assigns them (a parameter's, one placeholder's size).
        self._sentinel_grads = [(u, k, p, _ShardedGrad.make(e))
                                for u, (ps, es) in enumerate(zip(self.params, self._empty))
                                for k, (p, e) in enumerate(zip(ps, es)) if p.requires_grad]

    def sample(self) -> Optional[Any]:
        """One placeholder (every one has the model's device and the param dtype)."""
        return next((e for es in self._empty for e in es), None)

    # -- slots --------------------------------------------------------------------------

    def _views(self, cache: list, u: int, arrays: list) -> list:
        """Torch views of unit ``u``'s ``arrays``, kept in ``cache[u]``: made when the
        runtime hands out other arrays than the cached ones (its callers compare first,
        so that the common case, the same arrays step after step, makes no call)."""
        # Never inference tensors (made under torch.inference_mode): the views are
        # kept, and a training forward could not save them for its backward.
        with torch.inference_mode(False):
            views = [as_tensor(a, s) for a, s in zip(arrays, self.shapes[u])]
        cache[u] = (arrays, views)
        return views

    def use_gathered(self, u: int, arrays: list) -> None:
        """Unit ``u``'s parameters' ``.data`` become torch views of its gathered slot."""
        if self._live[u]:
            return  # on this gather already (a released unit is back on its placeholders)
        seen, views = self._param_views[u]
        if seen is not arrays:
            views = self._views(self._param_views, u, arrays)
        for p, t in zip(self.params[u], views):
            p.data = t
        self._live[u] = True

    def use_placeholders(self, u: int) -> None:
        """Unit ``u``'s parameters' ``.data`` become their empty placeholders again (the
        runtime released the unit's slot: its ``on_release``)."""
        if self._live[u]:
            for p, e in zip(self.params[u], self._empty[u]):
                p.data = e
            self._live[u] = False

    def fill_grads(self, u: int, grads: list) -> list[bool]:
        """The runtime is about to reduce open unit ``u``'s gradient buffer ``grads``: the
        ``.grad``s autograd gave its parameters are copied into it (one batched copy on
        torch's current stream, which the reduction follows), zeros where a parameter has
        none, and dropped; returns which parameters had one."""
        seen, views = self._grad_views[u]
        if seen is not grads:
            views = self._views(self._grad_views, u, grads)
        written, dst, src, unset = [], [], [], []
        for p, v in zip(self.params[u], views):
            g = p.grad
            if g is None:
                unset.append(v)
            else:
                dst.append(v)
                src.append(g if g.layout is torch.strided else g.to_dense())  # (a sparse one)
                p.grad = None
            written.append(g is not None)
        if dst:
            torch._foreach_copy_(dst, src)
        if unset:
            torch._foreach_zero_(unset)
        return written

    def stray_grads(self, drop: bool = False) -> list[tuple[int, int]]:
        """The ``(unit, index)`` of each trained parameter whose ``.grad`` (no sentinel) no
        reduction took: autograd set it while its unit's backward was not open; with
        ``drop``, dropped (as torch's ``zero_grad`` drops a ``.grad``). None can form while
        the sentinels are set: autograd cannot add a gradient to one."""
        stray = [(u, k, p) for u, k, p, _ in self._sentinel_grads if p.grad is not None]
        if drop:
            for _, _, p in stray:
                p.grad = None
        return [(u, k) for u, k, _ in stray]

    # -- sentinels ----------------------------------------------------------------------

    def set_sentinels(self) -> list[tuple[int, int]]:
        """Each trained parameter's ``.grad`` is its sentinel (a backward ended); returns
        :meth:`stray_grads` as they were (one pass over the parameters)."""
        stray = []
        for u, k, p, s in self._sentinel_grads:
            if p.grad is not None:
                stray.append((u, k))
            p.grad = s
        self._sentinels = True
        return stray

    def clear_sentinels(self) -> bool:
        """No sentinel ``.grad`` is left (a pass, a step or a ``zero_grad`` begins); whether
        they were set (then no stray gradient formed since: :meth:`stray_grads`)."""
        if not self._sentinels:
            return False
        for _, _, p, s in self._sentinel_grads:
            if p.grad is s:
                p.grad = None
        self._sentinels = False
        return True

    @contextlib.contextmanager
    def sentinels_cleared(self) -> Iterator[None]:
        """No sentinel ``.grad`` inside (``nn.Module._apply`` converts each ``.grad``);
        put back after, if they were set."""
        were = self._sentinels
        self.clear_sentinels()
        try:
            yield
        finally:
            if were:
                self.set_sentinels()


class _ShardedGrad(torch.Tensor):
    """The ``.grad`` of a sharded parameter's placeholder after a backward: using it
    raises, since the gradient lives in the shards (torch tools would see nothing)."""

    ALLOWED = frozenset({"__get__", "__set__", "__repr__", "__format__", "__bool__",
                         "requires_grad", "is_leaf", "grad_fn", "_base", "dtype", "device",
                         "shape", "layout", "is_sparse", "size", "dim", "numel", "__hash__",
                         "_is_view", "data", "detach", "__eq__"})

    @staticmethod
    def make(like: Any) -> _ShardedGrad:
        return torch.Tensor._make_subclass(_ShardedGrad, torch.empty_like(like))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name.startswith("_amp_"):  # torch.amp.GradScaler's unscale and inf check
            raise TideInvalid("a gradient of a module sharded by tidearray: torch.amp.GradScaler "
                              "unscales each parameter's .grad, and a sharded model's are in "
                              "its shards: loss scaling is not supported; train in bfloat16 "
                              "(param_dtype=torch.bfloat16, or torch.autocast's bfloat16), "
                              "which needs none")
        if name not in cls.ALLOWED:
            raise TideInvalid("a gradient of a module sharded by tidearray: expected "
                              "the sharded model's clip_grad_norm_() or its shards "
                              "(shard_parameters()), got a use of the placeholder's .grad "
                              f"({name or func})")
        return super().__torch_function__(func, types, args, kwargs or {})


def _replace_param(aliases: dict, all_names: dict, old: Any, empty: Any) -> Any:
    """A real Parameter in place of a meta one, under every name it had."""
    new = torch.nn.Parameter(empty, requires_grad=old.requires_grad)
    for module, attr in aliases[id(old)]:
        module._parameters[attr] = new
    aliases[id(new)] = aliases[id(old)]
    all_names[id(new)] = all_names[id(old)]
    return new


def as_tensor(a: Any, shape: Any) -> Any:
    """A torch view of a tidearray array (NumPy or CuPy), no copy; bf16 included."""
    if isinstance(a, np.ndarray):
        if a.dtype == _dtypes.bfloat16:  # NumPy's DLPack has no bf16: move the bits
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(a).reshape(shape)
    return torch.from_dlpack(a).reshape(shape)
