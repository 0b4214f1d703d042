"""Thin nccl4py helpers for the NCCL baselines: communicators, windows, raw calls.

Communicators are bootstrapped over MPI (rank 0 makes the unique id and
broadcasts it). Collectives are issued through nccl4py's low-level bindings
with raw pointers, so the baselines pay no per-call Python buffer resolution
(FSDP2 calls NCCL from C++).
"""

from __future__ import annotations

from typing import Any, Optional

#: ncclDataType_t / ncclRedOp_t values (nccl.h; stable across NCCL 2.x).
DTYPES = {"uint8": 1, "bfloat16": 9, "float16": 6, "float32": 7}
_ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
SUM, AVG = 0, 4


def available() -> tuple[bool, str]:
    try:
        import nccl.core as nc
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing libnccl
        return False, f"nccl4py not importable ({e.__class__.__name__}: {e})"
    try:
        return True, f"nccl4py {nc.__version__}, NCCL {version_string()}"
    except Exception as e:  # noqa: BLE001 - libnccl failed to load
        return False, f"NCCL library not usable ({e})"


def version() -> tuple[int, int, int]:
    """The loaded libnccl's version as (major, minor, patch).

    Raises:
        RuntimeError: libnccl could not be loaded.
    """
    from nccl.bindings import nccl as nb

    code = int(nb.get_version())  # X*10000 + Y*100 + Z since NCCL 2.9 (nccl4py needs newer)
    return code // 10000, code % 10000 // 100, code % 100


def library_path() -> str:
    from nccl.bindings import nccl as nb

    return str(nb.get_library_path() or "")


def version_string() -> str:
    return ".".join(str(x) for x in version())


def communicator(comm: Any, cta_policy: Optional[str] = None) -> Any:
    """A new NCCL communicator over the MPI communicator ``comm`` (collective).

    Args:
        comm: mpi4py communicator; one rank per GPU, the current CuPy device.
        cta_policy: None (NCCL's default) or ``"zero"`` (``NCCL_CTA_POLICY_ZERO``,
            NCCL >= 2.27: copy-engine collectives on symmetric windows).
    """
    import nccl.core as nc

    uid = nc.get_unique_id() if comm.rank == 0 else None
    uid = comm.bcast(uid, root=0)
    config = None
    if cta_policy == "zero":
        config = nc.NCCLConfig(cta_policy=nc.CTAPolicy.ZERO)
    return nc.Communicator.init(comm.size, comm.rank, uid, config)


def raw(nccl_comm: Any) -> Any:
    """The bindings-level communicator object that the raw calls take: a handle over the
    communicator's public pointer (it owns nothing)."""
    from nccl.bindings import nccl as nb

    return nb.Comm(nccl_comm.ptr)


def all_gather(nccl_comm: Any, send: int, recv: int, count: int, dtype: str,
               stream_ptr: int) -> None:
    """ncclAllGather of ``count`` elements per rank (in place when send = recv + rank*count)."""
    from nccl.bindings import nccl as nb

    nb.all_gather(send, recv, count, DTYPES[dtype], raw(nccl_comm), stream_ptr)


def reduce_scatter_avg(nccl_comm: Any, send: int, recv: int, count: int, dtype: str,
                       stream_ptr: int) -> None:
    """ncclReduceScatter with ncclAvg; ``count`` elements received per rank."""
    reduce_scatter(nccl_comm, send, recv, count, dtype, AVG, stream_ptr)


def reduce_scatter(nccl_comm: Any, send: int, recv: int, count: int, dtype: str, op: int,
                   stream_ptr: int) -> None:
    """ncclReduceScatter with ``op`` (:data:`SUM` or :data:`AVG`); ``count`` elements
    received per rank."""
    from nccl.bindings import nccl as nb

    nb.reduce_scatter(send, recv, count, DTYPES[dtype], op, raw(nccl_comm), stream_ptr)


def all_to_all(nccl_comm: Any, send: int, recv: int, count: int, dtype: str, size: int,
               stream_ptr: int) -> None:
    """All-to-all of ``count`` elements per peer (block ``p`` of ``send`` to rank ``p``,
    block ``p`` of ``recv`` from it), as grouped ``ncclSend``/``ncclRecv``."""
    import nccl.core as core
    from nccl.bindings import nccl as nb

    nbytes = count * _ITEMSIZE[dtype]
    core.group_start()
    try:
        for p in range(size):
            nb.recv(recv + p * nbytes, count, DTYPES[dtype], p, raw(nccl_comm), stream_ptr)
            nb.send(send + p * nbytes, count, DTYPES[dtype], p, raw(nccl_comm), stream_ptr)
    finally:
        core.group_end()


class NcclBuffer:
    """``nbytes`` of ``ncclMemAlloc`` memory as a CuPy uint8 array (for windows)."""

    def __init__(self, nbytes: int) -> None:
        import cupy
        import nccl.core as nc

        self.nbytes = nbytes
        self._buf = nc.mem_alloc(max(nbytes, 1))
        self.ptr = int(self._buf.handle)
        mem = cupy.cuda.UnownedMemory(self.ptr, max(nbytes, 1), self._buf)
        self.array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def free(self) -> None:
        if self._buf is not None:
            self.array = None
            self._buf.close()
            self._buf = None


def register_window(nccl_comm: Any, buf: NcclBuffer) -> Any:
    """Collective ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC.

    Raises:
        RuntimeError: NCCL returned a null window (symmetric windows unsupported here).
    """
    import nccl.core as nc

    handle = nccl_comm.register_window(buf.array, nc.WindowFlag.COLL_SYMMETRIC)
    if not handle.handle:
        handle.close()
        raise RuntimeError("ncclCommWindowRegister returned a null window: symmetric "
                           "windows are not supported on this platform/NCCL")
    return handle
