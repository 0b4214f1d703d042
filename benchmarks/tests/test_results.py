"""The README's Results section is exactly what the records say.

``python -m benchmarks results`` writes the section from the records under
docs/benchmarks; a figure edited by hand, or a record replaced without rewriting the
section, fails here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from benchmarks.__main__ import main
from benchmarks.harness import results

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_section_is_generated_from_the_records():
    assert results.current(str(ROOT / "README.md")) == results.render(str(ROOT))


def test_a_figure_edited_by_hand_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    text = readme.read_text()
    section = results.current(str(readme))
    figure = re.search(r"\*\*(\d+\.\d+)x\*\*", section).group(1)  # a bold ratio
    edited = section.replace(f"**{figure}x**", f"**{float(figure) + 0.01:.2f}x**", 1)
    assert edited != section
    readme.write_text(text.replace(section, edited))
    assert main(["results", "--readme", str(readme), "--root", str(ROOT), "--check"]) == 1
    assert main(["results", "--readme", str(readme), "--root", str(ROOT)]) == 0
    assert main(["results", "--readme", str(readme), "--root", str(ROOT), "--check"]) == 0
    assert readme.read_text() == text


def test_a_missed_gemm_target_names_the_narrow_accumulate_where_measured():
    """The GEMM-beside-TIDE-RS row's reason carries tide-narrow's figure from the same run
    (the default's figure stays the goal's), and says nothing of it where it did not run."""
    from benchmarks.harness import targets
    from benchmarks.harness.tables import Results

    def rec(impl: str, value: float, **extra) -> dict:
        return {"suite": "interference", "impl": impl, "workload": "llama3.1-8b",
                "metric": f"rs:{targets.GEMM}", "value": value, "unit": "fraction",
                "status": "ok", "extra": {"collective_alone_s": 7e-4, **extra}}

    both = targets.gemm_rows(Results([rec("tide", 0.2), rec("tide-narrow", 0.03)]))[0]
    assert both.measured == 0.2 and not both.met
    assert "tide-narrow, opt-in): +3.0%, TIDE-RS" in both.why
    alone = targets.gemm_rows(Results([rec("tide", 0.2)]))[0]
    assert "narrow" not in alone.why and "pairs" not in alone.why
    # each pair's slowdown, where recorded: a slow pair shows beside the median
    paired = targets.gemm_rows(Results([
        rec("tide", 0.2, slowdowns=[0.18, 0.2, 0.25]),
        rec("tide-narrow", 0.03, slowdowns=[0.02, 0.03, 0.85])]))[0]
    assert "overlapped; pairs +18.0%, +20.0%, +25.0%" in paired.why
    assert "opt-in): +3.0%; pairs +2.0%, +3.0%, +85.0%, TIDE-RS" in paired.why
