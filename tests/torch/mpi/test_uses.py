"""How a training loop uses the model within a step, with a unit per block (two slots for
four blocks, so a unit that waits for a later backward holds a slot another needs):

* **the model called twice before one backward** (two views of a batch through one
  encoder, a chosen and a rejected sequence scored by one model), also with the
  embedding frozen (the first block's input needs no gradient: the end of its backward
  is not seen), or the first call cut after two blocks (its third block's backward
  unseen, its first two with none), and a siamese encoder whose blocks are units: the
  backward of the second call comes first, then the first's, whose units must be
  gathered again;
* **a forward whose output is kept but never backpropagated** (a metric computed with
  grad enabled and held until the next step);
* **two backwards of one forward** (``retain_graph=True``, then a second loss): the
  gradients add up, as torch's ``.grad`` does;
* **an evaluation under** ``torch.inference_mode()`` between training steps;
* **a block's output used beyond the next block** (added to the last block's output: its
  gradient is complete only after every later block's backward), or **scaled in place**
  before the next block takes it (the node that made it is then not the one whose
  gradient the next block's backward gives first): the next block's use ends with that
  output's gradient ([Note: hooks] in ``tidearray.torch._hooks``).

Each case trains for test_lifecycle's steps with ``shard_module`` on every rank's batch and,
in one process, with torch's AdamW on the global batch; the losses agree within
test_lifecycle's bound (1e-5 relative, fp32) and go down. Fresh data every run.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from ..._util import agree, on_rank_zero
from . import test_hf
from .test_hf import _batch, _loss, _seed
from .test_lifecycle import STEPS, Block, Siamese, TinyLM, _adamw, _loss_failures, _tiny, _wrap

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mpi
device, _set_device = test_hf.device, test_hf._set_device

#: ``step(model, seed, s, ranks)``: the forward and backward of step ``s`` on the batches
#: of ``ranks`` (their mean loss), returning the loss to compare and what must stay alive
#: until the optimizer's step.
Step = Callable[[Any, int, int, list], tuple[torch.Tensor, Any]]


class Stack(TinyLM):
    """Four blocks, each a unit; its result a Hugging Face ``CausalLMOutput`` (a pytree
    container, whose loss the root's hooks see: a second backward of a retained graph
    gathers the root again by them)."""

    #: Detach the hidden states after the second block (this call's first two blocks then
    #: get no backward, and the third's input needs no gradient: a blind use).
    cut = False
    #: Add the first block's output to the last one's.
    skip = False
    #: Scale each block's output in place before the next block takes it.
    scaled_in_place = False

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

    def body(self, h: torch.Tensor) -> torch.Tensor:
        first = None
        for k, block in enumerate(self.blocks):
            h = block(h)
            if self.cut and k == 1:
                h = h.detach()
            if self.scaled_in_place:
                h.mul_(1.5)
            first = h if first is None else first
        return h + first if self.skip else h

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=super().forward(input_ids, labels).loss)


class DeepSiamese(Siamese):
    """test_lifecycle's siamese model with three blocks in its encoder, each a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(Block(), Block(), Block())


def _mean(model: Any, seed: int, s: int, ranks: list, other: bool = False) -> torch.Tensor:
    """The mean over ``ranks`` of each one's loss on its batch of step ``s`` (``other``: on
    its next step's batch)."""
    return torch.stack([_loss(model, _batch(seed, s + other, r)) for r in ranks]).mean()


def _called_twice(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    loss = _mean(model, seed, s, ranks) + 0.5 * _mean(model, seed, s, ranks, other=True)
    loss.backward()
    return loss, None


def _first_call_cut(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    model.cut = True
    first = _mean(model, seed, s, ranks)
    model.cut = False
    loss = first + 0.5 * _mean(model, seed, s, ranks, other=True)
    loss.backward()
    return loss, None


def _output_kept(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    kept = _mean(model, seed, s, ranks, other=True)  # grad enabled, never backpropagated
    loss = _mean(model, seed, s, ranks)
    loss.backward()
    return loss, kept


def _two_backwards(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    loss = _mean(model, seed, s, ranks)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    return loss, None


def _inference_first(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    with torch.inference_mode():
        evaluated = _mean(model, seed, s, ranks, other=True)
    loss = _mean(model, seed, s, ranks)
    loss.backward()
    return loss, evaluated


def _once(model: Any, seed: int, s: int, ranks: list) -> tuple[torch.Tensor, Any]:
    loss = _mean(model, seed, s, ranks)
    loss.backward()
    return loss, None


CASES = {"called twice": _called_twice, "called twice, embedding frozen": _called_twice,
         "a skip over the blocks": _once, "scaled in place": _once,
         "a skip over the blocks, called twice": _called_twice,
         "called twice, the first cut after two blocks": _first_call_cut,
         "an output kept": _output_kept, "two backwards": _two_backwards,
         "inference_mode": _inference_first}


def _one_process(model: Any, seed: int, world: int, step: Step) -> list[float]:
    opt = _adamw()([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss, kept = step(model, seed, s, list(range(world)))
        opt.step()
        losses.append(float(loss.detach()))
        del kept
    return losses


def _train(model: Any, units: list, group, seed: int, step: Step) -> list[str]:
    """Failures: ``model`` trained by ``step`` on ``seed``'s batches with ``units``, against
    one process."""
    reference = copy.deepcopy(model)
    sm = _wrap(model, units, group)
    got = []
    for s in range(STEPS):
        loss, kept = step(sm, seed, s, [group.rank])
        sm.step()
        got.append(group.comm.allreduce(float(loss.detach())) / group.size)
        del kept
    want = on_rank_zero(group.comm, lambda: _one_process(reference, seed, group.size, step))
    return _loss_failures(got, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_that_uses_the_model_so_trains_as_one_process(group, case):
    seed = _seed(group)
    model = _tiny(Stack, seed)
    if "frozen" in case:
        model.embed.requires_grad_(False)
    model.skip, model.scaled_in_place = "skip" in case, "in place" in case
    agree(group.comm, _train(model, list(model.blocks), group, seed, CASES[case]),
          f"{case} vs one process")


def test_siamese_encoder_of_unit_blocks(group):
    """The encoder runs on two inputs, both in one loss; its blocks are units."""
    seed = _seed(group)
    model = _tiny(DeepSiamese, seed)

    agree(group.comm, _train(model, list(model.encoder), group, seed, _once),
          "siamese of unit blocks vs one process")
