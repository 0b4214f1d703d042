"""Pure planning: the ranks of a group as nodes x local ranks.

:class:`Topology` numbers a rank by its node and local rank; :func:`shared_devices`
is the rule for which ranks one communicator would put on one device. Nothing here
touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._errors import TideInvalid


@dataclass(frozen=True)
class Topology:
    """Ranks as ``nodes x local_size``; global rank = node * local_size + local_rank."""

    world: int
    rank: int
    local_size: int

    def __post_init__(self) -> None:
        if self.local_size < 1 or self.world % self.local_size:
            raise TideInvalid(
                f"expected a local size that divides the world size {self.world}, "
                f"got {self.local_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world // self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    def global_rank(self, node: int, local_rank: int) -> int:
        return node * self.local_size + local_rank

    def column(self, local_rank: int) -> tuple[int, ...]:
        """Global ranks that share ``local_rank``, one per node, in node order."""
        return tuple(self.global_rank(m, local_rank) for m in range(self.num_nodes))


def shared_devices(places: Sequence[tuple]) -> list[tuple[int, int]]:
    """Pairs of ranks that one communicator would put on one device.

    Args:
        places: per rank of the group, ``(communicator, host, device)``: which
            communicator the rank joins (e.g. its local rank, for the
            inter-node one), and where it runs.

    Returns:
        ``(first rank, later rank)`` for each rank whose place another rank of
        the same communicator already has (NCCL rejects such a communicator).
    """
    first: dict = {}
    pairs = []
    for r, place in enumerate(places):
        if place in first:
            pairs.append((first[place], r))
        else:
            first[place] = r
    return pairs
