"""Shared fixtures: Hypothesis profiles, the MPI seed, the group, per-test barriers, and
the GPU tests' cuda group (every area's ``gpu/``: skipped cleanly without a GPU).

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
import sys

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


#: Seconds a rank waits at the barrier after a test for the other ranks. Every test ends
#: in a collective (``_util.agree``), so ranks finish within moments of each other; a rank
#: still missing after this long is stuck in a collective that a rank which raised alone
#: left behind.
_SKEW_S = float(os.environ.get("TIDE_TEST_SKEW_S", "120"))


_REPORTS = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keep each phase's report on the item, for the barrier after the test; print a GPU
    test's failure, and any failure on the cuda backend, at once (``_print_failure``)."""
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    if report.failed and (item.get_closest_marker("gpu")
                          or os.environ.get("TIDE_BACKEND") == "cuda"):
        _print_failure(item, report)


def _timed_barrier(comm, item: pytest.Item) -> None:
    """``comm.Barrier()``, but after ``_SKEW_S`` seconds without the other ranks: print
    this rank's failure, if it had one, and abort the run instead of hanging it."""
    from mpi4py import MPI

    from ._util import quiet_barrier

    if quiet_barrier(comm, _SKEW_S):
        return
    failed = [r for r in item.stash.get(_REPORTS, {}).values() if r.failed]
    capture = item.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the run's log, not the test's
        print(f"\nrank {comm.rank}: the other ranks did not finish {item.nodeid} within "
              f"{_SKEW_S:.0f} s; this rank {'failed' if failed else 'passed'} it. A rank "
              "that raised alone leaves the others in a collective: aborting the run.",
              file=sys.stderr)
        for report in failed:
            print(report.longreprtext, file=sys.stderr)
        sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def mpi_barrier(request: pytest.FixtureRequest):
    """A barrier around each multi-rank test, so one test's traffic never meets the next's;
    the one after the test aborts the run when a rank never arrives (``_timed_barrier``)."""
    if not (_with_mpi(request.config) and request.node.get_closest_marker("mpi")):
        yield
        return
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    yield
    _timed_barrier(MPI.COMM_WORLD, request.node)


# GPU tests (``tests/*/gpu/``). The skip is collective: under MPI every rank must agree, or
# a rank that skips would leave the others waiting in ``init``.


def _print_failure(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Print a failure at once, with the rank: under MPI a failed rank can leave its
    peers waiting, and on the GPU machine a step's timeout can come before the
    end-of-session report."""
    try:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
    except ImportError:
        rank = 0
    sys.__stderr__.write(f"\n[rank {rank}] FAILED ({rep.when}) {item.nodeid}\n"
                         f"{rep.longreprtext[-4000:]}\n")
    sys.__stderr__.flush()


def _all_ranks_have_gpu() -> tuple[bool, str]:
    from tidearray.backends import cuda_usable

    ok, why = cuda_usable()
    try:
        from mpi4py import MPI

        oks = MPI.COMM_WORLD.allgather((ok, why))
    except ImportError:
        oks = [(ok, why)]
    bad = [w for o, w in oks if not o]
    return (not bad), (bad[0] if bad else why)


@pytest.fixture(scope="session")
def cuda_group(request: pytest.FixtureRequest):
    """A group on the cuda backend: the session's own ``group`` when TIDE_BACKEND=cuda."""
    pytest.importorskip("cupy")
    ok, why = _all_ranks_have_gpu()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    if os.environ.get("TIDE_BACKEND") == "cuda":
        yield request.getfixturevalue("group")
        return
    import tidearray

    g = tidearray.init(backend="cuda")
    yield g
    g.close()


@pytest.fixture(autouse=True)
def _own_device(request: pytest.FixtureRequest):
    """Make this rank's GPU current around every GPU test.

    JAX and PyTorch can leave another device current; arrays made afterwards
    would then sit on the wrong GPU, and the collectives rightly refuse them.
    Restoring it after the test also keeps later (generic) tests on the right GPU.
    """
    if "cuda_group" not in request.fixturenames:
        yield
        return
    import cupy

    dev = request.getfixturevalue("cuda_group").backend.device
    cupy.cuda.Device(dev).use()
    yield
    cupy.cuda.Device(dev).use()


@pytest.fixture(scope="session")
def cp(cuda_group):
    import cupy

    return cupy
