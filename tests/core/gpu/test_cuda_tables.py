"""Host-side tables of the cuda backend (accumulate table, split pushes): CPU only.

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


@given(st.lists(st.integers(0, 5 << 17), min_size=1, max_size=8), st.integers(1, 4))
def test_split_copies_keeps_every_byte_in_order(sizes, parts):
    from tidearray._copies import SPLIT_ALIGN, split_copies

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
