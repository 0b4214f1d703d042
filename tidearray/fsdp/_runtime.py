"""``ShardedModel``: the FSDP runtime over a list of units.

It knows nothing of autograd. A front end calls four hooks per unit, at the
points where FSDP2 hooks in, and :meth:`ShardedModel.step` once per step::

    for i in range(n):                      # forward
        params = model.pre_forward(i)       # gathered (prefetch of i+1.. issued)
        x = forward(i, params, x)
        model.post_forward(i)               # slot free for the next gather
    for i in reversed(range(n)):            # backward
        params, grads = model.pre_backward(i)
        dx = backward(i, params, dx, grads) # writes the unit's gradients into grads
        model.post_backward(i)              # reduce-scatter starts; slot reused as staging
    model.step()                            # fused AdamW on the shards

[Note: slots]
``prefetch + 1`` slots; unit ``i`` is always gathered into slot
``i % (prefetch + 1)``, when first needed or prefetched, so its parameters
have the same addresses in forward and in backward (front ends whose autograd
saved the forward's parameter tensors find them again, regathered, in
backward). A slot is free again after its unit's forward (the last unit stays
for its backward, as FSDP2 keeps the root) or after its backward. A gather
into a slot is ordered after everything the compute stream issued before the
gather was issued, so it never overwrites parameters still in use; on the tide
path its grant also follows the reduce-scatter that staged in that slot
(Slot-Reuse).

A backward prefetch whose slot still holds a unit (autograd may start unit
``i-1``'s backward before unit ``i``'s gradients are all in, and unit ``i-2``
shares unit ``i``'s slot) is deferred: it is issued when that slot is released
(``post_backward``), so ``prefetch + 1`` slots suffice for autograd too. Every
rank defers the same prefetches, since every rank runs the same hooks in the
same order.

[Note: passes]
Real training loops do not always pair a forward with a backward, nor give
every parameter a gradient. The runtime keeps, per pass, the units forwarded,
the units whose backward began (``pre_backward``) and the units reduced:

* a ``pre_forward`` of a unit already forwarded in this pass starts a new pass:
  the old one had no backward (an evaluation, a discarded forward), so its
  gathered units are released (``release``) and nothing of it is reduced;
* a backward pass ends (and its micro-batch counts) at :meth:`finish_backward`,
  which the torch front end calls from autograd's end-of-backward callback and
  which the next pass's first ``pre_forward`` and ``step`` call otherwise. It
  reduces zeros for every unit with trainable parameters not reduced yet:
  forwarded units whose backward never began (gathered, then reduced), and
  units not forwarded at all (no collective: a sum of zeros is zero on every
  rank);
* units are reduced in descending order on every rank, whatever order each
  rank's gradients arrive in, so every rank issues the same collectives in the
  same order (a unit's missing gradients are zeros; the front end writes them).

With ``root=True`` unit 0 is the root, as FSDP2's: the parameters used around
the other units (embedding, final norm, head, a weight tied between them). It
has a slot of its own, is gathered at its ``pre_forward`` and stays gathered
until its ``post_backward``, which comes last.

[Note: gradient buffers]
Unit ``i`` in slot ``k`` writes its gradients into gradient buffer ``k``
(``num_slots`` of them, each as big as the largest unit). The reduction of
buffer ``k`` reads it on tidearray's lanes while compute goes on; before
buffer ``k`` is handed to another backward, the compute stream waits for that
reduction (``_retire``). So at most ``num_slots`` units' gradients exist at once
and nothing blocks the host.

[Note: streams]
Compute runs on the caller's stream (``stream=``, CuPy's current stream if
None). Gathers and reductions run on tidearray's lanes (or a comm factory's
side streams), forked from the compute stream when issued and joined back by
stream waits (events): in the steady state no call blocks the host, except
reading back the gradient norm when clipping is on (not inside a capture).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import _dtypes
from .._errors import TideInvalid
from .._group import Group, default_group
from ._comm import UnitComm, comm_factory
from ._norm import GlobalNorm
from ._optim import AdamW, FusedAdamW, ParamGroup, clip_scale, on_stream
from ._shards import ShardArena, arena_layout

Init = Callable[[str, tuple], Any]


class ShardedModel:
    """A model's units, sharded over the group, with their optimizer. Collective.

    Args:
        units: per FSDP unit, ``(name, value)`` pairs: ``value`` is the full
            parameter (any array; the same on every rank) or, with ``init``, its
            shape. Names must be unique.
        init: ``init(name, shape)`` returns a full parameter (any array), called
            one parameter at a time so that only one full parameter exists at once.
        group: the group (default: the last ``init``).
        param_dtype: dtype of the gathered parameters and of the gradients
            (bf16 default; fp32 masters are kept either way).
        optimizer: AdamW hyper-parameters (defaults of :class:`AdamW`).
        prefetch: units gathered ahead of the one running (1).
        num_slots: slots (and gradient buffers); ``prefetch + 1`` if None (more
            only spread the gathers further apart; see [Note: slots]).
        comm: ``"tide"`` (default), or a comm factory: a
            :class:`~tidearray.fsdp._comm.UnitComm` subclass, called as
            ``comm(group, shapes, dtype, arena, num_slots, root)``, whose
            ``sharded_over(group)`` and ``send_shards`` size the shard arena
            (see ``UnitComm``). The benchmarks' baselines are such factories
            (``benchmarks.baselines.StockComm``, FSDP2's flat path, and
            ``LocalComm``, the no-communication floor).
        keep_param_shards: ``tide`` only: keep a param-dtype copy of this
            rank's shards, written by the optimizer, and gather from it, instead
            of casting the masters into the slot at every gather. Costs
            ``param_dtype.itemsize`` bytes per sharded parameter; saves the cast
            kernels (one per gather) beside the compute. A factory's
            ``send_shards`` says whether it keeps them.
        stream: the compute stream (cuda; CuPy's current stream if None).
        root: unit 0 is the root unit (its own slot; gathered from its
            ``pre_forward`` to its ``post_backward``; see [Note: passes]).
        trainable: per unit, per parameter, whether it is trained (all True if
            None). A unit with none is never reduced; the others reduce every
            parameter (a frozen one's gradient must be written as zeros) and
            the optimizer leaves frozen parameters bitwise unchanged.
        param_groups: ``(hyper-parameters, parameter names)`` pairs: those
            parameters step with those AdamW settings (say, no weight decay on
            norms and biases); the others with ``optimizer``. Frozen parameters
            are a group of their own, with lr 0.

    Raises:
        TideInvalid: on every rank, for bad units, dtype or settings.
    """

    def __init__(self, units: Sequence[Sequence[tuple[str, Any]]], *,
                 init: Optional[Init] = None, group: Optional[Group] = None,
                 param_dtype: Any = _dtypes.bfloat16, optimizer: Optional[AdamW] = None,
                 prefetch: int = 1, comm: Any = "tide", stream: Any = None,
                 num_slots: Optional[int] = None, keep_param_shards: bool = False,
                 root: bool = False,
                 trainable: Optional[Sequence[Sequence[bool]]] = None,
                 param_groups: Sequence[tuple[AdamW, Sequence[str]]] = ()) -> None:
        group = group or default_group()
        names, shapes, values = _describe(units, init)
        if prefetch < 1:
            raise TideInvalid(f"prefetch: expected >= 1, got {prefetch}")
        num_slots = prefetch + 1 if num_slots is None else num_slots
        if num_slots < prefetch + 1:
            raise TideInvalid(f"num_slots: expected >= prefetch + 1 = {prefetch + 1}, got "
                              f"{num_slots}")
        factory = comm_factory(comm)
        self.group, self.kind, self.stream = group, factory.name, stream
        self.names, self.shapes = names, shapes
        self.root = bool(root)
        self.trainable = _trainable(trainable, shapes)
        self.param_dtype = _dtypes.normalize(param_dtype)
        self.xp = group.backend.xp
        self.world = factory.sharded_over(group)
        self.rank = group.rank if self.world > 1 else 0
        # Unless asked to keep them, tide's gathers cast the masters into the slots.
        self.arena = ShardArena(arena_layout(shapes, self.world), self.xp, self.param_dtype,
                                send=factory.send_shards or keep_param_shards)
        self._fill_masters(values, init)
        hp = optimizer or AdamW()
        self.optimizer = FusedAdamW(hp, self.arena.master, self.arena.send, self.xp,
                                    groups=self._groups(hp, param_groups))
        self._clip_coef: Optional[float] = None
        self._clip_captured = False  # the clip factor is in the optimizer's device table
        self._norm: Optional[GlobalNorm] = None
        self.num_slots = num_slots
        self.prefetch = prefetch
        self.comm: UnitComm = factory(group, shapes, self.param_dtype, self.arena,
                                      self.num_slots, self.root)
        self._free = list(range(self.num_slots + self.root))
        self._gathered: dict[int, tuple[int, Any]] = {}
        self._pending: dict[int, tuple[Any, int, bool]] = {}
        self._deferred: list[int] = []  # backward prefetches waiting for their slot
        self._micro = 0
        self._scratch: Any = None
        # [Note: passes]
        self._forwarded: set[int] = set()
        self._opened: set[int] = set()
        self._reduced: set[int] = set()
        self._to_reduce = {i for i, t in enumerate(self.trainable) if any(t)}

    @property
    def num_units(self) -> int:
        return len(self.shapes)

    # -- the four hooks ---------------------------------------------------------

    def pre_forward(self, i: int) -> list:
        """Unit ``i``'s full parameters (waited on the compute stream); prefetches
        the next ``prefetch`` units. A unit forwarded already in this pass starts
        a new pass ([Note: passes])."""
        if i in self._forwarded:
            self._new_pass()
        self._forwarded.add(i)
        self._ensure(i)
        for j in range(i + 1, min(i + 1 + self.prefetch, self.num_units)):
            self._ensure(j)
        return self._params(i)

    def post_forward(self, i: int) -> None:
        """Unit ``i``'s forward is issued: its slot may take another gather.
        The last unit keeps its parameters for its backward, which comes next,
        and so does the root (see [Note: passes])."""
        if i != self.num_units - 1 and not (self.root and i == 0):
            self._release(i)

    def release(self) -> None:
        """End a forward that has no backward (evaluation, generation, a discarded
        forward): release every gathered unit and drop deferred prefetches.

        Not collective and never needed for correctness (the next pass's first
        ``pre_forward`` does the same), but it frees the slots at once.
        """
        for i in list(self._gathered):
            self._gathered[i][1].wait(self.stream)  # a later gather waits on this stream
            self._release(i)
        self._deferred.clear()
        if not self._opened and not self._reduced:
            self._forwarded.clear()

    def pre_backward(self, i: int) -> tuple[list, list]:
        """Unit ``i``'s parameters and the gradient arrays its backward must write."""
        if i in self._reduced:
            raise TideInvalid(f"unit {i}: expected one backward per unit per pass, got a "
                              "second one after its gradients were reduced")
        self._opened.add(i)
        self._ensure(i)
        for j in range(i - 1, max(i - 1 - self.prefetch, -1), -1):
            self._prefetch(j)
        k = self._gathered[i][0]
        self._retire(k)  # [Note: gradient buffers]
        return self._params(i), self.comm.grads(i, k)

    def post_backward(self, i: int) -> None:
        """Unit ``i``'s gradients are written (issued): reduce them into the fp32 shards.

        The first micro-batch of a step reduces straight into the gradient
        shards; later ones reduce into a scratch arena that is added on retire.
        """
        if i not in self._opened or i in self._reduced:
            raise TideInvalid(f"unit {i}: expected post_backward after its pre_backward, once "
                              "per pass")
        k = self._gathered[i][0]
        if i in self._to_reduce:
            accumulate = self._micro > 0
            out = self._scratch_arena() if accumulate else self.arena.grad
            self._pending[k] = (self.comm.reduce(i, k, out, self.stream), i, accumulate)
        self._release(i)
        self._reduced.add(i)

    def finish_backward(self) -> None:
        """Complete this backward pass ([Note: passes]): every unit with trainable
        parameters not yet reduced reduces zeros, in descending order. Collective
        (every rank must reach it at the same point: the torch front end calls it
        from the callback autograd runs at the end of each backward).
        """
        if not self._opened and not self._reduced:
            return  # no backward began: nothing to finish (a forward-only pass)
        opened = sorted(self._opened - self._reduced)
        if opened:
            raise TideInvalid(f"units {opened}: expected post_backward for every unit whose "
                              "pre_backward ran, before finish_backward")
        for i in sorted(self._to_reduce - self._reduced, reverse=True):
            if i in self._forwarded:  # its backward never began: gather it, reduce zeros
                _, grads = self.pre_backward(i)
                with on_stream(self.stream):
                    for g in grads:
                        g.fill(0)
                self.post_backward(i)
            else:  # not forwarded: its gradient is zero on every rank, no collective
                self._reduced.add(i)
                if self._micro == 0:
                    self._zero_grad(i)
        if self._opened or self._reduced:
            self._end_pass()

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass has begun and is not complete."""
        return bool(self._opened or self._reduced)

    # -- the step -----------------------------------------------------------------

    def step(self, lr: Optional[float] = None) -> Optional[float]:
        """Average the accumulated gradients and run the fused AdamW on every shard.

        Args:
            lr: this step's learning rate (the optimizer's ``lr`` if None).

        Returns:
            The global gradient norm when clipping is on (see :meth:`clip_grad_norm_`:
            a float, which syncs the host, or a device array inside a capture), else
            None.
        """
        scale, norm = self.finalize_grads()
        if norm is None and self.optimizer.hp.max_grad_norm is not None:
            norm = self.clip_grad_norm_(self.optimizer.hp.max_grad_norm)
            scale *= self._clip_coef
        self._clip_coef, self._clip_captured = None, False
        self.optimizer.step(self.arena.grad, grad_scale=scale, lr=lr, stream=self.stream)
        self._micro = 0
        return norm

    def finalize_grads(self) -> tuple[float, Optional[float]]:
        """End the backward pass, wait for every reduction (on the stream) and release the
        gathered units; the gradient shards are then the sums over ranks and micro-batches.

        Returns:
            ``(scale, norm)``: the factor that turns the shards into the averaged (and,
            after :meth:`clip_grad_norm_`, clipped) gradient, and that call's norm or None.

        Raises:
            TideInvalid: no backward since the last step.
        """
        self.finish_backward()
        for k in list(self._pending):
            self._retire(k)
        self.release()  # parameters gathered now would be stale after the step
        if self._micro == 0:
            raise TideInvalid("step: expected a backward since the last step, got none")
        scale = 1.0 / (self.world * self._micro)
        if self._clip_coef is None:
            return scale, None
        return scale * self._clip_coef, self._clip_norm

    def apply_step(self, step: Callable[[], None]) -> None:
        """Step with another optimizer: :meth:`finalize_grads`, the gradient shards scaled
        to the averaged (and clipped) gradient in place, then ``step()``, which updates
        :meth:`params` (the fp32 masters) from :meth:`grads`; then the send shards."""
        if self._clip_captured:
            raise TideInvalid("a clip inside a stream capture reaches the fused AdamW "
                              "(step()) only, got another optimizer's step")
        scale, _ = self.finalize_grads()
        with on_stream(self.stream):
            self.arena.grad *= np.float32(scale)
        step()
        self.arena.refresh_send()
        self._clip_coef = None
        self._micro = 0

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip the averaged gradient to the global L2 norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does, at the next :meth:`step`.

        Collective: the ranks' sums of squares are all-gathered ([Note: global norm] in
        ``_norm``), and the host reads the norm back (a sync). Inside a stream capture
        (a captured step, ``CapturedStep``) nothing is read back: the clip factor is
        computed on the device, for the fused AdamW's :meth:`step` only.

        Returns:
            The global norm of the averaged gradient, before clipping: a float, or,
            inside a capture, a 0-d float64 device array that each replay overwrites.

        Raises:
            TideInvalid: ``max_norm`` is not a finite real > 0; inside a capture, before
                :meth:`prepare_capture`.
        """
        _check_max_norm(max_norm)
        self._clip_coef, self._clip_captured = None, False
        scale, _ = self.finalize_grads()
        if self._capturing():
            opt = self.optimizer
            if self._norm is None or opt.coeff_dev is None:
                raise TideInvalid("clip_grad_norm_ inside a stream capture: expected "
                                  "prepare_capture() before the capture (it makes what the "
                                  "captured clip reads), got none")
            self._clip_norm = self._norm.compute(
                self.arena.grad, scale, stream=self.stream, max_norm=max_norm,
                table=opt.coeff_dev, table_shape=opt.table_layout).reshape(())
            # The device writes the factor into the optimizer's coefficient table.
            self._clip_coef, self._clip_captured = 1.0, True
            return self._clip_norm
        self._clip_norm = self.global_norm().compute(self.arena.grad, scale, stream=self.stream)
        self._clip_coef = clip_scale(self._clip_norm, max_norm)
        return self._clip_norm

    def global_norm(self) -> GlobalNorm:
        """What computes the gradient's global norm, made at its first use (collective:
        every rank makes it at the same call)."""
        if self._norm is None:
            self._norm = GlobalNorm(self.group if self.world > 1 else None, self.world,
                                    self.xp)
        return self._norm

    def prepare_capture(self) -> None:
        """Make, outside a capture, what a captured step reads (collective): the
        optimizer's device table of coefficients and the global norm's plan and kernels."""
        self.optimizer.prepare_capture()
        self.global_norm()

    def _capturing(self) -> bool:
        """Whether the stream the runtime issues on is capturing (cuda only)."""
        if self.xp is np:
            return False
        with on_stream(self.stream):
            return bool(self.xp.cuda.get_current_stream().is_capturing())

    # -- internals -------------------------------------------------------------------

    def _slot(self, i: int) -> int:
        """Unit ``i``'s slot ([Note: slots]): the same one every time; the root's own last."""
        return self.num_slots if self.root and i == 0 else i % self.num_slots

    def _new_pass(self) -> None:
        """A unit forwarded again: end the last pass ([Note: passes])."""
        if self._opened or self._reduced:
            self.finish_backward()
        self.release()
        self._forwarded.clear()

    def _end_pass(self) -> None:
        self._micro += 1
        self._forwarded.clear()
        self._opened.clear()
        self._reduced.clear()
        self._deferred.clear()  # a backward's prefetches end with it

    def _groups(self, hp: AdamW, param_groups: Sequence[tuple[AdamW, Sequence[str]]]) -> list:
        """The optimizer's groups as element ranges of this rank's shards; frozen last."""
        where = {name: (u, k) for u, names in enumerate(self.names)
                 for k, name in enumerate(names)}
        groups, taken = [], set()
        frozen = [(u, k) for u, t in enumerate(self.trainable) for k, ok in enumerate(t)
                  if not ok]
        wanted = [(g, list(names)) for g, names in param_groups]
        if frozen:
            wanted.append((replace(hp, lr=0.0, weight_decay=0.0, max_grad_norm=None),
                           [self.names[u][k] for u, k in frozen]))
        for j, (group_hp, names) in enumerate(wanted):
            ranges = []
            for name in names:
                if name not in where:
                    raise TideInvalid(f"param_groups[{j}]: expected parameter names of the "
                                      f"model, got {name!r}")
                if name in taken:
                    if j == len(param_groups):
                        continue  # a frozen parameter a group named: frozen wins
                    raise TideInvalid(f"param_groups[{j}]: expected each parameter in one "
                                      f"group, got {name!r} twice")
                taken.add(name)
                u, k = where[name]
                lay = self.arena.layout.units[u]
                start = self.arena.layout.starts[u] + lay.offsets[k]
                ranges.append((start, start + lay.specs[k].shard_numel))
            groups.append(ParamGroup(group_hp, tuple(ranges)))
        return groups

    def _zero_grad(self, i: int) -> None:
        with on_stream(self.stream):
            self.arena.block(self.arena.grad, i).fill(0)

    def _ensure(self, i: int) -> None:
        if i in self._gathered:
            return
        if i in self._deferred:
            self._deferred.remove(i)
        k = self._slot(i)
        if k not in self._free:
            raise TideInvalid(f"unit {i}: expected its slot {k} to be free, got it holding unit "
                              f"{next(u for u, (s, _) in self._gathered.items() if s == k)}: "
                              "call the hooks in order (forward 0..n-1, backward n-1..0), "
                              "each unit's post hook before the unit prefetch+1 further on")
        self._free.remove(k)
        self._gathered[i] = (k, self.comm.gather(i, k, self.stream))

    def _prefetch(self, i: int) -> None:
        """Gather ``i`` ahead now if its slot is free, else when the slot is released."""
        if i in self._gathered or i in self._deferred:
            return
        if self._slot(i) in self._free:
            self._ensure(i)
        else:
            self._deferred.append(i)

    def _params(self, i: int) -> list:
        return self._gathered[i][1].wait(self.stream)

    def _release(self, i: int) -> None:
        k = self._gathered.pop(i)[0]
        self._free.append(k)
        for j in self._deferred:
            if self._slot(j) == k:
                self._deferred.remove(j)
                self._ensure(j)
                return

    def _retire(self, k: int) -> None:
        entry = self._pending.pop(k, None)
        if entry is None:
            return
        work, unit, accumulate = entry
        work.wait(self.stream)
        if accumulate:
            with on_stream(self.stream):
                grad = self.arena.block(self.arena.grad, unit)
                self.xp.add(grad, self.arena.block(self._scratch, unit), out=grad)

    def _scratch_arena(self) -> Any:
        if self._scratch is None:
            self._scratch = self.xp.zeros_like(self.arena.grad)
        return self._scratch

    def _fill_masters(self, values: list, init: Optional[Init]) -> None:
        xp, r = self.xp, self.rank
        for u, unit_values in enumerate(values):
            lay = self.arena.layout.units[u]
            for spec, master, (name, value) in zip(
                    lay.specs, self.arena.views(self.arena.master, u), unit_values):
                full = init(name, spec.shape) if init is not None else value
                if tuple(full.shape) != spec.shape:
                    raise TideInvalid(f"parameter {name!r}: expected shape {spec.shape}, got "
                                      f"{tuple(full.shape)}")
                start, stop = spec.rows(r)
                if stop > start:
                    master[:stop - start] = xp.asarray(full[start:stop], dtype=np.float32)
        self.arena.refresh_send()

    # -- state --------------------------------------------------------------------

    def params(self, unit: int) -> list:
        """This rank's fp32 master shards of ``unit`` (padded views into the arena)."""
        return self.arena.views(self.arena.master, unit)

    def grads(self, unit: int) -> list:
        """This rank's fp32 gradient shards of ``unit`` (padded views into the arena)."""
        return self.arena.views(self.arena.grad, unit)

    def gathered(self, unit: int) -> bool:
        """Whether ``unit`` holds a slot now (gathered, or its gather issued)."""
        return unit in self._gathered

    def synchronize(self) -> None:
        """Wait for every outstanding gather, reduction and optimizer step (host)."""
        for k in list(self._pending):
            self._retire(k)
        self.group.synchronize()  # the group's device, not whichever is current

    def close(self) -> None:
        """Release communicators (collective). Slots go with the group."""
        self.comm.close()

    def save(self, path: str) -> None:
        """Save the sharded state; see :func:`tidearray.fsdp.save`."""
        from ._checkpoint import save

        save(self, path)

    def load(self, path: str) -> None:
        """Load a sharded state saved at the same world size; see :func:`tidearray.fsdp.load`."""
        from ._checkpoint import load

        load(self, path)

    def export(self, path: str) -> None:
        """Write the gathered fp32 model to one ``.npz`` (rank 0 writes; collective)."""
        from ._checkpoint import export

        export(self, path)


def _check_max_norm(max_norm: Any) -> None:
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
            and math.isfinite(max_norm) and max_norm > 0):
        raise TideInvalid(f"max_norm: expected a finite real > 0, got {max_norm!r}")


def _trainable(trainable: Optional[Sequence[Sequence[bool]]],
               shapes: list) -> list[list[bool]]:
    if trainable is None:
        return [[True] * len(s) for s in shapes]
    got = [len(t) for t in trainable]
    if got != [len(s) for s in shapes]:
        raise TideInvalid(f"trainable: expected a flag per parameter, {[len(s) for s in shapes]}"
                          f" per unit, got {got}")
    return [[bool(x) for x in t] for t in trainable]


def _describe(units: Sequence[Sequence[tuple[str, Any]]],
              init: Optional[Init]) -> tuple[list, list, list]:
    names: list[list[str]] = []
    shapes: list[list[tuple]] = []
    values: list[list] = []
    seen: set = set()
    for u, unit in enumerate(units):
        names.append([]), shapes.append([]), values.append([])
        for entry in unit:
            name, value = entry
            if name in seen:
                raise TideInvalid(f"unit {u}: expected unique parameter names, got {name!r} "
                                  "twice")
            seen.add(name)
            shape = tuple(int(d) for d in (value if init is not None else value.shape))
            names[-1].append(name)
            shapes[-1].append(shape)
            values[-1].append((name, value))
    if not shapes or not all(shapes):
        raise TideInvalid("units: expected at least one unit, each with parameters, got "
                          f"{[len(s) for s in shapes]}")
    return names, shapes, values

