"""Debug stamps: proof, per call, that every peer's bytes arrived before they were read.

[Note: stamps]
With ``Config.debug`` on, each node-local transfer carries a stamp: after a
writer's data copies, on the same lane, it copies the channel's use number
(the per-slot sequence number of the grant/arrive protocol, [Note:
grant/arrive] in ``_arena``) from a word of its own into the reader's STAMP
word for that writer. The copy goes by the copy engine, like the data, and
after it in lane order, so a stamp that has arrived means the data before it
has. The reader, at the point where it starts reading (after its waits, on
the lane that reads), snapshots the STAMP words of every writer into a small
array of its own, and writes 0 back into each STAMP word it read (as flags are
reset: [Note: replay-safe flags] in ``_arena``). After the call, the snapshot
must hold exactly this call's use numbers: 0 means the reader went ahead
without the data (a protocol bug, such as a grant that a rejected call left
behind); another number means the writer was in another call. A replayed
call (a graph) repeats the use numbers it was captured with, and the reset
keeps a stale stamp from passing for a new one.

The check synchronizes and agrees across ranks, so debug mode is for finding
bugs, not for timing. Inter-node transfers (NCCL, MPI) are not stamped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._arena import OUTBOX, STAMP, Region
from ._errors import agree
from .backends import array_backend

if TYPE_CHECKING:
    from ._group import Group
    from .backends import Executor


class Stamps:
    """One call's stamps: what was sent, where each reader snapshots, what to expect.

    Args:
        group: the group.
        what: the collective's name, for messages.
        capacity: the most snapshot words the call will take.
    """

    def __init__(self, group: Group, what: str, capacity: int) -> None:
        self.group = group
        self.what = what
        self._snap = group.backend.empty((max(capacity, 1),), np.int32)
        self.poison()
        self._snap_ptr = group.backend.resolve(self._snap).ptr
        self._expect: list[tuple[str, int, int]] = []  # (where, writer's rank, use)

    def poison(self) -> None:
        """Fill the snapshot with -1 before any lane can write it (again, before each
        replay of a graph plan)."""
        self._snap[...] = -1
        self.group.backend.synchronize()

    def send(self, ex: Executor, lane: int, region: Region, channel: int, reader: int,
             use: int) -> None:
        """After ``lane``'s data copies into ``reader``'s ``region``: stamp them ``use``."""
        me = self.group.topology.local_rank
        outbox = region.flag(me, channel, OUTBOX, reader)
        ex.signal(lane, outbox, use)
        # Raw copies: planned for this call only ([Note: compiled batches]).
        ex.copy(lane, [(region.flag(reader, channel, STAMP, me), outbox, 4)])

    def fetch(self, ex: Executor, lane: int, src_addr: int, writer: int, use: int,
              where: str) -> None:
        """Copy one stamp word (ours, or a peer's) into the snapshot, on ``lane``."""
        k = len(self._expect)
        self._expect.append((where, self.group.topology.global_rank(
            self.group.topology.node, writer), use))
        ex.copy(lane, [(self._snap_ptr + 4 * k, src_addr, 4)])

    def snapshot(self, ex: Executor, lane: int, region: Region, channel: int, writers: list,
                 use: int, where: str) -> None:
        """Before ``lane`` reads ``region``: snapshot every writer's stamp, and reset it."""
        me = self.group.topology.local_rank
        for q in writers:
            self.fetch(ex, lane, region.flag(me, channel, STAMP, q), q, use, where)
            self.reset(ex, lane, region.flag(me, channel, STAMP, q))

    @staticmethod
    def reset(ex: Executor, lane: int, addr: int) -> None:
        """Write 0 into a stamp word once every reader has fetched it (on ``lane``)."""
        ex.signal(lane, addr, 0)

    def check(self) -> None:
        """Wait for the call, then raise TideBackendError on every rank if any stamp
        was not this call's."""
        be = self.group.backend
        be.synchronize()
        got = array_backend(np).asarray(self._snap)  # the host's: a CuPy array comes down
        bad = [f"{where}: rank {writer}'s stamp was {int(v)}, expected {use}"
               for (where, writer, use), v in zip(self._expect, got) if v != use]
        agree(self.group.comm, "; ".join(bad[:4]) or None,
              f"{self.what}: data was read before it arrived (debug stamps, [Note: stamps])")


def start(group: Group, what: str, capacity: int) -> Any:
    """A :class:`Stamps` for this call if ``Config.debug`` is on, else None."""
    return Stamps(group, what, capacity) if group.config.debug else None
