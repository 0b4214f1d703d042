"""The cuda backend's pieces, each on its own: accumulate kernel, copier, flags, capabilities.

Also the claim that TIDE-AG launches no kernels for a unit of fewer than
``local_copy_kernel_min`` arrays, checked with CUPTI through ``torch.profiler``
(skipped without PyTorch).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import pytest

import tidearray
from tidearray.backends._base import AccumPiece
from tidearray.layout import shard_shape

from ..._util import fresh_seed, stall
from ._units import UNITS

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _host_accumulate(srcs: list, scale: float) -> np.ndarray:
    """What the host backend computes: out = s0; out += s1 ...; out *= scale (fp32)."""
    out = srcs[0].astype(np.float32)
    for s in srcs[1:]:
        np.add(out, s.astype(np.float32), out=out)
    if np.float32(scale) != 1:
        np.multiply(out, np.float32(scale), out=out)
    return out


def _check_accumulate(cp, accumulator, stream, dtype: str, n_src: int, scale: float,
                      sizes: list, offs: list, alone: Optional[bool] = None) -> None:
    """Accumulate pieces of ``sizes`` elements at element offsets ``offs`` (16-byte
    aligned or not: vector and scalar paths) and compare bitwise with the host formula;
    with ``alone`` given, as a plan's table (``Accumulator.table``) of that kind."""
    dt = tidearray._dtypes.normalize(dtype)
    rng = np.random.default_rng(n_src * 7 + len(dtype))
    host_srcs = [[rng.standard_normal(n + o).astype(np.float32).astype(dt) for n, o in
                  zip(sizes, offs)] for _ in range(n_src)]
    dev_srcs = [[cp.asarray(a.view(f"u{dt.itemsize}")).view(dt) for a in per] for per in host_srcs]
    outs = [cp.full(n + o, np.nan, cp.float32) for n, o in zip(sizes, offs)]
    pieces = [AccumPiece(outs[k].data.ptr + 4 * offs[k],
                         tuple(dev_srcs[s][k].data.ptr + dt.itemsize * offs[k]
                               for s in range(n_src)), sizes[k]) for k in range(len(sizes))]
    if alone is not None:
        pieces = accumulator.table(pieces, dt, alone=alone)
        cap = accumulator.alone_grid if alone else accumulator.max_grid
        assert pieces.grid == min(pieces.n_tiles, cap), (pieces.grid, pieces.n_tiles, cap)
    cp.cuda.runtime.deviceSynchronize()
    accumulator.launch(stream, pieces, dt, scale)
    stream.synchronize()
    for k, o in enumerate(offs):
        want = _host_accumulate([host_srcs[s][k][o:] for s in range(n_src)], scale)
        got = cp.asnumpy(outs[k])
        assert np.isnan(got[:o]).all(), "wrote before the piece"
        bad = np.flatnonzero(got[o:].view(np.uint32) != want.view(np.uint32))
        assert not bad.size, (f"piece {k} ({sizes[k]} elements at offset {o}) differs at "
                              f"{bad.size} elements, first {bad[:4].tolist()}: got "
                              f"{got[o:][bad[:4]].tolist()}, want {want[bad[:4]].tolist()} "
                              "(NaN: not written)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n_src", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_accumulate_bitwise_as_host(cuda_group, cp, dtype, n_src, scale):
    be = cuda_group.backend.lanes
    _check_accumulate(cp, be.accumulator, be.streams[-2], dtype, n_src, scale,
                      sizes=[1, 7, 8, 15, 8192, 8193, 40_000, 3],
                      offs=[0, 3, 16, 1, 64, 5, 128, 9])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n_src", [1, 2, 3, 5, 8])
def test_accumulate_long_tiles_bitwise_as_host(cuda_group, cp, dtype, n_src):
    """Tiles long enough for the unrolled loop of 16-bit sources (eight vector steps of
    four elements per thread: at least 16,384 elements, here 2 CTAs on large pieces),
    with ragged ends, aligned and not."""
    from tidearray.backends.cuda.accumulate import BLOCK, Accumulator, choose_tile

    be = cuda_group.backend.lanes
    acc = Accumulator(be.accumulator.device, be.accumulator.sm_count, 2)
    sizes, offs = [3_000_001, 70_000, 16_384, 100_003], [0, 8, 64, 3]
    assert choose_tile(sum(sizes), acc.max_grid) >= 8 * 4 * BLOCK  # the unrolled loop runs
    for scale in (1.0, 1 / 3):
        _check_accumulate(cp, acc, be.streams[-2], dtype, n_src, scale, sizes, offs)


@pytest.mark.parametrize("n_src", [1, 2, 3])
@pytest.mark.parametrize("alone", [False, True])
def test_accumulate_alone_takes_the_whole_device(cuda_group, cp, n_src, alone):
    """A plan's table for a collective that has the device alone (``alone``: the
    callbacks of ``tidearray.jax``) launches ``ALONE_PER_SM`` blocks per SM, one that
    shares it half the SMs (``Config.accum_ctas`` unset); bitwise the same results."""
    from tidearray.backends.cuda.accumulate import ALONE_PER_SM

    be = cuda_group.backend.lanes
    acc = be.accumulator
    if cuda_group.config.accum_ctas is None:
        assert (acc.max_grid, acc.alone_grid) == (acc.sm_count // 2,
                                                  ALONE_PER_SM * acc.sm_count)
    _check_accumulate(cp, acc, be.streams[-2], "bfloat16", n_src, 0.5, alone=alone,
                      sizes=[6_000_001, 2_500_000, 16_384, 3], offs=[0, 8, 64, 3])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cast_bitwise_as_astype(cuda_group, cp, dtype):
    """fp32 in, 16-bit out (a cast plan's kernel): round to nearest even, as astype does,
    on values with bits below the 16-bit mantissa, at vector and scalar offsets."""
    dt = tidearray._dtypes.normalize(dtype)
    rng = np.random.default_rng(len(dtype))
    sizes, offs = [1, 7, 8, 4099, 8192, 40_001], [0, 3, 8, 1, 16, 5]
    host = [rng.standard_normal(n + o).astype(np.float32) for n, o in zip(sizes, offs)]
    host[3][5:9] = [65504.0, 1e30, np.float32(1.00390625), np.float32(-2.0**-20)]  # overflow, ties
    srcs = [cp.asarray(a) for a in host]
    outs = [cp.full(n + o, 0x7E7E, cp.uint16) for n, o in zip(sizes, offs)]
    pieces = tuple(AccumPiece(outs[k].data.ptr + 2 * offs[k], (srcs[k].data.ptr + 4 * offs[k],),
                              sizes[k]) for k in range(len(sizes)))
    be = cuda_group.backend.lanes
    cp.cuda.runtime.deviceSynchronize()
    be.accumulator.launch(be.streams[-2], pieces, np.float32, 1.0, dt)
    be.streams[-2].synchronize()
    for k, o in enumerate(offs):
        got = cp.asnumpy(outs[k])
        assert (got[:o] == 0x7E7E).all(), "wrote before the piece"
        want = host[k][o:].astype(dt).view(np.uint16)
        assert (got[o:] == want).all(), f"piece {k} differs from astype"


@pytest.mark.parametrize("batched,batch_max", [(True, 0), (True, 7), (False, 0)])
def test_copier_many_small_segments(cuda_group, cp, batched, batch_max):
    """200 small copies land exactly, in one batch, in batches of ``batch_max`` issued
    in turn, or one by one."""
    from tidearray.backends.cuda.copies import Copier

    be = cuda_group.backend.lanes
    c = Copier(None if batched else False, batch_max=batch_max)
    on, why = c.probe(be.streams[0].ptr)
    if batched and not on:
        pytest.skip(f"batched copies unavailable: {why}")
    src = cp.arange(1 << 20, dtype=cp.uint8)
    dst = cp.zeros_like(src)
    cp.cuda.runtime.deviceSynchronize()
    copies = tuple((dst.data.ptr + k * 4096 + 1, src.data.ptr + k * 4096 + 1, 4000 - k % 3)
                   for k in range(200))  # unequal sizes: no 2D runs, all in the batch
    batch = c.plan(copies)
    assert len(batch) == 200 and len(batch.runs) == 1
    c.issue(be.streams[0].ptr, batch.runs[0])
    be.streams[0].synchronize()
    if batched and c.batched:
        packs = batch.runs[0].packs
        assert [p[-1] for p in packs] == ([200] if not batch_max else
                                          [7] * (200 // 7) + [200 % 7])
    want = cp.zeros_like(src)
    for k in range(200):
        want[k * 4096 + 1: k * 4096 + 4001 - k % 3] = src[k * 4096 + 1: k * 4096 + 4001 - k % 3]
    assert bool((dst == want).all())


@pytest.mark.parametrize("batched", [True, False])
def test_copier_local_copies_cut_and_exact(cuda_group, cp, batched):
    """Same-device copies go cut to ``local_max`` and never as 2D copies, and land
    bitwise; equal, evenly spaced copies (a 2D run otherwise) included."""
    from tidearray.backends.cuda.copies import Copier

    be = cuda_group.backend.lanes
    cap = 64 << 10
    c = Copier(None if batched else False, local_max=cap)
    on, why = c.probe(be.streams[0].ptr)
    if batched and not on:
        pytest.skip(f"batched copies unavailable: {why}")
    rng = np.random.default_rng(fresh_seed(cuda_group.comm))
    src = cp.asarray(rng.integers(0, 256, 4 << 20, dtype=np.uint8))
    dst = cp.full_like(src, 0xA5)
    sizes = [int(n) for n in rng.integers(1, 5 * cap, 12)] + [3 * cap + 17]
    copies, at = [], 0
    for n in sizes:
        copies.append((dst.data.ptr + at + 3, src.data.ptr + at + 1, n))
        at += n + 4099
    copies += [(dst.data.ptr + at + k * 8192, src.data.ptr + at + k * 8192, 5000)
               for k in range(4)]
    copies = tuple(copies)
    cp.cuda.runtime.deviceSynchronize()
    batch = c.plan(copies, local=True)
    (run,) = batch.runs
    c.issue(be.streams[0].ptr, run)
    be.streams[0].synchronize()
    strided, large, rest, _ = run
    assert not strided and not large
    assert max(n for _, _, n in rest) <= cap and sum(n for _, _, n in rest) == sum(
        n for _, _, n in copies)
    want = cp.full_like(src, 0xA5)
    base_d, base_s = dst.data.ptr, src.data.ptr
    for d, s_, n in copies:
        want[d - base_d: d - base_d + n] = src[s_ - base_s: s_ - base_s + n]
    assert bool((dst == want).all())


def test_copier_many_local_copies_go_as_one_kernel(cuda_group, cp):
    """A plan's batch of at least ``kernel_min`` same-device copies goes as one copy
    kernel (``pack_bytes``) and lands bitwise into a poisoned buffer, odd sizes and
    unaligned addresses included, call after call with new data; fewer copies, or
    copies of one call, go in the driver's batch."""
    from tidearray.backends.cuda.copies import Copier, KernelCopy

    be = cuda_group.backend.lanes
    c = Copier(None, local_max=64 << 10, kernel_min=8, device=be.device, ctas=3)
    c.probe(be.streams[0].ptr)
    rng = np.random.default_rng(fresh_seed(cuda_group.comm))
    src = cp.zeros(8 << 20, cp.uint8)
    dst = cp.zeros_like(src)
    copies, at = [], 0
    for n in [int(n) for n in rng.integers(1, 300_000, 20)] + [1 << 20, 16, 0]:
        copies.append((dst.data.ptr + at + int(rng.integers(0, 16)), src.data.ptr + at + 5, n))
        at += n + 4096 + 32
    copies = tuple(copies)
    batch = c.plan(copies, local=True)
    assert isinstance(batch.runs[0], KernelCopy)
    for k in range(3):  # the table is uploaded once, the data changes
        src[...] = cp.asarray(rng.integers(0, 256, src.size, dtype=np.uint8))
        dst.fill(0xA5)
        cp.cuda.runtime.deviceSynchronize()
        if k < 2:
            c.issue(be.streams[0].ptr, batch.runs[0], be.streams[0])
        else:  # one call's copies: the driver's batch, no kernel table
            c.copy(be.streams[0].ptr, copies, local=True)
        be.streams[0].synchronize()
        want = cp.full_like(src, 0xA5)
        base_d, base_s = dst.data.ptr, src.data.ptr
        for d, s_, n in copies:
            want[d - base_d: d - base_d + n] = src[s_ - base_s: s_ - base_s + n]
        assert bool((dst == want).all())
    assert not isinstance(c.plan(copies, local=True, kernel=False).runs[0], KernelCopy)
    assert not isinstance(c.plan(copies[:7], local=True).runs[0], KernelCopy)


@pytest.mark.parametrize("order", ["after", "depend"])
def test_after_a_mark_waits_for_that_point_only(cuda_group, cp, order):
    """COMPUTE: slow work, flag = 1, a mark, slow work, flag = 2. NET, after the mark,
    copies the flag: it reads 1 (the marked point reached, COMPUTE's later work not
    waited for). ``depend`` at the same place orders after everything COMPUTE issued
    so far, so it reads 2. Each spin is 0.3 s: the copy cannot win by luck."""
    ex = cuda_group.backend.executor()
    lanes = ex.lanes.streams
    flag = cp.zeros(1, cp.int32)
    seen = cp.full(1, -1, cp.int32)
    ptr = flag.data.ptr
    ex.signal(ex.COMPUTE, ptr, 0)  # the lane's first use: it waits for the fork here
    with lanes[ex.COMPUTE]:
        stall(cp, 0.3)
    ex.signal(ex.COMPUTE, ptr, 1)
    mark = ex.mark(ex.COMPUTE)
    with lanes[ex.COMPUTE]:
        stall(cp, 0.3)
    ex.signal(ex.COMPUTE, ptr, 2)
    if order == "after":
        ex.after(ex.NET, mark)
    else:
        ex.depend(ex.NET, ex.COMPUTE)
    ex.copy(ex.NET, [(seen.data.ptr, ptr, 4)], local=True)
    ex.finish().wait()
    cp.cuda.runtime.deviceSynchronize()
    assert int(seen[0]) == (1 if order == "after" else 2)


def test_capabilities_reported(cuda_group):
    caps = cuda_group.backend.capabilities
    for name in ("batched copies", "stream memory operations", "symmetric memory", "multicast",
                 "NCCL put/signal", "nccl"):
        ok, why = caps[name]
        assert isinstance(ok, bool) and why, name
    assert not caps["multicast"][0] or os.environ.get("NCCL_NVLS_ENABLE") != "0"


def test_multicast_refused_when_nvls_disabled(cuda_group):
    from tidearray.backends.cuda import multicast_capability

    ok, why = multicast_capability(cuda_group.backend.device)
    if os.environ.get("NCCL_NVLS_ENABLE") == "0":
        assert not ok and "NCCL_NVLS_ENABLE" in why
    else:
        assert isinstance(ok, bool) and why


def test_info_capability_lines(cuda_group):
    from tidearray.info import capability_lines

    lines = capability_lines(cuda_group.backend)
    assert any(line.startswith("stream memory operations") for line in lines)


def test_all_gather_launches_no_kernels(cuda_group, cp, tmp_path):
    """CUPTI (through torch.profiler) sees memcpys and no kernels during TIDE-AG."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    g = cuda_group
    if g.topology.num_nodes > 1:
        pytest.skip("across nodes TIDE-AG exchanges through NCCL (its kernels drive the NIC)")
    if g.config.debug:
        pytest.skip("debug mode poisons its stamp snapshot with a fill kernel")
    torch.cuda.set_device(g.backend.device)
    torch.cuda.init()
    # 40 repeated shapes: their pieces pull as one 2D copy ([Note: copy plans])
    shapes = [(4096, 512), (512,), (1000, 64), (3, 3)] + [(64, 32)] * 40
    shards = [cp.ones(shard_shape(s, g.size), cp.float16) for s in shapes]
    tidearray.all_gather(shards, shapes, group=g)  # warm-up: slots exist, flags zeroed
    cp.cuda.runtime.deviceSynchronize()
    g.comm.Barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            tidearray.all_gather(shards, shapes, group=g)
        cp.cuda.runtime.deviceSynchronize()
    path = tmp_path / f"ag_trace_{g.rank}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    cats = [e.get("cat", "") for e in events]
    kernels = [e.get("name") for e in events if e.get("cat") == "kernel"]
    memcpys = sum(1 for c in cats if c == "gpu_memcpy")
    bad = [] if not kernels and memcpys else [f"{len(kernels)} kernels {kernels[:5]}, "
                                              f"{memcpys} memcpys"]
    everything = g.comm.allgather(bad)
    assert not any(everything), everything


def test_repeated_all_gather_follows_its_arrays(cuda_group, cp):
    """Eager plans found by their arrays (``CudaBackend.array_key``): the same list gathered
    again, then with one entry replaced in place, then new arrays after the old
    ones died (ids and addresses may be reused), each bitwise against NumPy."""
    g = cuda_group
    rng = np.random.default_rng(fresh_seed(g.comm, bits=30))
    shapes = [(4 * g.size + 1, 8), (3 * g.size, 16), (5,)]

    def make() -> tuple[list, list]:
        full = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        return full, [cp.asarray(tidearray.shard(f, rank=g.rank, world=g.size)) for f in full]

    def check(shards: list, full: list, label: str) -> list[str]:
        outs = tidearray.all_gather(shards, shapes, group=g)
        return [f"{label}: parameter {i}" for i, (o, f) in enumerate(zip(outs, full))
                if not (cp.asnumpy(o).view(np.uint32) == f.view(np.uint32)).all()]

    full, shards = make()
    bad = check(shards, full, "first") + check(shards, full, "repeated")
    full2, shards2 = make()
    full[1], shards[1] = full2[1], shards2[1]
    bad += check(shards, full, "one entry replaced")
    del shards2
    full, shards = make()
    bad += check(shards, full, "new arrays")
    everything = g.comm.allgather(bad)
    assert not any(everything), everything


@pytest.mark.parametrize("memory", ["vmm", "ipc"])
def test_symmetric_memory_routes_units(cuda_group, cp, memory):
    """Each symmetric-memory route (``symmetric_memory``: VMM, legacy IPC) on the
    unit shapes, with the slots and staging it maps; back-to-back calls advance
    its flags. The rest of the suite runs on the default route."""
    from .test_cuda_units import _agree, _guarded, gather_and_check, reduce_and_check

    g = tidearray.init(backend="cuda", symmetric_memory=memory)
    try:
        route = g.backend.capabilities["symmetric memory"]
        want = {"vmm": "VMM", "ipc": "legacy CUDA IPC"}[memory]
        bad = [] if want in route[1] else [f"expected the {want} route, got {route}"]
        for unit in ("llama3.1-8b", "qwen3-30b-a3b"):
            for _ in range(2):
                bad += _guarded(gather_and_check, g, cp, UNITS[unit]())
            bad += _guarded(reduce_and_check, g, cp, UNITS[unit]())
        _agree(g, bad, memory)
    finally:
        g.comm.Barrier()
        g.close()
