"""The baseline comms (:class:`StockComm`, :class:`LocalComm`) under the library's trainer
checks (``tests/fsdp/mpi/test_train.py``): the single-process reference, bitwise agreement
with ``tide`` where sums are order-free, and the hook orders front ends produce."""

from __future__ import annotations

import pytest

import tests.fsdp.mpi.test_train as tt
from benchmarks.baselines import LocalComm, StockComm
from tests._util import agree

pytestmark = pytest.mark.mpi


def test_stock_losses_match_the_single_process_reference(group):
    tt.check_against_reference(group, StockComm)


def test_tide_and_stock_agree_bitwise_at_two_ranks(group):
    """At two ranks every fp32 sum of two terms is order-free, so the paths agree exactly."""
    if group.size != 2 or group.backend.name != "host":
        pytest.skip("bitwise agreement is promised at 2 ranks")
    a = tt._train(group, "--steps", "8")
    b = tt._train(group, "--steps", "8", comm=StockComm)
    agree(group.comm, [] if a == b else [f"tide {a} != stock {b}"], "tide vs stock")


def test_stock_autograd_order_on_two_slots_gives_the_same_losses(group, monkeypatch):
    """Two slots (prefetch 1) and the interleaved hook order: bit for bit the in-order run."""
    tt.same_losses_with_step(group, StockComm, monkeypatch, tt.autograd_order_step,
                             "autograd order")


@pytest.mark.parametrize("factory", [StockComm, LocalComm], ids=["stock", "local"])
def test_forward_only_passes_between_steps_change_nothing(group, factory, monkeypatch):
    """The losses of the run without them: bit for bit on the host."""
    tt.same_losses_with_step(group, factory, monkeypatch, tt.step_after_forward_only_passes,
                             "forward-only")


def test_floor_casts_a_unit_in_one_copy_as_it_would_per_parameter(group, monkeypatch):
    """The floor's one cast per unit (the FSDP2 baseline's chunk-cat table) gives the
    losses of a copy per parameter, bit for bit; the tiny model's units take it."""
    taken: list[bool] = []
    cast = LocalComm._cast

    def counted(self, unit, k, out, stream):
        op = cast(self, unit, k, out, stream)
        taken.append(op is not None)
        return op

    monkeypatch.setattr(LocalComm, "_cast", counted)
    one_copy = tt._train(group, "--steps", "4", comm=LocalComm)
    monkeypatch.setattr(LocalComm, "_cast", lambda self, unit, k, out, stream: None)
    per_param = tt._train(group, "--steps", "4", comm=LocalComm)
    problems = [] if one_copy == per_param else [f"one cast {one_copy} != per parameter "
                                                 f"{per_param}"]
    if not any(taken):
        problems.append("no unit took the one cast: the test compares nothing")
    agree(group.comm, problems, "floor copies")
