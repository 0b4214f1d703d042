"""The shared-memory board that validation agrees on (one node): its max and its timeout."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ..._util import agree, fresh_seed

pytestmark = pytest.mark.mpi


def _board(group, timeout: float):
    from tidearray._board import HostBoard

    return HostBoard(group.node_comm, 3, timeout)


def test_board_max_matches_allreduce(group, comm):
    """Many rounds back to back (both halves reused), each against an MPI Allreduce."""
    from mpi4py import MPI

    failures = []
    one_node = 1 < group.local_size == group.size
    if (group.board is not None) != one_node:
        failures.append(f"expected a board exactly on one node of several ranks, got "
                        f"{group.board} for {group}")
    board = _board(group, 30.0)
    rng = np.random.default_rng(fresh_seed(group.comm))  # fresh data on every run
    node = group.node_comm
    try:
        for k in range(200):
            mine = rng.integers(-(1 << 62), 1 << 62, size=3).tolist()
            if k % 7 == 0:  # a late rank: the others wait on the board
                time.sleep(0.002 * node.rank)
            got = board.max(mine)
            want = np.empty(3, np.int64)
            node.Allreduce(np.array(mine, np.int64), want, op=MPI.MAX)
            if got != want.tolist():
                failures.append(f"round {k}: board max {got}, Allreduce {want.tolist()}")
                break
    finally:
        board.free()
    agree(comm, failures)


def test_board_reports_a_missing_rank(group, comm):
    """A node rank that never posts: every other node rank raises within the timeout."""
    from tidearray import TideBackendError

    node = group.node_comm
    if node.size < 2:
        pytest.skip("needs two ranks on a node")
    board = _board(group, 0.3)
    failures = []
    try:
        if node.rank != 0:
            t0 = time.monotonic()
            try:
                board.max([1, 2, 3])
                failures.append("max returned without node rank 0")
            except TideBackendError as e:
                if "node rank 0" not in str(e):
                    failures.append(f"the error does not name the missing rank: {e}")
            if time.monotonic() - t0 > 10:
                failures.append(f"raised after {time.monotonic() - t0:.1f} s, timeout 0.3 s")
    finally:
        board.free()
    agree(comm, failures)
