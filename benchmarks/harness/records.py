"""Benchmark results as data: JSON Lines records, one per (impl, workload, metric).

Only rank 0 writes. Every record carries the run id, so a file can hold several
runs (the report uses the latest record of each key). A ``run`` record per run
holds the command line and the environment (devices, versions).

Record fields: ``run``, ``suite`` (ag, rs, interference, memory, ...), ``impl``,
``workload``, ``metric``, ``value`` (a number, or None when skipped or failed),
``unit``, and optional ``status`` (``ok``, ``skipped``, ``error``), ``reason``
and ``extra`` (a dict).
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from typing import Any, Iterable, Optional


class Sink:
    """Appends records to ``path`` (rank 0 only; other ranks keep nothing)."""

    def __init__(self, path: Optional[str], rank: int) -> None:
        self.path = path
        self.active = rank == 0 and path is not None
        self.run = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S") + \
            "-" + uuid.uuid4().hex[:6]
        self.records: list[dict] = []
        if self.active:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def add(self, suite: str, impl: str, workload: str, metric: str, value: Any,
            unit: str = "", *, status: str = "ok", reason: str = "", **extra: Any) -> dict:
        rec = {"run": self.run, "suite": suite, "impl": impl, "workload": workload,
               "metric": metric, "value": _plain(value), "unit": unit, "status": status}
        if reason:
            rec["reason"] = reason
        if extra:
            rec["extra"] = _plain(extra)
        self.records.append(rec)
        if self.active:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def skip(self, suite: str, impl: str, workload: str, reason: str) -> dict:
        return self.add(suite, impl, workload, "status", None, status="skipped", reason=reason)


def git_commit() -> str:
    """The commit the code ran at: ``TIDE_GIT_COMMIT`` if set (a copied working tree may
    carry a stale ``.git``; the launcher then names the commit), else ``git rev-parse
    HEAD`` of this checkout, with ``-dirty`` when tracked files differ from it."""
    import subprocess

    if os.environ.get("TIDE_GIT_COMMIT"):
        return os.environ["TIDE_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=here, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=here,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def _plain(v: Any) -> Any:
    """JSON-safe: numpy scalars to Python, tuples to lists, dicts recursively."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    return v


def load(paths: Iterable[str]) -> list[dict]:
    """All records of the given JSON Lines files, in file order."""
    out = []
    for p in paths:
        with open(p) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out

