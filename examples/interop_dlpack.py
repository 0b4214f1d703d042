"""Interop: feed tidearray with CuPy, PyTorch or JAX arrays and read its outputs back, zero-copy.

tidearray takes any array that speaks DLPack (``__dlpack__``) on the group's
device, and its outputs (views into a slot, or fp32 shards) can be handed to
any framework by DLPack without a copy::

    mpiexec -n 2 python examples/interop_dlpack.py

It tries NumPy or CuPy (whichever lives on the group's device), then PyTorch
and JAX. It needs the ``torch`` and ``jax`` extras and fails without them,
naming the extra. On the host backend (no GPU) the arrays are CPU arrays and
the demo moves float32, because NumPy's DLPack has no bfloat16; on the cuda
backend it moves bfloat16 (CuPy, PyTorch and JAX all export it by DLPack).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
from mpi4py import MPI

import tidearray as ta

# JAX would otherwise grab most of the GPU's memory in every rank.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

#: The frameworks this demo needs, and the pip extra of each.
NEEDS = {"torch": "torch", "jax": "jax"}
SHAPES = [(6, 4), (5,), (2, 3)]  # (2, 3): fewer rows than ranks at -n 3 and -n 4


class Framework(NamedTuple):
    name: str
    wrap: Callable[[Any], Any]  # a backend array -> this framework's array (zero-copy)
    ptr: Callable[[Any], int]  # this framework's array -> its data pointer


class DLPackOnly:
    """An array that offers nothing but DLPack, like many frameworks' tensors."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


def numpy_framework(backend: str) -> tuple[Optional[Framework], str]:
    if backend != "host":
        return None, "NumPy arrays live on the CPU; this group runs on the GPU"
    return Framework("numpy (DLPack-only producer)", lambda a: DLPackOnly(a),
                     lambda a: np.from_dlpack(a).ctypes.data), ""


def cupy_framework(backend: str) -> tuple[Optional[Framework], str]:
    if backend != "cuda":
        return None, "CuPy arrays live on the GPU; this group runs on the host backend"
    import cupy

    return Framework("cupy", cupy.from_dlpack, lambda a: a.data.ptr), ""


def torch_framework(backend: str) -> tuple[Optional[Framework], str]:
    import torch

    return Framework(f"torch {torch.__version__}", torch.from_dlpack,
                     lambda t: t.data_ptr()), ""


def jax_framework(backend: str) -> tuple[Optional[Framework], str]:
    import jax
    import jax.dlpack

    return Framework(f"jax {jax.__version__}", jax.dlpack.from_dlpack,
                     lambda x: x.unsafe_buffer_pointer()), ""


def to_numpy(xp: Any, a: Any) -> np.ndarray:
    """A NumPy array of any DLPack producer on the backend's device (a copy on GPU)."""
    b = xp.from_dlpack(a)
    return b.get() if hasattr(b, "get") else b


def round_trip(g: ta.Group, fw: Framework, dtype: Any) -> dict:
    """All-gather and reduce-scatter this framework's arrays; check values and pointers."""
    xp = g.backend.xp
    rng = np.random.default_rng(0)
    full = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    shards = [fw.wrap(ta.shard(xp.asarray(w))) for w in full]  # framework arrays in
    params = ta.all_gather(shards, SHAPES)
    views = [fw.wrap(p) for p in params]  # the gathered parameters, seen by the framework
    gathered = all(np.array_equal(to_numpy(xp, p).view(np.uint8), w.view(np.uint8))
                   for p, w in zip(params, full))
    zero_copy = all(fw.ptr(v) == g.backend.resolve(p).ptr for v, p in zip(views, params))

    grads = [fw.wrap(xp.asarray(w)) for w in full]  # the same "gradient" on every rank
    shards32 = [fw.wrap(s) for s in ta.reduce_scatter(grads, op="avg")]
    reduced = all(np.allclose(to_numpy(xp, s), ta.shard(w.astype(np.float32)), rtol=1e-6)
                  for s, w in zip(shards32, full))
    return {"gathered": gathered, "zero_copy": zero_copy, "reduced": reduced}


def main() -> None:
    missing = [f"{m} (pip install 'tidearray[{extra}]')" for m, extra in NEEDS.items()
               if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit("interop_dlpack.py: needs " + " and ".join(missing))
    g = ta.init()
    dtype = ta.bfloat16 if g.backend.name == "cuda" else ta.float32
    comm = MPI.COMM_WORLD
    failed = False
    lines = [f"backend {g.backend.name}, world {g.size}, dtype {np.dtype(dtype).name}"]
    for make in (numpy_framework, cupy_framework, torch_framework, jax_framework):
        fw, why = make(g.backend.name)
        if fw is None:
            lines.append(f"  {make.__name__.split('_')[0]:6s} skipped: {why}")
            continue
        res = {k: comm.allreduce(v, op=MPI.LAND) for k, v in round_trip(g, fw, dtype).items()}
        failed |= not (res["gathered"] and res["reduced"])
        # A framework may still copy on import (JAX on CPU does for some buffers).
        seen = "zero-copy" if res["zero_copy"] else "copied on import by the framework"
        lines.append(f"  {fw.name}: all_gather bitwise equal {res['gathered']}, "
                     f"reduce_scatter(avg) correct {res['reduced']}; outputs {seen}")
    if g.rank == 0:
        print("\n".join(lines))
        print("FAILED" if failed else "OK")
    g.close()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
