"""The options of ``Runtime`` checked at its construction: :class:`FrontEnd`, those only a
front end sets, and the slots the prefetch depth needs."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from .. import _validate
from .._errors import TideInvalid
from .._group import allreduce_max

if TYPE_CHECKING:
    from .._group import Group


@dataclass(frozen=True)
class FrontEnd:
    """The runtime's options that only a front end sets (the torch front end sets all
    three; a trainer that calls the four hooks itself keeps the defaults).

    Raises:
        TideInvalid: ``accumulate`` is neither ``"mean"`` nor ``"sum"``.
    """

    #: The front end reports each gradient it writes (:meth:`Runtime.grad_written`) and
    #: the end of each use's backward (:meth:`Runtime.use_done`); the gradients it does
    #: not write are zeros, and a parameter no rank gave a gradient in a step is not
    #: stepped ([Note: unit lifecycle]). False (default): the front end writes every
    #: gradient of each unit between ``pre_backward`` and ``post_backward``.
    report_grads: bool = False
    #: Called with a unit's index whenever its slot is released (the torch front end
    #: points its parameters away from the slot then); None (default): nothing.
    on_release: Optional[Callable[[int], None]] = None
    #: How the backward passes since the last step combine: ``"mean"`` (default: the
    #: step takes their mean; the trainers of this package) or ``"sum"`` (torch's and
    #: FSDP2's: each backward adds to the gradient, so a loop divides each micro-batch's
    #: loss by their count; the torch front end). Either way the gradient is averaged
    #: over the ranks.
    accumulate: str = "mean"
    #: Called with an open unit's index and its gradient arrays just before the runtime
    #: reduces them (when the unit closes, or loses its slot while open): the front end
    #: writes the gradients it holds into them, zeros where it holds none, and returns
    #: which parameters it wrote. With it, ``report_grads`` holds without
    #: :meth:`Runtime.grad_written`, and no buffer is zeroed when a backward opens (the
    #: torch front end: autograd's own ``.grad``s, copied once per unit). None (default):
    #: the gradients are written into the buffer directly.
    fill_grads: Optional[Callable[[int, list], list[bool]]] = None

    def __post_init__(self) -> None:
        if self.accumulate not in ("mean", "sum"):
            raise TideInvalid(f"accumulate: expected 'mean' or 'sum', got {self.accumulate!r}")

    @classmethod
    def of(cls, front_end: Optional[FrontEnd], report_grads: bool,
           on_release: Optional[Callable[[int], None]], accumulate: str) -> FrontEnd:
        """``Runtime``'s ``front_end``, or, where that is None, its three keywords of the
        same names (the spelling of earlier versions).

        Raises:
            TideInvalid: ``front_end`` and any of the three keywords given.
        """
        if front_end is None:
            return cls(bool(report_grads), on_release, accumulate)
        if (report_grads, on_release, accumulate) != (False, None, "mean"):
            raise TideInvalid("front_end: expected it or report_grads/on_release/accumulate, "
                              "got both")
        if not isinstance(front_end, cls):
            raise TideInvalid(f"front_end: expected a FrontEnd, got {type(front_end).__name__}")
        if front_end.fill_grads is not None and not front_end.report_grads:
            raise TideInvalid("front_end: expected report_grads=True with fill_grads (the "
                              "front end says which gradients it wrote), got False")
        return front_end


def slot_count(prefetch: int, num_slots: Optional[int]) -> int:
    """``Runtime``'s slots: ``num_slots``, or ``prefetch + 1`` where None.

    Raises:
        TideInvalid: ``prefetch`` below 1, or fewer slots than ``prefetch + 1``.
    """
    if prefetch < 1:
        raise TideInvalid(f"prefetch: expected >= 1, got {prefetch}")
    num_slots = prefetch + 1 if num_slots is None else num_slots
    if num_slots < prefetch + 1:
        raise TideInvalid(f"num_slots: expected >= prefetch + 1 = {prefetch + 1}, got "
                          f"{num_slots}")
    return num_slots


def agree_settings(group: Group, settings: dict[str, Any]) -> None:
    """Raise ``TideInvalid`` on every rank unless every rank made its runtime with the same
    ``settings`` (the optimizer's, its parameter groups, the clip limit, the frozen
    parameters, the prefetch and slots, ...): each rank steps and gathers only its own rows,
    so a setting that differs by rank trains one model with another's rules, silently.
    Compared by ``repr`` (``AdamW`` is a frozen dataclass), before any memory is made."""
    _validate.check(group, "Runtime", tuple((name, repr(value))
                                            for name, value in settings.items()), ())


def agree_step(group: Group, lr: Any, present: np.ndarray) -> np.ndarray:
    """Per parameter, whether some rank gave it a gradient in this step (``present``, this
    rank's, OR-ed over the ranks) as bools; and ``lr`` checked to be the same on every
    rank, as the settings are (a scheduler that runs differently on one rank would step
    its rows by another lr, silently). Collective: one host all-reduce of a word per
    parameter, polled against ``Config.timeout`` (a rank that raised before the step
    leaves the others an error, not a hang). Every rank then skips the same parameters
    ([Note: unit lifecycle]).

    Raises:
        TideInvalid: ``lr`` differs between ranks (on every rank).
    """
    if group.size == 1:
        return present.astype(bool)
    try:  # by value: 0.1 and np.float64(0.1) step alike
        data = np.asarray(lr, dtype=np.float64).tobytes() if lr is not None else b"None"
    except Exception:  # noqa: BLE001 (never raise before the collective: a tensor that
        data = repr(lr).encode()  # requires grad, on a GPU, ... compares by its repr)
    key = zlib.crc32(data)
    every = allreduce_max(group.comm, np.concatenate([[key, -key], present]),
                          group.config.timeout)
    if every[0] != -every[1]:
        raise TideInvalid(f"step: expected the same lr on every rank, got {lr!r} on rank "
                          f"{group.rank} and another on some other rank")
    return every[2:].astype(bool)
