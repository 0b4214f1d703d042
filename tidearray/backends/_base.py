"""The backend interface: the few primitives every collective is written against.

A backend supplies memory (plain and symmetric), array resolution, and an
``Executor`` that issues one collective's primitives onto *lanes*. A lane is an
in-order queue: a CUDA stream on the cuda backend, program order on the host
backend. Lanes ``0..L-1`` push to node-local peer ``0..L-1``; ``COMPUTE`` runs
accumulation; ``NET`` runs inter-node traffic.

Public methods here are checked; backends implement the ``_`` hooks.
"""

from __future__ import annotations

import abc
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

from .. import _dtypes
from .._cache import CallCache
from .._dtypes import float32
from .._errors import TideBackendError, TideInvalid, agree
from .._layout import Copy

if TYPE_CHECKING:
    from .._group import Group


@dataclass(frozen=True)
class AccumPiece:
    """``out[:numel] = scale * sum(src[:numel] for src in srcs)`` in fp32, srcs in order."""

    out: int
    srcs: tuple[int, ...]
    numel: int


class SymmetricBuffer(abc.ABC):
    """``nbytes`` on every node-local rank, mapped once by every node-local peer."""

    nbytes: int
    #: True when one write to :meth:`Executor.multicast_copy` reaches every peer's copy.
    multicast: bool = False

    @abc.abstractmethod
    def ptr(self, local_rank: int) -> int:
        """Address of ``local_rank``'s copy, valid in this process."""

    @abc.abstractmethod
    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """An array over this rank's copy, at byte ``offset``."""

    @abc.abstractmethod
    def free(self) -> None:
        """Unmap peers and release local memory (collective over the node)."""


class Completion(abc.ABC):
    """The end of one collective's device work."""

    @abc.abstractmethod
    def wait(self, stream: Any = None) -> None:
        """Order ``stream`` (the current one if None) after the collective."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the device work has finished."""


class Executor(abc.ABC):
    """Issues one collective's primitives; built by :meth:`Backend.executor`."""

    def __init__(self, local_size: int) -> None:
        self.COMPUTE = local_size
        self.NET = local_size + 1

    def copy(self, lane: int, copies: Sequence[Copy], local: bool = False) -> None:
        """A batch of ``(dst, src, nbytes)`` address triples, any peer.

        Copies are passed on as given, the same object each call for a cached
        program (device backends keep per-batch state by its identity): two
        arrays can be adjacent without being one allocation, and a device copy
        must not span allocations, so merging neighbours is left to backends
        where it is safe (host memory). Zero-byte copies are allowed.
        ``local`` says every copy is within this rank's device, which a device
        backend may issue differently (the cuda backend's driver runs those on
        the SMs: [Note: same-device copies]).
        """
        if copies:
            self._copy(lane, copies, local)

    def multicast_copy(self, lane: int, buffer: SymmetricBuffer,
                       copies: Sequence[tuple[int, int, int]]) -> None:
        """Write ``(offset, src, nbytes)`` once into every node-local copy of ``buffer``.

        ``buffer`` must have been allocated with ``multicast=True`` (NVSwitch
        multicast on cuda, emulated by the host backend).
        """
        if not buffer.multicast:
            raise TideBackendError("multicast_copy: expected a buffer allocated with "
                                   "multicast=True, got a unicast one")
        if not all(c[2] for c in copies):  # keeps a cached program's tuple as it is
            copies = tuple(c for c in copies if c[2])
        if copies:
            self._multicast_copy(lane, buffer, copies)

    def _multicast_copy(self, lane: int, buffer: SymmetricBuffer, copies: list) -> None:
        raise TideBackendError(f"{type(self).__name__}: multicast is not available")

    def signal(self, lane: int, addr: int, value: int) -> None:
        """Write ``value`` to a (usually peer-mapped) int32 flag after ``lane``'s prior work."""
        self._signal(lane, addr, value)

    def wait(self, lane: int, addr: int, value: int) -> None:
        """Hold ``lane`` until the local int32 flag at ``addr`` is >= ``value``."""
        self._wait(lane, addr, value)

    def accumulate(self, lane: int, pieces: Sequence[AccumPiece], src_dtype: Any,
                   scale: float, out_dtype: Any = float32) -> None:
        """``out = scale * sum(srcs)`` per piece, in fp32, sources summed in the given order.

        ``out_dtype`` bf16 or fp16 (fp32 sources only) rounds the fp32 result to
        nearest even: one fp32 source with scale 1 is a cast.
        """
        if out_dtype is not float32:  # checked for casts only: the default runs per chunk
            out_dtype = _dtypes.normalize(out_dtype)
            if out_dtype != float32 and _dtypes.normalize(src_dtype) != float32:
                raise TideBackendError(f"accumulate: a {out_dtype} output takes float32 "
                                       f"sources, got {src_dtype}")
        if not all(p.numel for p in pieces):  # keeps a cached program's tuple as it is
            pieces = tuple(p for p in pieces if p.numel)
        if pieces:
            self._accumulate(lane, pieces, src_dtype, scale, out_dtype)

    def zero(self, lane: int, addr: int, nbytes: int) -> None:
        if nbytes:
            self._zero(lane, addr, nbytes)

    def exchange(self, lane: int, sends: Sequence[tuple[int, int, int]],
                 recvs: Sequence[tuple[int, int, int]]) -> None:
        """Grouped inter-node ``(peer, addr, nbytes)`` sends and receives."""
        sends = [s for s in sends if s[2]]
        recvs = [r for r in recvs if r[2]]
        if sends or recvs:
            self._exchange(lane, sends, recvs)

    def reduce_scatter_f32(self, lane: int, send: int, recv: int, count: int) -> None:
        """Inter-node fp32 sum reduce-scatter; ``count`` elements received per node."""
        if count:
            self._reduce_scatter_f32(lane, send, recv, count)

    def depend(self, lane: int, on: int) -> None:
        """Order ``lane``'s later work after ``on``'s work issued so far."""
        if lane != on:
            self._depend(lane, on)

    @abc.abstractmethod
    def finish(self) -> Completion:
        """Join every lane; the returned completion orders the caller's stream."""

    @abc.abstractmethod
    def _copy(self, lane: int, copies: list[Copy], local: bool) -> None: ...

    @abc.abstractmethod
    def _signal(self, lane: int, addr: int, value: int) -> None: ...

    @abc.abstractmethod
    def _wait(self, lane: int, addr: int, value: int) -> None: ...

    @abc.abstractmethod
    def _accumulate(self, lane: int, pieces: list[AccumPiece], src_dtype: Any,
                    scale: float, out_dtype: Any) -> None: ...

    @abc.abstractmethod
    def _zero(self, lane: int, addr: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _exchange(self, lane: int, sends: list, recvs: list) -> None: ...

    @abc.abstractmethod
    def _reduce_scatter_f32(self, lane: int, send: int, recv: int, count: int) -> None: ...

    @abc.abstractmethod
    def _depend(self, lane: int, on: int) -> None: ...


class Resolved(NamedTuple):
    """An input array resolved once, at the edge: the array, its address and size.

    A NamedTuple, not a dataclass: units of hundreds of parameters resolve
    hundreds of arrays per call, and a tuple is built three times faster.
    """

    array: Any
    ptr: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: Any
    contiguous: bool


class Backend(abc.ABC):
    """Device memory, array resolution and executors for one group.

    Constructors do nothing but store arguments; :meth:`setup` (called by
    ``tidearray.init``) selects devices and creates communicators.
    """

    name: str = "?"
    #: The array module (numpy or cupy).
    xp: Any = None

    def __init__(self, group: Group) -> None:
        self.group = group
        self._fingerprints = CallCache(64)

    def setup(self) -> None:
        """Collective start-up over the group (device choice, communicators)."""

    def close(self) -> None:
        """Release communicators; idempotent."""

    def check(self) -> None:
        """Raise :class:`TideBackendError` if an earlier collective failed in a way that
        only the device saw (a timed-out wait); nothing on backends without one."""

    @abc.abstractmethod
    def resolve(self, obj: Any) -> Resolved:
        """Zero-copy view of ``obj`` (this backend's array or a DLPack producer).

        Raises:
            TideInvalid: ``obj`` is not an array this backend can address.
        """

    def fingerprint(self, objs: Any) -> Optional[tuple]:
        """A cheap cache key for a list of this backend's own arrays, or None.

        One tuple per array, its address first, holding everything
        :meth:`resolve` would check (size, dtype, contiguity, device), so a
        repeated call can find its validated entry without resolving each
        array. None (resolve them) for anything else. The same array objects as
        a recent call (checked through weak references, so ids cannot be stale
        and nothing is kept alive) get that call's fingerprint back, the same
        tuple object: an array's address, size, dtype and device never change,
        and its contiguity only with its shape, which callers compare.
        """
        if type(objs) not in (list, tuple):
            return None
        ids = tuple(map(id, objs))
        seen = self._fingerprints.get(ids)
        if seen is not None and all(r() is a for r, a in zip(seen[0], objs)):
            return seen[1]
        fp = self._fingerprint_of(objs)
        if fp is None:
            return None
        try:
            self._fingerprints.put(ids, ([weakref.ref(a) for a in objs], fp))
        except TypeError:  # arrays without weak references: fingerprint every call
            pass
        return fp

    def _fingerprint_of(self, objs: Any) -> Optional[tuple]:
        """:meth:`fingerprint`'s tuple, made anew; None where ``objs`` are not all
        this backend's own arrays."""
        return None

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any: ...

    @abc.abstractmethod
    def alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        """Allocate and map symmetric memory (collective over the node)."""

    def alloc_multicast(self, nbytes: int) -> SymmetricBuffer:
        """Symmetric memory also bound to a multicast address (collective over the node).

        Raises:
            TideInvalid: multicast is not allowed or not supported here.
        """
        ok, why = self.multicast_capability()  # every rank learns of any rank's refusal
        agree(self.group.node_comm, None if ok else why,
              "multicast: expected a machine that allows it, got", TideInvalid)
        return self._alloc_multicast(nbytes)

    def multicast_capability(self) -> tuple[bool, str]:
        """Whether :meth:`alloc_multicast` can work here, and why (not)."""
        return False, f"the {self.name} backend has no multicast transport"

    def _alloc_multicast(self, nbytes: int) -> SymmetricBuffer:
        raise NotImplementedError

    @abc.abstractmethod
    def executor(self, stream: Any = None) -> Executor:
        """Start one collective, its lanes ordered after ``stream``."""

    def synchronize(self) -> None:
        """Wait for all device work of this process."""
