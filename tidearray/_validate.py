"""Collective validation: every rank raises the same TideInvalid, before any transfer.

The fast path is one small agreement (``Group.agree_max``: shared memory on
one node, else ``Allreduce``): a 56-bit digest of the call's signature and a
count of local errors. Only when digests differ or some rank
found an error do ranks exchange descriptions, to name the rank and parameter.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import _dtypes
from ._errors import TideInvalid

if TYPE_CHECKING:
    from ._group import Group


def check_open(group: Group, what: str) -> None:
    """Raise ``TideInvalid`` if ``group`` was closed (its communicators are gone: no
    agreement can run, so every rank that uses it raises here, alike)."""
    if group.closed:
        raise TideInvalid(f"{what}: expected an open group, got one that was closed "
                          "(group.close())")


def region_key(region: Any) -> Any:
    """A slot or staging region as the ranks compare it: its number in its group, None
    (the group's own), or, for anything else (refused by the caller), its type."""
    if region is None:
        return None
    return getattr(region, "id", None) if hasattr(region, "contains") else \
        f"not a region ({type(region).__name__})"


def digest(signature: tuple) -> int:
    """56-bit digest, equal on every rank for equal signatures.

    ``hash`` of ints and tuples is not salted (only str/bytes are), so strings
    go through crc32 first; this keeps 1000-parameter units in microseconds.
    """
    plain = tuple((zlib.crc32(name.encode()), _plain(value)) for name, value in signature)
    return hash(plain) & ((1 << 56) - 1)


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    return value


def check(group: Group, what: str, signature: tuple, errors: Sequence[str],
          known_digest: Optional[int] = None, count: int = 0) -> int:
    """Raise :class:`TideInvalid` on every rank if any rank's input is bad; else return
    the least ``count`` over the ranks (a caller's count rides on the same agreement).

    Args:
        group: the group the collective runs on.
        what: the collective's name, for messages.
        signature: what must be equal on every rank (a tuple of plain values;
            its first entry per parameter list element describes that element).
        errors: this rank's own findings, each "parameter i: expected X, got Y".
    """
    h = digest(signature) if known_digest is None else known_digest
    hmax, negmin, nerr, negcount = group.agree_max([h, -h, len(errors), -count])
    if hmax == -negmin and nerr == 0:
        return -negcount
    everything = group.comm.allgather((signature, list(errors)))
    if all(sig == everything[0][0] and not errs for sig, errs in everything):
        return -negcount  # digests can differ only if interpreters hash differently
    ranks_of: dict[str, list[int]] = {}
    for r, (_, errs) in enumerate(everything):
        for e in errs:
            ranks_of.setdefault(e, []).append(r)
    lines = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {e}"
             for e, rs in ranks_of.items()]
    if not lines:  # a mismatch is often a consequence of a local error: name that first
        lines.insert(0, _mismatch([sig for sig, _ in everything]))
    raise TideInvalid(f"{what}: " + "; ".join(lines))


def resolve_all(backend: Any, objs: Any, what: str) -> tuple[list, list[str]]:
    """Resolve every array, collecting errors instead of raising them here.

    Raising on one rank would leave the others waiting in :func:`check`, so
    failures become entries of the error list that ``check`` shares.
    """
    if objs is None or isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__"):
        return [], [f"expected a list of {what}s, got {type(objs).__name__}"]
    resolved, errors = [], []
    for i, obj in enumerate(objs):
        try:
            resolved.append(backend.resolve(obj))
        except TideInvalid as e:
            errors.append(f"{what} {i}: {e}")
    return resolved, errors


def check_arrays(arrays: Sequence[Any], what: str) -> tuple[Any, list[str]]:
    """The unit's dtype (the first supported one) and each array's local errors.

    Every array must have a supported dtype, the same one, and be C-contiguous.
    """
    # The unit's dtype is the first supported one: an odd first array (say float64)
    # is then reported once, not as every other parameter's mismatch.
    dtype = next((a.dtype for a in arrays if _dtypes.is_supported(a.dtype)),
                 arrays[0].dtype if arrays else _dtypes.bfloat16)
    errors = []
    for i, a in enumerate(arrays):
        if not _dtypes.is_supported(a.dtype):
            errors.append(f"parameter {i}: expected dtype in {sorted(_dtypes.SUPPORTED)}, "
                          f"got {a.dtype}")
        elif a.dtype != dtype:
            errors.append(f"parameter {i}: expected the unit's dtype {dtype}, got {a.dtype}")
        if not a.contiguous:
            errors.append(f"parameter {i}: expected a C-contiguous {what}, got a "
                          f"non-contiguous view of shape {a.shape}")
    return dtype, errors


#: How a mismatched signature field is shown: regions by their number in the group.
_SHOW = {"slot": lambda v: "the group's default slots" if v is None else f"region #{v}",
         "staging": lambda v: "the group's own staging" if v is None else f"region #{v}",
         "out": lambda v: "out= given" if v else "no out=",
         "plan": lambda v: f"plan #{v}",
         "unit": lambda v: f"unit {v}"}


def _mismatch(sigs: list[tuple]) -> str:
    """Name the first field where ranks disagree."""
    ref = sigs[0]
    for r, sig in enumerate(sigs[1:], 1):
        if sig == ref:
            continue
        for (name, a), (_, b) in zip(ref, sig):
            if a == b:
                continue
            if isinstance(a, tuple) and isinstance(b, tuple) and name.endswith("s"):
                if len(a) != len(b):
                    return (f"expected the same number of {name} on every rank, got "
                            f"{len(a)} on rank 0 and {len(b)} on rank {r}")
                i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                return (f"parameter {i}: expected the same {name[:-1]} on every rank, got "
                        f"{a[i]} on rank 0 and {b[i]} on rank {r}")
            show = _SHOW.get(name, str)
            return (f"expected the same {name} on every rank, got {show(a)} on rank 0 and "
                    f"{show(b)} on rank {r}")
    return "ranks disagree on the call"


def overlaps(a: Sequence[tuple[int, int, int]], b: Sequence[tuple[int, int, int]]) -> list:
    """Pairs ``(i, j)`` where range ``a[i]`` overlaps ``b[j]``; ranges are (ptr, nbytes, index).

    A sweep over sorted ranges: O(n log n), so 1000-parameter units stay cheap.
    """
    events = sorted([(p, p + n, 0, i) for p, n, i in a if n] +
                    [(p, p + n, 1, j) for p, n, j in b if n])
    found, open_ = [], {0: [], 1: []}
    for start, end, side, idx in events:
        for s in (0, 1):
            open_[s] = [(e, k) for e, k in open_[s] if e > start]
        for _, k in open_[1 - side]:
            found.append((idx, k) if side == 0 else (k, idx))
        open_[side].append((end, idx))
    return found
