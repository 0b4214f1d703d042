"""Train a small PyTorch network with ``tidearray.torch.shard_module``.

    mpiexec -n 2 python examples/torch_train.py

Each rank's module is sharded by units (here: the three layers). The forward and
backward run as plain PyTorch; tidearray's hooks gather each unit just before it
runs, reduce its gradients as soon as they are in, and step a fused AdamW on the
fp32 shards. On the host backend the tensors are CPU tensors (fp32); on the cuda
backend, CUDA tensors (bf16 parameters, fp32 masters). Needs the ``torch`` extra;
without torch it fails, naming the extra.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import tidearray as ta


def main() -> None:
    try:
        import torch
    except ImportError as e:
        sys.exit(f"torch_train.py: needs torch ({e}); pip install 'tidearray[torch]'")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    g = ta.init()
    cuda = g.backend.name == "cuda"
    device = torch.device("cuda", g.backend.device) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    units = [torch.nn.Linear(64, 256),
             torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(256, 256)),
             torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(256, 8))]
    model = torch.nn.Sequential(*units).to(device)
    sm = tt.shard_module(model, units, optimizer=AdamW(lr=3e-3),
                         param_dtype=torch.bfloat16 if cuda else torch.float32)
    rng = np.random.default_rng(g.rank)
    x = torch.from_numpy(rng.standard_normal((512, 64)).astype(np.float32)).to(device)
    y = torch.sin(x[:, :8] * 3)
    first = last = None
    for step in range(30):
        t0 = time.perf_counter()
        out = sm(x.to(torch.bfloat16) if cuda else x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        sm.step()
        value = g.comm.allreduce(float(loss.detach())) / g.size
        first = value if first is None else first
        last = value
        if g.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {value:.5f}  {1e3 * (time.perf_counter() - t0):.1f} ms",
                  flush=True)
    if g.rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over 30 steps on {g.size} ranks "
              f"({g.backend.name})")
    ok = last < first
    g.close()
    if not ok:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()
