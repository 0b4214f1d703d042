"""Measured device activity: every kernel, copy and memset of a region, from CUPTI.

CUPTI records all activity of the process's CUDA contexts, whichever library
launched it (CuPy, NCCL, the driver's copy engines). It is reached through
``torch.profiler`` (Kineto), where torch is installed: the region runs under
the profiler, its Chrome trace is read back, and each device event becomes a
record with its stream, start, duration and, for kernels, its grid and block.
Without torch (or a GPU) :func:`trace` returns None and callers say so.

SM time of a kernel is ``duration x min(1, blocks / SMs)``: the fraction of
the device its grid can occupy, times how long it ran, measured, not modelled.

A copy between two buffers of one device ("Memcpy DtoD") is run by the driver
on the SMs, not by a copy engine, though CUPTI reports it as a memcpy and gives
no grid ([Note: same-device copies] in the cuda backend's ``copies``). Those
copies are counted apart (:func:`same_device_copies`); a peer's copy over NVLink
is "Memcpy PtoP".
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Callable, Optional

#: Chrome-trace categories of device activity, as Kineto writes them.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def available() -> tuple[bool, str]:
    try:
        import torch
        from torch.profiler import ProfilerActivity  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken torch
        return False, f"torch.profiler not importable ({e.__class__.__name__}: {e})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, f"torch {torch.__version__} (Kineto/CUPTI)"


def trace(fn: Callable[[], Any]) -> Optional[list[dict]]:
    """Run ``fn`` under CUPTI; its device events (or None where CUPTI is not reachable).

    ``fn`` must synchronize the device before it returns, so that every event
    of the region is complete when the profiler stops.
    """
    if not available()[0]:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):  # its first start in a process, not in
        pass  # the region (the first JAX step traced idled 8-10 ms more than the others)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            raw = json.load(f)
    return events_from_chrome(raw)


def events_from_chrome(raw: Any) -> list[dict]:
    """Device events of a Chrome trace: name, category, stream, start and duration (us);
    for kernels also blocks, threads per block, registers per thread and shared memory
    per block (bytes), where the trace gives them."""
    items = raw.get("traceEvents", []) if isinstance(raw, dict) else raw
    out = []
    for e in items:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        args = e.get("args", {})
        grid, block = args.get("grid"), args.get("block")
        out.append({"name": e.get("name", "?"), "cat": e["cat"],
                    "stream": int(args.get("stream", e.get("tid", -1))),
                    "ts_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0)),
                    "blocks": math.prod(grid) if grid else None,
                    "threads": math.prod(block) if block else None,
                    # A kernel's footprint per CTA: whether another's fits beside it.
                    "registers": args.get("registers per thread"),
                    "shared_bytes": args.get("shared memory"),
                    "bytes": args.get("bytes")})
    out.sort(key=lambda e: e["ts_us"])
    return out


def sm_seconds(events: list[dict], num_sms: int) -> float:
    """Kernel time weighted by the share of SMs each grid can occupy."""
    total = 0.0
    for e in events:
        if e["cat"] == "kernel":
            share = min(1.0, (e["blocks"] or num_sms) / num_sms)
            total += e["dur_us"] * 1e-6 * share
    return total


def same_device_copies(events: list[dict]) -> list[dict]:
    """The copies within one device: run on the SMs by the driver, grid unknown."""
    return [e for e in events if e["cat"] == "gpu_memcpy" and "DtoD" in e["name"]]


def save(events: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(events, f)
