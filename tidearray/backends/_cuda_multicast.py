"""NVSwitch multicast slots: VMM memory bound to a multicast object. Opt-in only.

A multicast slot is ordinary symmetric memory (every node-local rank's copy is
mapped by every peer, for flags and unicast pushes) whose physical pages are
also bound to one multicast object. A copy-engine write to the multicast
address lands in every rank's copy at the same offset, so all-gather writes
each shard once (``Executor.multicast_copy``).

This needs VMM (``cuMemCreate``), not legacy IPC: only VMM allocations can be
bound. VMM handles are file descriptors, passed between the node's processes
over abstract Unix sockets with ``SCM_RIGHTS`` (:func:`exchange_fds`).

Safety: nothing here runs unless :func:`tidearray.backends.cuda.multicast_capability`
allows it, which it never does while ``NCCL_NVLS_ENABLE=0`` is set (the
operator's statement that multicast must stay off), nor on a device without
``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``. On our test machines it is off,
so this module is exercised only through the host backend's emulation of the
same addressing, and :func:`exchange_fds` through CPU tests.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Sequence

import numpy as np

from .._dtypes import normalize
from .._errors import TideBackendError
from ._base import SymmetricBuffer


def exchange_fds(node_comm: Any, fds: Sequence[int]) -> list[list[int]]:
    """Send ``fds`` to every node-local peer; return every rank's fds (ours as given).

    Collective over ``node_comm``. Each rank listens on an abstract Unix socket
    (no file system path, so nothing to clean up), connects to each peer and
    sends its descriptors with ``SCM_RIGHTS``; the receiver gets duplicates
    valid in its own process.
    """
    tag = node_comm.bcast(uuid.uuid4().hex if node_comm.rank == 0 else None)
    me, size = node_comm.rank, node_comm.size
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0tidearray-{tag}-{me}")
        listener.listen(size)
        node_comm.Barrier()  # every listener is up
        for r in range(size):  # connections queue in the backlog: no accept needed to send
            if r != me:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(f"\0tidearray-{tag}-{r}")
                    socket.send_fds(s, [me.to_bytes(4, "little")], list(fds))
        got: list[list[int]] = [[] for _ in range(size)]
        got[me] = list(fds)
        for _ in range(size - 1):
            conn, _ = listener.accept()
            with conn:
                data, received, _, _ = socket.recv_fds(conn, 4, max(len(fds), 1))
                got[int.from_bytes(data, "little")] = list(received)
        node_comm.Barrier()
        return got
    finally:
        listener.close()


def _check(res: Any, what: str) -> Any:
    from cuda.bindings import driver as cu

    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise TideBackendError(f"{what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else res


class MulticastSymmetricBuffer(SymmetricBuffer):
    """Symmetric VMM memory whose pages are also bound to a multicast object.

    Collective over ``node_comm``. Attributes: ``mc_ptr``, this process's
    mapping of the multicast address.
    """

    multicast = True

    def __init__(self, node_comm: Any, nbytes: int, device: int) -> None:
        from cuda.bindings import driver as cu

        self.nbytes, self.device, self._comm = nbytes, device, node_comm
        fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        L, me = node_comm.size, node_comm.rank
        mc_prop = cu.CUmulticastObjectProp()
        mc_prop.numDevices, mc_prop.handleTypes, mc_prop.size = L, fd_type, max(nbytes, 1)
        gran = _check(cu.cuMulticastGetGranularity(
            mc_prop, cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED),
            "cuMulticastGetGranularity")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = fd_type
        gran = max(gran, _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self._gran = gran
        self._size = size = -(-max(nbytes, 1) // gran) * gran
        mc_prop.size = size
        self._mem = _check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        own = [_check(cu.cuMemExportToShareableHandle(self._mem, fd_type, 0),
                      "cuMemExportToShareableHandle")]
        if me == 0:
            self._mc = _check(cu.cuMulticastCreate(mc_prop), "cuMulticastCreate")
            own.append(_check(cu.cuMemExportToShareableHandle(self._mc, fd_type, 0),
                              "cuMemExportToShareableHandle(multicast)"))
        fds = exchange_fds(node_comm, own)
        if me != 0:
            self._mc = _check(cu.cuMemImportFromShareableHandle(fds[0][1], fd_type),
                              "cuMemImportFromShareableHandle(multicast)")
        dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
        _check(cu.cuMulticastAddDevice(self._mc, dev), "cuMulticastAddDevice")
        node_comm.Barrier()  # every device joined before any bind
        _check(cu.cuMulticastBindMem(self._mc, 0, self._mem, 0, size, 0), "cuMulticastBindMem")
        handles = [self._mem if r == me else _check(
            cu.cuMemImportFromShareableHandle(fds[r][0], fd_type),
            "cuMemImportFromShareableHandle") for r in range(L)]
        self._imported = [h for r, h in enumerate(handles) if r != me]
        self._ptrs = [self._map(h) for h in handles]
        self.mc_ptr = self._map(self._mc)
        for r, group in enumerate(fds):  # the handles hold the memory now
            for fd in group if r != me else group[:1] + group[2:]:
                os.close(fd)
        if me == 0:
            os.close(own[1])
        node_comm.Barrier()

    def _map(self, handle: Any) -> int:
        from cuda.bindings import driver as cu

        # Aligned to the granularity: multicast mappings require it.
        ptr = _check(cu.cuMemAddressReserve(self._size, self._gran, 0, 0), "cuMemAddressReserve")
        _check(cu.cuMemMap(ptr, self._size, 0, handle, 0), "cuMemMap")
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(ptr, self._size, [desc], 1), "cuMemSetAccess")
        return int(ptr)

    def ptr(self, local_rank: int) -> int:
        return self._ptrs[local_rank]

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        import cupy

        dtype = normalize(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + count * dtype.itemsize > self._size:
            raise IndexError(f"view of {count * dtype.itemsize} bytes at {offset} is outside "
                             f"a multicast buffer of {self._size} bytes")
        mem = cupy.cuda.UnownedMemory(self._ptrs[self._comm.rank], self._size, self,
                                      self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset))

    def free(self) -> None:
        """Unmap everything, unbind, release. Collective."""
        if self._ptrs is None:
            return
        import cupy
        from cuda.bindings import driver as cu

        cupy.cuda.runtime.deviceSynchronize()
        self._comm.Barrier()
        for ptr in [*self._ptrs, self.mc_ptr]:
            cu.cuMemUnmap(ptr, self._size)
            cu.cuMemAddressFree(ptr, self._size)
        dev = _check(cu.cuDeviceGet(self.device), "cuDeviceGet")
        cu.cuMulticastUnbind(self._mc, dev, 0, self._size)
        for h in [*self._imported, self._mem, self._mc]:
            cu.cuMemRelease(h)
        self._ptrs = None
        self._comm.Barrier()
