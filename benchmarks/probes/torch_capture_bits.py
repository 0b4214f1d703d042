"""Does torch itself give a model the same gradient bits captured as eagerly? No tidearray.

    python benchmarks/probes/torch_capture_bits.py

One GPU, one process. For a small torch network and a Hugging Face Llama (SDPA on its
math kernels, grouped-query attention), each in bf16: forward and backward eagerly
(after warm-up on a side stream, as torch's CUDA-graph notes ask), then the same
forward and backward captured with ``torch.cuda.graph`` and replayed once on the same
weights and batch. Prints whether the losses are equal and which parameters' gradients
differ bit for bit, under the default settings, with bf16 reduced-precision reductions
off, and with the cuBLAS (not cuBLASLt) back end. tidearray's captured torch step
(``model.capture_step``) can only be as bitwise as this.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB, WIDTH, BATCH, TOKENS = 128, 64, 4, 32


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.up = torch.nn.ModuleList(torch.nn.Linear(WIDTH, 4 * WIDTH) for _ in range(3))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * WIDTH, WIDTH) for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Any, y: Any) -> Any:
        h = self.embed(x)
        for up, down in zip(self.up, self.down):
            h = h + down(torch.nn.functional.gelu(up(h)))
        return torch.nn.functional.cross_entropy(self.head(h).float().flatten(0, 1),
                                                 y.flatten())


def _llama() -> tuple[Any, Callable]:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa",
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg), lambda m, x, y: m(input_ids=x, labels=y).loss


def _run(name: str, make: Callable[[], tuple[Any, Callable]], setting: str) -> None:
    dev = torch.device("cuda", 0)
    torch.manual_seed(7)
    net, loss_of = make()
    net = net.to(dev).to(torch.bfloat16)
    x = (torch.randint(0, VOCAB, (BATCH, 1), device=dev)
         + torch.arange(TOKENS, device=dev)) % VOCAB

    def forward_backward() -> Any:
        for p in net.parameters():
            p.grad = None
        loss = loss_of(net, x, x)
        loss.backward()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = forward_backward()
    torch.cuda.current_stream().wait_stream(side)
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        captured = forward_backward()
    graph.replay()
    torch.cuda.synchronize()
    differ = [n for n, p in net.named_parameters() if not torch.equal(p.grad, grads[n])]
    print(f"{setting:22s} {name:6s} loss equal: {torch.equal(eager, captured)}; gradients "
          f"differ: {len(differ)} of {len(grads)} {differ[:6]}", flush=True)


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    models = {"net": lambda: (_Net(), lambda m, x, y: m(x, y)), "llama": _llama}
    settings: list[tuple[str, Callable[[], None]]] = [
        ("default", lambda: None),
        ("no bf16 reduced prec.", lambda: setattr(
            torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)),
        ("cuBLAS back end", lambda: torch.backends.cuda.preferred_blas_library("cublas")),
    ]
    with sdpa_kernel(SDPBackend.MATH):
        for setting, apply in settings:
            apply()
            for name, make in models.items():
                _run(name, make, setting)


if __name__ == "__main__":
    main()
