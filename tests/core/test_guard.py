"""The guard pages that tests/core/mpi/test_bounds.py relies on really fault."""

from __future__ import annotations

import numpy as np
import pytest

from .._guard import PAGE, guarded
from .._util import run_python


def _read_in_child(expr: str) -> int:
    code = ("import ctypes, numpy as np; from tests._guard import guarded; "
            f"a = guarded((10,), np.float32, readable=24); a[:6] = 1; {expr}")
    return run_python(code).returncode


def test_readable_bytes_are_usable():
    a = guarded((3, PAGE // 4 + 5), np.float32)
    a[...] = 2.0
    assert a.sum() == 2.0 * a.size
    b = guarded((7,), np.uint16, at_end=False)
    b[...] = 1
    assert b.sum() == 7


@pytest.mark.parametrize("expr,faults", [
    ("a[:6].sum()", False),
    ("ctypes.c_char.from_address(a.ctypes.data + 23).value", False),
    ("ctypes.c_char.from_address(a.ctypes.data + 24).value", True),   # first padding byte
    ("ctypes.c_char.from_address(a.ctypes.data - 1 - 4096).value", True),
])
def test_reads_outside_fault(expr, faults):
    rc = _read_in_child(expr)
    assert (rc != 0) == faults, rc
