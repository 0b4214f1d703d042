"""No private names across boundaries: what others need is exported, or it stays inside.

Every import in ``tidearray/``, ``benchmarks/``, ``examples/`` and ``tests/`` is read from
the source (``ast``, including imports inside functions and under ``TYPE_CHECKING``).

- Inside ``tidearray``, a module may import the private (``_x``) modules and names of its
  own package, and the private modules of the packages above it (``backends.cuda`` may
  use ``tidearray._errors``). Across into another subpackage (``tidearray.torch`` ->
  ``tidearray.fsdp._lifecycle``, the core -> ``tidearray.backends._base``) it imports what
  that subpackage's ``__init__`` exports.
- ``benchmarks/``, ``examples/`` and ``tests/`` import no private module or name of
  ``tidearray``, nor of each other's folders.
- No file imports a private module or name of another distribution.

Each exception is in :data:`ALLOWED`, with its reason.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import pathlib
from typing import NamedTuple, Optional

REPO = pathlib.Path(__file__).resolve().parents[2]
AREAS = ("tidearray", "benchmarks", "examples", "tests")

#: (importing module, imported module or ``module:_name``, reason); fnmatch patterns over
#: dotted names. A private name needs an entry of its own: a module's entry allows its
#: public names only. Tests reaching internals to test them is a fair reason; the library's
#: own imports are fixed by exporting instead, except in files being restructured.
ALLOWED = [
    ("tidearray.torch._hooks", "torch.utils._pytree",
     "torch has no public pytree module (torch.utils.pytree) in the versions supported"),
    ("benchmarks.*", "tidearray._arena", "the harness times collectives into raw regions"),
    ("tests.*", "tidearray._*",
     "unit and multi-rank tests of the core's internals: layouts, copies, schedules, "
     "topologies, flags, stamps, boards, validation, caches, config parsing, AdamW math"),
    ("tests.*", "tidearray.fsdp._*",
     "unit tests of the runtime's parts: rows, lifecycle, slots, norm, optimizer"),
    ("tests.*", "tidearray.backends._base", "tests of the backend interface's records"),
    ("tests.*", "tidearray.torch._state", "the torch front end's state-dict key"),
    ("tests.jax.gpu.*", "tidearray.jax._units", "GPU tests of the JAX units' buffers"),
    ("tests.benchmarks.test_clocks", "benchmarks.harness.device:_reading",
     "the harness's own test of its nvidia-smi line parser"),
]


class Import(NamedTuple):
    where: str  # the importing module
    what: str  # the imported module, or module:name
    line: int


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, pathlib.Path]:
    """Every module of the four folders, by dotted name."""
    return {_module_name(f): f for area in AREAS for f in (REPO / area).rglob("*.py")
            if "results" not in f.relative_to(REPO).parts}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def imports(mod: str, path: pathlib.Path, mods: dict) -> list[tuple[str, Optional[str], int]]:
    """``(module, name or None, line)`` of every import in ``path``: a name imported
    ``from`` a package that is itself a module counts as that module."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level
                    else [])
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((sub, None, node.lineno) if sub in mods
                             else (target, a.name, node.lineno))
    return found


def _package(mod: str, mods: dict) -> str:
    return mod if mods.get(mod, pathlib.Path()).name == "__init__.py" else mod.rpartition(".")[0]


def _inside(pkg: str, owner: str) -> bool:
    return pkg == owner or pkg.startswith(owner + ".")


@functools.lru_cache(maxsize=1)
def crossings() -> tuple[Import, ...]:
    """Every import of a private module or name across a boundary."""
    mods = sources()
    bad = []
    for mod, path in sorted(mods.items()):
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for target, name, line in imports(mod, path, mods):
            parts = target.split(".")
            home = parts[0] in AREAS and parts[0] == mod.split(".")[0]
            if target == "__future__" or (home and parts[0] != "tidearray"):
                continue  # benchmarks, examples and tests inside themselves
            for i, part in enumerate(parts):
                if _private(part):
                    owner = ".".join(parts[:i])  # the package the private module is in
                    if not (home and _inside(pkg, owner)):
                        bad.append(Import(mod, target, line))
                    break
            if name and _private(name) and not (home and pkg == _package(target, mods)):
                bad.append(Import(mod, f"{target}:{name}", line))
    return tuple(bad)


def _matches(imp: Import, who: str, what: str) -> bool:
    return (fnmatch.fnmatchcase(imp.where, who) and fnmatch.fnmatchcase(imp.what, what)
            and (":" in what) == (":" in imp.what))


def _allowed(imp: Import) -> bool:
    return any(_matches(imp, who, what) for who, what, _ in ALLOWED)


def test_no_private_import_crosses_a_boundary():
    bad = [f"{i.where}:{i.line} imports {i.what}" for i in crossings() if not _allowed(i)]
    assert not bad, ("private imports across a boundary (export the name, or add it to "
                     "ALLOWED with a reason):\n" + "\n".join(bad))


def test_every_allowance_is_used():
    """An allowance nothing needs any more goes, so the list stays what it says."""
    found = crossings()
    unused = [(who, what) for who, what, _ in ALLOWED
              if not any(_matches(i, who, what) for i in found)]
    assert not unused, f"allowances nothing uses: {unused}"


def test_the_walker_sees_known_crossings():
    """The check is not empty by accident: a made-up crossing, a made-up private name and
    an allowed own-package import are told apart."""
    mods = sources()
    assert "tidearray.fsdp._lifecycle" in mods and "tests.core.test_boundaries" in mods
    found = {(i.where, i.what) for i in crossings()}
    assert ("tests.core.test_layout_unit", "tidearray._layout") in found
    assert not any(w.startswith("tidearray.backends.cuda") and what.startswith("tidearray._")
                   for w, what in found)  # an ancestor's private modules are in-house
    assert _private("_x") and not _private("__init__") and not _private("x")
    assert not _allowed(Import("tidearray.torch._hooks", "tidearray.fsdp._lifecycle", 1))
    assert not _allowed(Import("examples.train", "tidearray._plan", 1))
    assert not _allowed(Import("tests.test_x", "tidearray._plan:_private", 1))
