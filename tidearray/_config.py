"""Run-time settings: keyword arguments of ``tidearray.init`` over ``TIDE_*`` variables."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ._errors import TideInvalid

AG_TRANSPORTS = ("push",)
#: Transports measured and retired (docs/performance.md, "Retired experiments").
RETIRED_AG_TRANSPORTS = ("pull", "push-batch")
SYMMETRIC_MEMORY = ("auto", "vmm", "ipc")
#: ``local_copy_max`` is a multiple of this (``_copies.SPLIT_ALIGN``): pieces keep their
#: copy's vector alignment, and a tiny value cannot make millions of pieces.
LOCAL_COPY_ALIGN = 1 << 16


def _flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Config:
    """Settings of one group. Unknown keys are rejected, like mpi4py's ``rc``."""

    backend: str = "auto"
    """``"auto"`` (cuda where a GPU and CuPy are usable, else host), ``"cuda"`` or
    ``"host"``. Env: ``TIDE_BACKEND``."""

    local_size: Optional[int] = None
    """Ranks per node; None means what ``COMM_TYPE_SHARED`` finds. Set it to make
    one host look like several nodes, e.g. 1 to force the inter-node path.
    Env: ``TIDE_LOCAL_SIZE``."""

    chunk_nbytes: int = 32 << 20
    """Reduce-scatter chunk: one remote source's staged bytes per chunk (32 MiB).
    Env: ``TIDE_CHUNK_BYTES``."""

    depth: int = 2
    """Reduce-scatter staging buffers in flight (2). Env: ``TIDE_DEPTH``."""

    timeout: float = 300.0
    """Seconds the host backend waits for a peer before raising (300).
    Env: ``TIDE_TIMEOUT``."""

    multicast: bool = False
    """Opt in to NVSwitch multicast for all-gather (False). Refused while
    ``NCCL_NVLS_ENABLE=0`` or without device support. Env: ``TIDE_MULTICAST``."""

    ag_transport: str = "push"
    """How the node-local all-gather moves data, by copy engine between GPUs (the
    own copy, within the GPU, the driver runs on the SMs: ``local_copy_max``):
    ``"push"``, the only one (one batch per peer, each on its own lane, straight
    from the shards into the peer's slot, and our own copy beside them:
    copy-engine writes into a peer's memory were the fastest route measured).
    ``"pull"`` (measured slower) and ``"push-batch"`` (no faster) were removed:
    they raise ``TideInvalid``. Multicast slots (``multicast``) write once instead.
    Env: ``TIDE_AG_TRANSPORT``."""

    accum_ctas: Optional[int] = None
    """CTAs of the reduce-scatter's accumulate kernel; None means half the SMs.
    Env: ``TIDE_ACCUM_CTAS``."""

    ce_split: int = 1
    """Copy-engine streams per peer lane: a copy batch of 8 MiB or more to or from
    a peer is cut into this many runs of equal bytes, so several copy engines
    share the link (cuda). Env: ``TIDE_CE_SPLIT``."""

    symmetric_memory: str = "auto"
    """How symmetric memory (slots, staging) is allocated and mapped on the cuda
    backend: ``"auto"`` (default: VMM where every node-local rank can pass
    descriptors, else legacy IPC), ``"vmm"`` (``cuMemCreate``, file descriptors
    passed over Unix sockets; copy-engine writes into a peer's VMM memory were
    faster than into legacy-IPC memory: docs/config.md), or ``"ipc"``
    (``cudaMalloc`` and legacy IPC handles over MPI; works wherever the driver
    allows IPC). Env: ``TIDE_SYMMETRIC_MEMORY``."""

    batch_copies: Optional[bool] = None
    """Use batched copies (``cuMemcpyBatchAsync``) for a call's small copies; None
    means where available.
    Env: ``TIDE_BATCH_COPIES``."""

    local_copy_max: int = 8 << 20
    """Same-device copies (the all-gather's own copy; the reduce-scatter's copy
    from NCCL's buffer into ``out`` across nodes) are cut into pieces of at most
    this many bytes (8 MiB), in the call's batch (one memcpy each where batches
    are off), never merged into 2D copies.
    The driver runs such copies on the SMs, and large ones slow a concurrent
    kernel most; pieces of this size in one batch slowed it least
    ([Note: same-device copies] in the cuda backend's ``copies``). 0 leaves them
    whole; otherwise a multiple of 64 KiB.
    Env: ``TIDE_LOCAL_COPY_MAX``."""

    local_copy_kernel_min: int = 64
    """A cached batch of at least this many same-device copies (64; the all-gather's
    own copy, the reduce-scatter's copy out of NCCL's buffer across nodes) goes as
    one copy kernel (``kernels/pack.cu``, on a quarter of the SMs) instead of the
    driver's batch: the driver spends microseconds of host time on each
    same-device copy, so a unit of many
    parameters held as separate arrays was bound by that issue. The driver runs
    such copies on the SMs either way.
    0: never (TIDE-AG then launches no kernel). Env: ``TIDE_LOCAL_COPY_KERNEL_MIN``."""

    copy_batch_max: int = 32
    """The most copies in one batched-copy call (32; 0: any number). A planned
    batch of more goes as several calls in order, so the copy engines start on
    the first part while the host issues the rest ([Note: issue in parts] in the
    cuda backend's ``copies``). Env:
    ``TIDE_COPY_BATCH_MAX``."""

    graph_flag_kernels: bool = True
    """In CUDA graphs (graph plans, collectives inside a capture), signal and wait with
    one-thread kernels instead of stream memory operations, each of which costs the
    graph's launch about 2 us of host time ([Note: flags in graphs] in the cuda
    backend's ``flags``). False keeps memory operations in graphs too (no resident
    CTA while a wait spins). Env: ``TIDE_GRAPH_FLAG_KERNELS``."""

    unit_graphs: bool = True
    """The FSDP runtime's units (``tidearray.fsdp``, ``tidearray.torch``) and
    ``tidearray.jax``'s in-place callbacks gather and reduce by graph plans: on cuda
    one graph launch of host time per collective instead of an eager call's 150-250
    us; on the host a recording of the call, replayed ([Note: unit graphs] in
    ``fsdp._comm``). False issues eager plan calls. Env: ``TIDE_UNIT_GRAPHS``."""

    debug: bool = False
    """Debug mode (False): re-check every plan call across ranks (one small
    agreement per call), so ranks that call plans in different orders raise;
    and stamp every node-local transfer with its sequence number, then wait
    for each call and check that every peer's bytes arrived before they were
    read ([Note: stamps] in ``_stamps``). Synchronizes every call: for finding
    bugs, not for timing. Env: ``TIDE_DEBUG``."""

    #: Where a field's environment variable is not ``TIDE_<FIELD>``.
    _ENV_NAMES = {"chunk_nbytes": "TIDE_CHUNK_BYTES"}

    @classmethod
    def make(cls, env: Optional[dict] = None, **kwargs: Any) -> Config:
        """Defaults, then ``TIDE_*`` from ``env`` (os.environ), then ``kwargs``."""
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        if "jax_cuda" in kwargs:
            raise TideInvalid("jax_cuda: expected no such setting, got one: tidearray.jax "
                              "runs on the cuda backend without it (docs/api.md)")
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TideInvalid(f"expected settings among {sorted(names)}, got {unknown}")
        values: dict[str, Any] = {}
        for var, (name, parse) in env_table(cls).items():
            if env.get(var, "") != "":
                try:
                    values[name] = parse(env[var])
                except ValueError:
                    raise TideInvalid(
                        f"{var}: expected {name} as a number, got {env[var]!r}") from None
        values.update({k: v for k, v in kwargs.items() if v is not None})
        cfg = cls(**values)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.backend not in ("auto", "cuda", "host"):
            raise TideInvalid(f"backend: expected 'auto', 'cuda' or 'host', got {self.backend!r}")
        if self.ag_transport in RETIRED_AG_TRANSPORTS:
            raise TideInvalid(f"ag_transport: expected 'push' (the one all-gather transport "
                              f"left; multicast=True for multicast slots), got "
                              f"{self.ag_transport!r}, which was measured and removed "
                              f"(docs/performance.md, Retired experiments)")
        if self.ag_transport not in AG_TRANSPORTS:
            raise TideInvalid(f"ag_transport: expected one of {AG_TRANSPORTS}, got "
                              f"{self.ag_transport!r}")
        if self.symmetric_memory not in SYMMETRIC_MEMORY:
            raise TideInvalid(f"symmetric_memory: expected one of {SYMMETRIC_MEMORY}, got "
                              f"{self.symmetric_memory!r}")
        if self.local_size is not None and self.local_size < 1:
            raise TideInvalid(f"local_size: expected >= 1, got {self.local_size}")
        if self.ce_split < 1:
            raise TideInvalid(f"ce_split: expected >= 1, got {self.ce_split}")
        if self.accum_ctas is not None and self.accum_ctas < 1:
            raise TideInvalid(f"accum_ctas: expected >= 1, got {self.accum_ctas}")
        if self.local_copy_max < 0 or self.local_copy_max % LOCAL_COPY_ALIGN:
            raise TideInvalid(f"local_copy_max: expected 0 or a positive multiple of "
                              f"{LOCAL_COPY_ALIGN} bytes, got {self.local_copy_max}")
        if self.copy_batch_max < 0:
            raise TideInvalid(f"copy_batch_max: expected >= 0, got {self.copy_batch_max}")
        if self.local_copy_kernel_min < 0:
            raise TideInvalid(f"local_copy_kernel_min: expected >= 0, got "
                              f"{self.local_copy_kernel_min}")
        if self.chunk_nbytes < 4096:
            raise TideInvalid(f"chunk_nbytes: expected >= 4096, got {self.chunk_nbytes}")
        if not 1 <= self.depth <= 4:
            raise TideInvalid(f"depth: expected 1..4, got {self.depth}")
        if self.timeout <= 0:
            raise TideInvalid(f"timeout: expected > 0 seconds, got {self.timeout}")


def env_table(cls: type[Config]) -> dict[str, tuple[str, Callable[[str], Any]]]:
    """``TIDE_*`` variable -> (field, parser), one per field; the parser follows the
    field's type (a bool is on for 1, true, yes or on)."""
    table = {}
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        parse = (_flag if "bool" in kind else int if "int" in kind
                 else float if "float" in kind else str)
        table[cls._ENV_NAMES.get(f.name, f"TIDE_{f.name.upper()}")] = (f.name, parse)
    return table
