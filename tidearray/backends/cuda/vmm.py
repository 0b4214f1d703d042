"""Symmetric device memory over VMM: ``cuMemCreate``, descriptors over Unix sockets.

Each node-local rank creates the same number of bytes with ``cuMemCreate``,
exports a POSIX file descriptor, and hands it to every peer over an abstract
Unix socket (:func:`exchange_fds`); each rank then imports and maps every
peer's memory once, at allocation. Used for multicast slots, which only VMM
memory can be bound to (``multicast``), and for ordinary symmetric
memory by default (``Config.symmetric_memory``): peers write VMM memory at the
link's rate, and legacy-IPC memory markedly slower (development record run5's
quick bench, in git history).
See ``memory`` for where legacy IPC is still needed.
"""

from __future__ import annotations

import os
import socket
import struct
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from ..._errors import TideBackendError, agree, fail_together
from .._base import SymmetricBuffer
from .memory import device_view

if TYPE_CHECKING:
    from mpi4py import MPI


def exchange_fds(node_comm: MPI.Comm, fds: Sequence[int], timeout: float = 30.0) -> list[list[int]]:
    """Send ``fds`` to every node-local peer; return every rank's fds (ours as given).

    Collective over ``node_comm``. Each rank listens on an abstract Unix socket
    (no file system path, so nothing to clean up), connects to each peer and
    sends its descriptors with ``SCM_RIGHTS``; the receiver gets duplicates
    valid in its own process.

    [Note: peer credentials]
    An abstract socket's name is listed in ``/proc/net/unix``, so any local
    process can connect. Before reading a connection, the receiver checks its
    ``SO_PEERCRED``: the same user, and the process id of the node-local rank
    the connection claims to be, once. Anything else is refused unread (its
    descriptors are dropped with the connection) and reported with a warning;
    the exchange goes on with the real peers.

    Raises:
        TideBackendError: on every rank, if any rank could not send or receive
            (abstract sockets are per network namespace: containers that do not
            share one cannot pass descriptors). No rank waits longer than
            ``timeout`` seconds for a peer that never connects.
    """
    tag = node_comm.bcast(uuid.uuid4().hex if node_comm.rank == 0 else None)
    pids = node_comm.allgather(os.getpid())
    me, size = node_comm.rank, node_comm.size
    got: list[list[int]] = [[] for _ in range(size)]
    got[me] = list(fds)
    err = None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0tidearray-{tag}-{me}")
        listener.listen(size)
    except OSError as e:
        err = f"listen: {e}"
    node_comm.Barrier()  # every listener is up (or has failed)
    try:
        for r in range(size):  # connections queue in the backlog: no accept needed to send
            if r != me and err is None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(timeout)
                    s.connect(f"\0tidearray-{tag}-{r}")
                    socket.send_fds(s, [me.to_bytes(4, "little")], list(fds))
        listener.settimeout(timeout)
        _receive(listener, got, pids, me, len(fds), 0 if err is not None else size - 1)
    except OSError as e:  # refused, timed out, no such socket
        err = f"{type(e).__name__}: {e}"
    finally:
        listener.close()
    try:
        agree(node_comm, err, "passing VMM file descriptors over Unix sockets failed")
    except TideBackendError:
        for r, group in enumerate(got):
            for fd in group if r != me else ():
                os.close(fd)
        raise
    return got


def _peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end (``SO_PEERCRED``)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    return pid, uid


def _receive(listener: socket.socket, got: list, pids: list, me: int, count: int,
             expected: int) -> None:
    """Accept until ``expected`` peers have sent; refuse anyone else ([Note: peer credentials])."""
    arrived: set = set()
    while len(arrived) < expected:
        conn, _ = listener.accept()
        with conn:
            pid, uid = _peer(conn)
            rank = pids.index(pid) if pid in pids else None
            if uid != os.getuid() or rank is None or rank == me or rank in arrived:
                warnings.warn(f"tidearray: refused a descriptor connection from pid {pid} "
                              f"(uid {uid}): not a node-local peer that has yet to send",
                              RuntimeWarning, stacklevel=3)
                continue  # closed unread: any descriptors it sent are dropped with it
            data, received, _, _ = socket.recv_fds(conn, 4, max(count, 1))
            if int.from_bytes(data, "little") != rank:
                for fd in received:
                    os.close(fd)
                raise OSError(f"pid {pid} is rank {rank} but claimed rank "
                              f"{int.from_bytes(data, 'little')}")
            got[rank] = list(received)
            arrived.add(rank)


def check(res: Any, what: str) -> Any:
    """The value of a cuda-bindings driver call, or TideBackendError naming ``what``."""
    from cuda.bindings import driver as cu

    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise TideBackendError(f"{what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else res


def go_on(errors: list[str], res: Any, what: str) -> None:
    """Check a driver call made while freeing: a failure goes into ``errors`` and the
    caller goes on, since a free that stops half-way leaks everything after it."""
    from cuda.bindings import driver as cu

    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        errors.append(f"{what}: {err}")


FD_HANDLE = "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"


def alloc_prop(device: int) -> Any:
    """Pinned device memory on ``device``, exportable as a file descriptor."""
    from cuda.bindings import driver as cu

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = getattr(cu.CUmemAllocationHandleType, FD_HANDLE)
    return prop


def granularity(prop: Any) -> int:
    from cuda.bindings import driver as cu

    return int(check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"))


def access(device: int) -> Any:
    """Read-write access for ``device``, as ``cuMemSetAccess`` takes it."""
    from cuda.bindings import driver as cu

    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def peer_devices(device: int) -> list[int]:
    """Every other visible device with peer access to ``device``.

    Mappings are made accessible to these too: a process in which another
    library (JAX, by default) has enabled peer access between its devices may
    have a copy into a peer's memory carried out through another device's
    context, which faults on a mapping only ``device`` may access. XLA's own
    VMM allocator grants every peer for the same reason.
    """
    import cupy

    rt = cupy.cuda.runtime
    return [d for d in range(rt.getDeviceCount())
            if d != device and rt.deviceCanAccessPeer(device, d)]


class VmmSymmetricBuffer(SymmetricBuffer):
    """``nbytes`` of VMM memory on every node-local rank, each mapped by all.

    Collective over ``node_comm``. Subclasses add handles to the exchange
    (``_extra_fds``) and use them before the peers' memory is mapped
    (``_bind``).
    """

    def __init__(self, node_comm: MPI.Comm, nbytes: int, device: int, gran: int = 0) -> None:
        self.nbytes, self.device, self._comm = nbytes, device, node_comm
        self._ptrs: Any = None
        own: list[int] = []
        try:  # local steps first, then agree: no rank enters the exchange alone
            with fail_together(node_comm, "VMM allocation failed"):
                from cuda.bindings import driver as cu

                fd_type = getattr(cu.CUmemAllocationHandleType, FD_HANDLE)
                prop = alloc_prop(device)
                self._gran = gran = max(gran, granularity(prop))
                self._size = size = -(-max(nbytes, 1) // gran) * gran
                self._mem = check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
                own.append(check(cu.cuMemExportToShareableHandle(self._mem, fd_type, 0),
                                 "cuMemExportToShareableHandle"))
                own += self._extra_fds()
            fds = exchange_fds(node_comm, own)
        except TideBackendError:
            for fd in own:
                os.close(fd)
            raise
        me = node_comm.rank
        try:
            with fail_together(node_comm, "VMM import and mapping failed"):
                self._bind(fds)
                handles = [self._mem if r == me else check(
                    cu.cuMemImportFromShareableHandle(fds[r][0], fd_type),
                    "cuMemImportFromShareableHandle") for r in range(node_comm.size)]
                self._imported = [h for r, h in enumerate(handles) if r != me]
                self._ptrs = [self._map(h) for h in handles]
        finally:
            for fd in (fd for group in fds for fd in group):  # the handles hold the memory
                os.close(fd)

    def _extra_fds(self) -> list[int]:
        return []

    def _bind(self, fds: list[list[int]]) -> None:
        pass

    def _map(self, handle: Any) -> int:
        from cuda.bindings import driver as cu

        ptr = check(cu.cuMemAddressReserve(self._size, self._gran, 0, 0), "cuMemAddressReserve")
        check(cu.cuMemMap(ptr, self._size, 0, handle, 0), "cuMemMap")
        check(cu.cuMemSetAccess(ptr, self._size, [access(self.device)], 1), "cuMemSetAccess")
        for dev in peer_devices(self.device):
            # Optional: a device without a path to this memory's owner refuses.
            cu.cuMemSetAccess(ptr, self._size, [access(dev)], 1)
        return int(ptr)

    def ptr(self, local_rank: int) -> int:
        return self._ptrs[local_rank]

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A CuPy array over this rank's memory at byte ``offset`` (keeps this buffer alive)."""
        import cupy

        mem = cupy.cuda.UnownedMemory(self._ptrs[self._comm.rank], self._size, self,
                                      self.device)
        return device_view(mem, offset, shape, dtype)

    def _unmap(self, errors: list[str]) -> list:
        """Unmap every mapping (failures into ``errors``); the handles still to release."""
        from cuda.bindings import driver as cu

        for ptr in self._ptrs:
            go_on(errors, cu.cuMemUnmap(ptr, self._size), "cuMemUnmap")
            go_on(errors, cu.cuMemAddressFree(ptr, self._size), "cuMemAddressFree")
        return [*self._imported, self._mem]

    def free(self) -> None:
        """Unmap everything and release. Collective: a failed driver call raises
        TideBackendError on every rank, after everything else was released."""
        if self._ptrs is None:
            return
        import cupy
        from cuda.bindings import driver as cu

        cupy.cuda.runtime.deviceSynchronize()
        self._comm.Barrier()
        errors: list[str] = []
        for h in self._unmap(errors):
            go_on(errors, cu.cuMemRelease(h), "cuMemRelease")
        self._ptrs = None
        agree(self._comm, "; ".join(errors) or None, "freeing symmetric memory failed")
