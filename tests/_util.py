"""Helpers shared by the tests: data generation, array conversion, collective asserts.

Everything here is independent of tidearray's own planning, so the references
the tests compare against cannot inherit a bug from the code under test.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)
DTYPES = (BF16, FP16, FP32)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The variables by which MPI launchers tell a process which job and rank it is: Open MPI
#: and PMIx (``OMPI_``, ``PMIX_``), MPICH's Hydra (``PMI_``, ``HYDRA_``, ``MPI_LOCAL``).
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def fresh_seed(comm: Any = None, bits: int = 31) -> int:
    """A new seed every run, or ``TIDE_TEST_SEED``'s: every test that draws fresh data
    draws its seed here. Under MPI (``comm``) rank 0 draws it and broadcasts it
    (collective), so the ranks draw alike. Printed: pytest shows a failed test's output,
    so the failure names the seed that reproduces it (``TIDE_TEST_SEED=N``)."""
    pinned = os.environ.get("TIDE_TEST_SEED")
    if pinned:
        seed = int(pinned) % (1 << bits)
    else:
        mine = int(np.random.default_rng().integers(1 << bits))
        seed = mine if comm is None else comm.bcast(mine if comm.rank == 0 else None)
    print(f"seed {seed} (reproduce: TIDE_TEST_SEED={seed})")
    return seed


def child_env() -> dict[str, str]:
    """This process's environment without its MPI launcher's variables, for a child process
    a test starts.

    A child that inherits them takes itself for this rank: under Open MPI on the H200, a
    child's ``MPI_Init`` joined the running job as a second copy of its parent's rank (it
    reported the job's size and the parent's rank), and the job's ranks then died of a
    segmentation fault in their next collective. Without them the child is no part of the
    job (tests whose child starts MPI still skip inside a job: ``skip_inside_mpi_job``)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}


def skip_inside_mpi_job(what: str) -> None:
    """Skip the calling test when this process is a rank of an MPI job; ``what`` says what
    the test starts that needs a process of its own (an ``mpiexec``, a child's ``MPI_Init``:
    a singleton started from inside a job depends on the MPI and the machine)."""
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        pytest.skip(f"{what}: run it outside an MPI job")


def run_python(code: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter started in the checkout (its own ``sys.modules``,
    warning filters and MPI: ``child_env``), text output captured."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


def bits(a: np.ndarray) -> np.ndarray:
    """``a``'s raw bits as unsigned integers of the same itemsize (bitwise compares)."""
    return a.view(_UINT[a.dtype.itemsize])


def torch_chunk_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that ``torch.chunk(x, world)`` gives ``rank``, written from scratch.

    ``torch.chunk`` cuts chunks of ``c = ceil(d0 / world)`` rows; the last
    non-empty chunk may be short, and ranks past it get nothing.
    """
    c = math.ceil(d0 / world) if d0 else 0
    bounds = list(range(0, d0, c)) + [d0] if c else [0]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    return chunks[rank] if rank < len(chunks) else (d0, d0)


def to_numpy(a: Any) -> np.ndarray:
    """A host copy of a NumPy or CuPy array (bf16 included, moved as raw bits)."""
    if isinstance(a, np.ndarray):
        return a
    import cupy

    return cupy.asnumpy(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)


def to_xp(xp: Any, a: np.ndarray) -> Any:
    """``a`` as a fresh array of the backend's module (NumPy or CuPy)."""
    if xp is np:
        return np.array(a, copy=True)
    return xp.asarray(bits(np.ascontiguousarray(a))).view(a.dtype)


_SPIN = r"""
extern "C" __global__ void tide_test_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def stall(xp: Any, seconds: float) -> None:
    """Make the backend's queue late by ``seconds``: NumPy sleeps; on CuPy one thread
    spins on the current stream, so work queued after it really runs late on the GPU."""
    if seconds <= 0:
        return
    if xp is np:
        time.sleep(seconds)
        return
    khz = xp.cuda.Device().attributes["ClockRate"]
    xp.RawKernel(_SPIN, "tide_test_spin")((1,), (1,), (np.int64(seconds * khz * 1e3),))


def random_bits(rng: np.random.Generator, shape: Sequence[int], dtype: np.dtype,
                avoid: Optional[int] = None) -> np.ndarray:
    """Uniformly random bit patterns (NaN payloads and all) except the pattern ``avoid``.

    Bitwise tests poison outputs with ``avoid``; keeping it out of the data
    means any element the collective failed to write shows up.
    """
    u = _UINT[dtype.itemsize]
    raw = rng.integers(0, np.iinfo(u).max, size=tuple(shape), dtype=u, endpoint=True)
    if avoid is not None:
        raw[raw == avoid] = 0
    return raw.view(dtype)


def random_values(rng: np.random.Generator, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """Standard-normal values rounded to ``dtype`` (gradients)."""
    return rng.standard_normal(tuple(shape), dtype=np.float32).astype(dtype)


def padded_shard(full: np.ndarray, world: int, rank: int) -> np.ndarray:
    """``rank``'s torch.chunk rows of ``full``, zero-padded to ``ceil(d0/world)`` rows."""
    d0 = full.shape[0]
    c = math.ceil(d0 / world) if d0 else 0
    start, stop = torch_chunk_rows(d0, world, rank)
    out = np.zeros((c, *full.shape[1:]), full.dtype)
    out[: stop - start] = full[start:stop]
    return out


def agree(comm: Any, failures: Sequence[str], what: str = "") -> None:
    """Collective assert: raise the same AssertionError on every rank if any rank failed.

    Failing on every rank alike keeps ranks in lockstep: no rank waits in a
    collective that a failed peer has abandoned, and Hypothesis sees the same
    outcome on every rank.
    """
    everything = comm.allgather(list(failures))
    lines = [f"rank {r}: {f}" for r, fs in enumerate(everything) for f in fs]
    if lines:
        raise AssertionError((what + ": " if what else "") + "\n".join(lines[:20]))


def quiet_barrier(comm: Any, timeout_s: Optional[float] = None, spin_s: float = 0.05) -> bool:
    """``comm.Barrier()`` that, after ``spin_s`` of polling (yielding the core between
    polls, as the barrier's other ranks may need it), sleeps between polls: a rank that
    waits long leaves the cores to the ranks still working (CI runs up to eight ranks on
    two cores). False if ``timeout_s`` passed first."""
    request, pause = comm.Ibarrier(), 1e-4
    now = time.monotonic()
    spin_until, deadline = now + spin_s, None if timeout_s is None else now + timeout_s
    while not request.Test():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return False
        if now < spin_until:
            os.sched_yield()
            continue
        time.sleep(pause)
        pause = min(2 * pause, 0.005)
    return True


def on_rank_zero(comm: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` run on rank 0 alone, its result on every rank (collective).

    For a reference every rank would compute alike (one process training on the global
    batch): the other ranks sleep meanwhile. If it raises, rank 0 raises it and every
    other rank an AssertionError that names it, so no rank is left waiting.
    """
    outcome: Any = None
    if comm.rank == 0:
        try:
            outcome = (True, compute())
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error, outcome = e, (False, f"{type(e).__name__}: {e}")
    quiet_barrier(comm)
    ok, value = comm.bcast(outcome, root=0)
    if not ok:
        if comm.rank == 0:
            raise error
        raise AssertionError(f"rank 0's reference raised {value}")
    return value


def compare_bits(got: Any, want: np.ndarray, label: str) -> list[str]:
    """Failures (empty if none) of a bitwise comparison of ``got`` against ``want``."""
    got = to_numpy(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{label}: expected {want.dtype}{want.shape}, got {got.dtype}{got.shape}"]
    bad = np.flatnonzero(bits(got) != bits(want))
    if bad.size:
        return [f"{label}: {bad.size} of {want.size} elements differ, first at flat index "
                f"{bad[0]} (got bits {bits(got).flat[bad[0]]:#x}, "
                f"expected {bits(want).flat[bad[0]]:#x})"]
    return []


# -- Hypothesis strategies ------------------------------------------------------


def dim0(world: int, max_rows: int) -> st.SearchStrategy[int]:
    """d0 values biased to the edge cases: 0, 1, < world, multiples of world, ragged."""
    return st.one_of(
        st.integers(0, max(world - 1, 0)),
        st.integers(0, max_rows // max(world, 1)).map(lambda k: k * world),
        st.integers(0, max_rows),
    )


def shapes(world: int, max_count: int = 12, max_rows: Optional[int] = None,
           max_inner: int = 5, min_count: int = 0) -> st.SearchStrategy[list]:
    """Parameter shape lists: 1-D to 3-D, d0 around ``world``, inner dims 1..max_inner."""
    max_rows = max_rows if max_rows is not None else 4 * world + 5
    shape = st.tuples(dim0(world, max_rows),
                      st.lists(st.integers(1, max_inner), max_size=2)).map(
        lambda t: (t[0], *t[1]))
    return st.lists(shape, min_size=min_count, max_size=max_count)


seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from(DTYPES)


def recording_executor(make: Any, names: Sequence[str]) -> tuple[list, Any]:
    """``(log, executor)``: ``executor(stream)`` calls ``make`` (a backend's ``executor``)
    and makes each primitive in ``names`` append ``(name, lane, args)`` to ``log`` before
    it runs, so a test or probe reads the order in which lanes were given work."""
    log: list = []

    def recording(name: str, real: Any) -> Any:
        def recorded(lane: int, *args: Any, **kw: Any) -> Any:
            log.append((name, lane, args))
            return real(lane, *args, **kw)
        return recorded

    def executor(stream: Any = None) -> Any:
        ex = make(stream)
        for name in names:
            setattr(ex, name, recording(name, getattr(ex, name)))
        return ex

    return log, executor


def skip_in_debug(group: Any) -> None:
    """Skip a test that captures a stream: debug mode refuses collectives inside a
    capture (its stamps are checked on the host), which its own tests check."""
    if group.config.debug:
        pytest.skip("debug mode refuses collectives inside a stream capture")
