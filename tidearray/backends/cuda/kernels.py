"""Loads the CUDA C++ sources in ``kernels/`` and compiles them once, with CuPy.

The sources ship as package data under ``tidearray/kernels/`` (setup.py maps the
top-level ``kernels/`` directory onto it). In a source checkout, installed
editable or not at all, they are read from ``kernels/`` next to the
``tidearray`` package. ``kernels/`` has no ``__init__.py``: a regular package
of that name would shadow, for every process started in the checkout, the
``kernels`` distribution that ``transformers`` imports.
Compiled modules are cached per (file, device), so each process compiles a
file once (CuPy also caches the binary on disk across processes).

A line ``#include "name.cuh"`` is replaced by that file's text (once per
source), so shared device helpers need no include path, installed or not.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import TideBackendError

#: Tile size of ``kernels/pack.cu`` (``BYTES_TILE`` there).
PACK_BYTES_TILE = 65536

_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[ \t]*$', re.M)


def source(name: str) -> str:
    """The text of ``kernels/<name>``, its headers inlined (:func:`with_headers`).

    Raises:
        TideBackendError: the file (or a header) is not there.
    """
    return with_headers(_read(name))


def with_headers(text: str) -> str:
    """CUDA C++ ``text`` with each ``#include "x.cuh"`` line replaced by the text of
    ``kernels/x.cuh`` (its own includes inlined too; each header once, as ``#pragma
    once`` would).

    Raises:
        TideBackendError: a header is not in ``kernels/``.
    """
    seen: set[str] = set()

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:  # #pragma once, for a text include
            return ""
        seen.add(header)
        return _INCLUDE.sub(inline, _read(header))

    return _INCLUDE.sub(inline, text)


def _read(name: str) -> str:
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
    raise TideBackendError(f"kernel source {name!r}: expected it in the package "
                           f"tidearray.kernels or at {local}, found none")


@functools.cache
def module(name: str, device: int) -> Any:
    """``cupy.RawModule`` of ``kernels/<name>``, compiled for ``device`` (cached).

    ``device`` only keys the cache: CuPy compiles for the current device.
    """
    return compile_source(source(name), f"kernels/{name}")


def compile_source(code: str, what: str) -> Any:
    """``cupy.RawModule`` of CUDA C++ ``code`` (its headers inlined: :func:`with_headers`),
    compiled for the current device.

    Raises:
        TideBackendError: it does not compile; the message names ``what``.
    """
    import cupy

    try:
        mod = cupy.RawModule(code=code, options=("--std=c++14",))
        mod.compile()
    except Exception as e:  # CompileException, CUDADriverError: wrap with the file name
        raise TideBackendError(f"compiling {what} failed: {e}") from e
    return mod


def function(name: str, kernel: str, device: int) -> Any:
    """The ``cupy.RawKernel`` called ``kernel`` in ``kernels/<name>``."""
    return module(name, device).get_function(kernel)


def pack_table(segs: list, tile: int) -> tuple[np.ndarray, int]:
    """The segment table of ``kernels/pack_segments.cuh`` for ``(dst, src, valid, total)``
    segments: ``(n, 5)`` int64 rows ``dst, src, valid, total, tile0`` (empty
    segments left out), and the tile count."""
    segs = [s for s in segs if s[3] > 0]
    table = np.zeros((len(segs), 5), np.int64)
    t0 = 0
    for i, (d, s, v, t) in enumerate(segs):
        table[i] = (d, s, v, t, t0)  # user-space addresses fit in int64
        t0 += -(-t // tile)
    return table, t0
