"""The global gradient norm and the clip it decides: one sum per rank, all-gathered, summed in
rank order.

[Note: global norm]
The norm spans every rank's gradient shard. Each rank sums the squares of its
shard in float64; the ranks all-gather those sums with a TIDE gather plan
(each rank's float64 as a shard of two float32 words, so the gather moves its
bits), and every rank adds them in rank order. So every rank gets the same
bits, and no MPI call is involved: on the cuda backend the whole computation
is device work on the model's stream (``kernels/gradnorm.cu``), in a fixed
order whatever the call, which a stream capture can hold.

[Note: clipping]
The norm spans every rank's shard, so the optimizer cannot clip by itself: the
runtime clips (``Runtime.finalize_grads``, through ``_accum.GradAccumulator``), and
the result is a value, :class:`GradScale`, whose ``factor`` the fused AdamW
takes as its ``grad_scale``. The averaging ``1 / (world x micro-batches)``
multiplies into that same factor, so the norm is of the averaged gradient,
``average * sqrt(total)``. The clip rule is torch's ``clip_grad_norm_``, in
two forms with the same float64 operations (each correctly rounded, so the
same bits):

* Eager, the host reads the norm back (one sync) and :func:`clip_scale` turns
  it into the clip factor: ``GradScale(average * factor, norm, False)``.
* Inside a capture (a captured step, ``fsdp._graph``), nothing can be read
  back: ``clip_finish`` computes the factor on the device and writes
  ``round_to_float(average * factor)`` into the ``grad_scale`` of every row of
  the optimizer's coefficient table, which the ``adamw_table_*`` kernels read
  next: ``GradScale(average, norm, True)``, the norm a device array. Only the
  fused AdamW's step reads that table.

The host backend sums its shard with NumPy in float64 chunks, gathers the same
way, and adds the ranks' sums on the host in rank order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np

from .. import _dtypes
from .._adamw import HOST_CHUNK
from .._arena import SlotArena
from .._errors import TideInvalid
from .._plan import Unit
from ..backends import array_backend

if TYPE_CHECKING:
    from .._group import Group

#: ``NORM_BLOCKS`` and ``NORM_THREADS`` of ``kernels/gradnorm.cu``: the fixed grid.
NORM_BLOCKS = 1024
NORM_THREADS = 256


class GradScale(NamedTuple):
    """What turns the summed gradient shards into the step's gradient ([Note: clipping])."""

    #: Multiplies the summed shards (the optimizer's ``grad_scale``): the averaging
    #: ``1 / (world x micro-batches)``, times the clip factor where the host computed it.
    factor: float
    #: The global norm of the averaged gradient before clipping: None without a clip, a
    #: float, or (``on_device``) a 0-d float64 device array that each replay overwrites.
    norm: Any = None
    #: The clip factor is computed on the device, into the optimizer's coefficient table
    #: (a clip inside a capture): ``factor`` is the averaging alone.
    on_device: bool = False


def clip_scale(total_norm: float, max_norm: Optional[float]) -> float:
    """The gradient factor of torch's ``clip_grad_norm_`` (``clip_finish`` in
    ``kernels/gradnorm.cu`` is its device form; [Note: clipping]).

    Args:
        total_norm: the global L2 norm of the gradient (over every rank's shard).
        max_norm: the norm to clip to, or None for no clipping.

    Returns:
        ``max_norm / (total_norm + 1e-6)`` where that is below 1, else 1.0; 1.0
        when ``max_norm`` is None. A NaN ``total_norm`` gives NaN, as in torch.
    """
    if max_norm is None:
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    return coef if (coef < 1.0 or math.isnan(coef)) else 1.0


def check_max_norm(max_norm: Any, what: str = "max_norm", inf: bool = False) -> None:
    """Raise ``TideInvalid`` unless ``max_norm`` is a finite real > 0 (a clip limit), or,
    with ``inf``, +inf too: ``clip_grad_norm_(inf)``, torch's way to take the norm without
    clipping (its factor is 1)."""
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
            and (math.isfinite(max_norm) or (inf and max_norm == math.inf)) and max_norm > 0):
        raise TideInvalid(f"{what}: expected a {'' if inf else 'finite '}real > 0, got "
                          f"{max_norm!r}")


def clip_limit(max_grad_norm: Optional[float], optimizer_limit: Optional[float]) -> Optional[float]:
    """The runtime's clip limit: ``max_grad_norm``, else the optimizer's
    (``AdamW.max_grad_norm``, the spelling of earlier versions, which the optimizer
    itself never reads); refused where both are given and differ."""
    if max_grad_norm is None:
        return optimizer_limit
    check_max_norm(max_grad_norm, "max_grad_norm")
    if optimizer_limit not in (None, max_grad_norm):
        raise TideInvalid(f"max_grad_norm: expected one clip limit, got {max_grad_norm!r} and "
                          f"optimizer.max_grad_norm={optimizer_limit!r}")
    return max_grad_norm


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
    must then call :meth:`compute` (or :meth:`clip`) at the same points, as for any plan.
    Each call leaves this rank's own sum of squares in :attr:`local`.

    Args:
        group: the group the shards are spread over (None where ``world`` is 1).
        world: the ranks they are sharded over (the group's size, or 1: no exchange).
        xp: the array module of the shards (numpy or cupy).
    """

    def __init__(self, group: Optional[Group], world: int, xp: Any) -> None:
        self.world, self.xp = world, xp
        self._backend = array_backend(xp)  # its streams and kernels ([Note: backend interface])
        self.cuda = xp is not np  # kernels or NumPy (not routed yet: [Note: backend interface])
        self.local = xp.zeros(1, np.float64)  # this rank's sum of squares, the last call's
        self.norm = xp.zeros(1, np.float64)  # cuda: the last norm, on the device
        self._gather: Any = None
        if world > 1:
            unit = Unit([(2 * world,)], _dtypes.float32, group)
            self._slots = SlotArena(unit.nbytes, 1, group=group)
            self._gather = unit.gather_plan([self.local.view(np.float32)], self._slots[0])
            self._gather()  # a first call uploads its tables, which a capture cannot
        if self.cuda:
            self._partial = xp.empty(NORM_BLOCKS, np.float64)
            self._blocks, self._total, self._finish = (
                self._backend.kernel("gradnorm.cu", k, self.local)
                for k in ("sum_squares_blocks", "sum_squares_total", "clip_finish"))
        self._backend.settle()  # the zeros above, before a first use on another stream

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
        with self._backend.on_stream(stream):
            per_rank = self._per_rank(stream)
            rows, width, field = table_shape
            self._finish((1,), (1,), (per_rank, np.int32(self.world), np.float64(scale),
                                      np.float64(max_norm or 0.0), self.norm,
                                      np.uint64(0) if table is None else table,
                                      np.int32(rows), np.int32(width), np.int32(field)))
            if table is not None:
                return self.norm
            return float(self.norm.get(stream=self._backend.stream(None))[0])

    def clip(self, grad: Any, average: float, max_norm: float, *, stream: Any = None,
             table: Any = None, table_shape: tuple[int, int, int] = (0, 0, 0)) -> GradScale:
        """Clip the averaged gradient, ``average`` times the sum whose shard on this rank is
        ``grad``, to the global norm ``max_norm`` ([Note: clipping]).

        Args:
            grad, average, stream: as :meth:`compute` takes ``grad``, ``scale`` and ``stream``.
            max_norm: the norm to clip to.
            table, table_shape: as :meth:`compute` takes them: the device computes the clip
                factor into ``table`` (a captured step's clip); None: the host does.
        """
        if table is None:
            norm = self.compute(grad, average, stream=stream)
            return GradScale(average * clip_scale(norm, max_norm), norm, False)
        norm = self.compute(grad, average, stream=stream, max_norm=max_norm, table=table,
                            table_shape=table_shape)
        return GradScale(average, norm.reshape(()), True)

    def _local_sum(self, grad: Any, stream: Any) -> None:
        """This rank's sum of squares into :attr:`local`, on ``stream`` (cuda)."""
        if not self.cuda:
            self.local[0] = host_sum_squares(grad)
            return
        with self._backend.on_stream(stream):
            n = np.int64(grad.size)
            self._blocks((NORM_BLOCKS,), (NORM_THREADS,), (grad, n, self._partial))
            self._total((1,), (NORM_THREADS,), (self._partial, self.local))

    def _per_rank(self, stream: Any = None) -> Any:
        """Every rank's sum of squares, rank 0 first (float64; gathered where world > 1)."""
        if self._gather is None:
            return self.local
        return self._gather(stream=stream)[0].view(np.float64)
