"""Arrays against PROT_NONE guard pages, to catch out-of-bounds reads (host memory only).

Linux/POSIX only: ``mmap`` plus ``mprotect`` from the C library.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Optional

import numpy as np

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # <sys/mman.h>
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _protect(addr: int, nbytes: int) -> None:
    if nbytes and _libc.mprotect(addr, nbytes, PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


def guarded(shape: tuple, dtype: np.dtype, readable: Optional[int] = None,
            at_end: bool = True) -> np.ndarray:
    """A new array whose first ``readable`` bytes (default: all) are the only accessible ones.

    With ``at_end`` the readable bytes end exactly at a guard page, and the rest of
    the array (e.g. a shard's padding rows) lies inside the guard. Otherwise the array
    starts exactly after a guard page, so reads before it fault. Nothing here touches
    the guarded bytes; the caller fills the readable ones.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    readable = nbytes if readable is None else readable
    assert 0 <= readable <= nbytes
    data = _pages(readable) if at_end else _pages(nbytes)
    tail = max(_pages(nbytes - readable), 1) if at_end else 1
    m = mmap.mmap(-1, (1 + data + tail) * PAGE)
    base = np.frombuffer(m, np.uint8).ctypes.data
    _protect(base, PAGE)
    _protect(base + (1 + data) * PAGE, tail * PAGE)
    start = PAGE + (data * PAGE - readable if at_end else 0)
    return np.frombuffer(m, np.uint8, count=nbytes, offset=start).view(dtype).reshape(shape)
