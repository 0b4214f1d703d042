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
        from tidearray._arena import Region
        from tidearray._schedule import plan_reduce_scatter
        from tidearray.layout import plan_unit, unit_nbytes

        ctx, g = self.ctx, self.ctx.group
        shapes, xp, stream = data.unit.shapes, ctx.dev.xp, ctx.dev.stream
        cfg = g.config
        rs_plan = plan_reduce_scatter(plan_unit(shapes, 2, g.size), g.topology,
                                      cfg.chunk_nbytes, cfg.depth)
        slot = Region(g, unit_nbytes(shapes, bfloat16, group=g))
        staging = Region(g, rs_plan.staging_nbytes)  # the default staging size
        outs = [xp.empty(s.shard_shape, float32) for s in data.specs]
        last: dict[str, Any] = {}

        def ag() -> None:
            last["ag"] = ta.all_gather(data.shards, shapes, group=g, slot=slot, stream=stream)

        def rs() -> None:
            ta.reduce_scatter(data.grads, op="avg", out=outs, group=g, staging=staging,
                              stream=stream)

        phases = self._phases(data, rs_plan, slot, staging, outs)
        release = _release(last, slot, staging)
        return Prepared(ag, rs, lambda: last["ag"], lambda: outs, phases,
                        slot.nbytes + staging.nbytes + sum(o.nbytes for o in outs), release)


    def _phases(self, data: UnitData, rs_plan: Any, slot: Any, staging: Any,
                outs: list) -> dict:
        """The GPU breakdown pieces. If any rank cannot make them, every rank leaves
        them out (TIDE's own timing still runs) and the run is marked failed: a
        breakdown that silently disappears hides a broken path."""
        if self.ctx.dev.name != "cuda":
            return {}
        from .tide_phases import accumulate_phase, peer_copy_phase

        def make() -> dict:
            phases = {"ag.peer_copy": peer_copy_phase(self.ctx, data, slot)}
            acc = accumulate_phase(self.ctx, data, rs_plan, staging, outs)
            if acc is not None:
                phases["rs.accumulate"] = acc
            return phases

        ok, phases = guarded(self.ctx, "breakdown", self.name, data.unit.name, "phases", make)
        return phases if ok else {}


@register
class TidePlan(Tide):
    """TIDE-AG / TIDE-RS through persistent plans: the path ``tidearray.fsdp`` takes."""

    name = "tide-plan"
    description = ("TIDE-AG / TIDE-RS as persistent plans (Unit.gather_plan / reduce_plan, "
                   "validated once), as the FSDP runtime calls them")

    def setup(self, data: UnitData) -> Prepared:
        import tidearray as ta
        from tidearray._arena import Region

        g, stream = self.ctx.group, self.ctx.dev.stream
        unit = ta.Unit(data.unit.shapes, bfloat16, group=g)
        slot, staging = Region(g, unit.nbytes), Region(g, unit.staging_nbytes)
        outs = [self.ctx.dev.xp.empty(s.shard_shape, float32) for s in data.specs]
        gather = unit.gather_plan(data.shards, slot)
        reduce = unit.reduce_plan(data.grads, outs, op="avg", staging=staging)
        last: dict[str, Any] = {}

        def ag() -> None:
            last["ag"] = gather(stream=stream)

        return Prepared(ag, lambda: reduce(stream=stream), lambda: last["ag"], lambda: outs,
                        {}, slot.nbytes + staging.nbytes + sum(o.nbytes for o in outs),
                        _release(last, slot, staging))


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
