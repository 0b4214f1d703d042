"""The cuda backend, one concern per module.

* ``backend``: :class:`CudaBackend`, the :class:`~tidearray.backends.Backend`
  the collectives call; it owns the pieces below and holds no device logic itself.
* ``executor``: lane streams, events and their completions ([Note: streams]).
* ``memory`` (legacy CUDA IPC), ``vmm`` (VMM, descriptors over a Unix socket)
  and ``multicast`` (NVSwitch, opt-in): symmetric memory.
* ``copies``: copy-engine transfers, one ``cuMemcpyBatchAsync`` per call.
* ``flags``: stream flags (``cuStreamWriteValue32`` / ``WaitValue32``).
* ``accumulate``: the reduce-scatter's fp32 accumulate kernel and its tables.
* ``nccl``: the NCCL link (nccl4py) between nodes and for exchanges.
* ``watchdog``: the timeout that aborts a stuck collective on every rank.
* ``driver``: ctypes entry points to the CUDA driver on the hot path.
* ``kernels``: loads and compiles ``kernels/*.cu`` with CuPy.

Importing this package imports no CUDA library; :class:`CudaBackend` does that
in ``setup``.
"""

from .backend import CudaBackend, multicast_capability

__all__ = ["CudaBackend", "multicast_capability"]
