"""Streams and interop on the cuda backend.

* ``stream=`` as a CuPy stream, an int handle and a ``__cuda_stream__`` object;
  the collective is ordered after work the user queued on that stream (a
  kernel that spins ~20 ms before it writes the inputs);
* ``async_op=True``: ``Work.wait(stream)`` orders another stream, no host sync;
* DLPack inputs from PyTorch and JAX, where importable;
* inputs on the wrong device or on the host raise ``TideInvalid``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tidearray
from tidearray.layout import shard_shape

from ._units import BF16, bf16_normal, bf16_to_f64, padded_shard, shard_rows

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SHAPES = [(300, 128), (7,), (64, 33), (2, 1)]

_LATE_FILL = r"""
extern "C" __global__ void late_fill(unsigned short* dst, const unsigned short* src,
                                     long long n, long long cycles) {
    if (threadIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }
    __syncthreads();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


class _StreamObj:
    """A foreign stream: only ``__cuda_stream__``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _agree(group, bad, what):
    everything = group.comm.allgather(bad)
    lines = [f"rank {r}: {f}" for r, fs in enumerate(everything) for f in fs]
    assert not lines, what + ":\n" + "\n".join(lines[:20])


def _full(cp, group, seed=1234):
    seed = group.comm.bcast(seed, root=0)
    return [bf16_normal(cp, seed + i, s) for i, s in enumerate(SHAPES)]


def _compare(cp, outs, full) -> list[str]:
    return [f"parameter {i} differs" for i, (o, f) in enumerate(zip(outs, full))
            if not bool((o.view(cp.uint16) == f.view(cp.uint16)).all())]


@pytest.mark.parametrize("kind", ["cupy", "int", "cuda_stream"])
def test_stream_argument_orders_after_user_work(cuda_group, cp, kind):
    g = cuda_group
    full = _full(cp, g)
    src = [padded_shard(cp, f, g.size, g.rank) for f in full]
    dst = [cp.zeros_like(s) for s in src]
    s = cp.cuda.Stream(non_blocking=True)
    stream = {"cupy": s, "int": s.ptr, "cuda_stream": _StreamObj(s.ptr)}[kind]
    cp.cuda.runtime.deviceSynchronize()
    kernel = cp.RawKernel(_LATE_FILL, "late_fill")
    with s:  # the inputs are written only after ~20 ms on the user's stream
        for d, x in zip(dst, src):
            kernel((1,), (256,), (d.view(cp.uint16), x.view(cp.uint16), np.int64(d.size),
                                  np.int64(40_000_000)))
    outs = tidearray.all_gather(dst, SHAPES, group=g, stream=stream)
    s.synchronize()
    _agree(g, _compare(cp, outs, full), f"AG on a {kind} stream")


def test_async_work_waits_on_device(cuda_group, cp):
    g = cuda_group
    full = _full(cp, g, 99)
    shards = [padded_shard(cp, f, g.size, g.rank) for f in full]
    other = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.deviceSynchronize()
    work = tidearray.all_gather(shards, SHAPES, group=g, async_op=True)
    outs = work.wait(other)  # orders `other`, returns without blocking the host
    other.synchronize()
    assert work.is_completed()
    _agree(g, _compare(cp, outs, full), "async AG")


def test_reduce_scatter_on_side_stream(cuda_group, cp):
    g = cuda_group
    W, r = g.size, g.rank
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        grads = [bf16_normal(cp, 77 + 100 * r + i, sh) for i, sh in enumerate(SHAPES)]
    res = tidearray.reduce_scatter(grads, op="sum", group=g, stream=s)
    s.synchronize()
    bad = []
    for i, sh in enumerate(SHAPES):
        a, b = shard_rows(sh[0], W, r)
        ref = sum(bf16_to_f64(cp, bf16_normal(cp, 77 + 100 * q + i, sh)[a:b]) for q in range(W))
        if not bool(cp.allclose(res[i][: b - a], ref, rtol=W * 2.0**-22, atol=0)):
            bad.append(f"parameter {i}: wrong sum")
    _agree(g, bad, "RS on a side stream")


def test_torch_dlpack_inputs(cuda_group, cp):
    torch = pytest.importorskip("torch")
    g = cuda_group
    dev = g.backend.device
    full = _full(cp, g, 555)
    shards = [torch.from_dlpack(padded_shard(cp, f, g.size, g.rank)) for f in full]
    assert shards[0].dtype == torch.bfloat16 and shards[0].device.index == dev
    outs = tidearray.all_gather(shards, SHAPES, group=g)
    cp.cuda.runtime.deviceSynchronize()
    bad = _compare(cp, outs, full)
    grads = [torch.ones(sh, dtype=torch.bfloat16, device=f"cuda:{dev}") for sh in SHAPES]
    outs32 = [torch.full(shard_shape(sh, g.size), float("nan"), device=f"cuda:{dev}")
              for sh in SHAPES]
    torch.cuda.synchronize(dev)
    tidearray.reduce_scatter(grads, op="sum", out=outs32, group=g)
    cp.cuda.runtime.deviceSynchronize()
    for i, (o, sh) in enumerate(zip(outs32, SHAPES)):
        a, b = shard_rows(sh[0], g.size, g.rank)
        if not bool((o[: b - a] == g.size).all()) or bool((o[b - a:] != 0).any()):
            bad.append(f"torch out {i}: wrong values")
    _agree(g, bad, "torch DLPack")


def test_jax_dlpack_inputs(cuda_group, cp):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    g = cuda_group
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    cp.cuda.Device(g.backend.device).use()  # JAX's start-up leaves another device current
    if len(gpus) <= g.backend.device:
        pytest.skip("JAX does not see this rank's GPU")
    full = _full(cp, g, 777)
    host = [cp.asnumpy(padded_shard(cp, f, g.size, g.rank).view(cp.uint16)).view(BF16)
            for f in full]
    shards = [jax.device_put(h, gpus[g.backend.device]) for h in host]
    outs = tidearray.all_gather(shards, SHAPES, group=g)
    cp.cuda.runtime.deviceSynchronize()
    _agree(g, _compare(cp, outs, full), "JAX DLPack")


def test_host_and_foreign_device_inputs_rejected(cuda_group, cp):
    g = cuda_group
    host = [np.zeros(shard_shape(s, g.size), BF16) for s in SHAPES]
    with pytest.raises(tidearray.TideInvalid, match="expected an array on cuda"):
        tidearray.all_gather(host, SHAPES, group=g)
    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        return
    with cp.cuda.Device((g.backend.device + 1) % n):
        other = [cp.zeros(shard_shape(s, g.size), cp.float32) for s in SHAPES]
    want = f"expected an array on cuda:{g.backend.device}"
    with pytest.raises(tidearray.TideInvalid, match=want):
        tidearray.all_gather(other, SHAPES, group=g)


class _XlaLikeBuffer:
    """What ``wrap`` reads of XLA's buffer in a callback: ``__cuda_array_interface__`` and
    ``dtype``, and nothing that keeps the memory alive."""

    def __init__(self, a) -> None:
        self.__cuda_array_interface__ = a.__cuda_array_interface__
        self.dtype = a.dtype


def test_wrap_keeps_its_arrays_by_address_shape_and_dtype(cuda_group, cp):
    """The arrays over XLA's buffers are made once per address, shape and dtype (a jitted
    step meets the same ones every step) and never alias a buffer of another shape or
    dtype at the same address."""
    be = cuda_group.backend
    rng = np.random.default_rng()
    base = cp.asarray(rng.standard_normal(96).astype(np.float32))
    first = be.wrap(_XlaLikeBuffer(base))
    assert first.data.ptr == base.data.ptr and first.shape == (96,)
    assert be.wrap(_XlaLikeBuffer(base)) is first
    first[:] = 7.0  # writes reach the buffer: no copy
    assert bool((base == 7.0).all())
    reshaped = be.wrap(_XlaLikeBuffer(base.reshape(8, 12)))
    assert reshaped is not first and reshaped.shape == (8, 12)
    as_int = be.wrap(_XlaLikeBuffer(base.view(cp.int32)))
    assert as_int is not first and as_int.dtype == np.int32
    other = cp.zeros(96, cp.float32)
    assert be.wrap(_XlaLikeBuffer(other)).data.ptr == other.data.ptr
