"""Waiting on peers without hanging: every host wait on another rank is polled against
``Config.timeout``, so a rank that raised, exited or called collectives in another order
becomes an error on the ranks waiting for it, not a hang."""

from __future__ import annotations

import os
import time
from typing import Callable


def poll_until(done: Callable[[], bool], timeout: float, spin: float = 0.0) -> bool:
    """Call ``done()`` until it is true (True) or ``timeout`` seconds have passed (False).

    For the first ``spin`` seconds ``done`` is called back to back, yielding the CPU in
    between (a peer on the same cores, or MPI's progress inside ``done``, may be what is
    waited for), then with pauses that double up to 1 ms."""
    now = time.monotonic()
    deadline, spin_until, pause = now + timeout, now + spin, 0.0
    while not done():
        now = time.monotonic()
        if now > deadline:
            return False
        if now < spin_until:
            os.sched_yield()
            continue
        time.sleep(pause)
        pause = min(pause * 2 or 1e-6, 1e-3)
    return True
