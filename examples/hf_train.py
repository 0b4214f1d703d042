"""Train a Hugging Face ``transformers`` model, unchanged, under ``tidearray.torch.shard_module``.

    mpiexec -n 2 python examples/hf_train.py                 # tiny Llama, CPU or GPU
    mpiexec -n 2 python examples/hf_train.py --lora          # LoRA fine-tuning (peft)
    mpirun -n 2 python examples/hf_train.py --size 8b-8l --tokens 2048 --steps 20

What a real job does, end to end:

* the model is built on the meta device and materialised shard by shard by its own
  ``_init_weights`` (no rank ever holds it whole); its embedding and head are tied;
* units are the decoder layers; the root (embedding, final norm, head) stays gathered
  through each forward and backward, as FSDP2 keeps its root;
* parameter groups: no weight decay on 1-D parameters (norms);
* gradient clipping by the global norm (``model.clip_grad_norm_``);
* a learning-rate schedule by ``transformers``' own ``get_cosine_schedule_with_warmup`` on
  ``model.sharding.optimizer`` (the fused AdamW as a torch optimizer), stepped in torch's
  loop: ``opt.step()``, ``schedule.step()``, ``opt.zero_grad()``;
* an evaluation forward under ``torch.no_grad()`` every few steps;
* at the end a full state dict (the model's own names) is gathered to rank 0 and loaded
  into a plain ``LlamaForCausalLM`` with ``strict=True``, which must give the sharded
  model's evaluation loss.

With ``--lora``, a fine-tune: the base model's weights (seeded here, a checkpoint's in a
real job) are frozen and ``peft`` puts LoRA adapters on ``q_proj`` and ``v_proj``; only the
adapters train. The adapters are saved with ``save_pretrained`` (every rank calls it,
rank 0 writes), and rank 0 merges them in a plain ``PeftModel`` loaded from the full
state dict (the sharded model refuses ``merge_and_unload``: its weights are shards). The
merged model must give the sharded evaluation loss, and the base weights must be unchanged.

Needs the ``hf`` extra (torch, transformers, safetensors, and peft for ``--lora``);
without them it fails, naming the extra. Exits 1 if the loss does not fall or the plain
model's loss differs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
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
    p.add_argument("--lora", action="store_true",
                   help="fine-tune LoRA adapters (peft) on a frozen base model")
    args = p.parse_args()
    try:
        import torch
        import transformers

        if args.lora:
            import peft
    except ImportError as e:
        sys.exit(f"hf_train.py: needs torch, transformers{' and peft' * args.lora} ({e}); "
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
    if args.lora:
        # The base stands in for a pretrained checkpoint; peft freezes it and adds the
        # adapters (lora_B starts at zero, so the model starts as the base).
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.0)
        model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg).to(device), lora)
        layers, extra, made = model.base_model.model.model.layers, {}, "LoRA on a frozen base"
        base = {n: q.detach().clone() for n, q in model.named_parameters()
                if not q.requires_grad}
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        norms = [n for n, q in model.named_parameters() if q.ndim == 1]
        layers, made = model.model.layers, "wrapped from the meta device"
        extra = dict(param_groups=[{"params": norms, "weight_decay": 0.0}])
    t0 = time.perf_counter()
    tt.shard_module(model, list(layers), group=g,  # returns model, sharded
                    param_dtype=torch.bfloat16 if cuda else torch.float32,
                    optimizer=AdamW(lr=args.lr, weight_decay=0.1), **extra)
    log = print if g.rank == 0 else (lambda *a, **k: None)
    # The parameters are empty placeholders now: count them from their full shapes.
    sizes = [(math.prod(s), q.requires_grad) for ss, qs in
             zip(model.sharding.shapes, model.sharding.params) for s, q in zip(ss, qs)]
    log(f"hf_train: Llama {args.size} (tied embedding), {sum(n for n, _ in sizes):,} "
        f"parameters ({sum(n for n, t in sizes if t):,} trained), {g.size} ranks, "
        f"{g.backend.name}, {made} in {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(g.rank)
    batches = [torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=gen).to(device)
               for _ in range(2)]
    held_out = torch.randint(0, cfg.vocab_size, (1, args.tokens),
                             generator=torch.Generator().manual_seed(1234)).to(device)

    def evaluate() -> float:
        with torch.no_grad():
            return float(model(input_ids=held_out, labels=held_out).loss)

    opt = model.sharding.optimizer
    schedule = transformers.get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=max(1, args.steps // 6), num_training_steps=args.steps)
    losses = []
    for step in range(args.steps):
        t = time.perf_counter()
        ids = batches[step % 2]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(g.comm.allreduce(float(loss.detach())) / g.size)
        line = (f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {norm:.3f}  "
                f"{1e3 * (time.perf_counter() - t):.0f} ms")
        if step % 4 == 3:
            line += f"  eval {evaluate():.4f}"
        log(line, flush=True)
    sharded_eval = evaluate()
    if args.lora:  # the adapters alone (every rank gathers, rank 0 writes)
        with tempfile.TemporaryDirectory() as adapters:
            model.save_pretrained(g.comm.bcast(adapters), is_main_process=g.rank == 0)
            saved = g.comm.bcast(sorted(os.listdir(adapters)) if g.rank == 0 else None)
        log(f"adapters saved by save_pretrained: {', '.join(saved)}")
    state = model.state_dict(rank0_only=True)  # collective: gathered to rank 0, on the CPU
    ok = losses[-1] < losses[0]
    if g.rank == 0:
        plain = transformers.LlamaForCausalLM(cfg).to(torch.float32)
        what = "a plain model"
        if args.lora:
            plain = peft.get_peft_model(plain, lora)
            plain.load_state_dict(state, strict=True)
            unchanged = all(torch.equal(state[n], w.cpu().to(state[n].dtype))
                            for n, w in base.items())
            plain, what = plain.merge_and_unload(), "a plain model, the adapters merged,"
            ok = ok and unchanged
            print(f"{len(base)} frozen base weights unchanged: {unchanged}")
        else:
            plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            ids = held_out.cpu()
            plain_eval = float(plain(input_ids=ids, labels=ids).loss)
        same = abs(plain_eval - sharded_eval) <= (2e-2 if cuda else 1e-5) * abs(plain_eval)
        ok = ok and same
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; eval "
              f"{sharded_eval:.4f} sharded, {plain_eval:.4f} in {what} loaded from "
              f"the full state dict ({len(state)} keys); {'OK' if ok else 'FAILED'}")
    ok = g.comm.bcast(ok, root=0)
    model.close()
    g.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
