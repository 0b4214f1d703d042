"""The suite's fixtures and Hypothesis set-up (``tests/conftest.py``), for the harness's
and the baselines' tests: the same group, MPI seed and per-test barriers."""

from tests.conftest import comm, group, mpi_barrier, pytest_configure, xp  # noqa: F401
