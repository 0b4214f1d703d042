"""The device the benchmark runs on: arrays, streams, timers, memory readings.

Two kinds, chosen by the tidearray group's backend:

* :class:`HostDevice` (NumPy): wall-clock timers; no streams, SMs or device memory.
* :class:`CudaDevice` (CuPy): one timing stream per process, CUDA-event timers,
  ``cudaMemGetInfo`` readings, the SM count, and a bf16 GEMM for interference runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np


class WallTimer:
    """``start``/``lap``/``stop`` on the host clock; ``seconds()`` after ``stop``."""

    def __init__(self, laps: int = 0) -> None:
        self._laps: list[float] = []

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def lap(self) -> None:
        self._laps.append(time.perf_counter())

    def stop(self) -> None:
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        return self._t1 - self._t0

    def lap_seconds(self) -> list[float]:
        """Time from the start (then from each lap) to each lap."""
        marks = [self._t0, *self._laps]
        return [b - a for a, b in zip(marks, marks[1:])]


class EventTimer:
    """CUDA events recorded on ``stream``; ``seconds()`` waits for the end event.

    ``laps`` events are made up front, so a lap costs one record between calls.
    """

    def __init__(self, stream: Any, laps: int = 0) -> None:
        import cupy

        self.stream = stream
        self._e0, self._e1 = cupy.cuda.Event(), cupy.cuda.Event()
        self._laps = [cupy.cuda.Event() for _ in range(laps)]
        self._used = 0

    def start(self) -> None:
        self._e0.record(self.stream)

    def lap(self) -> None:
        self._laps[self._used].record(self.stream)
        self._used += 1

    def stop(self) -> None:
        self._e1.record(self.stream)

    def seconds(self) -> float:
        import cupy

        self._e1.synchronize()
        return cupy.cuda.get_elapsed_time(self._e0, self._e1) * 1e-3

    def lap_seconds(self) -> list[float]:
        """Time from the start (then from each lap) to each lap."""
        import cupy

        self._e1.synchronize()
        marks = [self._e0, *self._laps[:self._used]]
        return [cupy.cuda.get_elapsed_time(a, b) * 1e-3 for a, b in zip(marks, marks[1:])]


class HostDevice:
    """CPU processes under MPI (the host backend)."""

    name = "host"
    xp = np
    num_sms: Optional[int] = None
    stream: Any = None

    def describe(self) -> dict:
        import platform

        return {"device": platform.processor() or platform.machine(), "backend": "host"}

    def sync(self) -> None:
        pass

    def timer(self, laps: int = 0) -> WallTimer:
        return WallTimer(laps)

    def mem_used(self) -> Optional[int]:
        return None

    def release_pools(self) -> None:
        import gc

        gc.collect()

    def pool_bytes(self) -> Optional[int]:
        return None

    def clocks(self) -> dict:
        return {}


class CudaDevice:
    """One GPU per process (the cuda backend), timed on a private stream."""

    name = "cuda"

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.dev = cupy.cuda.Device()
        self.num_sms = int(self.dev.attributes["MultiProcessorCount"])
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.side_stream = cupy.cuda.Stream(non_blocking=True)  # the interference GEMMs

    def describe(self) -> dict:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(self.dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return {"device": name, "backend": "cuda", "sms": self.num_sms,
                "driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion(),
                "cupy": cupy.__version__, "mem_total": rt.memGetInfo()[1]}

    def sync(self) -> None:
        self.dev.synchronize()

    def timer(self, laps: int = 0) -> EventTimer:
        return EventTimer(self.stream, laps)

    def mem_used(self) -> int:
        """Device bytes in use by anyone (``total - free`` of ``cudaMemGetInfo``)."""
        import cupy

        self.sync()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    def release_pools(self) -> None:
        import gc

        import cupy

        gc.collect()
        self.sync()
        cupy.get_default_memory_pool().free_all_blocks()

    def pool_bytes(self) -> int:
        import cupy

        return int(cupy.get_default_memory_pool().total_bytes())

    def clocks(self) -> dict:
        """This GPU's clocks, power and temperature now (see :func:`gpu_clocks`)."""
        return gpu_clocks(self.dev.id)

    def gemm(self, m: int, n: int, k: int) -> Callable[[], None]:
        """A bf16 ``(m, k) @ (k, n)`` product on the side stream (cuBLAS via CuPy)."""
        import cupy

        from tidearray import bfloat16

        with self.side_stream:
            a = (cupy.random.standard_normal((m, k), dtype=cupy.float32) * 0.01).astype(bfloat16)
            b = (cupy.random.standard_normal((k, n), dtype=cupy.float32) * 0.01).astype(bfloat16)
            c = cupy.empty((m, n), bfloat16)
        stream = self.side_stream

        def run() -> None:
            with stream:
                cupy.matmul(a, b, out=c)

        def run_alloc() -> None:  # where CuPy's matmul takes no bf16 out=
            with stream:
                cupy.matmul(a, b)
        try:
            run()
        except (TypeError, ValueError, NotImplementedError):
            return run_alloc
        return run


#: What a clock reading holds, as ``nvidia-smi --query-gpu`` fields and record keys.
CLOCK_FIELDS = (("clocks.sm", "sm_mhz"), ("clocks.mem", "mem_mhz"), ("power.draw", "power_w"),
                ("temperature.gpu", "temp_c"), ("power.limit", "power_limit_w"))


def _smi_args(device: int) -> list:
    import cupy

    bus = cupy.cuda.runtime.deviceGetPCIBusId(device)  # CUDA's and nvidia-smi's
    bus = bus.decode() if isinstance(bus, bytes) else str(bus)
    return ["nvidia-smi", "-i", bus, "--query-gpu=" + ",".join(f for f, _ in CLOCK_FIELDS),
            "--format=csv,noheader,nounits"]


def _reading(line: str) -> dict:
    """One CSV line of :data:`CLOCK_FIELDS`; a field the GPU does not report ("[N/A]") is
    left out. Raises ValueError for a line of another length (a cut-off last line)."""
    parts = [v.strip() for v in line.strip().split(",")]
    if len(parts) != len(CLOCK_FIELDS):
        raise ValueError(f"expected {len(CLOCK_FIELDS)} fields, got {line!r}")
    out = {}
    for (_, key), v in zip(CLOCK_FIELDS, parts):
        try:
            out[key] = float(v)
        except ValueError:  # "[N/A]", "[Not Supported]"
            pass
    return out


def clock_median(run: dict, key: str) -> Optional[float]:
    """The median of ``key`` over a training record's clock readings, or None where none
    has it."""
    vals = [k[key] for k in run.get("clocks", []) if key in k]
    return float(np.median(vals)) if vals else None


def gpu_clocks(device: int) -> dict:
    """CUDA device ``device``'s SM and memory clocks (MHz), power (W) and temperature (C)
    now, from ``nvidia-smi``; empty where it cannot be asked. Best effort: a figure
    beside a timing, never a reason to fail one."""
    import subprocess

    try:
        out = subprocess.run(_smi_args(device), capture_output=True, text=True, timeout=10,
                             check=True).stdout
        return _reading(out)
    except Exception:  # noqa: BLE001 - no nvidia-smi, no permission, odd output: no figure
        return {}


class ClockLog:
    """Readings of :func:`gpu_clocks` every ``period_ms`` while it is open, from one
    ``nvidia-smi`` process in the background (so the readings fall inside the work,
    not between its pieces). Best effort: :meth:`close` returns what it got, maybe none.
    """

    def __init__(self, device: int, period_ms: int = 250) -> None:
        import subprocess
        import tempfile

        # A file, not a pipe: nobody reads until close, and a full pipe would stop it.
        self._file = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(_smi_args(device) + ["-lms", str(period_ms)],
                                          stdout=self._file, stderr=subprocess.DEVNULL)
        except Exception:  # noqa: BLE001 - no nvidia-smi: no readings
            self._proc = None
            self._file.close()

    def close(self) -> list[dict]:
        if self._proc is None:
            return []
        import subprocess

        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self._file.seek(0)
        out = self._file.read()
        self._file.close()
        readings = []
        for line in out.splitlines():
            try:
                readings.append(_reading(line))
            except ValueError:  # a cut-off last line
                pass
        return readings
