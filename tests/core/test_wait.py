"""Host waits on peers end in an error, not a hang: ``poll_until`` and the polled host
all-reduce (``_group.allreduce_max``, which the step's agreement and the validation's
multi-node path use) against a peer that never comes. One process: a stand-in
communicator whose request never completes (MPI's own path runs in every multi-rank test)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tidearray import TideBackendError
from tidearray._group import allreduce_max
from tidearray._wait import poll_until


class _Silent:
    """A communicator whose all-reduce never completes: a peer that raised or exited."""
    rank = 0

    def __init__(self) -> None:
        self.tests = 0

    def Iallreduce(self, send, recv, op):  # noqa: N802 (mpi4py's name)
        comm = self

        class Request:
            def Test(self) -> bool:  # noqa: N802
                comm.tests += 1
                return False
        return Request()


def test_poll_until_returns_once_done_and_gives_up_after_the_timeout():
    calls = iter(range(10))
    assert poll_until(lambda: next(calls) == 3, timeout=60)
    start = time.monotonic()
    assert not poll_until(lambda: False, timeout=0.2, spin=0.05)
    assert time.monotonic() - start >= 0.2


def test_allreduce_max_raises_when_a_peer_never_comes():
    comm = _Silent()
    start = time.monotonic()
    with pytest.raises(TideBackendError, match="timed out after 0.3 s in a host all-reduce"):
        allreduce_max(comm, np.arange(4), timeout=0.3)
    assert time.monotonic() - start >= 0.3 and comm.tests > 1  # polled, not waited on once
