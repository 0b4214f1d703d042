"""A child process a test starts is not a rank of the test's MPI job.

Tests start fresh interpreters (``_util.run_python``) to check imports and faults. Inside
an ``mpirun`` job a child that inherits the launcher's variables takes itself for its
parent's rank: under Open MPI on an H200, such a child's ``MPI_Init`` joined the job as a
second copy of the rank (it reported the job's size and its parent's rank), and the job's
ranks then crashed in their next collectives. ``child_env`` drops those variables.
"""

from __future__ import annotations

import pytest

from ..._util import LAUNCHER_PREFIXES, agree, run_python

pytestmark = pytest.mark.mpi

_SEEN = ("import os; print(' '.join(sorted(k for k in os.environ "
         f"if k.startswith({LAUNCHER_PREFIXES!r}))))")


def test_a_child_process_sees_no_launcher_variable(comm):
    failures = []
    out = run_python(_SEEN, timeout=60)
    if out.returncode != 0:
        failures.append(f"the child failed ({out.returncode}): {out.stderr[-400:]}")
    elif out.stdout.split():
        failures.append(f"the child sees the launcher's variables {out.stdout.split()}")
    agree(comm, failures, "child process")
