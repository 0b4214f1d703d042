"""No out-of-bounds reads: inputs placed against PROT_NONE guard pages (host backend).

A copy that reads past a gradient, or reads a shard's padding rows, is a bug
the outputs alone cannot show (padding rows are zeroed or never delivered).
Here the bytes just past (or before) each gradient, and each shard's padding
rows, lie in pages with no access rights, so such a read kills the rank with
SIGSEGV (pytest's faulthandler prints where) and the run fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import tidearray
from tidearray.layout import shard_shape

from ..._guard import guarded
from ..._util import agree, compare_bits, dtypes, seeds, shapes, torch_chunk_rows
from ._cases import compare_rs, full_params, rank_grads, rs_reference

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(os.environ.get("TIDE_BACKEND", "host") != "host",
                       reason="guard pages need host memory"),
]


@given(shapes(WORLD, min_count=1, max_count=6), dtypes, seeds, st.booleans())
@settings(max_examples=10)
def test_reduce_scatter_reads_only_the_gradients(group, unit, dtype, seed, at_end):
    """Gradients against a guard page (after their end, or before their start)."""
    grads = []
    for g in rank_grads(unit, dtype, seed, group.rank):
        a = guarded(g.shape, g.dtype, at_end=at_end)
        a[...] = g
        grads.append(a)
    res = tidearray.reduce_scatter(grads, op="sum", group=group)
    agree(group.comm, compare_rs(res, *rs_reference(unit, dtype, seed, WORLD, group.rank,
                                                    "sum")))


@given(shapes(WORLD, min_count=1, max_count=6), dtypes, seeds)
@settings(max_examples=10)
def test_all_gather_never_reads_padding(group, unit, dtype, seed):
    """Each shard's real rows end at a guard page that holds its padding rows."""
    fulls = full_params(unit, dtype, seed)
    shards = []
    for f in fulls:
        start, stop = torch_chunk_rows(f.shape[0], WORLD, group.rank)
        real = f[start:stop]
        a = guarded(shard_shape(f.shape, WORLD), dtype, readable=real.nbytes)
        a[: stop - start] = real
        shards.append(a)
    outs = tidearray.all_gather(shards, unit, group=group)
    agree(group.comm, [x for i, (o, f) in enumerate(zip(outs, fulls))
                       for x in compare_bits(o, f, f"parameter {i}")])


def test_empty_shards_are_never_touched(group):
    """d0 < W: trailing ranks' shards are all padding, entirely inside the guard."""
    unit = [(1, 5), (max(WORLD - 1, 1), 3)]
    fulls = full_params(unit, np.dtype(tidearray.float32), 17)
    shards = []
    for f in fulls:
        start, stop = torch_chunk_rows(f.shape[0], WORLD, group.rank)
        a = guarded(shard_shape(f.shape, WORLD), f.dtype,
                    readable=f[start:stop].nbytes)
        a[: stop - start] = f[start:stop]
        shards.append(a)
    outs = tidearray.all_gather(shards, unit, group=group)
    agree(group.comm, [x for i, (o, f) in enumerate(zip(outs, fulls))
                       for x in compare_bits(o, f, f"parameter {i}")])
