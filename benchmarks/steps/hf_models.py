"""Hugging Face models at real shapes under ``shard_module`` on the cuda backend.

    mpirun -n 2 python benchmarks/steps/hf_models.py train8b [RECORD.json]
    mpirun -n 4 python benchmarks/steps/hf_models.py meta70b [RECORD.json]

``train8b``: a ``transformers`` Llama-3.1-8B-shaped model with 8 decoder layers (vocab
128256, untied head), built on the meta device and initialised shard by shard by its own
``_init_weights``, bf16 parameters, trained for 20 steps on a repeating set of batches;
prints each step's loss and time and exits 1 unless the loss falls.

``meta70b``: a Llama-3.1-70B-shaped model (hidden 8192, 64 heads, 8 KV heads, FF 28672,
vocab 128256) with 2 layers, built on the meta device and wrapped: each rank's peak host
RSS while wrapping (sampled every 2 ms) and its device memory (NVML, per process) against
the runtime's own per-rank bytes + twice the largest parameter + 1 GiB; then two training
steps. Exits 1 if a bound is exceeded.

Both write a JSON record (with the git commit) when given a path.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
import transformers

import tidearray as ta
import tidearray.torch as tt
from tidearray.fsdp import AdamW

SHAPES = {
    "train8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8),
    "meta70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                    num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8),
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_bytes(g: Any) -> int:
    """This process's memory on its GPU (NVML: every allocator, VMM slots included)."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(g.backend.device)
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            return int(p.usedGpuMemory or 0)
    return 0


def _build(name: str, g: Any, tokens: int) -> tuple:
    cfg = transformers.LlamaConfig(**SHAPES[name], tie_word_embeddings=False,
                                   attn_implementation="sdpa", max_position_embeddings=tokens)
    torch.manual_seed(0)  # every rank draws the same initial values
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, cfg


def _rank_figures(g: Any, sm: Any, grew: int, device_bytes: int, largest: int) -> dict:
    m = sm.sharding.runtime
    own = m.arena.nbytes + 2 * m.optimizer.exp_avg.nbytes + m.comm.nbytes
    bound = own + 2 * largest + (1 << 30)
    return {"rank": g.rank, "runtime_bytes": own, "bound_bytes": bound, "rss_growth": grew,
            "device_bytes": device_bytes, "rss_ok": grew <= bound,
            "device_ok": device_bytes <= bound}


def wrap_measured(name: str, g: Any, tokens: int) -> tuple:
    model, cfg = _build(name, g, tokens)
    largest = max(p.numel() for p in model.parameters()) * 4
    peak, done = [_rss()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            done.wait(0.002)

    before = _rss()
    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        sm = tt.shard_module(model, list(model.model.layers), group=g,
                             param_dtype=torch.bfloat16, optimizer=AdamW(lr=3e-4))
        torch.cuda.synchronize()
    finally:
        done.set()
        sampler.join()
    figures = _rank_figures(g, sm, peak[0] - before, _device_bytes(g), largest)
    figures["wrap_s"] = time.perf_counter() - t0
    figures["parameters"] = sum(math.prod(s) for u in sm.sharding.runtime.shapes for s in u)
    return sm, cfg, figures


def train(sm: Any, g: Any, cfg: Any, tokens: int, steps: int) -> tuple[list, list]:
    device = torch.device("cuda", g.backend.device)
    gen = torch.Generator().manual_seed(g.rank)
    batches = [torch.randint(0, cfg.vocab_size, (1, tokens), generator=gen).to(device)
               for _ in range(2)]
    losses, times = [], []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = batches[s % len(batches)]
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward()
        sm.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(g.comm.allreduce(float(loss.detach())) / g.size)
        if g.rank == 0:
            print(f"step {s:3d}  loss {losses[-1]:.4f}  {1e3 * times[-1]:.1f} ms", flush=True)
    return losses, times


def main() -> None:
    name = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else None
    g = ta.init()
    torch.cuda.set_device(g.backend.device)
    tokens = 2048 if name == "train8b" else 512
    sm, cfg, figures = wrap_measured(name, g, tokens)
    every = g.comm.gather(figures, root=0)
    losses, times = train(sm, g, cfg, tokens, 20 if name == "train8b" else 2)
    peak = torch.cuda.max_memory_allocated()
    ok = all(f["rss_ok"] and f["device_ok"] for f in every) if g.rank == 0 else True
    if name == "train8b":
        ok = ok and losses[-1] < losses[0]
    if g.rank == 0:
        gib = 2 ** 30
        print(f"\n{name}: {figures['parameters'] / 1e9:.2f}B parameters, {g.size} ranks on "
              f"{torch.cuda.get_device_name()}")
        print("rank  runtime GiB  bound GiB  RSS growth GiB  device GiB  wrap s")
        for f in every:
            print(f"{f['rank']:4d}  {f['runtime_bytes'] / gib:11.2f}  {f['bound_bytes'] / gib:9.2f}"
                  f"  {f['rss_growth'] / gib:14.2f}  {f['device_bytes'] / gib:10.2f}"
                  f"  {f['wrap_s']:6.1f}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step "
              f"{1e3 * statistics.median(times[2:] or times):.1f} ms; torch peak allocated "
              f"{peak / gib:.2f} GiB; {'OK' if ok else 'FAILED'}")
        if out:
            from benchmarks.harness.records import git_commit

            with open(out, "w") as f:
                json.dump({"commit": git_commit(), "what": name, "world": g.size,
                           "tokens_per_rank": tokens, "ranks": every, "losses": losses,
                           "step_s": times, "ok": ok}, f, indent=1)
    ok = g.comm.bcast(ok, root=0)
    sm.close()
    g.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
