"""Groups, multi-rank: the node split, the topology override, other communicators."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import tidearray
from tidearray._group import default_group
from tidearray.layout import full_from_shards

from ..._util import BF16, agree, bits, compare_bits, padded_shard, random_bits, to_numpy, to_xp
from ._cases import check_usable

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi


def _expected_local_size(comm) -> int:
    env = os.environ.get("TIDE_LOCAL_SIZE", "")
    if env:
        return int(env)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    size = node.size
    node.Free()
    return size


def test_topology(group, comm):
    """Ranks, node-local and inter-node communicators follow ``global = node * L + local``."""
    L = _expected_local_size(comm)
    t, failures = group.topology, []
    if (group.size, group.rank, group.local_size) != (comm.size, comm.rank, L):
        failures.append(f"expected size/rank/local {comm.size, comm.rank, L}, got "
                        f"{group.size, group.rank, group.local_size}")
    if t.num_nodes * L != comm.size or group.local_rank != comm.rank % L:
        failures.append(f"expected {comm.size // L} nodes, local rank {comm.rank % L}; got {t}")
    node_members = group.node_comm.allgather(comm.rank)
    if node_members != [t.node * L + i for i in range(L)]:
        failures.append(f"node communicator holds ranks {node_members}")
    inter_members = group.inter_comm.allgather(comm.rank)
    if inter_members != list(t.column(t.local_rank)):
        failures.append(f"inter-node communicator holds ranks {inter_members}")
    if MPI.Comm.Compare(group.comm, comm) != MPI.CONGRUENT:
        failures.append("group.comm is not a private duplicate of the world communicator")
    want = os.environ.get("TIDE_BACKEND", "host")
    if group.backend.name != want:
        failures.append(f"expected backend {want!r}, got {group.backend.name!r}")
    agree(comm, failures)


def test_shard_helper_on_the_group(group, comm):
    """``shard(full, group=...)`` takes the group's rank and size, on the backend's arrays."""
    xp = group.backend.xp
    full = random_bits(np.random.default_rng(5), (3 * WORLD + 2, 3), BF16)
    mine = tidearray.shard(to_xp(xp, full), group=group)
    failures = [] if (bits(to_numpy(mine)) == bits(padded_shard(full, WORLD, comm.rank))).all() \
        else ["shard() with the group's rank differs from NumPy slicing"]
    shards = [s for s in comm.allgather(to_numpy(mine))]
    back = full_from_shards(shards, full.shape)
    if back.shape != full.shape or (bits(back) != bits(full)).any():
        failures.append("full_from_shards(all shards) is not the full parameter")
    agree(comm, failures)


def test_group_over_comm_self(group, comm):
    """A group of one rank per process, side by side with the world group."""
    g = tidearray.init(MPI.COMM_SELF, backend=group.backend.name, local_size=1)
    failures = [] if (g.size, g.rank) == (1, 0) else [f"expected size 1, got {g}"]
    failures += check_usable(g)
    g.close()
    agree(comm, failures)


def test_group_over_a_split_communicator(group, comm):
    """Two sub-groups (even and odd ranks) run collectives at the same time."""
    sub = comm.Split(comm.rank % 2, comm.rank)
    L = _expected_local_size(comm)
    # An emulated local size must divide the sub-group; otherwise emulate one rank per node.
    try:
        g = tidearray.init(sub, backend=group.backend.name,
                           local_size=L if sub.size % L == 0 else 1)
    except tidearray.TideInvalid as e:
        # On cuda, emulated nodes whose ranks share a GPU are refused before NCCL sees
        # them (NCCL would fail or hang): a clear error on every rank of the sub-group.
        refused = group.backend.name == "cuda" and "distinct GPUs" in str(e)
        failures = [] if refused else [f"init failed: {e}"]
    else:
        failures = [] if g.size == sub.size else [f"expected size {sub.size}, got {g}"]
        failures += check_usable(g, seed=comm.rank % 2)
        g.close()
    sub.Free()
    agree(comm, failures)


def test_bad_local_size_raises_everywhere(group, comm):
    """A local size that does not divide the world size: TideInvalid on every rank."""
    try:
        tidearray.init(backend=group.backend.name, local_size=comm.size + 1)
        failures = ["init accepted a local size that does not divide the world"]
    except tidearray.TideInvalid as e:
        failures = [] if "local_size" in str(e) else [f"unclear message: {e}"]
    agree(comm, failures)
    agree(comm, check_usable(group))


def test_default_group_and_close(group, comm):
    """``init`` makes the default group; ``close`` is idempotent and clears the default,
    so that a collective given no group then raises instead of starting one."""
    g = tidearray.init(backend=group.backend.name)
    failures = [] if default_group() is g else ["init did not set the default group"]
    failures += check_usable(g)
    g.close()
    g.close()
    if not g.closed:
        failures.append("close() did not mark the group closed")
    try:
        default_group()
        failures.append("default_group() after close returned a group")
    except tidearray.TideInvalid as e:
        failures += [] if "init()" in str(e) else [f"unclear message: {e}"]
    agree(comm, failures)


def test_first_collective_of_a_new_group_needs_no_barrier(comm):
    """A group's first collective, straight after ``init``, with no barrier between.

    Each rank leaves ``init`` when its own part is done; the host backend's fence
    window must not wait there for peers that are already spinning in the
    first collective's shared-memory agreement (it hung 3 runs in 10 at 4 ranks).
    """
    for k in range(5):
        g = tidearray.init(comm, backend="host", timeout=30)
        try:
            full = np.arange(8 * g.size + k, dtype=np.float32)
            out = tidearray.all_gather([tidearray.shard(full, group=g)], [full.shape], group=g)
            agree(comm, compare_bits(out[0], full, f"round {k}"))
        finally:
            g.close()


def test_synchronize_waits_then_checks(group, xp, monkeypatch):
    """``group.synchronize()`` returns once the device work is done (the gathered values
    are then readable) and raises what ``check`` raises on a broken group."""
    full = np.arange(4 * group.size * 3, dtype=np.float32).reshape(4 * group.size, 3)
    shard = xp.asarray(tidearray.shard(full, group=group))
    got = tidearray.all_gather([shard], [full.shape], group=group, async_op=True).wait()
    group.synchronize()
    ok = bool(np.array_equal(to_numpy(got[0]), full))

    def broken():
        raise tidearray.TideBackendError("collective #1 did not complete")

    monkeypatch.setattr(group.backend, "check", broken)
    try:
        group.synchronize()
        raised = False
    except tidearray.TideBackendError:
        raised = True
    monkeypatch.undo()
    assert group.comm.allreduce(ok and raised, op=MPI.LAND)
