"""Train a small PyTorch network with ``tidearray.torch.shard_module``.

    mpiexec -n 2 python examples/torch_train.py
    mpiexec -n 2 python examples/torch_train.py --graph   # cuda: the step as a CUDA graph
    mpiexec -n 2 python examples/torch_train.py --graph --clip 0.5  # the clip captured too
    mpiexec -n 2 python examples/torch_train.py --micro-batches 2   # gradient accumulation

Each rank's module is sharded by units (here: the three layers). The forward and
backward run as plain PyTorch; tidearray's hooks gather each unit just before it
runs, reduce its gradients as soon as they are in, and step a fused AdamW on the
fp32 shards. On the host backend the tensors are CPU tensors (fp32); on the cuda
backend, CUDA tensors (bf16 parameters, fp32 masters). Needs the ``torch`` extra;
without torch it fails, naming the extra.

``--graph`` (cuda) steps once eagerly, then captures the whole step (forward,
backward, reductions, AdamW) with ``torch.cuda.graph`` through
``model.capture_step`` and replays it, with a learning rate that changes on
every replay; it runs the eager steps beside it on a second copy of the network and
checks that the losses are bitwise equal. ``--clip`` clips by the global norm
(``model.clip_grad_norm_``), eagerly and inside the captured step.
``--micro-batches K`` splits each rank's batch in K and runs K forward/backward
passes per step, each loss divided by K as in a torch loop: the backwards add up,
as torch's ``.grad`` does, to the gradient of the whole batch's loss.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import tidearray as ta

STEPS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", action="store_true",
                    help="capture the step as a CUDA graph and replay it (cuda backend)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                    help="clip the gradient to this global norm (model.clip_grad_norm_), inside "
                         "the captured step too")
    ap.add_argument("--micro-batches", type=int, default=1, metavar="K",
                    help="forward/backward passes per step, each on 1/K of the batch")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        sys.exit(f"torch_train.py: needs torch ({e}); pip install 'tidearray[torch]'")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    g = ta.init()
    cuda = g.backend.name == "cuda"
    if args.graph and not cuda:
        sys.exit("torch_train.py --graph: expected the cuda backend (a CUDA graph), got "
                 f"{g.backend.name}")
    device = torch.device("cuda", g.backend.device) if cuda else torch.device("cpu")
    rng = np.random.default_rng(g.rank)
    x = torch.from_numpy(rng.standard_normal((512, 64)).astype(np.float32)).to(device)
    x_in = x.to(torch.bfloat16) if cuda else x
    y = torch.sin(x[:, :8] * 3)

    def shard() -> torch.nn.Sequential:
        torch.manual_seed(0)
        units = [torch.nn.Linear(64, 256),
                 torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(256, 256)),
                 torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(256, 8))]
        model = torch.nn.Sequential(*units).to(device)
        # The model itself comes back, sharded: still a torch.nn.Sequential.
        return tt.shard_module(model, units, optimizer=AdamW(lr=3e-3),
                               param_dtype=torch.bfloat16 if cuda else torch.float32)

    def lr(step: int) -> float:  # a warm-up: the rate changes every step
        return 3e-3 * min(1.0, (step + 1) / 10)

    def whole_step(model: torch.nn.Sequential, rate: float) -> torch.Tensor:
        k = args.micro_batches
        loss = torch.zeros((), device=device)
        for xb, yb in zip(x_in.chunk(k), y.chunk(k)):
            part = torch.nn.functional.mse_loss(model(xb).float(), yb) / k
            part.backward()  # the micro-batches' gradients add up, as torch's .grad
            loss += part.detach()
        if args.clip is not None:
            model.clip_grad_norm_(args.clip)  # a float eagerly, a device tensor in the capture
        model.step(rate)
        return loss

    model = shard()
    eager = shard() if args.graph else None  # the same network, stepped eagerly beside it
    captured = None
    first = last = None
    mismatches = 0
    for step in range(STEPS):
        t0 = time.perf_counter()
        if captured is not None:
            loss = captured(lr=lr(step))
        else:
            loss = whole_step(model, lr(step))
            if args.graph:  # after one eager step: capture the whole step once
                captured = model.capture_step(lambda: whole_step(model, lr(0)))
        value = float(loss)  # (reading the loss syncs the host: the example prints it)
        ms = 1e3 * (time.perf_counter() - t0)
        if eager is not None:
            mismatches += float(whole_step(eager, lr(step))) != value
        value = g.comm.allreduce(value) / g.size
        first = value if first is None else first
        last = value
        if g.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {value:.5f}  {ms:.1f} ms", flush=True)
    mismatches = g.comm.allreduce(mismatches)
    if g.rank == 0:
        how = "captured step replayed" if args.graph else "eager steps"
        print(f"loss {first:.4f} -> {last:.4f} over {STEPS} steps on {g.size} ranks "
              f"({g.backend.name}, {how})")
        if args.graph:
            print(f"captured against eager: {mismatches} of {STEPS * g.size} losses differ")
    ok = last < first and mismatches == 0
    if captured is not None:
        captured.close()
    g.close()
    if not ok:
        sys.exit("the loss did not go down" if last >= first else
                 "the captured step's losses differ from the eager step's")


if __name__ == "__main__":
    main()
