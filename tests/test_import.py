"""The package surface: imports with NumPy, mpi4py and ml_dtypes only; picklable errors."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import tidearray

ROOT = Path(__file__).resolve().parent.parent


def test_import_pulls_in_no_gpu_or_framework_module():
    code = ("import sys, tidearray; "
            "print([m for m in ('cupy', 'torch', 'jax', 'nccl', 'cuda') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_import_works_when_gpu_modules_are_unavailable():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ("cupy", "torch", "jax"))
    code = f"import sys; {blocked}; import tidearray; print(tidearray.__version__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_public_names_exist():
    assert all(hasattr(tidearray, name) for name in tidearray.__all__)


def test_errors_pickle_and_keep_their_type():
    for err in (tidearray.TideInvalid("parameter 3: expected X, got Y"),
                tidearray.TideBackendError("rank 1: timed out")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    assert issubclass(tidearray.TideInvalid, ValueError)
    assert issubclass(tidearray.TideInvalid, tidearray.TideError)
