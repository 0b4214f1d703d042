"""The report's targets table: the reasons it gives for a missed goal."""

from __future__ import annotations

from benchmarks.harness import targets
from benchmarks.harness.tables import Results


def test_a_missed_gemm_target_gives_each_pair_where_recorded():
    """The GEMM-beside-TIDE-RS row's reason gives each alone-then-beside pair's slowdown
    beside the median where the record has them, and none where it does not."""

    def rec(value: float, **extra) -> dict:
        return {"suite": "interference", "impl": "tide", "workload": "llama3.1-8b",
                "metric": f"rs:{targets.GEMM}", "value": value, "unit": "fraction",
                "status": "ok", "extra": {"collective_alone_s": 7e-4, **extra}}

    alone = targets.gemm_rows(Results([rec(0.2)]))[0]
    assert alone.measured == 0.2 and not alone.met and "pairs" not in alone.why
    paired = targets.gemm_rows(Results([rec(0.2, slowdowns=[0.18, 0.2, 0.25])]))[0]
    assert "overlapped; pairs +18.0%, +20.0%, +25.0%" in paired.why
