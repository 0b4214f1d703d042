"""Which coefficient row each element of an AdamW step reads: :class:`RowPlan`.

Host-side bookkeeping over NumPy for ``_optim.FusedAdamW`` (it imports no
CuPy): each parameter's lag behind the step count, the ``(group, lag)`` rows
of a step, the row of each piece of the arena (:data:`SKIP` where its
parameter is absent), the runs of one row that the NumPy path steps, and the
slice fills that bring the device's uint8 row index up to date.

[Note: absent gradients]
torch.optim.AdamW steps only the parameters whose ``.grad`` is not None: one
without keeps its value and moments, and its ``state['step']`` stays, so its
later bias corrections use its own count. Given ``params`` (each parameter's
element range), :meth:`_optim.FusedAdamW.step`'s ``present`` does the same: an
absent parameter's master, moments and send elements keep their bits, and a
present one's ``k`` is its own count. The elements in no range are one
implicit parameter, present at every step.

Each parameter keeps its lag ``d = step_count - (own count)``: 0 at the
start, kept by a step it is present in, one more after each it misses. (So
code that sets ``step_count``, a loaded checkpoint, moves every count with
it; [Note: step counts] in ``_optim``.) A step's coefficient rows are the distinct
``(group, d)`` pairs of the present parameters' elements, with ``k =
step_count - d``; a pair keeps its row number while it stays in use, and a
new pair takes the lowest free one (at the start group ``j`` at lag 0 has row
``j``). More than :data:`MAX_ROWS` pairs in one step are refused. The arena
is cut into pieces of one group and one parameter (:func:`arena_pieces`);
each piece's row is its pair's, or :data:`SKIP` where its parameter is
absent.

* NumPy: ``tidearray._adamw.adamw_numpy`` over each run of pieces of one row
  (:meth:`RowPlan.host_runs`); SKIP runs are not touched.
* cupy, eager: where every element has one row, no index: the nine-float
  ``adamw_<send>`` kernel, the launch of an ungrouped step; where none
  is present, no launch. Else a uint8 row index (one byte an element) on the
  device, rewritten only for the pieces whose row changed since it was last
  written (slice fills on the step's stream, :meth:`RowPlan.index_fills`);
  the rows go by value to ``adamw_grouped_<send>`` while every row number is
  below ``MAX_GROUPS``, else into a device table (uploaded on the step's
  stream) for ``adamw_table_<send>``. A SKIP element is neither read nor
  written. While every parameter has been present at every step, the row
  numbers are the group numbers: the index is the group index and the
  launches are those of groups alone.
* captured (``_graph``): a graph replays its launch as captured, so the
  presence at the capture holds for every replay: the parameters present
  then advance together, the absent ones stay skipped. The kernel
  (``adamw_table_<send>``) reads the row index and the rows from device
  memory, ``FusedAdamW.coeff_dev``; ``FusedAdamW.stage_step`` makes each
  replay a step of the captured presence: it takes that step's rows from the
  lags as they are then (eager steps between replays may have moved some),
  rewrites the index where it differs, writes each row's coefficients, ``k =
  step_count - d``, and counts the step. Capturing counts no step, so it
  changes no lag. Where the capture found one row for every element it passes
  no index (row 0), as an ungrouped step does; a replay whose present
  parameters no longer share one count (eager steps in between left some
  behind) is refused: capture again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from .._adamw import MAX_GROUPS, ParamGroup, is_int
from .._errors import TideInvalid

#: Most coefficient rows one step uses (distinct (group, lag) pairs; see [Note:
#: absent gradients]), the rows of the device tables: ``ADAMW_MAX_ROWS``.
MAX_ROWS = 254
#: The row index of an element a step leaves alone: ``ADAMW_SKIP``.
SKIP = 255

#: A run of the arena: elements ``[start, stop)`` that all share one label (a group, a
#: parameter or a row).
Run = tuple[int, int, int]


def append_run(runs: list[Run], start: int, stop: int, group: int) -> None:
    """Append ``[start, stop)`` of ``group`` (a label), merged into the last run where it
    continues it."""
    if start >= stop:
        return
    if runs and runs[-1][1] == start and runs[-1][2] == group:
        runs[-1] = (runs[-1][0], stop, group)
    else:
        runs.append((start, stop, group))


def labelled_runs(size: int, spans: Sequence[Run], rest: int,
                  overlap: Callable[[Run, int, int], str]) -> list[Run]:
    """``[0, size)`` as maximal runs ``(start, stop, label)``, in order: ``spans`` (sorted,
    none empty) under their labels, the elements in none under ``rest``.

    Raises:
        TideInvalid: a span overlaps the one before it, with the message ``overlap(span,
            label of the one before, its stop)``.
    """
    runs: list[Run] = []
    pos, owner = 0, rest
    for a, b, j in spans:
        if a < pos:  # sorted by start, so only the span before can overlap this one
            raise TideInvalid(overlap((a, b, j), owner, pos))
        append_run(runs, pos, a, rest)
        append_run(runs, a, b, j)
        pos, owner = b, j
    append_run(runs, pos, size, rest)
    return runs


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
    return tuple(labelled_runs(size, spans, 0, lambda span, owner, end: (
        f"groups[{span[2] - 1}].ranges: expected ranges that overlap no other, got "
        f"{span[:2]}, which overlaps a range of groups[{owner - 1}] ending at {end}")))


def check_params(size: int, params: Any) -> tuple[tuple[int, int], ...]:
    """``params`` as plain ``(start, stop)`` pairs inside ``[0, size)`` (overlaps are
    found by :class:`RowPlan`)."""
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise TideInvalid(f"params: expected None or a sequence of (start, stop), got "
                          f"{type(params).__name__}")
    for i, r in enumerate(params):
        if not (isinstance(r, Sequence) and len(r) == 2 and all(map(is_int, r))
                and 0 <= r[0] <= r[1] <= size):
            raise TideInvalid(f"params[{i}]: expected (start, stop), integers with 0 <= "
                              f"start <= stop <= {size} (the arena's length), got {r!r}")
    return tuple((int(a), int(b)) for a, b in params)


def param_runs(size: int, params: Sequence[tuple[int, int]]) -> list[Run]:
    """``[0, size)`` as runs ``(start, stop, i)`` of parameter ``i``; the elements in no
    range are labelled ``len(params)`` (the implicit parameter).

    Raises:
        TideInvalid: two ranges overlap.
    """
    spans = sorted((a, b, i) for i, (a, b) in enumerate(params) if a < b)
    return labelled_runs(size, spans, len(params), lambda span, owner, _: (
        f"params[{span[2]}]: expected a range that overlaps no other, got {span[:2]}, "
        f"which overlaps params[{owner}] = {params[owner]}"))


class Pieces(NamedTuple):
    """The arena cut wherever its group or its parameter changes (see [Note: absent
    gradients]): piece ``k`` is elements ``[start[k], stop[k])``, all of group
    ``group[k]`` and of parameter ``param[k]`` (``len(params)``: the implicit one).
    int64 arrays, the pieces in arena order, none empty."""

    start: np.ndarray
    stop: np.ndarray
    group: np.ndarray
    param: np.ndarray


def arena_pieces(groups: Sequence[Run], params: Sequence[Run]) -> Pieces:
    """The pieces of two runs of one arena: :func:`group_runs`' and the parameters'."""
    cut: list[tuple[int, int, int, int]] = []
    i = j = 0
    while i < len(groups) and j < len(params):
        (a0, a1, g), (b0, b1, p) = groups[i], params[j]
        lo, hi = max(a0, b0), min(a1, b1)
        if lo < hi:
            cut.append((lo, hi, g, p))
        if a1 <= b1:
            i += 1
        else:
            j += 1
    table = np.array(cut, np.int64).reshape(-1, 4)
    return Pieces(*(np.ascontiguousarray(table[:, c]) for c in range(4)))


def row_runs(pieces: Pieces, rows: np.ndarray, which: Optional[np.ndarray] = None
             ) -> list[Run]:
    """``(start, stop, row)`` runs of consecutive pieces (of ``which``, every one if None)
    that share a row."""
    ks = range(rows.size) if which is None else which.tolist()
    start, stop, row = pieces.start.tolist(), pieces.stop.tolist(), rows.tolist()
    runs: list[Run] = []
    for k in ks:
        append_run(runs, start[k], stop[k], row[k])
    return runs


class Rows(NamedTuple):
    """One step's rows ([Note: absent gradients])."""

    pieces: np.ndarray
    """Each piece's row (uint8), :data:`SKIP` where its parameter is absent."""
    pairs: dict[int, tuple[int, int]]
    """Each row in use: its ``(group, lag)``."""
    one: bool
    """Whether every element has the same row (one pair, nothing skipped)."""


class Captured(NamedTuple):
    """What a captured step fixes for its replays ([Note: absent gradients])."""

    indexed: bool
    """Whether its kernel reads the row index (else row 0 of ``coeff_dev`` for all)."""
    present: np.ndarray
    """Which parameters it steps (the implicit one last)."""

    def pairs(self, rows: Rows) -> dict[int, tuple[int, int]]:
        """The rows a replay of presence ``rows`` writes: ``rows.pairs``, or without an
        index its one pair as row 0.

        Raises:
            TideInvalid: no index, and the present parameters' counts are apart.
        """
        pairs = rows.pairs
        if not self.indexed and pairs:  # the graph reads row 0 for every element
            if not rows.one:
                raise TideInvalid(
                    "stage_step: expected the parameters present at the capture at one step "
                    f"count (its kernel reads one coefficient row), got {len(pairs)} counts, "
                    "as eager steps of another presence since left some behind: capture the "
                    "step again")
            pairs = {0: next(iter(pairs.values()))}
        return pairs


class RowPlan:
    """Each parameter's lag and the coefficient rows of each step ([Note: absent
    gradients]). Host bookkeeping only: the caller owns the step count and the device.

    Args:
        size: the arena's length.
        groups: its group runs (:func:`group_runs`).
        num_groups: how many groups, the default one included.
        params: each parameter's element range, checked to lie in ``[0, size)``.

    Raises:
        TideInvalid: two of ``params`` overlap.
    """

    def __init__(self, size: int, groups: Sequence[Run], num_groups: int,
                 params: Sequence[tuple[int, int]]) -> None:
        self.pieces = arena_pieces(groups, param_runs(size, params))
        """The arena's pieces of one group and one parameter."""
        self._width = num_groups
        self._count = len(params)
        self.lag = np.zeros(len(params) + 1, np.int64)
        """Each parameter's lag, the implicit one's (0) last."""
        self.row_of_pair = {j: j for j in range(num_groups)}
        """The row of each (group, lag) pair in use, keyed lag * num_groups + group."""
        self._index_rows: Optional[np.ndarray] = None  # what the device index holds, per piece
        # The last step's rows and its presence: the next step's too if its presence is
        # the same, as no present parameter's lag has changed (dropped where lags move
        # otherwise: set_lags).
        self._last_rows: Optional[tuple[bytes, Rows]] = None
        self._last_runs: Optional[tuple[Rows, list[Run]]] = None  # NumPy: its runs

    def own_steps(self, step_count: int) -> np.ndarray:
        """Each parameter's own step count at ``step_count`` (int64, a new array)."""
        return step_count - self.lag[:-1]

    def mask(self, present: Any) -> np.ndarray:
        """``step``'s ``present`` as a mask of the parameters, the implicit one (always
        present) last.

        Raises:
            TideInvalid: ``present`` is neither None nor one bool per parameter.
        """
        mask = np.ones(self._count + 1, bool)
        if present is None:
            return mask
        want = self._count
        if isinstance(present, (str, bytes)) or not hasattr(present, "__len__"):
            raise TideInvalid(f"present: expected None or {want} bools (one per parameter), "
                              f"got {type(present).__name__}")
        if len(present) != want:
            raise TideInvalid(f"present: expected None or {want} bools (one per parameter), "
                              f"got {len(present)} values")
        if not (isinstance(present, np.ndarray) and present.dtype == bool):
            for i, x in enumerate(present):
                if not isinstance(x, (bool, np.bool_)):
                    raise TideInvalid(f"present[{i}]: expected a bool, got {x!r}")
        mask[:-1] = np.asarray(present, bool)
        return mask

    def rows(self, mask: np.ndarray) -> Rows:
        """This step's rows: one per present ``(group, lag)`` pair, numbered as at the last
        step where the pair was in use, a new pair the lowest free number ([Note: absent
        gradients]).

        Raises:
            TideInvalid: more than :data:`MAX_ROWS` pairs; nothing has changed then.
        """
        presence = mask.tobytes()
        if self._last_rows is not None and self._last_rows[0] == presence:
            return self._last_rows[1]
        pieces, width = self.pieces, self._width
        on = mask[pieces.param]
        keys = self.lag[pieces.param] * width + pieces.group
        used = np.unique(keys[on])
        if used.size > MAX_ROWS:
            raise TideInvalid(
                f"present: expected at most {MAX_ROWS} distinct (group, own step count) pairs "
                f"among the present parameters (a coefficient row each), got {used.size}: "
                "pass parameters with a zero gradient as present rather than leaving them out "
                "(torch steps a zero .grad too), so that fewer counts drift apart, or use "
                "fewer groups")
        keep = set(used.tolist())
        live = {k: r for k, r in self.row_of_pair.items() if k in keep}
        free = iter(sorted(set(range(MAX_ROWS)) - set(live.values())))
        for k in keep - set(live):
            live[k] = next(free)
        self.row_of_pair = live
        number = np.array([live[k] for k in used.tolist()], np.uint8)
        rows = np.full(on.size, SKIP, np.uint8)
        rows[on] = number[np.searchsorted(used, keys[on])]
        pairs = {live[k]: (k % width, k // width) for k in used.tolist()}
        step_rows = Rows(rows, pairs, len(pairs) == 1 and bool(on.all()))
        self._last_rows = (presence, step_rows)
        return step_rows

    def advance(self, mask: np.ndarray) -> None:
        """Count a step of presence ``mask``: each absent parameter falls one more behind."""
        self.lag[~mask] += 1

    def host_runs(self, rows: Rows) -> list[Run]:
        """The NumPy path's runs of one row for ``rows``, SKIP runs left out (kept while the
        rows are)."""
        if self._last_runs is None or self._last_runs[0] is not rows:
            runs = [r for r in row_runs(self.pieces, rows.pieces) if r[2] != SKIP]
            self._last_runs = (rows, runs)
        return self._last_runs[1]

    def index_fills(self, rows: np.ndarray) -> list[Run]:
        """The slice fills ``(start, stop, row)`` that make the device row index hold
        ``rows`` (one per piece): the pieces whose row differs from what it holds (all
        zero before the first fills, as a new index is), which then count as written."""
        if self._index_rows is None:
            self._index_rows = np.zeros(rows.size, np.uint8)
        changed = np.flatnonzero(self._index_rows != rows)
        fills = row_runs(self.pieces, rows, changed)
        self._index_rows[changed] = rows[changed]
        return fills

    def checked_lags(self, param_steps: Any, step: int) -> np.ndarray:
        """The lags of a state's ``param_steps`` at ``step`` (all 0 where it is None), for
        :meth:`set_lags`.

        Raises:
            TideInvalid: ``param_steps`` is not one integer in ``[0, step]`` a parameter.
        """
        lag = np.zeros(self._count + 1, np.int64)
        if param_steps is None:
            return lag
        got = np.asarray(param_steps.get() if hasattr(param_steps, "get") else param_steps)
        want = self._count
        if not (got.ndim == 1 and got.size == want and (got.dtype.kind in "iu" or not got.size)
                and ((got >= 0) & (got <= step)).all()):
            what = f"{got.dtype} of shape {got.shape}"
            if got.size and got.dtype.kind in "iuf":
                what += f" in [{got.min()}, {got.max()}]"
            raise TideInvalid(f"state['param_steps']: expected {want} integers in [0, {step}] "
                              f"(one per parameter, none past the step), got {what}")
        lag[:-1] = step - got
        return lag

    def set_lags(self, lag: np.ndarray) -> None:
        """Take ``lag`` (from :meth:`checked_lags`) as every parameter's lag."""
        self.lag, self._last_rows = lag, None
