"""Does a GEMM read its weight slower from a slot? (diagnostic)

    mpirun -n 2 python benchmarks/probes/gemm_memory.py

The training step's GEMMs read their weights from wherever the front end put them:
FSDP2 from torch's allocator, ``shard_module`` from a slot (symmetric memory, VMM
and mapped by every peer), the floor from CuPy's pool. This times the same bf16
``(tokens, k) @ (k, n).T`` products of the Llama-3.1-8B block (torch, so cuBLAS picks
the kernels it picks in training) with the weight in each of the three, in
interleaved rounds, and prints the median per GEMM and memory on each rank. Nothing
else runs on the GPU meanwhile.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.getcwd())
import tidearray as ta  # noqa: E402

TOKENS, H, FF, KV = 8192, 4096, 14336, 1024
SHAPES = {"wq": (H, H), "wk": (KV, H), "w_gate": (FF, H), "w_down": (H, FF)}
ROUNDS, ITERS = 5, 10

comm = MPI.COMM_WORLD
g = ta.init()
cp = g.backend.xp
dev = torch.device("cuda", g.backend.device)
torch.cuda.set_device(dev)
nbytes = sum(int(np.prod(s)) * 2 for s in SHAPES.values())
arena = ta.SlotArena(nbytes, num_slots=1)
slot = arena[0]
pool = cp.empty(nbytes, np.uint8)


def weights(where: str) -> dict:
    """The weights, bf16, in ``where``'s memory, with the same values everywhere."""
    out, off = {}, 0
    for name, shape in SHAPES.items():
        n = int(np.prod(shape)) * 2
        if where == "torch":
            w = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        else:
            raw = slot.view(off, (n,), np.uint8) if where == "slot" else pool[off:off + n]
            w = torch.from_dlpack(raw).view(torch.bfloat16).view(shape)
        gen = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
        w.copy_(torch.randn(shape, device=dev, generator=gen).to(torch.bfloat16) * 0.02)
        out[name], off = w, off + n
    return out


x = {k: torch.randn(TOKENS, s[1], device=dev, dtype=torch.bfloat16) for k, s in SHAPES.items()}
mems = {where: weights(where) for where in ("torch", "cupy", "slot")}
torch.cuda.synchronize()
times: dict = {(w, n): [] for w in mems for n in SHAPES}
for _ in range(ROUNDS):
    for where, ws in mems.items():
        for name, w in ws.items():
            for _ in range(2):  # warm
                x[name] @ w.T
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ITERS):
                x[name] @ w.T
            end.record()
            end.synchronize()
            times[where, name].append(start.elapsed_time(end) * 1e3 / ITERS)
rows = comm.gather({k: float(np.median(v)) for k, v in times.items()})
if g.rank == 0:
    from benchmarks.harness.records import git_commit

    print(f"# commit {git_commit()}, {torch.cuda.get_device_name(dev)}: "
          f"mpirun -n {g.size} python benchmarks/probes/gemm_memory.py")
    print(f"median us per GEMM ({ROUNDS} rounds x {ITERS}); weight in torch / cupy / slot memory")
    for r, row in enumerate(rows):
        for name, shape in SHAPES.items():
            t = [row[w, name] for w in mems]
            print(f"rank {r} {name:7s} {TOKENS}x{shape[1]}x{shape[0]}: " + " / ".join(
                f"{v:8.1f}" for v in t) + f"   slot/torch {t[2] / t[0]:.3f}")
g.close()
