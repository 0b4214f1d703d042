"""Fused AdamW over the flat fp32 shard arena, writing the param-dtype send shard too.

One pass per step reads the fp32 gradient shard and updates the fp32 master
shard and both moments in place, and writes the send shard (bf16, fp16 or
fp32) that the next all-gather sends: no separate cast. Without a send shard
(``send=None``: the gathers cast the masters themselves, as the ``tide``
runtime does) it writes master and moments only. CuPy arrays run
``kernels/adamw.cu``; NumPy arrays run the same float32 operations with
NumPy's ufuncs.

[Note: AdamW math]
torch.optim.AdamW's formulation (decoupled weight decay), per element in
float32, every operation rounded to nearest even:

    g     = grad * grad_scale
    p     = master * decay                     decay     = 1 - lr * weight_decay
    m     = beta1 * m + omb1 * g               omb1      = 1 - beta1
    v     = beta2 * v + omb2 * (g * g)         omb2      = 1 - beta2
    denom = sqrt(v) / bc2_sqrt + eps           bc2_sqrt  = sqrt(1 - beta2**step)
    p     = p - step_size * (m / denom)        step_size = lr / (1 - beta1**step)
    master = p; exp_avg = m; exp_avg_sq = v; send = round_to_nearest_even(p)

The right-hand coefficients are computed once per step on the host in float64
and rounded once to float32 (:func:`coefficients`); both paths read those same
float32 values. The kernel spells every operation as a ``_rn`` intrinsic (no
FMA contraction, IEEE division and sqrt), and NumPy's float32 ufuncs round
each operation the same way, so the two paths agree bitwise. The one
exception is NaN sent as fp16: both give a NaN, with different payload bits.

Parameter groups (:class:`ParamGroup`, torch's ``param_groups``) give element
ranges of the arena their own ``lr``, ``betas``, ``eps`` and ``weight_decay``;
the elements in no range form the default group 0, which uses ``hp``. Each
group's coefficients come from :func:`coefficients` with its own
hyper-parameters and the shared step count, so an element's update is the
one above with its group's float32 values. A frozen group (``lr = 0``,
``weight_decay = 0``) has ``decay = 1`` and ``step_size = 0``: its masters
stay bitwise as they were (its send elements their rounding) while
``m / denom`` is finite (finite gradients, ``eps > 0``), except that -0.0
can become +0.0; its moments still advance. Both as in torch. NumPy runs
:func:`adamw_numpy` once per run of one group (:func:`group_runs`); the
kernel reads each element's group from a uint8 index array written once, at
construction, and every group's coefficients from one kernel argument.

[Note: clipping]
The global gradient norm spans every rank's shard, so the optimizer cannot
clip by itself. The runtime computes it (``_norm.GlobalNorm``, [Note: global
norm] there): each rank sums the squares of its shard in float64, the ranks
all-gather those sums and add them in rank order, and
``clip_scale(norm, hp.max_grad_norm)`` is passed to :meth:`FusedAdamW.step` as
``grad_scale``. Any other factor (say 1/world for averaging) multiplies into
the same ``grad_scale``; the norm must then be of the scaled gradient,
``factor * sqrt(total)``. In a captured step the device computes the factor
with the same float64 operations and writes ``grad_scale`` into the
coefficient table itself (:attr:`FusedAdamW.table_layout`).

[Note: optimizer streams]
``step`` (cupy) enqueues one kernel on ``stream`` (None: the current stream)
and returns without waiting. The caller orders it after the reduce-scatter
that wrote ``grad`` and before the all-gather that reads ``send``, by using
the same stream or events. ``grad`` must stay unchanged until the kernel
has run. The moments, and the group index, belong to the optimizer and live
as long as it does; the constructor writes both on the current stream, so a
first step on another stream waits for that stream (one synchronize will do).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from .. import _dtypes
from .._errors import TideInvalid
from ..backends.cuda import kernels as _kernels
from ..backends.cuda.streams import on_stream
from ._norm import GlobalNorm, host_sum_squares

#: An array of the optimizer's array module (numpy.ndarray or cupy.ndarray).
Array = Any

#: Threads per block of the AdamW kernel.
BLOCK = 256
#: Most blocks per launch (the grid-stride loop covers the rest): far more than
#: enough resident threads to saturate memory on any current GPU.
MAX_BLOCKS = 65535
#: Elements per pass of the NumPy path: its temporaries stay in cache.
HOST_CHUNK = 1 << 16
#: Kernel per send dtype.
KERNELS = {"bfloat16": "adamw_bf16", "float16": "adamw_f16", "float32": "adamw_f32",
           None: "adamw_none"}
#: Kernel per send dtype where parameter groups are given.
GROUPED_KERNELS = {k: v.replace("adamw_", "adamw_grouped_") for k, v in KERNELS.items()}
#: Kernel per send dtype in a captured step: coefficients read from the device.
TABLE_KERNELS = {k: v.replace("adamw_", "adamw_table_") for k, v in KERNELS.items()}
#: Most parameter groups, the default one included: ``ADAMW_MAX_GROUPS`` in
#: ``kernels/adamw.cu``, and what a uint8 group index holds with room to spare.
MAX_GROUPS = 16


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_real(what: str, value: Any, expected: str, ok: bool) -> None:
    """Raise ``TideInvalid`` unless ``value`` is a finite real and ``ok`` holds."""
    if not (_is_real(value) and math.isfinite(value) and ok):
        raise TideInvalid(f"{what}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class AdamW:
    """Hyper-parameters of AdamW, as torch.optim.AdamW spells them."""

    lr: float = 1e-3
    """Learning rate (1e-3); ``FusedAdamW.step(lr=...)`` overrides it per step (see
    there for how one lr scales a group's)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Decay rates of the first and second moment ((0.9, 0.95)), each in [0, 1)."""

    eps: float = 1e-8
    """Added to the bias-corrected ``sqrt(v)`` in the denominator (1e-8), >= 0."""

    weight_decay: float = 0.0
    """Decoupled weight decay (0.0): the master is scaled by ``1 - lr * weight_decay``
    before the update."""

    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this (> 0), or None (default) for no
    clipping. The runtime applies it through :func:`clip_scale` (see
    [Note: clipping])."""

    def __post_init__(self) -> None:
        _check_real("AdamW.lr", self.lr, "a finite real >= 0", _is_real(self.lr) and self.lr >= 0)
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2
                and all(_is_real(x) and 0.0 <= x < 1.0 for x in b)):
            raise TideInvalid(f"AdamW.betas: expected two reals in [0, 1), got {b!r}")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))  # hashable, plain floats
        _check_real("AdamW.eps", self.eps, "a finite real >= 0",
                    _is_real(self.eps) and self.eps >= 0)
        _check_real("AdamW.weight_decay", self.weight_decay, "a finite real >= 0",
                    _is_real(self.weight_decay) and self.weight_decay >= 0)
        if self.max_grad_norm is not None:
            _check_real("AdamW.max_grad_norm", self.max_grad_norm, "None or a finite real > 0",
                        _is_real(self.max_grad_norm) and self.max_grad_norm > 0)


class Coefficients(NamedTuple):
    """The float32 scalars of one step, in the kernel's argument order
    (see [Note: AdamW math])."""

    decay: np.float32
    beta1: np.float32
    omb1: np.float32
    beta2: np.float32
    omb2: np.float32
    eps: np.float32
    step_size: np.float32
    bc2_sqrt: np.float32
    grad_scale: np.float32


def coefficients(hp: AdamW, step: int, lr: float, grad_scale: float) -> Coefficients:
    """Step ``step``'s (1-based) coefficients: float64 on the host, rounded once to float32."""
    b1, b2 = hp.betas
    f = np.float32
    return Coefficients(
        decay=f(1.0 - lr * hp.weight_decay), beta1=f(b1), omb1=f(1.0 - b1), beta2=f(b2),
        omb2=f(1.0 - b2), eps=f(hp.eps), step_size=f(lr / (1.0 - b1**step)),
        bc2_sqrt=f(math.sqrt(1.0 - b2**step)), grad_scale=f(grad_scale))


@dataclass(frozen=True)
class ParamGroup:
    """Elements of the flat master arena with their own hyper-parameters (torch's
    param groups; see [Note: AdamW math]).

    Elements in no group's ranges form the default group (index 0), which uses
    :class:`FusedAdamW`'s ``hp``; ``groups[j]`` is group ``j + 1``.

    Raises:
        TideInvalid: ``hp`` is not an AdamW or clips, or a range is not two
            integers ``0 <= start <= stop``.
    """

    hp: AdamW
    """The group's hyper-parameters. ``max_grad_norm`` must be None: clipping is
    global, and :class:`FusedAdamW`'s ``hp`` sets it."""

    ranges: tuple[tuple[int, int], ...]
    """Element ranges ``(start, stop)`` (``[start, stop)``) of the arena,
    ``0 <= start <= stop``, overlapping no other range of any group (checked by
    :class:`FusedAdamW`, which knows the arena). Empty ranges, or none at all,
    are allowed: a rank's shard may hold none of a group, and every rank still
    passes the same groups (so ``step``'s lr sequence is one length)."""

    def __post_init__(self) -> None:
        if not isinstance(self.hp, AdamW):
            raise TideInvalid(f"ParamGroup.hp: expected an AdamW, got {type(self.hp).__name__}")
        if self.hp.max_grad_norm is not None:
            raise TideInvalid("ParamGroup.hp.max_grad_norm: expected None (clipping is global: "
                              f"FusedAdamW's hp sets it), got {self.hp.max_grad_norm!r}")
        if not isinstance(self.ranges, Sequence):
            raise TideInvalid(f"ParamGroup.ranges: expected a sequence of (start, stop), got "
                              f"{type(self.ranges).__name__}")
        for k, r in enumerate(self.ranges):
            if not (isinstance(r, Sequence) and len(r) == 2 and all(map(_is_int, r))
                    and 0 <= r[0] <= r[1]):
                raise TideInvalid(f"ParamGroup.ranges[{k}]: expected (start, stop), integers "
                                  f"with 0 <= start <= stop, got {r!r}")
        # Hashable, plain ints; overlaps, in this group or with others, are found by
        # group_runs, which sees every group at once.
        object.__setattr__(self, "ranges", tuple((int(a), int(b)) for a, b in self.ranges))


#: A run of the arena: elements ``[start, stop)`` that all belong to group ``group``.
Run = tuple[int, int, int]


def _append_run(runs: list[Run], start: int, stop: int, group: int) -> None:
    """Append ``[start, stop)`` of ``group``, merged into the last run where it continues it."""
    if start >= stop:
        return
    if runs and runs[-1][1] == start and runs[-1][2] == group:
        runs[-1] = (runs[-1][0], stop, group)
    else:
        runs.append((start, stop, group))


def group_runs(size: int, groups: Sequence[ParamGroup]) -> tuple[Run, ...]:
    """The arena ``[0, size)`` as maximal runs ``(start, stop, group)``, in order.

    Group 0 is the default (the elements in no range); ``groups[j]`` is group
    ``j + 1``. Runs are never empty; an empty arena has none.

    Raises:
        TideInvalid: more than ``MAX_GROUPS - 1`` groups, an item that is not a
            ParamGroup, a range past the arena, or two ranges that overlap (of one
            group or two).
    """
    if len(groups) >= MAX_GROUPS:
        raise TideInvalid(f"groups: expected at most {MAX_GROUPS - 1} groups ({MAX_GROUPS} with "
                          f"the default one), got {len(groups)}")
    for j, g in enumerate(groups):
        if not isinstance(g, ParamGroup):
            raise TideInvalid(f"groups[{j}]: expected a ParamGroup, got {type(g).__name__}")
        for r in g.ranges:
            if r[1] > size:
                raise TideInvalid(f"groups[{j}].ranges: expected ranges inside the arena "
                                  f"[0, {size}), got {r}")
    spans = sorted((a, b, j) for j, g in enumerate(groups, start=1) for a, b in g.ranges if a < b)
    runs: list[Run] = []
    pos, owner = 0, 0
    for a, b, j in spans:
        if a < pos:  # sorted by start, so only the span before can overlap this one
            raise TideInvalid(f"groups[{j - 1}].ranges: expected ranges that overlap no other, "
                              f"got {(a, b)}, which overlaps a range of groups[{owner - 1}] "
                              f"ending at {pos}")
        _append_run(runs, pos, a, 0)
        _append_run(runs, a, b, j)
        pos, owner = b, j
    _append_run(runs, pos, size, 0)
    return tuple(runs)


#: The kernel argument ``CoeffTable`` of ``kernels/adamw.cu``: ``MAX_GROUPS`` rows
#: of :class:`Coefficients`, float32, in their order.
_COEFF_TABLE = np.dtype([("c", np.float32, (MAX_GROUPS, len(Coefficients._fields)))])


def _coeff_table(cs: Sequence[Coefficients]) -> np.ndarray:
    """Every group's coefficients as one ``CoeffTable``; rows past the last group stay zero.

    A NumPy array of one element, because that is how CuPy (10 and later) passes
    a struct by value: it hands the array's bytes to the launch, which copies
    them (``CNumpyArray`` in ``cupy/cuda/function.pyx``). So a step uploads
    nothing itself, and the array may go once the launch returns.
    """
    table = np.zeros(1, _COEFF_TABLE)
    table["c"][0, :len(cs)] = cs
    return table


def clip_scale(total_norm: float, max_norm: Optional[float]) -> float:
    """The gradient factor of torch's ``clip_grad_norm_``.

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


def adamw_numpy(master: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray,
                grad: np.ndarray, send: Optional[np.ndarray], c: Coefficients) -> None:
    """One step on NumPy arrays, in place, in [Note: AdamW math]'s order.

    Every ufunc has float32 operands and a float32 ``out``, so no intermediate
    is widened to float64. Works in chunks of :data:`HOST_CHUNK` elements so
    the two temporaries stay small and in cache.
    """
    n = master.size
    g = np.empty(min(n, HOST_CHUNK), np.float32)
    t = np.empty_like(g)
    for lo in range(0, n, HOST_CHUNK):
        hi = min(lo + HOST_CHUNK, n)
        p, m, v, gk, tk = master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], g[:hi - lo], t[:hi - lo]
        np.multiply(grad[lo:hi], c.grad_scale, out=gk)
        np.multiply(p, c.decay, out=p)
        np.multiply(m, c.beta1, out=m)
        np.add(m, np.multiply(gk, c.omb1, out=tk), out=m)
        np.multiply(v, c.beta2, out=v)
        np.add(v, np.multiply(np.multiply(gk, gk, out=tk), c.omb2, out=tk), out=v)
        np.add(np.divide(np.sqrt(v, out=tk), c.bc2_sqrt, out=tk), c.eps, out=tk)  # denom
        np.multiply(np.divide(m, tk, out=tk), c.step_size, out=tk)
        np.subtract(p, tk, out=p)
        if send is not None:
            send[lo:hi] = p  # the cast rounds to nearest even (ml_dtypes and NumPy alike)


class FusedAdamW:
    """Fused AdamW over flat fp32 shards, also writing the param-dtype send shard.

    Args:
        hp: the hyper-parameters.
        master: the 1-D, contiguous float32 master shard; updated in place.
        send: the 1-D, contiguous send shard of the same length (bfloat16,
            float16 or float32), a separate array, overwritten each step; or
            None for no send shard (gathers that cast the masters).
        xp: the array module of both, ``numpy`` or ``cupy``.
        groups: parameter groups (at most ``MAX_GROUPS - 1``): ``groups[j]`` is
            group ``j + 1``, and the elements in none of their ranges are the
            default group 0, which uses ``hp``. None (or none) steps the whole
            arena with ``hp``, as one kernel without a group index.

    Raises:
        TideInvalid: an argument does not fit the above.

    The constructor allocates the two zeroed float32 moments (on the master's
    device) and, for cupy where some element is in a group, the uint8 group
    index (one byte an element, read each step); it does nothing else, and
    the kernel is compiled at the first step.
    """

    def __init__(self, hp: AdamW, master: Array, send: Optional[Array], xp: Any,
                 groups: Optional[Sequence[ParamGroup]] = None) -> None:
        if not isinstance(hp, AdamW):
            raise TideInvalid(f"hp: expected an AdamW, got {type(hp).__name__}")
        if xp is not np and getattr(xp, "__name__", None) != "cupy":
            raise TideInvalid(f"xp: expected the numpy or cupy module, got {xp!r}")
        self._hp, self._xp = hp, xp
        self._check_vector("master", master, getattr(master, "size", 0))
        self._master = master
        if send is not None:
            self._check_send(send)
        self._send = send
        self._kind = None if send is None else _dtypes.normalize(send.dtype).name
        if groups is not None and not isinstance(groups, Sequence):
            raise TideInvalid(f"groups: expected None or a sequence of ParamGroup, got "
                              f"{type(groups).__name__}")
        self._groups: tuple[ParamGroup, ...] = () if groups is None else tuple(groups)
        self._runs = group_runs(master.size, self._groups)
        self._hps = (hp, *(g.hp for g in self._groups))
        self._group_index = self._build_group_index()
        with self._device():
            self._exp_avg = xp.zeros(master.size, dtype=np.float32)
            self._exp_avg_sq = xp.zeros(master.size, dtype=np.float32)
        self._kernel: Any = None  # compiled at the first cupy step
        self._norm: Any = None  # sum_squares' kernels (cupy), made at its first call
        self.coeff_dev: Any = None  # a captured step's coefficients (prepare_capture)
        self._table_kernel: Any = None  # and the kernel that reads them
        self.captured_grad_scale: Optional[float] = None
        self.step_count = 0
        """Steps taken; step ``k`` (1-based) uses bias corrections ``1 - beta**k``."""

    @property
    def hp(self) -> AdamW:
        """The hyper-parameters."""
        return self._hp

    @property
    def groups(self) -> tuple[ParamGroup, ...]:
        """The parameter groups given, without the default one (group ``j + 1`` is
        ``groups[j]``)."""
        return self._groups

    @property
    def num_groups(self) -> int:
        """How many groups ``step``'s lr sequence has: the default one and :attr:`groups`."""
        return len(self._hps)

    @property
    def exp_avg(self) -> Array:
        """The first moment (float32, the master's length), updated in place."""
        return self._exp_avg

    @property
    def exp_avg_sq(self) -> Array:
        """The second moment (float32, the master's length), updated in place."""
        return self._exp_avg_sq

    @property
    def table_layout(self) -> tuple[int, int, int]:
        """Where a captured step's ``grad_scale`` lies in :attr:`coeff_dev`: ``(rows,
        width, field)``, its groups' rows, their width in floats and the field's index."""
        fields = Coefficients._fields
        return len(self._hps), len(fields), fields.index("grad_scale")

    def sum_squares(self, grad: Array, *, stream: Any = None) -> float:
        """Sum of squares of this rank's fp32 gradient shard, accumulated in float64.

        Waits for the result (a host sync); only clipping needs it (see
        [Note: clipping]).

        Args:
            grad: the float32 gradient shard, the master's length.
            stream: cupy stream to run on (None: the current one); ignored for NumPy.

        Raises:
            TideInvalid: ``grad`` does not match the master.
        """
        self._check_vector("grad", grad, self._master.size)
        if self._xp is np:
            return host_sum_squares(grad)
        if self._norm is None:
            with self._device():
                self._norm = GlobalNorm(None, 1, self._xp)
        with self._device():
            return self._norm.sum_squares(grad, stream)

    def step(self, grad: Array, *, grad_scale: float = 1.0,
             lr: Union[float, Sequence[float], None] = None, stream: Any = None) -> None:
        """One AdamW step: master, moments and send shard, in one pass.

        Args:
            grad: the float32 gradient shard, the master's length.
            grad_scale: multiplies the gradient first (clipping, averaging; see
                [Note: clipping]).
            lr: this step's learning rate (a scheduler's). None: each group's own
                ``hp.lr``. A real: the default group's lr, and every other group's
                lr is its ``hp.lr`` times ``lr / hp.lr`` (so a scheduler driving one
                number keeps the groups' ratios, and a frozen group stays frozen);
                with groups and ``hp.lr == 0`` there is no ratio, and a real is
                refused. A sequence: one lr per group, the default first
                (:attr:`num_groups` of them).
            stream: cupy stream to enqueue on (None: the current one); ignored for
                NumPy. See [Note: optimizer streams].

        Raises:
            TideInvalid: ``grad`` does not match the master, ``grad_scale`` is not
                a real number, or ``lr`` does not fit the above (each lr a finite
                real >= 0).

        See Also:
            ``kernels/adamw.cu`` (cupy), :func:`adamw_numpy` (NumPy).
        """
        self._check_vector("grad", grad, self._master.size)
        lrs = self._group_lrs(lr)
        if not _is_real(grad_scale):
            raise TideInvalid(f"grad_scale: expected a real number, got {grad_scale!r}")
        cs = self._next_step(lrs, grad_scale)
        if self._xp is not np:
            self._step_cupy(grad, cs, stream)
            return
        for lo, hi, j in self._runs:  # no groups: one run, the whole arena
            send = None if self._send is None else self._send[lo:hi]
            adamw_numpy(self._master[lo:hi], self._exp_avg[lo:hi], self._exp_avg_sq[lo:hi],
                        grad[lo:hi], send, cs[j])

    def state_dict(self) -> dict:
        """``{"step": int, "exp_avg": array, "exp_avg_sq": array}``; the arrays are copies."""
        return {"step": self.step_count, "exp_avg": self._exp_avg.copy(),
                "exp_avg_sq": self._exp_avg_sq.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Copy a :meth:`state_dict` into this optimizer's moments and step count.

        Args:
            state: ``step`` (int >= 0) and the two moments, each of the master's
                length; NumPy or CuPy arrays, converted to float32.

        Raises:
            TideInvalid: a key is missing or a value has the wrong type or length.
        """
        missing = {"step", "exp_avg", "exp_avg_sq"} - set(state)
        if missing:
            raise TideInvalid(f"state: expected keys step, exp_avg, exp_avg_sq, "
                              f"got {sorted(state)} (missing {sorted(missing)})")
        step = state["step"]
        if not (_is_int(step) and step >= 0):
            raise TideInvalid(f"state['step']: expected an int >= 0, got {step!r}")
        moments = [self._to_module(f"state[{k!r}]", state[k]) for k in ("exp_avg", "exp_avg_sq")]
        with self._device():
            self._xp.copyto(self._exp_avg, moments[0], casting="same_kind")
            self._xp.copyto(self._exp_avg_sq, moments[1], casting="same_kind")
        self.step_count = int(step)

    # -- private --------------------------------------------------------------------------

    def _group_lrs(self, lr: Any) -> tuple[float, ...]:
        """One learning rate per group, the default first, from ``step``'s ``lr``."""
        if lr is None:
            return tuple(float(h.lr) for h in self._hps)
        if isinstance(lr, Sequence) and not isinstance(lr, str):
            if len(lr) != len(self._hps):
                raise TideInvalid(f"lr: expected None, a real or {len(self._hps)} reals (one "
                                  f"per group, the default first), got {len(lr)} values")
            for j, x in enumerate(lr):
                _check_real(f"lr[{j}]", x, "a finite real >= 0", _is_real(x) and x >= 0)
            return tuple(float(x) for x in lr)
        _check_real("lr", lr, "a finite real >= 0", _is_real(lr) and lr >= 0)
        if len(self._hps) == 1:
            return (float(lr),)
        if self._hp.lr == 0:
            raise TideInvalid(f"lr: expected None or {len(self._hps)} reals (hp.lr is 0, so one "
                              f"lr gives no ratio to scale the groups' by), got {lr!r}")
        ratio = float(lr) / self._hp.lr
        return (float(lr), *(h.lr * ratio for h in self._hps[1:]))

    def _build_group_index(self) -> Optional[Array]:
        """Each element's group as uint8 on the device; None for NumPy (which steps
        run by run) or where every element is in the default group."""
        if self._xp is np or all(j == 0 for _, _, j in self._runs):
            return None
        with self._device():
            index = self._xp.zeros(self._master.size, dtype=np.uint8)
            for lo, hi, j in self._runs:
                if j:
                    index[lo:hi] = j
        return index

    def _step_cupy(self, grad: Array, cs: Sequence[Coefficients], stream: Any) -> None:
        import cupy

        n = self._master.size
        if n == 0:
            return
        dev = self._master.device.id
        if self._kernel is None:
            names = KERNELS if self._group_index is None else GROUPED_KERNELS
            self._kernel = _kernels.function("adamw.cu", names[self._kind], dev)
        # bf16 and fp16 travel as raw 16-bit words: the kernel rounds them itself.
        if self._send is None:  # adamw_none ignores it: any float32 array will do
            send = self._master
        elif self._kind == "float32":
            send = self._send
        else:
            send = self._send.view(cupy.uint16)
        blocks = min(-(-n // BLOCK), MAX_BLOCKS)
        with self._device(), on_stream(stream):
            if cupy.cuda.get_current_stream().is_capturing():  # [Note: captured steps] in _graph
                if self._table_kernel is None:
                    raise TideInvalid("a captured optimizer step: expected prepare_capture() "
                                      "before the capture, got none")
                index = np.uint64(0) if self._group_index is None else self._group_index
                kernel, coeffs = self._table_kernel, (index, self.coeff_dev)
                self.captured_grad_scale = cs[0].grad_scale
            elif self._group_index is None:  # the default group only: nine floats
                kernel, coeffs = self._kernel, tuple(cs[0])
            else:  # the table goes by value, so a step copies nothing to the device
                kernel, coeffs = self._kernel, (self._group_index, _coeff_table(cs))
            kernel((blocks,), (BLOCK,), (self._master, self._exp_avg, self._exp_avg_sq,
                                         grad, send, np.int64(n), *coeffs))

    def _next_step(self, lrs: Sequence[float], grad_scale: float) -> list[Coefficients]:
        """Count one step; its coefficients, one set per group."""
        self.step_count += 1
        return [coefficients(h, self.step_count, x, float(grad_scale))
                for h, x in zip(self._hps, lrs)]

    def prepare_capture(self) -> None:
        """Make what a captured step reads, outside the capture: the device table of
        coefficients and its kernel ([Note: captured steps] in ``_graph``)."""
        if self._xp is np or self.coeff_dev is not None:
            return
        with self._device():
            self.coeff_dev = self._xp.zeros(_COEFF_TABLE.itemsize // 4, np.float32)
            self._table_kernel = _kernels.function("adamw.cu", TABLE_KERNELS[self._kind],
                                                   self._master.device.id)

    def stage_step(self, lr: Union[float, Sequence[float], None], grad_scale: float,
                   stream: Any = None) -> None:
        """The next step's coefficients into the device table, on ``stream``, for a
        replayed step to read; counts the step, as :meth:`step` does."""
        table = _coeff_table(self._next_step(self._group_lrs(lr), grad_scale))
        with self._device(), on_stream(stream):
            self.coeff_dev.set(table.view(np.float32), stream=self._xp.cuda.get_current_stream())

    def _device(self) -> Any:
        """Context with the master's GPU current (nothing for NumPy)."""
        if self._xp is np:
            return contextlib.nullcontext()
        return self._xp.cuda.Device(self._master.device.id)

    def _check_vector(self, what: str, a: Any, n: int, dtype: Any = np.float32) -> None:
        """``a`` must be a 1-D, C-contiguous array of this module, dtype and length
        (and, for cupy, on the master's device)."""
        if not isinstance(a, self._xp.ndarray):
            raise TideInvalid(f"{what}: expected a {self._xp.__name__}.ndarray, "
                              f"got {type(a).__name__}")
        got = f"{a.dtype}, shape {a.shape}, contiguous={a.flags.c_contiguous}"
        if a.ndim != 1 or a.size != n or a.dtype != dtype or not a.flags.c_contiguous:
            raise TideInvalid(f"{what}: expected a contiguous 1-D {np.dtype(dtype)} array of "
                              f"{n} elements, got {got}")
        if self._xp is not np and hasattr(self, "_master") and a.device != self._master.device:
            raise TideInvalid(f"{what}: expected an array on device "
                              f"{self._master.device.id}, got device {a.device.id}")

    def _check_send(self, send: Any) -> None:
        if not (_is_array(send) and _dtypes.is_supported(send.dtype)):
            got = getattr(send, "dtype", type(send).__name__)
            raise TideInvalid(f"send: expected a bfloat16, float16 or float32 array, got {got}")
        self._check_vector("send", send, self._master.size, _dtypes.normalize(send.dtype))
        if send is self._master or self._xp.may_share_memory(send, self._master):
            raise TideInvalid("send: expected an array separate from master, got one that "
                              "overlaps it")

    def _to_module(self, what: str, a: Any) -> Array:
        """``a`` as a float32 array of this module, checked against the master's length."""
        if self._xp is np and hasattr(a, "get"):
            a = a.get()  # a cupy array loaded into a NumPy optimizer
        with self._device():
            a = self._xp.asarray(a)
        if a.ndim != 1 or a.size != self._master.size:
            raise TideInvalid(f"{what}: expected a 1-D array of {self._master.size} elements, "
                              f"got shape {a.shape}")
        return a


def _is_array(a: Any) -> bool:
    return all(hasattr(a, k) for k in ("dtype", "ndim", "size", "flags"))
