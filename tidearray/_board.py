"""Node-local agreement through shared host memory: the fast path of validation.

Every collective starts with a small agreement (``_validate.check``): the
elementwise maximum of three integers over the group. As an MPI ``Allreduce``
it took microseconds on the host, on the critical path of every call. When the
whole group is on one node, ranks instead post their values on a board in an
MPI shared-memory window and read each other's: an order of magnitude less once
every rank has arrived (measured on 2xH200's host; development records from run 6,
in git history).

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
import platform
import time
from typing import TYPE_CHECKING, Sequence

from ._errors import TideBackendError

if TYPE_CHECKING:
    from mpi4py import MPI

#: Spins before a waiting rank starts yielding its CPU.
_SPINS = 1024


class HostBoard:
    """Elementwise max of ``width`` int64 values over the ranks of ``node_comm``.

    Collective to create and to :meth:`free`; every rank must call :meth:`max`
    the same number of times, in the same order (as with any collective).
    """

    def __init__(self, node_comm: MPI.Comm, width: int, timeout: float) -> None:
        from mpi4py import MPI

        size, me = node_comm.size, node_comm.rank
        self._row = 1 + width  # round number, then the values
        self._half = size * self._row
        nbytes = 2 * self._half * 8 if me == 0 else 0
        self._win = MPI.Win.Allocate_shared(nbytes, 8, comm=node_comm)
        buf, _ = self._win.Shared_query(0)
        # A memoryview, not NumPy: element access costs a tenth as much.
        self._mem = memoryview(buf).cast("B").cast("q")
        # One passive epoch for the board's life: Win.Sync (the fence) needs one.
        self._win.Lock_all(MPI.MODE_NOCHECK)
        if me == 0:
            for i in range(2 * self._half):
                self._mem[i] = 0
        self._win.Sync()
        node_comm.Barrier()
        self._me, self._width, self._peers = me, width, [r for r in range(size) if r != me]
        self._round, self._timeout = 0, timeout
        # x86 keeps stores in order and loads in order, which is all [Note: board
        # rounds] needs; other CPUs fence.
        self._fence = None if platform.machine() in ("x86_64", "AMD64") else self._win.Sync

    def max(self, values: Sequence[int]) -> list[int]:
        """Post ``values``; the elementwise max over every rank's ([Note: board rounds])."""
        self._round += 1
        k, mem, fence = self._round, self._mem, self._fence
        base = (k & 1) * self._half
        mine = base + self._me * self._row
        for j, v in enumerate(values, mine + 1):
            mem[j] = v
        if fence:
            fence()
        mem[mine] = k
        out = list(values)
        for r in self._peers:
            row = base + r * self._row
            if mem[row] != k:
                self._wait(row, k, r)
            if fence:
                fence()
            for j in range(self._width):
                v = mem[row + 1 + j]
                if v > out[j]:
                    out[j] = v
        return out

    def _wait(self, row: int, k: int, peer: int) -> None:
        mem = self._mem
        deadline = time.monotonic() + self._timeout
        spins = 0
        while mem[row] != k:
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
            self._mem.release()
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
