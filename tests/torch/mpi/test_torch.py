"""``tidearray.torch.shard_module`` against plain PyTorch, multi-rank, on the host backend.

A small network trained on every rank's samples by ``shard_module`` (units sharded,
gathered by hooks, gradients reduce-scattered, the fused AdamW on the shards) must give
the losses of the same network trained in one process on all the samples with
``torch.optim.AdamW``: within 1e-5 relative, for 10 steps, in fp32. Skipped without torch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ..._util import agree, on_rank_zero

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mpi
LR, STEPS, B = 1e-2, 10, 4
LOSS_RTOL = 1e-5


class _Checkpointed(torch.nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


class _Compiled(torch.nn.Module):
    """Runs ``inner`` through ``torch.compile`` (AOT autograd, no code generation: the
    graph capture and the compiled backward are what meet the hooks)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fn = torch.compile(inner, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


WRAP = {"plain": lambda u: u, "checkpointed": _Checkpointed, "compiled": _Compiled}


def _model(seed: int, wrap: str = "plain") -> tuple:
    torch.manual_seed(seed)
    units = [torch.nn.Linear(6, 16), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 16)),
             torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 3))]
    layers = [WRAP[wrap](u) if k == 1 else u for k, u in enumerate(units)]
    return torch.nn.Sequential(*layers), units


def _batch(step: int, first: int, n: int) -> tuple:
    rng = np.random.default_rng([step % 2, first])  # two batches in turn: a learnable fit
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = np.sin(x[:, :3] * 2).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def _reference(model, group) -> list[float]:
    """One process on the global batch (collective: rank 0 trains ``model``)."""
    return on_rank_zero(group.comm, lambda: _one_process(model, group.size))


def _one_process(model, world: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    losses = []
    for s in range(STEPS):
        xs, ys = zip(*[_batch(s, r, B) for r in range(world)])
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("wrap", list(WRAP))
@pytest.mark.parametrize("units_given", [3, 2, 0])
def test_shard_module_matches_plain_torch(group, wrap, units_given):
    """Also with the middle unit under activation checkpointing (its forward runs again
    inside backward) and under ``torch.compile``; with every layer a unit, with the last
    left to the root (the model itself owns what no unit owns), and with no units (the
    whole model one root unit)."""
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    if wrap == "compiled" and not hasattr(torch, "compile"):
        pytest.skip("this torch has no torch.compile")
    if wrap == "compiled" and group.size > 2:
        pytest.skip("CI's time: compiling costs each rank seconds of CPU; 1-2 ranks")
    model, units = _model(0, wrap)
    reference = copy.deepcopy(model)
    sm = tt.shard_module(model, units[:units_given], group=group, optimizer=AdamW(lr=LR))
    assert len(sm.sharding.units) == max(units_given + (units_given < 3), 1)
    _train_as_one_process(sm, reference, group)


def test_a_unit_of_several_modules_matches_plain_torch(group):
    """A unit given as a list of modules (the first two layers): each one's forward is a
    use, and the unit's forward ends with the last one's (the lifecycle's
    ``forward_done``); an evaluation forward after each step changes nothing."""
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    model, units = _model(0)
    reference = copy.deepcopy(model)
    sm = tt.shard_module(model, [[units[0], units[1]], units[2]], group=group,
                         optimizer=AdamW(lr=LR))
    assert [len(u.modules) for u in sm.sharding.units] == [2, 1]
    _train_as_one_process(sm, reference, group, evaluate=True)


def _train_as_one_process(sm, reference, group, evaluate: bool = False) -> None:
    """``sm`` trains for :data:`STEPS` steps as ``reference`` does in one process on the
    global batch (with ``evaluate``, a forward without grad after each step)."""
    losses = []
    for s in range(STEPS):
        x, y = _batch(s, group.rank, B)
        loss = torch.nn.functional.mse_loss(sm(x), y)
        loss.backward()
        sm.step()
        if evaluate:
            with torch.no_grad():
                sm(x)
        losses.append(group.comm.allreduce(float(loss.detach())) / group.size)
    want = _reference(reference, group)
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(losses, want))
                if abs(a - b) > LOSS_RTOL * abs(b)]
    if not losses[-1] < losses[(STEPS - 1) % 2]:  # (two batches in turn: the same batch's)
        failures.append(f"loss did not go down: {losses}")
    agree(group.comm, failures, "shard_module vs torch")


class _Tokens(torch.nn.Module):
    """The batch's features as token ids: four per sample, in [0, 16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x[:, :4] + 2) * 4).long().clamp(0, 15)


class _MeanRows(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=1)


def test_a_sparse_embedding_trains_as_a_dense_one(group):
    """``nn.Embedding(sparse=True)`` gives its weight a sparse ``.grad``: the unit's
    reduction takes it as the dense rows it stands for, so training matches the same
    model with a dense embedding in one process."""
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    torch.manual_seed(6)
    embedding, head = torch.nn.Embedding(16, 6, sparse=True), torch.nn.Linear(6, 3)
    model = torch.nn.Sequential(_Tokens(), embedding, _MeanRows(), torch.nn.Tanh(), head)
    reference = copy.deepcopy(model)
    reference[1].sparse = False
    sm = tt.shard_module(model, [embedding, head], group=group, optimizer=AdamW(lr=LR))
    _train_as_one_process(sm, reference, group)


def test_autocast_trains_as_one_process_and_loss_scaling_is_refused(group):
    """fp32 parameters under ``torch.autocast``'s bfloat16 (the hooks gather fp32, autocast
    casts per op): the losses of one process under the same autocast, within 1e-2 (bf16
    products, summed in another order). ``torch.amp.GradScaler``, which unscales each
    parameter's ``.grad``, raises a ``TideInvalid`` that says to train in bf16 instead."""
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    import tidearray
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    model, units = _model(0)
    reference = copy.deepcopy(model)
    sm = tt.shard_module(model, units, group=group, optimizer=AdamW(lr=LR))

    def loss_of(m, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.mse_loss(m(x).float(), y)

    def one_process():
        opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0)
        out = []
        for s in range(STEPS):
            xs, ys = zip(*[_batch(s, r, B) for r in range(group.size)])
            loss = loss_of(reference, torch.cat(xs), torch.cat(ys))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(float(loss.detach()))
        return out

    got = []
    for s in range(STEPS):
        loss = loss_of(sm, *_batch(s, group.rank, B))
        loss.backward()
        sm.step()
        got.append(group.comm.allreduce(float(loss.detach())) / group.size)
    want = on_rank_zero(group.comm, one_process)
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(got, want))
                if abs(a - b) > 1e-2 * abs(b)]
    if not got[-1] < got[0]:
        failures.append(f"loss did not go down: {got}")
    agree(group.comm, failures, "shard_module under autocast vs torch")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(sm, *_batch(0, group.rank, B))).backward()
    with pytest.raises(tidearray.TideInvalid, match="GradScaler.*bfloat16"):
        scaler.step(sm.sharding.optimizer)
    sm.zero_grad()


def test_a_compiled_forward_and_backward_runs_the_hooks_eagerly(group):
    """A function compiled whole, forward and backward, runs the hooks while Dynamo
    evaluates frames around its graph breaks ([Note: hooks and Dynamo] in
    ``tidearray/torch/_hooks.py``): it trains as one process does, and Dynamo compiles
    none of the hooks (compiled per hook, they would reach its recompile limit, which
    warns)."""
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    if not hasattr(torch, "compile"):
        pytest.skip("this torch has no torch.compile")
    if group.size > 2:
        pytest.skip("CI's time: compiling costs each rank seconds of CPU; 1-2 ranks")
    import logging

    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    model, units = _model(4)
    reference = copy.deepcopy(model)
    sm = tt.shard_module(model, units, group=group, optimizer=AdamW(lr=LR))

    @torch.compile(backend="aot_eager")
    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(sm(x), y)
        loss.backward()
        return loss.detach()

    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    losses = []
    try:
        for s in range(STEPS):
            x, y = _batch(s, group.rank, B)
            loss = forward_backward(x, y)
            sm.step()
            losses.append(group.comm.allreduce(float(loss)) / group.size)
    finally:
        dynamo_log.removeHandler(handler)
    want = _reference(reference, group)
    failures = [f"step {i}: {a!r} vs reference {b!r}" for i, (a, b) in enumerate(zip(losses, want))
                if abs(a - b) > LOSS_RTOL * abs(b)]
    failures += [f"Dynamo warned: {w[:200]}" for w in warned if "recompile" in w]
    agree(group.comm, failures, "a compiled forward and backward vs torch")


def test_bad_units_are_refused(group):
    import tidearray
    import tidearray.torch as tt

    model, units = _model(1)
    with pytest.raises(tidearray.TideInvalid, match="in units 0 and 1"):
        tt.shard_module(model, [units[0], units[0]], group=group)
    with pytest.raises(tidearray.TideInvalid, match="submodule of the model"):
        tt.shard_module(model, [torch.nn.Linear(2, 2)], group=group)
    with pytest.raises(tidearray.TideInvalid, match="owns parameters"):
        tt.shard_module(model, [units[1], units[1][0]], group=group)


def test_mixed_dtypes_need_a_param_dtype(group):
    """Parameters of two dtypes (one bf16 layer in an fp32 model): without ``param_dtype``
    a TideInvalid on every rank naming both, as FSDP2 refuses; with it, every parameter
    is gathered in that dtype and the model trains."""
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    model, units = _model(0)
    units[1].to(torch.bfloat16)
    with pytest.raises(tidearray.TideInvalid,
                       match=r"float32 \('0.weight', \.\.\.\), bfloat16 \('1.1.weight'"):
        tt.shard_module(model, units, group=group)
    seen = set()
    units[1].register_forward_pre_hook(lambda m, args: seen.add(m[1].weight.dtype))
    sm = tt.shard_module(model, units, group=group, param_dtype=torch.float32)
    x, y = _batch(0, group.rank, B)
    torch.nn.functional.mse_loss(sm(x), y).backward()
    sm.step()
    agree(group.comm, [] if seen == {torch.float32} else [f"gathered as {seen}"],
          "param_dtype=float32 over fp32 and bf16 parameters")


def test_units_out_of_order_are_refused_at_the_first_forward(group):
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    model, units = _model(2)
    sm = tt.shard_module(model, [units[1], units[0], units[2]], group=group)
    with pytest.raises(tidearray.TideInvalid, match="order their forwards begin"):
        sm(_batch(0, group.rank, B)[0])


def test_a_captured_torch_step_needs_the_cuda_backend(group):
    """``model.capture_step`` captures with ``torch.cuda.graph``: on the host
    backend it refuses, clearly, on every rank, before touching CUDA
    (tests/torch/gpu/test_torch_graph.py replays it on the cuda backend)."""
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    model, units = _model(3)
    sm = tt.shard_module(model, units, group=group)
    with pytest.raises(tidearray.TideInvalid, match="expected a model on the cuda backend"):
        sm.capture_step(lambda: None)
    sm.close()


def test_unfreezing_after_sharding_is_refused(group):
    """A parameter frozen when the model was sharded has no gradient buffer: unfrozen
    later, its gradient would be dropped and it would never train. The backward then
    raises on every rank, naming it, once the backward is over (the model usable again
    when it is frozen back); freezing during training stays allowed."""
    import tidearray
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    model, units = _model(4)
    units[2][1].weight.requires_grad_(False)
    sm = tt.shard_module(model, units, group=group, optimizer=AdamW(lr=LR))
    x, y = _batch(0, group.rank, B)
    failures = []
    units[0].weight.requires_grad_(False)  # frozen during training: fine
    torch.nn.functional.mse_loss(sm(x), y).backward()
    sm.step()
    units[2][1].weight.requires_grad_(True)
    try:
        torch.nn.functional.mse_loss(sm(x), y).backward()
        failures.append("expected TideInvalid from the backward, got none")
    except tidearray.TideInvalid as e:
        if "2.1.weight" not in str(e) or "unfreezing is not" not in str(e):
            failures.append(f"expected the parameter and the rule named, got {e}")
    units[2][1].weight.requires_grad_(False)
    sm.zero_grad()
    torch.nn.functional.mse_loss(sm(x), y).backward()
    sm.step()
    agree(group.comm, failures, "a parameter unfrozen after shard_module")
    sm.close()


def test_a_gradient_outside_its_units_backward_is_refused(group):
    """A sharded parameter used outside its unit's backward (here a tensor made from the
    last unit's weight after the forward, backpropagated alone) gets a ``.grad`` that no
    reduction takes: the step raises on every rank, naming it (a backward of the pass
    that opens the unit would take it: torch adds the two); ``zero_grad()`` drops it, as
    torch's does, and training goes on."""
    import tidearray
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    model, units = _model(5)
    sm = tt.shard_module(model, units, group=group, optimizer=AdamW(lr=LR))
    x, y = _batch(0, group.rank, B)
    failures = []
    sm(x)
    kept = units[2][1].weight * 1.0  # the last unit stays gathered after its forward
    kept.sum().backward()  # reaches no unit's output: its unit never opens
    try:
        sm.step()
        failures.append("expected TideInvalid from the step, got none")
    except tidearray.TideInvalid as e:
        if "2.1.weight" not in str(e) or "outside its unit" not in str(e):
            failures.append(f"expected the parameter and the rule named, got {e}")
    sm.zero_grad()
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(sm(x), y)
        loss.backward()
        sm.step()
        sm.zero_grad()
        losses.append(loss.item())
    if not losses[-1] < losses[0]:
        failures.append(f"expected the loss to go down after, got {losses}")
    agree(group.comm, failures, "a parameter's gradient outside its unit's backward")
    sm.close()


def test_a_weight_penalty_after_the_forward_fails_loudly(group):
    """A weight penalty over ``model.parameters()`` added to the loss after the forward (an
    L2 term) reads the released units' parameters, empty placeholders then ([Note:
    parameter storage] in ``_storage``): the backward raises on every rank (autograd's
    shape check) rather than train on what their slots hold by then; the failed pass
    leaves nothing behind: after ``zero_grad()`` the losses are a run's without it, bit
    for bit."""
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")

    def train(penalty: bool) -> tuple[list[float], list[str]]:
        model, units = _model(5)
        sm = tt.shard_module(model, units, group=group, optimizer=AdamW(lr=LR))
        losses, failures = [], []
        for step in range(5):  # (two batches in turn: the last is the first's)
            x, y = _batch(step, group.rank, B)
            if step == 1 and penalty:
                loss = torch.nn.functional.mse_loss(sm(x), y) + 1e-3 * sum(
                    p.pow(2).sum() for p in sm.parameters())
                try:
                    loss.backward()
                    failures.append("expected the penalty's backward to raise, got none")
                except RuntimeError:
                    pass
                sm.zero_grad()
            loss = torch.nn.functional.mse_loss(sm(x), y)
            loss.backward()
            sm.step()
            losses.append(loss.item())
        sm.close()
        return losses, failures

    got, failures = train(penalty=True)
    want, _ = train(penalty=False)
    if got != want:
        failures.append(f"expected the losses of a run without the failed pass, got {got} "
                        f"against {want}")
    if not want[-1] < want[0]:
        failures.append(f"expected the loss to go down, got {want}")
    agree(group.comm, failures, "a weight penalty after the forward")


def test_a_torch_optimizer_made_already_is_refused_naming_the_function(group):
    """FSDP2's order (wrap, then ``torch.optim.AdamW(model.parameters())``) given as
    ``optimizer=``: an optimizer over the parameters that sharding empties. The error
    names the torch class and the form to pass (a function of the shards); a string is
    refused too."""
    import tidearray
    import tidearray.torch as tt

    for given, match in ((lambda m: torch.optim.AdamW(m.parameters()),
                          r"got a torch\.optim\.adamw\.AdamW made already .*lambda shards"),
                         (lambda m: "adamw", "expected a tidearray.fsdp.AdamW .* got str")):
        model, units = _model(5)
        with pytest.raises(tidearray.TideInvalid, match=match):
            tt.shard_module(model, units, group=group, optimizer=given(model))


def test_param_groups_need_the_fused_adamw(group):
    """``param_groups`` configure the fused AdamW: given with a torch optimizer they would
    be ignored (a no-decay group decayed anyway), so they are refused."""
    import tidearray
    import tidearray.torch as tt

    model, units = _model(5)
    with pytest.raises(tidearray.TideInvalid, match="param_groups: expected none with a torch"):
        tt.shard_module(model, units, group=group,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        param_groups=[{"params": ["0.bias"], "weight_decay": 0.0}])


def test_an_optimizer_that_reads_across_a_parameter_is_refused_when_sharded(group):
    """torch's Adafactor factors its second moments over a parameter's rows and columns:
    over a rank's rows it would step otherwise than one process, silently. Sharded over
    more than one rank it is refused on every rank, before any step (the runtime closed);
    at one rank, where a shard is the whole parameter, it trains as one process."""
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    model, units = _model(5)
    make = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)  # noqa: E731
    if group.size == 1:
        reference, x = copy.deepcopy(model), _batch(0, 0, 4)[0]
        opt = make(list(reference.parameters()))
        reference(x).pow(2).mean().backward()
        opt.step()
        sm = tt.shard_module(model, units, group=group, optimizer=make)
        sm(x).pow(2).mean().backward()
        sm.step()
        state = sm.state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
        sm.close()
        return
    with pytest.raises(tidearray.TideInvalid, match="element by element.*got Adafactor"):
        tt.shard_module(model, units, group=group, optimizer=make)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt", ["fused", "torch"])
def test_a_learning_rate_that_differs_by_rank_is_refused(group, opt):
    """A scheduler that ran differently on one rank: its rows would be stepped by another
    lr, silently (each rank steps only its own). Every rank raises, and no parameter
    changes; the fused AdamW's ``step(lr=)`` and a torch optimizer's group lr alike."""
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    last = group.rank == group.size - 1
    model, units = _model(5)
    make = None if opt == "fused" else (lambda ps: torch.optim.SGD(ps, lr=0.2 if last else 0.1))
    sm = tt.shard_module(model, units, group=group, optimizer=make)
    masters = sm.sharding.runtime.arena.master
    before = np.array(masters).tobytes()
    x, y = _batch(0, group.rank, 4)
    torch.nn.functional.mse_loss(sm(x), y).backward()
    failures = []
    try:
        sm.step(lr=(2e-3 if last else 1e-3) if opt == "fused" else None)
        failures.append("expected TideInvalid, got none")
    except tidearray.TideInvalid as e:
        if "expected the same lr on every rank" not in str(e):
            failures.append(str(e))
    if np.array(masters).tobytes() != before:
        failures.append("a refused step changed the masters")
    agree(group.comm, failures, f"an lr differing by rank ({opt})")
    sm.close()


class _Skipping(torch.nn.Module):
    """Two units of one shape; ``skip`` leaves out the last (a data-dependent depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.units = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for u in self.units[:1] if skip else self.units:
            x = torch.tanh(u(x))
        return x


@pytest.mark.mpi(min_size=2)
def test_a_unit_skipped_on_one_rank_is_named(group):
    """Every rank must run every unit: the last rank skipping one at the first step, the
    ranks build the reduce plans of different units of one shape, and every rank raises,
    naming them, before anything is transferred (their agreement names the unit: by
    shapes alone it would pass)."""
    import tidearray
    import tidearray.torch as tt

    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")
    torch.manual_seed(6)
    model = _Skipping()
    sm = tt.shard_module(model, list(model.units), group=group)
    try:
        sm(torch.randn(4, 8), skip=group.rank == group.size - 1).square().mean().backward()
        failures = ["expected TideInvalid, got none"]
    except tidearray.TideInvalid as e:
        failures = [] if "expected the same unit on every rank" in str(e) else [str(e)]
    agree(group.comm, failures, "a unit skipped on one rank")
