"""A whole training step captured as a CUDA graph ([Note: captured steps] in
``tidearray.fsdp._graph``): ``examples/train.py --graph`` against the same trainer run
eagerly, for 50 steps with two micro-batches (gradient accumulation) and a learning-rate
warm-up (the rate changes on every replay), without and with clipping: the losses (and
the clipping's norms) must be bitwise equal.
"""

from __future__ import annotations

import numpy as np
import pytest

import tidearray as ta

from ..._util import agree, skip_in_debug
from ...support import example

train = example("train")

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


def _compare(g, eager: dict, graph: dict, what: str) -> None:
    failures = []
    if graph["impl"] != "tide-graph":
        failures.append(f"expected a captured run, got {graph['impl']}")
    for key in ("losses", "norms"):
        if eager[key] != graph[key]:
            first = next(i for i, (a, b) in enumerate(zip(eager[key], graph[key])) if a != b)
            failures.append(f"{key} differ from step {first + 1}: eager {eager[key][first]!r}"
                            f", captured {graph[key][first]!r}")
    if not np.isfinite(graph["losses"]).all() or graph["losses"][-1] >= graph["losses"][0]:
        failures.append(f"the captured run did not train: {graph['losses'][::10]}")
    agree(g.comm, failures, what)


def test_a_captured_step_replays_the_eager_losses(cuda_group):
    g = cuda_group
    skip_in_debug(g)
    _compare(g, _run(g, False), _run(g, True), "captured step")


def test_a_captured_step_that_clips_replays_the_eager_losses_and_norms(cuda_group):
    """Clipping at a norm below the gradients' on most steps: the norm and the clip factor
    are device work in the graph ([Note: global norm] in ``tidearray.fsdp._norm``), with
    the eager step's bits."""
    g = cuda_group
    skip_in_debug(g)
    clip = 0.05
    eager, graph = _run(g, False, clip=clip), _run(g, True, clip=clip)
    _compare(g, eager, graph, "captured step with clipping")
    clipped = [n for n in eager["norms"] if n > clip]  # NaN: not clipped
    agree(g.comm, [f"{len(clipped)} of {STEPS} steps clipped: norms {eager['norms'][:5]}"]
          if len(clipped) < STEPS * 0.8 else [], "clipping active")


def test_capturing_a_step_in_debug_mode_is_refused(cuda_group):
    if not cuda_group.config.debug:
        pytest.skip("debug mode only (tests/gpu/run.sh's debug step)")
    with pytest.raises(ta.TideInvalid, match="expected no debug mode"):
        _run(cuda_group, True, steps=2)
