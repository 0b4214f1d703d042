"""The JAX multi-rank tests' fixture: CPU JAX on the host backend, matmuls at full precision."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cpu_jax(group):
    """JAX on the CPU (skips on another backend: the cuda path has its own tests), matmuls
    in full fp32 so that a sharded run and one process agree to fp32's roundings."""
    jax = pytest.importorskip("jax")
    if group.backend.name != "host":
        pytest.skip("CPU JAX: the host backend (cuda: tests/jax/gpu/test_jax_jit_gpu.py)")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    return jax
