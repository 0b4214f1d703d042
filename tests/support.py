"""What tests and benchmarks share: the example model and trainer, and the workloads.

* :func:`example` imports a script of ``examples/`` (``llama``: the model; ``train``: the
  trainer; ``jax_train``: the JAX transformer) by its path: ``examples/`` is no package,
  and nothing puts it on ``sys.path``.
* The workloads: the FSDP unit shapes of real models and synthetic sweeps, which the
  benchmark moves and the GPU tests check.

A :class:`Unit` is a list of parameter shapes (bf16). Unit sizes, in bf16, are
checked by the tests: Llama-3.1-8B 416 MiB, Llama-3.1-70B 1632 MiB,
Qwen3-30B-A3B 1189 MiB (rounded); the Wan2.2 DiT block is 670 MiB.

Data are made by a counter-based hash of (seed, element index), so any rank can
rebuild any other rank's gradients (for the fp64 reference) without moving
them, and NumPy and CuPy produce the same values.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The examples a script imports by name, loaded first (``train`` imports ``llama``).
NEEDS = {"train": ("llama",)}
MiB = 1 << 20
BF16_BYTES = 2


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name``, imported once.

    Registered in ``sys.modules`` under its own name, as running it would: its dataclasses
    look their module up there, and ``train``'s ``import llama`` finds the one loaded here.
    """
    if name in sys.modules:
        return sys.modules[name]
    for dep in NEEDS.get(name, ()):
        example(dep)
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: parameter shapes, moved as bf16.

    Attributes:
        name: short id used in records (``llama3.1-8b``, ``size-64MiB``, ...).
        label: human name for tables.
        shapes: full shape of every parameter, in order.
        kind: ``"unit"`` (a model layer), ``"size"`` or ``"count"`` (sweeps).
        x: the sweep coordinate (total bytes, or parameter count); None for units.
    """

    name: str
    label: str
    shapes: tuple[tuple[int, ...], ...]
    kind: str = "unit"
    x: float | None = None

    @property
    def nparams(self) -> int:
        return len(self.shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of the full parameters in bf16 (no padding, no alignment)."""
        return self.numel * BF16_BYTES


def _linear(out_f: int, in_f: int) -> tuple[int, int]:
    return (out_f, in_f)  # nn.Linear weight layout: (out_features, in_features)


def llama_layer(hidden: int, heads: int, kv_heads: int, head: int, ffn: int) -> list[tuple]:
    """q, k, v, o, gate, up, down, and the two RMSNorm weights."""
    return [_linear(heads * head, hidden), _linear(kv_heads * head, hidden),
            _linear(kv_heads * head, hidden), _linear(hidden, heads * head),
            _linear(ffn, hidden), _linear(ffn, hidden), _linear(hidden, ffn),
            (hidden,), (hidden,)]


def qwen3_moe_layer(hidden: int, heads: int, kv_heads: int, head: int, experts: int,
                    expert_ffn: int) -> list[tuple]:
    """Attention (with per-head q/k RMSNorm), router, ``experts`` x gate/up/down, two norms."""
    shapes = [_linear(heads * head, hidden), _linear(kv_heads * head, hidden),
              _linear(kv_heads * head, hidden), _linear(hidden, heads * head),
              (head,), (head,), _linear(experts, hidden)]
    for _ in range(experts):
        shapes += [_linear(expert_ffn, hidden), _linear(expert_ffn, hidden),
                   _linear(hidden, expert_ffn)]
    return shapes + [(hidden,), (hidden,)]


def wan22_dit_block(dim: int, ffn: int) -> list[tuple]:
    """WanAttentionBlock: self- and cross-attention (q/k/v/o with bias, q/k RMSNorm),
    the affine cross-attention LayerNorm, the GELU FFN with biases, and the
    (1, 6, dim) modulation."""
    def attention() -> list[tuple]:
        out = []
        for _ in range(4):
            out += [_linear(dim, dim), (dim,)]
        return out + [(dim,), (dim,)]
    return (attention() + [(dim,), (dim,)] + attention()
            + [_linear(ffn, dim), (ffn,), _linear(dim, ffn), (dim,), (1, 6, dim)])


def units(scale: int = 1) -> list[Unit]:
    """The four real-model units (one layer or block each); ``scale`` > 1 divides every
    width (for CPU smoke runs)."""
    s = scale
    return [
        Unit("llama3.1-8b", "Llama-3.1-8B layer",
             tuple(llama_layer(4096 // s, 32, 8, 128 // s, 14336 // s))),
        Unit("llama3.1-70b", "Llama-3.1-70B layer",
             tuple(llama_layer(8192 // s, 64, 8, 128 // s, 28672 // s))),
        Unit("qwen3-30b-a3b", "Qwen3-30B-A3B MoE layer",
             tuple(qwen3_moe_layer(2048 // s, 32, 4, 128 // s, 128, 768 // s))),
        Unit("wan2.2-dit", "Wan2.2 DiT block", tuple(wan22_dit_block(5120 // s, 13824 // s))),
    ]


def _even_shapes(total_bytes: int, count: int, cols: int = 1024) -> tuple[tuple[int, ...], ...]:
    numel = max(1, total_bytes // (BF16_BYTES * count))
    shape = (numel // cols, cols) if numel % cols == 0 and numel >= cols else (numel,)
    return (shape,) * count


def size_sweep(sizes_mib: Sequence[float], count: int = 8) -> list[Unit]:
    """Units of ``count`` equal parameters with the given total sizes (MiB)."""
    out = []
    for m in sizes_mib:
        b = int(m * MiB)
        label = f"{m:g} MiB" if m < 1024 else f"{m / 1024:g} GiB"
        out.append(Unit(f"size-{m:g}MiB", label, _even_shapes(b, count), "size", b))
    return out


def count_sweep(counts: Sequence[int], total_mib: float = 256) -> list[Unit]:
    """Units of ``total_mib`` split into the given numbers of equal parameters."""
    b = int(total_mib * MiB)
    return [Unit(f"count-{c}", f"{c} x {total_mib / c:g} MiB", _even_shapes(b, c), "count", c)
            for c in counts]


def values(xp: Any, seed: int, start: int, count: int) -> Any:
    """float32 values in [-1, 1) for elements ``start..start+count`` of stream ``seed``.

    A 32-bit integer hash (wrap-around arithmetic), identical on NumPy and CuPy.
    """
    u32 = xp.uint32
    h = xp.arange(start, start + count, dtype=xp.uint32)
    h *= u32(0x9E3779B1)
    h += u32((seed * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF)
    h ^= h >> u32(15)
    h *= u32(0x2C1B3C6D)
    h ^= h >> u32(12)
    h *= u32(0x297A2D39)
    h ^= h >> u32(15)
    out = (h >> u32(8)).astype(xp.float32)
    out *= xp.float32(2.0 / (1 << 24))
    out -= xp.float32(1.0)
    return out
