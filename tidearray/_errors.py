"""The two kinds of error tidearray raises.

``TideInvalid`` is for user input: a wrong shape, dtype, or a list that differs
between ranks. It is raised on every rank of the group, before any transfer.
``TideBackendError`` wraps failures of CUDA, NCCL or MPI underneath.
:func:`agree` and :class:`fail_together` are how a failure on one rank becomes
an error on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from mpi4py import MPI


class TideError(RuntimeError):
    """Base class of every error tidearray raises."""

    def __reduce__(self):  # picklable, so ranks can exchange it
        return (type(self), self.args)


class TideInvalid(TideError, ValueError):
    """Invalid user input. The message says "expected X, got Y" and names the
    parameter index and the rank(s) at fault."""


class TideBackendError(TideError):
    """A CUDA, NCCL or MPI call failed, or a peer stopped answering."""


def agree(comm: MPI.Comm, err: Optional[str], what: str,
          error: type[TideError] = TideBackendError) -> None:
    """Raise ``error`` on every rank of ``comm`` if any rank's ``err`` is set. Collective.

    Each rank passes its own failure (a message) or None, so a rank that failed
    alone never leaves the others waiting for it in a later collective.
    """
    errors = comm.allgather(err)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if bad:
        raise error(f"{what}: " + "; ".join(bad))


class fail_together:
    """``with fail_together(comm, what):`` runs a block of local steps, then
    :func:`agree`: an exception in the block becomes this rank's message, and
    every rank raises ``error`` if any rank failed. Collective, even on failure.
    """

    def __init__(self, comm: MPI.Comm, what: str, error: type[TideError] = TideBackendError):
        self.comm, self.what, self.error = comm, what, error

    def __enter__(self) -> fail_together:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if kind is not None and not issubclass(kind, Exception):
            return False  # KeyboardInterrupt and the like: not a failure to share
        agree(self.comm, None if exc is None else f"{kind.__name__}: {exc}", self.what,
              self.error)
        return False
