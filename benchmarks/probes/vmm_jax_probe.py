"""Copies from CuPy and JAX arrays into a peer's VMM memory, before and after JAX
starts (diagnostic: ``mpirun -n 2 python benchmarks/probes/vmm_jax_probe.py [own]``; ``own``
limits JAX to the rank's GPU). They faulted once JAX (seeing every GPU) was in the
process while only our device had access to the mapping; every line prints True
since mappings grant every peer-capable device (``tidearray.backends.cuda.vmm.peer_devices``)."""
import os
import sys

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.getcwd())
from tidearray.backends.cuda.vmm import VmmSymmetricBuffer  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
comm = MPI.COMM_WORLD
me, peer = comm.rank, 1 - comm.rank
cp.cuda.Device(me).use()
n = 1 << 20
buf = VmmSymmetricBuffer(comm, 4 * n * 2, me)
want = cp.arange(n, dtype=cp.float32)


def push(step: str, src) -> None:
    cp.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    buf.view(0, (2 * n,), "float32")[...] = -1
    cp.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    try:
        cp.cuda.runtime.memcpyAsync(buf.ptr(peer) + 4 * n * peer, src.data.ptr, src.nbytes, 4, 0)
        cp.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        got = buf.view(4 * n * me, (n,), "float32")
        ok = bool((got == want).all())
    except Exception as e:  # noqa: BLE001
        ok = f"{type(e).__name__}: {e}"
    print(f"rank {me} {step}: {ok}", flush=True)


push("cupy before jax", want)
import jax  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] == "own":
    jax.config.update("jax_cuda_visible_devices", str(me))
devs = jax.devices()
cp.cuda.Device(me).use()
print(f"rank {me} jax devices {devs}", flush=True)
push("cupy after jax", want)
j = jax.device_put(np.arange(n, dtype=np.float32), devs[min(me, len(devs) - 1)])
push("jax source", cp.from_dlpack(j))
buf.free()
