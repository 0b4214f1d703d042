"""The runtime's ``stock`` comm: FSDP2's communication path, at its strongest.

``Runtime(comm=StockComm)`` (or ``shard_module(comm=StockComm)``) trains with it
under the same trainer as ``tide``: the baseline of the step comparisons.

Per unit, with the flat rank-major layout ``[r0: p0 p1 ..][r1: p0 p1 ..]``:

* all-gather: one fused copy-in of the send shards into our block of the
  flat buffer, an in-place flat all-gather, one fused copy-out into each
  parameter's storage;
* reduce-scatter: one fused chunk-cat of the gradients into a flat fp32
  buffer (padding zeroed), a flat fp32 sum reduce-scatter straight into the
  unit's block of the fp32 gradient arena.

On cuda the copies are the kernels of ``pack`` (``kernels/pack.cu`` and
``pack_bf16_f32.cu``; tables uploaded once per unit and slot) and the collectives
are NCCL through nccl4py, each collective kind on its own side stream and
communicator (FSDP2's all-gather and reduce-scatter streams). On host they are
memmove / NumPy over the same tables and MPI collectives.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

import tidearray
from tidearray import TideInvalid, Work
from tidearray.fsdp import UnitComm

from . import pack

if TYPE_CHECKING:
    from tidearray import Group


class StockComm(UnitComm):
    """Flat buffers per slot, conversion tables per (unit, slot), made on first use."""

    name = "stock"

    def __init__(self, group: Group, shapes: Sequence, dtype: Any, arena: Any,
                 num_slots: int, root: bool = False) -> None:
        super().__init__(group, shapes, dtype, arena, num_slots, root)
        if self.dtype not in (tidearray.bfloat16, tidearray.float32):
            raise TideInvalid(f"comm=StockComm: expected param dtype bfloat16 or float32, got "
                              f"{self.dtype}")
        xp, W = self.xp, self.world
        self.flats = arena.layout.units  # the arena's units lie in FSDP2's flat layout
        slots = range(len(self.slot_units))
        blocks = [self.slot_max(k, lambda u: self.flats[u].block_numel) for k in slots]
        self._params = [xp.empty((self.slot_max(k, lambda u: self.layouts[u].nbytes),), np.uint8)
                        for k in slots]
        self._ag_flat = [xp.empty((W * b,), self.dtype) for b in blocks]
        self._rs_flat = [xp.empty((W * b,), np.float32) for b in blocks]
        self._ops: dict = {}
        self._cuda = group.backend.name == "cuda"
        self._lanes = _CudaLanes(group) if self._cuda else _HostLanes(group)

    @property
    def nbytes(self) -> int:
        bufs = self._params + self._ag_flat + self._rs_flat
        return super().nbytes + sum(b.nbytes for b in bufs)

    def gather(self, unit: int, k: int, stream: Any) -> Work:
        copy_in, copy_out, params = self._ag_ops(unit, k)
        flat, lay = self._ag_flat[k], self.flats[unit]
        n = lay.block_numel * self.dtype.itemsize

        def run(s: Any) -> None:
            copy_in(s)
            self._lanes.all_gather(flat, n * self.world, n, s)
            copy_out(s)

        return self._lanes.run("ag", run, stream, params)

    def reduce(self, unit: int, k: int, out: Any, stream: Any) -> Work:
        chunk_cat = self._rs_op(unit, k)
        lay = self.flats[unit]
        dst = self.arena.block(out, unit)
        src = self._rs_flat[k][:lay.block_numel * self.world]

        def run(s: Any) -> None:
            chunk_cat(s)
            self._lanes.reduce_scatter(src, dst, lay.block_numel, s)

        return self._lanes.run("rs", run, stream, None)

    def _ag_ops(self, unit: int, k: int) -> tuple:
        key = ("ag", unit, k)
        ops = self._ops.get(key)
        if ops is None:
            lay, size = self.flats[unit], self.dtype.itemsize
            params = self.views(self._params[k], unit)
            flat = pack.ptr(self._ag_flat[k])
            shards = [pack.ptr(a) for a in self.arena.views(self.arena.send, unit)]
            copy_in = self._copy(pack.copy_in_segs(lay, shards, flat, self.group.rank, size),
                                 "bytes")
            ptrs = [pack.ptr(p) for p in params]
            copy_out = self._copy(pack.copy_out_segs(lay, flat, ptrs, size), "bytes")
            ops = self._ops[key] = (copy_in, copy_out, params)
        return ops

    def _rs_op(self, unit: int, k: int) -> Callable[[Any], None]:
        key = ("rs", unit, k)
        op = self._ops.get(key)
        if op is None:
            op = self._ops[key] = pack.chunk_cat(self._cuda, self.flats[unit],
                                                 self.grads(unit, k), self._rs_flat[k])
        return op

    def _copy(self, segs: list, kind: str) -> Callable[[Any], None]:
        return pack.make_copy(self._cuda, segs, kind)

    def close(self) -> None:
        self._lanes.close()


class _HostLanes:
    """MPI collectives in program order, on a private duplicate of the group's comm."""

    def __init__(self, group: Group) -> None:
        self.comm = group.comm.Dup()

    def run(self, kind: str, fn: Callable[[Any], None], stream: Any, result: Any) -> Work:
        fn(None)
        return UnitComm.done(result)

    def all_gather(self, flat: np.ndarray, nbytes: int, each: int, stream: Any) -> None:
        from mpi4py import MPI

        self.comm.Allgather(MPI.IN_PLACE, [flat.view(np.uint8)[:nbytes], MPI.BYTE])

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, count: int, stream: Any) -> None:
        from mpi4py import MPI

        self.comm.Reduce_scatter_block(src, dst[:count], op=MPI.SUM)

    def close(self) -> None:
        self.comm.Free()


class _CudaLanes:
    """NCCL on two side streams, one communicator each (FSDP2's AG and RS streams).

    Each collective's side stream is forked from the compute stream and joined back by
    events (``UnitComm.on_side_stream``, [Note: comm streams] in ``tidearray.fsdp``).
    """

    def __init__(self, group: Group) -> None:
        import cupy

        from . import nccl

        ok, why = nccl.available()
        missing = [f"rank {r}: {w}" for r, w in enumerate(group.comm.allgather(
            None if ok else why)) if w]
        if missing:  # on every rank alike
            raise TideInvalid(f"comm=StockComm on cuda needs nccl4py: {'; '.join(missing)}")
        # NCCL refuses (one rank) or hangs (the others) on two ranks of a GPU: say so first.
        places = group.comm.allgather((socket.gethostname(), group.backend.device))
        pairs = [(places.index(p), b) for b, p in enumerate(places) if places.index(p) != b]
        if pairs:
            a, b = pairs[0]
            raise TideInvalid(f"comm=StockComm on cuda: expected one rank per GPU (NCCL's "
                              f"communicators refuse two), got ranks {a} and {b} on device "
                              f"{places[a][1]} of {places[a][0]}; use comm='tide' or LocalComm, "
                              "or one rank per GPU")
        self.nccl = nccl
        self.rank = group.comm.rank
        self.streams = {k: cupy.cuda.Stream(non_blocking=True) for k in ("ag", "rs")}
        self.comms = {k: nccl.communicator(group.comm) for k in ("ag", "rs")}

    def run(self, kind: str, fn: Callable[[Any], None], stream: Any, result: Any) -> Work:
        return UnitComm.on_side_stream(self.streams[kind], stream, fn, result)

    def all_gather(self, flat: Any, nbytes: int, each: int, stream: Any) -> None:
        base = int(flat.data.ptr)
        self.nccl.all_gather(self.comms["ag"], base + self.rank * each, base, each, "uint8",
                             stream.ptr)

    def reduce_scatter(self, src: Any, dst: Any, count: int, stream: Any) -> None:
        self.nccl.reduce_scatter(self.comms["rs"], int(src.data.ptr), int(dst.data.ptr),
                                 count, "float32", self.nccl.SUM, stream.ptr)

    def close(self) -> None:
        for c in self.comms.values():
            c.destroy()
