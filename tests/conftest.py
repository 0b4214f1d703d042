"""Shared fixtures: Hypothesis profiles, the MPI seed, the group, and per-test barriers.

Hypothesis under MPI: every rank runs the same test function, and each draw
becomes a collective, so every rank must draw the same examples in the same
order. We get that by forcing one seed on all ranks (rank 0 picks it, or
``--hypothesis-seed`` gives it; ``tests/run.py`` passes one seed to every run
and prints it), and by turning off everything that can make a rank's run of
Hypothesis depend on timing or on local state: the example database,
deadlines, health checks, shrinking (it stops on a clock) and the search for
further bugs after the first. Test assertions fail on every rank together
(``_util.agree``), so ranks also agree on which examples fail.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, Phase, settings

#: Examples per property test; raise with TIDE_TEST_EXAMPLES for a longer soak.
_EXAMPLES = int(os.environ.get("TIDE_TEST_EXAMPLES", "0") or 0)
settings.register_profile("tide", deadline=None, max_examples=_EXAMPLES or 150, database=None,
                          print_blob=True)
settings.register_profile(
    "tide-mpi", deadline=None, max_examples=_EXAMPLES or 40, database=None, derandomize=False,
    suppress_health_check=list(HealthCheck),
    # Shrinking stops on a wall clock, so ranks could stop at different examples and hang;
    # TIDE_TEST_SHRINK=1 turns it on for debugging a failure on a quiet machine.
    phases=(Phase.explicit, Phase.generate)
    + ((Phase.shrink,) if os.environ.get("TIDE_TEST_SHRINK") == "1" else ()),
    report_multiple_bugs=False, print_blob=True)


def _with_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("--with-mpi", default=False))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Load the profile; under MPI make every rank use one Hypothesis seed."""
    mpi = _with_mpi(config)
    settings.load_profile(os.environ.get("TIDE_HYPOTHESIS_PROFILE",
                                         "tide-mpi" if mpi else "tide"))
    if not mpi:
        return
    from mpi4py import MPI

    seed = config.getoption("--hypothesis-seed", default=None)
    seed = MPI.COMM_WORLD.bcast(seed if seed is not None else random.getrandbits(32), root=0)
    # The Hypothesis plugin reads the option in its own pytest_configure, after this one.
    config.option.hypothesis_seed = str(seed)


@pytest.fixture(scope="session")
def comm():
    """``MPI.COMM_WORLD`` (the group duplicates it; tests use it for references)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def group(comm):
    """The group every multi-rank test runs on (collective; made once per session).

    ``TIDE_BACKEND`` picks the backend (``host`` by default, ``cuda`` on GPU
    machines); ``TIDE_LOCAL_SIZE`` emulates several nodes.
    """
    import tidearray

    g = tidearray.init(backend=os.environ.get("TIDE_BACKEND", "host"))
    yield g
    comm.Barrier()
    g.close()


@pytest.fixture(scope="session")
def xp(group):
    """The backend's array module: NumPy on host, CuPy on cuda."""
    return group.backend.xp


@pytest.fixture(autouse=True)
def _mpi_barrier(request: pytest.FixtureRequest):
    """A barrier around each multi-rank test, so one test's traffic never meets the next's."""
    if not (_with_mpi(request.config) and request.node.get_closest_marker("mpi")):
        yield
        return
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    yield
    MPI.COMM_WORLD.Barrier()
