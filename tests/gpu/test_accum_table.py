"""The accumulate kernel's table, built on the host: runs on CPU (no GPU needed).

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
from tidearray.backends._cuda_accum import TILE, build_table, choose_tile

piece = st.tuples(st.integers(1, 3 * 64), st.integers(0, 40), st.integers(0, 40))


@given(st.lists(piece, min_size=1, max_size=12), st.integers(1, 4), st.sampled_from([8, 64]))
def test_table_covers_each_element_once(specs, n_src, tile):
    pieces = [AccumPiece(4096 * (k + 1) + 4 * o, tuple((1 << 20) * (s + 1) + 2 * o2
                                                       for s in range(n_src)), n)
              for k, (n, o, o2) in enumerate(specs)]
    table, n_tiles = build_table(pieces, tile)
    P = len(pieces)
    heads = table[: 3 * P].reshape(P, 3)
    srcs = table[3 * P: 3 * P + n_src * P].reshape(P, n_src)
    tiles = table[3 * P + n_src * P:].reshape(-1, 2)
    assert len(tiles) == n_tiles and table.dtype == np.int64
    seen = [np.zeros(p.numel, np.int64) for p in pieces]
    for p, a in tiles:
        assert a % tile == 0 and 0 <= a < pieces[p].numel
        seen[p][a: min(a + tile, pieces[p].numel)] += 1
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
