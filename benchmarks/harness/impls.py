"""The implementations that need no NCCL (the registry is ``impl.py``).

Registered here: ``tide`` (both backends) and the host-backend ``stock``
(NumPy copy-in/out around flat MPI collectives). The NCCL baselines are in
``impls_nccl.py``, the PyTorch cross-checks in ``impls_torch.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from tidearray import bfloat16, float32

from ..baselines import pack
from .data import UnitData, as_f32_shards
from .guard import guarded
from .impl import Impl, Phase, Prepared, register


def _release(last: dict, *regions: Any) -> Callable[[], None]:
    """Drop the kept results, then free the regions (the order the harness needs)."""
    def release() -> None:
        last.clear()
        for r in regions:
            r.free()
    return release


def _tide_buffers(ctx: Any, data: UnitData) -> tuple:
    """The unit's ``Unit`` (the group's chunk size and depth), a slot and a staging region
    of the sizes it needs, and fp32 outputs of this rank's shards."""
    import tidearray as ta
    from tidearray._arena import Region

    g = ctx.group
    unit = ta.Unit(data.unit.shapes, bfloat16, group=g)
    slot, staging = Region(g, unit.nbytes), Region(g, unit.staging_nbytes)
    outs = [ctx.dev.xp.empty(s.shard_shape, float32) for s in data.specs]
    return unit, slot, staging, outs, slot.nbytes + staging.nbytes + sum(o.nbytes for o in outs)


@register
class Tide(Impl):
    """tidearray.all_gather / reduce_scatter into a pre-created slot and staging region."""

    name = "tide"
    description = "TIDE-AG / TIDE-RS (tidearray), slot and staging made once"

    def unavailable(self) -> Optional[str]:
        be = self.ctx.group.backend.name
        if be != self.ctx.dev.name:
            return self.ctx.group_note or f"tidearray runs on {be}, not {self.ctx.dev.name}"
        return None

    def setup(self, data: UnitData) -> Prepared:
        import tidearray as ta

        g, stream = self.ctx.group, self.ctx.dev.stream
        _, slot, staging, outs, nbytes = _tide_buffers(self.ctx, data)
        last: dict[str, Any] = {}

        def ag() -> None:
            last["ag"] = ta.all_gather(data.shards, data.unit.shapes, group=g, slot=slot,
                                       stream=stream)

        def rs() -> None:
            ta.reduce_scatter(data.grads, op="avg", out=outs, group=g, staging=staging,
                              stream=stream)

        return Prepared(ag, rs, lambda: last["ag"], lambda: outs, self._phases(data, slot),
                        nbytes, _release(last, slot, staging))

    def _phases(self, data: UnitData, slot: Any) -> dict:
        """``ag.peer_copy`` on the GPU: one plain ``cudaMemcpyAsync`` of this rank's share
        into each peer's slot, the copy-engine floor of TIDE-AG (a reference, not a piece
        of it). If any rank cannot make it, every rank leaves it out and the run is marked
        failed: a breakdown that silently disappears hides a broken path."""
        if self.ctx.dev.name != "cuda":
            return {}

        def make() -> dict:
            import cupy

            g, stream = self.ctx.group, self.ctx.dev.stream
            nbytes = sum(s.byte_range(g.rank)[1] for s in data.specs)
            src = slot.ptr(g.local_rank)
            dsts = [slot.ptr((g.local_rank + k) % g.local_size) for k in range(1, g.local_size)]

            def run() -> None:  # W = 2: exactly TIDE-AG's traffic; W > 2: serial (a bound)
                for dst in dsts:
                    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, 4, stream.ptr)
            return {"ag.peer_copy": Phase(run, "ce", 0, f"one cudaMemcpyAsync of {nbytes} B "
                                          "to each peer's slot", part=False)}

        ok, phases = guarded(self.ctx, "breakdown", self.name, data.unit.name, "phases", make)
        return phases if ok else {}


@register
class TidePlan(Tide):
    """TIDE-AG / TIDE-RS through persistent plans: the path ``tidearray.fsdp`` takes."""

    name = "tide-plan"
    description = ("TIDE-AG / TIDE-RS as persistent plans (Unit.gather_plan / reduce_plan, "
                   "validated once), as the FSDP runtime calls them")

    def setup(self, data: UnitData) -> Prepared:
        stream = self.ctx.dev.stream
        unit, slot, staging, outs, nbytes = _tide_buffers(self.ctx, data)
        gather = unit.gather_plan(data.shards, slot)
        reduce = unit.reduce_plan(data.grads, outs, op="avg", staging=staging)
        last: dict[str, Any] = {}

        def ag() -> None:
            last["ag"] = gather(stream=stream)

        return Prepared(ag, lambda: reduce(stream=stream), lambda: last["ag"], lambda: outs,
                        {}, nbytes, _release(last, slot, staging))


@register
class HostStock(Impl):
    """FSDP2's path on CPUs: NumPy copy-in, flat MPI Allgather, copy-out; pack to fp32 and
    MPI Reduce_scatter_block (sum, then scaled)."""

    name = "stock"
    backends = ("host",)
    description = "copy-in + flat MPI Allgather + copy-out; fp32 pack + MPI Reduce_scatter"

    def open(self) -> None:
        self.comm = self.ctx.comm.Dup()

    def close(self) -> None:
        self.comm.Free()

    def setup(self, data: UnitData) -> Prepared:
        from mpi4py import MPI

        comm, W, me = self.comm, data.world, data.rank
        lay = pack.flat_layout(data.unit.shapes, W)
        flat = np.empty(lay.total_numel, bfloat16)
        params = [np.empty(s.shape, bfloat16) for s in data.specs]
        fp = flat.ctypes.data
        copy_in = pack.HostCopy(pack.copy_in_segs(lay, [a.ctypes.data for a in data.shards], fp,
                                                  me, 2), "bytes")
        copy_out = pack.HostCopy(pack.copy_out_segs(lay, fp, [a.ctypes.data for a in params], 2),
                                 "bytes")
        rs_in = np.empty(lay.total_numel, float32)
        rs_out = np.empty(lay.block_numel, float32)
        chunk_cat = pack.HostCopy(pack.chunk_cat_segs(lay, [g.ctypes.data for g in data.grads],
                                                      rs_in.ctypes.data, 2, 4), "bf16_f32")
        inv_w = np.float32(1.0 / W)

        def gather() -> None:
            comm.Allgather(MPI.IN_PLACE, [flat.view(np.uint8), MPI.BYTE])

        def reduce() -> None:
            comm.Reduce_scatter_block(rs_in, rs_out, op=MPI.SUM)
            np.multiply(rs_out, inv_w, out=rs_out)

        def ag() -> None:
            copy_in()
            gather()
            copy_out()

        def rs() -> None:
            chunk_cat()
            reduce()

        phases = {"ag.copy_in": Phase(copy_in, "host"), "ag.collective": Phase(gather, "host"),
                  "ag.copy_out": Phase(copy_out, "host"), "rs.pack": Phase(chunk_cat, "host"),
                  "rs.collective": Phase(reduce, "host")}
        outs = as_f32_shards(np, rs_out, lay.offsets, data.specs)
        nbytes = flat.nbytes + sum(p.nbytes for p in params) + rs_in.nbytes + rs_out.nbytes
        return Prepared(ag, rs, lambda: params, lambda: outs, phases, nbytes)
