"""A Llama-style decoder with a hand-written backward, split into FSDP units.

The FSDP runtime gathers one unit's parameters, runs that unit, and frees them; for
the backward it gathers them again. So the model is a list of per-unit
``forward``/``backward`` functions that take the unit's parameters as arguments:

* unit 0: the token embedding;
* units 1..layers: pre-norm decoder layers (RMSNorm, grouped-query attention with
  RoPE and a causal mask, RMSNorm, SwiGLU MLP);
* the last unit: final RMSNorm, an untied LM head and the mean token cross-entropy.

[Note: saved state and parameter lifetimes]
Gathered parameters are views into a slot that the next gather overwrites. What a
forward saves for its backward therefore never refers to a parameter array: it
holds activations only, and the backward recomputes anything that needs a weight
(the normalized inputs, for instance) from the parameters it is handed.

[Note: precision]
Activations, matmuls and gradients use the parameters' dtype (float32, float64 or
bfloat16; cuBLAS accumulates bf16 matmuls in fp32). RMSNorm statistics, RoPE,
softmax, SiLU and the loss run in a compute dtype, float32 (float64 for float64
parameters), and are cast back once.

Array-module generic: ``Llama(cfg, xp=numpy)`` runs on the CPU, ``xp=cupy`` on a GPU,
with the same code. Everything goes through ``xp`` except the embedding's
scatter-add (:func:`_scatter_add`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

#: A NumPy or CuPy array (the module is generic over the two).
Array = Any

#: Probability that a synthetic token follows the fixed successor rule (see :func:`batch`).
FOLLOW = 0.9


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder.

    Linear weights are ``(out, in)`` as in torch (``y = x @ W.T``); the head
    dimension is ``hidden // heads``.
    """

    vocab: int
    """Vocabulary size (rows of the embedding and of the LM head)."""
    hidden: int
    """Model width H."""
    layers: int
    """Number of decoder layers (one FSDP unit each)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads; each serves ``heads // kv_heads`` query heads."""
    ffn: int
    """SwiGLU inner width F."""
    seq: int
    """Tokens per sequence; a batch is ``(batch, seq)`` token ids."""
    rope_theta: float = 500000.0
    """RoPE base; default 500000.0 (Llama 3)."""
    eps: float = 1e-5
    """RMSNorm epsilon; default 1e-5."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"expected heads | hidden and kv_heads | heads, got hidden="
                             f"{self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"expected an even head_dim for RoPE, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=16),
    "small": ModelConfig(vocab=256, hidden=128, layers=4, heads=8, kv_heads=2, ffn=384, seq=64),
    "llama3-8b-8l": ModelConfig(vocab=32000, hidden=4096, layers=8, heads=32, kv_heads=8,
                                ffn=14336, seq=2048),
    # Many small layers: a step is bound by the host (Python and kernel launches), so its
    # time per unit is the wrapper's overhead. 4 sequences (the default) = 512 tokens.
    "small-32l": ModelConfig(vocab=8192, hidden=512, layers=32, heads=8, kv_heads=4, ffn=1408,
                             seq=128),
}

_LAYER_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def unit_specs(cfg: ModelConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Names and shapes of every unit's parameters, in unit order.

    Args:
        cfg: The model shape.

    Returns:
        ``layers + 2`` lists of ``(name, shape)``: the embedding, one per layer, and
        the head (final norm and untied LM head).
    """
    h, f, q, kv = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = [(h,), (q, h), (kv, h), (kv, h), (h, q), (h,), (f, h), (f, h), (h, f)]
    layer = list(zip(_LAYER_NAMES, shapes))
    return ([[("embed", (cfg.vocab, h))]] + [list(layer) for _ in range(cfg.layers)]
            + [[("final_norm", (h,)), ("lm_head", (cfg.vocab, h))]])


def init_params(cfg: ModelConfig, seed: int = 0) -> list[list[np.ndarray]]:
    """Deterministic float32 initial parameters, the same on every process.

    Norm weights are 1; other weights are N(0, 0.02), with ``wo`` and ``w_down``
    scaled by ``1/sqrt(2 * layers)`` so the residual stream does not grow with depth.
    Draws go unit by unit, parameter by parameter, from one ``default_rng(seed)``.

    Args:
        cfg: The model shape.
        seed: Seed of the generator.

    Returns:
        One list of NumPy arrays per unit, matching :func:`unit_specs`.
    """
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.layers)
    units = []
    for spec in unit_specs(cfg):
        arrays = []
        for name, shape in spec:
            if name.endswith("norm"):
                arrays.append(np.ones(shape, np.float32))
                continue
            std = 0.02 * (out_scale if name in ("wo", "w_down") else 1.0)
            arrays.append(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        units.append(arrays)
    return units


def batch(cfg: ModelConfig, *, step: int, batch_size: int, first_sample: int,
          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic sequences with learnable structure: ``(tokens, targets)``.

    A fixed random permutation ``perm`` of the vocabulary (from ``seed``) gives each
    token a successor; every next token is ``perm[current]`` with probability
    :data:`FOLLOW` and uniform otherwise. Sample ``first_sample + j`` of a step is a
    pure function of ``(seed, step, first_sample + j)``, so data-parallel rank ``r``
    taking ``first_sample = r * B`` sees exactly its slice of a ``W * B`` batch.

    Args:
        cfg: The model shape (``vocab`` and ``seq`` are used).
        step: Training step, >= 0.
        batch_size: Sequences to return, >= 1.
        first_sample: Global index of the first sequence, >= 0.
        seed: Data seed, >= 0.

    Returns:
        ``tokens`` and ``targets``, int32 NumPy arrays of shape ``(batch_size, seq)``;
        ``targets`` is ``tokens`` shifted left by one.

    Raises:
        ValueError: If an argument is out of range.
    """
    if min(step, first_sample, seed) < 0 or batch_size < 1:
        raise ValueError(f"expected step, first_sample, seed >= 0 and batch_size >= 1, got "
                         f"{step}, {first_sample}, {seed} and {batch_size}")
    perm = np.random.default_rng(seed).permutation(cfg.vocab).tolist()
    rows = np.empty((batch_size, cfg.seq + 1), np.int32)
    for j in range(batch_size):
        rng = np.random.default_rng([seed, step, first_sample + j])
        rows[j] = _markov_chain(rng, perm, cfg.seq + 1)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def _markov_chain(rng: np.random.Generator, perm: list[int], n: int) -> list[int]:
    follow = (rng.random(n) < FOLLOW).tolist()
    out = rng.integers(0, len(perm), n).tolist()
    for i in range(1, n):
        if follow[i]:
            out[i] = perm[out[i - 1]]
    return out


def optimal_loss(cfg: ModelConfig) -> float:
    """Entropy (nats) of the next synthetic token given the current one: the loss floor."""
    v, hit = cfg.vocab, FOLLOW + (1.0 - FOLLOW) / cfg.vocab
    miss = (1.0 - FOLLOW) / v
    return -hit * math.log(hit) - (v - 1) * miss * math.log(miss)


# ---------------------------------------------------------------- array helpers


def _compute_dtype(dtype: Any) -> np.dtype:
    """float64 for float64 parameters, float32 otherwise (see [Note: precision])."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _scatter_add(xp: Any, out: Array, index: Array, values: Array) -> None:
    """``out[index] += values`` with repeated indices accumulated (NumPy or CuPy)."""
    if xp is np:
        np.add.at(out, index, values)
    elif isinstance(xp, Capturable):
        xp.scatter_add_rows(out, index, values)
    else:
        import cupyx  # only reached with xp = cupy

        cupyx.scatter_add(out, index, values)


_SCATTER_ROWS = r"""
extern "C" __global__ void scatter_add_rows(float* out, const int* index, const float* values,
                                            long long n, long long d) {
    // One thread per column, over every row in order: a fixed order of additions.
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    for (long long p = 0; p < n; ++p) out[index[p] * d + j] += values[p * d + j];
}
"""


def _cublas_library() -> Any:
    """The libcublas CuPy loaded (its cuBLAS module links it), opened by ctypes: CuPy's own
    wrappers set the handle's stream at every call, which a capture refuses."""
    import ctypes

    from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads libcublas

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublas.so" in line}
    path = next((p for p in sorted(paths) if "libcublasLt" not in p), None)
    if path is None:
        raise RuntimeError("libcublas: not loaded by CuPy")
    return ctypes.CDLL(path)


def _checked(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed: cublasStatus_t {status}")


class Capturable:
    """CuPy, with the model's two calls that a stream capture refuses or that vary from run
    to run replaced, for a step captured as a CUDA graph and replayed bitwise as it ran
    eagerly (``train.py --graph``):

    * ``matmul``: CuPy sets its cuBLAS handle's stream at every call and refuses to while
      capturing, though cuBLAS itself captures; here a handle of our own is bound to
      ``stream`` once, before any capture, with a workspace of its own (so cuBLAS picks
      the same kernels eagerly and captured);
    * the embedding gradient's scatter-add: one thread per column adds the rows in
      order, instead of atomics whose order varies.

    Everything else is CuPy's (``getattr``). Use the same object for the eager steps that
    the captured ones are compared with.
    """

    WORKSPACE = 32 << 20

    def __init__(self, stream: Any) -> None:
        import ctypes

        import cupy

        self._cupy = cupy
        lib = self._lib = _cublas_library()
        handle = ctypes.c_void_p()
        _checked(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        _checked(lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        self.workspace = cupy.empty(self.WORKSPACE, np.uint8)
        _checked(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(self.workspace.data.ptr),
                                           ctypes.c_size_t(self.WORKSPACE)), "cublasSetWorkspace")
        self._one, self._zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        self._gemm = lib.cublasGemmEx
        p, i = ctypes.c_void_p, ctypes.c_int
        # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
        # Ctype, ldc, computeType, algo
        self._gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self._scatter = cupy.RawKernel(_SCATTER_ROWS, "scatter_add_rows")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cupy, name)

    def matmul(self, a: Array, b: Array, out: Optional[Array] = None) -> Array:
        if a.ndim == 3:
            if out is None:
                out = self._cupy.empty((a.shape[0], a.shape[1], b.shape[2]), a.dtype)
            for i in range(a.shape[0]):
                self.matmul(a[i], b[i], out=out[i])
            return out
        m, k = a.shape
        n = b.shape[1]
        if out is None:
            out = self._cupy.empty((m, n), a.dtype)
        cuda_type = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}.get(a.dtype, 14)  # bf16
        # Row-major C = A @ B is column-major C^T = B^T A^T: each operand is read as it
        # lies (C-order: as is; F-order, a transpose's view: transposed by cuBLAS).
        ops = []
        for x, rows in ((b, n), (a, k)):
            if not (x.flags.c_contiguous or x.flags.f_contiguous):
                x = self._cupy.ascontiguousarray(x)
            ops.append((x, 0 if x.flags.c_contiguous else 1,
                        rows if x.flags.c_contiguous else x.shape[0]))
        (bb, tb, ldb), (aa, ta, lda) = ops
        _checked(self._gemm(self.handle, tb, ta, n, m, k, self._one.ctypes.data,
                            bb.data.ptr, cuda_type, ldb, aa.data.ptr, cuda_type, lda,
                            self._zero.ctypes.data, out.data.ptr, cuda_type, n,
                            68, -1), "cublasGemmEx")  # CUBLAS_COMPUTE_32F, GEMM_DEFAULT
        return out

    def scatter_add_rows(self, out: Array, index: Array, values: Array) -> None:
        if out.dtype != np.float32:
            raise TypeError(f"scatter_add_rows: expected a float32 output, got {out.dtype}")
        n, d = values.shape[0], out.shape[1]
        index = self._cupy.ascontiguousarray(index.reshape(-1), dtype=np.int32)
        values = self._cupy.ascontiguousarray(values.reshape(n, d), dtype=np.float32)
        self._scatter(((d + 255) // 256,), (256,), (out, index, values, np.int64(n),
                                                    np.int64(d)))


_BATCHED = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _mm(xp: Any, a: Array, b: Array) -> Array:
    """``a @ b`` in a's dtype (ml_dtypes' bf16 matmul returns float32 on NumPy)."""
    out = xp.matmul(a, b)
    return out if out.dtype == a.dtype else out.astype(a.dtype)


def _bmm(xp: Any, a: Array, b: Array, out: Optional[Array] = None) -> Array:
    """``a[i] @ b[i]`` over the leading axis (one kv head each), in a's dtype.

    CuPy 14 batches matmul for float16/32/64 only: bfloat16 falls to its integer
    kernel and raises. Other dtypes therefore take one 2-D product (cuBLAS bf16 GEMM)
    per kv head; each stacks its query heads in the rows, so at most ``kv_heads``
    large GEMMs per sequence.
    """
    if out is None:
        out = xp.empty((a.shape[0], a.shape[1], b.shape[2]), a.dtype)
    if a.dtype in _BATCHED:
        xp.matmul(a, b, out=out)
    else:
        for i in range(a.shape[0]):
            xp.matmul(a[i], b[i], out=out[i])
    return out


def _linear(xp: Any, x: Array, w: Array) -> Array:
    """``x @ w.T`` over the last axis of x, as one 2-D matmul."""
    return _mm(xp, x.reshape(-1, x.shape[-1]), w.T).reshape(*x.shape[:-1], w.shape[0])


def _linear_back(xp: Any, dy: Array, x: Array, w: Array) -> tuple[Array, Array]:
    """Gradients of ``y = x @ w.T``: ``(dx, dw)``."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = _mm(xp, dy2.T, x.reshape(-1, x.shape[-1]))
    return _mm(xp, dy2, w).reshape(x.shape), dw


def _rms_stats(xp: Any, h: Array, eps: float) -> Array:
    """``1 / rms(h)`` over the last axis, shape ``(..., 1)``, in the compute dtype."""
    hc = h.astype(_compute_dtype(h.dtype))
    return 1.0 / xp.sqrt((hc * hc).mean(-1, keepdims=True) + eps)


def _rms_apply(h: Array, r: Array, w: Array) -> Array:
    """``h / rms(h) * w`` in the parameters' dtype, from saved statistics ``r``."""
    return (h.astype(r.dtype) * r * w.astype(r.dtype)).astype(h.dtype)


def _rms_back(h: Array, r: Array, w: Array, dy: Array,
              residual: Optional[Array] = None) -> tuple[Array, Array]:
    """Gradients of :func:`_rms_apply`: ``(dh + residual, dw)``.

    ``residual`` is the gradient arriving through the skip connection; adding it in
    the compute dtype rounds once instead of twice.
    """
    n = h.astype(r.dtype) * r
    dyc = dy.astype(r.dtype)
    dw = (dyc * n).reshape(-1, n.shape[-1]).sum(0)
    dn = dyc * w.astype(r.dtype)
    dh = r * (dn - n * (dn * n).mean(-1, keepdims=True))
    if residual is not None:
        dh += residual.astype(r.dtype)
    return dh.astype(h.dtype), dw.astype(w.dtype)


def _write(grads: list, grads_out: list, unit: int) -> list:
    """Copy ``grads`` into the caller's arrays (cast to their dtype); returns those."""
    if [tuple(g.shape) for g in grads_out] != [tuple(g.shape) for g in grads]:
        raise ValueError(f"expected grads_out shapes {[g.shape for g in grads]} for unit "
                         f"{unit}, got {[g.shape for g in grads_out]}")
    for dst, g in zip(grads_out, grads):
        dst[...] = g
    return list(grads_out)


def _rotate_half(xp: Any, x: Array) -> Array:
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _sigmoid(xp: Any, x: Array) -> Array:
    # tanh form: exp(-x) would overflow (and warn) for very negative x.
    y = xp.tanh(0.5 * x)
    y *= 0.5
    y += 0.5
    return y


class _HeadSaved(NamedTuple):
    h: Array        # input of the final norm
    r: Array        # its 1/rms
    logits: Array   # (B, S, V), parameters' dtype
    lse: Array      # (B*S, 1) log-sum-exp, compute dtype
    targets: Array  # (B*S,)


class _LayerSaved(NamedTuple):
    h: Array      # layer input
    r1: Array     # 1/rms of h
    q: Array      # (B, heads, S, hd): RoPE'd queries, pre-scaled by 1/sqrt(hd)
    k: Array      # (B, kv, S, hd): RoPE'd keys
    v: Array      # (B, kv, S, hd)
    probs: Array  # (B, kv, group*S, S) softmax, parameters' dtype
    o: Array      # (B, S, heads*hd) attention output before wo
    h1: Array     # residual stream after attention
    r2: Array     # 1/rms of h1
    gate: Array   # (B, S, F) w_gate projection
    up: Array     # (B, S, F) w_up projection


class Llama:
    """Per-unit forward and backward of a Llama-style decoder.

    Args:
        cfg: The model shape.
        xp: The array module, ``numpy`` or ``cupy``. Parameters and inputs must live
            on its device.

    Attributes:
        cfg: The model shape.
        xp: The array module.
        num_units: ``layers + 2``.

    The object caches RoPE tables and causal masks per (sequence length, dtype); it
    holds no parameters (see [Note: saved state and parameter lifetimes]).
    """

    def __init__(self, cfg: ModelConfig, xp: Any = np) -> None:
        self.cfg = cfg
        self.xp = xp
        self.num_units = cfg.layers + 2
        self._tables: dict[tuple[str, int, str], Any] = {}

    def forward(self, unit: int, params: list, inputs: Any) -> tuple[Any, Any]:
        """Run one unit.

        Args:
            unit: Unit index, ``0 <= unit < num_units``.
            params: The unit's parameters in :func:`unit_specs` order, all one dtype.
            inputs: Unit 0: token ids ``(B, S)``. Layers: the hidden state
                ``(B, S, H)``. Last unit: ``(hidden state, targets)``.

        Returns:
            ``(output, saved)``: the next hidden state (the loss, a 0-d array in the
            compute dtype, for the last unit) and the state its backward needs.
        """
        self._check(unit, params)
        if unit == 0:
            return params[0][inputs], inputs
        # Activations travel in the parameters' dtype (a no-op cast when they already do).
        dtype = params[0].dtype
        if unit == self.num_units - 1:
            return self._head_forward(params, inputs[0].astype(dtype, copy=False), inputs[1])
        return self._layer_forward(params, inputs.astype(dtype, copy=False))

    def backward(self, unit: int, params: list, saved: Any, grad_output: Any, *,
                 grads_out: Optional[list] = None) -> tuple[Optional[Array], list]:
        """Backward of one unit.

        Args:
            unit: Unit index.
            params: The unit's parameters, gathered again (same values as in forward).
            saved: What :meth:`forward` returned for this unit.
            grad_output: ``dL/d(output)``; for the last unit a float scale of the loss.
            grads_out: Optional arrays, one per parameter in its shape, that receive the
                gradients (overwritten, not accumulated): the runtime's gradient buffers.

        Returns:
            ``(grad_input, grads)``: the gradient of the unit's input (None for unit 0)
            and one gradient per parameter, each in the parameter's shape and dtype
            (the arrays of ``grads_out`` when given).

        Raises:
            ValueError: If ``unit``, the number of parameters or a ``grads_out`` shape is off.
        """
        self._check(unit, params)
        if unit == 0:
            grad_input, grads = None, [self._embed_backward(params[0], saved, grad_output)]
        elif unit == self.num_units - 1:
            grad_input, grads = self._head_backward(params, saved, float(grad_output))
        else:
            # A gradient in another dtype (fp32, say) would drag every product after it
            # off the param-dtype GEMMs, so it is cast once here.
            dh = grad_output.astype(params[0].dtype, copy=False)
            grad_input, grads = self._layer_backward(params, saved, dh)
        return grad_input, grads if grads_out is None else _write(grads, grads_out, unit)

    def _check(self, unit: int, params: list) -> None:
        if not 0 <= unit < self.num_units:
            raise ValueError(f"expected 0 <= unit < {self.num_units}, got {unit}")
        want = 1 if unit == 0 else 2 if unit == self.num_units - 1 else len(_LAYER_NAMES)
        if len(params) != want:
            raise ValueError(f"expected {want} parameters for unit {unit}, got {len(params)}")

    def _embed_backward(self, embed: Array, tokens: Array, dh: Array) -> Array:
        xp, c = self.xp, _compute_dtype(embed.dtype)
        grad = xp.zeros(embed.shape, c)
        _scatter_add(xp, grad, tokens.reshape(-1), dh.reshape(-1, embed.shape[1]).astype(c))
        return grad.astype(embed.dtype)

    def _head_forward(self, params: list, h: Array, targets: Array) -> tuple[Array, _HeadSaved]:
        xp = self.xp
        norm, head = params
        r = _rms_stats(xp, h, self.cfg.eps)
        logits = _linear(xp, _rms_apply(h, r, norm), head)
        flat = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        z = flat.astype(r.dtype)  # a copy, so the in-place steps below leave logits alone
        m = z.max(-1, keepdims=True)
        z -= m
        xp.exp(z, out=z)
        lse = xp.log(z.sum(-1, keepdims=True)) + m
        picked = flat[xp.arange(t.shape[0]), t].astype(r.dtype)
        loss = (lse[:, 0] - picked).mean(keepdims=True).reshape(())
        return loss, _HeadSaved(h, r, logits, lse, t)

    def _head_backward(self, params: list, s: _HeadSaved, scale: float) -> tuple[Array, list]:
        xp = self.xp
        norm, head = params
        flat = s.logits.reshape(-1, s.logits.shape[-1])
        d = flat.astype(s.r.dtype)
        d -= s.lse
        xp.exp(d, out=d)  # softmax
        d[xp.arange(s.targets.shape[0]), s.targets] -= 1.0
        d *= scale / s.targets.shape[0]
        dlogits = d.astype(flat.dtype).reshape(s.logits.shape)
        dx, dhead = _linear_back(xp, dlogits, _rms_apply(s.h, s.r, norm), head)
        dh, dnorm = _rms_back(s.h, s.r, norm, dx)
        return dh, [dnorm, dhead]

    def _layer_forward(self, params: list, h: Array) -> tuple[Array, _LayerSaved]:
        xp, eps = self.xp, self.cfg.eps
        attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down = params
        r1 = _rms_stats(xp, h, eps)
        x = _rms_apply(h, r1, attn_norm)
        q = self._rope(_linear(xp, x, wq), 1.0 / math.sqrt(self.cfg.head_dim))
        k = self._rope(_linear(xp, x, wk), 1.0)
        v = self._split_heads(_linear(xp, x, wv))
        probs, o = self._attend(q, k, v)
        h1 = h + _linear(xp, o, wo)
        r2 = _rms_stats(xp, h1, eps)
        x2 = _rms_apply(h1, r2, mlp_norm)
        gate, up = _linear(xp, x2, w_gate), _linear(xp, x2, w_up)
        silu, _ = self._silu(gate)
        act = xp.multiply(silu, up, out=xp.empty_like(up), casting="unsafe")
        h2 = h1 + _linear(xp, act, w_down)
        return h2, _LayerSaved(h, r1, q, k, v, probs, o, h1, r2, gate, up)

    def _layer_backward(self, params: list, s: _LayerSaved, dh2: Array) -> tuple[Array, list]:
        dh1, mlp_grads = self._mlp_back(params[5:], s, dh2)
        dh, attn_grads = self._attn_back(params[:5], s, dh1)
        return dh, attn_grads + mlp_grads

    def _mlp_back(self, params: list, s: _LayerSaved, dh2: Array) -> tuple[Array, list]:
        """Backward of ``h2 = h1 + w_down(silu(gate) * up)``, gate/up from rmsnorm(h1).

        The (B, S, F) compute-dtype temporaries are updated in place: at the 8B shape
        each is 0.5 GB.
        """
        xp = self.xp
        mlp_norm, w_gate, w_up, w_down = params
        silu, sig = self._silu(s.gate)
        act = xp.multiply(silu, s.up, out=xp.empty_like(s.up), casting="unsafe")
        dact, dw_down = _linear_back(xp, dh2, act, w_down)
        del act
        dact = dact.astype(silu.dtype)
        dup = xp.multiply(dact, silu, out=xp.empty_like(s.up), casting="unsafe")
        xp.multiply(dact, s.up, out=dact)  # s.up is lifted to the compute dtype on the fly
        # silu'(g) = sig * (1 + g * (1 - sig)) = sig + silu - silu * sig
        sig_silu = silu * sig
        silu -= sig_silu
        silu += sig
        del sig, sig_silu
        dgate = xp.multiply(dact, silu, out=xp.empty_like(s.gate), casting="unsafe")
        del dact, silu
        x2 = _rms_apply(s.h1, s.r2, mlp_norm)
        dx2, dw_gate = _linear_back(xp, dgate, x2, w_gate)
        dx2_up, dw_up = _linear_back(xp, dup, x2, w_up)
        dh1, dmlp_norm = _rms_back(s.h1, s.r2, mlp_norm, dx2 + dx2_up, residual=dh2)
        return dh1, [dmlp_norm, dw_gate, dw_up, dw_down]

    def _attn_back(self, params: list, s: _LayerSaved, dh1: Array) -> tuple[Array, list]:
        """Backward of ``h1 = h + wo(attention(rope(wq x), rope(wk x), wv x))``."""
        xp = self.xp
        attn_norm, wq, wk, wv, wo = params
        do, dwo = _linear_back(xp, dh1, s.o, wo)
        dq, dk, dv = self._attend_back(s, do)
        x = _rms_apply(s.h, s.r1, attn_norm)
        dq = self._rope_back(dq, 1.0 / math.sqrt(self.cfg.head_dim))
        dx, dwq = _linear_back(xp, dq, x, wq)
        dx_k, dwk = _linear_back(xp, self._rope_back(dk, 1.0), x, wk)
        dx_v, dwv = _linear_back(xp, self._merge_heads(dv), x, wv)
        dh, dattn_norm = _rms_back(s.h, s.r1, attn_norm, dx + dx_k + dx_v, residual=dh1)
        return dh, [dattn_norm, dwq, dwk, dwv, dwo]

    def _silu(self, gate: Array) -> tuple[Array, Array]:
        """``(silu(gate), sigmoid(gate))`` in the compute dtype."""
        g = gate.astype(_compute_dtype(gate.dtype))
        sig = _sigmoid(self.xp, g)
        return g * sig, sig

    def _attend(self, q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        """Causal softmax attention; returns probabilities and ``(B, S, heads*hd)`` output.

        Query heads ``kv*group .. kv*group + group - 1`` share kv head ``kv``, so one
        sequence's queries reshape for free to ``(kv, group*S, hd)`` and each kv head
        is one matmul. The loop over the batch bounds the fp32 scores to one sequence
        (heads x S x S).
        """
        xp = self.xp
        b, nh, s, hd = q.shape
        kv = k.shape[1]
        g = nh // kv
        c = _compute_dtype(q.dtype)
        mask = self._causal_mask(s, c)
        probs = xp.empty((b, kv, g * s, s), q.dtype)
        o = xp.empty_like(q)
        for i in range(b):
            z = _bmm(xp, q[i].reshape(kv, g * s, hd), k[i].swapaxes(-1, -2))
            z = xp.add(z.reshape(kv, g, s, s), mask)  # the mask's dtype lifts z to c
            z -= z.max(-1, keepdims=True)
            xp.exp(z, out=z)
            # Normalize while storing in the parameters' dtype: one pass instead of two.
            xp.multiply(z, 1.0 / z.sum(-1, keepdims=True), casting="unsafe",
                        out=probs[i].reshape(kv, g, s, s))
            _bmm(xp, probs[i], v[i], out=o[i].reshape(kv, g * s, hd))
        return probs, self._merge_heads(o)

    def _attend_back(self, s: _LayerSaved, do: Array) -> tuple[Array, Array, Array]:
        """Gradients of :meth:`_attend` for queries, keys and values (head layout).

        Softmax backward needs ``rowsum(P * dP)``, which equals ``do . o`` per query
        (as in FlashAttention), so no second score-sized temporary is made for it.
        """
        xp = self.xp
        b, nh, n, hd = s.q.shape
        kv = s.k.shape[1]
        c = _compute_dtype(do.dtype)
        rowdot = (do.astype(c) * s.o.astype(c)).reshape(b, n, nh, hd).sum(-1)
        rowdot = rowdot.transpose(0, 2, 1).reshape(b, kv, -1, 1)
        do = self._split_heads(do)
        dq, dk, dv = xp.empty_like(s.q), xp.empty_like(s.k), xp.empty_like(s.v)
        for i in range(b):
            p = s.probs[i]
            doi = do[i].reshape(kv, -1, hd)
            _bmm(xp, p.swapaxes(-1, -2), doi, out=dv[i])
            # dz = p * (do v^T - rowdot): the compute dtype from rowdot, then stored back
            # in the parameters' dtype by the multiply itself (two passes over S x S).
            dz = xp.subtract(_bmm(xp, doi, s.v[i].swapaxes(-1, -2)), rowdot[i])
            dz = xp.multiply(dz, p, out=xp.empty_like(p), casting="unsafe")
            _bmm(xp, dz, s.k[i], out=dq[i].reshape(kv, -1, hd))
            _bmm(xp, dz.swapaxes(-1, -2), s.q[i].reshape(kv, -1, hd), out=dk[i])
        return dq, dk, dv

    def _split_heads(self, x: Array) -> Array:
        """``(B, S, n*hd)`` -> contiguous ``(B, n, S, hd)``."""
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        return self.xp.ascontiguousarray(x.reshape(b, s, -1, hd).transpose(0, 2, 1, 3))

    def _merge_heads(self, x: Array) -> Array:
        """``(B, n, S, hd)`` -> contiguous ``(B, S, n*hd)``."""
        b, n, s, hd = x.shape
        return self.xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, s, n * hd)

    def _rope(self, x: Array, scale: float) -> Array:
        """RoPE ("rotate half") of ``(B, S, n*hd)`` times ``scale``, as ``(B, n, S, hd)``."""
        b, s, _ = x.shape
        c = _compute_dtype(x.dtype)
        cos, sin = self._rope_tables(s, c)
        xc = x.reshape(b, s, -1, self.cfg.head_dim).transpose(0, 2, 1, 3).astype(c)
        y = xc * cos + _rotate_half(self.xp, xc) * sin
        if scale != 1.0:
            y *= scale
        return self.xp.ascontiguousarray(y.astype(x.dtype))

    def _rope_back(self, dy: Array, scale: float) -> Array:
        """Gradient of :meth:`_rope`, back in ``(B, S, n*hd)`` layout.

        The rotation's transpose is ``-rotate_half``, so ``dx = dy*cos - rot(dy*sin)``.
        """
        c = _compute_dtype(dy.dtype)
        cos, sin = self._rope_tables(dy.shape[2], c)
        dyc = dy.astype(c)
        dx = dyc * cos - _rotate_half(self.xp, dyc * sin)
        if scale != 1.0:
            dx *= scale
        return self._merge_heads(dx.astype(dy.dtype))

    def _rope_tables(self, s: int, c: np.dtype) -> tuple[Array, Array]:
        """``(cos, sin)`` of shape ``(S, hd)``, built once per (S, dtype)."""
        key = ("rope", s, c.name)
        if key not in self._tables:
            hd = self.cfg.head_dim
            inv_freq = self.cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
            ang = np.outer(np.arange(s, dtype=np.float64), inv_freq)
            ang = np.concatenate([ang, ang], axis=-1)
            self._tables[key] = (self.xp.asarray(np.cos(ang).astype(c)),
                                 self.xp.asarray(np.sin(ang).astype(c)))
        return self._tables[key]

    def _causal_mask(self, s: int, c: np.dtype) -> Array:
        """``(S, S)`` additive mask: 0 on and below the diagonal, -inf above."""
        key = ("mask", s, c.name)
        if key not in self._tables:
            upper = np.triu(np.ones((s, s), dtype=bool), k=1)
            self._tables[key] = self.xp.asarray(np.where(upper, -np.inf, 0.0).astype(c))
        return self._tables[key]
