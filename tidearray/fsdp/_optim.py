"""Fused AdamW over the flat fp32 shard arena, writing the param-dtype send shard too.

One pass per step reads the fp32 gradient shard and updates the fp32 master
shard and both moments in place, and writes the send shard (bf16, fp16 or
fp32) that the next all-gather sends: no separate cast. Without a send shard
(``send=None``: the gathers cast the masters themselves, as the ``tide``
runtime does) it writes master and moments only. CuPy arrays run
``kernels/adamw.cu``; NumPy arrays run the same float32 operations with
NumPy's ufuncs.

The update, its hyper-parameters and parameter groups, and the float32
coefficients both paths read are [Note: AdamW math] in ``tidearray/_adamw.py``; this
module runs them.

[Note: optimizer streams]
``step`` (cupy) enqueues its work on ``stream`` (None: the current stream): the
kernel, and the index fills or the row upload it needs, and returns without
waiting. The caller orders it after the reduce-scatter that wrote ``grad``
and before the all-gather that reads ``send``, by using the same stream or
events. ``grad`` must stay unchanged until the kernel has run. The moments,
the row index and the device tables belong to the optimizer and live as long
as it does; the constructor, :meth:`FusedAdamW.prepare_capture` and
:meth:`FusedAdamW.load_state_dict` write the moments, the group index and the
table on the current stream and wait for it before they return, so a first
step may come on any stream ([Note: initialized memory] in
``backends.cuda.streams``); later steps, and :meth:`FusedAdamW.stage_step`,
write the index and tables on their own stream, their coefficients copied from
pinned memory that outlives the copy (the backend's ``uploader``), so the steps of one
optimizer must be ordered (one stream, or events).

[Note: step counts]
The optimizer is the one home of the step count (:attr:`FusedAdamW.step_count`,
and each parameter's own count, ``param_steps``): a step counts when it runs,
an eager :meth:`FusedAdamW.step` after its launch is issued, a replay of a
captured step in :meth:`FusedAdamW.stage_step`. A step issued inside a stream
capture runs nothing and counts nothing (its coefficients are those of the
step it would be, checked as an eager step checks them), so a captured step
(``fsdp._graph``) leaves the counts as it found them, with no one outside
correcting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from .. import _dtypes
from .._adamw import (
    MAX_GROUPS,
    AdamW,
    Coefficients,
    ParamGroup,
    adamw_numpy,
    check_real,
    coefficients,
    is_int,
    is_real,
)
from .._errors import TideInvalid
from ..backends import array_backend
from ._rows import MAX_ROWS, Captured, RowPlan, Rows, check_params, group_runs

#: An array of the optimizer's array module (numpy.ndarray or cupy.ndarray).
Array = Any

#: Threads per block of the AdamW kernel.
BLOCK = 256
#: Most blocks per launch (the grid-stride loop covers the rest): far more than
#: enough resident threads to saturate memory on any current GPU.
MAX_BLOCKS = 65535
#: Kernel per send dtype.
KERNELS = {"bfloat16": "adamw_bf16", "float16": "adamw_f16", "float32": "adamw_f32",
           None: "adamw_none"}
#: Kernel per send dtype where elements differ in their rows: rows by value.
GROUPED_KERNELS = {k: v.replace("adamw_", "adamw_grouped_") for k, v in KERNELS.items()}
#: Kernel per send dtype reading the rows from the device: a captured step, or rows
#: past the by-value table.
TABLE_KERNELS = {k: v.replace("adamw_", "adamw_table_") for k, v in KERNELS.items()}

#: The kernel argument ``CoeffTable`` of ``kernels/adamw.cu``: ``MAX_GROUPS`` rows
#: of :class:`Coefficients`, float32, in their order.
_COEFF_TABLE = np.dtype([("c", np.float32, (MAX_GROUPS, len(Coefficients._fields)))])


class TableLayout(NamedTuple):
    """Where a captured step's ``grad_scale`` lies in :attr:`FusedAdamW.coeff_dev`."""

    #: The rows a captured step may read.
    rows: int
    #: A row's width, in floats.
    width: int
    #: The index of ``grad_scale`` in a row.
    field: int


def _coeff_rows(cs: dict[int, Coefficients], rows: int) -> np.ndarray:
    """Row ``r`` of ``cs`` as row ``r`` of a float32 ``(rows, 9)`` array; the others zero."""
    table = np.zeros((rows, len(Coefficients._fields)), np.float32)
    for r, c in cs.items():
        table[r] = c
    return table


def _coeff_table(cs: dict[int, Coefficients]) -> np.ndarray:
    """The rows ``cs`` (each number below ``MAX_GROUPS``) as one ``CoeffTable``; the
    others stay zero.

    A NumPy array of one element, because that is how CuPy (10 and later) passes
    a struct by value: it hands the array's bytes to the launch, which copies
    them (``CNumpyArray`` in ``cupy/cuda/function.pyx``). So a step uploads
    nothing itself, and the array may go once the launch returns.
    """
    table = np.zeros(1, _COEFF_TABLE)
    table["c"][0] = _coeff_rows(cs, MAX_GROUPS)
    return table


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
        params: each parameter's element range ``(start, stop)`` of the arena
            (``[start, stop)``, ``0 <= start <= stop <= master.size``), in any
            order, overlapping no other; empty ranges are allowed (a parameter
            with none of this shard). The elements in none are one more,
            implicit, parameter, present at every step. Given, each parameter
            keeps its own step count and :meth:`step` takes ``present``, as
            torch.optim.AdamW skips a parameter without a gradient ([Note:
            absent gradients] in ``_rows``). None: no per-parameter counts,
            bitwise as before.

    Raises:
        TideInvalid: an argument does not fit the above.

    The constructor allocates the two zeroed float32 moments (on the master's
    device) and, for cupy where some element is in a group, the uint8 row
    index (one byte an element, read each step; otherwise it is made by the
    first step that needs it); it does nothing else, and the kernels are
    compiled at the first step.
    """

    def __init__(self, hp: AdamW, master: Array, send: Optional[Array], xp: Any,
                 groups: Optional[Sequence[ParamGroup]] = None,
                 params: Optional[Sequence[tuple[int, int]]] = None) -> None:
        if not isinstance(hp, AdamW):
            raise TideInvalid(f"hp: expected an AdamW, got {type(hp).__name__}")
        self._backend = array_backend(xp)  # its streams and kernels ([Note: backend interface])
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
        self._params = () if params is None else check_params(master.size, params)
        self._per_param = params is not None
        # [Note: absent gradients] in _rows: the lags, each step's rows and the index fills.
        self._plan = RowPlan(master.size, self._runs, len(self._hps), self._params)
        self._pieces = self._plan.pieces
        self._index: Optional[Array] = None  # each element's row (cupy, where rows differ)
        with self._backend.on_device(master):
            self._exp_avg = xp.zeros(master.size, dtype=np.float32)
            self._exp_avg_sq = xp.zeros(master.size, dtype=np.float32)
            # the kernels' per-element row index (not routed yet: [Note: backend interface])
            if xp is not np and (self._pieces.group != 0).any():
                self._write_index(self._pieces.group.astype(np.uint8))  # the group index
            self._backend.settle()  # a first step may come on another stream
        self._kernels: dict[str, Any] = {}  # by name, fetched at their first launch
        self._rows_dev: Any = None  # an eager step's rows past the by-value table
        self._upload = self._backend.uploader()  # the coefficient tables' host side, pinned
        self.coeff_dev: Any = None  # a captured step's coefficients (prepare_capture)
        self._captured: Optional[Captured] = None  # and what it reads
        self.step_count = 0
        """Steps taken ([Note: step counts]); a parameter's own count is in
        :attr:`param_steps`."""

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
    def params(self) -> tuple[tuple[int, int], ...]:
        """The parameters' element ranges, as given (none without ``params``)."""
        return self._params

    @property
    def param_steps(self) -> np.ndarray:
        """Each parameter's own step count, the steps it was present in (int64, one per
        :attr:`params`, a copy): its next step's bias corrections use one more."""
        return self._plan.own_steps(self.step_count)

    @property
    def _row_of_pair(self) -> dict[int, int]:
        """The row of each (group, lag) pair in use (:attr:`RowPlan.row_of_pair`)."""
        return self._plan.row_of_pair

    @property
    def exp_avg(self) -> Array:
        """The first moment (float32, the master's length), updated in place."""
        return self._exp_avg

    @property
    def exp_avg_sq(self) -> Array:
        """The second moment (float32, the master's length), updated in place."""
        return self._exp_avg_sq

    @property
    def table_layout(self) -> TableLayout:
        """Where a captured step's ``grad_scale`` lies in :attr:`coeff_dev`: ``(rows,
        width, field)``, the rows a captured step may read, their width in floats and the
        field's index. ``rows`` is every row of the table (``MAX_ROWS``): a clip writes
        them before the step it scales is issued, and that step picks its rows from
        which parameters are present ([Note: absent gradients] in ``_rows``)."""
        fields = Coefficients._fields
        return TableLayout(MAX_ROWS, len(fields), fields.index("grad_scale"))

    def step(self, grad: Array, *, grad_scale: float = 1.0,
             lr: Union[float, Sequence[float], None] = None, stream: Any = None,
             present: Optional[Sequence[bool]] = None) -> None:
        """One AdamW step: master, moments and send shard, in one pass.

        Args:
            grad: the float32 gradient shard, the master's length.
            grad_scale: multiplies the gradient first (clipping, averaging; see
                [Note: clipping] in ``_norm``).
            lr: this step's learning rate (a scheduler's). None: each group's own
                ``hp.lr``. A real: the default group's lr, and every other group's
                lr is its ``hp.lr`` times ``lr / hp.lr`` (so a scheduler driving one
                number keeps the groups' ratios, and a frozen group stays frozen);
                with groups and ``hp.lr == 0`` there is no ratio, and a real is
                refused. A sequence: one lr per group, the default first
                (:attr:`num_groups` of them).
            stream: cupy stream to enqueue on (None: the current one); ignored for
                NumPy. See [Note: optimizer streams].
            present: whether each parameter (of :attr:`params`) has a gradient this
                step; None: every one. An absent one is skipped, as torch skips a
                ``.grad`` of None: its master, moments and send elements keep their
                bits, and its own step count stays ([Note: absent gradients] in
                ``_rows``). ``grad``'s elements there are not read.

        Raises:
            TideInvalid: ``grad`` does not match the master, ``grad_scale`` is not
                a real number, ``lr`` does not fit the above (each lr a finite
                real >= 0), ``present`` is not one bool per parameter, or the
                step would need more than ``MAX_ROWS`` coefficient rows. Nothing
                has changed then.

        See Also:
            ``kernels/adamw.cu`` (cupy), :func:`adamw_numpy` (NumPy).
        """
        self._check_vector("grad", grad, self._master.size)
        lrs = self._group_lrs(lr)
        if not is_real(grad_scale):
            raise TideInvalid(f"grad_scale: expected a real number, got {grad_scale!r}")
        mask = self._plan.mask(present)
        rows = self._plan.rows(mask)
        cs = self._coefficients(rows.pairs, lrs, float(grad_scale), self.step_count + 1)
        if self._xp is not np:  # kernels or NumPy (not routed yet: [Note: backend interface])
            if self._step_cupy(grad, rows, cs, mask, stream):
                return  # captured: only the replays count ([Note: step counts])
        else:
            for lo, hi, r in self._plan.host_runs(rows):  # one row: one run, the whole arena
                send = None if self._send is None else self._send[lo:hi]
                adamw_numpy(self._master[lo:hi], self._exp_avg[lo:hi], self._exp_avg_sq[lo:hi],
                            grad[lo:hi], send, cs[r])
        self.step_count += 1
        self._plan.advance(mask)

    def state_dict(self) -> dict:
        """``{"step": int, "exp_avg": array, "exp_avg_sq": array}``, and ``"param_steps"``
        (:attr:`param_steps`) where ``params`` were given; the arrays are copies."""
        state = {"step": self.step_count, "exp_avg": self._exp_avg.copy(),
                 "exp_avg_sq": self._exp_avg_sq.copy()}
        if self._per_param:
            state["param_steps"] = self.param_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        """Copy a :meth:`state_dict` into this optimizer's moments and step counts.

        Args:
            state: ``step`` (int >= 0) and the two moments, each of the master's
                length (NumPy or CuPy arrays, converted to float32); and
                ``param_steps``, one integer in ``[0, step]`` per parameter, or
                none: then every parameter's count is ``step`` (a state saved
                before per-parameter counts, or without ``params``, loads so).

        Raises:
            TideInvalid: a key is missing or a value has the wrong type or length.
        """
        missing = {"step", "exp_avg", "exp_avg_sq"} - set(state)
        if missing:
            raise TideInvalid(f"state: expected keys step, exp_avg, exp_avg_sq, "
                              f"got {sorted(state)} (missing {sorted(missing)})")
        step = state["step"]
        if not (is_int(step) and step >= 0):
            raise TideInvalid(f"state['step']: expected an int >= 0, got {step!r}")
        lag = self._plan.checked_lags(state.get("param_steps"), int(step))
        moments = [self._to_module(f"state[{k!r}]", state[k]) for k in ("exp_avg", "exp_avg_sq")]
        with self._backend.on_device(self._master):
            self._xp.copyto(self._exp_avg, moments[0], casting="same_kind")
            self._xp.copyto(self._exp_avg_sq, moments[1], casting="same_kind")
            self._backend.settle()  # the next step may come on another stream
        self.step_count = int(step)
        self._plan.set_lags(lag)

    def prepare_capture(self) -> None:
        """Make what a captured step reads, outside the capture: the device table of
        coefficients, the row index (where the arena has more than one piece) and the
        kernel ([Note: captured steps] in ``_graph``)."""
        if not self._backend.graphs or self.coeff_dev is not None:
            return
        with self._backend.on_device(self._master):
            self.coeff_dev = self._xp.zeros(MAX_ROWS * len(Coefficients._fields), np.float32)
            if self._index is None and self._pieces.start.size > 1:
                self._write_index(np.zeros(self._pieces.start.size, np.uint8))  # allocates
            self._kernel(TABLE_KERNELS)
            self._backend.settle()  # the replays' stream may not wait for these zeros

    def stage_step(self, lr: Union[float, Sequence[float], None], grad_scale: float,
                   stream: Any = None) -> None:
        """Ready the next replay of the captured step, on ``stream``: a step of the
        presence at the capture, whose row index (where it differs) and rows'
        coefficients go to the device for the graph to read. Counts the step, as
        :meth:`step` does: the parameters absent at the capture fall one more step
        behind ([Note: absent gradients] in ``_rows``).

        Args:
            lr: as :meth:`step` takes it.
            grad_scale: the ``grad_scale`` the captured step was issued with (a clip on
                the device overwrites it in the table, after this copy).
            stream: the stream the replay launches on.

        Raises:
            TideInvalid: no step was captured, ``lr`` does not fit :meth:`step`'s, the
                rows outgrow ``MAX_ROWS``, or a capture without an index finds its
                parameters' counts apart.
        """
        cap = self._captured
        if cap is None:
            raise TideInvalid("stage_step: expected a captured step (prepare_capture(), then "
                              "step() inside a stream capture), got none")
        lrs = self._group_lrs(lr)
        rows = self._plan.rows(cap.present)
        pairs = cap.pairs(rows)
        cs = self._coefficients(pairs, lrs, float(grad_scale), self.step_count + 1)
        with self._backend.on_device(self._master), self._backend.on_stream(stream):
            if cap.indexed:
                self._write_index(rows.pieces)
            if cs:
                self._upload(self.coeff_dev, _coeff_rows(cs, max(cs) + 1))
        self.step_count += 1
        self._plan.advance(cap.present)

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
                check_real(f"lr[{j}]", x, "a finite real >= 0", is_real(x) and x >= 0)
            return tuple(float(x) for x in lr)
        check_real("lr", lr, "a finite real >= 0", is_real(lr) and lr >= 0)
        if len(self._hps) == 1:
            return (float(lr),)
        if self._hp.lr == 0:
            raise TideInvalid(f"lr: expected None or {len(self._hps)} reals (hp.lr is 0, so one "
                              f"lr gives no ratio to scale the groups' by), got {lr!r}")
        ratio = float(lr) / self._hp.lr
        return (float(lr), *(h.lr * ratio for h in self._hps[1:]))

    def _coefficients(self, pairs: dict[int, tuple[int, int]], lrs: Sequence[float],
                      grad_scale: float, step: int) -> dict[int, Coefficients]:
        """Each row's coefficients at step ``step`` (the one being taken): its group's, at
        the group's lr and the row's own step count ``step - lag``."""
        return {r: coefficients(self._hps[g], step - lag, lrs[g], grad_scale)
                for r, (g, lag) in pairs.items()}

    def _step_cupy(self, grad: Array, rows: Rows, cs: dict[int, Coefficients],
                   mask: np.ndarray, stream: Any) -> bool:
        """Enqueue the step on ``stream``; True where it was captured instead."""
        with self._backend.on_device(self._master), self._backend.on_stream(stream):
            if self._backend.capturing():  # [Note: captured steps] in _graph
                self._capture(grad, rows, mask)
                return True
            if self._master.size == 0 or not cs:
                return False  # nothing present: nothing to do
            if rows.one:  # one row: nine floats, as without groups
                self._launch(KERNELS, grad, tuple(next(iter(cs.values()))))
                return False
            self._write_index(rows.pieces)
            if max(cs) < MAX_GROUPS:  # the table goes by value: a step copies nothing
                self._launch(GROUPED_KERNELS, grad, (self._index, _coeff_table(cs)))
                return False
            if self._rows_dev is None:
                self._rows_dev = self._xp.zeros(MAX_ROWS * len(Coefficients._fields),
                                                np.float32)
            self._upload(self._rows_dev, _coeff_rows(cs, max(cs) + 1))
            self._launch(TABLE_KERNELS, grad, (self._index, self._rows_dev))
        return False

    def _capture(self, grad: Array, rows: Rows, mask: np.ndarray) -> None:
        """The step inside a capture: the table kernel, reading :attr:`coeff_dev` and, unless
        every element has one row, the row index, which :meth:`stage_step` writes before
        each replay (a capture runs nothing)."""
        if self.coeff_dev is None:
            raise TideInvalid("a captured optimizer step: expected prepare_capture() "
                              "before the capture, got none")
        self._captured = Captured(bool(rows.pairs) and not rows.one, mask)
        if not rows.pairs or not self._master.size:  # nothing present: nothing to launch
            return
        # Not one row: more than one piece, so prepare_capture made the index.
        index = np.uint64(0) if rows.one else self._index
        self._launch(TABLE_KERNELS, grad, (index, self.coeff_dev))

    def _kernel(self, names: dict) -> Any:
        """The kernel of ``names`` for this send dtype, fetched once."""
        name = names[self._kind]
        if name not in self._kernels:
            self._kernels[name] = self._backend.kernel("adamw.cu", name, self._master)
        return self._kernels[name]

    def _launch(self, names: dict, grad: Array, coeffs: tuple) -> None:
        """The kernel of ``names`` over the arena on the current stream, with ``coeffs``
        after the arrays and the length."""
        # bf16 and fp16 travel as raw 16-bit words: the kernel rounds them itself.
        if self._send is None:  # adamw_none ignores it: any float32 array will do
            send = self._master
        elif self._kind == "float32":
            send = self._send
        else:
            send = self._send.view(np.uint16)
        n = self._master.size
        blocks = min(-(-n // BLOCK), MAX_BLOCKS)
        self._kernel(names)((blocks,), (BLOCK,), (self._master, self._exp_avg, self._exp_avg_sq,
                                                 grad, send, np.int64(n), *coeffs))

    def _write_index(self, rows: np.ndarray) -> None:
        """Make the device row index hold ``rows`` (one per piece), on the current stream,
        filling only the pieces whose row differs from what it holds (made, zero, at the
        first call)."""
        if self._index is None:
            self._index = self._xp.zeros(self._master.size, dtype=np.uint8)
        for lo, hi, r in self._plan.index_fills(rows):
            self._index[lo:hi] = r

    def _check_vector(self, what: str, a: Any, n: int, dtype: Any = np.float32) -> None:
        """``a`` must be a 1-D, C-contiguous array of this module, dtype and length
        (and on the master's device)."""
        if not isinstance(a, self._xp.ndarray):
            raise TideInvalid(f"{what}: expected a {self._xp.__name__}.ndarray, "
                              f"got {type(a).__name__}")
        got = f"{a.dtype}, shape {a.shape}, contiguous={a.flags.c_contiguous}"
        if a.ndim != 1 or a.size != n or a.dtype != dtype or not a.flags.c_contiguous:
            raise TideInvalid(f"{what}: expected a contiguous 1-D {np.dtype(dtype)} array of "
                              f"{n} elements, got {got}")
        # cupy: a Device; NumPy 2: "cpu" (older NumPy and the master itself: nothing to check)
        want = getattr(getattr(self, "_master", None), "device", None)
        if want is not None and a.device != want:
            raise TideInvalid(f"{what}: expected an array on device {getattr(want, 'id', want)}, "
                              f"got device {getattr(a.device, 'id', a.device)}")

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
        with self._backend.on_device(self._master):
            a = self._backend.asarray(a)  # a cupy array comes down to a NumPy optimizer
        if a.ndim != 1 or a.size != self._master.size:
            raise TideInvalid(f"{what}: expected a 1-D array of {self._master.size} elements, "
                              f"got shape {a.shape}")
        return a


def _is_array(a: Any) -> bool:
    return all(hasattr(a, k) for k in ("dtype", "ndim", "size", "flags"))
