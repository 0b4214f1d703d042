"""NVSwitch multicast slots: VMM memory bound to a multicast object. Opt-in only.

A multicast slot is ordinary symmetric VMM memory (``vmm``: every
node-local rank's copy is mapped by every peer, for flags and unicast pushes)
whose physical pages are also bound to one multicast object. A copy-engine
write to the multicast address lands in every rank's copy at the same offset,
so all-gather writes each shard once (``Executor.multicast_copy``).

Safety: nothing here runs unless :func:`tidearray.backends.cuda.multicast_capability`
allows it, which it never does while ``NCCL_NVLS_ENABLE=0`` is set (the
operator's statement that multicast must stay off), nor on a device without
``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``. On our test machines it is off,
so this module is exercised only through the host backend's emulation of the
same addressing; the VMM memory and descriptor exchange under it
(``vmm``) run on every VMM allocation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._errors import fail_together
from .vmm import FD_HANDLE, VmmSymmetricBuffer, check, go_on

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MulticastSymmetricBuffer"]


class MulticastSymmetricBuffer(VmmSymmetricBuffer):
    """Symmetric VMM memory whose pages are also bound to a multicast object.

    Collective over ``node_comm``. Attributes: ``mc_ptr``, this process's
    mapping of the multicast address.
    """

    multicast = True

    def __init__(self, node_comm: MPI.Comm, nbytes: int, device: int) -> None:
        from cuda.bindings import driver as cu

        self._mc_prop = prop = cu.CUmulticastObjectProp()
        prop.numDevices, prop.size = node_comm.size, max(nbytes, 1)
        prop.handleTypes = getattr(cu.CUmemAllocationHandleType, FD_HANDLE)
        gran = check(cu.cuMulticastGetGranularity(
            prop, cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED),
            "cuMulticastGetGranularity")
        self._mc_rank0 = node_comm.rank == 0
        super().__init__(node_comm, nbytes, device, gran=int(gran))
        # Aligned to the granularity: multicast mappings require it.
        self.mc_ptr = self._map(self._mc)

    def _extra_fds(self) -> list[int]:
        from cuda.bindings import driver as cu

        if not self._mc_rank0:
            return []
        self._mc_prop.size = self._size
        self._mc = check(cu.cuMulticastCreate(self._mc_prop), "cuMulticastCreate")
        return [check(cu.cuMemExportToShareableHandle(
            self._mc, self._mc_prop.handleTypes, 0), "cuMemExportToShareableHandle(multicast)")]

    def _bind(self, fds: list[list[int]]) -> None:
        from cuda.bindings import driver as cu

        with fail_together(self._comm, "multicast join failed"):  # all joined before any bind
            if not self._mc_rank0:
                self._mc = check(cu.cuMemImportFromShareableHandle(
                    fds[0][1], self._mc_prop.handleTypes), "cuMemImportFromShareableHandle")
            dev = check(cu.cuDeviceGet(self.device), "cuDeviceGet")
            check(cu.cuMulticastAddDevice(self._mc, dev), "cuMulticastAddDevice")
        check(cu.cuMulticastBindMem(self._mc, 0, self._mem, 0, self._size, 0),
              "cuMulticastBindMem")

    def _unmap(self, errors: list[str]) -> list:
        from cuda.bindings import driver as cu

        go_on(errors, cu.cuMemUnmap(self.mc_ptr, self._size), "cuMemUnmap(multicast)")
        go_on(errors, cu.cuMemAddressFree(self.mc_ptr, self._size), "cuMemAddressFree(multicast)")
        err, dev = cu.cuDeviceGet(self.device)
        go_on(errors, err, "cuDeviceGet")
        go_on(errors, cu.cuMulticastUnbind(self._mc, dev, 0, self._size), "cuMulticastUnbind")
        return [*super()._unmap(errors), self._mc]
