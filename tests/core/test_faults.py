"""Faults under mpiexec: a dead, stopped, failing or out-of-order rank.

Each case starts ``tests/core/faults/worker.py`` on 3 ranks with ``TIDE_TIMEOUT`` = 5 s, on
the host backend, and on the cuda backend where a GPU is visible (ranks share GPUs), and
checks that the job ends within the timeout plus 10 s, that no process of it is left,
that no rank ever returned wrong data, and what the survivors said. What each fault
does to the survivors is written up in docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .._util import skip_inside_mpi_job
from ..run import contention, mpiexec_flags

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0
RANKS = 3


def _slack() -> float:
    """The contention a job starts under (``run.py``'s measure, its ranks counted): the
    allowances for a job's start-up and for a survivor's report scale by it, as
    ``run.py``'s limits do; the library's timeout itself does not."""
    return contention(RANKS, os.cpu_count() or 1).factor


def _backends() -> list:
    """host always; cuda where CuPy sees a GPU (skipped, with the reason, elsewhere)."""
    why = None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            why = "no CUDA device"
    except Exception as e:  # noqa: BLE001 - no CuPy, or no driver: skip the cuda cases
        why = f"no CUDA device ({type(e).__name__})"
    cuda = pytest.param("cuda", marks=pytest.mark.skip(reason=why)) if why else "cuda"
    return ["host", cuda]


@pytest.fixture(params=_backends(), autouse=True)
def backend(request):
    skip_inside_mpi_job("starts its own mpiexec")
    return request.param


def _mpiexec() -> list:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec")
    return [found, *mpiexec_flags(found)]


def _alive(token: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if token in line and "ps -eo" not in line]


SHM = Path("/dev/shm")


def _segments() -> set[str]:
    """MPICH's shared-memory segments now in /dev/shm."""
    return {p.name for p in SHM.glob("mpich_shm_*")} if SHM.is_dir() else set()


def _mapped() -> set[str]:
    """Names of /dev/shm files some live process maps."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        names.update(m.group(1) for m in re.finditer(r"/dev/shm/(\S+)", text))
    return names


def _remove_leftovers(before: set[str]) -> None:
    """Unlink the segments this job made that no live process maps: a killed rank never
    unlinks its own (MPICH's survivors do), and left there they pile up run after run."""
    for name in _segments() - before - _mapped():
        try:
            (SHM / name).unlink()
        except OSError:
            pass


def _run(backend: str, fault: str, **env: str) -> tuple[int, str, float]:
    before = _segments()
    try:
        return _run_job(backend, fault, **env)
    finally:
        _remove_leftovers(before)


def _run_job(backend: str, fault: str, **env: str) -> tuple[int, str, float]:
    token = f"tide-fault-{uuid.uuid4().hex[:8]}"
    env = dict(env, TIDE_TIMEOUT=str(TIMEOUT_S), PYTHONUNBUFFERED="1",
               TIDE_FAULT_BACKEND=backend)
    mpiexec = _mpiexec()
    if "--oversubscribe" in mpiexec:  # Open MPI passes on only what it is told to
        mpiexec += [a for v in [*env, "PYTHONPATH"] if v in env or v in os.environ
                    for a in ("-x", v)]
    cmd = mpiexec + ["-n", str(RANKS), sys.executable, "tests/core/faults/worker.py", fault, token]
    environ = dict(os.environ, **env)
    start, hang_s = time.monotonic(), TIMEOUT_S + 60 * _slack()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=hang_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{fault}: the job did not end within {hang_s:.0f} s:\n{out}")
    took = time.monotonic() - start
    time.sleep(0.5)
    left = _alive(token)
    for line in left:  # do not leave them to the next test
        os.kill(int(line.split()[0]), 9)
    assert not left, f"{fault}: processes left after the job ended: {left}"
    assert "WRONG DATA" not in out, out
    started = sorted(int(r) for r in re.findall(r"rank (\d+): started", out))
    assert started == list(range(RANKS)), f"{fault}: not every rank started:\n{out}"
    return proc.returncode, out, took


@pytest.mark.parametrize("fault", ["exit", "raise"])
def test_a_dead_rank_ends_the_job(backend, fault):
    """A rank that dies (``os._exit``) or raises between collectives: the job ends,
    none of its processes is left, and no survivor returned wrong data."""
    rc, out, took = _run(backend, fault)
    assert rc != 0, out
    limit = TIMEOUT_S + 30 * _slack()
    assert took < limit, f"{fault}: took {took:.1f} s (limit {limit:.0f} s):\n{out}"


@pytest.mark.parametrize("nodes", [1, RANKS], ids=["one-node", "three-nodes"])
def test_a_stopped_rank_makes_every_survivor_raise(backend, nodes):
    """A rank stopped (SIGSTOP) for longer than the timeout: every other rank raises
    TideBackendError within the timeout plus 10 s, then the job ends. Across emulated
    nodes (``TIDE_LOCAL_SIZE=1``) the survivors wait in inter-node exchanges, which
    time out too."""
    env = {}
    if nodes > 1:
        if backend == "cuda":
            pytest.skip("three emulated nodes need three GPUs for NCCL (refused on fewer)")
        env["TIDE_LOCAL_SIZE"] = "1"
    rc, out, took = _run(backend, "stop", **env)
    survivors = re.findall(r"rank (\d+): TideBackendError after ([\d.]+) s", out)
    assert sorted(int(r) for r, _ in survivors) == [r for r in range(RANKS) if r != 1], out
    limit = TIMEOUT_S + 10 * _slack()
    assert all(float(s) <= limit for _, s in survivors), f"limit {limit:.0f} s:\n{out}"
    assert rc != 0, out


def test_plans_called_out_of_order_raise_in_debug_mode(backend):
    """Rank 1 calls two plans in the other order: with ``TIDE_DEBUG=1`` every rank raises
    TideInvalid at that call, before any copy (without it the call would move the wrong
    unit's bytes: the reason the mode exists)."""
    rc, out, took = _run(backend, "order", TIDE_DEBUG="1")
    raised = re.findall(r"rank (\d+): TideInvalid after [\d.]+ s: all_gather plan", out)
    assert sorted(int(r) for r in raised) == list(range(RANKS)), out
