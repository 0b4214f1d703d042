"""Failing together: one rank's failure is an error on every rank, never a hang."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from tidearray._errors import TideBackendError, TideInvalid, agree, fail_together

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("culprit", [0, -1])
def test_one_rank_failing_raises_on_every_rank(comm, culprit):
    culprit %= comm.size
    with pytest.raises(TideBackendError) as info:
        with fail_together(comm, "the step failed"):
            if comm.rank == culprit:
                raise OSError("disk on fire")
    msg = str(info.value)
    assert msg.startswith("the step failed: ") and f"rank {culprit}: OSError: disk on fire" in msg
    assert msg.count("rank ") == 1  # only the culprit is named
    comm.Barrier()  # every rank got here: nobody was left waiting


def test_no_failure_passes_and_the_block_runs_on_every_rank(comm):
    ran = []
    with fail_together(comm, "nothing"):
        ran.append(comm.rank)
    assert comm.allgather(ran) == [[r] for r in range(comm.size)]


def test_agree_names_every_failing_rank_with_the_chosen_error(comm):
    err = f"bad {comm.rank}" if comm.rank % 2 == 1 or comm.size == 1 else None
    with pytest.raises(TideInvalid) as info:
        agree(comm, err, "input", TideInvalid)
    odd = [r for r in range(comm.size) if r % 2 == 1] or [0]
    assert [f"rank {r}: bad {r}" in str(info.value) for r in odd] == [True] * len(odd)


def test_an_interrupt_is_not_shared(comm):
    """KeyboardInterrupt goes straight up (it is the user stopping this process)."""
    with pytest.raises(KeyboardInterrupt):
        with fail_together(MPI.COMM_SELF, "never agreed"):
            raise KeyboardInterrupt
