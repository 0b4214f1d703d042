"""The watchdog: a collective whose peer never signals is released after the timeout.

Rank 1 builds a plan with rank 0 but never calls it. Rank 0's call then waits on the
GPU for rank 1's grant and data; without the watchdog its stream, and the host that
synchronizes on it, would wait for ever. With ``timeout=3``, the wait is released, the
group reports the timeout (``group.check()``), and every later call raises. Once for an
eager plan (its waits are stream memory operations) and once for a graph plan (its
waits are spinning kernels: [Note: flags in graphs]).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import tidearray as ta

from ..._util import agree

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.gpu]
TIMEOUT_S = 3.0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_watchdog_releases_a_wait_on_a_silent_peer(comm, graph):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    if ta.Config.make().debug:
        pytest.skip("debug mode agrees on every plan call, which a silent peer never joins")
    sub = comm.Split(0 if comm.rank < 2 else 1, comm.rank)
    failures: list[str] = []
    if comm.rank < 2:
        g = ta.init(sub, backend="cuda", timeout=TIMEOUT_S)
        unit = ta.Unit([(64, 64)], np.float32, group=g)
        arena = ta.SlotArena(unit.nbytes, 1, group=g)
        plan = unit.gather_plan([cupy.zeros(unit.shard_shapes[0], np.float32)], arena[0],
                                graph=graph)
        if g.rank == 0:
            failures = _silent_peer(g, plan, cupy)
        sub.Barrier()
        g.close()
    sub.Free()
    agree(comm, failures, "watchdog")


def _silent_peer(g, plan, cupy) -> list[str]:
    failures = []
    t0 = time.monotonic()
    plan(async_op=True).wait()
    cupy.cuda.Device().synchronize()  # for ever, without the watchdog
    took = time.monotonic() - t0
    if not TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + 10:
        failures.append(f"released after {took:.1f} s, expected about {TIMEOUT_S} s")
    try:
        g.check()
        failures.append("group.check() did not raise after the timeout")
    except ta.TideBackendError as e:
        if "did not complete" not in str(e):
            failures.append(f"unclear message: {e}")
    try:
        plan()
        failures.append("a call after the timeout did not raise")
    except ta.TideBackendError:
        pass
    return failures
