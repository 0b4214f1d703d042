"""A whole training step captured as a CUDA graph ([Note: captured steps] in
``tidearray.fsdp._graph``): ``examples/train.py --graph`` against the same trainer run
eagerly, for 50 steps with two micro-batches (gradient accumulation) and a learning-rate
warm-up (the rate changes on every replay): the losses must be bitwise equal.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from .._util import agree, skip_in_debug

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import train  # noqa: E402

import tidearray as ta  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
STEPS = 50


def _run(group, graph: bool, **extra) -> dict:
    argv = ["--model", "tiny", "--steps", str(STEPS), "--micro-batches", "2",
            "--lr-warmup", "20", "--seed", "3"]
    argv += ["--graph"] if graph else ["--capturable-model"]
    for k, v in extra.items():
        argv += [f"--{k}", str(v)]
    args = train.parse(argv)
    cfg, B = train.configure(args, group)
    return train.run(args, group, "tide", cfg, B, lambda *a: None)


def test_a_captured_step_replays_the_eager_losses(cuda_group):
    g = cuda_group
    skip_in_debug(g)
    eager, graph = _run(g, False), _run(g, True)
    failures = []
    if graph["impl"] != "tide-graph":
        failures.append(f"expected a captured run, got {graph['impl']}")
    if eager["losses"] != graph["losses"]:
        first = next(i for i, (a, b) in enumerate(zip(eager["losses"], graph["losses"]))
                     if a != b)
        failures.append(f"losses differ from step {first + 1}: eager {eager['losses'][first]!r}"
                        f", captured {graph['losses'][first]!r}")
    if not np.isfinite(graph["losses"]).all() or graph["losses"][-1] >= graph["losses"][0]:
        failures.append(f"the captured run did not train: {graph['losses'][::10]}")
    agree(g.comm, failures, "captured step")


def test_capturing_a_step_that_clips_is_refused(cuda_group):
    """Clipping agrees its norm on the host, which a graph cannot replay: refused with a
    clear error on every rank, not captured wrongly."""
    with pytest.raises(ta.TideInvalid, match="clipping is not captured"):
        _run(cuda_group, True, clip=1.0, steps=2)


def test_capturing_a_step_in_debug_mode_is_refused(cuda_group):
    if not cuda_group.config.debug:
        pytest.skip("debug mode only (tests/gpu/run.sh's debug step)")
    with pytest.raises(ta.TideInvalid, match="expected no debug mode"):
        _run(cuda_group, True, steps=2)
