"""Timing shared by the GPU diagnostics (``hw_bounds.py``, ``narrow_probe.py``)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def timed_on(stream: Any, launch: Callable[[], Any], reps: int = 5) -> float:
    """Median seconds of ``launch()`` between events on ``stream`` (two untimed first)."""
    import cupy as cp

    for _ in range(2):
        launch()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        launch()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(times))
