"""The FSDP runtime end to end: ``examples/train.py`` against a single-process reference.

The reference is written here from the model and the optimizer's NumPy step
alone: full fp32 parameters, one forward and backward over every rank's
samples at once, one AdamW step per parameter. The runtime shards, gathers,
reduces and steps per rank; its losses must match the reference's within
1e-5 relative for 20 steps, at any world size, with and without gradient
accumulation. Checkpoints must resume bit for bit. (The benchmark's baseline comms
run these checks too: ``tests/benchmarks/mpi/test_comms.py``.)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np
import pytest

import tidearray
from tidearray._adamw import adamw_numpy, coefficients
from tidearray.fsdp import AdamW, clip_scale

from ..._util import agree, fresh_seed, to_numpy
from ...support import example

llama, train = example("llama"), example("train")

pytestmark = pytest.mark.mpi

CFG = llama.MODELS["tiny"]
STEPS, B, LR = 20, 2, 3e-3
#: fp32 on CPU: the runtime sums per-rank gradients, the reference sums all samples at once.
LOSS_RTOL = 1e-5


def reference_losses(world: int, steps: int, micro: int = 1, seed: int = 0,
                     clip: float = None) -> list[float]:
    """Single-process training of the same model on every rank's samples, fp32; with
    ``clip``, torch's global-norm rule over every gradient (computed in fp64)."""
    net = llama.Llama(CFG)
    params = llama.init_params(CFG, seed)
    moments = [[(np.zeros(p.size, np.float32), np.zeros(p.size, np.float32)) for p in u]
               for u in params]
    losses = []
    for s in range(steps):
        tokens, targets = llama.batch(CFG, step=s, batch_size=world * micro * B,
                                      first_sample=0, seed=seed)
        saved, x = [], tokens
        for i, unit in enumerate(params):
            x, sv = net.forward(i, unit, (x, targets) if i == len(params) - 1 else x)
            saved.append(sv)
        losses.append(float(x))
        grads, dx = [None] * len(params), 1.0
        for i in reversed(range(len(params))):
            dx, grads[i] = net.backward(i, params[i], saved[i], dx)
        coef = 1.0
        if clip is not None:
            norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum())
                               for unit in grads for g in unit))
            coef = clip_scale(norm, clip)
        c = coefficients(AdamW(lr=LR), s + 1, LR, coef)
        for unit, unit_grads, unit_moments in zip(params, grads, moments):
            for p, g, (m, v) in zip(unit, unit_grads, unit_moments):
                flat = p.reshape(-1)
                adamw_numpy(flat, m, v, np.ascontiguousarray(g, np.float32).reshape(-1), flat,
                            c)
    return losses


def _train(group, *extra: str, comm="tide") -> list[float]:
    """The trainer's losses with ``comm`` (``"tide"`` or a comm factory)."""
    args = train.parse(["--model", "tiny", "--tokens", str(B * CFG.seq), "--lr", str(LR),
                        "--param-dtype", "float32", *extra])
    log = train.Log(-1)  # quiet
    return train.run(args, group, comm, CFG, B, log)["losses"]


def _close(got: list[float], want: list[float], label: str) -> list[str]:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want))
           if abs(g - w) > LOSS_RTOL * abs(w)]
    if len(got) != len(want):
        return [f"{label}: expected {len(want)} losses, got {len(got)}"]
    return [f"{label}: step {i}: loss {g!r}, reference {w!r}" for i, g, w in bad[:3]]


def test_losses_match_the_single_process_reference(group):
    check_against_reference(group, "tide")


def check_against_reference(group, comm) -> None:
    """``comm``'s 20 losses are the single-process reference's, and go down."""
    if group.backend.name != "host":
        pytest.skip("the fp32 CPU reference is for the host backend")
    label = getattr(comm, "name", comm)
    got = _train(group, "--steps", str(STEPS), comm=comm)
    want = reference_losses(group.size, STEPS)
    failures = _close(got, want, label)
    if not got[-1] < 0.8 * got[0]:
        failures.append(f"{label}: loss did not go down: {got[0]:.4f} -> {got[-1]:.4f}")
    agree(group.comm, failures, "trainer vs reference")


@pytest.mark.parametrize("kind", ["stock", "nccl"])
def test_a_comm_kind_other_than_tide_is_refused(group, kind):
    """The runtime's one built-in comm is ``'tide'``; any other is a ``UnitComm`` factory
    (the benchmarks' baselines are such factories)."""
    from tidearray.fsdp import Runtime

    try:
        Runtime([[("w", np.ones((4, 3), np.float32))]], group=group, comm=kind)
        failures = [f"comm={kind!r} accepted"]
    except tidearray.TideInvalid as e:
        want = "a UnitComm factory"
        failures = [] if want in str(e) else [f"comm={kind!r}: {e} does not say {want!r}"]
    agree(group.comm, failures, "comm kinds")


def test_kept_param_shards_give_the_casting_gathers_losses_bitwise(group):
    """The optimizer's bf16 shards and the gathers' casts round the same masters to
    nearest even: the same parameters, so the same losses, bit for bit."""
    bf16 = ("--param-dtype", "bfloat16", "--steps", "6")
    cast = _train(group, *bf16)
    kept = _train(group, "--keep-param-shards", *bf16)
    failures = [] if cast == kept else [f"casting gathers {cast} != kept shards {kept}"]
    if not kept[-1] < kept[0]:
        failures.append(f"loss did not go down: {kept[0]:.4f} -> {kept[-1]:.4f}")
    agree(group.comm, failures, "kept param shards")


def test_unit_graphs_and_eager_plans_give_the_same_losses_bitwise(group, monkeypatch):
    """``Config.unit_graphs``: the units' graph plans (replayed recordings on the host,
    CUDA graphs on cuda) and the same plans issued eagerly at every call are the same
    collectives, so the same losses, bit for bit; and the option does build graph plans."""
    built = []  # per plan the runtime built: whether it is a graph plan
    for name in ("gather_plan", "reduce_plan"):
        make = getattr(tidearray.Unit, name)

        def spy(self, *args, _make=make, **kwargs):
            plan = _make(self, *args, **kwargs)
            built.append(plan.graph is not None)
            return plan

        monkeypatch.setattr(tidearray.Unit, name, spy)
    args = ("--param-dtype", "bfloat16", "--steps", "6")
    config = group.config
    monkeypatch.setattr(group, "config", dataclasses.replace(config, unit_graphs=True))
    graphs = _train(group, *args)
    with_graphs = list(built)
    monkeypatch.setattr(group, "config", dataclasses.replace(config, unit_graphs=False))
    eager = _train(group, *args)
    failures = [] if graphs == eager else [f"unit graphs {graphs} != eager plans {eager}"]
    if not with_graphs or not all(with_graphs):
        failures.append(f"expected graph plans with unit_graphs, got {sum(with_graphs)} of "
                        f"{len(with_graphs)}")
    if any(built[len(with_graphs):]):
        failures.append("unit_graphs=False built graph plans")
    if not graphs[-1] < graphs[0]:
        failures.append(f"loss did not go down: {graphs[0]:.4f} -> {graphs[-1]:.4f}")
    agree(group.comm, failures, "unit graphs")


def autograd_order_step(sm, net, tokens, targets):
    """``train.train_step``, but as autograd may run it: unit ``i``'s backward starts
    before unit ``i+1``'s reduction is issued (the prefetch of ``i-1`` must then wait
    for unit ``i+1``'s slot)."""
    n = sm.num_units
    saved, x = [], tokens
    for i in range(n):
        x, s = net.forward(i, sm.pre_forward(i), (x, targets) if i == n - 1 else x)
        saved.append(s)
        sm.post_forward(i)
    loss, dx, done = x, 1.0, None
    for i in reversed(range(n)):
        params, grads = sm.pre_backward(i)
        if done is not None:
            sm.post_backward(done)
        dx, _ = net.backward(i, params, saved[i], dx, grads_out=grads)
        saved[i], done = None, i
    sm.post_backward(done)
    return loss


def test_autograd_order_on_two_slots_gives_the_same_losses(group, monkeypatch):
    """Two slots (prefetch 1) and the interleaved hook order: bit for bit the in-order run."""
    same_losses_with_step(group, "tide", monkeypatch, autograd_order_step, "autograd order")


def same_losses_with_step(group, comm, monkeypatch, train_step, what):
    """Four steps with ``train.train_step`` replaced give the plain run's losses: bit for
    bit on the host; on cuda, where two runs of the same steps can differ in the last bit,
    within the losses' tolerance."""
    impl = getattr(comm, "name", comm)
    try:
        want = _train(group, "--steps", "4", comm=comm)
    except tidearray.TideInvalid as e:  # raised on every rank, so all skip together
        if "one rank per GPU" in str(e):
            pytest.skip(f"stock needs one rank per GPU: {e}")
        raise
    monkeypatch.setattr(train, "train_step", train_step)
    got = _train(group, "--steps", "4", comm=comm)
    ok = got == want if group.backend.name == "host" else not _close(got, want, impl)
    agree(group.comm, [] if ok else [f"{impl}: {got} != {want}"], what)


def step_after_forward_only_passes(sm, net, tokens, targets):
    """``train.train_step`` after an evaluation forward (every unit, no backward) and a
    forward abandoned half way (a discarded forward), as real loops run them."""
    n = sm.num_units
    x = tokens
    for i in range(n):  # evaluation: the last unit stays gathered, and no backward comes
        x, _ = net.forward(i, sm.pre_forward(i), (x, targets) if i == n - 1 else x)
        sm.post_forward(i)
    x = tokens
    for i in range(n // 2 + 1):  # abandoned: the next pre_forward(0) starts a new pass
        x, _ = net.forward(i, sm.pre_forward(i), x)
        sm.post_forward(i)
    if n > 2:
        sm.release()  # the documented way to end a forward-only pass at once
    return _plain_train_step(sm, net, tokens, targets)


_plain_train_step = train.train_step


def test_forward_only_passes_between_steps_change_nothing(group, monkeypatch):
    """The losses of the run without them: bit for bit on the host."""
    same_losses_with_step(group, "tide", monkeypatch, step_after_forward_only_passes,
                          "forward-only")


def test_gradient_accumulation_matches_the_reference(group):
    if group.backend.name != "host":
        pytest.skip("the fp32 CPU reference is for the host backend")
    got = _train(group, "--steps", "6", "--micro-batches", "2")
    agree(group.comm, _close(got, reference_losses(group.size, 6, micro=2), "micro-batches"))


@pytest.mark.parametrize("accumulate", ["mean", "sum"])
def test_micro_batches_combine_as_asked(group, accumulate):
    """Two backward passes of one unit before a step, each writing a fresh random gradient
    on every rank: the finalized gradient (the shards times the step's factor) is, row
    by row, the mean over ranks of the passes' mean (``accumulate="mean"``) or of their
    sum (``"sum"``, torch's), against a float64 reference within 1e-6 of the sum of the
    terms' magnitudes (fp32 sums). A bad value is a TideInvalid."""
    from tidearray.fsdp import Runtime

    with pytest.raises(tidearray.TideInvalid, match="accumulate: expected 'mean' or 'sum'"):
        Runtime([[("w", np.zeros((2, 3), np.float32))]], group=group, param_dtype="float32",
                accumulate="avg")
    shape = (5, 3)
    seed = fresh_seed(group.comm, bits=32)
    grads = np.random.default_rng(seed).standard_normal((2, group.size, *shape))
    grads = grads.astype(np.float32)  # [pass, rank]: what each pass writes on each rank
    rt = Runtime([[("w", np.zeros(shape, np.float32))]], group=group, param_dtype="float32",
                 accumulate=accumulate)
    for m in range(2):
        _one_pass(rt, grads[m, group.rank])
    factor = rt.finalize_grads().factor
    rt.synchronize()
    per = 2.0 * group.size if accumulate == "mean" else float(group.size)
    want = grads.astype(np.float64).sum(axis=(0, 1)) / per
    scale = np.abs(grads.astype(np.float64)).sum(axis=(0, 1)) / per  # fp32 sums' error scale
    rows = rt.arena.layout.units[0].specs[0].rows(rt.rank)
    shard = rt.grads(0)[0]
    shard = shard.get() if hasattr(shard, "get") else shard  # cupy on the cuda backend
    got = np.asarray(shard, dtype=np.float64)[:rows[1] - rows[0]] * factor
    err = float(np.max(np.abs(got - want[rows[0]:rows[1]]) / scale[rows[0]:rows[1]],
                       initial=0.0))
    rt.close()
    agree(group.comm, [] if err <= 1e-6 else [f"{accumulate}: relative error {err:.1e}"],
          f"micro-batches, {accumulate}")


def _one_pass(rt, grad: np.ndarray) -> None:
    """A forward and backward of a one-unit runtime whose backward writes ``grad``."""
    rt.pre_forward(0)
    rt.post_forward(0)
    _, out = rt.pre_backward(0)
    out[0][...] = rt.xp.asarray(grad)
    rt.post_backward(0)


@pytest.mark.parametrize("after", ["clip_grad_norm_", "post_backward"])
def test_zero_grad_drops_a_clip_of_the_dropped_gradients(group, after):
    """``zero_grad()`` drops a backward: right after its last ``post_backward`` (it finishes
    the backward first, as ``step`` does), or after a ``clip_grad_norm_`` of it, which
    then does not clip the next step. After one more backward, the masters are bitwise
    those of a runtime that saw only that backward (fresh random gradients and weights)."""
    from tidearray.fsdp import Runtime

    seed = fresh_seed(group.comm, bits=32)
    rng = np.random.default_rng(seed)
    weights, dropped, kept = (rng.standard_normal((3, 7, 3)) * [[[1]], [[100]], [[1]]]
                              ).astype(np.float32)
    masters = []
    for drop_one in (True, False):
        rt = Runtime([[("w", weights)]], group=group, param_dtype="float32",
                     optimizer=AdamW(lr=LR))
        if drop_one:
            _one_pass(rt, dropped)
            if after == "clip_grad_norm_":
                rt.clip_grad_norm_(1e-3)  # far below the dropped gradient's norm
            rt.zero_grad()
        _one_pass(rt, kept)
        rt.step()
        rt.synchronize()
        m = rt.params(0)[0]
        masters.append(np.array(m.get() if hasattr(m, "get") else m))
        rt.close()
    same = masters[0].tobytes() == masters[1].tobytes()
    agree(group.comm, [] if same else ["the dropped backward's clip reached the step"],
          f"zero_grad after {after}")


def test_gradient_clipping_matches_the_reference(group):
    """A clip well below the gradients' norm, so every step is clipped."""
    if group.backend.name != "host":
        pytest.skip("the fp32 CPU reference is for the host backend")
    got = _train(group, "--steps", "8", "--clip", "0.05")
    agree(group.comm, _close(got, reference_losses(group.size, 8, clip=0.05), "clip"))


def test_checkpoint_resume_reproduces_the_next_losses(group):
    """Train 10 steps; separately train 5, save, load into a fresh model, train 5 more:
    the last 5 losses must be identical, bit for bit (on the GPU, where the model's own
    embedding backward is not deterministic, within 1e-5)."""
    path = group.comm.bcast(tempfile.mkdtemp(prefix="tide-ckpt-") if group.rank == 0 else None)
    ckpt = os.path.join(path, "ckpt")
    straight = _train(group, "--steps", "10")
    _train(group, "--steps", "5", "--save", ckpt)
    resumed = _train(group, "--steps", "5", "--resume", ckpt,
                     "--export", os.path.join(path, "full.npz"))
    if group.backend.name == "host":
        failures = [] if resumed == straight[5:] else [f"resumed {resumed} != {straight[5:]}"]
    else:  # the model's embedding backward adds with atomics on the GPU: run to run, not bitwise
        failures = _close(resumed, straight[5:], "resumed (cuda, 1e-5)")
    group.comm.Barrier()
    if group.rank == 0:
        full = np.load(os.path.join(path, "full.npz"))
        names = [f"{u}.{n}" for u, unit in enumerate(llama.unit_specs(CFG)) for n, _ in unit]
        shapes = [s for unit in llama.unit_specs(CFG) for _, s in unit]
        if sorted(full.files) != sorted(names):
            failures.append(f"export: expected {sorted(names)}, got {sorted(full.files)}")
        failures += [f"export: {n}: shape {full[n].shape}" for n, s in zip(names, shapes)
                     if n in full.files and full[n].shape != s]
    agree(group.comm, failures, "checkpoint")


@pytest.mark.parametrize("damage", ["stale", "truncated", "short moments"])
def test_a_damaged_or_stale_rank_file_is_refused_on_every_rank(group, xp, damage):
    """A checkpoint whose last rank's file is of another save (one step later), cut short,
    or holds moments of the wrong length: every rank raises TideInvalid naming that file,
    before any state changes (a mixed model used to load without a word, and a damaged
    file raised on its rank alone while the others waited)."""
    import shutil

    from .test_norm import _backward, _model

    if damage == "stale" and group.size == 1:
        pytest.skip("a file of another save beside rank 0's needs 2+ ranks")
    root = group.comm.bcast(tempfile.mkdtemp(prefix="tide-ckpt-") if group.rank == 0 else None)
    first, later, mixed = (os.path.join(root, d) for d in ("first", "later", "mixed"))
    sm = _model(group, xp)
    for step, path in ((0, first), (1, later)):
        _backward(sm, step)
        sm.step()
        sm.save(path)
    mine = f"rank{group.rank:05d}.npz"
    if group.rank == 0:
        shutil.copytree(first, mixed)
    group.comm.Barrier()
    if group.rank == group.size - 1:
        target = os.path.join(mixed, mine)
        if damage == "stale":
            shutil.copy(os.path.join(later, mine), target)
        elif damage == "truncated":
            with open(target, "r+b") as f:
                f.truncate(100)
        else:
            with np.load(target) as npz:
                arrays = {k: npz[k] for k in npz.files}
            np.savez(target, **{**arrays, "exp_avg": arrays["exp_avg"][:-1]})
    group.comm.Barrier()
    fresh = _model(group, xp)
    before = fresh.arena.master.copy()
    try:
        fresh.load(mixed)
        failures = ["expected TideInvalid, got none"]
    except tidearray.TideInvalid as e:
        bad_file = f"rank{group.size - 1:05d}.npz"
        failures = [] if bad_file in str(e) else [f"expected {bad_file} named, got {e}"]
    if to_numpy(fresh.arena.master).tobytes() != to_numpy(before).tobytes():
        failures.append("the masters changed")
    agree(group.comm, failures, f"a {damage} rank file")
