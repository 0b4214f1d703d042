"""The NCCL baselines on the cuda backend: ``stock``, ``symm`` and ``nccl-a2a``.

All three keep FSDP2's flat rank-major buffers and do the layout conversion
with one fused kernel per conversion per unit (``pack``: ``kernels/pack.cu`` and
``pack_bf16_f32.cu``):

* ``stock``: copy-in into this rank's block of the flat buffer, in-place NCCL
  all-gather, copy-out into each parameter's storage; RS = chunk-cat bf16 ->
  fp32 (padding zeroed), NCCL fp32 reduce-scatter (avg). FSDP2's path.
* ``symm``: the same buffers allocated with ``ncclMemAlloc`` and registered as
  symmetric windows; the all-gather communicator uses ``NCCL_CTA_POLICY_ZERO``
  (NCCL's copy-engine all-gather), the reduce-scatter one NCCL's defaults, with
  ``ncclSum`` (the symmetric kernels take no ``ncclAvg``) and the 1/W scale after.
* ``nccl-a2a``: RS only, Megatron-style: chunk-cat bf16, NCCL bf16 all-to-all (each
  rank receives every rank's bf16 block of its shard), then a local fp32 accumulate of
  the blocks in rank order with the 1/W scale fused, by TIDE-RS's own accumulate kernel.
  The closest NCCL analogue of TIDE-RS: the same bytes on the wire and the same sum.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tidearray import bfloat16, float32
from tidearray.backends import AccumPiece

from ..harness.data import UnitData, as_f32_shards
from ..harness.impl import Impl, Phase, Prepared, Skip, register
from . import nccl, pack


class _Buffers:
    """Device buffers of one setup, freed together."""

    def __init__(self, alloc: Callable[[int, str], Any]) -> None:
        self._alloc = alloc
        self.items: list = []
        self.nbytes = 0

    def get(self, nbytes: int, role: str) -> tuple[Any, int]:
        """A uint8 device array of ``nbytes`` and its address."""
        buf = self._alloc(nbytes, role)
        self.items.append(buf)
        self.nbytes += nbytes
        arr = buf.array if hasattr(buf, "array") else buf
        return arr, int(arr.data.ptr)

    def free(self) -> None:
        for b in reversed(self.items):
            if hasattr(b, "free"):
                b.free()
        self.items.clear()


@register
class Stock(Impl):
    """FSDP2's path, with fused copy kernels."""

    name = "stock"
    backends = ("cuda",)
    description = "fused copy-in + NCCL all-gather + fused copy-out; fused fp32 chunk-cat + NCCL " \
                  "fp32 reduce-scatter"
    do_ag, do_rs = True, True

    def unavailable(self) -> Optional[str]:
        ok, why = nccl.available()
        return None if ok else why

    def open(self) -> None:
        self.ag_comm = self.rs_comm = nccl.communicator(self.ctx.comm)

    def close(self) -> None:
        for c in {id(self.ag_comm): self.ag_comm, id(self.rs_comm): self.rs_comm}.values():
            c.destroy()

    def _alloc(self, nbytes: int, role: str) -> Any:
        return self.ctx.dev.xp.empty(nbytes, self.ctx.dev.xp.uint8)

    def _reduce(self, comm: Any, send: int, recv: int, out32: Any, count: int,
                stream: Any) -> None:
        """The fp32 reduce-scatter of the average (FSDP2 passes ncclAvg)."""
        nccl.reduce_scatter_avg(comm, send, recv, count, "float32", stream.ptr)

    def _collective_kind(self, op: str) -> str:
        return "nccl"

    def setup(self, data: UnitData) -> Prepared:
        bufs = _Buffers(self._alloc)
        lay = pack.flat_layout(data.unit.shapes, data.world)
        prep = Prepared(release=bufs.free)
        try:
            if self.do_ag:
                self._setup_ag(data, lay, bufs, prep)
            if self.do_rs:
                self._setup_rs(data, lay, bufs, prep)
        except BaseException:
            bufs.free()
            raise
        prep.accounted_nbytes = bufs.nbytes
        return prep

    def _setup_ag(self, data: UnitData, lay: pack.FlatLayout, bufs: _Buffers,
                  prep: Prepared) -> None:
        dev, xp, me = self.ctx.dev, self.ctx.dev.xp, data.rank
        _, flat = bufs.get(lay.total_numel * 2, "ag")
        params = [xp.empty(s.shape, bfloat16) for s in data.specs]
        bufs.nbytes += sum(p.nbytes for p in params)
        copy_in = pack.make_copy(dev, pack.copy_in_segs(
            lay, [a.data.ptr for a in data.shards], flat, me, 2), "bytes")
        copy_out = pack.make_copy(dev, pack.copy_out_segs(
            lay, flat, [a.data.ptr for a in params], 2), "bytes")
        s, comm = dev.stream, self.ag_comm
        send = flat + me * lay.block_numel * 2

        def gather() -> None:
            nccl.all_gather(comm, send, flat, lay.block_numel, "bfloat16", s.ptr)

        def ag() -> None:
            copy_in(s)
            gather()
            copy_out(s)

        prep.ag, prep.ag_out = ag, lambda: params
        prep.phases.update({
            "ag.copy_in": Phase(lambda: copy_in(s), "kernel", copy_in.ctas),
            "ag.collective": Phase(gather, self._collective_kind("ag")),
            "ag.copy_out": Phase(lambda: copy_out(s), "kernel", copy_out.ctas)})

    def _setup_rs(self, data: UnitData, lay: pack.FlatLayout, bufs: _Buffers,
                  prep: Prepared) -> None:
        dev, xp = self.ctx.dev, self.ctx.dev.xp
        _, rs_in = bufs.get(lay.total_numel * 4, "rs_in")
        out_arr, rs_out = bufs.get(lay.block_numel * 4, "rs_out")
        chunk_cat = pack.make_copy(dev, pack.chunk_cat_segs(
            lay, [g.data.ptr for g in data.grads], rs_in, 2, 4), "bf16_f32")
        s, comm = dev.stream, self.rs_comm

        out32 = out_arr.view(float32)

        def reduce() -> None:
            self._reduce(comm, rs_in, rs_out, out32, lay.block_numel, s)

        def rs() -> None:
            chunk_cat(s)
            reduce()

        outs = as_f32_shards(xp, out32, lay.offsets, data.specs)
        prep.rs, prep.rs_out = rs, lambda: outs
        prep.phases.update({
            "rs.pack": Phase(lambda: chunk_cat(s), "kernel", chunk_cat.ctas),
            "rs.collective": Phase(reduce, self._collective_kind("rs"))})


@register
class Symm(Stock):
    """NCCL symmetric windows: zero-CTA (copy-engine) all-gather, symmetric reduce-scatter."""

    name = "symm"
    description = "fused copy-in + NCCL CE all-gather (symmetric window, CTA policy ZERO) + " \
                  "fused copy-out; fused fp32 chunk-cat + NCCL symmetric reduce-scatter " \
                  "(ncclSum on windows) + 1/W scale"

    def unavailable(self) -> Optional[str]:
        why = super().unavailable()
        if why:
            return why
        v = nccl.version()
        if v < (2, 27, 0):
            return (f"NCCL {nccl.version_string()} has no symmetric windows with "
                    "NCCL_CTA_POLICY_ZERO (needs >= 2.27)")
        return None

    def open(self) -> None:
        self.ag_comm = nccl.communicator(self.ctx.comm, cta_policy="zero")
        self.rs_comm = nccl.communicator(self.ctx.comm)
        self._windows: list = []

    def _alloc(self, nbytes: int, role: str) -> Any:
        buf = nccl.NcclBuffer(nbytes)
        comm = self.ag_comm if role == "ag" else self.rs_comm
        try:
            handle = nccl.register_window(comm, buf)
        except RuntimeError as e:
            buf.free()
            raise Skip(str(e)) from None
        return _Windowed(buf, handle)

    def _collective_kind(self, op: str) -> str:
        return "nccl-ce" if op == "ag" else "nccl"

    def _reduce(self, comm: Any, send: int, recv: int, out32: Any, count: int,
                stream: Any) -> None:
        """ncclSum on the windows, then the 1/W scale: NCCL's symmetric reduce-scatter
        kernels do not take ncclAvg (with it NCCL falls back to its regular kernel)."""
        nccl.reduce_scatter(comm, send, recv, count, "float32", nccl.SUM, stream.ptr)
        with stream:
            out32 *= float32.type(1.0 / self.ctx.size)


class _Windowed:
    """An ncclMemAlloc buffer and its window registration."""

    def __init__(self, buf: Any, handle: Any) -> None:
        self.buf, self.handle, self.array = buf, handle, buf.array

    def free(self) -> None:
        self.handle.close()
        self.array = None
        self.buf.free()


@register
class NcclA2a(Stock):
    """bf16 chunk-cat, NCCL bf16 all-to-all, fp32 accumulate of the W blocks (Megatron)."""

    name = "nccl-a2a"
    description = "fused bf16 chunk-cat + NCCL bf16 all-to-all (grouped send/recv) + fp32 " \
                  "accumulate of the W blocks in rank order, 1/W fused (TIDE-RS's kernel)"
    do_ag = False
    ops = ("rs",)

    def _setup_rs(self, data: UnitData, lay: pack.FlatLayout, bufs: _Buffers,
                  prep: Prepared) -> None:
        """bf16 chunk-cat into the flat buffer, NCCL's bf16 all-to-all (every rank's block
        of our shard), then the fp32 sum of the W blocks in rank order, scale fused."""
        dev, xp, W, comm = self.ctx.dev, self.ctx.dev.xp, data.world, self.rs_comm
        _, rs_in = bufs.get(lay.total_numel * 2, "rs_in")
        _, recv = bufs.get(lay.total_numel * 2, "rs_out")
        out32 = xp.empty(lay.block_numel, float32)
        bufs.nbytes += out32.nbytes
        chunk_cat = pack.make_copy(dev, pack.to_bytes(pack.chunk_cat_segs(
            lay, [g.data.ptr for g in data.grads], rs_in, 2, 2), 2), "bytes")
        accumulator = self.ctx.group.backend.lanes.accumulator
        pieces = (AccumPiece(int(out32.data.ptr), tuple(
            recv + r * lay.block_numel * 2 for r in range(W)), lay.block_numel),)
        s = dev.stream

        def exchange() -> None:
            nccl.all_to_all(comm, rs_in, recv, lay.block_numel, "bfloat16", W, s.ptr)

        def accumulate() -> None:
            accumulator.launch(s, pieces, bfloat16, 1.0 / W)

        def rs() -> None:
            chunk_cat(s)
            exchange()
            accumulate()

        outs = as_f32_shards(xp, out32, lay.offsets, data.specs)
        prep.rs, prep.rs_out = rs, lambda: outs
        prep.phases.update({
            "rs.pack": Phase(lambda: chunk_cat(s), "kernel", chunk_cat.ctas),
            "rs.collective": Phase(exchange, "nccl"),
            "rs.accumulate": Phase(accumulate, "kernel", accumulator.max_grid,
                                   "TIDE-RS accumulate kernel")})
