"""Per-rank memory of a unit's collectives, from the plans alone (no group, no device).

TIDE's buffers are read off its plans (``plan_unit``, ``plan_reduce_scatter``); stock
FSDP2's are what its flat path allocates for the same unit. ``python -m
benchmarks.memory`` prints them for the benchmark units (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._errors import TideInvalid
from ._layout import plan_unit
from ._schedule import plan_reduce_scatter
from ._topology import Topology


@dataclass(frozen=True)
class MemoryReport:
    """Per-rank bytes of one unit's all-gather and reduce-scatter: TIDE's, from its
    plans, and stock FSDP2's (every parameter padded to ``rows_per_shard x world`` rows,
    flat buffers, ``reduce_dtype=float32``) for comparison.

    Attributes:
        slot: TIDE's all-gather slot, the full unit with each parameter 256-aligned
            (``UnitLayout.nbytes``).
        staging: node-local reduce-scatter staging (``RsPlan.local_nbytes``).
        partial: fp32 node partial sums (``RsPlan.partial_nbytes``); 0 on one node.
        receive: fp32 receive buffer (``RsPlan.receive_nbytes``); 0 on one node.
        output: fp32 results, this rank's output shards aligned (``RsPlan.block_numel``).
        stock_ag_output: FSDP2's all-gather output: the padded full unit, param dtype.
        stock_ag_input: FSDP2's all-gather input: this rank's shards, param dtype.
        stock_rs_input: FSDP2's reduce-scatter input: the padded full unit in fp32.
        stock_rs_output: FSDP2's reduce-scatter output: this rank's shards in fp32.
    """

    slot: int
    staging: int
    partial: int
    receive: int
    output: int
    stock_ag_output: int
    stock_ag_input: int
    stock_rs_input: int
    stock_rs_output: int

    @property
    def rs_nbytes(self) -> int:
        """The reduce-scatter's buffers: its staging region (``RsPlan.staging_nbytes``)."""
        return self.staging + self.partial + self.receive


def memory_report(
    shapes: Sequence[Sequence[int]], itemsize: int, world: int, local_size: int,
    chunk_nbytes: int = 32 << 20, depth: int = 2,
) -> MemoryReport:
    """What one unit's collectives hold per rank, from the plans alone (no device).

    Args:
        shapes: the unit's full parameter shapes.
        itemsize: bytes per parameter (and gradient) element, e.g. 2 for bf16.
        world: ranks.
        local_size: ranks per node; it must divide ``world``.
        chunk_nbytes: the reduce-scatter chunk (``Config.chunk_nbytes``, 32 MiB).
        depth: reduce-scatter buffers in flight (``Config.depth``, 2).

    Returns:
        The bytes of each buffer (:class:`MemoryReport`), the same on every rank.

    Raises:
        TideInvalid: ``world`` < 1, ``local_size`` does not divide it, ``depth`` < 1,
            or a shape is not a parameter's.

    See Also:
        :func:`plan_unit`, :func:`plan_reduce_scatter`: the plans it reads.
    """
    if world < 1:
        raise TideInvalid(f"expected a world size >= 1, got {world}")
    unit = plan_unit(shapes, itemsize, world)
    rs = plan_reduce_scatter(unit, Topology(world, 0, local_size), chunk_nbytes, depth)
    shards = sum(s.shard_numel for s in unit.specs)  # padded, unaligned: FSDP2's flat shard
    return MemoryReport(
        slot=unit.nbytes, staging=rs.local_nbytes, partial=rs.partial_nbytes,
        receive=rs.receive_nbytes, output=rs.block_numel * 4,
        stock_ag_output=shards * world * itemsize, stock_ag_input=shards * itemsize,
        stock_rs_input=shards * world * 4, stock_rs_output=shards * 4)
