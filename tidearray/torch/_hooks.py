"""The module and autograd hooks of a sharded model: they report events to the runtime
([Note: torch front end] in ``_sharding``).

[Note: hooks]
The hooks only report events to the runtime, which alone knows where each unit
is in its pass ([Note: unit lifecycle] in ``tidearray.fsdp._lifecycle``); they
read its lifecycle (``runtime.life``) to decide, and keep no pass state of their
own:

* a forward pre-hook of each of the unit's modules is one use of the unit:
  the runtime gathers it if it is not (and prefetches the next), and its
  parameters' ``.data`` point at the gathered slot, zero-copy through DLPack
  ([Note: parameter storage] in ``_storage``); the first use of a pass (the
  lifecycle's ``in_pass`` False) clears the sentinel ``.grad``s and follows
  torch's current stream (``_streams``); with grad enabled the forward's
  inputs that need a gradient pass through ``_PostBackward``, whose backward
  runs when their gradients are computed, that is when this use's backward is
  done: it reports the use's token (``use_done``), and the runtime closes the
  unit once no use is pending. Where the one input that needs a gradient is
  the output the unit before left (a layer's hidden states: ``_Boundary``),
  the hook that opens that unit's backward reports the use first instead,
  when that output's gradient is complete, which autograd computes only
  after every use of it, this one included: the same end, without an
  autograd function per unit (its apply is most of a hook's host time);
* a forward hook lets the slot go (the runtime keeps the last unit and the
  root; a unit of several modules when the last of them is done, the
  lifecycle's ``forward_done``) and hooks each output tensor (a pre-hook of
  the node that made it, or of the tensor, a leaf): the first to get its gradient
  reports the uses that output fed (``_Boundary``, above), then
  opens the unit's backward (regathered into the same slot, so the tensors
  autograd saved see the same memory with the same values); autograd then sets
  the ``.grad`` of each parameter it reaches, which the runtime's reduction of
  the unit copies into its buffer ([Note: parameter storage]: no hook per
  parameter; the optimizer skips a parameter no rank gave one). A unit the
  runtime suspended (its slot given to another unit's backward: the
  lifecycle's ``suspended``) is opened again the same way by its next output
  gradient;
* the model's forward hook, with grad disabled (evaluation, generation),
  releases every unit;
* autograd's end-of-backward callback, queued by the open that begins the
  backward phase (the lifecycle's ``in_backward`` False), lets the runtime
  close what is open and reduce zeros for units never reached; a ``.grad``
  left set then came after its unit was reduced (a parameter used outside its
  unit) and raises; then each trained placeholder's ``.grad`` is a sentinel.

Activation checkpointing works: a forward recomputed during backward finds its
unit gathered already, and the hooks leave the runtime alone then; under
reentrant checkpointing, whose first forward runs without grad (so the unit was
released and hooked no outputs), the recompute opens the unit's backward. Every
hook runs outside ``torch.compile``'s graphs ([Note: hooks and Dynamo]).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._errors import TideInvalid
from ..fsdp import BLIND, State, UseToken

if TYPE_CHECKING:
    from ..fsdp import Runtime
    from ._storage import ParamStorage
    from ._streams import TorchStream


class Hooks:
    """A sharded model's hooks ([Note: hooks]): made once, registered by :meth:`register`.

    Args:
        module: the model (its forward hook ends a forward-only pass).
        units: the units (``_units.UnitSpec``), in the runtime's order.
        runtime: the :class:`tidearray.fsdp.Runtime` they drive.
        storage: the parameters' storage (``_storage.ParamStorage``).
        stream: the stream follower (``_streams.TorchStream``).
    """

    def __init__(self, module: torch.nn.Module, units: Sequence[Any], runtime: Runtime,
                 storage: ParamStorage, stream: TorchStream) -> None:
        self.module = module
        self.units = units
        self.runtime = runtime
        self.life = runtime.life  # where each unit is in its pass: read here, kept there
        self.storage = storage
        self.stream = stream
        self._members = [len(unit.modules) for unit in units]
        # Dynamo-free wrappers of what autograd calls each backward, made once.
        self._end_backward_eager = _outside_compile(self._end_backward)
        self._use_done_eager = _outside_compile(runtime.use_done)
        self._output_hooks = [_outside_compile(functools.partial(self._open, u))
                              for u in range(len(units))]
        self._boundary_hook = _outside_compile(self._boundary_grad)
        #: The last unit output hooked in this pass's forward, as a ``_Boundary`` (None:
        #: none, or a pass began since): the next use's one grad input, if it is that.
        self._boundary: Optional[_Boundary] = None
        # The parameters frozen when the model was sharded: they have no gradient buffer,
        # so one unfrozen later would have its gradient dropped (checked each backward).
        self._frozen = [(u, k, p) for u, ps in enumerate(storage.params)
                        for k, p in enumerate(ps) if not p.requires_grad]

    def register(self) -> list:
        """Register the hooks; returns their handles."""
        handles = []
        for u, unit in enumerate(self.units):
            for m in unit.modules:
                handles.append(m.register_forward_pre_hook(
                    _outside_compile(functools.partial(self._pre_forward, u)), with_kwargs=True))
                handles.append(m.register_forward_hook(
                    _outside_compile(functools.partial(self._post_forward, u))))
        handles.append(self.module.register_forward_hook(_outside_compile(self._model_done)))
        return handles

    # -- forward --------------------------------------------------------------------

    def _pre_forward(self, u: int, module: Any, args: Any, kwargs: Any) -> Any:
        runtime, life = self.runtime, self.life
        if _graph_task_id() != -1:  # in autograd's backward: activation checkpointing
            if life.state[u] is not State.DONE and not life.is_open(u):  # recomputes it
                # Reentrant checkpointing ran the first forward without grad (the unit was
                # released and hooked no outputs): the recompute opens its backward.
                self._open(u)
            return None  # else gathered already: its backward opened it
        if not life.in_pass:  # the first use of a pass
            self.storage.clear_sentinels()
            self.stream.follow()
            self._boundary = None
        if life.last_used > u and not life.in_backward and life.state[u] is State.IDLE:
            raise self._order_error(u)
        if not torch.is_grad_enabled():
            self.storage.use_gathered(u, runtime.pre_forward(u))
            return None
        inputs = _GradInputs(args, kwargs)
        use = UseToken() if inputs.tensors else BLIND  # [Note: unit lifecycle]
        self.storage.use_gathered(u, runtime.pre_forward(u, use))
        if not inputs.tensors:
            return None
        boundary = self._boundary
        if (boundary is not None and len(inputs.tensors) == 1
                and boundary.output() is inputs.tensors[0]):
            boundary.uses.append((u, use))  # reported by that output's hook ([Note: hooks])
            return None
        outs = _PostBackward.apply(self._use_done_eager, u, use, *inputs.tensors)
        return inputs.replaced(outs if isinstance(outs, tuple) else (outs,))

    def _order_error(self, u: int) -> TideInvalid:
        """Units must be given in the order their forwards begin (the runtime prefetches
        the next one and assigns slots by that order); the same on every rank: unit ``u``
        began its pass's first use after a later unit."""
        return TideInvalid(f"units: expected them in the order their forwards begin, got "
                           f"unit {u} ({type(self.units[u].modules[0]).__name__}) after unit "
                           f"{self.life.last_used}; pass the units in execution order")

    def _post_forward(self, u: int, module: Any, args: Any, output: Any) -> Any:
        if _graph_task_id() != -1:  # in autograd's backward (a recompute)
            return None
        members = self._members[u]
        if members > 1 and not self.life.forward_done(u, members):
            return None  # a list unit: its other modules are still to run
        self._boundary = None
        if torch.is_grad_enabled():
            # A block's output is mostly one tensor: flattened only when it is not.
            outs = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            outs = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
            hook = self._output_hooks[u]
            if len(outs) == 1:  # one output: the next unit's input, mostly ([Note: hooks])
                self._boundary = _Boundary(outs[0])
                hook = functools.partial(self._boundary_hook, u, self._boundary)
            for t in outs:
                # The hook runs when autograd is about to compute the gradient of t's
                # inputs: a pre-hook of the node that made t, registered in C++
                # (Tensor.register_hook costs a few microseconds of Python more); on t
                # itself where no node made it (a leaf).
                node = t.grad_fn
                if node is None:
                    t.register_hook(hook)
                else:
                    node.register_prehook(hook)
        self.runtime.post_forward(u)
        return None

    def _model_done(self, module: Any, args: Any, output: Any) -> None:
        """The whole model's forward returned: with grad disabled nothing will run a
        backward (evaluation, generation), so every gathered unit is released (and the
        pass ends: the lifecycle forgets its forward)."""
        if not torch.is_grad_enabled() and _graph_task_id() == -1:  # (not in a backward)
            self.runtime.release()

    # -- backward ----------------------------------------------------------------------

    def _open(self, u: int, grad: Any = None) -> None:
        """Open unit ``u``'s backward (the first gradient of one of its outputs, ``grad``,
        came, or a recompute began): regathered; autograd then sets its parameters'
        ``.grad``s, which its reduction takes ([Note: parameter storage]). Open already
        (another of its outputs' gradients came first) or reduced already, it is left
        alone; a suspended unit lost its slot: opened again, regathered."""
        life = self.life
        state = life.state[u]
        if state is State.DONE or (state is State.BACKWARD and u not in life.suspended):
            return  # (read in place: life.is_open, without its call)
        if not life.in_backward:  # the backward phase begins: autograd says when it ends
            torch.autograd.Variable._execution_engine.queue_callback(
                self._end_backward_eager)
            self.storage.clear_sentinels()  # (a second backward of a retained graph)
        self.storage.use_gathered(u, self.runtime.open_backward(u))

    def _boundary_grad(self, u: int, boundary: _Boundary, grad: Any = None) -> None:
        """The gradient of unit ``u``'s one output came: the uses it fed are done (their
        own inputs' gradients, autograd's node runs once every use of the output is), then
        ``u`` opens ([Note: hooks])."""
        for i, use in boundary.uses:
            self.runtime.use_done(i, use)
        self._open(u)

    def _end_backward(self) -> None:
        """Autograd's engine runs this when a backward pass is done."""
        self.runtime.finish_backward()
        stray = self.storage.set_sentinels()  # every unit is reduced now: a .grad left is
        self.check_grads_taken(stray)  # stray (raised after the backward's end, as below)
        thawed = [self.runtime.names[u][k] for u, k, p in self._frozen if p.requires_grad]
        if thawed:  # after the backward's end, so the model stays usable once refrozen
            raise TideInvalid(
                f"expected the parameters frozen when the model was sharded to stay frozen, "
                f"got {len(thawed)} with requires_grad=True ({', '.join(thawed[:4])}"
                f"{', ...' if len(thawed) > 4 else ''}): their gradients have nowhere to go. "
                "Freezing during training is supported, unfreezing is not: set "
                "requires_grad=True before shard_module (and False for the steps it "
                "waits), or shard the model again")

    def check_grads_taken(self, stray: Optional[list] = None) -> None:
        """Raise if a parameter's ``.grad`` was set while its unit's backward was not open
        and no reduction took it (``stray``, else :meth:`ParamStorage.stray_grads`): at the
        end of a backward and before a step it would be lost. (Before that, an open of its
        unit in the same pass takes it, as torch adds a ``.grad`` to the next.)"""
        stray = self.storage.stray_grads() if stray is None else stray
        if stray:
            u, k = stray[0]
            raise TideInvalid(
                f"parameter {self.runtime.names[u][k]!r} (unit {u}): expected its gradient "
                "while its unit's backward was open, got it outside (after the unit was "
                "reduced, or from a backward that reached none of the unit's outputs): is it "
                "used outside its unit? Put it in a unit that holds every module using it "
                "(or in the root); zero_grad() drops it")


class _Boundary:
    """A unit's one output that needs a gradient, and the uses of later units whose one
    grad input it is ([Note: hooks]): the hook on the output's node reports them. The
    output is held weakly (a forward's last output must not outlive its graph), the uses'
    tokens by the hook, so as long as the graph (as ``_PostBackward``'s context holds one)."""

    __slots__ = ("output", "uses")

    def __init__(self, output: Any) -> None:
        self.output = weakref.ref(output)
        self.uses: list[tuple[int, UseToken]] = []


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
                if isinstance(value, torch.Tensor):  # (here, not in a call: most inputs)
                    if value.requires_grad:
                        self.tensors.append(value)
                        self._where.append((is_kwarg, key, None))
                elif isinstance(value, (tuple, list, dict)) and value:
                    self._scan(is_kwarg, key, value)

    def _scan(self, is_kwarg: bool, key: Any, value: Any) -> None:
        """A non-empty container input."""
        if isinstance(value, (tuple, list)) and not any(
                isinstance(v, (tuple, list, dict)) or (isinstance(v, torch.Tensor)
                                                       and v.requires_grad) for v in value):
            return  # a flat sequence with nothing that needs a gradient (rotary cos, sin)
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
    def forward(ctx: Any, use_done: Callable[[int, UseToken], None], u: int, use: UseToken,
                *inputs: Any) -> Any:
        ctx.use_done, ctx.u, ctx.use = use_done, u, use  # the context keeps the token alive
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.use_done(ctx.u, ctx.use)
        return (None, None, None) + grads


#: The id of the backward pass autograd runs on this thread (-1: none); read in the
#: hooks themselves (a call less per hook).
_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


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
    it), ``is_dynamo_compiling()`` is a constant True in the trace and the call goes to
    the disabled ``fn`` (a graph break, run eagerly; ``is_compiling()`` says the same
    to Dynamo, and costs a call more: it asks ``is_scripting()`` first); when a hook
    runs eagerly while Dynamo evaluates frames on this thread (the eager part of a
    compiled function around a graph break, or a frame Dynamo gave up on), the frame
    callback is set and the call goes to the disabled ``fn`` too; otherwise (no compile
    on this thread: the eager loop, a block compiled on its own, whose hooks run in
    ``Module.__call__``, and a backward on autograd's device threads) it calls ``fn``
    directly. Dynamo never compiles the deciding frame itself (``skip_code``): compiled
    once per hook, its guards on the arguments would reach Dynamo's recompile limit,
    which warns.
    """
    # The first call imports torch._dynamo, and with it sympy, whose import adds a
    # process-wide warnings filter: keep the caller's filters as they were.
    with warnings.catch_warnings():
        disabled = torch._dynamo.disable(fn, recursive=True)
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    frame_callback = _FRAME_CALLBACK
    if frame_callback is None or skip_code is None:
        return disabled
    is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)

    def hook(*args: Any) -> Any:
        if is_compiling() or frame_callback() is not None:
            return disabled(*args)
        return fn(*args)

    skip_code(hook.__code__)
    return hook
