"""The GPU fixtures of ``tests/gpu/conftest.py`` (a cuda group, skipped cleanly without a
GPU, on every rank together; this rank's device current around each test)."""

from tests.gpu.conftest import _own_device, cp, cuda_group  # noqa: F401
