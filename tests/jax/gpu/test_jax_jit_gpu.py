"""``tidearray.jax`` on the cuda backend: the collectives on XLA's stream inside one jit.

* ``examples/jax_train.py``'s transformer, ten jitted steps against one JAX process
  on the global batch, the gradient clipped by its global norm: 1e-4 relative loss in
  fp32 (matmuls at full precision), the blocks under ``lax.scan`` and unrolled; 3e-2
  with bf16 parameters and fp32 reduction, scanned;
* ``ShardedUnits.full_params`` after the fp32 runs: every leaf of the trained model,
  gathered whole on every rank, within 1e-3 of the reference's (``PARAM_RTOL``);
* no host synchronization inside a step (scanned blocks, the clip's norm gathered over
  the ranks): every CuPy and tidearray synchronize entry point is counted while a
  (warmed-up) step runs, and must stay at zero;
* at one rank the first test takes XLA's casts (the default, [Note: one rank] in
  ``tidearray/jax/_runners.py``), the others tidearray's plans (``xla_at_one_rank=False``);
* ``command_buffer=True`` (staged plans; XLA may record the collectives into its command
  buffers and replay them): the same losses as without, to 1e-6 (the same collectives,
  summed in the same order: equal bits are expected); how often the callbacks' Python
  ran is printed.

Ranks may share one GPU (``bash tests/gpu/run.sh`` step ``jaxjit``: 1-4 ranks). Skipped
without a usable GPU or without a CUDA JAX.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ranks share the GPU
jax = pytest.importorskip("jax")

from ..._util import agree  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "jax_train.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("jax_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gpu_jax(cuda_group):
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if not all(cuda_group.comm.allgather(has_gpu)):
        pytest.skip("no CUDA JAX on every rank (pip install 'jax[cuda12]')")
    return _example().setup_jax(cuda_group)


#: fp32 parameters after ten steps, relative to each leaf's norm: AdamW divides each update
#: by its gradient's root mean square, so where a gradient is near zero (the leaves that start
#: at zero: biases, norms' shifts) its summation-order differences become steps of the
#: learning rate's size (1.2e-4 at 3 ranks on one H200). A wrong gather is off by O(1).
PARAM_RTOL = 1e-3


@pytest.mark.parametrize("dtype,tol,scan", [("float32", 1e-4, True), ("float32", 1e-4, False),
                                            ("bfloat16", 3e-2, True)],
                         ids=["float32-scan", "float32-unrolled", "bfloat16-scan"])
def test_jitted_step_matches_one_process(cuda_group, gpu_jax, dtype, tol, scan):
    ex = _example()
    cfg = ex.Config(layers=2, width=64, heads=4, seq=32, batch=4, scan=scan)
    assert cfg.max_grad_norm is not None  # the example clips: the norm's gather runs too
    losses, su, shards = ex.train_sharded(jax, cuda_group, cfg, dtype)
    with jax.default_device(su.device):
        want, _, trained = ex.reference_run(jax, cfg, cuda_group.size)
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(losses, want))
                if abs(a - b) > tol * abs(b)]
    # The trained model whole on every rank (gathered from the device shards): in fp32 each
    # leaf within PARAM_RTOL of the reference's (bf16: as the example, not bounded).
    model = su.full_params(shards)
    if dtype == "float32":
        failures += [f"full_params {path}: relative difference {diff:.2e} from the "
                     "reference's (inf: not a float32 NumPy array of its shape)"
                     for path, diff in ex.param_differences(jax, cfg, model, trained)
                     if not diff <= PARAM_RTOL]
    agree(cuda_group.comm, failures, f"{dtype} jitted sharded step on cuda vs one JAX process")


class _Syncs:
    """Counts calls of every host synchronize entry point that can be patched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, group: Any) -> None:
        import cupy

        self.calls: list[str] = []
        self.counting = False
        targets = [(cupy.cuda.Stream, "synchronize"), (cupy.cuda.ExternalStream, "synchronize"),
                   (cupy.cuda.Event, "synchronize"), (cupy.cuda.Device, "synchronize"),
                   (cupy.cuda.runtime, "deviceSynchronize"),
                   (cupy.cuda.runtime, "streamSynchronize"),
                   (cupy.cuda.runtime, "eventSynchronize"), (group.backend, "synchronize"),
                   (group, "synchronize")]
        self.unpatched = []
        for owner, name in targets:
            try:
                monkeypatch.setattr(owner, name, self._wrap(f"{owner!r}.{name}",
                                                            getattr(owner, name)))
            except (TypeError, AttributeError):  # a Cython type: its calls go uncounted
                self.unpatched.append(f"{owner!r}.{name}")

    def _wrap(self, label: str, real: Callable) -> Callable:
        def counted(*args: Any, **kw: Any) -> Any:
            if self.counting:
                self.calls.append(label)
            return real(*args, **kw)
        return counted


#: Steps before a step must be free of host synchronizations. The first compiles and
#: builds each in-place plan; with unit graphs (the default) a plan is captured at its
#: second call, a device wait each ([Note: graph plans on cuda] in
#: backends/cuda/graphs.py): in the first step for a plan met twice in it, else in the
#: second, or in the third for a plan first met in the second (where XLA's buffers of a
#: step differ from the step before's).
WARMUP_STEPS = 3
#: Steps counted after the warm-up: enough to see a plan built and captured again later.
COUNTED_STEPS = 5


@pytest.mark.parametrize("command_buffer", [False, True])
def test_no_host_synchronize_inside_a_step(cuda_group, gpu_jax, monkeypatch, command_buffer):
    import tidearray.jax as tj
    from tidearray.fsdp import AdamW

    ex = _example()
    cfg = ex.Config()  # the blocks under lax.scan, the gradient clipped
    units, fns, stacked = ex.sharded_model(jax, cfg)
    su = tj.shard_units(units, group=cuda_group, stacked=stacked,
                        command_buffer=command_buffer, xla_at_one_rank=False)
    opt = tj.ShardAdamW(AdamW(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm), group=cuda_group)
    step = ex.sharded_step(jax, su, fns, opt)
    shards, state = su.shards, opt.init(su.shards)
    tokens, targets = (jax.device_put(a, su.device) for a in ex.batch(cfg, 0, cuda_group.rank))
    for k in range(WARMUP_STEPS):
        shards, state, _ = jax.block_until_ready(step(shards, state, opt.coefficients(k + 1),
                                                      tokens, targets))
    syncs = _Syncs(monkeypatch, cuda_group)
    syncs.counting = True
    per_step = []
    for k in range(COUNTED_STEPS):
        shards, state, loss = step(shards, state, opt.coefficients(WARMUP_STEPS + k + 1),
                                   tokens, targets)
        jax.block_until_ready(loss)  # JAX's own wait: not patched
        per_step.append(len(syncs.calls) - sum(per_step))
    syncs.counting = False
    failures = [f"{len(syncs.calls)} host synchronizations in {COUNTED_STEPS} steps "
                f"({per_step} per step): {syncs.calls[:8]}"] if syncs.calls else []
    if cuda_group.rank == 0 and syncs.unpatched:
        print(f"not counted (Cython types): {syncs.unpatched}")
    agree(cuda_group.comm, failures, "host synchronizations inside a jitted step")


def test_command_buffers_give_the_same_losses(cuda_group, gpu_jax, monkeypatch):
    from tidearray.jax import _units

    calls = {"gather": 0, "reduce": 0}

    def counting(kind: str, real: Callable) -> Callable:
        def cb(self: Any, *args: Any) -> None:
            calls[kind] += 1
            return real(self, *args)
        return cb

    monkeypatch.setattr(_units._UnitCollectives, "_gather_cb",
                        counting("gather", _units._UnitCollectives._gather_cb))
    monkeypatch.setattr(_units._UnitCollectives, "_reduce_cb",
                        counting("reduce", _units._UnitCollectives._reduce_cb))
    ex = _example()
    cfg = ex.Config(steps=6)
    runs = {}
    for command_buffer in (False, True):
        calls.update(gather=0, reduce=0)
        runs[command_buffer] = _train(ex, cuda_group, cfg, command_buffer), dict(calls)
    (plain, plain_calls), (recorded, recorded_calls) = runs[False], runs[True]
    if cuda_group.rank == 0:
        print(f"callback Python calls in {cfg.steps} steps: {plain_calls} without command "
              f"buffers, {recorded_calls} with")
    failures = [f"step {k}: {a!r} with command buffers, {b!r} without"
                for k, (a, b) in enumerate(zip(recorded, plain)) if abs(a - b) > 1e-6 * abs(b)]
    agree(cuda_group.comm, failures, "command buffers vs callbacks every step")


def _train(ex: Any, group: Any, cfg: Any, command_buffer: bool) -> list[float]:
    import tidearray.jax as tj
    from tidearray.fsdp import AdamW

    su = tj.shard_units(ex.init_units(cfg), group=group, command_buffer=command_buffer,
                        xla_at_one_rank=False)
    opt = tj.ShardAdamW(AdamW(lr=cfg.lr))
    step = ex.sharded_step(jax, su, ex.unit_fns(jax, cfg), opt)
    shards, state, losses = su.shards, opt.init(su.shards), []
    for s in range(cfg.steps):
        tokens, targets = (jax.device_put(a, su.device) for a in ex.batch(cfg, s, group.rank))
        shards, state, loss = step(shards, state, opt.coefficients(s + 1), tokens, targets)
        losses.append(float(np.asarray(loss)))
    return losses
