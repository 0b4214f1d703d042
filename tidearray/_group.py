"""The process group: an mpi4py bootstrap, the node split and the backend.

``init()`` is collective over its communicator. It duplicates the
communicator (so tidearray's traffic never matches the user's), splits it into
node-local ranks (``COMM_TYPE_SHARED``, or ``local_size`` to emulate several
nodes on one host) and inter-node ranks, then starts the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ._config import Config
from ._errors import TideBackendError, TideInvalid
from ._topology import Topology
from ._wait import poll_until

if TYPE_CHECKING:
    from mpi4py import MPI

    from ._board import HostBoard
    from .backends import Backend

_default: Optional[Group] = None

#: Eager plans a group keeps (``Group.eager_plans``).
EAGER_PLANS = 64
#: Integers every collective's validation agrees on (``_validate.check``).
VALIDATION_WIDTH = 4


class Group:
    """Ranks that run collectives together. Made by :func:`init`.

    Attributes:
        comm: private duplicate of the bootstrap communicator.
        node_comm: node-local ranks, in rank order.
        inter_comm: one rank per node with the same local rank, in node order.
        topology: world size, rank and local size.
        rank, size, local_rank, local_size: this rank, the group's size, this
            rank on its node and the ranks per node (from ``topology``).
        backend: the engine (``"cuda"`` or ``"host"``).
        config: the settings in force.
    """

    def __init__(self, comm: MPI.Comm, topology: Topology, node_comm: MPI.Comm,
                 inter_comm: MPI.Comm, config: Config) -> None:
        self.comm = comm
        self.topology = topology  # frozen: these four never change
        self.rank: int = topology.rank
        self.size: int = topology.world
        self.local_rank: int = topology.local_rank
        self.local_size: int = topology.local_size
        self.node_comm = node_comm
        self.inter_comm = inter_comm
        self.config = config
        self.backend: Optional[Backend] = None
        #: Shared-memory agreement when the group is one node (see ``_board``).
        self.board: Optional[HostBoard] = None
        self.closed = False
        #: Symmetric regions made so far (each region's ``id`` is its number).
        self.regions_made = 0
        #: Plans built on this group so far (each plan's build number: [Note: plan order]).
        self.plans_built = 0
        self._resources: dict = {}
        from ._cache import BoundedCache

        #: The eager collectives' latest plans, by their calls ([Note: one pipeline] in
        #: ``_plan``).
        self.eager_plans = BoundedCache(EAGER_PLANS)

    def __repr__(self) -> str:
        t = self.topology
        return (f"Group(rank={t.rank}, size={t.world}, nodes={t.num_nodes}, "
                f"local_size={t.local_size}, backend={getattr(self.backend, 'name', None)!r})")

    def next_region_id(self) -> int:
        """Number the next symmetric region. Regions are made collectively, in the same
        order on every rank, so a number names the same region everywhere."""
        self.regions_made += 1
        return self.regions_made

    def keep(self, key: tuple, resource: Any) -> None:
        """Hold ``resource`` (anything with ``free()``) until :meth:`close` frees it."""
        self._resources[key] = resource

    def kept(self, key: tuple) -> Any:
        """The resource kept under ``key``, or None."""
        return self._resources.get(key)

    def agree_max(self, values: list[int]) -> list[int]:
        """Elementwise max of ``values`` over the group (collective): over the
        node's shared-memory board where there is one, else ``Allreduce``."""
        if self.size == 1:  # the max over one rank: no round trip through MPI
            return [int(v) for v in values]
        if self.board is not None:
            return self.board.max(values)
        return allreduce_max(self.comm, values, self.config.timeout).tolist()

    def check(self) -> None:
        """Raise :class:`TideBackendError` if a collective of this group timed out on the
        device (a peer died or stopped; see docs/reliability.md). Call it before
        trusting results read after a host synchronization."""
        if self.backend is not None:
            self.backend.check()

    def synchronize(self) -> None:
        """Wait for all of this process's device work, then :meth:`check`.

        The way to wait before reading results on the host: the wait releases the
        GIL, so the cuda backend's watchdog (a Python thread) can still release a
        collective whose peer died; a blocking copy that holds the GIL while it waits
        would keep it from running (docs/reliability.md).
        """
        if self.backend is not None:
            self.backend.synchronize()
        self.check()

    def close(self) -> None:
        """Free symmetric memory and communicators (collective)."""
        global _default
        if self.closed:
            return
        self.closed = True
        self.eager_plans.clear()  # their compiled batches go before the memory they address
        for res in self._resources.values():
            res.free()
        self._resources.clear()
        if self.backend is not None:
            self.backend.close()
        if self.board is not None:
            self.board.free()
        for c in (self.inter_comm, self.node_comm, self.comm):
            c.Free()
        if _default is self:
            _default = None

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _split(comm: MPI.Comm, local_size: Optional[int]) -> tuple[Any, int]:
    from mpi4py import MPI

    if local_size is not None:
        if comm.size % local_size:
            raise TideInvalid(f"local_size: expected a divisor of the world size "
                              f"{comm.size}, got {local_size}")
        return comm.Split(comm.rank // local_size, comm.rank), local_size
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    sizes = comm.allgather((node.size, node.rank))
    L = sizes[0][0]
    ok = all(s == L and r == i % L for i, (s, r) in enumerate(sizes))
    if not ok:
        node.Free()
        raise TideInvalid(
            "expected every node to hold the same number of ranks, numbered "
            f"contiguously (mpirun --map-by slot); got (node size, local rank) per rank "
            f"{sizes}")
    return node, L


def init(comm: Optional[MPI.Comm] = None, *, backend: Optional[str] = None,
         local_size: Optional[int] = None, **settings: Any) -> Group:
    """Start a group over ``comm`` (``MPI.COMM_WORLD`` by default). Collective.

    Args:
        comm: an mpi4py intracommunicator; it is duplicated, never used directly.
        backend: ``"auto"``, ``"cuda"`` or ``"host"``; overrides ``TIDE_BACKEND``.
        local_size: ranks per node; overrides ``TIDE_LOCAL_SIZE`` and the
            ``COMM_TYPE_SHARED`` split, e.g. 1 to run the inter-node path on one host.
        **settings: further :class:`Config` fields (``chunk_nbytes``, ``depth``, ...).

    Returns:
        The group, which also becomes the default for collectives.

    Raises:
        TideInvalid: an unknown setting, or a topology tidearray cannot use.
    """
    global _default
    from mpi4py import MPI

    from .backends import make_backend

    config = Config.make(backend=backend, local_size=local_size, **settings)
    dup = (comm if comm is not None else MPI.COMM_WORLD).Dup()
    node, L = _split(dup, config.local_size)
    inter = dup.Split(dup.rank % L, dup.rank)
    group = Group(dup, Topology(dup.size, dup.rank, L), node, inter, config)
    if 1 < L == dup.size:
        from ._board import HostBoard

        group.board = HostBoard(node, VALIDATION_WIDTH, config.timeout)
    group.backend = make_backend(config.backend, group)
    group.backend.setup()
    _default = group
    return group


def default_group() -> Group:
    """The group of the last :func:`init`: what a collective given no ``group=`` runs on.

    Never collective: it starts no group (a size query such as ``unit_nbytes`` must
    not turn into a collective on some ranks only).

    Raises:
        TideInvalid: no group is open (``init`` was never called, or its group was
            closed).
    """
    if _default is None or _default.closed:
        raise TideInvalid("no group is open: call tidearray.init() first, or pass group= "
                          "(expected an open group, got none: never started, or closed)")
    return _default


def allreduce_max(comm: MPI.Comm, values: Any, timeout: float) -> np.ndarray:
    """Elementwise max of ``values`` (int64) over ``comm`` (collective).

    Raises:
        TideBackendError: not every rank reached it within ``timeout`` seconds (one that
            raised, exited or called collectives in another order): polled, so the ranks
            that came end in an error instead of a hang. ``comm`` is then unusable.
    """
    from mpi4py import MPI

    buf = np.ascontiguousarray(values, dtype=np.int64)
    out = np.empty_like(buf)
    req = comm.Iallreduce(buf, out, op=MPI.MAX)
    # Test is what moves MPI's messages along: spin first, as a blocking call would.
    if not poll_until(req.Test, timeout, spin=0.05):
        raise TideBackendError(f"rank {comm.rank}: timed out after {timeout:g} s in a host "
                               "all-reduce; did every rank call the same collectives in the "
                               "same order? (this group can no longer be used)")
    return out
