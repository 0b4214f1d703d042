"""GPU fixtures: a cuda group, made once per session, skipped cleanly without a GPU.

The skip is collective: under MPI every rank must agree, or a rank that skips
would leave the others waiting in ``init``.
"""

from __future__ import annotations

import os
import sys

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Print a GPU test's failure at once, with the rank: under MPI a failed rank
    can leave its peers waiting, and the end-of-session report never comes."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and item.get_closest_marker("gpu"):
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
