"""Train a Hugging Face ``transformers`` model, unchanged, under ``tidearray.torch.shard_module``.

    mpiexec -n 2 python examples/hf_train.py                 # tiny Llama, CPU or GPU
    mpirun -n 2 python examples/hf_train.py --size 8b-8l --tokens 2048 --steps 20

What a real job does, end to end:

* the model is built on the meta device and materialised shard by shard by its own
  ``_init_weights`` (no rank ever holds it whole); its embedding and head are tied;
* units are the decoder layers; the root (embedding, final norm, head) stays gathered
  through each forward and backward, as FSDP2 keeps its root;
* parameter groups: no weight decay on 1-D parameters (norms);
* gradient clipping by the global norm (``model.clip_grad_norm_``);
* an evaluation forward under ``torch.no_grad()`` every few steps;
* at the end a full state dict (the model's own names) is gathered to rank 0 and loaded
  into a plain ``LlamaForCausalLM`` with ``strict=True``, which must give the sharded
  model's evaluation loss.

Needs the ``hf`` extra (torch, transformers, safetensors); without them it fails, naming
the extra. Exits 1 if the loss does not fall or the plain model's loss differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import tidearray as ta

SIZES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "8b-8l": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"hf_train.py: needs torch and transformers ({e}); "
                 "pip install 'tidearray[hf]'")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    g = ta.init()
    cuda = g.backend.name == "cuda"
    device = torch.device("cuda", g.backend.device) if cuda else torch.device("cpu")
    cfg = transformers.LlamaConfig(**SIZES[args.size], tie_word_embeddings=True,
                                   max_position_embeddings=max(args.tokens, 128),
                                   attn_implementation="sdpa" if cuda else "eager")
    torch.manual_seed(0)  # every rank draws the same initial values
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    norms = [n for n, q in model.named_parameters() if q.ndim == 1]
    t0 = time.perf_counter()
    tt.shard_module(model, list(model.model.layers), group=g,  # returns model, sharded
                    param_dtype=torch.bfloat16 if cuda else torch.float32,
                    optimizer=AdamW(lr=args.lr, weight_decay=0.1),
                    param_groups=[{"params": norms, "weight_decay": 0.0}])
    log = print if g.rank == 0 else (lambda *a, **k: None)
    log(f"hf_train: Llama {args.size} (tied embedding), {g.size} ranks, {g.backend.name}, "
        f"wrapped from the meta device in {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(g.rank)
    batches = [torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=gen).to(device)
               for _ in range(2)]
    held_out = torch.randint(0, cfg.vocab_size, (1, args.tokens),
                             generator=torch.Generator().manual_seed(1234)).to(device)

    def evaluate() -> float:
        with torch.no_grad():
            return float(model(input_ids=held_out, labels=held_out).loss)

    losses = []
    for step in range(args.steps):
        t = time.perf_counter()
        ids = batches[step % 2]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = model.clip_grad_norm_(1.0)
        model.step()
        losses.append(g.comm.allreduce(float(loss.detach())) / g.size)
        line = (f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {norm:.3f}  "
                f"{1e3 * (time.perf_counter() - t):.0f} ms")
        if step % 4 == 3:
            line += f"  eval {evaluate():.4f}"
        log(line, flush=True)
    sharded_eval = evaluate()
    state = model.state_dict(rank0_only=True)  # collective: gathered to rank 0, on the CPU
    ok = losses[-1] < losses[0]
    if g.rank == 0:
        plain = transformers.LlamaForCausalLM(cfg).to(torch.float32)
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            ids = held_out.cpu()
            plain_eval = float(plain(input_ids=ids, labels=ids).loss)
        same = abs(plain_eval - sharded_eval) <= (2e-2 if cuda else 1e-5) * abs(plain_eval)
        ok = ok and same
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; eval "
              f"{sharded_eval:.4f} sharded, {plain_eval:.4f} in a plain model loaded from "
              f"the full state dict ({len(state)} keys); {'OK' if ok else 'FAILED'}")
    ok = g.comm.bcast(ok, root=0)
    model.close()
    g.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
