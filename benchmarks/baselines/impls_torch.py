"""PyTorch cross-checks of the stock path (only where torch with CUDA is importable).

* ``stock-torch``: FSDP2's own copy ops on the same unit, timed alone, next to
  our fused kernels: ``torch.ops.fsdp.all_gather_copy_in`` (else the
  ``torch._foreach_copy_`` it wraps), ``torch.split_with_sizes_copy`` into padded
  parameter storage, and ``torch._chunk_cat`` of bf16 gradients into fp32.
* ``fsdp2``: a real ``fully_shard`` unit with the same parameter shapes over
  torch's NCCL process group, in FSDP2's usual mixed precision (fp32 sharded
  parameters, bf16 ``param_dtype``, fp32 ``reduce_dtype``; so its copy-in also
  casts fp32 to bf16): all-gather =
  ``unshard()`` + ``reshard()``; reduce-scatter = the unit's ``post_backward``
  with the gradients already in place (untimed ``unshard`` before each).
"""

from __future__ import annotations

import socket
from typing import Any, Optional

from ..harness.data import UnitData
from ..harness.impl import Impl, Phase, Prepared, register


def _torch() -> tuple[Any, str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA torch
        return None, f"torch not importable ({e.__class__.__name__})"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA here"
    return torch, ""


class _TorchImpl(Impl):
    backends = ("cuda",)

    def unavailable(self) -> Optional[str]:
        torch, why = _torch()
        return why or None

    def _stream(self) -> Any:
        import torch

        return torch.cuda.ExternalStream(self.ctx.dev.stream.ptr)

    def _tensor(self, a: Any) -> Any:
        import torch

        return torch.from_dlpack(a)  # zero-copy view of the CuPy array


@register
class TorchStock(_TorchImpl):
    """FSDP2's copy-in, copy-out and chunk-cat ops, timed on the same unit."""

    name = "stock-torch"
    description = "FSDP2's own copy ops (all_gather_copy_in, split_with_sizes_copy, _chunk_cat)"
    ops = ()

    def setup(self, data: UnitData) -> Prepared:
        import torch

        try:
            import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp.*)
        except Exception:  # noqa: BLE001 - then the plain torch ops below are timed
            pass
        W, me = data.world, data.rank
        dev = torch.device("cuda", self.ctx.dev.dev.id)
        shards = [self._tensor(a).reshape(-1) for a in data.shards]
        grads = [self._tensor(g) for g in data.grads]
        sizes = [s.shard_numel for s in data.specs]
        numel = sum(sizes)
        ag_out = torch.empty(numel * W, dtype=torch.bfloat16, device=dev)
        padded = [torch.empty(W * n, dtype=torch.bfloat16, device=dev) for n in sizes]
        outs = [p.view(W, -1) for p in padded]
        rs_in = torch.empty(numel * W, dtype=torch.float32, device=dev)
        stream = self._stream()
        copy_in_op = self._copy_in_op()

        def copy_in() -> None:
            with torch.cuda.stream(stream):
                copy_in_op(shards, ag_out, sizes, numel, me)

        def copy_out() -> None:
            with torch.cuda.stream(stream):
                torch.split_with_sizes_copy(ag_out.view(W, -1), sizes, dim=1, out=outs)

        def chunk_cat() -> None:
            with torch.cuda.stream(stream):
                torch._chunk_cat(grads, dim=0, num_chunks=W, out=rs_in.view(W, -1))

        def release() -> None:
            del padded[:], outs[:]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        phases = {"ag.copy_in": Phase(copy_in, "kernel", None, copy_in_op.__doc__ or ""),
                  "ag.copy_out": Phase(copy_out, "kernel", None, "torch.split_with_sizes_copy"),
                  "rs.pack": Phase(chunk_cat, "kernel", None, "torch._chunk_cat (bf16 -> fp32)")}
        nbytes = ag_out.nbytes + sum(p.nbytes for p in padded) + rs_in.nbytes
        return Prepared(phases=phases, accounted_nbytes=nbytes, release=release)

    @staticmethod
    def _copy_in_op() -> Any:
        import torch

        op = getattr(getattr(torch.ops, "fsdp", None), "all_gather_copy_in", None)

        def fsdp_op(inputs: list, out: Any, sizes: list, numel: int, rank: int) -> None:
            """torch.ops.fsdp.all_gather_copy_in"""
            op(inputs, out, sizes, numel, rank)

        def foreach(inputs: list, out: Any, sizes: list, numel: int, rank: int) -> None:
            """torch._foreach_copy_ (what all_gather_copy_in does)"""
            dsts = torch.split(out.narrow(0, numel * rank, numel), sizes)
            torch._foreach_copy_(dsts, inputs)

        if op is None:
            return foreach
        try:  # the 5-argument form (torch >= 2.6); older forms allocate their own output
            t = torch.zeros(4, device="cuda", dtype=torch.bfloat16)
            op([t[:1]], t, [1], 1, 0)
            return fsdp_op
        except Exception:  # noqa: BLE001 - another signature: time what the op wraps
            return foreach


@register
class Fsdp2(_TorchImpl):
    """A real FSDP2 unit (torch.distributed.fsdp.fully_shard) on torch's NCCL process group."""

    name = "fsdp2"
    description = "torch fully_shard unit: unshard()+reshard(); post_backward reduce-scatter"

    def unavailable(self) -> Optional[str]:
        why = super().unavailable()
        if why:
            return why
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means unavailable
            return f"torch.distributed.fsdp.fully_shard not importable ({e})"
        return None

    def open(self) -> None:
        import torch
        import torch.distributed as dist

        comm = self.ctx.comm
        if not dist.is_initialized():
            addr = None
            if comm.rank == 0:
                with socket.socket() as s:
                    s.bind(("", 0))
                    addr = f"tcp://{socket.gethostbyname(socket.gethostname())}:" \
                           f"{s.getsockname()[1]}"
            addr = comm.bcast(addr, root=0)
            dist.init_process_group("nccl", init_method=addr, rank=comm.rank,
                                    world_size=comm.size,
                                    device_id=torch.device("cuda", self.ctx.dev.dev.id))
            self._owns_pg = True

    def close(self) -> None:
        import torch.distributed as dist

        if getattr(self, "_owns_pg", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False

    def setup(self, data: UnitData) -> Prepared:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dev = torch.device("cuda", self.ctx.dev.dev.id)
        module = torch.nn.Module()
        module.params = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s.shape, dtype=torch.float32, device=dev))
             for s in data.specs])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(module, mp_policy=policy, reshard_after_forward=True)
        grads = [self._tensor(g) for g in data.grads]
        stream = self._stream()
        state = module._get_fsdp_state()
        state._lazy_init()  # what the root's first forward does: streams, comm state
        group = state._fsdp_param_group

        def ag() -> None:
            with torch.cuda.stream(stream):
                module.unshard()
                module.reshard()

        def before_rs() -> None:
            with torch.cuda.stream(stream):
                module.unshard()
                for fp in group.fsdp_params:  # no accumulation into the last iteration's
                    fp.sharded_param.grad = None  # grads (run 2 showed 23x: 3 warm-up + 20)
                    fp.unsharded_param.grad = None
                for fp, g in zip(group.fsdp_params, grads):
                    fp.unsharded_param.grad = g
            torch.cuda.synchronize()

        def rs() -> None:
            with torch.cuda.stream(stream):
                group.post_backward()
                stream.wait_stream(group.comm_ctx.reduce_scatter_stream)

        def rs_out() -> list:  # unpadded fp32 shards, as CuPy arrays for the check
            import cupy

            return [cupy.from_dlpack(p.grad.to_local().float().contiguous())
                    for p in module.params]

        def release() -> None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        return Prepared(ag, rs, None, rs_out, release=release, pre={"rs": before_rs},
                        accounted_nbytes=None)
