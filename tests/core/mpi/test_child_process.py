"""A child process a test starts is not a rank of the test's MPI job.

Tests start fresh interpreters (``_util.run_python``) to check imports and faults. Inside
an ``mpirun`` job a child inherits the launcher's variables and, under Open MPI, its
``MPI_Init`` joins the job as a second copy of the parent's rank: on an H200 that left
two ranks crashing in a later large message between them. ``child_env`` drops those
variables, so the child is an MPI singleton of its own.
"""

from __future__ import annotations

import pytest

from ..._util import LAUNCHER_PREFIXES, agree, child_env, run_python

pytestmark = pytest.mark.mpi

_SIZE = "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank())"


def test_a_child_process_is_an_mpi_singleton(comm):
    failures = []
    left = sorted(k for k in child_env() if k.startswith(LAUNCHER_PREFIXES))
    if left:
        failures.append(f"launcher variables passed on: {left}")
    try:
        out = run_python(_SIZE, timeout=60)
        if out.returncode != 0:
            failures.append(f"the child failed ({out.returncode}): {out.stderr[-400:]}")
        elif out.stdout.split() != ["1", "0"]:
            failures.append(f"the child is rank {out.stdout.strip()!r} of a job, not a "
                            "singleton ('1 0')")
    except Exception as e:  # noqa: BLE001 - a child that hangs in MPI_Init: report it
        failures.append(f"the child did not finish: {e!r}")
    agree(comm, failures, "child process")
