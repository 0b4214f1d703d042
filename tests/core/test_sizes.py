"""Sizes: no module of ``tidearray`` over 600 lines, no function over 60, and the
benchmarks (``benchmarks/``, what a user or a release runs) at most 6,000 lines of Python.

A module counts every line of its file. A function (or method) counts from its
``def`` line to its last line, docstring and nested functions included (decorators
excluded). Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tidearray"
MODULE_MAX = 600
FUNCTION_MAX = 60
BENCHMARKS_MAX = 6000

#: Files over a limit for now, by path under ``tidearray/``, with the reason.
ALLOWED: dict[str, str] = {}


def _sizes() -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
    """(file, lines) of every module and (file, function, lines) of every function."""
    modules, functions = [], []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        text = f.read_text()
        modules.append((rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((rel, f"{node.name} (line {node.lineno})",
                                  node.end_lineno - node.lineno + 1))
    return modules, functions


def test_no_module_over_the_limit():
    modules, _ = _sizes()
    over = [f"{rel}: {n} lines" for rel, n in modules if n > MODULE_MAX and rel not in ALLOWED]
    assert not over, f"modules over {MODULE_MAX} lines:\n" + "\n".join(over)


def test_no_function_over_the_limit():
    _, functions = _sizes()
    over = [f"{rel}: {name}, {n} lines" for rel, name, n in functions
            if n > FUNCTION_MAX and rel not in ALLOWED]
    assert not over, f"functions over {FUNCTION_MAX} lines:\n" + "\n".join(over)


def test_the_allowances_are_still_needed():
    """A file back under both limits leaves the list."""
    modules, functions = _sizes()
    over = ({rel for rel, n in modules if n > MODULE_MAX}
            | {rel for rel, _, n in functions if n > FUNCTION_MAX})
    assert set(ALLOWED) <= over, f"no longer over a limit: {sorted(set(ALLOWED) - over)}"


def test_the_measure_counts_from_def_to_the_last_line():
    tree = ast.parse("@dec\ndef f():\n    '''doc'''\n\n    def g():\n        pass\n"
                     "    return g\n")
    f = tree.body[0]
    assert f.end_lineno - f.lineno + 1 == 6


def test_the_benchmarks_stay_within_their_size():
    """Retired probes leave the tree (their findings stay in docs/performance.md)."""
    files = sorted((ROOT.parent / "benchmarks").rglob("*.py"))
    n = sum(len(f.read_text().splitlines()) for f in files)
    assert files and n <= BENCHMARKS_MAX, f"benchmarks/: {n} lines of Python (at most " \
        f"{BENCHMARKS_MAX})"
