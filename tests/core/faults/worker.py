"""A loop of collectives in which rank 1 misbehaves once; run by tests/core/test_faults.py.

Usage: ``mpiexec -n N python tests/core/faults/worker.py FAULT TOKEN`` with FAULT one of
``exit`` (rank 1 ``os._exit``), ``raise`` (rank 1 raises between collectives),
``stop`` (rank 1 stops itself with SIGSTOP), ``order`` (rank 1 calls two plans in the
other order; run with ``TIDE_DEBUG=1``). TOKEN only marks the processes, so the test
can check that none is left. Every survivor prints one line, ``rank R: <Error> after
S s: ...`` or ``rank R: done``; on a tidearray error it aborts the job.
``TIDE_FAULT_BACKEND`` picks the backend (``host`` by default, or ``cuda``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import numpy as np

import tidearray as ta

FAULT_STEP = 5


def misbehave(fault: str, rank: int) -> None:
    if rank != 1:
        return
    if fault == "exit":
        os._exit(3)
    if fault == "raise":
        raise RuntimeError("injected between collectives")
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def _host(xp, a):
    return a if xp is np else xp.asnumpy(a)


def _synchronize(xp) -> None:
    """Wait for the current stream, the GIL released (the watchdog is a Python thread)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def main() -> int:
    fault = sys.argv[1]
    # A hang is a failure to report, not to wait out: print every thread's stack and exit.
    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_TIMEOUT", "5")) + 25,
                                      exit=True)
    g = ta.init(backend=os.environ.get("TIDE_FAULT_BACKEND", "host"))
    xp = g.backend.xp
    print(f"rank {g.rank}: started", flush=True)
    units = [ta.Unit([(4 * g.size + 1, 8), (3,)], ta.float32),
             ta.Unit([(2 * g.size, 5)], ta.float32)]
    arena = ta.SlotArena(max(max(u.nbytes, u.staging_nbytes) for u in units), 2)
    rng = np.random.default_rng(7)
    fulls = [[rng.standard_normal(s).astype(np.float32) for s in u.shapes] for u in units]
    plans = [u.gather_plan([xp.asarray(ta.shard(f)) for f in full], arena[0])
             for u, full in zip(units, fulls)]
    ones = [xp.ones(s, np.float32) for s in units[0].shapes]
    t_fault = time.monotonic()
    try:
        for step in range(3 * FAULT_STEP):
            if step == FAULT_STEP:
                t_fault = time.monotonic()
                misbehave(fault, g.rank)
            order = [1, 0] if fault == "order" and step == FAULT_STEP and g.rank == 1 else [0, 1]
            for i in order:
                got = plans[i]()
                # On cuda a call returns at once; a peer's silence shows after the
                # host has waited for the device: check before trusting the data.
                _synchronize(xp)
                g.check()
                got = [_host(xp, a) for a in got]
                if not all(np.array_equal(a, b) for a, b in zip(got, fulls[i])):
                    print(f"rank {g.rank}: WRONG DATA at step {step}", flush=True)
                    return 4
            ta.reduce_scatter(ones, staging=arena[1])
    except ta.TideError as e:
        print(f"rank {g.rank}: {type(e).__name__} after {time.monotonic() - t_fault:.1f} s: "
              f"{e}", flush=True)
        # A peer may never reach MPI_Finalize: abort the job, as ``python -m mpi4py`` does
        # for an unhandled exception, instead of waiting for it at exit.
        # The pause lets the other survivors report too before the abort ends the job: each
        # times out a timeout after its own wait began, which under load can be seconds
        # after this one's (a pause of 2 s was once too short).
        from mpi4py import MPI

        time.sleep(max(2.0, float(os.environ.get("TIDE_TIMEOUT", "5"))))
        MPI.COMM_WORLD.Abort(2)
    print(f"rank {g.rank}: done", flush=True)
    g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
