"""Running implementations safely: one failure is recorded, never a hang.

Every step that can fail (open, setup, a timed loop, a check, release) runs
through :func:`guarded`: each rank catches its own exception, then all ranks
agree (an allgather) before anyone goes on, so no rank enters a collective
alone. Failures become ``status`` records with every rank's reason; the run
goes on to the other implementations, then exits nonzero if any step failed
(a skip, where an implementation cannot run here, is not a failure).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

from . import impls as registry
from .impls import Skip


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


class Suite:
    """The implementations of one suite, opened together and closed at the end."""

    def __init__(self, ctx: Any, name: str) -> None:
        self.ctx, self.name = ctx, name
        self.impls: list = []
        for n in selected_names(ctx):
            impl, why = registry.make(ctx, n)
            if impl is None:
                ctx.sink.add(name, n, "*", "status", None, status="skipped", reason=why)
                ctx.log(f"  {n:<12} skipped: {why}")
                continue
            ok, _ = guarded(ctx, name, n, "*", "open", impl.open)
            if ok:
                self.impls.append(impl)

    def close(self) -> None:
        for impl in self.impls:
            guarded(self.ctx, self.name, impl.name, "*", "close", impl.close)
        self.impls = []

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def selected_names(ctx: Any) -> list[str]:
    want = ctx.args.impls
    known = registry.names()
    if not want:
        return known
    return [n.strip() for n in want.split(",") if n.strip()]


def prepare(ctx: Any, suite: str, impl: Any, data: Any) -> Optional[Any]:
    """``impl.setup(data)`` under :func:`guarded`; None if it failed anywhere."""
    ok, prep = guarded(ctx, suite, impl.name, data.unit.name, "setup",
                       lambda: impl.setup(data))
    return prep if ok else None


def release(ctx: Any, suite: str, impl: Any, data: Any, prep: Any) -> None:
    def run() -> None:
        ctx.dev.sync()
        prep.release()
    guarded(ctx, suite, impl.name, data.unit.name, "release", run)
