"""jax_step.py's goals from records: compile times compared only between alike compiles."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
from benchmarks.steps import jax_step  # noqa: E402


def _rec(impl: str, compile_s: float, cache: object = None, cpu_s: float = 0.005) -> dict:
    r = {"impl": impl, "compile_s": compile_s, "median_step_s": 0.05, "median_cpu_s": cpu_s}
    return r if cache is None else {**r, "xla_cache": cache}


def test_a_compile_that_found_the_autotuning_warm_is_not_compared():
    lines = jax_step.targets({"tidearray": _rec("tidearray", 90.0, "cold"),
                              "unsharded": _rec("unsharded", 20.0, "warm")})
    compile_line = next(ln for ln in lines if ln.startswith("- compile time"))
    assert "not compared" in compile_line and "met" not in compile_line


@pytest.mark.parametrize("ref_s, verdict", [(80.0, "met"), (50.0, "NOT met")])
def test_alike_compiles_are_judged_against_the_bound(ref_s, verdict):
    for cache in ("cold", None):  # a process each (jaxcompile), or records before the field
        lines = jax_step.targets({"tidearray": _rec("tidearray", 90.0, cache),
                                  "unsharded": _rec("unsharded", ref_s, cache)})
        compile_line = next(ln for ln in lines if ln.startswith("- compile time"))
        assert compile_line.endswith(f"{verdict})"), compile_line


def test_host_cpu_is_judged_in_milliseconds_over_the_reference():
    lines = jax_step.targets({"tidearray": _rec("tidearray", 1.0, cpu_s=0.0095),
                              "unsharded": _rec("unsharded", 1.0, cpu_s=0.0070)})
    cpu = next(ln for ln in lines if ln.startswith("- host CPU"))
    assert "+2.50 ms" in cpu and cpu.endswith("NOT met)")
