"""Reduce-scatter bits do not depend on how the bytes travel.

The same gradients reduced under every transport setting (symmetric memory by VMM or
legacy IPC, pushes split over copy engines, batched or single copies), every chunk size
and staging depth, as a call and as a plan, twice each: every result must equal, bit for
bit, the documented fold (sources in local-rank order, then the scale; across nodes,
then the nodes' partial sums in node order). The data spans
magnitudes 2**-10..2**14, so fp32 sums depend on their order. On the host backend the
transport settings do not apply and the test checks chunks, depths and repeats.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta

from ..._util import BF16, FP32, agree, bits, fresh_seed, padded_shard, to_numpy, to_xp
from ._cases import documented_sum

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi
SHAPES = [(40 * WORLD + 3, 96), (129,), (6 * WORLD, 5, 33)]
TRANSPORTS = [{}, {"symmetric_memory": "ipc"}, {"ce_split": 2}, {"batch_copies": False}]
CHUNKS = [{}, {"chunk_nbytes": 4096, "depth": 1}, {"chunk_nbytes": 65536, "depth": 3}]
SETTINGS = [{**t, **c} for t in TRANSPORTS for c in CHUNKS]


@pytest.fixture(scope="module", params=SETTINGS,
                ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def transport_group(request, group):
    g = ta.init(backend=group.backend.name, **request.param)
    yield g
    g.comm.Barrier()
    g.close()


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_bits_equal_the_documented_fold_everywhere(transport_group, xp, dtype):
    g = transport_group
    rng = np.random.default_rng(fresh_seed(g.comm, bits=30))
    every = [[(rng.standard_normal(s) * np.exp2(rng.integers(-10, 15, s))).astype(dtype)
              for s in SHAPES] for _ in range(WORLD)]
    want = [padded_shard(documented_sum([e[j] for e in every], g.topology, 1.0 / WORLD),
                         WORLD, g.rank)
            for j in range(len(SHAPES))]
    grads = [to_xp(xp, a) for a in every[g.rank]]
    plan = ta.Unit(SHAPES, dtype, group=g).reduce_plan(grads, op="avg")
    failures = []
    for run in range(2):
        for how, outs in (("plan", plan()), ("call", ta.reduce_scatter(grads, group=g))):
            for j, (o, w) in enumerate(zip(outs, want)):
                n = int((bits(to_numpy(o)) != bits(w)).sum())
                if n:
                    failures.append(f"run {run} {how}: parameter {j}: {n} elements differ "
                                    "from the fold")
    agree(g.comm, failures, f"{dtype}")
