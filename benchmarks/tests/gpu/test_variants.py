"""The accumulate variants of ``benchmarks/variants`` (the bulk-copy and narrow kernels):
the library's seam they plug into, their launch constants and the narrow kernel's walk
of the table (CPU), and their bits against the host's formula, which the library's
vector kernel gives too (GPU: skipped cleanly without one)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tidearray
from benchmarks.variants import accumulate as variants
from tests.gpu.test_cuda_engine import _check_accumulate, _host_accumulate
from tidearray.backends._base import AccumPiece
from tidearray.backends.cuda import accumulate
from tidearray.backends.cuda.accumulate import TILE, Accumulator, Kernel, build_table

piece = st.tuples(st.integers(1, 3 * 64), st.integers(0, 40), st.integers(0, 40))


# -- the seam, on CPU ---------------------------------------------------------------------

class _Picky(Accumulator):
    """An accumulator whose kernels are names, not RawKernels: no GPU needed."""

    def _select(self, src: str, out: str, n_srcs: int) -> Kernel:
        if (src, out) == ("bfloat16", "float32") and n_srcs <= 2:
            return Kernel("other", 32, 1024, 5)
        return super()._select(src, out, n_srcs)

    def _vector(self, src: str, out: str) -> Kernel:
        return Kernel("vector", accumulate.BLOCK, 0, self.max_grid)


def test_a_subclass_picks_the_kernel_per_dtypes_and_sources():
    """``table`` takes ``_select``'s kernel and grid cap, kept per (dtypes, sources);
    ``set_grid`` forgets them."""
    acc = _Picky(0, 132)
    pieces = [AccumPiece(4096 * (k + 1), (1 << 20, 1 << 21), 100 * TILE) for k in range(4)]
    t = acc.table(pieces, tidearray.bfloat16)
    assert (t.kernel.fn, t.grid) == ("other", 5)
    assert acc.table(pieces, "float16").kernel.fn == "vector"
    assert acc.table(pieces, "float16").grid == 66
    three = [AccumPiece(p.out, p.srcs + (1 << 22,), p.numel) for p in pieces]
    assert acc.table(three, "bfloat16").kernel.fn == "vector"
    assert ("bfloat16", "float32", 2) in acc._kernels
    acc.set_grid(3)
    assert acc.table(pieces, "float16").grid == 3 and ("bfloat16", "float32", 2) not in \
        acc._kernels


def test_variant_sources_are_not_library_kernels():
    """The variants' files and their bulk-copy helpers are read from benchmarks/variants
    (the library ships only the vector kernel), their other headers from the library's
    kernels/."""
    from tidearray.backends.cuda import kernels

    for name in ("accumulate_bulk.cu", "accumulate_narrow.cu", "bulk_copy.cuh"):
        with pytest.raises(tidearray.TideBackendError, match=name):
            kernels.source(name)
    assert variants.source("narrow").count("TileAt locate(") == 1


def _constants(kernel: str) -> dict:
    text = variants.source(kernel)
    return {name: int(v) for name, v in re.findall(r"^#define (\w+) (\d+)$", text, re.M)}


def test_bulk_kernel_constants_match_the_host():
    """The bulk kernel's block and shared memory, as ``accumulate_bulk.cu`` defines
    them, are what the host launches with; its sub-chunk divides a tile."""
    assert variants.source("bulk").count("TileAt locate(") == 1  # inlined once
    k = _constants("bulk")
    assert k["THREADS"] == variants.BULK_BLOCK
    # SMEM_BYTES: the stages' source slots (16-bit elements), then an mbarrier per stage.
    smem = k["STAGES"] * k["GROUP"] * 2 * k["CHUNK"] + 8 * k["STAGES"]
    assert smem == variants.BULK_SMEM <= 227 * 1024
    assert TILE % k["CHUNK"] == 0 and k["CHUNK"] % (4 * k["THREADS"]) == 0


def test_narrow_kernel_constants_match_the_host():
    """The narrow kernel's block, shared memory and source limit are the host's, and
    its CTA fits beside the interference suite's GEMM CTA on an H200 SM (which leaves
    1,024 registers and 19,228 bytes of shared memory, ``benchmarks/probes/footprints.py``)."""
    k = _constants("narrow")
    assert k["THREADS"] == variants.NARROW_BLOCK == 32  # 1,024 registers at 32
    assert k["STAGES"] * k["STAGE_BYTES"] + 512 == variants.NARROW_SMEM
    assert variants.NARROW_SMEM + 1024 <= 19_228
    assert k["MAX_SOURCES"] == variants.NARROW_MAX_SOURCES
    assert k["STAGE_BYTES"] // 2 // k["MAX_SOURCES"] // 256 >= 1  # a chunk per source


def test_narrow_grid_and_the_vector_kernels_grid():
    """One narrow CTA per SM; a launch the vector kernel takes instead (fp32 sources,
    more than two sources) keeps the vector kernel's half of the SMs; ``ctas`` caps both."""
    acc = variants.StreamedAccumulator(0, 132, kernel="narrow")
    assert (acc.max_grid, acc.vector_grid) == (132, 66)
    acc.set_grid(8)
    assert (acc.max_grid, acc.vector_grid) == (8, 8)
    bulk = variants.StreamedAccumulator(0, 132, kernel="bulk")
    assert (bulk.max_grid, bulk.vector_grid) == (66, 66)
    assert Accumulator(0, 132).max_grid == 66
    with pytest.raises(ValueError, match="vector"):
        variants.StreamedAccumulator(0, 132, kernel="vector")


def narrow_items(table: np.ndarray, n_pieces: int, n_src: int, n_tiles: int, tile: int,
                 grid: int) -> list:
    """(piece, lo, hi, kind) of every item the narrow kernel's CTAs produce, walked as
    ``produce`` in ``accumulate_narrow.cu`` walks it."""
    k = _constants("narrow")
    chunk = k["STAGE_BYTES"] // 2 // n_src // 256 * 256
    heads = table[: 4 * n_pieces].reshape(n_pieces, 4)
    items = []
    for b in range(grid):
        t0, t1 = b * n_tiles // grid, (b + 1) * n_tiles // grid

        def enter(p: int, e: int, t1: int = t1) -> dict:
            numel, vec, first = heads[p, 1], heads[p, 2], heads[p, 3]
            limit = min((t1 - first) * tile, numel)
            return {"p": p, "e": e, "numel": numel, "limit": limit,
                    "bulk_end": (limit if limit < numel else numel // 8 * 8) if vec else e}

        p = int(np.searchsorted(heads[:, 3], t0, side="right")) - 1
        c = enter(p, (t0 - heads[p, 3]) * tile)
        while True:
            end = False
            while c["e"] >= c["limit"]:
                end = (c["limit"] < c["numel"] or c["p"] + 1 >= n_pieces
                       or heads[c["p"] + 1, 3] >= t1)
                if end:
                    break
                c = enter(c["p"] + 1, 0)
            if end:
                break
            if c["e"] < c["bulk_end"]:
                hi = min(c["bulk_end"], c["e"] + chunk)
                items.append((c["p"], c["e"], hi, "bulk"))
            else:
                hi = c["limit"]
                items.append((c["p"], c["e"], hi, "scalar"))
            c["e"] = hi
    return items


@given(st.lists(piece, min_size=1, max_size=12), st.integers(1, 2), st.sampled_from([8, 64]),
       st.integers(1, 40))
def test_narrow_walk_covers_each_element_once(specs, n_src, tile, grid):
    """Every element of every piece in exactly one item; bulk items are whole 16-byte
    words of aligned pieces, at most a chunk; scalar ones are unaligned pieces or
    ragged tails of fewer than 8 elements."""
    pieces = [AccumPiece(4096 * (k + 1) + 4 * o, tuple((1 << 20) * (s + 1) + 2 * o2
                                                       for s in range(n_src)), n)
              for k, (n, o, o2) in enumerate(specs)]
    table, n_tiles = build_table(pieces, tile)
    chunk = _constants("narrow")["STAGE_BYTES"] // 2 // n_src // 256 * 256
    seen = [np.zeros(p.numel, np.int64) for p in pieces]
    for p, lo, hi, kind in narrow_items(table, len(pieces), n_src, n_tiles, tile,
                                        min(grid, n_tiles)):
        assert 0 <= lo < hi <= pieces[p].numel
        seen[p][lo:hi] += 1
        vec = table[4 * p + 2]
        if kind == "bulk":
            assert vec and lo % 8 == 0 and (hi - lo) % 8 == 0 and hi - lo <= chunk
        else:
            assert not vec or hi - lo < 8 and hi == pieces[p].numel
    assert all((s == 1).all() for s in seen)


# -- bits, on the GPU -----------------------------------------------------------------------

def _streamed(cuda_group, ctas, kernel: str) -> variants.StreamedAccumulator:
    import cupy

    lib = cuda_group.backend.lanes.accumulator
    major = cupy.cuda.runtime.getDeviceProperties(lib.device)["major"]
    if major < 9:
        pytest.skip(f"the {kernel} accumulate needs compute capability 9.0, not {major}.x")
    return variants.StreamedAccumulator(lib.device, lib.sm_count, ctas, kernel=kernel)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n_src", [1, 2, 3, 5])
@pytest.mark.parametrize("ctas", [2, None])
@pytest.mark.parametrize("kernel", ["bulk", "narrow"])
@pytest.mark.gpu
@pytest.mark.mpi
def test_streamed_accumulate_bitwise_as_host(cuda_group, cp, dtype, n_src, ctas, kernel):
    """The bulk and narrow kernels give the vector kernel's bits, the host's formula
    (fp32 sources keep the vector kernel): on awkward pieces; on a piece of many stages
    and tiles with a ragged tail, aligned and not; on one that ends in an 8-element
    sub-chunk; with 2 CTAs, each walking many tiles through its ring of stages; and on
    every SM, where most CTAs' runs start and end inside a piece."""
    acc = _streamed(cuda_group, ctas, kernel)
    streamed = dtype != "float32" and (kernel == "bulk" or n_src <= variants.NARROW_MAX_SOURCES)
    name = acc._kernel(dtype, "float32", n_src).fn.name
    assert name.endswith(f"_{kernel}") == streamed, name
    stream = cuda_group.backend.lanes.streams[-2]
    for scale in (1.0, 1 / 3):
        _check_accumulate(cp, acc, stream, dtype, n_src, scale,
                          sizes=[1, 7, 8, 15, 8192, 8193, 40_000, 3, 3_000_001, 16_392,
                                 100_003],
                          offs=[0, 3, 16, 1, 64, 5, 128, 9, 0, 8, 3])


@pytest.mark.parametrize("n_src", [1, 2, 3])
@pytest.mark.gpu
@pytest.mark.mpi
def test_narrow_accumulate_many_pieces_bitwise_as_host(cuda_group, cp, n_src):
    """The narrow kernel walks its run piece by piece: 300 pieces of 1 to 50,000
    elements, aligned and not, on every SM (runs start and end inside pieces, and
    cross many); more than two sources take the vector kernel, on its grid."""
    acc = _streamed(cuda_group, None, "narrow")
    rng = np.random.default_rng()
    sizes = [int(n) for n in rng.integers(1, 50_000, 300)]
    offs = [int(o) for o in rng.choice([0, 8, 16, 3], 300)]
    _check_accumulate(cp, acc, cuda_group.backend.lanes.streams[-2], "bfloat16", n_src, 0.5,
                      sizes, offs)
    dt = tidearray._dtypes.normalize("bfloat16")
    k = acc._kernels[dt, "float32", n_src]  # kept under the dtypes as launched
    vector = n_src > variants.NARROW_MAX_SOURCES
    assert (k.block, k.grid) == ((accumulate.BLOCK, acc.vector_grid) if vector
                                 else (variants.NARROW_BLOCK, acc.max_grid))


@pytest.mark.parametrize("ctas", [1, 3, None])
@pytest.mark.gpu
@pytest.mark.mpi
def test_narrow_accumulate_relaunched_bitwise_as_host(cuda_group, cp, ctas):
    """Launch after launch of the narrow kernel, more than the ring of table slots,
    cached tables and not, on two streams at once: each gives the host's bits (fresh
    data, outputs poisoned)."""
    acc = _streamed(cuda_group, ctas, "narrow")
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    rng = np.random.default_rng()
    dt = tidearray._dtypes.bfloat16
    checks = []
    for k in range(accumulate.RING + 5):
        sizes = [int(n) for n in rng.integers(1, 300_000, 6)]
        host = [[rng.standard_normal(n).astype(np.float32).astype(dt) for n in sizes]
                for _ in range(2)]
        srcs = [[cp.asarray(a.view(np.uint16)) for a in per] for per in host]
        outs = [cp.full(n, np.nan, cp.float32) for n in sizes]
        pieces = [AccumPiece(outs[j].data.ptr, (srcs[0][j].data.ptr, srcs[1][j].data.ptr), n)
                  for j, n in enumerate(sizes)]
        cp.cuda.runtime.deviceSynchronize()
        acc.launch(streams[k % 2], tuple(pieces) if k % 3 else pieces, dt, 0.5)
        checks.append((host, srcs, outs, pieces))
    for s in streams:
        s.synchronize()
    for host, _, outs, _ in checks:
        for j, out in enumerate(outs):
            want = _host_accumulate([host[0][j], host[1][j]], 0.5)
            assert (cp.asnumpy(out).view(np.uint32) == want.view(np.uint32)).all()
