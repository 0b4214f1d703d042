"""Host-side tables of the cuda backend (accumulate table, split pushes), the bulk
and narrow accumulate kernels' launch constants, and the narrow kernel's walk of the
table: CPU only.

Walks the table the way ``kernels/accumulate.cu`` does and checks that every
element of every piece is covered by exactly one tile, that tiles never cross
a piece's end, and that the vector flag is set exactly for 16-byte-aligned
pieces.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tidearray.backends._base import AccumPiece
from tidearray.backends.cuda import accumulate
from tidearray.backends.cuda.accumulate import TILE, build_table, choose_tile

piece = st.tuples(st.integers(1, 3 * 64), st.integers(0, 40), st.integers(0, 40))


@given(st.lists(piece, min_size=1, max_size=12), st.integers(1, 4), st.sampled_from([8, 64]))
def test_table_covers_each_element_once(specs, n_src, tile):
    pieces = [AccumPiece(4096 * (k + 1) + 4 * o, tuple((1 << 20) * (s + 1) + 2 * o2
                                                       for s in range(n_src)), n)
              for k, (n, o, o2) in enumerate(specs)]
    table, n_tiles = build_table(pieces, tile)
    P = len(pieces)
    heads = table[: 4 * P].reshape(P, 4)
    srcs = table[4 * P:].reshape(P, n_src)
    assert table.dtype == np.int64 and len(table) == P * (4 + n_src)
    seen = [np.zeros(p.numel, np.int64) for p in pieces]
    for t in range(n_tiles):  # the kernel's binary search, spelled out
        lo, hi = 0, P - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if heads[mid, 3] <= t else (lo, mid - 1)
        a = (t - heads[lo, 3]) * tile
        assert 0 <= a < pieces[lo].numel
        seen[lo][a: min(a + tile, pieces[lo].numel)] += 1
    assert all((s == 1).all() for s in seen)
    for k, p in enumerate(pieces):
        assert heads[k, 0] == p.out and heads[k, 1] == p.numel
        assert tuple(srcs[k]) == p.srcs
        aligned = p.out % 16 == 0 and all(s % 16 == 0 for s in p.srcs)
        assert heads[k, 2] == int(aligned)


@given(st.integers(1, 1 << 34), st.integers(1, 1024))
def test_tile_size_bounds_the_table(total, grid):
    tile = choose_tile(total, grid)
    assert tile % TILE == 0 and tile >= TILE
    assert -(-total // tile) <= max(4 * grid, -(-total // TILE))


def test_bulk_kernel_constants_match_the_host():
    """The bulk kernel's block and shared memory, as ``kernels/accumulate_bulk.cu``
    defines them, are what the host launches with; its sub-chunk divides a tile."""
    import re

    from tidearray.backends.cuda.kernels import source

    text = source("accumulate_bulk.cu")
    assert text.count("TileAt locate(") == 1  # accumulate_common.cuh, inlined once
    k = {name: int(v) for name, v in re.findall(r"^#define (\w+) (\d+)$", text, re.M)}
    assert k["THREADS"] == accumulate.BULK_BLOCK
    # SMEM_BYTES: the stages' source slots (16-bit elements), then an mbarrier per stage.
    smem = k["STAGES"] * k["GROUP"] * 2 * k["CHUNK"] + 8 * k["STAGES"]
    assert smem == accumulate.BULK_SMEM <= 227 * 1024
    assert TILE % k["CHUNK"] == 0 and k["CHUNK"] % (4 * k["THREADS"]) == 0


def _narrow_constants() -> dict:
    import re

    from tidearray.backends.cuda.kernels import source

    text = source("accumulate_narrow.cu")
    return {name: int(v) for name, v in re.findall(r"^#define (\w+) (\d+)$", text, re.M)}


def test_narrow_kernel_constants_match_the_host():
    """The narrow kernel's block, shared memory and source limit are the host's, and
    its CTA fits beside the interference suite's GEMM CTA on an H200 SM (which leaves
    1,024 registers and 19,228 bytes of shared memory, ``tests/gpu/footprints.py``)."""
    k = _narrow_constants()
    assert k["THREADS"] == accumulate.NARROW_BLOCK == 32  # 1,024 registers at 32
    assert k["STAGES"] * k["STAGE_BYTES"] + 512 == accumulate.NARROW_SMEM
    assert accumulate.NARROW_SMEM + 1024 <= 19_228
    assert k["MAX_SOURCES"] == accumulate.NARROW_MAX_SOURCES
    assert k["STAGE_BYTES"] // 2 // k["MAX_SOURCES"] // 256 >= 1  # a chunk per source


def test_narrow_grid_and_the_vector_kernels_grid():
    """One narrow CTA per SM; a launch the vector kernel takes instead (fp32 sources,
    more than two sources) keeps the vector kernel's half of the SMs; ``ctas`` caps both."""
    acc = accumulate.Accumulator(0, 132, kernel="narrow")
    assert (acc.max_grid, acc.vector_grid) == (132, 66)
    acc.set_grid(8)
    assert (acc.max_grid, acc.vector_grid) == (8, 8)
    vec = accumulate.Accumulator(0, 132, ctas=None)
    assert (vec.max_grid, vec.vector_grid) == (66, 66)


def narrow_items(table: np.ndarray, n_pieces: int, n_src: int, n_tiles: int, tile: int,
                 grid: int) -> list:
    """(piece, lo, hi, kind) of every item the narrow kernel's CTAs produce, walked as
    ``produce`` in ``kernels/accumulate_narrow.cu`` walks it."""
    k = _narrow_constants()
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
    chunk = _narrow_constants()["STAGE_BYTES"] // 2 // n_src // 256 * 256
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


@given(st.lists(st.integers(0, 5 << 17), min_size=1, max_size=8), st.integers(1, 4))
def test_split_copies_keeps_every_byte_in_order(sizes, parts):
    from tidearray._layout import SPLIT_ALIGN, split_copies

    copies, dst, src = [], 1 << 40, 1 << 30
    for n in sizes:
        if n:
            copies.append((dst, src, n))
        dst, src = dst + n + 4096, src + n + 8192
    runs = split_copies(copies, parts)
    assert len(runs) == parts
    merged = []  # re-join the pieces that continue each other: the original copies
    for d, s, n in (c for run in runs for c in run):
        assert n > 0
        if merged and merged[-1][0] + merged[-1][2] == d and merged[-1][1] + merged[-1][2] == s:
            md, ms, mn = merged[-1]
            assert (d - md) % SPLIT_ALIGN == 0, "a cut not on the split granule"
            merged[-1] = (md, ms, mn + n)
        else:
            merged.append((d, s, n))
    assert merged == copies


def test_process_device_prefers_the_launcher_and_sticks(monkeypatch):
    from tidearray.backends.cuda import backend as cuda

    monkeypatch.setattr(cuda, "_process_device", None)
    for var in cuda._LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert cuda.process_device(0, 2) == 1  # a group over COMM_SELF still gets GPU 1
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert cuda.process_device(0, 2) == 1  # chosen once per process
    monkeypatch.setattr(cuda, "_process_device", None)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    assert cuda.process_device(5, 4) == 1  # no launcher variable: the host split decides
