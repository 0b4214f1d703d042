"""Symmetric device memory over legacy CUDA IPC.

Every node-local rank ``cudaMalloc``s the same number of bytes, exports an
IPC handle (``cudaIpcGetMemHandle``), and the handles are exchanged with one
``allgather`` over the node communicator. Each rank then opens every peer's
handle once (``cudaIpcOpenMemHandle``), at allocation, never per step, since
an import costs milliseconds.

Legacy IPC is the fallback of ``Config.symmetric_memory="auto"`` (the
default prefers VMM, ``vmm``, which peers write faster) and the route
of ``"ipc"``, because it works where VMM's handle passing does not:

* a VMM handle is a file descriptor, which has to cross processes over a Unix
  domain socket with ``SCM_RIGHTS`` (or be fetched with ``pidfd_getfd``). In
  containers both are fragile: the socket needs a shared path or, for an
  abstract socket (what ``vmm`` uses), a shared network namespace,
  ``pidfd_getfd`` needs ``PTRACE_MODE_ATTACH`` rights, often denied, and each
  rank may sit in its own PID namespace;
* a legacy IPC handle is 64 opaque bytes that any transport carries, here the
  MPI communicator the group already has; the driver does the rest. It worked
  in the containers measured (H200 hosts).

Memory here comes from ``cudaMalloc`` directly, not CuPy's pool, because an
IPC handle maps a whole allocation from its base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..._dtypes import normalize
from ..._errors import TideBackendError, fail_together
from .._base import SymmetricBuffer

if TYPE_CHECKING:
    from mpi4py import MPI


def device_view(mem: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A CuPy array over the CuPy memory object ``mem`` at byte ``offset``.

    Raises:
        IndexError: the view would reach outside ``mem``.
    """
    import cupy

    dtype = normalize(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if offset < 0 or offset + count * dtype.itemsize > mem.size:
        raise IndexError(f"view of {count * dtype.itemsize} bytes at {offset} is outside "
                         f"a symmetric buffer of {mem.size} bytes")
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset))


class IpcSymmetricBuffer(SymmetricBuffer):
    """``nbytes`` of device memory on every node-local rank, each mapped by all.

    Collective over ``node_comm``: every rank must allocate (and free) together.
    """

    def __init__(self, node_comm: MPI.Comm, nbytes: int, device: int) -> None:
        import cupy

        rt = cupy.cuda.runtime
        self.nbytes = nbytes
        self.device = device
        self._node_comm = node_comm
        size = max(-(-nbytes // 4096) * 4096, 4096)
        self._local = rt.malloc(size)
        self._ptrs, self._opened = [], []
        try:
            with fail_together(node_comm, "cudaIpcGetMemHandle failed"):
                handle = rt.ipcGetMemHandle(self._local)
            handles = node_comm.allgather(handle)
            with fail_together(node_comm, "cudaIpcOpenMemHandle of a peer's memory failed"):
                from cuda.bindings import runtime as cudart

                lazy = int(cudart.cudaIpcMemLazyEnablePeerAccess)  # peer access on first use
                for r, h in enumerate(handles):
                    p = self._local if r == node_comm.rank else rt.ipcOpenMemHandle(h, lazy)
                    self._ptrs.append(p)
                    if p != self._local:
                        self._opened.append(p)
        except TideBackendError:
            self._close_peers()
            rt.free(self._local)
            raise
        self._mem = cupy.cuda.UnownedMemory(self._local, size, self, device)

    def ptr(self, local_rank: int) -> int:
        return self._ptrs[local_rank]

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A CuPy array over this rank's memory at byte ``offset`` (keeps this buffer alive)."""
        return device_view(self._mem, offset, shape, dtype)

    def _close_peers(self) -> None:
        import cupy

        for p in self._opened:
            cupy.cuda.runtime.ipcCloseMemHandle(p)
        self._opened = []

    def free(self) -> None:
        """Unmap peers, wait for every peer to unmap ours, then release it. Collective."""
        if self._local is None:
            return
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()  # no copy still touches a mapping
            self._close_peers()
            self._node_comm.Barrier()  # every peer has closed its mapping of our memory
            cupy.cuda.runtime.free(self._local)
        self._local, self._ptrs, self._mem = None, [], None
