"""State dicts of ``tidearray.torch.ShardedModule`` (``tidearray.torch._state``), multi-rank.

A tiny Hugging Face Llama (head tied to the embedding, and not), each decoder layer a
unit and the rest the root, on the host backend (CPU tensors):

* a full state dict taken after training loads strictly into a plain
  ``LlamaForCausalLM`` and gives the sharded model's loss;
* the full state dict of a fresh wrap is the model's own ``state_dict()``, bitwise;
* a sharded state dict, loaded into a fresh wrap, continues training bit for bit
  (losses and masters), with the fused AdamW and with a torch optimizer;
* bad loads, on one rank only, raise the same ``TideInvalid`` on every rank and change
  nothing; the module's own ``state_dict()`` is refused.

Data are fresh each run: drawn from the run's seed (``_util.fresh_seed``: one on every rank,
printed; ``TIDE_TEST_SEED`` pins it), mixed with the test's name.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ..._util import agree, compare_bits, fresh_seed

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD.Get_size()
BAD = WORLD - 1
VOCAB, B, T, LR = 64, 2, 8, 1e-2
LOSS_RTOL = 1e-6


@pytest.fixture
def seed(comm, request) -> int:
    """The run's fresh seed (``_util.fresh_seed``) mixed with the test's name."""
    return (fresh_seed(comm, bits=32) ^ zlib.crc32(request.node.name.encode())) & 0xFFFFFFFF


@pytest.fixture(autouse=True)
def _host_only(group) -> None:
    if group.backend.name != "host":
        pytest.skip("CPU tensors: the host backend")


def _config(tie: bool):
    return transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=64, tie_word_embeddings=tie,
        attn_implementation="eager")


def _llama(tie: bool, seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(tie))


def _wrap(model, group, optimizer: str = "fused"):
    import tidearray.torch as tt
    from tidearray.fsdp import AdamW

    opt = AdamW(lr=LR) if optimizer == "fused" else (
        lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(0.9, 0.95), weight_decay=0.01))
    return tt.shard_module(model, list(model.model.layers), group=group, optimizer=opt)


def _batch(seed: int, step: int, rank: int):
    rng = np.random.default_rng([seed, step, rank])
    return torch.from_numpy(rng.integers(0, VOCAB, (B, T)))


def _train(sm, seed: int, steps: range, rank: int) -> list[float]:
    """This rank's losses over ``steps`` (each rank its own batches)."""
    losses = []
    for s in steps:
        ids = _batch(seed, s, rank)
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward()
        sm.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("tie", [True, False])
def test_full_state_dict_loads_into_a_plain_model(group, seed, tie, rank0_only):
    sm = _wrap(_llama(tie, seed), group)
    _train(sm, seed, range(3), group.rank)
    state = sm.state_dict(rank0_only=rank0_only)
    ids = _batch(seed, 99, 0)  # the same batch on every rank
    with torch.no_grad():
        got = float(sm(input_ids=ids, labels=ids).loss)
    failures = []
    if rank0_only and group.rank != 0:
        if state != {}:
            failures.append(f"rank0_only: expected {{}} off rank 0, got {len(state)} keys")
    else:
        plain = _llama(tie, seed + 1)
        if list(state) != list(plain.state_dict()):
            failures.append(f"keys: {list(state)} vs {list(plain.state_dict())}")
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            want = float(plain(input_ids=ids, labels=ids).loss)
        if abs(got - want) > LOSS_RTOL * abs(want):
            failures.append(f"loss {got!r} sharded vs {want!r} plain (seed {seed})")
    agree(group.comm, failures, "full state dict into a plain model")
    sm.close()


@pytest.mark.parametrize("tie", [True, False])
def test_full_state_dict_of_a_fresh_wrap_is_the_models(group, seed, tie):
    model = _llama(tie, seed)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sm = _wrap(model, group)
    got = sm.state_dict()
    failures = [] if list(got) == list(want) else [f"keys: {list(got)} vs {list(want)}"]
    for key in want:
        if key in got:
            failures += compare_bits(got[key].numpy(), want[key].numpy(), key)
    if tie and got["lm_head.weight"] is not got["model.embed_tokens.weight"]:
        failures.append("a tied weight: expected one tensor under both names, got two")
    agree(group.comm, failures, f"fresh full state dict (seed {seed})")
    sm.close()


@pytest.mark.parametrize("optimizer", ["fused", "torch"])
@pytest.mark.parametrize("tie", [True, False])
def test_sharded_state_dict_resumes_bit_for_bit(group, seed, tie, optimizer):
    from tidearray.torch._state import SHARDING_KEY

    sm = _wrap(_llama(tie, seed), group, optimizer)
    _train(sm, seed, range(3), group.rank)
    state = sm.state_dict(full=False)
    want_losses = _train(sm, seed, range(3, 6), group.rank)
    want_master = sm.sharding.runtime.arena.master.copy()
    sm.close()
    sm2 = _wrap(_llama(tie, seed + 1), group, optimizer)  # other values: the load sets all
    sm2.load_state_dict(state)
    losses = _train(sm2, seed, range(3, 6), group.rank)
    failures = [] if losses == want_losses else [f"losses {losses} vs {want_losses}"]
    failures += compare_bits(sm2.sharding.runtime.arena.master, want_master, "masters")
    meta = state[SHARDING_KEY]
    if (meta["world"], meta["rank"]) != (group.size, group.rank):
        failures.append(f"sharding entry: world {meta['world']}, rank {meta['rank']}")
    agree(group.comm, failures, f"sharded resume, {optimizer} (seed {seed})")
    sm2.close()


def test_a_submodules_state_dict_is_refused(group, seed):
    """A submodule's parameters are placeholders: its own ``state_dict()`` raises; the
    sharded model's gathers, also as a child of another module (``nn.Module``'s
    ``destination`` and ``prefix``)."""
    import tidearray

    plain = _llama(True, seed)
    sm = _wrap(_llama(True, seed), group)
    layer = sm.model.layers[0]
    with pytest.raises(tidearray.TideInvalid, match=r"sharded model's own state_dict"):
        layer.state_dict()
    own = sm.state_dict()  # the sharded model's: under every name
    assert own.keys() == plain.state_dict().keys() and "lm_head.weight" in own
    outer = torch.nn.ModuleDict({"lm": sm}).state_dict()
    assert outer.keys() == {f"lm.{k}" for k in own}
    failures = [k for k in own if not torch.equal(outer[f"lm.{k}"], own[k])]
    with pytest.raises(tidearray.TideInvalid, match=r"sharded model's own state_dict"):
        layer.state_dict()  # still refused after the model's own
    agree(group.comm, failures, "a parent's state dict of the sharded model")
    sm.close()


def _full(state: dict, _: int) -> dict:
    return state


def _missing(state: dict, _: int) -> dict:
    del state["model.norm.weight"]
    return state


def _unexpected(state: dict, _: int) -> dict:
    state["model.extra.weight"] = torch.zeros(1)
    return state


def _wrong_shape(state: dict, _: int) -> dict:
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    return state


def _world(state: dict, world: int) -> dict:
    state["_tidearray"]["world"] = world + 1
    return state


BAD_LOADS = {
    "missing": (True, _missing, r"1 missing: 'model\.norm\.weight'"),
    "unexpected": (True, _unexpected, r"1 unexpected: 'model\.extra\.weight'"),
    "shape": (True, _wrong_shape, r"parameter 'model\.layers\.0\.mlp\.up_proj\.weight': "
                                  r"expected shape \(64, 32\), got \(3, 3\)"),
    "world": (False, _world, fr"expected world size {WORLD}, got {WORLD + 1}"),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_a_bad_load_on_one_rank_raises_on_every_rank(group, seed, case):
    import tidearray

    full, edit, message = BAD_LOADS[case]
    sm = _wrap(_llama(False, seed), group)
    _train(sm, seed, range(1), group.rank)
    good = sm.state_dict(full=full)
    state = sm.state_dict(full=full)
    if group.rank == BAD:
        state = edit(state, group.size)
    sm2 = _wrap(_llama(False, seed + 1), group)
    before = sm2.sharding.runtime.arena.master.copy()
    with pytest.raises(tidearray.TideInvalid, match=fr"rank {BAD}: .*{message}") as e:
        sm2.load_state_dict(state)
    failures = compare_bits(sm2.sharding.runtime.arena.master, before,
                            "masters after a refused load")
    messages = group.comm.allgather(str(e.value))
    if len(set(messages)) != 1:
        failures.append(f"ranks raised different messages: {messages}")
    sm2.load_state_dict(good)  # and a good load still works
    failures += compare_bits(sm2.sharding.runtime.arena.master,
                             sm.sharding.runtime.arena.master, "masters loaded")
    agree(group.comm, failures, case)
    sm.close()
    sm2.close()


def test_non_strict_load_returns_what_it_skipped(group, seed):
    sm = _wrap(_llama(False, seed), group)
    want = sm.sharding.runtime.arena.master.copy()
    state = _unexpected(_missing(sm.state_dict(), 0), 0)
    skipped = sm.load_state_dict(state, strict=False)
    failures = compare_bits(sm.sharding.runtime.arena.master, want, "masters")
    if (skipped.missing_keys, skipped.unexpected_keys) != (["model.norm.weight"],
                                                          ["model.extra.weight"]):
        failures.append(f"skipped: {skipped}")
    agree(group.comm, failures, "strict=False")
    sm.close()


def test_a_rank0_only_state_dict_is_refused_off_rank_0(group, seed):
    import tidearray

    if group.size == 1:
        pytest.skip("needs ranks other than 0")
    sm = _wrap(_llama(True, seed), group)
    state = sm.state_dict(rank0_only=True)
    with pytest.raises(tidearray.TideInvalid, match="rank0_only state dict"):
        sm.load_state_dict(state)
    sm.close()


def test_buffers_round_trip(group, seed):
    """BatchNorm's running statistics (persistent buffers) go into the state dicts and
    come back, full (into a plain module too) and sharded."""
    import tidearray.torch as tt

    def net(s: int):
        torch.manual_seed(s)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 2))

    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((6, 4), np.float32))
    model = net(seed)
    sm = tt.shard_module(model, [model[0], model[2]], group=group)
    with torch.no_grad():
        sm(x)  # train mode: updates the running statistics
    full, sharded = sm.state_dict(), sm.state_dict(full=False)
    bn = model[1]
    failures = []
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        for kind, state in (("full", full), ("sharded", sharded)):
            failures += compare_bits(state[f"1.{name}"].numpy(), getattr(bn, name).numpy(),
                                     f"{kind} 1.{name}")
    plain = net(seed + 1)
    plain.load_state_dict(full, strict=True)
    sm2_model = net(seed + 2)
    sm2 = tt.shard_module(sm2_model, [sm2_model[0], sm2_model[2]], group=group)
    sm2.load_state_dict(sharded)
    sm.eval(), plain.eval(), sm2.eval()
    with torch.no_grad():
        want = plain(x).numpy()
        for label, m in (("sharded module", sm), ("sharded state loaded", sm2)):
            failures += compare_bits(m(x).numpy(), want, label)
    agree(group.comm, failures, f"buffers (seed {seed})")
    sm.close()
    sm2.close()
