"""Node-local agreement through shared host memory: the fast path of validation.

Every collective starts with a small agreement (``_validate.check``): the
elementwise maximum of three integers over the group. As an MPI ``Allreduce``
it took about 14 us on 2xH200's host, on the critical path of every call.
When the whole group is on one node, ranks instead post their values on a
board in an MPI shared-memory window and read each other's: about a
microsecond once every rank has arrived.

[Note: board rounds]
Round ``k`` uses half ``k % 2`` of the board. A rank posts its values, then
the round number (a fence between, for weakly ordered CPUs), and reads a
peer's values once that peer's round number is ``k``. Two halves suffice: a
rank can only start round ``k + 2``, which overwrites half ``k % 2``, after
every peer has posted round ``k + 1``, that is after every peer has finished
reading round ``k``. A peer that never arrives is reported after
``Config.timeout`` seconds instead of hanging the caller.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import numpy as np

from ._errors import TideBackendError

#: Spins before a waiting rank starts yielding its CPU.
_SPINS = 1024


class HostBoard:
    """Elementwise max of ``width`` int64 values over the ranks of ``node_comm``.

    Collective to create and to :meth:`free`; every rank must call :meth:`max`
    the same number of times, in the same order (as with any collective).
    """

    def __init__(self, node_comm: Any, width: int, timeout: float) -> None:
        from mpi4py import MPI

        size, me = node_comm.size, node_comm.rank
        itemsize = np.dtype(np.int64).itemsize
        nbytes = 2 * size * (1 + width) * itemsize if me == 0 else 0
        self._win = MPI.Win.Allocate_shared(nbytes, itemsize, comm=node_comm)
        buf, _ = self._win.Shared_query(0)
        self._rows = np.ndarray((2, size, 1 + width), np.int64, buffer=buf)
        # One passive epoch for the board's life: Win.Sync (the fence) needs one.
        self._win.Lock_all(MPI.MODE_NOCHECK)
        if me == 0:
            self._rows[...] = 0
        self._win.Sync()
        node_comm.Barrier()
        self._comm, self._me, self._peers = node_comm, me, [r for r in range(size) if r != me]
        self._round, self._timeout = 0, timeout

    def max(self, values: Sequence[int]) -> list[int]:
        """Post ``values``; the elementwise max over every rank's ([Note: board rounds])."""
        self._round += 1
        k = self._round
        rows = self._rows[k & 1]
        mine = rows[self._me]
        mine[1:] = values
        self._win.Sync()
        mine[0] = k
        for r in self._peers:
            seen = rows[r, 0:1]
            if seen[0] != k:
                self._wait(seen, k, r)
        self._win.Sync()
        return rows[:, 1:].max(axis=0).tolist()

    def _wait(self, seen: np.ndarray, k: int, peer: int) -> None:
        deadline = time.monotonic() + self._timeout
        spins = 0
        while seen[0] != k:
            spins += 1
            if spins % 64 == 0:
                if spins > _SPINS:  # a peer this late may need our CPU (oversubscribed hosts)
                    os.sched_yield()
                if time.monotonic() > deadline:
                    raise TideBackendError(
                        f"node rank {self._me} waited {self._timeout:g} s for node rank "
                        f"{peer} to reach collective {k} (a rank that raised, exited or called "
                        "collectives in another order; Config.timeout)")

    def free(self) -> None:
        """Release the window (collective)."""
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
