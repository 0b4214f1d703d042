"""The host backend: the same plans, executed by CPU processes under MPI.

It is a real engine, not a mock, and what CI runs:

* symmetric memory is an MPI shared-memory window (``Win.Allocate_shared``)
  over the node communicator; peers' parts are mapped once, at allocation;
* the "copy engine" is ``memmove`` between addresses;
* the "CTA" is NumPy: fp32 accumulation in a fixed source order;
* flags are int32 words in shared windows, written after a memory fence and
  polled, with a timeout instead of a hang;
* between nodes, MPI point-to-point, polled with the same timeout.

Lanes execute in program order, so every primitive is complete when it returns.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from .._copies import Copy, coalesce
from .._dtypes import bfloat16, float32, normalize
from .._errors import TideBackendError, TideInvalid
from .._wait import poll_until
from ._base import Backend, Completion, Done, Executor, Resolved, SymmetricBuffer, TupleBatch

if TYPE_CHECKING:
    from mpi4py import MPI

    from .._group import Group


def _bytes_at(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 array over ``nbytes`` at ``addr`` (memory owned elsewhere)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(addr), np.uint8)


def _array_at(addr: int, numel: int, dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    return _bytes_at(addr, numel * dtype.itemsize).view(dtype)


class HostSymmetricBuffer(SymmetricBuffer):
    def __init__(self, node_comm: MPI.Comm, nbytes: int, multicast: bool = False) -> None:
        from mpi4py import MPI

        self.nbytes = nbytes
        self.multicast = multicast
        # MPI may start a part only 16-byte aligned; over-allocate and start each
        # part at the next 4 KiB boundary, so slot offsets are truly aligned (and
        # DLPack consumers such as JAX import without copying). Mappings are
        # page-aligned, so every process computes the same offset for a part.
        size = -(-nbytes // 4096) * 4096 + 4096
        self._win = MPI.Win.Allocate_shared(size, 1, comm=node_comm)
        self._parts = []
        for p in range(node_comm.size):
            raw = np.frombuffer(self._win.Shared_query(p)[0], np.uint8)
            skip = -raw.ctypes.data % 4096
            self._parts.append(raw[skip:skip + size - 4096])
        self._local = self._parts[node_comm.rank]
        self._ptrs = [part.ctypes.data for part in self._parts]

    def ptr(self, local_rank: int) -> int:
        return self._ptrs[local_rank]

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = normalize(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self._local[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def free(self) -> None:
        if self._win is not None:
            self._parts = self._local = None
            self._win.Free()
            self._win = None


class HostExecutor(Executor):
    def __init__(self, backend: HostBackend) -> None:
        super().__init__(backend.group.local_size)
        self.backend = backend

    def _copy(self, lane: int, copies: Any, local: bool) -> None:
        for dst, src, n in copies if isinstance(copies, TupleBatch) else coalesce(copies):
            ctypes.memmove(dst, src, n)

    def _multicast_copy(self, lane: int, buffer: Any, copies: list) -> None:
        # Emulates one NVSwitch multicast write: the same bytes at the same
        # offset in every peer's copy; the source may be our own copy.
        for p in range(self.backend.group.local_size):
            base = buffer.ptr(p)
            for off, src, n in copies:
                if base + off != src:
                    ctypes.memmove(base + off, src, n)

    def _signal(self, lane: int, addr: int, value: int) -> None:
        self.backend.fence()  # data before flag
        ctypes.c_int32.from_address(addr).value = value

    def _wait(self, lane: int, addr: int, value: int) -> None:
        flag = ctypes.c_int32.from_address(addr)
        self._poll(lambda: flag.value >= value,
                   lambda: f"waiting for a peer's signal (flag {flag.value}, expected >= {value})")
        self.backend.fence()  # flag before data

    def _poll(self, done: Any, waiting: Any, spin: float = 0.0) -> None:
        """Return once ``done()``; after ``Config.timeout`` seconds raise, saying what was
        ``waiting()`` for, instead of hanging on a peer that never comes. For the first
        ``spin`` seconds ``done`` is called back to back, yielding the CPU in between (it
        may be what makes progress), then with pauses that double up to 1 ms."""
        timeout = self.backend.group.config.timeout
        if not poll_until(done, timeout, spin):
            msg = (f"rank {self.backend.group.rank}: timed out after {timeout:g} s "
                   f"{waiting()}; did every rank call the same collectives in the same order?")
            # Its flags are left mid-protocol: no later call may trust them.
            self.backend.broken = (f"an earlier collective failed ({msg}); this group "
                                   "can no longer be used")
            raise TideBackendError(msg)

    def _accumulate(self, lane: int, pieces: list, src_dtype: Any, scale: float,
                    out_dtype: Any) -> None:
        scale32 = np.float32(scale)
        for p in pieces:
            srcs = [_array_at(s, p.numel, src_dtype) for s in p.srcs]
            out = _array_at(p.out, p.numel, float32) if out_dtype == float32 else \
                np.empty(p.numel, float32)
            out[...] = srcs[0]
            for s in srcs[1:]:
                np.add(out, s.astype(float32), out=out)
            if scale32 != 1:
                np.multiply(out, scale32, out=out)
            if out_dtype != float32:  # rounds to nearest even, as the kernel does
                _array_at(p.out, p.numel, out_dtype)[...] = out

    def _zero(self, lane: int, addr: int, nbytes: int) -> None:
        ctypes.memset(addr, 0, nbytes)

    def _exchange(self, lane: int, sends: list, recvs: list) -> None:
        from mpi4py import MPI

        comm = self.backend.group.inter_comm
        reqs = [comm.Irecv(_bytes_at(a, n), source=peer, tag=7) for peer, a, n in recvs]
        reqs += [comm.Isend(_bytes_at(a, n), dest=peer, tag=7) for peer, a, n in sends]
        # Polled, not Waitall: a node that never posts its side must end in an error
        # on this rank within the timeout, as a flag wait does, not in a hang. Testall
        # is what moves MPI's messages along, so it spins first: with pauses from the
        # start, each step of a large message's handshake waited for one.
        try:
            self._poll(lambda: MPI.Request.Testall(reqs),
                       lambda: "in an inter-node exchange with nodes "
                               f"{sorted({p for p, _, _ in (*sends, *recvs)})}", spin=0.05)
        except TideBackendError:
            for r in reqs:
                try:
                    r.Cancel()
                except MPI.Exception:  # a send may be past cancelling: the job ends anyway
                    pass
            raise

    def _depend(self, lane: int, on: int) -> None:
        pass  # program order already

    def _mark(self, lane: int) -> None:
        return None

    def _after(self, lane: int, mark: Any) -> None:
        pass

    def finish(self) -> Completion:
        return Done()


class HostBackend(Backend):
    """NumPy arrays, MPI shared windows, memmove and NumPy accumulation."""

    name = "host"
    xp = np

    def __init__(self, group: Group) -> None:
        super().__init__(group)
        self._fence_win: Any = None
        self.broken: Optional[str] = None  # set by a timed-out wait

    def check(self) -> None:
        if self.broken is not None:
            raise TideBackendError(self.broken)

    def setup(self) -> None:
        from mpi4py import MPI

        # A window of our own, only for MPI_Win_sync as a memory fence.
        self._fence_win = MPI.Win.Allocate_shared(8, 1, comm=self.group.node_comm)
        # Win_sync is only legal inside an access epoch. MODE_NOCHECK: no peer locks this
        # window, so opening the epoch needs no message from peers (without it, MPICH can
        # wait here for peers that spin in a shared-memory loop and make no MPI progress).
        self._fence_win.Lock_all(MPI.MODE_NOCHECK)

    def close(self) -> None:
        if self._fence_win is not None:
            self._fence_win.Unlock_all()
            self._fence_win.Free()
            self._fence_win = None

    def fence(self) -> None:
        self._fence_win.Sync()

    def resolve(self, obj: Any) -> Resolved:
        if isinstance(obj, np.ndarray):
            arr = obj
        elif type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "detach"):
            arr = _torch_view(obj)
        elif hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
            try:
                arr = np.asarray(obj)
            except Exception as e:  # noqa: BLE001 - whatever the producer raises
                raise TideInvalid(f"expected an array NumPy can view, got "
                                  f"{type(obj).__name__} ({e})") from None
        elif hasattr(obj, "__dlpack__"):
            try:
                arr = np.from_dlpack(obj)
            except Exception as e:  # noqa: BLE001 - NumPy raises several types here
                raise TideInvalid(f"expected a CPU array NumPy can import by DLPack, "
                                  f"got {type(obj).__name__} ({e})") from None
        else:
            raise TideInvalid(f"expected an array, got {type(obj).__name__}")
        return Resolved(arr, arr.ctypes.data, arr.nbytes, tuple(arr.shape), arr.dtype,
                        bool(arr.flags.c_contiguous), bool(arr.flags.writeable))

    def array_key(self, objs: Any) -> Optional[tuple]:
        if type(objs) not in (list, tuple) or set(map(type, objs)) != {np.ndarray}:
            return None
        return tuple([(a.__array_interface__["data"][0], a.shape, a.dtype,
                       a.flags.c_contiguous) for a in objs])

    def compile_copies(self, copies: Sequence[Copy], local: bool = False,
                       split: bool = False) -> TupleBatch:
        # Plain host memory: neighbours may merge, once, here.
        return TupleBatch(tuple(coalesce(copies)))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.empty(shape, normalize(dtype))

    def alloc_symmetric(self, nbytes: int) -> HostSymmetricBuffer:
        return HostSymmetricBuffer(self.group.node_comm, nbytes)

    def multicast_capability(self) -> tuple[bool, str]:
        return True, "emulated: a multicast write is one memmove into each node-local peer"

    def _alloc_multicast(self, nbytes: int) -> HostSymmetricBuffer:
        return HostSymmetricBuffer(self.group.node_comm, nbytes, multicast=True)

    def wrap(self, buffer: Any) -> np.ndarray:
        return np.asarray(buffer)

    def asarray(self, obj: Any) -> np.ndarray:
        if not isinstance(obj, np.ndarray):
            if hasattr(obj, "get"):
                obj = obj.get()  # a CuPy array, copied down
            elif hasattr(obj, "cpu"):
                obj = obj.cpu()  # a torch tensor, copied down if on a device
        return np.asarray(obj)

    def executor(self, stream: Any = None) -> HostExecutor:
        self.check()  # a timed-out collective broke the group
        return HostExecutor(self)


def _torch_view(tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array, zero-copy: detached (a parameter's or a
    gradient's requires_grad says nothing of its memory), bfloat16 through its bits, which
    NumPy's DLPack cannot import."""
    if tensor.device.type != "cpu":
        raise TideInvalid(f"expected a CPU tensor on the host backend, got one on "
                          f"{tensor.device}")
    t = tensor.detach()
    try:
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return t.view(torch.int16).numpy().view(bfloat16)
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise TideInvalid(f"expected a tensor NumPy can view, got {t.dtype} ({e})") from None
