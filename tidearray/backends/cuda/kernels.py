"""Loads the CUDA C++ sources in ``kernels/`` and compiles them once, with CuPy.

The sources ship as the package ``tidearray.kernels`` (setup.py maps the
top-level ``kernels/`` directory onto it). In a source checkout that is not
installed, they are read from ``kernels/`` next to the ``tidearray`` package.
Compiled modules are cached per (file, device), so each process compiles a
file once (CuPy also caches the binary on disk across processes).

A line ``#include "name.cuh"`` is replaced by that file's text (once per
source), so shared device helpers need no include path, installed or not.

``path=`` names another directory to read a source (and headers) from first, e.g.
``benchmarks/variants/``: kernels kept outside the library, which may include the
library's headers.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..._errors import TideBackendError

#: Tile sizes of ``kernels/pack.cu`` (``BYTES_TILE``, ``CVT_TILE`` there).
PACK_BYTES_TILE = 65536
PACK_CVT_TILE = 32768

_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[ \t]*$', re.M)


def source(name: str, path: Optional[Path] = None) -> str:
    """The text of ``kernels/<name>`` (``<path>/<name>`` where ``path`` is given), with
    its ``#include "x.cuh"`` lines inlined (each read from ``path`` first, then from
    ``kernels/``).

    Raises:
        TideBackendError: the file (or a header) is in none of those places.
    """
    seen: set[str] = set()

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:  # #pragma once, for a text include
            return ""
        seen.add(header)
        return _INCLUDE.sub(inline, _read(header, path))

    return _INCLUDE.sub(inline, _read(name, path))


def _read(name: str, path: Optional[Path] = None) -> str:
    if path is not None and (Path(path) / name).is_file():
        return (Path(path) / name).read_text()
    try:
        from importlib import resources

        found = resources.files("tidearray.kernels").joinpath(name)
        if found.is_file():
            return found.read_text()
    except (ImportError, ModuleNotFoundError, OSError, TypeError):
        pass  # not installed as a package: try the checkout below
    local = Path(__file__).resolve().parents[3] / "kernels" / name
    if local.is_file():
        return local.read_text()
    where = f"{path}, " if path is not None else ""
    raise TideBackendError(f"kernel source {name!r}: expected it in {where}the package "
                           f"tidearray.kernels or at {local}, found none")


@functools.cache
def module(name: str, device: int, path: Optional[Path] = None) -> Any:
    """``cupy.RawModule`` of ``kernels/<name>`` (or ``<path>/<name>``), compiled for
    ``device`` (cached).

    ``device`` only keys the cache: CuPy compiles for the current device.
    """
    import cupy

    try:
        mod = cupy.RawModule(code=source(name, path), options=("--std=c++14",))
        mod.compile()
    except Exception as e:  # CompileException, CUDADriverError: wrap with the file name
        where = f"{path}/" if path is not None else "kernels/"
        raise TideBackendError(f"compiling {where}{name} failed: {e}") from e
    return mod


def function(name: str, kernel: str, device: int, path: Optional[Path] = None) -> Any:
    """The ``cupy.RawKernel`` called ``kernel`` in ``kernels/<name>`` (or
    ``<path>/<name>``)."""
    return module(name, device, path).get_function(kernel)


def pack_table(segs: list, tile: int) -> tuple[np.ndarray, int]:
    """The segment table of ``kernels/pack.cu`` for ``(dst, src, valid, total)``
    segments: ``(n, 5)`` int64 rows ``dst, src, valid, total, tile0`` (empty
    segments left out), and the tile count."""
    segs = [s for s in segs if s[3] > 0]
    table = np.zeros((len(segs), 5), np.int64)
    t0 = 0
    for i, (d, s, v, t) in enumerate(segs):
        table[i] = (d, s, v, t, t0)  # user-space addresses fit in int64
        t0 += -(-t // tile)
    return table, t0
