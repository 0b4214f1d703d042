"""Graph plans and the replay-safe flags, multi-rank: a plan captured once and replayed
([Note: graph plans] in ``_plan``) gives what its eager call gives, call after call.

On the host backend a "graph" is the call's primitives recorded once and replayed in
order; on cuda, a CUDA graph. Either way a replay repeats the captured flag values, so
these tests check the protocol that allows it ([Note: replay-safe flags] in ``_arena``):
after every call, every flag is 0 again. Each replay gets new inputs, written in place,
and poisoned outputs; the reductions sum normal values (inexact in fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import tidearray as ta
import tidearray._stamps as _stamps
from tidearray._arena import ARRIVED, FREE, NUM_CHANNELS, NUM_KINDS, STAMP

from ..._util import BF16, FP32, agree, compare_bits, fresh_seed, padded_shard, to_numpy, to_xp
from ._cases import full_params, poison, rank_grads

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.mpi
#: Rows enough for several 4 KiB reduce-scatter chunks per call (a pipelined call).
SHAPES = [(96 * WORLD + 1, 64), (5,), (2 * WORLD, 3, 7), (3 * WORLD + 2, 24)]
#: fp32 accumulation of W normal values vs fp64: relative to the sum of magnitudes.
RS_RTOL = 4 * WORLD * 2.0**-24
REPLAYS = 6


@pytest.fixture(scope="module", params=["default", "debug", "flag-memops"])
def tgroup(request, group):
    """A group with the defaults, one in debug mode, whose replays check their stamps,
    and on cuda one whose graphs signal and wait with stream memory operations
    (``graph_flag_kernels=False``; kernels by default); 4 KiB chunks."""
    if request.param == "flag-memops" and group.backend.name != "cuda":
        pytest.skip("flags in graphs are a cuda backend choice")
    g = ta.init(backend=group.backend.name, chunk_nbytes=4096,
                debug=request.param == "debug",
                graph_flag_kernels=request.param != "flag-memops")
    yield g
    g.comm.Barrier()
    g.close()


def _seed(comm) -> int:
    return fresh_seed(comm, bits=32)


def nonzero_flags(group, regions) -> list[str]:
    """Every FREE, ARRIVED and STAMP word of ``regions`` that is not 0 on
    this rank, once every rank has finished its calls."""
    group.synchronize()
    group.comm.Barrier()
    L = group.local_size
    bad = []
    for r in regions:
        words = to_numpy(r.buffer.view(r.nbytes, (NUM_CHANNELS * NUM_KINDS * L,), "int32"))
        flags = words.reshape(NUM_CHANNELS, NUM_KINDS, L)
        for kind, name in ((FREE, "FREE"), (ARRIVED, "ARRIVED"), (STAMP, "STAMP")):
            for ch, peer in zip(*np.nonzero(flags[:, kind, :])):
                bad.append(f"region {r.id}: {name} word of channel {ch} about peer {peer} "
                           f"is {flags[ch, kind, peer]} between calls")
    group.comm.Barrier()  # nobody starts the next call before every rank has looked
    return bad


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_graph_plans_replay_as_eager_calls(tgroup, xp, dtype):
    """A gather, a cast gather and a pipelined reduction, each as an eager plan and as a
    graph plan, called six times with new data: the graph gathers give the full
    parameters bitwise, the graph reduction the eager one's bits (and the fp64 sum
    within tolerance). Eager calls into the graph's own slot come between replays, and
    every flag is 0 after each round. Every other replay is asynchronous: launched beside
    the stream, whose later reads wait for it through ``Work.wait``."""
    g = tgroup
    unit = ta.Unit(SHAPES, dtype, group=g)
    assert g.size == 1 or len(unit.rs_plan.chunks) > g.config.depth, "test bug: want pipelining"
    arena = ta.SlotArena(max(unit.nbytes, unit.staging_nbytes), num_slots=4, group=g)
    shards = [xp.zeros(s, dtype) for s in unit.shard_shapes]
    masters = [xp.zeros(s, FP32) for s in unit.shard_shapes]
    grads = [xp.zeros(s, dtype) for s in SHAPES]
    eager_gather = unit.gather_plan(shards, arena[0])
    graph_gather = unit.gather_plan(shards, arena[1], graph=True)
    graph_cast = unit.gather_plan(masters, arena[2], cast=True, graph=True)
    eager_reduce = unit.reduce_plan(grads, op="sum")
    graph_reduce = unit.reduce_plan(grads, op="sum", staging=arena[3], graph=True)
    seed = _seed(g.comm)
    failures = []
    for call in range(REPLAYS):
        if call % 3 == 2:  # eager calls on the graphs' own slot and staging, before the poison
            ta.all_gather(shards, SHAPES, group=g, slot=arena[1])
            ta.reduce_scatter(grads, op="sum", group=g, staging=arena[3])
        full = full_params(SHAPES, dtype, seed + call)
        rng = np.random.default_rng([seed, call])
        exact = [(rng.standard_normal(s) * 2.0 ** rng.integers(-8, 8, s)).astype(FP32)
                 for s in SHAPES]
        for s, m, f, e in zip(shards, masters, full, exact):
            s[...] = to_xp(xp, padded_shard(f, g.size, g.rank))
            m[...] = to_xp(xp, padded_shard(e, g.size, g.rank))
        every = [rank_grads(SHAPES, dtype, seed + call, r) for r in range(g.size)]
        for grad, mine in zip(grads, every[g.rank]):
            grad[...] = to_xp(xp, mine)
        for slot in arena.slots[:3]:
            poison(slot)
        for o in graph_reduce.out:
            o.fill(np.nan)
        # Odd calls launch beside the current stream (async_op) and join it by Work.wait.
        replay = (lambda plan: plan(async_op=True).wait()) if call % 2 else (lambda plan: plan())
        want = [to_numpy(p).copy() for p in eager_gather()]
        got = replay(graph_gather)
        cast = replay(graph_cast)
        reduced = [to_numpy(o).copy() for o in eager_reduce()]
        replayed = replay(graph_reduce)
        for i, f in enumerate(full):
            failures += compare_bits(want[i], f, f"call {call}: eager gather {i}")
            failures += compare_bits(got[i], f, f"call {call}: graph gather {i}")
            failures += compare_bits(cast[i], exact[i].astype(dtype),
                                     f"call {call}: graph cast gather {i}")
            failures += compare_bits(replayed[i], reduced[i], f"call {call}: graph reduction {i}")
            total = sum(e[i].astype(np.float64) for e in every)
            bound = padded_shard(sum(np.abs(e[i].astype(np.float64)) for e in every),
                                 g.size, g.rank) * RS_RTOL
            err = np.abs(to_numpy(replayed[i]).astype(np.float64)
                         - padded_shard(total, g.size, g.rank))
            if not np.all(err <= bound):
                failures.append(f"call {call}: reduction {i}: max error {np.nanmax(err)!r}")
        failures += nonzero_flags(g, [*arena.slots, eager_reduce.staging])
    agree(g.comm, failures, "graph plans")
    for s in arena.slots:
        s.free()


def test_eager_calls_leave_every_flag_zero(tgroup, xp):
    """The eager collectives reset what they signal too: after a gather into the group's
    own slots and a reduction without ``out=``, every flag is 0 on every rank."""
    g = tgroup
    full = full_params(SHAPES, FP32, _seed(g.comm))
    shards = [to_xp(xp, padded_shard(f, g.size, g.rank)) for f in full]
    ta.all_gather(shards, SHAPES, group=g)
    ta.reduce_scatter([to_xp(xp, a) for a in rank_grads(SHAPES, FP32, 5, g.rank)], group=g)
    regions = [r for kind in ("slot", "staging") for r in g.kept(("default", kind)).regions]
    agree(g.comm, nonzero_flags(g, regions), "eager calls")


def _raises(call, expect: tuple, what: str) -> list[str]:
    """No failure if ``call()`` raises TideBackendError saying one of ``expect``; else why."""
    try:
        call()
    except ta.TideBackendError as e:
        return [] if any(w in str(e) for w in expect) else [f"unclear message: {e}"]
    return [what]


def test_a_replay_after_a_fault_raises(group, xp):
    """Rank 0 skips a replay: every other rank's replay times out (host: at the call;
    cuda: the watchdog, seen at the next synchronize), and any later replay raises at
    once instead of running on flags left mid-protocol."""
    if group.size < 2 or group.topology.num_nodes > 1:
        pytest.skip("needs two ranks on one node (flags only, no inter-node messages)")
    g = ta.init(backend=group.backend.name, timeout=1.0, debug=False)  # no per-call agreement
    unit = ta.Unit(SHAPES, FP32, group=g)
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=g)
    shards = [xp.zeros(s, FP32) for s in unit.shard_shapes]
    plan = unit.gather_plan(shards, arena[0], graph=True)
    # The ranks leave the plan's making at different times (seconds apart on a busy
    # machine): under the 1 s timeout, the replay that must complete starts together.
    g.comm.Barrier()
    plan()
    failures = []
    if g.rank != 0:
        failures += _raises(lambda: (plan(), g.synchronize()), ("timed out", "did not complete"),
                            "a replay that rank 0 never joined completed")
        failures += _raises(plan, ("can no longer be used",), "a replay on a broken group ran")
    agree(g.comm, failures, "replay after a fault")
    g.comm.Barrier()
    g.close()


def test_a_replayed_stamp_that_never_arrives_fails_every_rank(group, xp, monkeypatch):
    """Debug mode: rank 1's graph is captured without its stamps (as if its data never
    came). The build's own run had them, but every replay raises on every rank."""
    if group.local_size < 2:
        pytest.skip("stamps are node-local: needs two ranks on a node")
    g = ta.init(backend=group.backend.name, debug=True)
    unit = ta.Unit(SHAPES, FP32, group=g)
    arena = ta.SlotArena(unit.nbytes, num_slots=1, group=g)
    shards = [xp.zeros(s, FP32) for s in unit.shard_shapes]
    if g.topology.local_rank == 1:
        capture = type(g.backend).capture

        def capture_without_stamps(backend, issue, what, **kw):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(_stamps.Stamps, "send", lambda *a, **k: None)
                return capture(backend, issue, what, **kw)
        monkeypatch.setattr(type(g.backend), "capture", capture_without_stamps)
    plan = unit.gather_plan(shards, arena[0], graph=True)
    monkeypatch.undo()
    failures = []
    for call in range(2):
        failures += _raises(plan, ("read before it arrived",),
                            f"replay {call} returned although rank 1's stamps never arrive")
    agree(g.comm, failures, "debug replay")
    g.comm.Barrier()
    g.close()


def test_a_captured_step_needs_the_cuda_backend(group):
    """``CapturedStep`` captures a CUDA graph: on the host backend it refuses, clearly, on
    every rank (and ``train.py --graph`` says so before building anything)."""
    if group.backend.name != "host":
        pytest.skip("the cuda backend captures (tests/fsdp/gpu/test_captured_step.py)")
    from tidearray.fsdp import CapturedStep, Runtime

    from ...support import example

    train = example("train")

    model = Runtime([[("w", np.ones((4 * group.size, 3), np.float32))]], group=group,
                         param_dtype="float32")
    with pytest.raises(ta.TideInvalid, match="expected a model on the cuda backend"):
        CapturedStep(model, lambda: None)
    model.close()
    with pytest.raises(SystemExit, match="--graph: expected the cuda backend"):
        train.configure(train.parse(["--graph"]), group)
