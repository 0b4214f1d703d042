"""The run's shared state: MPI, the tidearray group, the device, records, progress output.

Only rank 0 prints; progress lines are flushed at once and also written to
``<out>/bench.log``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .device import CudaDevice, HostDevice
from .records import Sink, git_commit


class Ctx:
    """Everything a suite needs. Made by :func:`make_ctx` (collective)."""

    def __init__(self, comm: Any, group: Any, dev: Any, args: Any, sink: Sink,
                 group_note: str = "") -> None:
        self.comm, self.group, self.dev, self.args, self.sink = comm, group, dev, args, sink
        self.rank, self.size = comm.rank, comm.size
        self.group_note = group_note
        #: Failures of the run (errors, not skips): any makes the command exit nonzero.
        self.errors: list[str] = []
        self.t0 = time.perf_counter()
        self._log = None
        if self.rank == 0 and args.out:
            self._log = open(os.path.join(args.out, "bench.log"), "a")

    def log(self, msg: str) -> None:
        """A progress line from rank 0, with the elapsed time."""
        self.out(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}")

    def out(self, text: str) -> None:
        """Plain output (tables) from rank 0, also into the log."""
        if self.rank != 0:
            return
        print(text, flush=True)
        if self._log:
            self._log.write(text + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._log:
            self._log.close()
            self._log = None


def _node_rank(comm: Any) -> int:
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    r = node.rank
    node.Free()
    return r


def _pick_device(comm: Any, want: str) -> str:
    """``cuda`` if asked for (or ``auto`` and every rank has a GPU and CuPy), else ``host``."""
    from mpi4py import MPI

    from tidearray.backends import cuda_usable

    if want == "host":
        return "host"
    ok, why = cuda_usable()
    if not comm.allreduce(int(ok), op=MPI.MIN):
        if want == "cuda":
            raise SystemExit(f"--device cuda: no usable GPU on some rank ({why})")
        return "host"
    import cupy

    dev = _node_rank(comm) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    try:  # cuda-bindings' runtime (used by nccl4py's cuda.core) keeps its own current device
        from cuda.bindings import runtime as cudart

        cudart.cudaSetDevice(dev)
    except ImportError:
        pass
    return "cuda"


def make_ctx(args: Any) -> Ctx:
    """Start MPI, pick the device, start tidearray (collective).

    If the device is a GPU but tidearray's cuda backend cannot start (not yet
    built, or broken), the group falls back to the host backend so that the
    NCCL baselines still run; ``tide`` is then reported as unavailable with the
    reason.
    """
    from mpi4py import MPI

    import tidearray as ta

    comm = MPI.COMM_WORLD.Dup()
    if args.out and comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
    kind = _pick_device(comm, args.device)
    note = ""
    try:
        group = ta.init(backend=kind)
    except Exception as e:  # noqa: BLE001 - cuda backend missing or broken: keep the baselines
        if kind != "cuda":
            raise
        note = f"tidearray's cuda backend did not start ({e.__class__.__name__}: {e})"
        group = ta.init(backend="host")
    dev = CudaDevice() if kind == "cuda" else HostDevice()
    json_path = os.path.join(args.out, "bench.jsonl") if args.out else None
    return Ctx(comm, group, dev, args, Sink(json_path, comm.rank), note)


def environment(ctx: Ctx) -> dict:
    """What the report needs to say where the numbers came from."""
    import platform

    import numpy

    import tidearray

    from ..baselines import nccl

    env = {"argv": " ".join(["python -m benchmarks"] + sys.argv[1:]),
           "world": ctx.size, "host": platform.node(), "python": platform.python_version(),
           "numpy": numpy.__version__, "tidearray": tidearray.__version__,
           "group": repr(ctx.group), "group_note": ctx.group_note,
           "commit": git_commit()}
    env.update(ctx.dev.describe())
    try:
        from mpi4py import MPI

        first = MPI.Get_library_version().splitlines()[0]
        env["mpi"] = "".join(c for c in first if c.isprintable()).strip()
    except Exception:  # noqa: BLE001 - the MPI version is only informative
        pass
    if ctx.dev.name == "cuda":
        ok, why = nccl.available()
        env["nccl"] = why
        env["nccl_path"] = nccl.library_path() if ok else ""
        env["env"] = {k: v for k, v in os.environ.items()
                      if k.startswith(("NCCL_", "TIDE_", "CUDA_VISIBLE"))}
    return env
