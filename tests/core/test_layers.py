"""The package's import graph: no circle, and no import running back up the layers.

Imports are read from the source (``ast``), including those inside functions,
but not those under ``if TYPE_CHECKING:`` (annotations only, never run).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tidearray"

#: Lowest first; a module may import its own layer or lower ones. The facade
#: (``tidearray``) sits with its consumers: it re-exports the core and the runtime.
LAYERS = [
    ("base", ("_errors", "_dtypes", "_cache", "_layout", "_topology", "_copies", "_schedule",
              "_memory", "_config", "_adamw", "_wait")),
    ("backends", ("backends",)),
    ("core", ("_group", "_board", "_arena", "_stamps", "_plan", "_work", "_validate",
              "_all_gather", "_reduce_scatter", "_shard", "layout")),
    ("runtime", ("fsdp",)),
    ("front ends and tools", ("", "torch", "jax", "info")),
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = ["tidearray", *f.relative_to(ROOT).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _targets(mod: str, path: pathlib.Path, node: ast.AST, mods: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    base = pkg.split(".")[:len(pkg.split(".")) - max(node.level - 1, 0)] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the tidearray modules it imports at run time."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(x) for n in ast.walk(tree)
                       if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                       for b in n.body for x in ast.walk(b)}
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
                for t in _targets(mod, path, node, mods):
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != mod:
                        deps.add(t)
        graph[mod] = deps
    return graph


def layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else ""
    return next(i for i, (_, tops) in enumerate(LAYERS) if top in tops)


def test_no_import_runs_back_up_a_layer():
    up = [f"{m} ({LAYERS[layer(m)][0]}) -> {d} ({LAYERS[layer(d)][0]})"
          for m, deps in import_graph().items() for d in sorted(deps) if layer(d) > layer(m)]
    assert not up, "imports running back up:\n" + "\n".join(up)


def test_no_import_circle():
    graph = import_graph()
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_see_a_known_edge():
    """The graph is not empty by accident: the runtime imports the core."""
    graph = import_graph()
    assert "tidearray._plan" in graph["tidearray.fsdp._comm"]
    assert layer("tidearray.backends.cuda.vmm") == 1 and layer("tidearray") == 4


def test_the_package_imports_no_benchmark_code():
    """The harness, baselines and probes live in the unpackaged ``benchmarks/``."""
    bad = []
    for f in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{f.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] in ("benchmarks", "tests")]
    assert not bad, "the package imports benchmark or test code:\n" + "\n".join(bad)
