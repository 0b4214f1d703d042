"""Host time a repeated call spends finding its validated entry (diagnostic).

    mpiexec -n 2 python benchmarks/probes/front_end_probe.py [UNIT]     # default qwen3-30b-a3b

On the default backend (``TIDE_BACKEND`` picks), for one unit of
``benchmarks.harness.workloads``: the median host time of the validation step of a
repeated ``reduce_scatter`` (gradients and ``out=``) and ``all_gather`` on the same
arrays, and, for reference, of resolving the reduce-scatter's arrays one by one (what
a repeat did before it found its entry by the arrays' identity). No transfer is
issued. Prints rank 0's figures.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import tidearray as ta
from tidearray import _all_gather, _reduce_scatter
from tidearray._all_gather import unit_nbytes
from tidearray._shard import shard_shape

if not any(Path(p or ".").resolve() == Path(__file__).resolve().parents[2] for p in sys.path):
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.harness.workloads import units  # noqa: E402


def median_us(fn, comm, reps: int = 200) -> float:
    fn()
    comm.Barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
    g = ta.init()
    xp, W = g.backend.xp, g.size
    unit = next(u for u in units() if u.name == name)
    grads = [xp.zeros(s, ta.bfloat16) for s in unit.shapes]
    outs = [xp.zeros(shard_shape(s, W), "float32") for s in unit.shapes]
    shards = [xp.zeros(shard_shape(s, W), ta.bfloat16) for s in unit.shapes]
    slots = ta.SlotArena(unit_nbytes(unit.shapes, ta.bfloat16), num_slots=2)
    rs = median_us(lambda: _reduce_scatter._validated(g, grads, outs, "avg", slots[1]), g.comm)
    ag = median_us(lambda: _all_gather._validated(g, shards, unit.shapes, slots[0]), g.comm)
    one_by_one = median_us(lambda: _reduce_scatter.resolve(g, grads, outs), g.comm)
    if g.rank == 0:
        print(f"{name} ({len(unit.shapes)} parameters), {g.backend.name} backend, {W} ranks: "
              f"a repeat's validation, reduce_scatter {rs:.0f} us, all_gather {ag:.0f} us; "
              f"resolving the reduce-scatter's {2 * len(grads)} arrays one by one "
              f"{one_by_one:.0f} us (median of 200)")
    g.close()


if __name__ == "__main__":
    main()
