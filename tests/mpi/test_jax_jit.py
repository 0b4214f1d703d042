"""``tidearray.jax``: sharded units inside one ``jax.jit`` step, multi-rank, on CPU JAX.

* a jitted sharded step (forward, ``jax.grad``, ``ShardAdamW``) against one JAX
  process training the same network on the global batch: losses within 1e-5 relative
  over 10 steps in fp32, within 3e-2 with bf16 parameters and fp32 reduction (the
  example's transformer, ``examples/jax_train.py``, makes the same check; CI runs it);
  ``command_buffer=True``'s staged plans once (XLA's command buffers exist on GPUs only:
  on CPU this checks the staged path's results);
* gathers bitwise against a NumPy reference (ragged and empty shards included), with
  the slot poisoned before each call;
* shard gradients against a float64 NumPy reference within the fp32 bound;
* the order the collectives run in: the forward gathers in unit order, then per unit
  in reverse its re-gather and its reduce-scatter, the same on every rank;
* errors: units that differ between ranks, bad leaves, ``jax.vmap``, a mesh context.

Fresh seeds every run (drawn on rank 0). Runs on the host backend at any world size;
the cuda path is ``tests/gpu/test_jax_jit_gpu.py``. Skipped without JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tidearray import TideInvalid
from tidearray.fsdp import AdamW

from .._util import agree
from ._cases import poison

jax = pytest.importorskip("jax")
jnp = jax.numpy
tj = pytest.importorskip("tidearray.jax")

pytestmark = pytest.mark.mpi
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def cpu_jax(group):
    if group.backend.name != "host":
        pytest.skip("CPU JAX: the host backend (cuda: tests/gpu/test_jax_jit_gpu.py)")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    return jax


def _seed(comm) -> int:
    return comm.bcast(int(np.random.default_rng().integers(2**31)) if comm.rank == 0 else None)


def _dense(p: dict, x: Any) -> Any:
    return jnp.tanh(x @ p["w"].T + p["b"])


def _chain_grads(su: Any, weights: Any = None) -> Any:
    """A jitted ``(shards, x) -> shard gradients`` of ``sum(weights * h)`` (``sum(h)`` without
    weights), ``h`` the units of ``su`` applied to ``x`` as a chain of tanh layers."""
    @jax.jit
    def grads(shards, x):
        def loss(shards):
            h = x
            for i in range(len(shards)):
                h = su.apply(i, _dense, shards[i], h)
            return jnp.sum(h if weights is None else h * weights)
        return jax.grad(loss)(shards)
    return grads


def _units(seed: int, widths: list[int]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i),
             "b": rng.standard_normal(o).astype(np.float32)}
            for i, o in zip(widths, widths[1:])]


def _train(step: Any, params: Any, opt: Any, batches: list) -> list[float]:
    state, losses = opt.init(params), []
    for k, (x, y) in enumerate(batches):
        params, state, loss = step(params, state, opt.coefficients(k + 1), x, y)
        losses.append(float(loss))
    return losses


#: (compute dtype, command_buffer): the in-place runner in both dtypes, the staged one once
#: ([Note: in place or staged] in tidearray/jax/_runners.py).
RUNS = [("float32", False), ("bfloat16", False), ("float32", True)]


@pytest.mark.parametrize("dtype,command_buffer", RUNS)
def test_jitted_step_matches_one_process(group, cpu_jax, dtype, command_buffer):
    """Ten jitted steps (forward, jax.grad, ShardAdamW) on each rank's samples against one
    process on all of them; the transformer is the example's (run by CI at 2 ranks).
    The bf16 and staged runs take 1-2 ranks in CI (two cores); fp32 in place any number."""
    if (dtype, command_buffer) != RUNS[0] and group.size > 2:
        pytest.skip("CI's time: the bf16 and staged runs at 1-2 ranks (the same collectives)")
    W, rank, seed = group.size, group.rank, _seed(group.comm)
    widths, steps = [6, 2 * W + 3, 8, 2], 10
    units = _units(seed, widths)
    data = [[np.random.default_rng([seed, k % 2, r]).standard_normal((4, widths[0]))
             .astype(np.float32) for r in range(W)] for k in range(steps)]
    targets = [[np.sin(x[:, :widths[-1]]) for x in xs] for xs in data]
    opt = tj.ShardAdamW(AdamW(lr=1e-2))

    def step_of(apply: Any) -> Any:
        def step(params, state, coef, x, y):
            def loss(params):
                h = x
                for i in range(len(units)):
                    h = apply(i, params[i], h)
                return jnp.mean((h.astype(jnp.float32) - y) ** 2)
            value, grads = jax.value_and_grad(loss)(params)
            return (*opt.update(params, grads, state, coef), value)
        return jax.jit(step)

    su = tj.shard_units(units, group=group, compute_dtype=jnp.dtype(dtype),
                        command_buffer=command_buffer)
    sharded = step_of(lambda i, p, h: su.apply(i, _dense, p, h))
    losses = _train(sharded, su.shards, opt, [(xs[rank], ys[rank])
                                               for xs, ys in zip(data, targets)])
    losses = [group.comm.allreduce(v) / W for v in losses]
    want = None
    if rank == 0:  # one reference, sent to all: four compiles would share CI's two cores
        whole = step_of(lambda i, p, h: _dense(jax.tree_util.tree_map(
            lambda a: a.astype(jnp.dtype(dtype)), p), h))
        want = _train(whole, jax.tree_util.tree_map(jnp.asarray, units), opt,
                      [(np.concatenate(xs), np.concatenate(ys)) for xs, ys in zip(data, targets)])
    want = group.comm.bcast(want)
    tol = 1e-5 if dtype == "float32" else 3e-2
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(losses, want))
                if abs(a - b) > tol * abs(b)]
    if not losses[-2] < losses[0]:  # the same samples
        failures.append(f"losses {losses} do not go down")
    agree(group.comm, failures, f"{dtype} jitted sharded step vs one JAX process (seed {seed})")


@pytest.mark.parametrize("dtype,command_buffer", [("float32", False), ("bfloat16", False),
                                                  ("bfloat16", True)])
def test_gather_bitwise(group, cpu_jax, dtype, command_buffer):
    W, seed = group.size, _seed(group.comm)
    rng = np.random.default_rng(seed)
    shapes = [(0, 3), (1, 2), (max(W - 1, 1), 5), (3 * W + 1,), (W, 2, 3)]
    full = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    su = tj.shard_units([full[:3], full[3:]], group=group, compute_dtype=jnp.dtype(dtype),
                        command_buffer=command_buffer)
    gather = jax.jit(lambda shards, i, x: su.apply(i, lambda p, _: p, shards[i], x),
                     static_argnums=1)
    failures = []
    for i, want in ((0, full[:3]), (1, full[3:])):
        poison(su.slot)
        got = gather(su.shards, i, jnp.zeros(2))
        for k, (a, w) in enumerate(zip(got, want)):
            w = w.astype(jnp.dtype(dtype))
            a = np.asarray(a)
            if a.shape != w.shape or a.dtype != w.dtype or a.tobytes() != w.tobytes():
                failures.append(f"unit {i} parameter {k} {w.shape}: gathered bits differ")
    agree(group.comm, failures, f"{dtype} gathers in a jit vs NumPy (seed {seed})")


def _reference_grads(units: list, x: np.ndarray, c: np.ndarray) -> list[dict]:
    """float64 gradients of ``sum(c * net(x))`` for the tanh network, and each gradient's
    magnitude bound (the same products in absolute values)."""
    hs, h = [x], x
    for u in units:
        h = np.tanh(h @ u["w"].T + u["b"])
        hs.append(h)
    dh, out = c, []
    for u, hin, hout in zip(reversed(units), reversed(hs[:-1]), reversed(hs[1:])):
        dz = dh * (1 - hout ** 2)
        out.append({"w": (dz.T @ hin, np.abs(dz).T @ np.abs(hin)),
                    "b": (dz.sum(0), np.abs(dz).sum(0))})
        dh = dz @ u["w"]
    return out[::-1]


def test_shard_grads_against_float64(group, cpu_jax):
    W, rank, seed = group.size, group.rank, _seed(group.comm)
    widths = [5, 2 * W + 1, 3]
    units = _units(seed, widths)
    su = tj.shard_units(units, group=group)
    xs = [np.random.default_rng([seed, r]).standard_normal((4, widths[0])) for r in range(W)]
    c = np.random.default_rng([seed, W]).standard_normal((4, widths[-1]))

    got = _chain_grads(su, c.astype(np.float32))(su.shards, xs[rank].astype(np.float32))
    u64 = [{k: v.astype(np.float64) for k, v in u.items()} for u in units]
    per_rank = [_reference_grads(u64, x, c) for x in xs]
    failures = []
    for i, u in enumerate(units):
        for name, a in u.items():
            want = sum(r[i][name][0] for r in per_rank) / W
            mag = sum(r[i][name][1] for r in per_rank) / W
            bound = 8 * (4 * W + widths[i] + 4) * EPS32 * (mag + np.abs(want)) + 1e-30
            c0 = -(-a.shape[0] // W)
            rows = slice(rank * c0, min((rank + 1) * c0, a.shape[0]))
            g = np.asarray(got[i][name], np.float64)
            n = max(rows.stop - rows.start, 0)
            err = np.abs(g[:n] - want[rows]) - bound[rows]
            if err.size and err.max() > 0:
                failures.append(f"unit {i} {name}: {int((err > 0).sum())} elements outside "
                                f"the fp32 bound, worst by {err.max():.3g}")
            if np.any(g[n:] != 0):
                failures.append(f"unit {i} {name}: padding rows of the gradient are not zero")
    agree(group.comm, failures, f"shard gradients vs float64 (seed {seed})")


def test_collective_order(group, cpu_jax, monkeypatch):
    """Forward gathers in unit order, then per unit in reverse its re-gather and its
    reduce-scatter, whatever XLA's scheduling; the same on every rank."""
    from tidearray.jax._runners import InPlace

    log: list[str] = []
    real_ag, real_rs = InPlace.gather, InPlace.reduce

    def ag(self, index, *args):
        log.append(f"ag{index}")
        return real_ag(self, index, *args)

    def rs(self, index, *args):
        log.append(f"rs{index}")
        return real_rs(self, index, *args)

    monkeypatch.setattr(InPlace, "gather", ag)
    monkeypatch.setattr(InPlace, "reduce", rs)
    widths = [3, 4, 5, 6, 7]
    su = tj.shard_units(_units(_seed(group.comm), widths), group=group)

    # sum(h): the last unit's output cotangent is a constant ([Note: collective order in
    # a jitted step] in tidearray/jax/_units.py).
    jax.block_until_ready(_chain_grads(su)(su.shards, jnp.ones((2, 3))))
    n = len(widths) - 1
    want = [f"ag{i}" for i in range(n)]
    for i in reversed(range(n)):
        want += [f"ag{i}", f"rs{i}"]
    failures = [] if log == want else [f"collectives ran as {log}, expected {want}"]
    everyone = group.comm.allgather(log)
    if any(o != everyone[0] for o in everyone):
        failures.append(f"ranks ran their collectives in different orders: {everyone}")
    agree(group.comm, failures, "collective order in a jitted step")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["shape", "dtype", "structure"])
def test_units_differing_between_ranks(group, cpu_jax, differ):
    units = [{"w": np.zeros((4, 3), np.float32)}]
    if group.rank == 1:
        units = {"shape": [{"w": np.zeros((4, 2), np.float32)}],
                 "dtype": [{"w": np.zeros((4, 3), np.float16)}],
                 "structure": [{"v": np.zeros((4, 3), np.float32)}]}[differ]
    with pytest.raises(TideInvalid, match="shard_units"):
        tj.shard_units(units, group=group)


def test_bad_leaves_vmap_and_mesh(group, cpu_jax):
    for bad in ([{"w": np.zeros((), np.float32)}], [{"w": np.zeros(3, np.int32)}]):
        with pytest.raises(TideInvalid, match="expected a floating array"):
            tj.shard_units(bad, group=group)
    su = tj.shard_units([{"w": np.ones((2, 3), np.float32), "b": np.zeros(2, np.float32)}],
                        group=group)
    with pytest.raises(TideInvalid, match="vmap"):
        jax.vmap(lambda x: su.apply(0, _dense, su.shards[0], x))(jnp.ones((4, 1, 3)))
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        with pytest.raises(TideInvalid, match="mesh"):
            jax.jit(lambda s, x: su.apply(0, _dense, s, x))(su.shards[0], jnp.ones((4, 3)))


def test_the_cuda_path_is_opt_in(group, cpu_jax, monkeypatch):
    """On the cuda backend ``shard_units`` refuses, on every rank, unless ``jax_cuda`` is
    set (docs/jax.md, Limits); seen here through the backend's name."""
    units = [{"w": np.ones((4, 3), np.float32)}]
    monkeypatch.setattr(group.backend, "name", "cuda")
    monkeypatch.setattr(group.backend, "device", 0, raising=False)
    with pytest.raises(TideInvalid, match="TIDE_JAX_CUDA=1"):
        tj.shard_units(units, group=group)
    monkeypatch.setattr(group, "config", dataclasses.replace(group.config, jax_cuda=True))
    with pytest.raises(TideInvalid) as e:  # still no JAX GPU here: only that is said
        tj.shard_units(units, group=group)
    assert "TIDE_JAX_CUDA" not in str(e.value) and "JAX gpu device" in str(e.value)
