"""Tables made from records: the terminal summary and the markdown report share them.

A table is a header row plus rows of strings; :func:`markdown` renders it (the
same text reads well in a terminal).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from .impl import ORDER

Table = tuple[list[str], list[list[str]]]


class Results:
    """The latest record of every (suite, impl, workload, metric) key."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records
        self.by_key = {(r["suite"], r["impl"], r["workload"], r["metric"]): r for r in records}

    def get(self, suite: str, impl: str, workload: str, metric: str) -> Optional[dict]:
        return self.by_key.get((suite, impl, workload, metric))

    def impls(self, suite: str) -> list[str]:
        seen = {k[1] for k in self.by_key if k[0] == suite and k[1] not in ("*", "none", "gemm")}
        return [n for n in ORDER if n in seen] + sorted(seen - set(ORDER))

    def workloads(self, suite: str, kind: Optional[str] = None) -> list[str]:
        """Workloads of ``suite`` in first-seen order (``kind``: unit, size or count)."""
        out: list[str] = []
        for r in self.records:
            if r["suite"] != suite or r["workload"] in out or r["workload"] == "*":
                continue
            if kind is None or (r.get("extra") or {}).get("kind", _kind(r["workload"])) == kind:
                out.append(r["workload"])
        return out

    def interference_metrics(self) -> list[str]:
        """The interference suite's ``<gemm>:<op>`` slowdown metrics (not the GEMM alone)."""
        return sorted({k[3] for k in self.by_key if k[0] == "interference" and ":" in k[3]
                       and not k[3].endswith(":alone")})

    def sweep_mib(self, suite: str, kind: str) -> Optional[float]:
        """The unit size (MiB) of a parameter-count sweep, from its records."""
        for w in self.workloads(suite, kind):
            r = next((r for k, r in self.by_key.items() if k[0] == suite and k[2] == w
                      and (r.get("extra") or {}).get("nbytes")), None)
            if r is not None:
                return r["extra"]["nbytes"] / 2**20
        return None

    def problems(self) -> list[dict]:
        return [r for k, r in self.by_key.items() if r.get("status") in ("skipped", "error")]

    def runs(self) -> list[dict]:
        return [r for r in self.records if r["suite"] == "run"]


def _kind(workload: str) -> str:
    if workload.startswith("size-"):
        return "size"
    if workload.startswith("count-"):
        return "count"
    return "unit"


def us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e6:,.0f}" if v >= 1e-4 else f"{v * 1e6:.1f}"


def num(v: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def gbs(v: Optional[float]) -> str:
    """A bandwidth: whole GB/s, one decimal below 10."""
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def mib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def grid(res: Results, suite: str, metric: str, workloads: Iterable[str],
         fmt: Callable[[Any], str],
         value: Callable[[dict], Any] = lambda r: r.get("value")) -> Table:
    """Rows = workloads, columns = implementations, cells = one metric (``value`` of
    its record). Columns: every implementation with a record of the metric or a
    failure on these workloads."""
    workloads = list(workloads)
    impls = [i for i in res.impls(suite) if any(
        res.get(suite, i, w, metric) or res.get(suite, i, w, "status") for w in workloads)]
    rows = []
    for w in workloads:
        cells = []
        for i in impls:
            r = res.get(suite, i, w, metric)
            if r is None:
                st = res.get(suite, i, w, "status") or res.get(suite, i, "*", "status")
                cells.append(st["status"] if st else "")
            else:
                cells.append(fmt(value(r)))
        rows.append([w] + cells)
    return ["workload"] + impls, rows


def phase_table(res: Results, suite: str, workloads: Iterable[str]) -> Table:
    """Every ``phase:*`` record: workload, impl, phase, time (us), kind, CTAs."""
    rows = []
    for w in workloads:
        for i in res.impls(suite):
            for (s, impl, wl, m), r in res.by_key.items():
                if s == suite and impl == i and wl == w and m.startswith("phase:"):
                    ex = r.get("extra") or {}
                    rows.append([w, i, m[6:], us(r["value"]), ex.get("kind", ""),
                                 str(ex.get("ctas") if ex.get("ctas") is not None else "-"),
                                 ex.get("note", "")])
    return ["workload", "impl", "phase", "time (us)", "kind", "CTAs", "note"], rows


def markdown(table: Table) -> str:
    head, rows = table
    if not rows:
        return "_(no data)_\n"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep] + body) + "\n"
