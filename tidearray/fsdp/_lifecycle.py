"""Where each unit is in the current pass: one state machine, owned by the runtime.

[Note: unit lifecycle]
Every front end (the torch hooks, the CuPy and JAX trainers) drives one state
per unit, kept here and read by ``Runtime``; no front end keeps a second
copy. The states are FSDP2's ``TrainingState`` for a parameter group:

    IDLE ──pre_forward──> FORWARD ──pre_backward──> BACKWARD ──post_backward──> DONE
      │                    │   ^ another use                                    │
      └────pre_backward────┼───┘ (pre_forward again)                            │
                           └── release (a pass with no backward) ─> IDLE        │
    every state ──end of the pass (finish_backward)──> IDLE <───────────────────┘

* **Uses.** A unit may run k times in one forward (a shared or looped block,
  ALBERT's layer group, a siamese encoder; k unknown in advance and free to
  change between steps). Every ``pre_forward`` of a unit in the forward phase
  is one more use: the unit is gathered at its first use (again if its slot
  was taken since), stays FORWARD, and is reduced once, when its backward is
  done. A unit is *running* from its ``pre_forward`` to its ``post_forward``;
  a running unit's slot is never taken (nested units).
* **The end of a unit's backward is autograd's to say.** A front end that can
  see it passes, per use, a *use token*: an object that lives as long as the
  use's autograd graph (torch: the hook on the output of the unit before that
  the use took, or the context of the function wrapping the unit's inputs,
  FSDP2's ``RegisterPostBackwardFunction``), and calls ``use_done`` when that
  use's input gradients are computed. The unit closes
  (DONE: reduced, slot released) when no token of it is left pending: the
  tokens of forwards that will never run a backward die with their graphs and
  are not waited for. So a partially frozen unit (a LoRA base) closes only
  after its frozen weights carried the gradient on to its input, never when
  its trainable gradients alone have arrived. A use whose end cannot be seen
  (grad enabled, no input needs a gradient) makes the unit *blind*, as does a
  recompute's open (reentrant checkpointing): it is suspended (below) when a
  lower unit closes, and closes at the end of the backward.
* **Slots: suspended units.** An open unit gives its slot up to a unit
  whose backward opens and needs it (never to a prefetch): autograd runs the
  nodes made later first, so when unit ``j``'s backward opens, every use
  made after ``j``'s is done, and a use made before it has not begun unless
  ``j`` ran inside it (nested units, which a slot cannot hold together:
  their forward already raised). What is left of the open unit is the
  backward of an earlier use (a model called twice before one backward, a
  forward whose output is kept but never backpropagated, a blind unit once
  its use is done). It is *suspended*: its gradients so far are reduced
  (their buffer goes with the slot), and its next backward gathers it
  again, zeroes its buffer and reduces once more when it closes: each time
  into the step's gradient shard (the step's first reduction of a unit
  writes it, later ones add: ``GradAccumulator``). Every rank runs the same
  hooks in the same order, so every rank suspends and reduces the same
  units at the same points.
* **Order.** Closing unit ``i`` first closes (a blind one: suspends) every
  open unit above it that waits for no token, in descending order, and
  ``finish_backward`` closes what is left in descending order: every rank
  issues the same reductions in the same order, whatever gradients its data
  gave it.
* **A pass** is the forward phase (uses) and then the backward phase (from the
  first ``pre_backward``). A ``pre_forward`` in the backward phase ends the pass
  (a new micro-batch); ``finish_backward`` ends it too, reducing zeros for
  the units with trainable parameters whose backward never began.
* **Gradients present.** A front end that reports the gradients it writes
  (``report_grads=True``: torch, where autograd may give a parameter none)
  gets zeros written for the others, and the step's optimizer skips every
  parameter that no rank and no micro-batch gave a gradient (torch's AdamW
  skips a ``.grad`` of None). A front end that does not report them writes
  every gradient of every unit it closes.
* **What a front end asks.** The pass state a front end's hooks need is here
  too, as plain attributes and transitions, so that a hook reads it without
  a call (the hooks run several times per unit per step): ``state`` and
  ``last_used`` (the torch hooks check the units' order with it),
  ``in_pass`` (a use or an open since the last pass ended: the torch hooks
  begin a pass at the first use that finds it False), ``in_backward`` (the
  backward phase has begun: the torch hooks queue autograd's end-of-backward
  callback at the open that finds it False), and ``forward_done`` (a unit of
  several modules, torch's list unit, ends its forward when the last of them
  does). Each ends with the pass. One question is a call, ``is_open`` (a unit
  open on its own buffer: BACKWARD and not suspended), so the rule is written
  once. A front end reads them and changes them only through the runtime, but
  for ``forward_done``, which the runtime does not read.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Optional, Sequence

import numpy as np


class State(enum.Enum):
    """A unit's place in the current pass ([Note: unit lifecycle])."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    DONE = "done"


class UseToken:
    """One use of a unit whose backward a front end will report (``use_done``).

    The runtime holds it weakly: a forward whose graph is freed without a
    backward leaves nothing to wait for."""

    __slots__ = ("__weakref__",)


#: A use whose backward's end the front end cannot see (no input needs a gradient).
BLIND = object()


class UnitLifecycle:
    """Per unit: the state, the uses still waiting for their backward, the gradients
    written in this pass; per parameter: whether it had a gradient in this step.

    Pure bookkeeping: the runtime (``Runtime``) gathers, reduces and releases.
    """

    def __init__(self, trainable: Sequence[Sequence[bool]]) -> None:
        #: Per unit, per parameter, whether it is trained: the runtime's flags, not a copy.
        self.trainable = trainable
        n = len(self.trainable)
        self.state = [State.IDLE] * n
        self.running: set[int] = set()
        #: The highest unit used in this pass's forward phase (-1: none).
        self.last_used = -1
        #: Whether a pass has begun: a use or an open since the last pass ended.
        self.in_pass = False
        #: Whether this pass's backward phase has begun.
        self.in_backward = False
        self._open: set[int] = set()  # the units in BACKWARD (closing scans these only)
        self._members_done: dict[int, int] = {}  # unit -> its modules that ran this forward
        # Per unit, weak references to the tokens of its uses whose backward is pending,
        # each dropped when its token dies: a plain set of them, not a WeakSet, whose
        # methods are Python calls (these run several times per unit per step).
        self._pending: list[set[weakref.ref]] = [set() for _ in range(n)]
        self._blind = [False] * n
        #: Open units that lost their slot since they opened ([Note: unit lifecycle],
        #: slots): their gradients so far are reduced, their buffer another's; their
        #: next backward opens them afresh (even where a prefetch gathered them again).
        self.suspended: set[int] = set()
        self.written: list[list[bool]] = [[False] * len(t) for t in self.trainable]
        starts = np.cumsum([0] + [len(t) for t in self.trainable])
        self._first = [int(s) for s in starts[:-1]]
        #: Per parameter (units in order, flattened): a gradient in this step.
        self.had_grad = np.zeros(int(starts[-1]), dtype=np.uint8)

    # -- queries ----------------------------------------------------------------------

    def units_in(self, state: State) -> list[int]:
        return [i for i, s in enumerate(self.state) if s is state]

    def waits(self, i: int) -> bool:
        """Whether unit ``i`` waits for a tracked use's backward."""
        return bool(self._pending[i])

    def blind(self, i: int) -> bool:
        """Whether a use of unit ``i`` in this pass has a backward whose end is not seen."""
        return self._blind[i]

    def is_open(self, i: int) -> bool:
        """Whether unit ``i``'s backward is open on its own buffer: BACKWARD and not
        suspended (a suspended unit lost its slot; its next backward opens it afresh)."""
        return self.state[i] is State.BACKWARD and i not in self.suspended

    def may_close(self, i: int) -> bool:
        """Whether open unit ``i`` is done by what the tokens say: none pending, not blind."""
        return self.state[i] is State.BACKWARD and not self._blind[i] and not self._pending[i]

    def may_give_up(self, i: int, prefetch: bool) -> bool:
        """Whether gathered unit ``i`` may lose its slot: neither running nor open for its
        backward (its next use, or its backward, gathers it again), or open and the slot
        wanted now, not by a ``prefetch`` ([Note: unit lifecycle], slots: ``i`` is then
        suspended)."""
        if i in self.running:
            return False
        return self.state[i] is not State.BACKWARD or not prefetch

    def closable_above(self, i: int) -> list[int]:
        """The open units above ``i`` that wait for no tracked use, in descending order:
        they close before ``i`` does ([Note: unit lifecycle], order)."""
        if len(self._open) == 1 and i in self._open:  # the common case: no scan
            return []
        return sorted((j for j in self._open if j > i and not self._pending[j]), reverse=True)

    # -- transitions -------------------------------------------------------------------

    def use(self, i: int, token: Any) -> None:
        """A ``pre_forward`` of unit ``i`` in the forward phase."""
        if self.state[i] is State.IDLE:
            self.state[i] = State.FORWARD
        self.running.add(i)
        self.last_used = max(self.last_used, i)
        self.in_pass = True
        if token is BLIND:
            self._blind[i] = True
        elif token is not None:
            pending = self._pending[i]
            pending.add(weakref.ref(token, pending.discard))

    def forward_issued(self, i: int) -> None:
        """A ``post_forward`` of unit ``i``: it is no longer running."""
        self.running.discard(i)

    def use_done(self, i: int, token: Any) -> bool:
        """The backward of the use ``token`` of unit ``i`` is done; whether the unit may
        close now (:meth:`may_close`)."""
        self._pending[i].discard(weakref.ref(token))
        return self.may_close(i)

    def forward_done(self, i: int, members: int) -> bool:
        """One of the ``members`` modules of unit ``i`` ended its forward (a unit of
        several modules: each one's start is a use); whether it was the last of them,
        which ends the unit's forward."""
        done = self._members_done.get(i, 0) + 1
        if done < members:
            self._members_done[i] = done
            return False
        self._members_done.pop(i, None)
        return True

    def open(self, i: int) -> None:
        """IDLE or FORWARD to BACKWARD; a recompute's open makes the unit blind."""
        if self.state[i] is State.IDLE:
            self._blind[i] = True  # no forward of it in this pass: nothing reports its end
        if self.suspended:  # (rarely any: no call on the common path)
            self.suspended.discard(i)
        self.state[i] = State.BACKWARD
        self._open.add(i)
        self.in_pass = self.in_backward = True
        self.written[i] = [False] * len(self.written[i])

    def write(self, i: int, k: int) -> bool:
        """Parameter ``k`` of open unit ``i`` got a gradient; whether it is the first."""
        first = not self.written[i][k]
        self.written[i][k] = True
        return first

    def close(self, i: int, written: Optional[Sequence[bool]]) -> None:
        """BACKWARD to DONE, with the parameters whose gradients were ``written`` (None:
        all of them) recorded in :attr:`had_grad`."""
        self.state[i] = State.DONE
        self._open.discard(i)
        if self.suspended:
            self.suspended.discard(i)
        self._record(i, written)

    def suspend(self, i: int, written: Optional[Sequence[bool]]) -> None:
        """Open unit ``i`` loses its slot, its gradients so far reduced: recorded as
        :meth:`close` records them; it stays open until its next backward opens it again
        (gathered again, its buffer zeroed) or the pass ends."""
        self._record(i, written)
        self.written[i] = [False] * len(self.written[i])
        self.suspended.add(i)

    def _record(self, i: int, written: Optional[Sequence[bool]]) -> None:
        for k, t in enumerate(self.trainable[i]):
            if t and (written is None or written[k]):
                self.had_grad[self._first[i] + k] = 1

    def forget_forward(self) -> None:
        """A pass with no backward ends (``release``): its FORWARD units are IDLE again."""
        self.state = [State.IDLE if s is State.FORWARD else s for s in self.state]
        self.running.clear()
        self.last_used = -1
        self.in_pass = False
        if self._members_done:
            self._members_done.clear()

    def end_pass(self) -> None:
        n = len(self.state)
        self.state = [State.IDLE] * n
        self.running.clear()
        self.last_used = -1
        self._open.clear()
        self.suspended.clear()
        self.in_pass = self.in_backward = False
        if self._members_done:
            self._members_done.clear()
        for pending in self._pending:  # tokens of uses whose backward never came
            if pending:
                pending.clear()
        self._blind = [False] * n

    def end_step(self) -> np.ndarray:
        """This step's gradient presence per parameter; cleared for the next step."""
        out, self.had_grad = self.had_grad, np.zeros_like(self.had_grad)
        return out
