"""The two kinds of error tidearray raises.

``TideInvalid`` is for user input: a wrong shape, dtype, or a list that differs
between ranks. It is raised on every rank of the group, before any transfer.
``TideBackendError`` wraps failures of CUDA, NCCL or MPI underneath.
"""

from __future__ import annotations


class TideError(RuntimeError):
    """Base class of every error tidearray raises."""

    def __reduce__(self):  # picklable, so ranks can exchange it
        return (type(self), self.args)


class TideInvalid(TideError, ValueError):
    """Invalid user input. The message says "expected X, got Y" and names the
    parameter index and the rank(s) at fault."""


class TideBackendError(TideError):
    """A CUDA, NCCL or MPI call failed, or a peer stopped answering."""
