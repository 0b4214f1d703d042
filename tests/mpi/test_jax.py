"""``examples/jax_train.py``'s trainer (one ``jax.vjp`` per unit on ``ShardedModel``) against
one JAX process, multi-rank, on the host backend.

Every rank trains the example's network on its own samples through the runtime; every
rank then trains the same network in one process on all the ranks' samples with the
optimizer's NumPy AdamW step. The losses must agree within 1e-5 relative for the
example's 10 steps, in fp32, and go down. Skipped without JAX.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .._util import agree

jax = pytest.importorskip("jax")
pytest.importorskip("jax.dlpack")

pytestmark = pytest.mark.mpi
LOSS_RTOL = 1e-5
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jax_train.py"


def _example():
    spec = importlib.util.spec_from_file_location("jax_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_per_unit_vjp_matches_one_jax_process(group):
    if group.backend.name != "host":
        pytest.skip("CPU JAX: the host backend")
    ex = _example()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    losses, bridge = ex.train_sharded(jax, group)
    with jax.default_device(bridge.device):
        want = ex.train_reference(jax, group.size)
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(losses, want))
                if abs(a - b) > LOSS_RTOL * abs(b)]
    if len(losses) != len(want) or not losses[-1] < losses[0]:
        failures.append(f"losses {losses} against reference {want}")
    agree(group.comm, failures, "per-unit jax.vjp on ShardedModel vs one JAX process")
