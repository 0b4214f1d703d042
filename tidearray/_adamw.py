"""AdamW's hyper-parameters and arithmetic, on the host: :class:`AdamW`, parameter
groups, a step's float32 coefficients, and the step itself on NumPy arrays.

Neutral ground: it imports neither the runtime nor a backend, so ``tidearray.fsdp`` and
``tidearray.jax`` both take their hyper-parameters and coefficients from here, and
importing ``tidearray.jax`` loads no part of the runtime.

Pure host code over NumPy: it launches nothing. :class:`FusedAdamW` (``_optim``)
runs this update over the flat fp32 shard arena, with ``kernels/adamw.cu``
(cupy) or :func:`adamw_numpy` (NumPy); ``tidearray.jax``'s ``ShardAdamW`` takes
the same :func:`coefficients`.

[Note: AdamW math]
torch.optim.AdamW's formulation (decoupled weight decay), per element in
float32, every operation rounded to nearest even, where ``k`` is the step
count of the element's parameter (1-based, this step included; without
``params`` every element's is :attr:`FusedAdamW.step_count`; see [Note:
absent gradients] in ``_rows``):

    g     = grad * grad_scale
    p     = master * decay                     decay     = 1 - lr * weight_decay
    m     = beta1 * m + omb1 * g               omb1      = 1 - beta1
    v     = beta2 * v + omb2 * (g * g)         omb2      = 1 - beta2
    denom = sqrt(v) / bc2_sqrt + eps           bc2_sqrt  = sqrt(1 - beta2**k)
    p     = p - step_size * (m / denom)        step_size = lr / (1 - beta1**k)
    master = p; exp_avg = m; exp_avg_sq = v; send = round_to_nearest_even(p)

The right-hand coefficients are computed once per step and coefficient row
(one group at one ``k``) on the host in float64 and rounded once to float32
(:func:`coefficients`); both paths read those same float32 values. The
kernel spells every operation as a ``_rn`` intrinsic (no FMA contraction,
IEEE division and sqrt), and NumPy's float32 ufuncs round each operation the
same way, so the two paths agree bitwise. The one exception is NaN sent as
fp16: both give a NaN, with different payload bits. torch's own CPU path
does not round the same way (``lerp`` for ``m``, ``addcmul`` and
``addcdiv`` multiply in another order), so it agrees to a few float32
roundings a step, not bitwise.

Parameter groups (:class:`ParamGroup`, torch's ``param_groups``) give element
ranges of the arena their own ``lr``, ``betas``, ``eps`` and ``weight_decay``;
the elements in no range form the default group 0, which uses ``hp``. Each
group's coefficients come from :func:`coefficients` with its own
hyper-parameters and ``k``, so an element's update is the one above with its
row's float32 values. A frozen group (``lr = 0``, ``weight_decay = 0``) has
``decay = 1`` and ``step_size = 0``: its masters stay bitwise as they were
(its send elements their rounding) while ``m / denom`` is finite (finite
gradients, ``eps > 0``), except that -0.0 can become +0.0; its moments still
advance. Both as in torch. NumPy runs :func:`adamw_numpy` once per run of
one row; the kernel reads each element's row from a uint8 index array on the
device (where the rows differ at all).

[Note: clipping] is in ``_norm``: the runtime clips, since the global norm
spans every rank's shard, and passes the clip factor (times the averaging) as
``grad_scale``; in a captured step the device writes ``grad_scale`` into the
coefficient table itself (:attr:`FusedAdamW.table_layout`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from ._errors import TideInvalid

#: Elements per chunk of the host paths (NumPy's AdamW step, the gradient norm): the
#: float64 and float32 temporaries stay chunk-sized and in cache.
HOST_CHUNK = 1 << 16

#: Most parameter groups, the default one included, and the rows of the by-value
#: table: ``ADAMW_MAX_GROUPS`` in ``kernels/adamw.cu``.
MAX_GROUPS = 16


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_real(what: str, value: Any, expected: str, ok: bool) -> None:
    """Raise ``TideInvalid`` unless ``value`` is a finite real and ``ok`` holds."""
    if not (is_real(value) and math.isfinite(value) and ok):
        raise TideInvalid(f"{what}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class AdamW:
    """Hyper-parameters of AdamW, as torch.optim.AdamW spells them. The defaults are not
    torch's (``betas=(0.9, 0.999)``, ``weight_decay=0.01``) but those of LLM pre-training:
    a loop moved over from torch spells out what it used."""

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
    clipping. The optimizer does not read it: the norm spans every rank, so
    :class:`~tidearray.fsdp.Runtime` clips, and takes this as its
    ``max_grad_norm`` where that is not given ([Note: clipping] in ``_norm``)."""

    def __post_init__(self) -> None:
        check_real("AdamW.lr", self.lr, "a finite real >= 0", is_real(self.lr) and self.lr >= 0)
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2
                and all(is_real(x) and 0.0 <= x < 1.0 for x in b)):
            raise TideInvalid(f"AdamW.betas: expected two reals in [0, 1), got {b!r}")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))  # hashable, plain floats
        check_real("AdamW.eps", self.eps, "a finite real >= 0",
                    is_real(self.eps) and self.eps >= 0)
        check_real("AdamW.weight_decay", self.weight_decay, "a finite real >= 0",
                    is_real(self.weight_decay) and self.weight_decay >= 0)
        if self.max_grad_norm is not None:
            check_real("AdamW.max_grad_norm", self.max_grad_norm, "None or a finite real > 0",
                        is_real(self.max_grad_norm) and self.max_grad_norm > 0)


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
    """The coefficients of a parameter's step ``step`` (its own count, 1-based): float64 on
    the host, rounded once to float32."""
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
    global, one limit for the whole model (``Runtime``'s)."""

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
                              f"one limit for the model), got {self.hp.max_grad_norm!r}")
        if not isinstance(self.ranges, Sequence):
            raise TideInvalid(f"ParamGroup.ranges: expected a sequence of (start, stop), got "
                              f"{type(self.ranges).__name__}")
        for k, r in enumerate(self.ranges):
            if not (isinstance(r, Sequence) and len(r) == 2 and all(map(is_int, r))
                    and 0 <= r[0] <= r[1]):
                raise TideInvalid(f"ParamGroup.ranges[{k}]: expected (start, stop), integers "
                                  f"with 0 <= start <= stop, got {r!r}")
        # Hashable, plain ints; overlaps, in this group or with others, are found by
        # group_runs, which sees every group at once.
        object.__setattr__(self, "ranges", tuple((int(a), int(b)) for a, b in self.ranges))


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
