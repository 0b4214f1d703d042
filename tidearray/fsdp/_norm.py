"""The global gradient norm, for clipping: one sum per rank, all-gathered, summed in rank order.

[Note: global norm]
The norm spans every rank's gradient shard. Each rank sums the squares of its
shard in float64; the ranks all-gather those sums with a TIDE gather plan
(each rank's float64 as a shard of two float32 words, so the gather moves its
bits), and every rank adds them in rank order. So every rank gets the same
bits, and no MPI call is involved: on the cuda backend the whole computation
is device work on the model's stream (``kernels/gradnorm.cu``), in a fixed
order whatever the call, which a stream capture can hold.

* Eager, the host reads the norm back (one sync) and the runtime turns it
  into the clip factor (``_optim.clip_scale``), which the step's coefficients
  carry as ``grad_scale``.
* Inside a capture (a captured step, ``fsdp._graph``), nothing can be read
  back: ``clip_finish`` computes the clip factor itself, with the same float64
  operations as ``clip_scale`` (each correctly rounded, so the same bits), and
  writes ``round_to_float(scale * factor)`` into the ``grad_scale`` of every
  row of the optimizer's coefficient table, which the ``adamw_table_*``
  kernels read next. The norm stays on the device for the caller to read.

The host backend sums its shard with NumPy in float64 chunks, gathers the same
way, and adds the ranks' sums on the host in rank order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .. import _dtypes
from .._arena import SlotArena
from .._plan import Unit
from ..backends.cuda import kernels as _kernels
from ..backends.cuda.streams import on_stream

if TYPE_CHECKING:
    from .._group import Group

#: ``NORM_BLOCKS`` and ``NORM_THREADS`` of ``kernels/gradnorm.cu``: the fixed grid.
NORM_BLOCKS = 1024
NORM_THREADS = 256
#: Elements per float64 pass of the host backend's sum: its copies stay in cache.
HOST_CHUNK = 1 << 16


def host_sum_squares(grad: np.ndarray) -> float:
    """Sum of squares of a float32 NumPy array, in float64 chunks of :data:`HOST_CHUNK`."""
    total = 0.0
    for lo in range(0, grad.size, HOST_CHUNK):  # float64 copies stay chunk-sized
        g = grad[lo:lo + HOST_CHUNK].astype(np.float64)
        total += float(np.dot(g, g))
    return total


class GlobalNorm:
    """The global L2 norm of the gradient shards over ``world`` ranks ([Note: global norm]).

    Collective to make (with ``world > 1`` it makes a small slot arena and a gather
    plan, and runs that once so that a capture finds its tables uploaded); every rank
    must then call :meth:`compute` at the same points, as for any plan.

    Args:
        group: the group the shards are spread over (None where ``world`` is 1).
        world: the ranks they are sharded over (the group's size, or 1: no exchange).
        xp: the array module of the shards (numpy or cupy).
    """

    def __init__(self, group: Optional[Group], world: int, xp: Any) -> None:
        self.world, self.xp = world, xp
        self.cuda = xp is not np
        self.local = xp.zeros(1, np.float64)  # this rank's sum of squares
        self.norm = xp.zeros(1, np.float64)  # cuda: the last norm, on the device
        self._gather: Any = None
        if world > 1:
            unit = Unit([(2 * world,)], _dtypes.float32, group)
            self._slots = SlotArena(unit.nbytes, 1, group=group)
            self._gather = unit.gather_plan([self.local.view(np.float32)], self._slots[0])
            self._gather()  # a first call uploads its tables, which a capture cannot
        if self.cuda:
            dev = self.local.device.id
            self._partial = xp.empty(NORM_BLOCKS, np.float64)
            self._blocks, self._total, self._finish = (
                _kernels.function("gradnorm.cu", k, dev)
                for k in ("sum_squares_blocks", "sum_squares_total", "clip_finish"))

    def compute(self, grad: Any, scale: float, *, stream: Any = None,
                max_norm: Optional[float] = None, table: Any = None,
                table_shape: tuple[int, int, int] = (0, 0, 0)) -> Any:
        """The norm of ``scale * (the gradient)``, whose shard on this rank is ``grad``.

        Args:
            grad: this rank's float32 gradient shard (1-D, contiguous).
            scale: the factor from ``grad`` to the gradient whose norm is wanted.
            stream: the cuda stream to run on (None: the current one).
            max_norm: with ``table``, the norm to clip to.
            table: cuda only: the optimizer's float32 coefficient table, whose rows'
                ``grad_scale`` get ``round_to_float(scale * clip_scale(norm,
                max_norm))`` on the device (a captured step's clip).
            table_shape: ``(rows, width, field)``: the table's rows, their width in
                floats, and where ``grad_scale`` is in a row.

        Returns:
            The norm as a Python float (read back: a host sync), or, with ``table``,
            :attr:`norm`, the device array the norm is written into (nothing is read
            back).
        """
        self._local_sum(grad, stream)
        if not self.cuda:
            total = sum(self._per_rank().tolist())  # rank order, as on the device
            return math.sqrt(total) * scale
        with on_stream(stream):
            per_rank = self._per_rank(stream)
            rows, width, field = table_shape
            self._finish((1,), (1,), (per_rank, np.int32(self.world), np.float64(scale),
                                      np.float64(max_norm or 0.0), self.norm,
                                      np.uint64(0) if table is None else table,
                                      np.int32(rows), np.int32(width), np.int32(field)))
            if table is not None:
                return self.norm
            return float(self.norm.get(stream=self.xp.cuda.get_current_stream())[0])

    def sum_squares(self, grad: Any, stream: Any = None) -> float:
        """This rank's sum of squares of ``grad``, as :meth:`compute` sums it (read back:
        a host sync on cuda)."""
        self._local_sum(grad, stream)
        if not self.cuda:
            return float(self.local[0])
        with on_stream(stream):
            return float(self.local.get(stream=self.xp.cuda.get_current_stream())[0])

    def _local_sum(self, grad: Any, stream: Any) -> None:
        """This rank's sum of squares into :attr:`local`, on ``stream`` (cuda)."""
        if not self.cuda:
            self.local[0] = host_sum_squares(grad)
            return
        with on_stream(stream):
            n = np.int64(grad.size)
            self._blocks((NORM_BLOCKS,), (NORM_THREADS,), (grad, n, self._partial))
            self._total((1,), (NORM_THREADS,), (self._partial, self.local))

    def _per_rank(self, stream: Any = None) -> Any:
        """Every rank's sum of squares, rank 0 first (float64; gathered where world > 1)."""
        if self._gather is None:
            return self.local
        return self._gather(stream=stream)[0].view(np.float64)
