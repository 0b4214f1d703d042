"""The report's targets table: the reasons it gives for a missed goal."""

from __future__ import annotations

from benchmarks.harness import targets
from benchmarks.harness.tables import Results


def test_a_missed_gemm_target_names_the_narrow_accumulate_where_measured():
    """The GEMM-beside-TIDE-RS row's reason carries tide-narrow's figure from the same run
    (the default's figure stays the goal's), and says nothing of it where it did not run."""

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
