"""Pieces of TIDE's collectives that can be run alone on the GPU, for breakdowns.

* ``ag.peer_copy``: one plain copy-engine copy of this rank's whole share into
  every peer's slot (``cudaMemcpyAsync``): the line-rate floor of TIDE-AG.
* ``rs.accumulate``: TIDE-RS's accumulate launches alone (the plan's pieces, read
  from the staging buffer as it is), through the backend's executor: the only
  SM work of TIDE-RS (its grids: CUPTI's, in the ``sm_time_cupti`` records).
"""

from __future__ import annotations

from typing import Any, Optional

from .impl import Phase


def peer_copy_phase(ctx: Any, data: Any, slot: Any) -> Phase:
    import cupy

    g = ctx.group
    me, L = g.local_rank, g.local_size
    nbytes = sum(s.byte_range(g.rank)[1] for s in data.specs)
    src = slot.ptr(me)
    peers = [(me + k) % L for k in range(1, L)]
    stream = ctx.dev.stream

    def run() -> None:
        for p in peers:  # W = 2: exactly TIDE-AG's traffic; W > 2: serial (an upper bound)
            cupy.cuda.runtime.memcpyAsync(slot.ptr(p), src, nbytes, 4, stream.ptr)
    return Phase(run, "ce", 0, f"one cudaMemcpyAsync of {nbytes} B to each peer's slot",
                 part=False)


def accumulate_phase(ctx: Any, data: Any, plan: Any, staging: Any, outs: list) -> Optional[Phase]:
    """TIDE-RS's accumulate launches alone, or None where the topology has several nodes."""
    from tidearray import bfloat16
    from tidearray._reduce_scatter import accum_pieces
    from tidearray.layout import plan_unit

    g = ctx.group
    topo = g.topology
    if topo.num_nodes != 1:
        return None
    be, me, L = g.backend, topo.local_rank, topo.local_size
    unit = plan_unit(data.unit.shapes, 2, g.size)
    grad_ptrs = [be.resolve(a).ptr for a in data.grads]
    out_ptrs = [be.resolve(o).ptr for o in outs]
    peers = [(me + k) % L for k in range(1, L)]
    per_chunk = []
    for k, chunk in enumerate(plan.chunks):
        boff = plan.buffer_of(k) * plan.buffer_nbytes
        src_base = {q: staging.ptr(me) + boff + ((q - me) % L - 1) * plan.source_nbytes
                    for q in peers}
        per_chunk.append(accum_pieces(unit, chunk, topo, grad_ptrs, out_ptrs, src_base))
    stream, scale = ctx.dev.stream, 1.0 / g.size

    def run() -> None:
        ex = be.executor(stream)
        for pieces in per_chunk:
            ex.accumulate(ex.COMPUTE, pieces, bfloat16, scale)
        ex.finish().wait(stream)

    return Phase(run, "kernel", None, f"{len(per_chunk)} launches of the accumulate")
