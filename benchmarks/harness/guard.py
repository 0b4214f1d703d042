"""Fail together: run one step of a suite on every rank, and record any rank's failure."""

from __future__ import annotations

import traceback
from typing import Any, Callable

from .impl import Skip


def guarded(ctx: Any, suite: str, impl: str, workload: str, what: str,
            fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``fn`` on every rank; (True, result) only if it succeeded everywhere."""
    err = None
    result = None
    try:
        result = fn()
    except Skip as e:
        err = ("skipped", str(e))
    except Exception as e:  # noqa: BLE001 - any failure is recorded, never fatal
        err = ("error", f"{e.__class__.__name__}: {e}")
        if ctx.args.verbose:
            traceback.print_exc()
    errs = ctx.comm.allgather(err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if not bad:
        return True, result
    status = "skipped" if all(e[0] == "skipped" for _, e in bad) else "error"
    reasons = sorted({e[1] for _, e in bad})
    ranks = [r for r, _ in bad]
    reason = f"{what}: " + " | ".join(reasons) + (f" (ranks {ranks})" if len(ranks) <
                                                  ctx.size else "")
    ctx.sink.add(suite, impl, workload, "status", None, status=status, reason=reason)
    ctx.log(f"  {impl:<12} {status.upper()}: {reason}")
    if status == "error":
        ctx.errors.append(f"{suite} {impl} {workload}: {reason}")
    return False, None
