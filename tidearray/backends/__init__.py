"""Backends: the primitives collectives are written against.

``host`` (NumPy + mpi4py) always imports. ``cuda`` imports CuPy, cuda-bindings
and nccl4py only when it is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import TideInvalid, agree
from ._base import AccumPiece, Backend, Completion, Done, Executor, Resolved, SymmetricBuffer

if TYPE_CHECKING:
    from .._group import Group

__all__ = ["AccumPiece", "Backend", "Completion", "Done", "Executor", "Resolved", "SymmetricBuffer",
           "array_backend", "array_module", "cuda_usable", "make_backend"]


def cuda_usable() -> tuple[bool, str]:
    """Whether the cuda backend can run here, and why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install
        return False, f"cupy not importable ({e.__class__.__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CUDA runtime failure means "not usable"
        return False, f"no usable CUDA device ({e})"
    if n == 0:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def make_backend(name: str, group: Group) -> Backend:
    """Pick and construct the backend (no side effects until ``setup``).

    Every rank must agree, so the choice is made collectively: ``auto`` picks
    cuda only if every rank can use it.
    """
    if name == "auto":
        ok, _ = cuda_usable()
        name = "cuda" if group.comm.allreduce(int(ok), op=_mpi_min()) else "host"
    if name == "host":
        from .host import HostBackend

        return HostBackend(group)
    if name == "cuda":
        ok, why = cuda_usable()
        agree(group.comm, None if ok else why,
              "backend 'cuda': expected a usable GPU on every rank, got", TideInvalid)
        from .cuda import CudaBackend

        return CudaBackend(group)
    raise TideInvalid(f"expected backend 'auto', 'cuda' or 'host', got {name!r}")


_ARRAY_BACKENDS: dict[str, Backend] = {}


def array_backend(xp: Any) -> Backend:
    """The backend of the array module ``xp`` (numpy: host; cupy: cuda), bound to no
    group: for the device methods of a caller that holds arrays but no group
    ([Note: backend interface] in ``_base``). Made once per module; nothing is set up.

    Raises:
        TideInvalid: ``xp`` is neither numpy nor cupy.
    """
    name = getattr(xp, "__name__", None)
    backend = _ARRAY_BACKENDS.get(name)
    if backend is not None:
        return backend
    if name == "numpy":
        from .host import HostBackend

        backend = HostBackend(None)  # type: ignore[arg-type]
    elif name == "cupy":
        from .cuda import CudaBackend

        backend = CudaBackend(None)  # type: ignore[arg-type]
        backend.xp = xp
    else:
        raise TideInvalid(f"xp: expected the numpy or cupy module, got {xp!r}")
    return _ARRAY_BACKENDS.setdefault(name, backend)


def array_module(array: Any) -> Any:
    """The array module ``array`` belongs to: cupy for a CuPy object (an array, or a
    stream; imported only then), else numpy: for helpers that take arrays of either kind
    and no group (``layout.shard``), with :func:`array_backend` for their devices."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _mpi_min() -> Any:
    from mpi4py import MPI

    return MPI.MIN
