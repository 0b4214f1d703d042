"""Pure helpers: shard/full_from_shards against NumPy slicing, range overlaps, digests."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import tidearray
from tidearray import _validate
from tidearray.layout import full_from_shards, shard_shape

from .._util import DTYPES, bits, padded_shard, random_bits, torch_chunk_rows

shape_st = st.tuples(st.integers(0, 40), st.lists(st.integers(0, 4), max_size=2)).map(
    lambda t: (t[0], *t[1]))


@given(shape_st, st.integers(1, 9), st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_shard_matches_numpy_slicing(shape, world, dtype, seed):
    full = random_bits(np.random.default_rng(seed), shape, dtype)
    shards = []
    for r in range(world):
        s = tidearray.shard(full, rank=r, world=world)
        start, stop = torch_chunk_rows(shape[0], world, r)
        assert s.dtype == dtype and s.shape == shard_shape(shape, world)
        assert (bits(s[: stop - start]) == bits(full[start:stop])).all()
        assert (bits(s[stop - start:]) == 0).all(), "padding rows must be zero"
        assert (bits(s) == bits(padded_shard(full, world, r))).all()
        assert not np.shares_memory(s, full)
        shards.append(s)
    back = full_from_shards(shards, shape)
    assert back.shape == full.shape and (bits(back) == bits(full)).all()


ranges = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=12)


@given(ranges, ranges)
def test_overlaps_matches_brute_force(a, b):
    ra = [(p, n, i) for i, (p, n) in enumerate(a)]
    rb = [(p, n, j) for j, (p, n) in enumerate(b)]
    want = {(i, j) for p, n, i in ra for q, m, j in rb if n and m and p < q + m and q < p + n}
    got = _validate.overlaps(ra, rb)
    assert len(got) == len(set(got)) and set(got) == want


def test_digest_is_stable_and_discriminating():
    sig = (("shapes", ((4, 3), (2,))), ("dtype", "bfloat16"))
    assert _validate.digest(sig) == _validate.digest(tuple(sig))
    assert _validate.digest(sig) != _validate.digest((("shapes", ((4, 3), (3,))),
                                                      ("dtype", "bfloat16")))
    assert 0 <= _validate.digest(sig) < 2**56


def test_mismatch_names_the_parameter_and_rank():
    base = (("shapes", ((4, 3), (2,))), ("dtype", "bfloat16"))
    other = (("shapes", ((4, 3), (5,))), ("dtype", "bfloat16"))
    msg = _validate._mismatch([base, base, other])
    assert "parameter 1" in msg and "rank 2" in msg and "(5,)" in msg
    longer = (("shapes", ((4, 3), (2,), (1,))), ("dtype", "bfloat16"))
    msg = _validate._mismatch([base, longer])
    assert "number of shapes" in msg and "rank 1" in msg
    fp16 = (("shapes", ((4, 3), (2,))), ("dtype", "float16"))
    assert "float16" in _validate._mismatch([base, fp16])
