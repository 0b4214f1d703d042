"""Prefetch: gather unit i+1 while unit i computes; reduce-scatter in a vacated slot.

The FSDP schedule with two slots, on a stack of small MLP units::

    mpiexec -n 2 python examples/async_prefetch.py

* Forward: ``all_gather(..., async_op=True)`` of unit i+1 into the other slot
  is issued *before* unit i computes, and waited only when unit i+1 is needed.
* Backward (reverse order, parameters gathered again, as FSDP does with
  reshard-after-forward): once unit i's "gradients" exist its parameters are
  dead, so its slot becomes the reduce-scatter's staging (Slot-Reuse) and the
  reduce-scatter runs asynchronously while the next unit is gathered.

On the cuda backend, ``Work.wait()`` does not block the host: it orders the
current stream after the collective. On the host backend every collective has
finished when it returns, so the overlap is only in the program's structure.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import tidearray as ta
from tidearray.layout import unit_nbytes

HIDDEN, FFN, UNITS, TOKENS = 128, 344, 4, 8
#: Reduce-scatter chunk. Staging takes at most depth (2) x (local_size - 1) x
#: chunk bytes, so 16 KiB chunks fit in a vacated slot (~180 KiB) with up to 6
#: ranks per node. Real units are MiBs to GiBs, so the default 32 MiB chunk fits.
CHUNK = 16 << 10


def unit_shapes() -> list[tuple[int, ...]]:
    """One MLP unit: a norm weight, an up and a down projection, and a 3-element bias."""
    return [(HIDDEN,), (FFN, HIDDEN), (HIDDEN, FFN), (3,)]


def unit_weights(u: int) -> list[np.ndarray]:
    """Unit ``u``'s full bf16 weights, the same on every rank."""
    rng = np.random.default_rng(u)
    return [(rng.standard_normal(s) / np.sqrt(s[-1])).astype(ta.bfloat16)
            for s in unit_shapes()]


def mlp(xp, x, params):
    """x -> down(relu(up(x * norm))) + bias[0], in fp32."""
    norm, up, down, bias = (p.astype(xp.float32) for p in params)
    h = xp.maximum((x * norm) @ up.T, 0)
    return h @ down.T + bias[0]


def fake_grads(xp, params, rank: int) -> list:
    """bf16 "gradients" of a unit on ``rank``: its parameters times (rank + 1)."""
    return [(p.astype(xp.float32) * (rank + 1)).astype(ta.bfloat16) for p in params]


def forward(g: ta.Group, arena: ta.SlotArena, shards: list, x):
    """Run every unit, gathering the next one while the current one computes."""
    xp, shapes = g.backend.xp, unit_shapes()
    pending = ta.all_gather(shards[0], shapes, slot=arena[0], async_op=True)
    for i in range(UNITS):
        params = pending.wait()  # views into arena[i % 2]
        if i + 1 < UNITS:  # arena[(i+1) % 2] held unit i-1, which is done
            pending = ta.all_gather(shards[i + 1], shapes, slot=arena[(i + 1) % 2],
                                    async_op=True)
        x = mlp(xp, x, params)
    return x


def backward(g: ta.Group, arena: ta.SlotArena, shards: list) -> list:
    """Reverse order: gather, make gradients, reduce-scatter them in the vacated slot."""
    xp, shapes = g.backend.xp, unit_shapes()
    order = list(reversed(range(UNITS)))
    rs_work: list = [None, None]  # the reduce-scatter staging in each slot, if any
    results: dict = {}
    pending = ta.all_gather(shards[order[0]], shapes, slot=arena[0], async_op=True)
    for j in range(UNITS):
        params = pending.wait()
        if j + 1 < UNITS:
            nxt = (j + 1) % 2
            if rs_work[nxt] is not None:  # a slot that staged a reduce-scatter is free
                # once it is waited on the stream that gathers into it (here: current)
                results[order[j - 1]] = rs_work[nxt].wait()
                rs_work[nxt] = None
            pending = ta.all_gather(shards[order[j + 1]], shapes, slot=arena[nxt],
                                    async_op=True)
        grads = fake_grads(xp, params, g.rank)
        # Slot-Reuse: params are dead now, so their slot holds the RS staging.
        rs_work[j % 2] = ta.reduce_scatter(grads, op="avg", staging=arena[j % 2],
                                           async_op=True)
    for j in range(UNITS - 2, UNITS):
        results[order[j]] = rs_work[j % 2].wait()
    return [results[u] for u in range(UNITS)]


def check_grads(g: ta.Group, got: list) -> float:
    """Max |error| of the fp32 gradient shards against an fp64 reference."""
    err = 0.0
    for u, shards32 in enumerate(got):
        for w, s in zip(unit_weights(u), shards32):
            every = [fake_grads(np, [w], r)[0].astype(np.float64) for r in range(g.size)]
            ref = ta.shard(sum(every) / g.size)
            host = s.get() if hasattr(s, "get") else s
            err = max(err, float(np.abs(host - ref).max(initial=0.0)))
    return err


def main() -> None:
    g = ta.init(chunk_nbytes=CHUNK)
    xp = g.backend.xp
    units = [unit_weights(u) for u in range(UNITS)]
    shards = [[ta.shard(xp.asarray(w)) for w in unit] for unit in units]
    slot_nbytes = unit_nbytes(unit_shapes(), ta.bfloat16)
    arena = ta.SlotArena(slot_nbytes, num_slots=2)  # mapped once, here

    x0 = np.random.default_rng(7).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    y = forward(g, arena, shards, xp.asarray(x0))
    ref = x0
    for unit in units:
        ref = mlp(np, ref, unit)
    y_host = y.get() if hasattr(y, "get") else y
    fwd_err = float(np.abs(y_host - ref).max())

    grad_err = check_grads(g, backward(g, arena, shards))
    comm = MPI.COMM_WORLD
    fwd_err = comm.allreduce(fwd_err, op=MPI.MAX)
    grad_err = comm.allreduce(grad_err, op=MPI.MAX)
    ok = fwd_err <= 1e-4 and grad_err <= 2.0**-20 * g.size
    if g.rank == 0:
        print(f"backend {g.backend.name}, world {g.size}: {UNITS} units, 2 slots of "
              f"{slot_nbytes / 2**10:.0f} KiB, prefetch depth 1")
        print(f"forward with async all_gather prefetch: max |y - y_ref| = {fwd_err:.1e}")
        print(f"backward with async reduce_scatter staged in the vacated slot: max |error| "
              f"of fp32 gradient shards vs fp64 = {grad_err:.1e}")
        print("OK" if ok else "FAILED")
    g.close()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
