"""Handles of asynchronous collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Optional, TypeVar

if TYPE_CHECKING:
    from ._stamps import Stamps
    from .backends import Completion, Executor

T = TypeVar("T")


class Work(Generic[T]):
    """An issued collective. ``wait()`` orders a stream after it and returns its result.

    On the cuda backend, ``wait`` does not block the host: it makes ``stream``
    (the current stream if None) wait for the collective on the device. On the
    host backend the work is already complete when the handle is returned.
    """

    def __init__(self, completion: Completion, result: T) -> None:
        self._completion = completion
        self._result = result

    def wait(self, stream: Any = None) -> T:
        self._completion.wait(stream)
        return self._result

    def is_completed(self) -> bool:
        return self._completion.query()


def finish(ex: Executor, result: T, stream: Any, async_op: bool,
           stamps: Optional[Stamps] = None, region: Any = None) -> Any:
    """End one issued collective: its :class:`Work`, checked first in debug mode (``stamps``,
    [Note: stamps] in ``_stamps``), returned as is if ``async_op``, else waited on.
    ``region``: the slot or staging it used, which remembers it ([Note: graph order]
    in ``_plan``)."""
    completion = ex.finish()
    if region is not None and not ex.capture:  # a user's capture: its replays are theirs
        region.last = (None, completion)
    work = Work(completion, result)
    if stamps is not None:
        stamps.check()
    return work if async_op else work.wait(stream)
