"""``python -m tidearray.info``: what to paste into a bug report, or read to pick a transport.

Prints the GPUs and their links, driver / CUDA / CuPy / NCCL / nccl4py / MPI
versions, the topology tidearray sees (run it under ``mpiexec`` to see a
multi-rank one; only rank 0 prints) and every capability of the cuda backend,
on or off, with the reason. On a machine without a usable GPU it says so and
why, and still prints the rest.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from typing import Any, Optional

# A diagnostics tool, not a layer above the backends: it reports what the cuda backend
# and its libraries (CuPy, the driver, NCCL, nccl4py) see on this machine, so it imports
# them and reads the cuda package directly ([Note: backend interface] in backends._base
# binds ``fsdp`` and the front ends, not this report).


def _version(module: str) -> Optional[str]:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - absent or broken: report as missing
        return None
    return str(getattr(mod, "__version__", "?"))


def _cuda_versions() -> list[tuple[str, str]]:
    import cupy

    rt = cupy.cuda.runtime

    def fmt(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    return [("CUDA driver API", fmt(rt.driverGetVersion())),
            ("CUDA runtime", fmt(rt.runtimeGetVersion())),
            ("CuPy", cupy.__version__),
            ("cuda-bindings", _version("cuda.bindings") or "not importable")]


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found"
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi failed ({e})"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def _links() -> str:
    """``nvidia-smi topo -m``, or the peer-access matrix where nvidia-smi is missing."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            pass  # fall through to the peer-access matrix
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    rows = ["cudaDeviceCanAccessPeer (1 = peer access):", "     " + " ".join(
        f"{j:>3}" for j in range(n))]
    for i in range(n):
        cells = [" - " if i == j else f"{cupy.cuda.runtime.deviceCanAccessPeer(i, j):>3}"
                 for j in range(n)]
        rows.append(f"{i:>3}: " + " ".join(cells))
    return "\n".join(rows)


def _gpus() -> list[str]:
    import cupy

    out = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        out.append(f"cuda:{i}  {name}  {p['totalGlobalMem'] / 2**30:.0f} GiB  "
                   f"sm_{p['major']}{p['minor']}  {p['multiProcessorCount']} SMs  "
                   f"{p.get('asyncEngineCount', '?')} copy engines")
    return out


def _mpi() -> str:
    try:
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - mpi4py missing or its MPI library broken
        return f"mpi4py not usable ({e})"
    lib = MPI.Get_library_version().strip().splitlines()[0]
    return f"mpi4py {_version('mpi4py')}; {lib}"


def _group_report() -> tuple[list[str], Any]:
    """Start a group (collective) and describe it; returns lines and the group."""
    import tidearray

    try:
        g = tidearray.init()
    except Exception as e:  # noqa: BLE001 - report, do not crash the report
        return [f"tidearray.init() failed: {type(e).__name__}: {e}"], None
    t = g.topology
    lines = [f"world {t.world}, {t.num_nodes} node(s) x {t.local_size} local rank(s); "
             f"backend {g.backend.name!r}; chunk {g.config.chunk_nbytes >> 20} MiB, "
             f"depth {g.config.depth}"]
    lines.append("settings not at their defaults: " + (", ".join(settings_changed(g.config))
                                                       or "none"))
    devices = g.comm.gather(getattr(g.backend, "device", None), root=0)
    if g.rank == 0 and devices and devices[0] is not None:
        lines.append("rank -> device: " + ", ".join(f"{r}->cuda:{d}" for r, d in
                                                    enumerate(devices)))
    return lines, g


def settings_changed(config: Any) -> list[str]:
    """``name=value`` of each setting not at its default (from ``TIDE_*`` or ``init``)."""
    return [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
            if getattr(config, f.name) != f.default]


def nccl_lines() -> list[str]:
    """nccl4py and libnccl versions, and whether one-sided put/signal is there."""
    from .backends.cuda.nccl import put_signal_capability, versions

    v = versions()
    ok, why = put_signal_capability()
    return [f"nccl4py: {v['nccl4py'] or 'not importable'}",
            f"NCCL (libnccl): {v['libnccl'] or 'not loaded'}",
            f"NCCL put/signal: {'yes' if ok else 'no'} ({why})"]


def capability_lines(backend: Any) -> list[str]:
    """``name: on/off (reason)`` for every capability a cuda backend recorded."""
    caps = getattr(backend, "capabilities", {}) or {}
    return [f"{name:<26} {'on ' if ok else 'off'}  {why}" for name, (ok, why) in caps.items()]


def report() -> str:
    """The whole report as text (collective when run under MPI)."""
    from .backends import cuda_usable

    sections: list[tuple[str, list[str]]] = []
    ok, why = cuda_usable()
    sections.append(("cuda", [f"usable: {ok} ({why})"]))
    if ok:
        sections.append(("GPUs", _gpus()))
        sections.append(("links", _links().splitlines()))
        sections.append(("versions", [f"NVIDIA driver: {_driver_version()}"] +
                         [f"{k}: {v}" for k, v in _cuda_versions()] + nccl_lines()))
    else:
        sections.append(("versions", [f"CuPy: {_version('cupy') or 'not importable'}"]
                         + nccl_lines()))
    sections[-1][1].append(f"MPI: {_mpi()}")
    lines, g = _group_report()
    sections.append(("topology", lines))
    if g is not None:
        caps = capability_lines(g.backend)
        sections.append(("capabilities", caps or [f"backend {g.backend.name!r}: the cuda "
                                                  "capabilities do not apply"]))
        g.close()
    return "\n".join(f"== {title}\n" + "\n".join("  " + x for x in body)
                     for title, body in sections)


def main() -> None:
    text = report()
    try:
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank != 0:
            return
    except ImportError:
        pass
    print(text)


if __name__ == "__main__":
    main()
