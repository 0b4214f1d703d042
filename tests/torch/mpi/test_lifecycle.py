"""A unit's lifecycle as autograd runs it, under ``tidearray.torch.shard_module``, multi-rank.

What fine-tuning and weight-sharing models do to a unit (docs/torch.md, "The same"),
each case against plain torch:

* **Partly frozen units** (LoRA through ``peft``, frozen norms, only ``q_proj``
  trained, a unit with nothing trained): autograd still needs the frozen weights
  to pass the gradient on to the unit's input after the trainable gradients
  have arrived, so the unit must stay gathered until its backward is done.
* **A unit run k times in one forward** (ALBERT's shared layer group, a block in
  a Python loop with k changing between steps, a siamese encoder, a reused block
  inside a reused block): gathered at its first use, kept until the backward of
  its last, reduced once; its second call is not a new pass.
* **Torch's optimizer semantics**: a parameter that no rank gave a gradient in a
  step is skipped (no moment update, no weight decay, its own step count not
  advanced), as ``torch.optim.AdamW`` skips a ``.grad`` of None; one that some
  rank gave a gradient steps with the mean over ranks. Frozen parameters stay
  bitwise unchanged, under the fused AdamW and under a torch optimizer.

Each case trains for 7 steps (13 for MoE) on every rank's batch with ``shard_module``
and, in one process on the global batch (the mean of each rank's mean loss), with a
torch optimizer over the trainable parameters. The reference is plain torch: a
gradient autograd left as None is not counted as zeros, so the optimizer skips it.
The losses agree within 1e-5 relative (2e-6 for MoE over 13 steps) in fp32 and go down; frozen and
skipped parameters are bitwise unchanged in the full state dict. Fresh data every run.
The models are tiny (hidden 32, vocabulary 64, 12 tokens per rank). Skipped without
torch and transformers; the LoRA case without peft.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest

from ..._util import agree, on_rank_zero
from . import test_hf
from .test_hf import LR, VOCAB, PerExpertMoE, _batch, _llama, _loss, _on_device, _per_expert, _seed

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi
#: test_hf's autouse fixtures (the device the models live on: the group's GPU on cuda).
device, _set_device = test_hf.device, test_hf._set_device
STEPS, MOE_STEPS = 7, 13  # the last step on step 0's batch (three in turn)
#: The MoE cases' bound over 13 steps: fp32 gradients summed over ranks in another order
#: than the reference's batch put the losses up to 2.5e-6 apart (seen once at 3 ranks, in
#: CI; 1.1e-6 once before); stepping the experts no rank routed to (the old semantics) put
#: them 2e-6 to 2e-2 apart in these tests, and moves expert 0's weights (weight decay),
#: which the test checks bitwise.
LOSS_RTOL, MOE_LOSS_RTOL = 1e-5, 5e-6
HIDDEN = 32
#: The LoRA adapters after training against the reference's (fp32, 7 steps), and the
#: merged model's logits: bounded by the steps' size, not by fp32's resolution. The ranks'
#: gradients summed, then scaled by 1/W, round otherwise than the reference's one batch;
#: AdamW (eps 1e-6) turns those roundings, on elements whose gradient nearly cancels, into
#: steps of about 1e-3 x lr: up to 8.9e-6 apart (3 of 140 seeds at 3 ranks beyond the
#: former atol 1e-6; none at 2 or 4). A gradient lost or scaled wrongly moves an adapter
#: by about lr (3e-3) a step.
ADAPTER_RTOL, ADAPTER_ATOL = 1e-5, 1e-2 * LR
LOGIT_RTOL, LOGIT_ATOL = 1e-4, 1e-5

MakeOpt = Callable[[list], Any]
#: ``setup(model, step, rank)``: runs before ``rank``'s forward of ``step``.
Setup = Callable[[Any, int, int], None]


def _adamw(weight_decay: float = 0.0, eps: float = 1e-8) -> MakeOpt:
    return lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(0.9, 0.95), eps=eps,
                                        weight_decay=weight_decay)


def _reference(model: Any, seed: int, group, **kw: Any) -> list[float]:
    """The losses of :func:`_one_process` (collective), trained on rank 0 alone (the
    other ranks' copies of ``model`` stay untrained)."""
    return on_rank_zero(group.comm, lambda: _one_process(model, seed, group.size, **kw))


def _one_process(model: Any, seed: int, world: int, steps: int = STEPS,
                 make_opt: Optional[MakeOpt] = None, setup: Optional[Setup] = None
                 ) -> list[float]:
    """One process, the global batch, a torch optimizer over the trainable parameters:
    test_hf's reference, with a number of steps and a ``setup`` per step and rank. No
    gradient is filled in: what autograd left as None the optimizer skips."""
    opt = (make_opt or _adamw())([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(steps):
        parts = []
        for r in range(world):
            if setup is not None:
                setup(model, s, r)
            parts.append(_loss(model, _batch(seed, s, r)))
        loss = torch.stack(parts).mean()  # the mean over ranks of each rank's mean loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _sharded(sm: Any, model: Any, group, seed: int, steps: int = STEPS,
             setup: Optional[Setup] = None) -> list[float]:
    """``steps`` steps of ``sm`` (wrapping ``model``) on this rank's batch; the mean loss."""
    losses = []
    for s in range(steps):
        if setup is not None:
            setup(model, s, group.rank)
        loss = _loss(sm, _batch(seed, s, group.rank))
        loss.backward()
        sm.step()
        losses.append(group.comm.allreduce(float(loss.detach())) / group.size)
    return losses


def _wrap(model: Any, units: list, group, optimizer: Any = None) -> Any:
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    return tt.shard_module(model, units, group=group,
                           optimizer=optimizer if optimizer is not None else AdamW(lr=LR))


def _loss_failures(got: list[float], want: list[float], rtol: float = LOSS_RTOL) -> list[str]:
    failures = [f"step {i}: {a!r} vs reference {b!r} (relative {abs(a - b) / abs(b):.1e}, "
                f"expected <= {rtol:.0e})"
                for i, (a, b) in enumerate(zip(got, want)) if not abs(a - b) <= rtol * abs(b)]
    if not got[-1] < got[0]:
        failures.append(f"expected the loss to go down, got {got}")
    return failures


def _frozen(model: Any) -> dict:
    """The values of ``model``'s parameters that nothing trains (before wrapping it)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()
            if not p.requires_grad}


def _full(sm: Any, group) -> Optional[dict]:
    """The full state dict (collective), or None on a rank that got none (as test_hf's
    frozen test reads it: rank 0 always checks)."""
    full = sm.state_dict()
    return full if group.rank == 0 or full else None


def _changed(full: Optional[dict], want: dict, what: str) -> list[str]:
    """Failures: the tensors of ``want`` that the full state dict ``full`` does not hold
    bitwise (none where ``full`` is None)."""
    out = []
    if full is None:
        return out
    for name, value in want.items():
        if name not in full:
            out.append(f"{what} {name}: missing from the full state dict")
        elif not torch.equal(full[name], value):
            diff = float((full[name].float() - value.float()).abs().max())
            out.append(f"{what} {name}: expected bitwise unchanged, max |change| {diff:.2e}")
    return out


# -- models ----------------------------------------------------------------------------


class Block(torch.nn.Module):
    """LayerNorm, Linear, GELU, Linear, with a residual: a block that may run k times."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 48)
        self.down = torch.nn.Linear(48, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class TinyLM(torch.nn.Module):
    """Embedding, ``body``, final norm and head, called as a Hugging Face causal LM is
    (``input_ids``, ``labels``; the result's ``.loss``: next-token cross entropy)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lm_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=self.lm_loss(self.body(self.embed(input_ids)), labels))


class Looped(TinyLM):
    """``first``, then ``loop`` called ``repeats`` times in a Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.loop = Block()
        self.repeats = 1

    def body(self, h: torch.Tensor) -> torch.Tensor:
        h = self.first(h)
        for _ in range(self.repeats):
            h = self.loop(h)
        return h


class Siamese(TinyLM):
    """One encoder on two inputs (the tokens, and each token + 1): next-token loss on the
    first encoding plus 1 - the cosine similarity of the two, per token."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(Block(), Block())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        a = self.encoder(self.embed(input_ids))
        b = self.encoder(self.embed((input_ids + 1) % VOCAB))
        similarity = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()
        return SimpleNamespace(loss=self.lm_loss(a, labels) + 0.5 * (1 - similarity))


class Outer(torch.nn.Module):
    """``inner`` twice, then a residual ``mix`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.inner(h))
        return h + torch.tanh(self.mix(h))


class Nested(TinyLM):
    """``outer`` twice: ``outer.inner`` runs four times, two in each run of ``outer``."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.outer(self.outer(h))


def _tiny(cls: type, seed: int) -> Any:
    torch.manual_seed(seed)
    return _on_device(cls())


class _Router(torch.nn.Linear):
    """A router whose ``disabled`` experts get -1e9 added to their logits: no token
    picks them, so they run no forward and get no gradient. A ``favored`` expert gets
    2e3 added for the first token, which then picks it. The other tokens take the
    enabled experts in turn, by row (1e3 added to one): chosen by the logits, a top-1 choice
    flips where two are within fp32 noise, which the sharded run and the reference sum
    differently (a top-2 gap of 3e-8 at seed 159780757 moved the loss by 1.5e-3). The
    gate is then exactly 1 and the router's gradient exactly 0: these tests are about
    the experts."""

    ROUTE_MARGIN = 1e3  # logits are O(1): e**-1e3 is 0 in fp32
    disabled: frozenset = frozenset()
    favored: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if not self.disabled and self.favored is None:
            return logits
        mask = torch.zeros_like(logits)
        enabled = [e for e in range(logits.shape[-1]) if e not in self.disabled]
        rows = torch.arange(logits.shape[0], device=logits.device)
        chosen = torch.tensor(enabled, device=logits.device)[rows % len(enabled)]
        mask[rows, chosen] = self.ROUTE_MARGIN
        mask[..., sorted(self.disabled)] = -1e9
        if self.favored is not None:
            mask[0, self.favored] = 2 * self.ROUTE_MARGIN  # over row 0's turn
        return logits + mask


class _Expert(torch.nn.Sequential):
    """An expert counting its forwards (it runs in a forward where a token picked it)."""

    ran = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran += 1
        return super().forward(x)


def _masked_moe(seed: int) -> Any:
    """test_hf's per-expert MoE Llama (8 experts, top-1), with experts that can be disabled
    (:func:`_disable`) and count their forwards."""
    model = _per_expert(seed)
    for layer in model.model.layers:
        assert isinstance(layer.mlp, PerExpertMoE)
        layer.mlp.router.__class__ = _Router
        for expert in layer.mlp.experts:
            expert.__class__ = _Expert
    return model


def _disable(model: Any, experts: set, favored: Optional[int] = None) -> None:
    for layer in model.model.layers:
        layer.mlp.router.disabled = frozenset(experts)
        layer.mlp.router.favored = favored


def _ran(model: Any) -> list[int]:
    """Forwards each expert ran, over both layers."""
    return [sum(layer.mlp.experts[e].ran for layer in model.model.layers) for e in range(8)]


# -- partly frozen units ---------------------------------------------------------------


def test_lora_through_peft(group):
    """LoRA adapters on ``q_proj`` and ``v_proj`` (peft), every base weight frozen; units:
    the decoder layers. The adapters end as the reference's; the base stays bitwise.
    peft's merge refuses the sharded model; merged in a plain PeftModel from the full
    state dict, it gives the reference's logits."""
    peft = pytest.importorskip("peft")
    import tidearray

    seed = _seed(group)
    base = _llama(seed, tied=False)
    torch.manual_seed(seed + 1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    reference = copy.deepcopy(model)
    frozen = _frozen(model)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    # eps 1e-6 on both sides: lora_B starts at zero, so lora_A's first gradients are
    # lr-small and many elements lie near zero, where eps 1e-8 makes AdamW's update
    # lr x sign(g); fp32 sums over ranks in another order than the reference's batch
    # then flipped whole lr-sized updates (seen once at 3 ranks: 2.2e-4).
    from tidearray.fsdp import AdamW

    sm = _wrap(model, list(model.base_model.model.model.layers), group,
               optimizer=AdamW(lr=LR, eps=1e-6))
    got = _sharded(sm, model, group, seed)
    failures = _loss_failures(got, _reference(reference, seed, group,
                                              make_opt=_adamw(eps=1e-6)))
    full = _full(sm, group)
    failures += _changed(full, frozen, "frozen base weight")
    want = dict(reference.named_parameters())  # trained on rank 0 (_reference)
    for name in adapters if group.rank == 0 else ():
        a, b = full[name], want[name].detach().cpu()
        if not torch.allclose(a, b, rtol=ADAPTER_RTOL, atol=ADAPTER_ATOL):
            failures.append(f"adapter {name}: expected the reference's within rtol "
                            f"{ADAPTER_RTOL:.0e}, atol {ADAPTER_ATOL:.0e}, got max |diff| "
                            f"{float((a - b).abs().max()):.2e}")
    with pytest.raises(tidearray.TideInvalid, match=r"merge_and_unload\(\): expected a plain"):
        sm.merge_and_unload()  # it would merge into the placeholders and return no weights
    # What the refusal says to do instead: the full state dict into a plain PeftModel.
    if group.rank == 0:
        plain = peft.get_peft_model(_llama(seed + 7, tied=False), config)
        plain.load_state_dict(full, strict=True)
        merged, ids = plain.merge_and_unload(), _batch(seed, 99, 0).to(test_hf.DEVICE[0])
        with torch.no_grad():
            a, b = (m(input_ids=ids).logits.cpu() for m in (merged, reference))
        if not torch.allclose(a, b, rtol=LOGIT_RTOL, atol=LOGIT_ATOL):
            failures.append(f"merged plain model: expected the reference's logits, got max "
                            f"|diff| {float((a - b).abs().max()):.2e}")
    agree(group.comm, failures, f"LoRA vs one process (seed {seed})")


#: Which of a Llama's parameters are frozen (by name), and its number of layers.
FROZEN = {
    "input-norms": (2, lambda n: n.endswith("input_layernorm.weight")),
    "only-q-proj-trained": (2, lambda n: not n.endswith("q_proj.weight")),
    "middle-unit-frozen": (3, lambda n: n.startswith("model.layers.1.")),
}


@pytest.mark.parametrize("name", list(FROZEN))
def test_partly_frozen_llama(group, name):
    layers, freeze = FROZEN[name]
    seed = _seed(group)
    model = _llama(seed, tied=False, layers=layers)
    for n, p in model.named_parameters():
        if freeze(n):
            p.requires_grad_(False)
    reference = copy.deepcopy(model)
    frozen = _frozen(model)
    assert frozen and len(frozen) < len(list(model.parameters()))
    sm = _wrap(model, list(model.model.layers), group)
    got = _sharded(sm, model, group, seed)
    failures = _loss_failures(got, _reference(reference, seed, group))
    failures += _changed(_full(sm, group), frozen, "frozen")
    agree(group.comm, failures, f"{name} vs one process")


def test_torch_optimizer_skips_frozen_and_unused(group):
    """A torch AdamW (weight decay 0.1) over the shards: frozen parameters, and one that
    no rank ever gives a gradient (registered, never called), stay bitwise unchanged, as
    torch leaves them."""
    seed = _seed(group)
    model = _llama(seed, tied=True)
    model.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    for layer in model.model.layers:
        layer.post_attention_layernorm.weight.requires_grad_(False)
    model.model.layers[1].unused = _on_device(torch.nn.Linear(HIDDEN, HIDDEN))
    reference = copy.deepcopy(model)
    frozen = _frozen(model)
    unused = {n: p.detach().cpu().clone() for n, p in model.named_parameters()
              if ".unused." in n}

    def make(ps: list) -> Any:
        return torch.optim.AdamW(ps, lr=LR, weight_decay=0.1)

    sm = _wrap(model, list(model.model.layers), group, optimizer=make)
    got = _sharded(sm, model, group, seed)
    failures = _loss_failures(got, _reference(reference, seed, group, make_opt=make))
    full = _full(sm, group)
    failures += _changed(full, frozen, "frozen")
    failures += _changed(full, unused, "never given a gradient (torch skips it)")
    agree(group.comm, failures, "torch AdamW on the shards")


# -- a unit run several times in one forward -------------------------------------------


def test_albert_shared_layer_group(group):
    """ALBERT: one layer group, its weights shared by 3 layers, runs 3 times per forward;
    the group is the unit (the root: embeddings, projection, MLM head)."""
    seed = _seed(group)
    torch.manual_seed(seed)
    cfg = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=HIDDEN, num_attention_heads=2,
        intermediate_size=48, num_hidden_layers=3, num_hidden_groups=1,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0, attn_implementation="eager")
    model = _on_device(transformers.AlbertForMaskedLM(cfg))
    reference = copy.deepcopy(model)
    shared = model.albert.encoder.albert_layer_groups[0]
    runs = []
    shared.register_forward_hook(lambda *_: runs.append(1))
    got = _sharded(_wrap(model, [shared], group), model, group, seed)
    failures = _loss_failures(got, _reference(reference, seed, group))
    if len(runs) != 3 * STEPS:
        failures.append(f"expected the shared group to run {3 * STEPS} times, got {len(runs)}")
    agree(group.comm, failures, "ALBERT vs one process")


def test_block_called_in_a_python_loop(group):
    """``loop`` runs k = 1, 2, 3, 1, ... times in a forward (the same k on every rank)."""
    seed = _seed(group)
    model = _tiny(Looped, seed)
    reference = copy.deepcopy(model)

    def setup(m: Any, s: int, r: int) -> None:
        m.repeats = 1 + s % 3

    sm = _wrap(model, [model.first, model.loop], group)
    got = _sharded(sm, model, group, seed, setup=setup)
    agree(group.comm, _loss_failures(got, _reference(reference, seed, group, setup=setup)),
          "looped block vs one process")


def test_siamese_encoder(group):
    """One encoder unit on two inputs, both encodings in one loss; the root: the rest."""
    seed = _seed(group)
    model = _tiny(Siamese, seed)
    reference = copy.deepcopy(model)
    got = _sharded(_wrap(model, [model.encoder], group), model, group, seed)
    agree(group.comm, _loss_failures(got, _reference(reference, seed, group)),
          "siamese vs one process")


def test_reused_block_inside_a_reused_block(group):
    """``outer`` runs twice, ``outer.inner`` twice in each: both units (outer first, as
    their forwards begin)."""
    seed = _seed(group)
    model = _tiny(Nested, seed)
    reference = copy.deepcopy(model)
    got = _sharded(_wrap(model, [model.outer, model.outer.inner], group), model, group, seed)
    agree(group.comm, _loss_failures(got, _reference(reference, seed, group)),
          "nested reuse vs one process")


class _Middle(Block):
    """A block with a block inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.deepest = Block()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.deepest(super().forward(h))


class _ThreeDeep(TinyLM):
    """``outer`` holds ``inner`` holds ``deepest``, each a unit: all three run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()
        self.outer.inner = _Middle()

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.outer(h)


def test_units_in_use_at_once_need_slots_of_their_own(group):
    """Three nested units share two slots: a TideInvalid on every rank names the unit and
    ``num_slots``; with ``num_slots=4`` the same model trains as one process."""
    import tidearray
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    def units(m: Any) -> list:
        return [m.outer, m.outer.inner, m.outer.inner.deepest]

    seed = _seed(group)
    model = _tiny(_ThreeDeep, seed)
    reference, short = copy.deepcopy(model), copy.deepcopy(model)
    sm = tt.shard_module(short, units(short), group=group, optimizer=AdamW(lr=LR))
    with pytest.raises(tidearray.TideInvalid, match=r"unit 3 \(outer\.inner\.deepest.*num_slots="):
        _loss(sm, _batch(seed, 0, group.rank))
    sm.close()
    sm = tt.shard_module(model, units(model), group=group, optimizer=AdamW(lr=LR), num_slots=4)
    got = _sharded(sm, model, group, seed)
    agree(group.comm, _loss_failures(got, _reference(reference, seed, group)),
          "three nested units with a slot each vs one process")


# -- torch's optimizer semantics: experts no rank routed to ----------------------------

HALF = MOE_STEPS // 2


def _schedule(s: int) -> tuple[set, int]:
    """Disabled experts at step ``s`` on every rank: 0 always; 1 in the first half (its own
    step count starts at the second); 2 in the second half (its moments stop). With the
    expert that must run then: 2 in the first half, 1 in the second."""
    return ({0, 1}, 2) if s < HALF else ({0, 2}, 1)


def test_experts_idle_on_every_rank_are_skipped(group):
    """AdamW with weight decay 0.1, 13 steps: an expert no rank routed to in a step is
    skipped as torch skips it. Expert 0 never runs, so its weights stay bitwise."""
    from tidearray.fsdp import AdamW

    seed = _seed(group)
    model = _masked_moe(seed)
    reference = copy.deepcopy(model)
    never = {n: p.detach().cpu().clone() for n, p in model.named_parameters()
             if ".experts.0." in n}
    at_half: list = []

    def setup(m: Any, s: int, r: int) -> None:
        if m is model and s == HALF:
            at_half.append(_ran(m))
        _disable(m, *_schedule(s))

    sm = _wrap(model, list(model.model.layers), group, optimizer=AdamW(lr=LR, weight_decay=0.1))
    got = _sharded(sm, model, group, seed, steps=MOE_STEPS, setup=setup)
    want = _reference(reference, seed, group, steps=MOE_STEPS, make_opt=_adamw(0.1),
                      setup=setup)
    failures = _loss_failures(got, want, MOE_LOSS_RTOL)
    failures += _changed(_full(sm, group), never, "expert 0 (never routed to)")
    first = _sum_over_ranks(group, at_half[0])
    total = _sum_over_ranks(group, _ran(model))
    second = [t - f for t, f in zip(total, first)]
    # The case must have happened: idle on every rank where disabled, run where enabled.
    if not (total[0] == 0 and first[1] == 0 and second[2] == 0 and second[1] > 0
            and first[2] > 0):
        failures.append(f"seed {seed}: expected expert 0 idle, 1 idle then run, 2 run then "
                        f"idle (over all ranks), got forwards {first} in the first half, "
                        f"{second} after")
    agree(group.comm, failures, "experts idle on every rank")


def _sum_over_ranks(group, counts: list[int]) -> list[int]:
    return [sum(c) for c in zip(*group.comm.allgather(counts))]


def test_expert_idle_on_some_ranks(group):
    """Expert 3 is disabled on rank 0 only: it steps with the mean over ranks, zeros for
    rank 0's share (at one rank it is idle everywhere, and skipped)."""
    from tidearray.fsdp import AdamW

    seed = _seed(group)
    model = _masked_moe(seed)
    reference = copy.deepcopy(model)

    def setup(m: Any, s: int, r: int) -> None:  # the other ranks' first token picks it
        _disable(m, {3} if r == 0 else set(), favored=None if r == 0 else 3)

    sm = _wrap(model, list(model.model.layers), group, optimizer=AdamW(lr=LR, weight_decay=0.1))
    got = _sharded(sm, model, group, seed, steps=MOE_STEPS, setup=setup)
    want = _reference(reference, seed, group, steps=MOE_STEPS, make_opt=_adamw(0.1),
                      setup=setup)
    failures = _loss_failures(got, want, MOE_LOSS_RTOL)
    ran = group.comm.allgather(_ran(model)[3])
    if ran[0] != 0 or (group.size > 1 and sum(ran) == 0):
        failures.append(f"expected expert 3 idle on rank 0 and run on another, got forwards "
                        f"{ran} per rank")
    agree(group.comm, failures, "expert idle on some ranks")


def test_resumed_state_keeps_each_parameters_step_count(group):
    """After steps with expert 1 idle on every rank, a sharded state dict loaded into a
    fresh wrapper of a fresh model carries each parameter's own step count: the two
    continue with the same losses, bitwise, and the same counts."""
    import numpy as np

    from tidearray.fsdp import AdamW

    seed = _seed(group)
    model = _masked_moe(seed)
    twin = copy.deepcopy(model)
    sm = _wrap(model, list(model.model.layers), group, optimizer=AdamW(lr=LR, weight_decay=0.1))
    _disable(model, {1})
    _sharded(sm, model, group, seed, steps=3)
    state = sm.state_dict(full=False)
    resumed = _wrap(twin, list(twin.model.layers), group,
                    optimizer=AdamW(lr=LR, weight_decay=0.1))
    resumed.load_state_dict(state)
    counts = [m.sharding.runtime.optimizer.param_steps for m in (sm, resumed)]
    _disable(model, set())
    _disable(twin, set())
    a = _sharded(sm, model, group, seed + 1, steps=2)
    b = _sharded(resumed, twin, group, seed + 1, steps=2)
    failures = [] if a == b else [f"losses after resuming: {b} against {a}"]
    if not np.array_equal(*counts) or counts[0].min() == counts[0].max():
        failures.append(f"expected the same, unequal step counts, got {counts}")
    agree(group.comm, failures, "resume keeps per-parameter step counts")
