"""The benchmark's verified call can fail: a wrong result fails the run.

``python -m benchmarks`` verifies one more call of every implementation on renewed
inputs into poisoned outputs, and exits nonzero if any is wrong. These tests run the
reduce-scatter suite in process on a small unit and make the check fail on purpose:
an implementation whose tolerance its (correct, inexact) fp32 sums exceed, and one whose
output is scaled wrong. A correct run returns 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.__main__ import main
from benchmarks.harness import impls

pytestmark = pytest.mark.mpi
ARGS = ["rs", "--quick", "--iters", "2", "--warmup", "1", "--workloads", "units",
        "--impls", "tide,stock", "--units", "llama3.1-8b"]


def _run(group, tmp_path_factory) -> int:
    out = group.comm.bcast(str(tmp_path_factory.mktemp("bench")) if group.rank == 0 else None)
    return group.comm.allreduce(main([*ARGS, "--out", out]), op=max_op())


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def test_a_correct_run_passes(group, tmp_path_factory):
    if group.backend.name != "host":
        pytest.skip("runs the host implementations")
    assert _run(group, tmp_path_factory) == 0


def test_an_error_beyond_tolerance_fails_the_run(group, tmp_path_factory, monkeypatch):
    """fp32 sums of inexact terms are off by ~3e-8; a tolerance of 0 must fail."""
    if group.backend.name != "host":
        pytest.skip("runs the host implementations")
    if group.size == 1:
        pytest.skip("one rank sums one term: exact")
    monkeypatch.setattr(impls.HostStock, "rs_tolerance", 0.0)
    assert _run(group, tmp_path_factory) == 1


def test_a_wrongly_scaled_result_fails_the_run(group, tmp_path_factory, monkeypatch):
    if group.backend.name != "host":
        pytest.skip("runs the host implementations")
    setup = impls.HostStock.setup

    def scaled_wrong(self, data):
        prep = setup(self, data)
        rs = prep.rs

        def wrong() -> None:
            rs()
            for o in prep.rs_out():
                np.multiply(o, np.float32(1.001), out=o)

        prep.rs = wrong
        return prep

    monkeypatch.setattr(impls.HostStock, "setup", scaled_wrong)
    assert _run(group, tmp_path_factory) == 1
