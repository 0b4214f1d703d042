"""Pure planning: copies shaped for the copy engines.

A copy is ``(dst, src, nbytes)``. These functions merge copies that continue each
other (:func:`coalesce`), cut them into parts of about equal bytes or pieces of at
most so many bytes (:func:`split_copies`, :func:`cut_copies`) and merge copies at
constant strides into 2D runs (:func:`strided_runs`). Nothing here touches a device:
the backends execute what these return.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

Copy = tuple[int, int, int]  # (dst, src, nbytes): addresses or offsets


def coalesce(copies: Sequence[Copy]) -> list[Copy]:
    """Merge copies that continue each other in both source and destination."""
    out: list[Copy] = []
    for dst, src, n in copies:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            pdst, psrc, pn = out[-1]
            out[-1] = (pdst, psrc, pn + n)
        else:
            out.append((dst, src, n))
    return out


#: Cut points of split batches are multiples of this (keeps vector alignment).
SPLIT_ALIGN = 1 << 16


def split_copies(copies: Sequence[tuple[int, int, int]], parts: int) -> list[list]:
    """``copies`` cut into ``parts`` runs of about equal bytes, in order.

    A copy that straddles a cut is split in two at a multiple of
    :data:`SPLIT_ALIGN` bytes from its start (same allocation, so still valid).
    Runs can be empty when there are fewer bytes than cut granules.
    """
    total = sum(n for _, _, n in copies)
    share = -(-total // parts)
    runs: list[list] = [[] for _ in range(parts)]
    k, room = 0, share
    for dst, src, n in copies:
        while n:
            take = n if n <= room or k == parts - 1 else max(
                room // SPLIT_ALIGN * SPLIT_ALIGN, 0)
            if take == 0:  # the cut would be unaligned: move on to the next run
                k, room = k + 1, share
                continue
            runs[k].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room <= 0 and k < parts - 1:
                k, room = k + 1, share
    return runs


def cut_copies(copies: Sequence[tuple[int, int, int]], max_bytes: int) -> tuple:
    """Every copy longer than ``max_bytes`` cut into pieces of at most that many
    bytes, in order (each cut at a multiple of ``max_bytes`` from the copy's start,
    so a piece keeps its copy's alignment when ``max_bytes`` is a multiple of
    :data:`SPLIT_ALIGN`); ``max_bytes`` of 0 leaves them whole."""
    if max_bytes <= 0:
        return tuple(copies)
    return tuple((dst + o, src + o, min(max_bytes, n - o)) for dst, src, n in copies
                 for o in range(0, n, max_bytes) or (0,))


class Strided(NamedTuple):
    """``height`` rows of ``width`` bytes: row ``k`` from ``src + k*spitch`` to
    ``dst + k*dpitch`` (one 2D copy; ``height`` 1 is a plain copy)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


#: Largest pitch a 2D copy takes (cudaDevAttrMaxPitch on current GPUs).
MAX_PITCH = (1 << 31) - 1


def strided_runs(copies: Sequence[tuple[int, int, int]]) -> list[Strided]:
    """Consecutive copies of one size at constant destination and source
    strides, merged into 2D runs; every other copy is a run of height 1.

    A unit's pieces from one rank sit at a constant stride wherever its
    parameters repeat a shape (a MoE layer's experts), so a gather of hundreds
    of pieces becomes a few 2D copies. Strides must be at least the width (rows
    never overlap). Zero-byte copies are dropped. Whether the rows of a run lie
    in one allocation is for the caller to check.
    """
    runs: list[Strided] = []
    for dst, src, n in copies:
        if not n:
            continue
        if runs:
            r = runs[-1]
            if n == r.width:
                if r.height == 1:
                    dp, sp = dst - r.dst, src - r.src
                    if n <= dp <= MAX_PITCH and n <= sp <= MAX_PITCH:
                        runs[-1] = r._replace(dpitch=dp, spitch=sp, height=2)
                        continue
                elif (dst == r.dst + r.height * r.dpitch
                      and src == r.src + r.height * r.spitch):
                    runs[-1] = r._replace(height=r.height + 1)
                    continue
        runs.append(Strided(dst, n, src, n, n, 1))
    return runs
