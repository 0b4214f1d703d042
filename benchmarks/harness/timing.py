"""Timing: untimed warm-up, a barrier before every timed iteration, medians.

Each iteration is timed on every rank (CUDA events on the timing stream, or
the wall clock on the host); a collective's time for that iteration is the
maximum over ranks, and the reported time is the median over iterations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

#: Medians are taken over at least this many timed iterations.
MIN_ITERS = 20


@dataclass(frozen=True)
class Stats:
    """Per-iteration times (seconds, max over ranks) and their summary."""

    samples: tuple[float, ...]
    #: Host time to issue each iteration (the call's return), max over ranks.
    host: tuple[float, ...] = ()
    #: Per call of ``iters`` calls issued back to back, host issue overlapped
    #: (from one call's end to the next's, max over ranks); their median is
    #: :attr:`back_to_back`.
    laps: tuple[float, ...] = ()

    @property
    def back_to_back(self) -> Optional[float]:
        return float(np.median(self.laps)) if self.laps else None

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    def summary(self) -> dict:
        p10, p90 = np.percentile(self.samples, [10, 90])
        out = {"median_s": self.median, "p10_s": float(p10), "p90_s": float(p90),
               "min_s": min(self.samples), "iters": len(self.samples)}
        if self.host:
            out["host_median_s"] = float(np.median(self.host))
        if self.laps:
            out["back_to_back_median_s"] = self.back_to_back
        return out


def measure(ctx: Any, fn: Callable[[], Any], *, iters: int = MIN_ITERS, warmup: int = 3,
            pre: Optional[Callable[[], Any]] = None, back_to_back: bool = True) -> Stats:
    """Time ``fn``, which issues work on the device's timing stream.

    ``pre`` runs untimed before every iteration. Without ``pre``, and unless
    ``back_to_back`` is False (callers that read only the median), the same
    number of calls is then issued back to back, with an event after each
    (``Stats.back_to_back``, the median per call). Collective: every rank must
    call it with the same ``iters``, ``warmup`` and ``back_to_back``.
    """
    dev = ctx.dev
    for _ in range(warmup):
        if pre is not None:
            pre()
        fn()
    dev.sync()
    times, host = np.empty(iters), np.empty(iters)
    for i in range(iters):
        if pre is not None:
            pre()
            dev.sync()
        ctx.comm.Barrier()
        t = dev.timer()
        t.start()
        h0 = time.perf_counter()
        fn()
        host[i] = time.perf_counter() - h0
        t.stop()
        times[i] = t.seconds()
    laps: tuple = ()
    if pre is None and back_to_back:
        ctx.comm.Barrier()
        t = dev.timer(laps=iters)
        t.start()
        for _ in range(iters):
            fn()
            t.lap()
        t.stop()
        laps = tuple(allreduce_max(ctx.comm, t.lap_seconds()).tolist())
    return Stats(tuple(allreduce_max(ctx.comm, times).tolist()),
                 tuple(allreduce_max(ctx.comm, host).tolist()), laps)


def allreduce_max(comm: Any, values: Sequence[float]) -> np.ndarray:
    from mpi4py import MPI

    buf = np.asarray(values, dtype=np.float64)
    out = np.empty_like(buf)
    comm.Allreduce(buf, out, op=MPI.MAX)
    return out

