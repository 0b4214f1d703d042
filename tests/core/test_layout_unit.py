"""Pure layout: shard specs, byte ranges, slot layout and all-gather pieces (one process)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import tidearray
from tidearray import _copies
from tidearray._layout import ALIGN, plan_unit, shard_spec
from tidearray._schedule import ag_pieces
from tidearray.layout import shard_shape

from .._util import torch_chunk_rows

worlds = st.integers(1, 64)
shape_st = st.tuples(st.integers(0, 200), st.lists(st.integers(0, 7), max_size=2)).map(
    lambda t: (t[0], *t[1]))
itemsizes = st.sampled_from([2, 4])


@given(shape_st, itemsizes, worlds)
@example((3,), 2, 4)      # d0 < W
@example((10,), 2, 4)     # ragged: 3, 3, 3, 1
@example((9,), 2, 4)      # c = 3: the last rank is empty although 9 > 3 * 2
@example((0, 5), 4, 3)    # empty parameter
@example((1,), 4, 1)
def test_shard_rows_follow_torch_chunk(shape, itemsize, world):
    spec = shard_spec(shape, itemsize, world)
    c = math.ceil(shape[0] / world) if shape[0] else 0
    assert spec.rows_per_shard == c
    assert spec.shard_shape == (c, *shape[1:])
    assert spec.shard_numel == c * math.prod(shape[1:])
    assert shard_shape(shape, world) == (c, *shape[1:])
    for r in range(world):
        assert spec.rows(r) == torch_chunk_rows(shape[0], world, r), r
        assert spec.valid_rows(r) == torch_chunk_rows(shape[0], world, r)[1] - spec.rows(r)[0]


@given(shape_st, itemsizes, worlds)
def test_byte_ranges_tile_the_parameter(shape, itemsize, world):
    """Ranks' byte ranges, in rank order, cover ``[0, nbytes)`` exactly once."""
    spec = shard_spec(shape, itemsize, world)
    row = math.prod(shape[1:]) * itemsize
    cursor = 0
    for r in range(world):
        off, n = spec.byte_range(r)
        assert off == cursor or n == 0, (r, off, cursor)
        assert n == spec.valid_rows(r) * row
        assert n <= spec.rows_per_shard * row  # never more than the padded shard
        cursor += n
    assert cursor == spec.nbytes == math.prod(shape) * itemsize


def test_shard_spec_rejects_bad_shapes():
    with pytest.raises(tidearray.TideInvalid, match="parameter 3"):
        shard_spec((), 2, 4, index=3)
    with pytest.raises(tidearray.TideInvalid, match="parameter 1.*non-negative"):
        shard_spec((4, -1), 2, 4, index=1)
    with pytest.raises(tidearray.TideInvalid, match="parameter 2"):
        plan_unit([(4,), (2, 2), ()], 2, 2)


@given(st.lists(shape_st, max_size=20), itemsizes, worlds,
       st.sampled_from([1, 16, ALIGN, 4096]))
def test_slot_layout_aligned_and_disjoint(shapes, itemsize, world, align):
    unit = plan_unit(shapes, itemsize, world, align)
    assert len(unit) == len(shapes)
    end = 0
    for spec, off, shape in zip(unit.specs, unit.offsets, shapes):
        assert spec.shape == tuple(shape)
        assert off % align == 0
        assert off >= end  # in order, no overlap with the previous parameter
        end = off + math.prod(shape) * itemsize
    assert unit.nbytes >= end and unit.nbytes % align == 0
    assert unit.nbytes < end + align or not shapes  # no more than one alignment of slack


@given(st.lists(shape_st, max_size=10), itemsizes, worlds)
def test_ag_pieces_tile_the_slot(shapes, itemsize, world):
    """All ranks' pieces cover each parameter's bytes in the slot exactly once, nothing else."""
    unit = plan_unit(shapes, itemsize, world)
    pieces = ag_pieces(unit, range(world))
    covered = sorted((p.offset, p.offset + p.nbytes) for p in pieces)
    wanted = sorted((off, off + spec.nbytes) for spec, off in zip(unit.specs, unit.offsets)
                    if spec.nbytes)
    merged = []
    for a, b in covered:
        assert not merged or a >= merged[-1][1], "overlapping pieces"
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    merged_wanted = []
    for a, b in wanted:  # parameters may also touch when align divides their sizes
        if merged_wanted and merged_wanted[-1][1] == a:
            merged_wanted[-1] = (merged_wanted[-1][0], b)
        else:
            merged_wanted.append((a, b))
    assert merged == merged_wanted
    for p in pieces:
        spec = unit.specs[p.param]
        off, n = spec.byte_range(p.rank)
        assert (p.offset, p.nbytes) == (unit.offsets[p.param] + off, n) and n > 0


@given(st.integers(1, 12), st.data())
def test_ag_pieces_of_a_subset(world, data):
    """Pieces for a subset of ranks are exactly the full set's pieces of those ranks."""
    unit = plan_unit([(world * 2 + 1, 3), (1,), (world,)], 2, world)
    ranks = data.draw(st.lists(st.integers(0, world - 1), unique=True).map(sorted))
    everything = ag_pieces(unit, range(world))
    assert list(ag_pieces(unit, ranks)) == [p for p in everything if p.rank in ranks]


copies_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 6)),
                     max_size=25)


@given(copies_st)
def test_coalesce_preserves_effect(steps):
    """Coalesced copies move the same bytes; nothing mergeable is left; empties dropped.

    Copies are built as runs: each step either continues the previous copy in
    both source and destination or jumps by a gap, so merges really happen.
    """
    copies, dst, src = [], 0, 1000
    for gap_d, gap_s, n in steps:
        dst, src = dst + gap_d, src + gap_s
        copies.append((dst, src, n))
        dst, src = dst + n, src + n
    out = _copies.coalesce(copies)
    moved = {(d + i, s + i) for d, s, n in copies for i in range(n)}
    assert {(d + i, s + i) for d, s, n in out for i in range(n)} == moved
    assert sum(n for _, _, n in out) == sum(n for _, _, n in copies)
    assert all(n > 0 for _, _, n in out)
    for (d0, s0, n0), (d1, s1, _) in zip(out, out[1:]):
        assert not (d0 + n0 == d1 and s0 + n0 == s1), "left a mergeable pair"


def test_coalesce_example():
    copies = [(0, 100, 4), (4, 104, 4), (8, 200, 4), (12, 204, 0), (12, 204, 2), (20, 206, 1)]
    assert _copies.coalesce(copies) == [(0, 100, 8), (8, 200, 6), (20, 206, 1)]
