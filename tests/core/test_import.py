"""The package surface: imports with NumPy, mpi4py and ml_dtypes only, a small top level,
lazy optional layers, no implicit group, no global state; picklable errors."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import tidearray

from .._util import run_python, skip_inside_mpi_job

ROOT = Path(__file__).resolve().parents[2]


def test_import_pulls_in_no_gpu_or_framework_module():
    code = ("import sys, tidearray; "
            "print([m for m in ('cupy', 'torch', 'jax', 'nccl', 'cuda') if m in sys.modules])")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_import_works_when_gpu_modules_are_unavailable():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ("cupy", "torch", "jax"))
    code = f"import sys; {blocked}; import tidearray; print(tidearray.__version__)"
    out = run_python(code)
    assert out.returncode == 0, out.stderr


def test_the_jax_front_end_loads_no_runtime():
    """``tidearray.jax`` takes AdamW's hyper-parameters and coefficients from the neutral
    ``tidearray._adamw``: importing it loads no module of ``tidearray.fsdp``."""
    pytest.importorskip("jax")
    out = run_python("import sys, tidearray.jax; "
               "print(sorted(m for m in sys.modules if m.startswith('tidearray.fsdp')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_runtime_loads_no_cuda_module():
    """``tidearray.fsdp`` reaches the device through the backend interface ([Note: backend
    interface] in ``backends/_base``): importing it on a CPU machine loads no module of the
    cuda backend."""
    out = run_python("import sys, tidearray.fsdp; "
               "print(sorted(m for m in sys.modules if m.startswith('tidearray.backends.cuda')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_checkout_shadows_no_installed_package():
    """A process started in the checkout has the checkout on ``sys.path``: none of its
    top-level directories may be a regular package that hides an installed one. The
    kernel sources' directory, ``kernels/``, shares its name with the Hugging Face
    ``kernels`` distribution that ``transformers`` imports."""
    code = ("import importlib.util as u, json; "
            "print(json.dumps({n: (u.find_spec(n) or u).__dict__.get('origin') "
            "for n in ('kernels', 'examples', 'docs')}))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    for name, origin in json.loads(out.stdout).items():
        assert not (origin and Path(origin).is_relative_to(ROOT / name)), (
            f"{name}/ of the checkout is importable as the package {name!r} ({origin})")


def test_the_kernel_sources_are_found():
    """Installed or not, the loader finds each ``.cu`` file of ``kernels/``, headers too."""
    from tidearray.backends.cuda.kernels import source

    names = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert len(names) >= 5, names
    for name in names:
        text = source(name)
        assert '#include "' not in text and "__global__" in text, name


def test_public_names_exist():
    assert all(hasattr(tidearray, name) for name in tidearray.__all__)


def test_errors_pickle_and_keep_their_type():
    for err in (tidearray.TideInvalid("parameter 3: expected X, got Y"),
                tidearray.TideBackendError("rank 1: timed out")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    assert issubclass(tidearray.TideInvalid, ValueError)
    assert issubclass(tidearray.TideInvalid, tidearray.TideError)


def test_import_leaves_the_runtime_backends_and_frameworks_unimported():
    code = ("import sys, tidearray; "
            "print([m for m in sys.modules if m in ('tidearray.fsdp', 'tidearray.torch', "
            "'tidearray.backends.cuda') or m.split('.')[0] in ('cupy', 'torch', 'jax')])")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import tidearray imported {out.stdout.strip()}"


def test_the_top_level_is_small_and_every_name_is_there():
    assert len(tidearray.__all__) <= 15, sorted(tidearray.__all__)
    assert len(set(tidearray.__all__)) == len(tidearray.__all__)
    missing = [n for n in tidearray.__all__ if n not in vars(tidearray)]
    assert not missing, f"in __all__ but not defined: {missing}"
    internals = {"UnitLayout", "plan_unit", "slot_chunk_nbytes", "ShardSpec", "shard_spec",
                 "default_group", "Region", "GatherPlan", "ReducePlan", "fsdp"}
    assert not internals & set(tidearray.__all__)
    assert isinstance(tidearray.__version__, str)


def test_fsdp_is_imported_on_first_use():
    code = ("import sys, tidearray; "
            "assert 'tidearray.fsdp' not in sys.modules; "
            "cls = tidearray.fsdp.Runtime; "
            "import tidearray.fsdp; "
            "assert cls is tidearray.fsdp.Runtime and 'tidearray.fsdp' in sys.modules; "
            "assert 'fsdp' in dir(tidearray); "
            "print(cls.__name__)")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Runtime"
    try:
        tidearray.no_such_name  # noqa: B018 - the lazy hook must not swallow typos
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("tidearray.no_such_name did not raise AttributeError")


def test_default_group_raises_when_no_group_is_open():
    """Never a hidden collective: before ``init`` and after ``close`` there is no group,
    and sizes given ``world=`` need none."""
    skip_inside_mpi_job("its child process starts MPI")
    code = """
import tidearray
from tidearray._group import default_group
from tidearray.layout import unit_nbytes

def raises(what):
    try:
        default_group()
    except tidearray.TideInvalid as e:
        assert "no group is open" in str(e) and "init()" in str(e), str(e)
    else:
        raise AssertionError(f"default_group() {what} returned a group")
    try:
        unit_nbytes([(4, 3)], tidearray.bfloat16)
    except tidearray.TideInvalid:
        pass
    else:
        raise AssertionError(f"unit_nbytes without world= {what} did not raise")

raises("before init")
assert unit_nbytes([(4, 3)], tidearray.bfloat16, world=2) == 256
g = tidearray.init(backend="host")
assert default_group() is g
assert unit_nbytes([(4, 3)], tidearray.bfloat16) == unit_nbytes([(4, 3)], "bfloat16", world=1)
g.close()
assert g.closed
raises("after close")
print("ok")
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_layout_names_work_without_a_group():
    from tidearray import layout

    assert layout.__doc__ and len(layout.__all__) >= 8
    assert all(hasattr(layout, n) for n in layout.__all__)
    shapes, world = [(7, 3), (5,), (1, 2, 2)], 3
    unit = layout.plan_unit(shapes, 2, world)
    assert isinstance(unit, layout.UnitLayout)
    assert layout.unit_nbytes(shapes, tidearray.bfloat16, world=world) == unit.nbytes
    assert all(o % layout.ALIGN == 0 for o in unit.offsets)
    spec = layout.shard_spec((7, 3), 2, world)
    assert isinstance(spec, layout.ShardSpec)
    assert layout.shard_shape((7, 3), world) == spec.shard_shape == (3, 3)
    full = np.arange(21, dtype=np.float32).reshape(7, 3)
    shards = [tidearray.shard(full, r, world) for r in range(world)]
    assert np.array_equal(layout.full_from_shards(shards, full.shape), full)


def test_torch_front_end_changes_no_warning_filter():
    """Neither ``import tidearray.torch`` nor wrapping and running a model touches the
    process's warning filters (measured after torch itself is imported)."""
    skip_inside_mpi_job("its child process starts MPI")
    pytest.importorskip("torch")
    code = """
import warnings
import torch
import tidearray
before = list(warnings.filters)
import tidearray.torch
assert warnings.filters == before, ("import", [f for f in warnings.filters if f not in before])
g = tidearray.init(backend="host")
model = tidearray.torch.shard_module(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                         torch.nn.Linear(4, 2)), group=g)
model(torch.randn(3, 4)).sum().backward()
assert warnings.filters == before, ("wrap", [f for f in warnings.filters if f not in before])
g.close()
print("ok")
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def _private(path: str) -> bool:
    """A dotted path with a part that starts with an underscore (dunders aside)."""
    return any(p.startswith("_") and not p.endswith("__") for p in path.split("."))


def private_names(source: str) -> list[str]:
    """The private tidearray names ``source`` uses: imported (``from tidearray._x import
    y``, ``import tidearray._x``, ``from tidearray.fsdp import _y``) or reached as an
    attribute of an imported tidearray module (``ta._dtypes``)."""
    found, modules = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tidearray":
                    continue
                if _private(alias.name):
                    found.append(alias.name)
                modules.add(alias.asname or alias.name.split(".")[0])
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] == "tidearray"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if _private(f"{node.module}.{a.name}")]
            modules.update(a.asname or a.name for a in node.names)  # a submodule, maybe
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_private_name_scan_finds_each_kind():
    source = ("import tidearray as ta\nimport tidearray._work\n"
              "from tidearray.fsdp._comm import UnitComm\nfrom tidearray import _dtypes, Work\n"
              "from tidearray.fsdp import UnitComm\nx = ta._config, ta.__version__, ta.init\n")
    assert sorted(private_names(source)) == sorted([
        "tidearray._work", "tidearray.fsdp._comm.UnitComm", "tidearray._dtypes", "ta._config"])


def test_examples_and_baselines_use_no_private_name():
    """What users copy from, and the comms written against ``tidearray.fsdp.UnitComm``
    (the benchmarks' baselines), stay on the public surface."""
    files = sorted([*(ROOT / "examples").glob("*.py"),
                    *(ROOT / "benchmarks" / "baselines").glob("*.py")])
    assert len(files) > 10
    used = {f.relative_to(ROOT).as_posix(): private_names(f.read_text()) for f in files}
    assert {f: names for f, names in used.items() if names} == {}
