"""Running implementations safely: one failure is recorded, never a hang.

Every step that can fail (open, setup, a timed loop, a check, release) runs
through :func:`guarded`: each rank catches its own exception, then all ranks
agree (an allgather) before anyone goes on, so no rank enters a collective
alone. Failures become ``status`` records with every rank's reason; the run
goes on to the other implementations, then exits nonzero if any step failed
(a skip, where an implementation cannot run here, is not a failure).
"""

from __future__ import annotations

from typing import Any, Optional

from . import impl as registry
from .guard import guarded


class Suite:
    """The implementations of one suite, opened together and closed at the end."""

    def __init__(self, ctx: Any, name: str) -> None:
        self.ctx, self.name = ctx, name
        self.impls: list = []
        names = [n.strip() for n in ctx.args.impls.split(",") if n.strip()]
        for n in names or registry.names():
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
