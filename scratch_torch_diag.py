"""torch alone: one HF Llama / the test net, forward+backward eager vs captured; grads bitwise?"""
import sys, torch
sys.path.insert(0, ".")
from tests.gpu import test_torch_graph as T
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = torch.device("cuda", 0)

def run(kind, variant):
    net, units, loss_of = T.MODELS[kind](7)
    net = net.to(dev).to(torch.bfloat16)
    x = (torch.randint(0, T.VOCAB, (T.BATCH, 1), device=dev) + torch.arange(T.TOKENS, device=dev)) % T.VOCAB
    def fb():
        for p in net.parameters():
            p.grad = None
        loss = loss_of(net, x, x)
        loss.backward()
        return loss.detach()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            le = fb()
    torch.cuda.current_stream().wait_stream(s)
    ge = {n: p.grad.clone() for n, p in net.named_parameters()}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="relaxed"):
        lc = fb()
    g.replay(); torch.cuda.synchronize()
    bad = [n for n, p in net.named_parameters() if not torch.equal(p.grad, ge[n])]
    print(f"{variant:10s} {kind:6s} loss equal {torch.equal(le, lc)}; grads differ: {len(bad)}/{len(ge)} {bad[:8]}", flush=True)

with sdpa_kernel(SDPBackend.MATH):
    for kind in ("net", "llama"):
        run(kind, "default")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    for kind in ("net", "llama"):
        run(kind, "no-bf16rr")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.backends.cuda.preferred_blas_library("cublas")
    for kind in ("net", "llama"):
        run(kind, "cublas")
