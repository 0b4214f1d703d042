"""A runtime on a group of one rank ([Note: one rank's gathers] in ``tidearray.fsdp._comm``).

A gather there communicates nothing. Where the source is in the param dtype (fp32
parameters from the masters, or bf16 from kept send shards) the gathered parameters
are views of it, bitwise its values, and the slots hold no parameters; bf16 from fp32
masters still goes through the cast plan into a slot. Each rank runs a group of its
own (over ``COMM_SELF``), so these run at any world size; training on one follows the
single-process reference (``test_train``'s), and kept shards train bit for bit as the
casting gathers.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray
from tidearray import _group
from tidearray.fsdp import Runtime

from ..._util import BF16, agree, bits, fresh_seed, to_numpy
from .test_train import STEPS, _close, _train, reference_losses

pytestmark = pytest.mark.mpi

#: (param dtype, keep_param_shards) -> whether the gathers are views of the source.
CASES = {("float32", False): True, ("bfloat16", True): True, ("bfloat16", False): False}


@pytest.fixture
def alone(group, monkeypatch):
    """A group of this rank alone (``init`` makes it the default: the world's is put back)."""
    monkeypatch.setattr(_group, "_default", group)
    g = tidearray.init(MPI.COMM_SELF, backend=group.backend.name, local_size=1)
    yield g
    g.close()


def _span(a) -> tuple[int, int]:
    """The bytes ``a`` (NumPy or CuPy) spans: [first, end)."""
    ptr = a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr
    return ptr, ptr + a.nbytes


@pytest.mark.parametrize("dtype,keep", list(CASES))
def test_gathers_at_one_rank_are_views_of_a_source_in_the_param_dtype(group, alone, dtype,
                                                                       keep):
    rng = np.random.default_rng(fresh_seed(group.comm, bits=32) + group.rank)
    shapes = [[(7, 5), (5,)], [(3, 4, 2)], [(6,), (2, 3), (1,)]]
    values = [[rng.standard_normal(s).astype(np.float32) for s in unit] for unit in shapes]
    rt = Runtime([[(f"p{i}.{j}", v) for j, v in enumerate(unit)]
                  for i, unit in enumerate(values)],
                 group=alone, param_dtype=dtype, keep_param_shards=keep, num_slots=2)
    views = CASES[(dtype, keep)]
    source = rt.arena.master if rt.arena.send is None else rt.arena.send
    lo, hi = _span(source)
    want_dtype = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    failures = []
    for i, unit in enumerate(values):
        got = rt.pre_forward(i)
        for j, (g, v) in enumerate(zip(got, unit)):
            host, want = to_numpy(g), v.astype(want_dtype)  # rounded to nearest even
            if host.shape != want.shape or host.dtype != want.dtype or \
                    (bits(host) != bits(want)).any():
                failures.append(f"unit {i} parameter {j}: expected the masters in {dtype}, "
                                f"got {host.dtype} {host.shape} with other values")
            first, end = _span(g)
            if (lo <= first and end <= hi) != views:
                failures.append(f"unit {i} parameter {j}: expected "
                                f"{'a view of' if views else 'a slot apart from'} the "
                                f"{'send shards' if keep else 'masters'}, got the other")
        rt.post_forward(i)
    slot_bytes = sum(s.nbytes for s in rt.comm.slots)
    biggest = max(u.nbytes for u in rt.comm.units)
    if (slot_bytes == 0) != views or (not views and slot_bytes < biggest):
        failures.append(f"expected slots of {0 if views else f'at least {biggest}'} bytes "
                        f"(staging only where the gathers are views), got {slot_bytes}")
    rt.release()
    rt.close()
    agree(group.comm, failures, f"gathers at one rank, {dtype}, keep_param_shards={keep}")


def test_training_at_one_rank_follows_the_reference(group, alone):
    """fp32 (views of the masters) against the single-process reference; bf16 from kept
    shards (views) bit for bit as bf16 through the casting gathers (slots)."""
    if group.backend.name != "host":
        pytest.skip("the fp32 CPU reference is for the host backend")
    got = _train(alone, "--steps", str(STEPS))
    failures = _close(got, reference_losses(1, STEPS), "fp32 at one rank")
    if not got[-1] < 0.8 * got[0]:
        failures.append(f"fp32 at one rank: loss did not go down: {got[0]:.4f} -> {got[-1]:.4f}")
    bf16 = ("--param-dtype", "bfloat16", "--steps", "6")
    cast, kept = _train(alone, *bf16), _train(alone, "--keep-param-shards", *bf16)
    if cast != kept:
        failures.append(f"bf16 at one rank: casting gathers {cast} != kept shards {kept}")
    agree(group.comm, failures, "training at one rank")
