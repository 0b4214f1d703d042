"""The backend interface: the few primitives every collective is written against.

A backend supplies memory (plain and symmetric), array resolution, and an
``Executor`` that issues one collective's primitives onto *lanes*. A lane is an
in-order queue: a CUDA stream on the cuda backend, program order on the host
backend. Lanes ``0..L-1`` push to node-local peer ``0..L-1``; ``COMPUTE`` runs
accumulation; ``NET`` runs inter-node traffic.

Public methods here are checked; backends implement the ``_`` hooks.

[Note: backend interface]
The layers above ``backends/`` (``fsdp``, the front ends) reach the device only
through :class:`Backend`; a branch on ``xp is np`` or ``backend.name`` up there is
a method missing here. Besides memory, resolution and executors (the collectives'
primitives), a backend offers the few things a layer needs to issue device work of
its own, each general enough for every caller:

* ``on_stream(stream)``: make a stream current, so that the array module's work
  (CuPy operations, kernel launches) goes on it: the runtime's compute stream,
  an optimizer step's stream.
* ``on_device(array)``: make an array's device (or the group's) current, for work
  on arrays a caller holds (an optimizer's shards), or on a thread of XLA's.
* ``wrap(buffer)``: an array over a producer's memory with no copy and no
  synchronization (XLA's buffers inside a ``buffer_callback``).
* ``settle()``: wait for the writes a constructor or a load issued on the current
  stream, which a first use on another stream need not wait for ([Note:
  initialized memory] in ``backends.cuda.streams``); the settles stay exactly
  where that note puts them.
* ``capturing(stream)``: whether a stream is in a graph capture, where nothing
  may be read back or allocated (and a graph plan issues instead of launching).
* ``uploader()``: asynchronous copies of small host tables to the device, from
  host memory that outlives each copy (the optimizer's coefficient rows).
* ``kernel(source, name, like)``: a compiled kernel of ``kernels/`` for an
  array's device (AdamW, the gradient norm); the host backend has none, and its
  callers compute with NumPy.
* ``asarray(obj)``: ``obj``'s values as an array of this backend, copied only
  where they live elsewhere: what a state-dict load or an optimizer's ``load``
  writes, and, from the host backend, any array brought down to the host.
* ``stream(stream)``: any stream the collectives take as this backend's stream
  object, for a caller to keep (a runtime's stream, a graph's launch stream).
* ``completion(stream)``: the end of the work issued on ``stream`` so far, whose
  ``wait`` orders another stream after it: how a comm forks a side stream of its
  own and joins it back ([Note: comm streams] in ``fsdp._comm``).
* ``copy_arrays(dsts, srcs, stream)``: asynchronous copies between arrays a front
  end was handed (XLA's, in a callback), on that front end's stream.
* ``graphs`` and ``step_pool()``: whether whole steps can be captured as device
  graphs, and a captured step's own memory pool with the stream capture that
  allocates from it ([Note: captured steps] in ``fsdp._graph``).
* ``device_kind``: the platform the arrays live on, as JAX and torch name it,
  for a front end to pick its own device (and XLA's stream, on a GPU).

Each member's docstring says what it does on the host and on cuda. The host
backend answers the stream methods as no-ops (program order: every write is done
when it returns). Only ``on_device()`` without an array and ``wrap`` read
the group's device, so ``backends.array_backend(xp)`` gives the rest to a caller
that holds arrays but no group (``FusedAdamW(..., xp)``, ``GlobalNorm``), and
importing ``fsdp`` loads no cuda module.

Not here yet: the optimizer step and the gradient norm choose, by array module,
between kernels and NumPy, which differ in more than the launch (device tables and
a fixed kernel grid on cuda, runs of rows and float64 chunks on the host).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple, Optional, Sequence

import numpy as np

from .. import _dtypes
from .._copies import Copy
from .._dtypes import float32
from .._errors import TideBackendError, TideInvalid, agree

if TYPE_CHECKING:
    from .._group import Group


@dataclass(frozen=True)
class AccumPiece:
    """``out[:numel] = scale * sum(src[:numel] for src in srcs)`` in fp32, srcs in order."""

    out: int
    srcs: tuple[int, ...]
    numel: int


class Batch:
    """A plan's copies or accumulate pieces in its backend's form, made once at build.

    [Note: compiled batches]
    A collective's program (its every address, computed when a plan is built)
    holds each batch in the form its backend issues: packed address arrays and
    2D runs for the cuda copier, a tiled table for the accumulate kernel, merged
    neighbours for host memory. A plan owns its batches, so what a call issues
    is decided at build time and dropped with the plan; nothing is looked up
    per call. Raw triples or pieces passed to an executor are planned for that
    call only.
    """

    def __len__(self) -> int:
        return 1


def check_accumulate(src_dtype: Any, out_dtype: Any) -> None:
    """A rounded (bf16 or fp16) output takes fp32 sources only."""
    if out_dtype is not float32:
        out_dtype = _dtypes.normalize(out_dtype)
        if out_dtype != float32 and _dtypes.normalize(src_dtype) != float32:
            raise TideBackendError(f"accumulate: a {out_dtype} output takes float32 "
                                   f"sources, got {src_dtype}")


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


class Done(Completion):
    """Work complete when issued: the host's, or work on the stream that waits for it."""

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class StepPool(abc.ABC):
    """A captured step's own device memory, and the stream capture that allocates from
    it ([Note: captured steps] in ``fsdp._graph``); made by :meth:`Backend.step_pool`."""

    @abc.abstractmethod
    def using(self) -> ContextManager:
        """A ``with`` context in which the array module allocates from this pool."""

    @abc.abstractmethod
    def capture(self, stream: Any, step: Callable[[], Any]) -> tuple[Any, Any]:
        """``step()`` captured (relaxed) on ``stream``, one of :meth:`Backend.stream`'s:
        the graph (``launch(stream)``), and what ``step`` returned; if ``step`` raises,
        its error, not the ending capture's."""

    @abc.abstractmethod
    def free_all_blocks(self) -> None:
        """Give the pool's memory back to the device (after the last replay)."""


class Graph(abc.ABC):
    """One collective captured once (:meth:`Backend.capture`), replayed per call."""

    @abc.abstractmethod
    def launch(self, stream: Any = None, after: Optional[Completion] = None,
               beside: bool = False) -> Completion:
        """Replay it after ``stream``'s earlier work (cuda: current stream if None) and
        ``after``; on ``stream`` itself, or ``beside`` it as an eager call's lanes run."""


class Executor(abc.ABC):
    """Issues one collective's primitives; built by :meth:`Backend.executor`."""

    #: Whether the primitives are captured into a graph, not run (a stream capture).
    capture = False

    def __init__(self, local_size: int) -> None:
        self.COMPUTE = local_size
        self.NET = local_size + 1

    def copy(self, lane: int, copies: Any, local: bool = False) -> None:
        """A batch of copies on ``lane``: a :class:`Batch` that
        :meth:`Backend.compile_copies` made (a plan's, issued every call), or
        ``(dst, src, nbytes)`` address triples, any peer, planned for this call only.

        Two arrays can be adjacent without being one allocation, and a device copy
        must not span allocations, so merging neighbours is left to backends where
        it is safe (host memory). Zero-byte copies are allowed. ``local`` (raw
        triples only; a batch carries its own) says every copy is within this
        rank's device, which a device backend may issue differently (the cuda
        backend's driver runs those on the SMs: [Note: same-device copies]).
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
        copies = [c for c in copies if c[2]]
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

    def consume(self, lane: int, addr: int, value: int) -> None:
        """:meth:`wait`, then write 0 back into the flag on ``lane``: the reader's reset
        that keeps every flag's values the same on every call ([Note: replay-safe
        flags] in ``_arena``)."""
        self._wait(lane, addr, value)
        self._signal(lane, addr, 0)

    def accumulate(self, lane: int, pieces: Any, src_dtype: Any, scale: float,
                   out_dtype: Any = float32) -> None:
        """``out = scale * sum(srcs)`` per piece, in fp32, sources summed in the given order.

        ``pieces``: a :class:`Batch` that :meth:`Backend.compile_pieces` made for
        these dtypes (a plan's), or :class:`AccumPiece` s, planned for this call only.
        ``out_dtype`` bf16 or fp16 (fp32 sources only) rounds the fp32 result to
        nearest even: one fp32 source with scale 1 is a cast.
        """
        if not isinstance(pieces, Batch):
            check_accumulate(src_dtype, out_dtype)
            pieces = [p for p in pieces if p.numel]
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

    def depend(self, lane: int, on: int) -> None:
        """Order ``lane``'s later work after ``on``'s work issued so far."""
        if lane != on:
            self._depend(lane, on)

    def mark(self, lane: int) -> Any:
        """A point in ``lane``'s work: everything issued on it so far. :meth:`after`
        orders another lane after that point, not after what ``lane`` issues later."""
        return self._mark(lane)

    def after(self, lane: int, mark: Any) -> None:
        """Order ``lane``'s later work after a :meth:`mark` of this collective's."""
        self._after(lane, mark)

    @abc.abstractmethod
    def finish(self) -> Completion:
        """Join every lane; the returned completion orders the caller's stream."""

    @abc.abstractmethod
    def _copy(self, lane: int, copies: Any, local: bool) -> None:
        """``copies``: a :class:`Batch` of this backend's, or a non-empty list of triples."""

    @abc.abstractmethod
    def _signal(self, lane: int, addr: int, value: int) -> None: ...

    @abc.abstractmethod
    def _wait(self, lane: int, addr: int, value: int) -> None: ...

    @abc.abstractmethod
    def _accumulate(self, lane: int, pieces: Any, src_dtype: Any,
                    scale: float, out_dtype: Any) -> None:
        """``pieces``: a :class:`Batch` of this backend's, or a non-empty list of pieces."""

    @abc.abstractmethod
    def _zero(self, lane: int, addr: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _exchange(self, lane: int, sends: list, recvs: list) -> None: ...

    @abc.abstractmethod
    def _depend(self, lane: int, on: int) -> None: ...

    @abc.abstractmethod
    def _mark(self, lane: int) -> Any: ...

    @abc.abstractmethod
    def _after(self, lane: int, mark: Any) -> None: ...


class TupleBatch(Batch):
    """A batch as plain tuples: what backends that issue them one by one keep."""

    def __init__(self, items: tuple) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        return iter(self.items)


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
    #: False for an array the backend knows is read-only (a NumPy view of an immutable
    #: array): never an output.
    writable: bool = True


class Backend(abc.ABC):
    """Device memory, array resolution and executors for one group.

    Constructors do nothing but store arguments; :meth:`setup` (called by
    ``tidearray.init``) selects devices and creates communicators.
    """

    name: str = "?"
    #: The array module (numpy or cupy).
    xp: Any = None
    #: Whether whole training steps can be captured as device graphs
    #: (:meth:`step_pool`): False on the host, where a step capture refuses the
    #: backend by name; True on cuda (CUDA graphs).
    graphs: bool = False
    #: The platform the arrays live on, as JAX and torch name it, for a front end to
    #: pick its own device: ``"cpu"`` on the host, ``"gpu"`` on cuda (the group's).
    device_kind: str = "cpu"

    def __init__(self, group: Group) -> None:
        self.group = group

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

    def array_key(self, objs: Any) -> Optional[tuple]:
        """What a plan built for ``objs`` depends on, read without resolving them: one
        ``(address, shape, dtype, contiguous)`` per array where all are this backend's
        own arrays on this rank's device; None (resolve them) for anything else.
        An eager collective finds the plan made for a call on the same arrays by it."""
        return None

    def compile_copies(self, copies: Sequence[Copy], local: bool = False,
                       split: bool = False) -> Any:
        """A plan's copy batch in this backend's form ([Note: compiled batches]).

        Args:
            copies: ``(dst, src, nbytes)`` triples.
            local: every copy is within this rank's device.
            split: the batch goes to or comes from one peer on that peer's lane,
                so a device backend may spread it over several copy engines.
        """
        return TupleBatch(tuple(c for c in copies if c[2]))

    def compile_pieces(self, pieces: Sequence[AccumPiece], src_dtype: Any,
                       out_dtype: Any = float32, alone: bool = False) -> Any:
        """A plan's accumulate pieces in this backend's form ([Note: compiled batches])."""
        check_accumulate(src_dtype, out_dtype)
        return TupleBatch(tuple(p for p in pieces if p.numel))

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

    def capture(self, issue: Callable[[Executor], Any], what: str, ran: bool = False,
                stream: Any = None) -> Graph:
        """``issue(executor)`` (one collective, which ran before: nothing may be uploaded
        in a capture) as a :class:`Graph` whose launches replay it ([Note: replay-safe
        flags] in ``_arena``), keeping what ``issue`` returns alive. ``ran``: at earlier
        calls on ``stream``, where the launches go ([Note: capture inside a step])."""
        return RecordedGraph(self, issue, what)

    def synchronize(self) -> None:
        """Wait for all device work of this process."""

    # -- device work of the layers above ([Note: backend interface]) ---------------------

    def on_stream(self, stream: Any) -> ContextManager:
        """A ``with`` context in which the array module issues on ``stream`` (any kind the
        collectives take); nothing for None (the current stream) or without a device."""
        return contextlib.nullcontext()

    def on_device(self, array: Any = None) -> ContextManager:
        """A ``with`` context in which ``array``'s device (None: this group's) is current;
        nothing without a device."""
        return contextlib.nullcontext()

    def wrap(self, buffer: Any) -> Any:
        """An array of this backend over a producer's ``buffer`` (``__array__`` on the host,
        ``__cuda_array_interface__`` on cuda; XLA's, in a callback), no copy and no
        synchronization: the caller uses it only in the producer's stream order."""
        raise TideBackendError(f"the {self.name} backend wraps no external buffers")

    def stream(self, stream: Any) -> Any:
        """``stream`` (any kind the collectives take; None: the current one) as this
        backend's stream object, to keep and pass to :meth:`on_stream` or a graph's
        ``launch``. Host: None (no streams). Cuda: a CuPy stream (a CuPy stream
        itself, CuPy's current one for None, an external stream over any other
        kind's handle; ``backends.cuda.streams.cupy_stream``)."""
        return None

    def completion(self, stream: Any) -> Completion:
        """The end of the work issued on ``stream`` (any kind the collectives take; None:
        the current one) so far: its ``wait(other)`` orders ``other`` after that work,
        and nothing blocks the host. Host: done at once. Cuda: an event (non-blocking,
        no timing) recorded on ``stream`` now; ``wait`` is ``cudaStreamWaitEvent``."""
        return Done()

    def step_pool(self) -> StepPool:
        """A captured step's own memory pool, which also captures the step
        (:class:`StepPool`). Cuda: CuPy's default pool first gives its cached blocks back
        to the device, then a new ``cupy.cuda.MemoryPool``; the capture is a relaxed
        CuPy stream capture.

        Raises:
            TideBackendError: on the host, which captures no graphs (:attr:`graphs`).
        """
        raise TideBackendError(f"the {self.name} backend captures no graphs (the cuda "
                               "backend does)")

    def settle(self) -> None:
        """Wait for the work issued so far on the current stream: the device writes of a
        constructor or a load ([Note: initialized memory] in ``backends.cuda.streams``).
        Nothing where every write is done when it returns."""

    def capturing(self, stream: Any = None) -> bool:
        """Whether ``stream`` (None: the current one) is being captured into a graph."""
        return False

    def copy_arrays(self, dsts: Sequence[Any], srcs: Sequence[Any], stream: Any) -> None:
        """``dst[...] = src`` for each pair of arrays of equal bytes, on ``stream`` (any
        kind the collectives take; None: the current one). Host: ``np.copyto``, in
        program order. Cuda: one ``cudaMemcpyAsync`` (device to device) per non-empty
        pair, returning before the copies have run."""
        for d, s in zip(dsts, srcs):
            np.copyto(d, s)

    def uploader(self) -> Callable[[Any, Any], None]:
        """``upload(dst, table)``: a NumPy ``table``'s bytes into the start of ``dst``, on
        the current stream, returning before the copy has run; the host memory it copies
        from is the uploader's own, reused only once the last copy has read it. One per
        owner of the device tables (an optimizer)."""
        def upload(dst: Any, table: Any) -> None:
            dst.view(np.uint8)[:table.nbytes] = np.ascontiguousarray(table).view(np.uint8).ravel()
        return upload

    def asarray(self, obj: Any) -> Any:
        """``obj``'s values as an array of this backend, copied only where they live
        elsewhere. Host: a NumPy array (a CuPy array copied down by ``get``, a torch
        tensor by ``cpu``). Cuda: a CuPy array on the current device (a CUDA DLPack
        producer, such as a CUDA tensor, viewed by ``cupy.from_dlpack``; a CuPy array
        as it is; anything else copied up by ``cupy.asarray``)."""
        return self.xp.asarray(obj)

    def kernel(self, source: str, name: str, like: Any) -> Any:
        """The compiled kernel ``name`` of ``kernels/<source>`` for ``like``'s device, called
        as ``kernel(grid, block, args)`` on the current stream.

        Raises:
            TideBackendError: this backend runs no kernels (its callers use NumPy).
        """
        raise TideBackendError(f"the {self.name} backend runs no kernels, got a call for "
                               f"{name} of kernels/{source}")


class _Recorder(Executor):
    """An executor that issues nothing: it records every primitive, for a replay."""

    def __init__(self, local_size: int) -> None:
        super().__init__(local_size)
        self.ops: list[tuple[str, tuple]] = []

    def _record(name: str) -> Any:  # noqa: N805 - builds the recording hooks below
        def hook(self: _Recorder, *args: Any) -> Any:
            self.ops.append((name, args))
            return len(self.ops)  # a mark names the point it was taken at
        hook.__name__ = name
        return hook

    _copy = _record("_copy")
    _multicast_copy = _record("_multicast_copy")
    _signal = _record("_signal")
    _wait = _record("_wait")
    _accumulate = _record("_accumulate")
    _zero = _record("_zero")
    _exchange = _record("_exchange")
    _depend = _record("_depend")
    _mark = _record("_mark")
    _after = _record("_after")
    del _record

    def finish(self) -> Completion:
        raise AssertionError("a recording is replayed, not finished")


class RecordedGraph(Graph):
    """A collective's primitives recorded once and replayed in order on a new executor
    per launch: the graph of backends without one of their own (the host backend).
    The replay issues exactly what a capture would hold, so the replay-safe protocol
    ([Note: replay-safe flags] in ``_arena``) is what makes it correct."""

    def __init__(self, backend: Backend, issue: Callable[[Executor], Any], what: str) -> None:
        self._backend, self.what = backend, what
        rec = _Recorder(backend.group.local_size)
        self._keep = issue(rec)
        self.ops = tuple(rec.ops)

    def launch(self, stream: Any = None, after: Optional[Completion] = None,
               beside: bool = False) -> Completion:
        if after is not None:
            after.wait(stream)
        ex = self._backend.executor(stream)  # lanes beside the stream: ``beside`` either way
        marks: dict[int, Any] = {}
        for k, (name, args) in enumerate(self.ops, 1):
            if name == "_after":
                args = (args[0], marks[args[1]])
            got = getattr(ex, name)(*args)
            if name == "_mark":
                marks[k] = got
        return ex.finish()
