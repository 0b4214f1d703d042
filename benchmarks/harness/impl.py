"""The registry of benchmark implementations, and what every implementation is.

Every implementation answers ``setup(data) -> Prepared``: buffers and tables are
made once per unit (outside timing), and the returned closures each issue one
collective on the timing stream. ``phases`` are the pieces of a collective, run
alone for breakdowns.

Implementations live in the plug-in modules named in :data:`PLUGINS` and register
themselves with :func:`register` when imported. This module imports none of them
statically: :func:`names` and :func:`make` load the table first, so the imports run
one way only (plug-ins -> this module).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .data import UnitData

#: Plug-in modules (relative to this package) that register implementations.
PLUGINS = (".impls", "..baselines.impls_nccl", "..baselines.impls_torch")

#: Names in report order.
ORDER = ("tide", "tide-plan", "stock", "symm", "nccl-a2a", "fsdp2")
_REGISTRY: dict[str, list[type]] = {}


class Skip(Exception):
    """Raised by ``setup``/``open`` when an implementation cannot run here (recorded, not fatal)."""


@dataclass
class Phase:
    """One piece of a collective, runnable alone.

    ``kind`` says how it uses SMs: ``kernel`` (``ctas`` CTAs), ``nccl`` (one CTA
    per NCCL channel), ``nccl-ce`` / ``ce`` (copy engines, no CTA), ``host``.
    """

    fn: Callable[[], Any]
    kind: str
    ctas: Optional[int] = None
    note: str = ""
    #: False for reference measurements that are not part of the collective.
    part: bool = True


@dataclass
class Prepared:
    """One implementation set up for one unit."""

    ag: Optional[Callable[[], Any]] = None
    rs: Optional[Callable[[], Any]] = None
    ag_out: Optional[Callable[[], list]] = None
    rs_out: Optional[Callable[[], list]] = None
    phases: dict[str, Phase] = field(default_factory=dict)
    #: Bytes of the buffers it allocates itself (None: not known, e.g. torch-managed).
    accounted_nbytes: Optional[int] = 0
    release: Callable[[], None] = lambda: None
    #: Untimed work before each timed iteration of an op (e.g. FSDP2's unshard before RS).
    pre: dict[str, Callable[[], None]] = field(default_factory=dict)


class Impl:
    """Base class: a named way to all-gather and reduce-scatter a unit."""

    name = "?"
    #: Largest normwise relative error vs fp64 of a correct reduce-scatter: fp32 sums of
    #: bf16 terms are within a few fp32 ulps. A larger error fails the run.
    rs_tolerance = 1e-5
    backends: tuple[str, ...] = ("host", "cuda")
    description = ""
    #: Collectives it times (``Prepared.ag`` / ``rs`` are set for these).
    ops: tuple[str, ...] = ("ag", "rs")

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def unavailable(self) -> Optional[str]:
        """Why this implementation cannot run here (same answer on every rank), or None."""
        return None

    def open(self) -> None:
        """Collective start-up (communicators); called once per suite."""

    def close(self) -> None:
        """Release what ``open`` made (collective)."""

    def setup(self, data: UnitData) -> Prepared:
        raise NotImplementedError


def register(cls: type) -> type:
    _REGISTRY.setdefault(cls.name, []).append(cls)
    return cls


def names() -> list[str]:
    _load_all()
    return [n for n in ORDER if n in _REGISTRY] + sorted(set(_REGISTRY) - set(ORDER))


def make(ctx: Any, name: str) -> tuple[Optional[Impl], str]:
    """The implementation ``name`` for this backend, or (None, why not)."""
    _load_all()
    for cls in _REGISTRY.get(name, []):
        if ctx.dev.name in cls.backends:
            impl = cls(ctx)
            why = impl.unavailable()
            return (None, why) if why else (impl, "")
    if name not in _REGISTRY:
        return None, f"unknown implementation {name!r} (known: {', '.join(names())})"
    return None, f"no implementation for the {ctx.dev.name} backend"


def _load_all() -> None:
    for name in PLUGINS:  # each registers its implementations when first imported
        importlib.import_module(name, __package__)
