"""The runtime's hooks driven by hand as a front end with use tokens drives them, for a
model called twice before one backward ([Note: unit lifecycle], "Slots: suspended units").

Four units of one parameter each share two slots. Two forwards (calls A, then B), then
B's backward through every unit, then A's through the top two units only (the rest of
A's graph is gone: its tokens die). On the way, open units lose their slots to units
whose backward opens (suspended: reduced so far), a suspended unit is opened afresh by
its next backward, and one is gathered again by a prefetch and then closed without a
backward of its own (it must not reduce the buffer it lost). Each unit's gradient shard
must be, row by row, the mean over the ranks of what its backwards wrote (B's, plus A's
for the top two), against a float64 reference within 1e-6 of the terms' magnitudes.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tidearray.fsdp import FrontEnd, Runtime, UseToken

from ..._util import agree, fresh_seed, to_numpy

pytestmark = pytest.mark.mpi
UNITS, SHAPE = 4, (5, 3)


def _backward(rt: Runtime, i: int, grad: np.ndarray, token: UseToken) -> None:
    """One use's backward of unit ``i``: it writes ``grad``, then its use is done."""
    _, out = rt.pre_backward(i)
    out[0][...] = rt.xp.asarray(grad)
    rt.grad_written(i, 0)
    rt.use_done(i, token)


def test_a_model_called_twice_reduces_each_backward_once(group):
    seed = fresh_seed(group.comm, bits=32)
    # [call, rank, unit]: what each call's backward writes on each rank (A: index 0)
    grads = np.random.default_rng(seed).standard_normal((2, group.size, UNITS, *SHAPE))
    grads = grads.astype(np.float32)
    rt = Runtime([[(f"w{i}", np.zeros(SHAPE, np.float32))] for i in range(UNITS)],
                 group=group, param_dtype="float32", num_slots=2,
                 front_end=FrontEnd(report_grads=True, accumulate="sum"))
    tokens = [[UseToken() for _ in range(UNITS)] for _ in range(2)]
    for call in tokens:  # A, then B
        for i in range(UNITS):
            rt.pre_forward(i, call[i])
            rt.post_forward(i)
    mine = grads[:, group.rank]
    for i in reversed(range(UNITS)):  # B's backward: each unit's A-use still to come
        _backward(rt, i, mine[1, i], tokens[1][i])
    for i in (3, 2):  # A's, through the top two units
        _backward(rt, i, mine[0, i], tokens[0][i])
    suspended_regathered = [i for i in rt.life.suspended if rt.gathered(i)]
    del tokens  # A's graph below unit 2 is gone
    gc.collect()
    rt.finish_backward()
    factor = rt.finalize_grads().factor
    rt.synchronize()

    failures = [] if suspended_regathered else [
        "expected a suspended unit gathered again by a prefetch before the end (the case "
        "this test is for), got none"]
    want = grads.astype(np.float64)
    want[0, :, :2] = 0  # A's backward never reached units 0 and 1
    scale = np.abs(want).sum(axis=(0, 1)) / group.size
    want = want.sum(axis=(0, 1)) / group.size
    for i in range(UNITS):
        rows = rt.arena.layout.units[i].specs[0].rows(rt.rank)
        got = to_numpy(rt.grads(i)[0]).astype(np.float64)[:rows[1] - rows[0]] * factor
        err = float(np.max(np.abs(got - want[i, rows[0]:rows[1]])
                           / scale[i, rows[0]:rows[1]], initial=0.0))
        if not err <= 1e-6:
            failures.append(f"unit {i}: relative error {err:.1e}")
    rt.close()
    agree(group.comm, failures, "a model called twice, hooks by hand")
