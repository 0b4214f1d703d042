"""FSDP2 itself as a collective baseline (only where torch with CUDA is importable).

``fsdp2``: a real ``fully_shard`` unit with the same parameter shapes over torch's NCCL
process group, in FSDP2's usual mixed precision (fp32 sharded parameters, bf16
``param_dtype``, fp32 ``reduce_dtype``; so its copy-in also casts fp32 to bf16):
all-gather = ``unshard()`` + ``reshard()``, FSDP2's whole path (copy-in, NCCL all-gather,
copy-out); reduce-scatter = the unit's ``post_backward`` with the gradients already in
place (untimed ``unshard`` before each): chunk-cat to fp32, NCCL reduce-scatter.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

from ..harness.data import UnitData
from ..harness.impl import Impl, Prepared, register


def init_process_group(comm: Any, backend: str, device: Any = None) -> None:
    """torch.distributed over the MPI communicator ``comm`` (collective): rank 0 takes a free
    port on its host and broadcasts the address of the TCP store to the others.

    Args:
        comm: mpi4py communicator; its ranks and size become the process group's.
        backend: ``"nccl"`` or ``"gloo"``.
        device: the CUDA device (``torch.device``) to bind NCCL's communicator to, or None.
    """
    import torch.distributed as dist

    addr = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = f"tcp://{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"
    dist.init_process_group(backend, init_method=comm.bcast(addr, root=0), rank=comm.rank,
                            world_size=comm.size, device_id=device)


def _torch_missing() -> Optional[str]:
    """Why torch with CUDA cannot run here, or None where it can."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA torch
        return f"torch not importable ({e.__class__.__name__})"
    return None if torch.cuda.is_available() else "torch has no CUDA here"


@register
class Fsdp2(Impl):
    """A real FSDP2 unit (torch.distributed.fsdp.fully_shard) on torch's NCCL process group."""

    name = "fsdp2"
    description = "torch fully_shard unit: unshard()+reshard(); post_backward reduce-scatter"
    backends = ("cuda",)

    def unavailable(self) -> Optional[str]:
        why = _torch_missing()
        if why:
            return why
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means unavailable
            return f"torch.distributed.fsdp.fully_shard not importable ({e})"
        return None

    def _stream(self) -> Any:
        import torch

        return torch.cuda.ExternalStream(self.ctx.dev.stream.ptr)

    def _tensor(self, a: Any) -> Any:
        import torch

        return torch.from_dlpack(a)  # zero-copy view of the CuPy array

    def open(self) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            init_process_group(self.ctx.comm, "nccl", torch.device("cuda", self.ctx.dev.dev.id))
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
