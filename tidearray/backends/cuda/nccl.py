"""NCCL through nccl4py: the inter-node exchanges (grouped send/recv).

The communicator spans ``group.inter_comm`` (one rank per node with the same
local rank), so NCCL ranks are node indices. It is bootstrapped over MPI as in
nccl4py's ``examples/01_basic``: rank 0 makes the unique id, MPI broadcasts
it, every rank calls ``Communicator.init``.

Operations are issued through nccl4py's thin bindings (``nccl.bindings.nccl``)
with integer addresses: the collectives hand the backend raw addresses, and
wrapping each one as an array for the high-level API would add a resolution
per call for nothing.

Feature detection: works on NCCL 2.28; where the loaded libnccl is 2.29 or
newer and nccl4py exposes ``put_signal``, that is recorded as a capability
(one-sided puts into registered windows). The exchange itself uses grouped
``send``/``recv``, which every version has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..._errors import TideBackendError, fail_together

if TYPE_CHECKING:
    from mpi4py import MPI

#: First libnccl release with ncclPutSignal / ncclWaitSignal.
PUT_SIGNAL_VERSION = (2, 29)


def versions() -> dict[str, Optional[str]]:
    """nccl4py and libnccl versions (None where not importable or not loadable)."""
    out: dict[str, Optional[str]] = {"nccl4py": None, "libnccl": None}
    try:
        import nccl.core as nccl
    except Exception:  # noqa: BLE001 - not installed, or its CUDA deps missing: report, don't fail
        return out
    try:
        v = nccl.get_version()
        out["nccl4py"] = str(v.nccl4py)
        out["libnccl"] = None if v.libnccl is None else str(v.libnccl.version)
    except Exception as e:  # noqa: BLE001 - libnccl not loadable
        out["libnccl"] = f"unavailable ({e})"
    return out


def put_signal_capability() -> tuple[bool, str]:
    """Whether NCCL one-sided put/signal is available here, and why (not)."""
    v = versions()
    if v["nccl4py"] is None:
        return False, "nccl4py not importable"
    lib = v["libnccl"]
    try:
        major, minor = (int(x) for x in str(lib).split(".")[:2])
    except ValueError:
        return False, f"libnccl version unknown ({lib})"
    import nccl.core as nccl

    if (major, minor) < PUT_SIGNAL_VERSION:
        return False, f"libnccl {lib} < 2.29; grouped send/recv used"
    if not hasattr(nccl.Communicator, "put_signal"):
        return False, f"nccl4py {v['nccl4py']} lacks Communicator.put_signal"
    return True, f"libnccl {lib}: available (exchange still uses grouped send/recv)"


class NcclLink:
    """One NCCL communicator over the inter-node communicator."""

    def __init__(self) -> None:
        self.comm: MPI.Comm = None
        self._raw: Any = None
        self._nb: Any = None
        self._nccl: Any = None

    def setup(self, inter_comm: MPI.Comm) -> None:
        """Collective over ``inter_comm``; the current CUDA device must be set."""
        uid = None
        with fail_together(inter_comm, "NCCL bootstrap failed"):  # before anyone waits in init
            import nccl.core as nccl
            from nccl.bindings import nccl as nb

            self._nccl, self._nb = nccl, nb
            if inter_comm.rank == 0:
                uid = nccl.get_unique_id()
        uid = inter_comm.bcast(uid, root=0)
        try:
            self.comm = self._nccl.Communicator.init(inter_comm.size, inter_comm.rank, uid)
        except Exception as e:
            raise TideBackendError(f"ncclCommInitRank failed on inter-node rank "
                                   f"{inter_comm.rank}: {e}") from e
        # The binding handle the thin calls take, over the communicator's public pointer
        # (a handle owns nothing: ``Communicator.destroy`` still ends the communicator).
        self._raw = self._nb.Comm(self.comm.ptr)
        self._connect(inter_comm.size, inter_comm.rank)

    def _connect(self, size: int, rank: int) -> None:
        """Make every connection the collectives can use, now, while every rank is here.

        NCCL connects peers on first use, and that first use blocks the host in
        ``ncclGroupEnd`` until the peer joins: a call to a dead peer would then hang
        on the host, where the watchdog ([Note: watchdog]) cannot release it. After
        this, calls only enqueue, and the watchdog's ``ncclCommAbort`` ends their
        kernels. One 4-byte send and receive with every peer.
        """
        import cupy

        buf = cupy.zeros(2 * size, cupy.float32)
        base, stream = buf.data.ptr, cupy.cuda.Stream(non_blocking=True)
        peers = [p for p in range(size) if p != rank]
        self.exchange(stream.ptr, [(p, base + 4 * p, 4) for p in peers],
                      [(p, base + 4 * (size + p), 4) for p in peers])
        stream.synchronize()

    def exchange(self, stream: int, sends: list, recvs: list) -> None:
        """Grouped byte ``send``/``recv`` of ``(peer, addr, nbytes)`` on ``stream``."""
        nb, u8 = self._nb, int(self._nccl.UINT8)
        self._nccl.group_start()
        try:
            for peer, addr, n in recvs:
                nb.recv(addr, n, u8, peer, self._raw, stream)
            for peer, addr, n in sends:
                nb.send(addr, n, u8, peer, self._raw, stream)
        finally:
            self._nccl.group_end()

    def abort(self) -> None:
        """``ncclCommAbort``: ends this rank's NCCL kernels that wait for a dead peer.

        Called by the watchdog's thread ([Note: watchdog]); the group is broken
        afterwards, so nothing issues on the communicator again.
        """
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = self._raw = None
