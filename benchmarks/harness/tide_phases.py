"""Pieces of TIDE's collectives that can be run alone on the GPU, for breakdowns.

* ``ag.peer_copy``: one plain copy-engine copy of this rank's whole share into
  every peer's slot (``cudaMemcpyAsync``): the line-rate floor of TIDE-AG.
* ``rs.accumulate``: TIDE-RS's accumulate launches alone (the plan's pieces, read
  from the staging buffer as it is), through the backend's executor: the only
  SM work of TIDE-RS. Its grid comes from the backend if the executor reports
  its launches (see :func:`launch_ctas`); otherwise SM time is an upper bound.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from .impl import Phase

#: Executor/backend attributes that may list kernel launches (newest first wins).
LAUNCH_ATTRS = ("launches", "last_launches", "kernel_launches")


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
    seen: dict[str, Any] = {}

    def run() -> None:
        ex = be.executor(stream)
        for pieces in per_chunk:
            ex.accumulate(ex.COMPUTE, pieces, bfloat16, scale)
        seen["ctas"] = launch_ctas(ex, be)
        ex.finish().wait(stream)

    run()  # once, to learn the grid
    ctx.dev.sync()
    ctas, src = seen.get("ctas"), "reported by the executor"
    if not ctas:
        ctas, src = accumulator_ctas(be, per_chunk), "the backend's accumulator grid rule"
    note = (f"{len(per_chunk)} launches, mean grid {ctas} CTAs ({src})" if ctas else
            "grid not reported by the cuda backend: SM time assumes every SM (upper bound)")
    return Phase(run, "kernel", ctas, note)


def launch_ctas(ex: Any, be: Any) -> Optional[int]:
    """Mean CTAs per accumulate launch, if the executor or backend lists its launches.

    Accepted entries: an int (CTAs), a tuple/list whose first item is the grid
    (int or dims), or a dict with ``ctas`` or ``grid``.
    """
    for obj in (ex, be):
        for attr in LAUNCH_ATTRS:
            items = getattr(obj, attr, None)
            if not items:
                continue
            grids = [_ctas_of(x) for x in items]
            grids = [c for c in grids if c]
            if grids:
                return int(round(sum(grids) / len(grids)))
    return None


def accumulator_ctas(be: Any, per_chunk: list) -> Optional[int]:
    """Mean grid of the accumulate launches, by the cuda backend's own rule
    (``min(tiles of the launch's table, Accumulator.max_grid)``, tiles sized by its
    ``choose_tile`` where it has one), or None if that rule is not there."""
    try:
        from tidearray.backends.cuda import accumulate as ca

        acc = be.lanes.accumulator
        grids = []
        for pieces in per_chunk:
            if not pieces:
                continue
            choose = getattr(ca, "choose_tile", None)
            tile = choose(sum(p.numel for p in pieces), acc.max_grid) if choose else ca.TILE
            grids.append(min(ca.build_table(pieces, tile)[1], acc.max_grid))
    except Exception:  # noqa: BLE001 - a changed backend: report the grid as unknown
        return None
    return int(round(sum(grids) / len(grids))) if grids else None


def _ctas_of(x: Any) -> Optional[int]:
    if isinstance(x, dict):
        x = x.get("ctas", x.get("grid"))
    elif isinstance(x, (tuple, list)) and x and not all(isinstance(v, int) for v in x):
        x = x[0]
    if isinstance(x, int):
        return x
    if isinstance(x, (tuple, list)) and x and all(isinstance(v, int) for v in x):
        return math.prod(x)
    return None
