"""``Sharding``: what a sharded ``torch.nn.Module`` holds: its units on tidearray's runtime,
the module hooks that drive it, and the step over its shards.

[Note: hooks]
The hooks only report events to the runtime, which alone knows where each unit
is in its pass ([Note: unit lifecycle] in ``tidearray.fsdp._lifecycle``):

* a forward pre-hook of each of the unit's modules is one use of the unit:
  the runtime gathers it if it is not (and prefetches the next), and its
  parameters' ``.data`` point at the gathered slot, zero-copy through DLPack;
  with grad enabled the forward's inputs that need a gradient pass through
  ``_PostBackward``, whose backward runs when their gradients are computed,
  that is when this use's backward is done: it reports the use's token
  (``use_done``), and the runtime closes the unit once no use is pending;
* a forward hook lets the slot go (the runtime keeps the last unit and the
  root) and hooks each output tensor (a pre-hook of the node that made it,
  ``_on_first_grad``): the first to get its
  gradient opens the unit's backward (regathered into the same slot, so the
  tensors autograd saved see the same memory with the same values); opening
  zeroes the unit's gradient buffer and makes it each trained parameter's
  ``.grad``, which autograd then accumulates into in place;
* each trained parameter's post-accumulate-grad hook reports that it got a
  gradient (the optimizer skips a parameter no rank gave one);
* the model's forward hook, with grad disabled (evaluation, generation),
  releases every unit;
* autograd's end-of-backward callback, queued when the first unit opens, lets
  the runtime close what is open and reduce zeros for units never reached.

Activation checkpointing works: a forward recomputed during backward finds its
unit gathered already, and the hooks leave the runtime alone then; under
reentrant checkpointing, whose first forward runs without grad (so the unit was
released and hooked no outputs), the recompute opens the unit's backward. Every
hook runs outside ``torch.compile``'s graphs ([Note: hooks and Dynamo]).

Parameters are empty placeholders whenever their unit is not gathered. So that
torch's own tools cannot silently see nothing, ``module.state_dict()`` raises
(naming the sharded model's own ``state_dict()``), and after a backward each trained
placeholder's ``.grad`` is a sentinel that raises when used (so
``torch.nn.utils.clip_grad_norm_(model.parameters())`` names the model's
``clip_grad_norm_`` instead of returning 0).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _dtypes, _validate
from .._errors import TideInvalid
from ..fsdp import AdamW, Runtime
from ..fsdp._lifecycle import BLIND, State, UseToken
from . import _init, _units

if TYPE_CHECKING:
    from .._group import Group

#: ``optimizer=``: the fused AdamW's settings, or a function making any torch optimizer
#: from the fp32 shards (see :meth:`Sharding.shard_parameters`).
Optimizer = Union[AdamW, Callable[[list], Any], None]


class Sharding:
    """What :func:`~tidearray.torch.shard_module` attaches to a module (its ``sharding``):
    the units, the runtime that gathers, reduces and steps them, the hooks, and the
    optimizer over the shards.

    Attributes:
        module: the sharded module (the one handle: ``shard_module`` returned it).
        runtime: the :class:`tidearray.fsdp.Runtime` the hooks drive.
        units: the units (``tidearray.torch._units.UnitSpec``), root first if any.
        names: each unit's parameter names, as the module names them.
        optimizer: the fused AdamW, or the torch optimizer ``optimizer=`` made (for
            learning-rate schedulers).
        group: the tidearray group; device: where gathered parameters live.
    """

    def __init__(self, module: torch.nn.Module, units: Optional[Sequence[Any]], *,
                 group: Optional[Group], param_dtype: Any, optimizer: Optimizer,
                 param_groups: Sequence[dict], prefetch: int, num_slots: Optional[int],
                 comm: Any,
                 keep_param_shards: bool, init_fn: Any, checkpoint: Optional[str],
                 device: Any) -> None:
        from .._group import default_group

        group = group or default_group()
        self.module = module
        self.module_class = type(module)  # the class it had, before shard_module swapped it
        self.group = group
        spec = _units.resolve(module, units)
        self.spec = spec
        self.units = list(spec.units)
        self.params = [list(u.params) for u in self.units]
        self.names = [list(u.names) for u in self.units]
        meta = any(_init.is_meta(p) for ps in self.params for p in ps)
        self.device = torch.device(device) if device is not None else (
            _default_device(group) if meta else self.params[0][0].device)
        init_fn = _init.default_init_fn(module, init_fn)
        values = _init.Values(spec, init_fn, checkpoint)
        errors = [f"checkpoint: expected every parameter, got none for {n!r}"
                  for n in values.missing()[:3]]
        if param_dtype is None:
            errors += _mixed_dtypes(self.names, self.params)
        _validate.check(group, "shard_module", _units.signature(spec), errors)
        dtype = _numpy_dtype(param_dtype if param_dtype is not None
                             else self.params[0][0].dtype)
        self.trainable = [[bool(p.requires_grad) for p in ps] for ps in self.params]
        fused, self._make_optimizer = _split_optimizer(optimizer)
        named = [list(zip(n, (tuple(p.shape) for p in ps)))
                 for n, ps in zip(self.names, self.params)]
        self.runtime = Runtime(
            named, init=values, group=group, param_dtype=dtype, optimizer=fused,
            prefetch=prefetch, comm=comm, keep_param_shards=keep_param_shards, root=spec.root,
            trainable=self.trainable, num_slots=num_slots, report_grads=True,
            on_release=self._use_placeholders, accumulate="sum",  # as torch's .grad
            param_groups=_param_groups(param_groups, fused, spec, self.names))
        if meta or checkpoint is not None:
            _init.materialise_buffers(module, self.device, values)
        values.close()
        self._empty = [[_placeholder(p, dtype, self.device) for p in ps] for ps in self.params]
        if meta:  # new Parameters, on the device, under every name the meta ones had
            self.params = [[_replace_param(spec, p, e) for p, e in zip(ps, es)]
                           for ps, es in zip(self.params, self._empty)]
        for ps, es in zip(self.params, self._empty):
            for p, e in zip(ps, es):
                p.data = e
        self._views: dict[tuple[str, int], tuple[list, list]] = {}
        self._live = [False] * len(self.units)  # parameters pointed at the unit's slot
        self._grads: dict[int, list] = {}  # open unit -> its gradient buffers (torch views)
        self._callback_queued = False
        self._in_pass = False  # a forward hook ran since the last pass ended
        self._members_left = [len(u.modules) for u in self.units]
        self._allow_state_dict = False
        self._sentinels = False
        self._stream: Any = None  # the torch stream the runtime issues on (None: the default)
        # Made once: each backward only assigns them (a parameter's, one placeholder's size).
        self._sentinel_grads = [(p, _ShardedGrad.make(e)) for ps, es in
                                zip(self.params, self._empty) for p, e in zip(ps, es)
                                if p.requires_grad]
        # Dynamo-free wrappers of what autograd calls each backward, made once.
        self._end_backward_eager = _outside_compile(self._end_backward)
        self._use_done_eager = _outside_compile(self.runtime.use_done)
        self._output_hooks = [_outside_compile(functools.partial(self._output_grad, u))
                              for u in range(len(self.units))]
        self._hooks = self._register()
        self._shards = self.shard_parameters() if self._make_optimizer is not None else []
        self._shard_grads = [t.grad for t in self._shards]  # the runtime's, set back each step
        self.optimizer = (self._make_optimizer(self._shards)
                          if self._make_optimizer is not None else self.runtime.optimizer)
        if self._make_optimizer is not None:
            _route_zero_grad(self.optimizer, self)

    # -- registration -----------------------------------------------------------------

    def _register(self) -> list:
        hooks = []
        for u, unit in enumerate(self.units):
            for m in unit.modules:
                hooks.append(m.register_forward_pre_hook(
                    _outside_compile(functools.partial(self._pre_forward, u)), with_kwargs=True))
                hooks.append(m.register_forward_hook(
                    _outside_compile(functools.partial(self._post_forward, u))))
            for k, p in enumerate(self.params[u]):
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(
                        _outside_compile(functools.partial(self._grad_ready, u, k))))
        hooks.append(self.module.register_forward_hook(_outside_compile(self._model_done)))
        owners = {id(m): m for ps in self.params for p in ps
                  for m, _ in self.spec.aliases[id(p)]}
        for m in owners.values():
            hooks.append(m.register_state_dict_pre_hook(self._guard_state_dict))
            hooks.append(m.register_load_state_dict_pre_hook(self._guard_load_state_dict))
        return hooks

    # -- forward --------------------------------------------------------------------

    def _pre_forward(self, u: int, module: Any, args: Any, kwargs: Any) -> Any:
        model = self.runtime
        if _in_backward():  # activation checkpointing recomputes the forward in backward:
            if model.state(u) in (State.IDLE, State.FORWARD):
                # Reentrant checkpointing ran the first forward without grad (the unit was
                # released and hooked no outputs): the recompute opens its backward.
                self._begin(u)
            return None  # else gathered already: its backward opened it
        if not self._in_pass:
            self._in_pass = True
            self._clear_sentinels()
            self._follow_stream()
        if not model.in_backward and model.state(u) is State.IDLE:
            self._check_order(u)
        if not torch.is_grad_enabled():
            self._use_gathered(u, model.pre_forward(u))
            return None
        inputs = _GradInputs(args, kwargs)
        use = UseToken() if inputs.tensors else BLIND  # [Note: unit lifecycle]
        self._use_gathered(u, model.pre_forward(u, use))
        if not inputs.tensors:
            return None
        outs = _PostBackward.apply(self, u, use, *inputs.tensors)
        return inputs.replaced(outs if isinstance(outs, tuple) else (outs,))

    def _check_order(self, u: int) -> None:
        """Units must be given in the order their forwards begin (the runtime prefetches
        the next one and assigns slots by that order); the same on every rank."""
        last = self.runtime.last_used()
        if last > u:
            raise TideInvalid(f"units: expected them in the order their forwards begin, got "
                              f"unit {u} ({type(self.units[u].modules[0]).__name__}) after unit "
                              f"{last}; pass the units in execution order")

    def _post_forward(self, u: int, module: Any, args: Any, output: Any) -> Any:
        if _in_backward():
            return None
        self._members_left[u] -= 1
        if self._members_left[u] > 0:
            return None  # a list unit: its other modules are still to run
        self._members_left[u] = len(self.units[u].modules)
        if torch.is_grad_enabled():
            # A block's output is mostly one tensor: flattened only when it is not.
            outs = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    _on_first_grad(t, self._output_hooks[u])
        self.runtime.post_forward(u)
        return None

    def _model_done(self, module: Any, args: Any, output: Any) -> None:
        """The whole model's forward returned: with grad disabled nothing will run a
        backward (evaluation, generation), so every gathered unit is released."""
        if not torch.is_grad_enabled() and not _in_backward():
            self.runtime.release()
            self._in_pass = False

    # -- backward ----------------------------------------------------------------------

    def _output_grad(self, u: int, grad: Any) -> None:
        if self.runtime.state(u) is not State.DONE:
            self._begin(u)

    def _begin(self, u: int) -> None:
        """Open unit ``u``'s backward: regathered, and each trained parameter's ``.grad``
        its (zeroed) gradient buffer, which autograd then accumulates into in place."""
        if self.runtime.state(u) is State.BACKWARD:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(
                self._end_backward_eager)
            self._callback_queued = True
        params, grads = self.runtime.pre_backward(u)
        self._use_gathered(u, params)
        views = self._grads[u] = self._torch_views("grads", u, grads)
        for p, g, t in zip(self.params[u], views, self.trainable[u]):
            if t:
                p.grad = g

    def _grad_ready(self, u: int, k: int, param: Any) -> None:
        grad = param.grad  # autograd's own where the unit was not open yet: moved over
        state = self.runtime.state(u)
        if state is not State.BACKWARD:  # (per parameter and step: the open unit first)
            if state is State.DONE:
                raise TideInvalid(f"parameter {self.names[u][k]!r} (unit {u}): expected its "
                                  "gradient before its unit's backward was done, got it after "
                                  "its reduction began: is it used outside its unit? Put it in "
                                  "a unit that holds every module using it (or in the root)")
            self._begin(u)
        buf = self._grads[u][k]
        if grad is not buf:
            param.grad = buf
            buf.add_(grad)
        self.runtime.grad_written(u, k)

    def _end_backward(self) -> None:
        """Autograd's engine runs this when a backward pass is done."""
        try:
            self.runtime.finish_backward()
        finally:
            self._callback_queued = False
            self._in_pass = False
        self._set_sentinels()

    # -- streams ----------------------------------------------------------------------

    def _follow_stream(self) -> None:
        """The runtime issues on torch's current stream, read at each pass and step: a
        forward on a side stream, or inside ``torch.cuda.graph``'s capture, has its
        gathers and reductions on that stream ([Note: torch captured steps] in
        ``_graph``). The new stream waits for the old one, whose kernels may still read
        the slots, except while it captures: a capture cannot wait on uncaptured work,
        and ``torch.cuda.graph`` synchronizes the device before it begins."""
        if self.group.backend.name != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        if self._stream is not None and stream == self._stream:
            return
        # Until the first pass, the runtime issued on the default stream (CuPy's current).
        old = self._stream if self._stream is not None else torch.cuda.default_stream(self.device)
        if stream != old and not torch.cuda.is_current_stream_capturing():
            stream.wait_stream(old)
        from ..backends.cuda.streams import cupy_stream

        self._stream = stream
        self.runtime.stream = cupy_stream(stream)

    # -- parameters' storage ------------------------------------------------------------

    def _torch_views(self, what: str, u: int, arrays: list) -> list:
        """Torch views of unit ``u``'s ``arrays``, made again only when the runtime hands
        out other arrays (a unit takes the same slot step after step)."""
        hit = self._views.get((what, u))
        if hit is None or hit[0] is not arrays:
            shapes = self.runtime.shapes[u]
            hit = self._views[(what, u)] = (arrays, [_tensor(a, s) for a, s in
                                                     zip(arrays, shapes)])
        return hit[1]

    def _use_gathered(self, u: int, arrays: list) -> None:
        """Unit ``u``'s parameters' ``.data`` become torch views of its gathered slot."""
        if self._live[u]:
            return  # on this gather already (a released unit is back on its placeholders)
        for p, t in zip(self.params[u], self._torch_views("params", u, arrays)):
            p.data = t
        self._live[u] = True

    def _use_placeholders(self, u: int) -> None:
        """Unit ``u``'s parameters' ``.data`` become their empty placeholders again (the
        runtime released the unit's slot)."""
        if self._live[u]:
            for p, e in zip(self.params[u], self._empty[u]):
                p.grad = None  # the gradient buffer goes with the slot
                p.data = e
            self._live[u] = False

    def _set_sentinels(self) -> None:
        for p, s in self._sentinel_grads:
            p.grad = s
        self._sentinels = True

    def _clear_sentinels(self) -> None:
        if self._sentinels:
            for p, s in self._sentinel_grads:
                if p.grad is s:
                    p.grad = None
            self._sentinels = False

    @contextlib.contextmanager
    def sentinels_cleared(self) -> Iterator[None]:
        """No sentinel ``.grad`` inside (``nn.Module._apply`` converts each ``.grad``);
        put back after, if they were set."""
        were = self._sentinels
        self._clear_sentinels()
        try:
            yield
        finally:
            if were:
                self._set_sentinels()

    def _guard_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        if not self._allow_state_dict:
            raise TideInvalid("state_dict() of a submodule of a model sharded by tidearray: "
                              "expected the sharded model's own state_dict() (full or "
                              "sharded), got a submodule's, whose parameters are empty "
                              "placeholders")

    def _guard_load_state_dict(self, *args: Any) -> None:
        if not self._allow_state_dict:
            raise TideInvalid("load_state_dict() of a submodule of a model sharded by "
                              "tidearray: expected the sharded model's own load_state_dict() "
                              "(full or sharded), got a submodule's, whose parameters are "
                              "empty placeholders")

    # -- the step -------------------------------------------------------------------------

    def step(self, lr: Optional[float] = None) -> Any:
        """The model's ``step`` (:meth:`ShardedModule.step`): the fused AdamW (see
        :meth:`Runtime.step`) or the torch optimizer ``optimizer=`` made."""
        self._clear_sentinels()
        self._follow_stream()
        if self._make_optimizer is None:
            return self._norm_out(self.runtime.step(lr))
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        self.runtime.apply_step(self._torch_step)
        return None

    def _torch_step(self, present: Any) -> None:
        """The torch optimizer's step over the shards, with no ``.grad`` on a parameter that
        no rank gave a gradient (torch's optimizers skip those, as in one process). Each
        other trained shard's ``.grad`` is the runtime's gradient shard, set back if
        anything replaced it (the optimizer's ``zero_grad()`` goes to :meth:`zero_grad`
        and leaves them; a ``p.grad = None`` of the user's does not skip a parameter
        that got a gradient)."""
        # Set only what differs: a step of a large model touches few ``.grad``s.
        for t, g, ok in zip(self._shards, self._shard_grads, present):
            want = g if ok else None
            if t.grad is not want:
                t.grad = want
        try:
            self.optimizer.step()
        finally:
            for t, g in zip(self._shards, self._shard_grads):
                if t.grad is not g:
                    t.grad = g

    def zero_grad(self) -> None:
        """The model's (and a torch ``optimizer=``'s) ``zero_grad()``: the gradients
        accumulated since the last step are dropped, as torch drops them
        (:meth:`Runtime.zero_grad`); no sentinel ``.grad`` is left."""
        self._clear_sentinels()
        self.runtime.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> Union[float, torch.Tensor]:
        """The model's ``clip_grad_norm_`` (:meth:`ShardedModule.clip_grad_norm_`), on the
        stream torch issues on now."""
        self._follow_stream()
        return self._norm_out(self.runtime.clip_grad_norm_(max_norm))

    def _norm_out(self, norm: Any) -> Any:
        """A norm as the runtime gave it (None, a float), or, from inside a capture (a
        device array), as a torch tensor on the same memory."""
        if norm is None or isinstance(norm, float):
            return norm
        from ..backends.cuda.streams import on_stream

        # With CuPy's current stream the capturing one, the DLPack exchange orders
        # nothing (the same stream on both sides); from another stream it would make
        # the capture wait on work outside it.
        with on_stream(self.runtime.stream):
            return torch.from_dlpack(norm)

    def shard_parameters(self) -> list:
        """This rank's fp32 master shards as torch tensors (padded rows), each trained one
        with its fp32 gradient shard as ``.grad``: what a torch optimizer steps
        (``optimizer=``). The runtime sets the gradients to the gradient averaged over
        the ranks (summed over the backwards since the last step) before that step; a
        frozen shard has no ``.grad`` (and ``requires_grad=False``), nor, during a step,
        has a shard that no rank gave a gradient, so a torch optimizer leaves both
        bitwise unchanged."""
        out = []
        for u in range(len(self.units)):
            for k, (m, g) in enumerate(zip(self.runtime.params(u), self.runtime.grads(u))):
                t = torch.nn.Parameter(_tensor(m, m.shape), requires_grad=self.trainable[u][k])
                if self.trainable[u][k]:
                    t.grad = _tensor(g, g.shape)
                out.append(t)
        return out

    def close(self) -> None:
        """Remove the hooks and release the runtime's communicators (collective); the
        parameters stay empty placeholders (take a state dict first)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.runtime.close()


def _route_zero_grad(optimizer: Any, sharding: Sharding) -> None:
    """``optimizer.zero_grad()`` (the torch optimizer over the shards) drops the accumulated
    gradients through ``sharding``, as in torch, instead of setting the shards' ``.grad`` to
    None (the runtime's gradient shards, which the optimizer must keep seeing)."""
    if not callable(getattr(optimizer, "zero_grad", None)):
        return

    def zero_grad(set_to_none: bool = True) -> None:
        sharding.zero_grad()

    optimizer.zero_grad = zero_grad


class _GradInputs:
    """A forward's tensor inputs that need a gradient, and the inputs with those replaced.

    Top-level tensors (a decoder layer's hidden states) are found without flattening;
    only containers are flattened (pytree flattening of a Hugging Face layer's keyword
    arguments costs tens of microseconds a call)."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        self.tensors: list = []
        self._where: list = []  # (is_kwarg, key, None or (flat, tree, indices))
        for is_kwarg, items in ((False, enumerate(args)), (True, kwargs.items())):
            for key, value in items:
                self._scan(is_kwarg, key, value)

    def _scan(self, is_kwarg: bool, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                self.tensors.append(value)
                self._where.append((is_kwarg, key, None))
        elif isinstance(value, (tuple, list)) and not any(
                isinstance(v, (tuple, list, dict)) or (isinstance(v, torch.Tensor)
                                                       and v.requires_grad) for v in value):
            return  # a flat sequence with nothing that needs a gradient (rotary cos, sin)
        elif isinstance(value, (tuple, list, dict)) and value:
            flat, tree = tree_flatten(value)
            idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if idx:
                self.tensors.extend(flat[i] for i in idx)
                self._where.append((is_kwarg, key, (flat, tree, idx)))

    def replaced(self, outs: tuple) -> tuple:
        args, kwargs = list(self.args), dict(self.kwargs)
        it = iter(outs)
        for is_kwarg, key, nested in self._where:
            if nested is None:
                value = next(it)
            else:
                flat, tree, idx = nested
                for i in idx:
                    flat[i] = next(it)
                value = tree_unflatten(flat, tree)
            if is_kwarg:
                kwargs[key] = value
            else:
                args[key] = value
        return tuple(args), kwargs


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once their gradients are
    computed, that is when the unit's backward is done (FSDP2's
    ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, owner: Sharding, u: int, use: UseToken, *inputs: Any) -> Any:
        ctx.owner, ctx.u, ctx.use = owner, u, use  # the context keeps the use's token alive
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.owner._use_done_eager(ctx.u, ctx.use)
        return (None, None, None) + grads


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
        if name not in cls.ALLOWED:
            raise TideInvalid("a gradient of a module sharded by tidearray: expected "
                              "the sharded model's clip_grad_norm_() or its shards "
                              "(shard_parameters()), got a use of the placeholder's .grad "
                              f"({name or func})")
        return super().__torch_function__(func, types, args, kwargs or {})


def _on_first_grad(t: torch.Tensor, hook: Callable[..., Any]) -> None:
    """``hook`` runs when autograd is about to compute the gradient of ``t``'s inputs (the
    moment a hook on ``t`` would run): a pre-hook of the node that made ``t``, registered
    in C++ (``Tensor.register_hook`` costs a few microseconds of Python more); a hook on
    ``t`` itself where no node made it (a leaf)."""
    node = t.grad_fn
    if node is None:
        t.register_hook(hook)
    else:
        node.register_prehook(hook)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


#: Dynamo's frame-evaluation callback on this thread (None: no frame is compiled here).
#: None where torch lacks it: every hook call then goes through ``torch._dynamo.disable``.
_FRAME_CALLBACK: Optional[Callable[[], Any]] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
    "get_eval_frame_callback", None)


def _outside_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly, never traced by Dynamo: the hooks keep the runtime's state.

    [Note: hooks and Dynamo]
    A hook must not be traced into a ``torch.compile`` graph, nor may Dynamo compile
    the runtime's frames it calls. ``torch._dynamo.disable`` ensures both, but each call
    through it switches Dynamo's frame evaluation off and on again (about a microsecond,
    and a hook runs several times per unit per step). So the hook decides per call:
    while Dynamo traces it (``torch.compile`` of the model, or of a function calling
    it), ``is_compiling()`` is a constant True in the trace and the call goes to the
    disabled ``fn`` (a graph break, run eagerly); when a hook runs eagerly while
    Dynamo evaluates frames on this thread (the eager part of a compiled function
    around a graph break, or a frame Dynamo gave up on), the frame callback is set and
    the call goes to the disabled ``fn`` too; otherwise (no compile on this thread: the
    eager loop, a block compiled on its own, whose hooks run in ``Module.__call__``,
    and a backward on autograd's device threads) it calls ``fn`` directly. Dynamo
    never compiles the deciding frame itself (``skip_code``): compiled once per hook,
    its guards on the arguments would reach Dynamo's recompile limit, which warns.
    """
    # The first call imports torch._dynamo, and with it sympy, whose import adds a
    # process-wide warnings filter: keep the caller's filters as they were.
    with warnings.catch_warnings():
        disabled = torch._dynamo.disable(fn, recursive=True)
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    frame_callback = _FRAME_CALLBACK
    if frame_callback is None or skip_code is None:
        return disabled
    is_compiling = torch.compiler.is_compiling

    def hook(*args: Any) -> Any:
        if is_compiling() or frame_callback() is not None:
            return disabled(*args)
        return fn(*args)

    skip_code(hook.__code__)
    return hook


def _placeholder(p: Any, dtype: np.dtype, device: Any) -> Any:
    return torch.empty(0, dtype=getattr(torch, dtype.name), device=device)


def _replace_param(spec: Any, old: Any, empty: Any) -> Any:
    """A real Parameter in place of a meta one, under every name it had."""
    new = torch.nn.Parameter(empty, requires_grad=old.requires_grad)
    for module, attr in spec.aliases[id(old)]:
        module._parameters[attr] = new
    spec.aliases[id(new)] = spec.aliases[id(old)]
    spec.all_names[id(new)] = spec.all_names[id(old)]
    return new


def _tensor(a: Any, shape: Any) -> Any:
    """A torch view of a tidearray array (NumPy or CuPy), no copy; bf16 included."""
    if isinstance(a, np.ndarray):
        if a.dtype == _dtypes.bfloat16:  # NumPy's DLPack has no bf16: move the bits
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(a).reshape(shape)
    return torch.from_dlpack(a).reshape(shape)


def _mixed_dtypes(names: list[list[str]], params: list[list[Any]]) -> list[str]:
    """The error, if any, of parameters of several dtypes without ``param_dtype``: every
    parameter is gathered in one dtype, so casting some silently (fp32 norms or LoRA
    adapters on a bf16 model gathered in bf16) is refused, as FSDP2 refuses mixed
    dtypes without a ``MixedPrecisionPolicy``."""
    first: dict[Any, str] = {}
    for ns, ps in zip(names, params):
        for n, p in zip(ns, ps):
            first.setdefault(p.dtype, n)
    if len(first) < 2:
        return []
    seen = ", ".join(f"{str(d).replace('torch.', '')} ({n!r}, ...)" for d, n in first.items())
    return [f"param_dtype: every parameter is gathered in one dtype; expected parameters of "
            f"one dtype or param_dtype= (the dtype to gather in), got {seen}"]


def _numpy_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).replace("torch.", "")
    if name not in _dtypes.SUPPORTED:
        raise TideInvalid(f"param_dtype: expected bfloat16, float16 or float32, got {dtype}")
    return _dtypes.SUPPORTED[name]


def _default_device(group: Group) -> torch.device:
    if group.backend.name == "cuda":
        return torch.device("cuda", group.backend.device)
    return torch.device("cpu")


def _split_optimizer(optimizer: Optimizer) -> tuple[Optional[AdamW], Optional[Callable]]:
    if optimizer is None or isinstance(optimizer, AdamW):
        return optimizer, None
    if callable(optimizer):
        return None, optimizer
    raise TideInvalid(f"optimizer: expected an AdamW or a function making a torch optimizer "
                      f"from a list of tensors, got {type(optimizer).__name__}")


_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay"}


def _param_groups(groups: Sequence[dict], fused: Optional[AdamW], spec: Any,
                  names: list) -> list:
    """Torch-style groups as the runtime's ``(AdamW, names)`` pairs."""
    base = fused or AdamW()
    known = {n for ns in names for n in ns}
    out = []
    for j, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g or set(g) - _GROUP_KEYS:
            raise TideInvalid(f"param_groups[{j}]: expected a dict with 'params' and any of "
                              f"lr, betas, eps, weight_decay, got {g!r}"[:300])
        chosen = []
        for p in g["params"]:
            name = p if isinstance(p, str) else spec.all_names.get(id(p), (None,))[0]
            if name not in known:
                raise TideInvalid(f"param_groups[{j}]: expected parameters of the model (or "
                                  f"their names), got {p if isinstance(p, str) else type(p)}")
            chosen.append(name)
        opts = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
        out.append((replace(base, max_grad_norm=None, **opts), chosen))
    return out


