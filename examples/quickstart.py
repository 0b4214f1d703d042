"""Quickstart: gather one sharded transformer layer, then reduce-scatter its gradients.

Run on any number of ranks, on the default backend (cuda where every rank has a
GPU and CuPy, host otherwise)::

    mpiexec -n 2 python examples/quickstart.py
    TIDE_LOCAL_SIZE=1 mpiexec -n 4 python examples/quickstart.py   # 4 emulated nodes

What it does, on every rank:

1. builds the full bf16 weights of a scaled-down Llama-style layer (the same
   on every rank, from a fixed seed) and keeps only this rank's FSDP2 shards;
2. all-gathers the shards into a slot of a :class:`tidearray.SlotArena` and
   checks the gathered parameters bit for bit against the full weights;
3. makes per-rank bf16 "gradients", reduce-scatters them (``op="avg"``) into
   fp32 shards and checks them against an fp64 reference;
4. prints a summary on rank 0.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import tidearray as ta
from tidearray.layout import shard_spec, unit_nbytes


def layer_shapes(hidden: int = 256, heads: int = 8, kv_heads: int = 2,
                 ffn: int = 688) -> dict[str, tuple[int, ...]]:
    """One Llama-style decoder layer, scaled down (grouped-query attention, SwiGLU)."""
    head = hidden // heads
    return {
        "attn_norm": (hidden,),
        "q_proj": (heads * head, hidden),
        "k_proj": (kv_heads * head, hidden),
        "v_proj": (kv_heads * head, hidden),
        "o_proj": (hidden, heads * head),
        "mlp_norm": (hidden,),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
        # An odd one: 3 rows (fewer than 4 ranks, not divisible by 2) of 5 columns.
        "router": (3, 5),
    }


def random_bf16(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(ta.bfloat16)


def to_host(a) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def gather_and_check(g: ta.Group, shapes: list, full: list) -> bool:
    """All-gather this rank's shards into a slot; True if every parameter is bitwise equal."""
    xp = g.backend.xp
    shards = [ta.shard(xp.asarray(w)) for w in full]  # this rank's padded dim-0 shards
    arena = ta.SlotArena(unit_nbytes(shapes, ta.bfloat16), num_slots=1)
    params = ta.all_gather(shards, shapes, slot=arena[0])  # views into arena[0]
    # Compare bit patterns (uint16), not values: "equal" must mean the same bytes.
    return all(np.array_equal(to_host(p).view(np.uint16), w.view(np.uint16))
               for p, w in zip(params, full))


def reduce_scatter_and_check(g: ta.Group, shapes: list) -> tuple[float, bool]:
    """Reduce-scatter (avg) per-rank bf16 gradients; (max error, within bound) vs fp64.

    The bound is fp32 rounding: W-1 additions and one scaling, each off by at
    most 2**-24 relative, stay within ``2**-23 * sum_r |g_r|`` per element.
    """
    xp = g.backend.xp
    grads = [xp.asarray(random_bf16(s, 1000 * g.rank + i)) for i, s in enumerate(shapes)]
    shards32 = ta.reduce_scatter(grads, op="avg")  # fp32 shards of shape (ceil(d0/W), *rest)
    err, ok = 0.0, True
    for i, s in enumerate(shapes):
        # Every rank's gradient comes from a known seed, so the reference needs no traffic.
        every = [random_bf16(s, 1000 * r + i).astype(np.float64) for r in range(g.size)]
        ref = ta.shard(sum(every) / g.size)
        bound = ta.shard(2.0**-23 * sum(np.abs(e) for e in every))
        got = to_host(shards32[i])
        assert got.dtype == np.float32 and got.shape == ref.shape
        diff = np.abs(got - ref)
        err = max(err, float(diff.max(initial=0.0)))
        ok = ok and bool((diff <= bound).all())
    return err, ok


def traffic(shapes: list, itemsize: int, rank: int, world: int) -> tuple[int, int]:
    """Bytes ``rank`` receives in the all-gather and in the reduce-scatter.

    All-gather: every other rank's rows, once. Reduce-scatter: this rank's own
    rows of every other rank's gradient. Padding rows are never sent.
    """
    ag = rs = 0
    for s in shapes:
        spec = shard_spec(s, itemsize, world)
        own = spec.byte_range(rank)[1]
        ag += spec.nbytes - own
        rs += (world - 1) * own
    return ag, rs


def main() -> None:
    g = ta.init()
    named = layer_shapes()
    shapes = list(named.values())
    full = [random_bf16(s, seed=i) for i, s in enumerate(shapes)]

    gathered_ok = gather_and_check(g, shapes, full)
    err, within = reduce_scatter_and_check(g, shapes)

    comm = MPI.COMM_WORLD
    gathered_ok = comm.allreduce(gathered_ok, op=MPI.LAND)
    within = comm.allreduce(within, op=MPI.LAND)
    err = comm.allreduce(err, op=MPI.MAX)
    if g.rank == 0:
        t, mib = g.topology, 2.0**-20
        ag, rs = traffic(shapes, 2, g.rank, g.size)
        print(f"tidearray {ta.__version__}: backend {g.backend.name}, world {g.size} = "
              f"{t.num_nodes} node(s) x {t.local_size} rank(s)")
        print(f"unit: a Llama-style layer, {len(shapes)} parameters, "
              f"{sum(w.nbytes for w in full) * mib:.2f} MiB bf16, incl. router {named['router']}")
        print(f"all_gather: rank 0 received {ag * mib:.2f} MiB straight into its slot; "
              f"bitwise equal to the full weights on every rank: {gathered_ok}")
        print(f"reduce_scatter(avg): bf16 gradients -> fp32 shards; rank 0 summed "
              f"{rs * mib:.2f} MiB of peers' rows; max |error| vs fp64: {err:.2e}, "
              f"within the fp32 bound 2^-23 * sum_r |g_r|: {within}")
    g.close()
    if not (gathered_ok and within):
        raise SystemExit(f"rank {g.rank}: check failed")
    if g.rank == 0:
        print("OK")


if __name__ == "__main__":
    main()
