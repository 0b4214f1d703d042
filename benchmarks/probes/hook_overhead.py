"""Where the host time of ``shard_module``'s eager step goes, against the same model with no
wrapper: a host-bound model (many small decoder layers), one rank.

    python benchmarks/probes/hook_overhead.py [--layers 32 --hidden 512 --tokens 512]
        [--impls plain,floor,tide] [--profile floor,tide] [--steps 30]

Prints each impl's median step time (the device synchronized after each step) and the
per-unit overhead over ``plain``; with ``--profile`` a cProfile of that impl's steps
(host functions by own time). On the host backend (no GPU) it runs in fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import tidearray as ta  # noqa: E402
import tidearray.torch as tt  # noqa: E402
from tidearray.fsdp import AdamW  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, h: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm = torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(h)
        self.gate = torch.nn.Linear(h, ffn, bias=False)
        self.up = torch.nn.Linear(h, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)
        self.heads = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        y = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


class Net(torch.nn.Module):
    def __init__(self, layers: int, h: int, vocab: int = 8192) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(Block(h, h * 11 // 4) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(h)
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _time(step: Callable[[], None], steps: int, sync: Callable[[], None]) -> list[float]:
    for _ in range(3):
        step()
    sync()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--impls", default="plain,floor,tide")
    p.add_argument("--profile", default="")
    args = p.parse_args()
    group = ta.init()
    cuda = group.backend.name == "cuda"
    dev = torch.device("cuda", group.backend.device) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.randint(0, 8192, (1, args.tokens), device=dev)
    units = args.layers + 1
    results = {}
    for impl in args.impls.split(","):
        torch.manual_seed(0)
        model = Net(args.layers, args.hidden).to(dev, dtype)
        if impl == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

            def step(model: Any = model, opt: Any = opt) -> None:
                opt.zero_grad(set_to_none=True)
                model(ids).backward()
                opt.step()
        else:
            comm: Any = "tide"
            if impl == "floor":
                from benchmarks.baselines.local import LocalComm
                comm = LocalComm
            sm = tt.shard_module(model, list(model.blocks), group=group, comm=comm,
                                 optimizer=AdamW(lr=1e-4))

            def step(sm: Any = sm) -> None:
                sm(ids).backward()
                sm.step()
        times = _time(step, args.steps, sync)
        results[impl] = statistics.median(times)
        if impl in args.profile.split(","):
            prof = cProfile.Profile()
            prof.enable()
            _time(step, 10, sync)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(f"== profile {impl} (10 steps)\n{s.getvalue()}")
        del step, model
    base = results.get("plain")
    for impl, t in results.items():
        extra = f"  per unit over plain {(t - base) / units * 1e3:.3f} ms" if base else ""
        print(f"{impl:8s} median step {t * 1e3:8.2f} ms{extra}")


if __name__ == "__main__":
    main()
