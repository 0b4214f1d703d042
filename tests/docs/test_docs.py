"""Every ```python block of README.md and docs/*.md runs, so a stale snippet fails CI.

Each block runs as its own program under ``mpiexec -n 2`` (``TIDE_DOCS_RANKS``), in a
temporary directory, on the host backend, with the repository first on ``PYTHONPATH``
and ``python -m mpi4py`` (an exception on one rank ends the job instead of hanging it).
A block of ``>>>`` lines runs as a doctest. The code is compiled under the document's
own name and line numbers, so a traceback reads ``File ".../README.md", line 95``.

What a document says before a fence (only blank lines between):

- ``<!-- not run: REASON -->``: the block is not run. It shows up as a skip with its
  reason (``pytest -rs`` lists them), so nothing leaves the test silently. Use it for
  what cannot run on the host backend (a GPU) and what is not a program. A block
  marked ``<!-- not run: a signature -->`` must read as ``inspect.signature`` gives the
  function (``ta.NAME(...)``, up to a ``->``).
- ``<!-- setup: WHAT ... -->``: the lines after the first, up to ``-->``, run before the
  block, in the same program: names a fragment takes from the prose or from a block
  before it. A reader of the rendered page does not see them.

Blocks of other languages are not run; in ``bash`` blocks, every path to a ``.py`` or
``.sh`` file of this repository must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .._util import skip_inside_mpi_job
from ..run import find_mpiexec, mpiexec_flags

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
RANKS = int(os.environ.get("TIDE_DOCS_RANKS", "2"))
#: Seconds one block may take: a JAX block compiles its step, and two ranks share CI's
#: two cores with the runs beside this one.
TIMEOUT_S = 300
RUN = ("python",)
SIGNATURE = "a signature"

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->", re.S)
SETUP = re.compile(r"<!--\s*setup:[^\n]*\n(.*?)-->", re.S)
MARKER = re.compile(r"<!--\s*(not run|setup)\b")
#: Paths of this repository in a bash block: at least one folder, then a .py or .sh file.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh))\b")


@dataclass(frozen=True)
class Block:
    """One fenced block: ``doc`` and ``line`` (1-based, the opening fence), its ``lang``,
    its ``code`` (dedented to the fence), the ``skip`` reason of a not-run marker, and the
    ``setup`` code with the line it starts on."""
    doc: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    setup: str = ""
    setup_line: int = 0

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _marker(lines: list[str], fence: int) -> tuple[str, int]:
    """The HTML comment that ends just before line ``fence`` (0-based; only blank lines
    between) and the 0-based line it starts on, or ("", fence)."""
    end = fence - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return "", fence
    start = end
    while start > 0 and "<!--" not in lines[start]:
        start -= 1
    return "\n".join(lines[start:end + 1]), start


def parse(doc: str, text: str) -> list[Block]:
    """Every fenced block of ``text`` with its marker. Raises ``ValueError`` on a marker
    that names no reason, a setup without code, or a marker that no fence follows."""
    lines = text.split("\n")
    blocks, used, i = [], set(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        close = re.compile(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*")
        end = next((j for j in range(i + 1, len(lines)) if close.fullmatch(lines[j])),
                   len(lines))
        body = [s[len(indent):] if s.startswith(indent) else s.lstrip() for s in lines[i + 1:end]]
        comment, start = _marker(lines, i)
        skip, setup, kind = None, "", MARKER.search(comment)
        if kind and kind.group(1) == "not run":
            if not (n := NOT_RUN.search(comment)) or not n.group(1):
                raise ValueError(f"{doc}:{start + 1}: 'not run' without a reason")
            skip = n.group(1)
        elif kind:
            if not (c := SETUP.search(comment)) or not c.group(1).strip():
                raise ValueError(f"{doc}:{start + 1}: 'setup' without code on the lines "
                                 "after its first")
            setup = c.group(1)
        if kind:
            used.add(start)
        blocks.append(Block(doc, i + 1, lang, "\n".join(body), skip, setup,
                            start + 2 if setup else 0))
        i = end + 1
    stray = [k for k, s in enumerate(lines) if MARKER.search(s) and k not in used]
    if stray:
        raise ValueError(f"{doc}:{stray[0] + 1}: a marker that no fenced block follows")
    return blocks


def _blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse(doc, (ROOT / doc).read_text())]


BLOCKS = _blocks()


def _program(block: Block) -> tuple[str, str]:
    """The code to exec (the setup, then the block unless it is a doctest) and the doctest
    text, laid out on the document's own line numbers so that tracebacks point into it."""
    lines: list[str] = []

    def put(text: str, first: int) -> None:  # first: the 1-based line of text's first line
        lines.extend([""] * (first - 1 - len(lines)))
        lines.extend(text.split("\n"))

    if block.setup:
        put(block.setup.rstrip("\n"), block.setup_line)
    if block.code.lstrip().startswith(">>>"):
        return "\n".join(lines) + "\n", block.code
    put(block.code, block.line + 1)
    return "\n".join(lines) + "\n", ""


#: Runs under ``python -m mpi4py -c``: argv = document, code file, doctest file, line.
DRIVER = """\
import doctest, sys
doc, code, tests, line = sys.argv[1], open(sys.argv[2]).read(), open(sys.argv[3]).read(), \
int(sys.argv[4])
scope = {"__name__": "__main__"}
exec(compile(code, doc, "exec"), scope)
if tests.strip():
    found = doctest.DocTestParser().get_doctest(tests, scope, doc, doc, line)
    sys.exit(int(doctest.DocTestRunner().run(found).failed > 0))
"""


def run_block(block: Block, ranks: int = RANKS) -> subprocess.CompletedProcess:
    """Run ``block`` as its own program at ``ranks`` ranks, in a temporary directory."""
    code, tests = _program(block)
    found = find_mpiexec()
    mpiexec = [found, *mpiexec_flags(found)]
    env = dict(os.environ, TIDE_BACKEND="host", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get(
                   "PYTHONPATH")])]))
    if "--oversubscribe" in mpiexec:  # Open MPI passes on only what it is told to
        mpiexec += ["-x", "TIDE_BACKEND", "-x", "PYTHONPATH"]
    with tempfile.TemporaryDirectory(prefix="tidearray-docs-") as tmp:
        Path(tmp, "block-code.txt").write_text(code)
        Path(tmp, "block-doctest.txt").write_text(tests)
        cmd = [*mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-c", DRIVER,
               str(ROOT / block.doc), "block-code.txt", "block-doctest.txt", str(block.line)]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # mpiexec and its ranks
            out, _ = proc.communicate()
            out += f"\n(killed after {TIMEOUT_S} s)"
        return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUN], ids=lambda b: b.id)
def test_python_block_runs(block: Block):
    if block.skip:
        pytest.skip(f"{block.id} not run: {block.skip}")
    skip_inside_mpi_job("starts its own mpiexec")
    done = run_block(block)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-60:])
        pytest.fail(f"the ```python block at {block.id} failed at {RANKS} ranks "
                    f"(exit {done.returncode}):\n{tail}", pytrace=False)


def _signature(name: str) -> str:
    """``name`` (``ta.X`` or ``ta.x.Y``) and its parameters as the code has them, without
    annotations, strings in double quotes."""
    import inspect

    import tidearray

    obj = tidearray
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    sig = inspect.signature(obj)
    bare = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)
    return name + str(bare).replace("'", '"')


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip == SIGNATURE], ids=lambda b: b.id)
def test_signature_block_matches_the_code(block: Block):
    shown = " ".join(block.code.split("->")[0].split())
    assert shown.startswith("ta."), f"{block.id}: expected a signature of ta.NAME, got {shown}"
    want = _signature(shown.split("(")[0])
    assert shown == want, f"{block.id}: the docs show\n  {shown}\nthe code has\n  {want}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.id)
def test_bash_block_names_files_that_exist(block: Block):
    missing = [p for p in REPO_PATH.findall(block.code) if not (ROOT / p).exists()]
    assert not missing, f"the ```bash block at {block.id} names files that do not exist: {missing}"


def test_every_python_fence_is_found():
    """The parser finds as many ```python blocks as a plain count of their fences, at least
    the README's first one runs (a parser that found nothing would pass the rest), and no
    block hides from the run under another name for Python."""
    others = [b.id for b in BLOCKS if b.lang in ("py", "python3", "pycon", "ipython")]
    assert not others, f"label these ```python, so that they run: {others}"
    for doc in DOCS:
        count = len(re.findall(r"^\s*```python\b", (ROOT / doc).read_text(), re.M))
        assert count == sum(b.doc == doc and b.lang == "python" for b in BLOCKS), doc
    assert any(b.doc == "README.md" and b.lang in RUN and not b.skip for b in BLOCKS)


def test_markers():
    """A marker needs a reason and a block after it; setup code lands on its own lines."""
    text = ("x\n<!-- not run: a sketch -->\n```python\nf(x)\n```\n\n"
            "<!-- setup: names\ny = 1\n-->\n```python\nprint(y)\n```\n")
    skipped, setup = parse("t.md", text)
    assert (skipped.skip, skipped.line, setup.skip, setup.line) == ("a sketch", 3, None, 10)
    code, tests = _program(setup)
    assert code.split("\n")[7:11] == ["y = 1", "", "", "print(y)"] and not tests
    with pytest.raises(ValueError, match="without a reason"):
        parse("t.md", "<!-- not run: -->\n```python\n```\n")
    with pytest.raises(ValueError, match="without code"):
        parse("t.md", "<!-- setup: y = 1 -->\n```python\n```\n")
    with pytest.raises(ValueError, match="no fenced block follows"):
        parse("t.md", "<!-- not run: why -->\ntext\n\n```python\n```\n")
