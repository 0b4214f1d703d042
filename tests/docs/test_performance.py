"""docs/performance.md and the README's summary are exactly what the records say.

``python -m benchmarks.performance`` writes both from ``benchmarks/results/``; a number
edited by hand, or a record replaced without regenerating, fails here. Needs neither
matplotlib nor a GPU: the markdown is compared, the plots are only checked to be the
generator's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks import performance

ROOT = Path(__file__).resolve().parents[2]

FIX = f"run `{performance.COMMAND}` from the repository root"
RUN_KEYS = ("name", "date", "commit", "machine", "command", "notes")


def _docs() -> list[Path]:
    return sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]


def test_the_page_is_generated_from_the_records():
    page = (ROOT / performance.PAGE).read_text()
    assert page == performance.render_page(str(ROOT)), f"{performance.PAGE} is stale: {FIX}"


def test_the_readme_summary_is_generated_from_the_records():
    block = performance.generated_block((ROOT / "README.md").read_text())
    assert block is not None, f"README.md has no {performance.BEGIN} block: add the markers"
    assert block == performance.render_summary(str(ROOT)), f"README.md's summary is stale: {FIX}"


def test_the_markdown_is_deterministic():
    assert performance.render_page(str(ROOT)) == performance.render_page(str(ROOT))
    assert performance.render_summary(str(ROOT)) == performance.render_summary(str(ROOT))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the generated outputs beside the real records."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    os.symlink(ROOT / performance.RESULTS, tmp_path / performance.RESULTS)
    shutil.copy(ROOT / performance.PAGE, tmp_path / performance.PAGE)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _bump(text: str, pattern: str) -> str:
    """The text with the first number matching pattern changed by one unit."""
    m = re.search(pattern, text)
    assert m, pattern
    edited = text[:m.start(1)] + str(int(m.group(1)) + 1) + text[m.end(1):]
    assert edited != text
    return edited


def test_a_number_edited_in_the_page_is_caught(tree: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # --check must not need it
    assert performance.main(["--check", "--root", str(tree)]) == 0
    page = tree / performance.PAGE
    page.write_text(_bump(page.read_text(), r"\| (\d+)\.\d+x \("))
    assert performance.stale(str(tree)) == [performance.PAGE]
    assert performance.main(["--check", "--root", str(tree)]) == 1


def test_a_number_edited_in_the_readme_is_caught(tree: Path):
    readme = tree / "README.md"
    text = readme.read_text()
    block = performance.generated_block(text)
    readme.write_text(text.replace(block, _bump(block, r"\*\*(\d+)\.\d+x\*\*")))
    assert performance.stale(str(tree)) == ["README.md"]
    performance.main(["--no-plots", "--root", str(tree)])  # regenerating mends it
    assert performance.stale(str(tree)) == [] and readme.read_text() == text


def test_every_image_in_the_docs_exists_and_figures_are_generated():
    pattern = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img[^>]*\bsrc=\"([^\"]+)\"")
    for doc in _docs():
        for m in pattern.finditer(doc.read_text()):
            ref = m.group(1) or m.group(2)
            if re.match(r"[a-z]+://", ref):
                continue
            path = (doc.parent / ref.split("#")[0]).resolve()
            assert path.is_file(), f"{doc.relative_to(ROOT)} embeds {ref}, which is missing"
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(performance.RESULTS + "/"):
                assert rel in performance.PLOTS, (
                    f"{doc.relative_to(ROOT)} embeds {rel}, which {performance.COMMAND} "
                    "does not generate: plots of records come from the generator")


def test_the_page_embeds_every_plot():
    page = (ROOT / performance.PAGE).read_text()
    for plot in performance.PLOTS:
        assert f"](../{plot})" in page


def test_every_cited_run_folder_has_its_record():
    cited = set()
    sources = _docs() + sorted(ROOT.glob("tidearray/**/*.py"))
    for src in sources:
        for name in re.findall(r"benchmarks/results/([A-Za-z0-9][A-Za-z0-9._-]*)",
                               src.read_text()):
            cited.add((src.relative_to(ROOT).as_posix(), name))
    assert any(src == performance.PAGE for src, _ in cited)
    for src, name in sorted(cited):
        run = ROOT / performance.RESULTS / name
        assert (run / "run.json").is_file(), (
            f"{src} cites {performance.RESULTS}/{name}, which has no run.json")


def test_every_run_folder_names_its_commit_machine_and_command():
    folders = sorted(p for p in (ROOT / performance.RESULTS).iterdir() if p.is_dir())
    assert folders
    page = (ROOT / performance.PAGE).read_text()
    for folder in folders:
        meta = json.loads((folder / "run.json").read_text())
        missing = [k for k in RUN_KEYS if not meta.get(k)]
        assert not missing, f"{folder.name}/run.json lacks {missing}"
        assert meta["name"] == folder.name
        assert meta["machine"] in performance.MACHINES, meta["machine"]
        assert re.fullmatch(r"[0-9a-f]{7,40}", meta["commit"]), meta["commit"]
        for rec in meta.get("records", []):
            assert (folder / rec).is_file(), f"{folder.name}/run.json lists {rec}: missing"
        # only the runs the page cites stay in the tree
        assert f"({folder.name}, {meta['machine']})" in page, f"{folder.name} is not cited"


def test_each_section_names_the_machine_of_its_record():
    page = performance.render_page(str(ROOT))
    for heading in re.findall(r"^### .*\((\S+), (\S+)\)$", page, re.M):
        run, machine = heading
        meta = json.loads((ROOT / performance.RESULTS / run / "run.json").read_text())
        assert meta["machine"] == machine


def test_every_relative_link_in_the_docs_resolves():
    pattern = re.compile(r"\]\(([^)\s]+)\)")
    missing = []
    for doc in _docs():
        for ref in pattern.findall(doc.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", ref) or ref.startswith("#"):
                continue
            if not (doc.parent / ref.split("#")[0]).resolve().exists():
                missing.append(f"{doc.relative_to(ROOT)}: {ref}")
    assert missing == [], "links to missing paths:\n" + "\n".join(missing)
