"""The cuda backend: CuPy arrays, symmetric memory, copy engines, stream flags, NCCL.

How each primitive runs (all asynchronous, on the lane streams of
``executor``, [Note: streams]):

* symmetric memory: VMM where descriptors pass (``vmm``), else legacy
  CUDA IPC (``memory``, which says when), mapped once per allocation;
* ``copy``: each call's batch planned once into 2D copies and
  ``cuMemcpyBatchAsync`` calls of at most ``Config.copy_batch_max`` copies
  (``copies``, [Note: issue in parts]): copy engines between devices; the driver
  runs a copy within one device on the SMs, and a cached batch of many such
  copies goes as one copy kernel (``kernels/pack.cu``) instead
  ([Note: same-device copies]);
* ``signal`` / ``wait``: ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``,
  zero SMs (``flags``);
* ``accumulate``: one short kernel per call (``kernels/accumulate.cu``,
  ``accumulate``);
* ``exchange``: NCCL grouped send/recv through nccl4py (``nccl``).

So TIDE-AG launches no kernel (only its own copy, within the device, runs on the
SMs; one copy kernel when it is ``Config.local_copy_kernel_min`` copies or more),
and TIDE-RS only the accumulate's CTAs.
Multicast (NVSwitch) slots are opt-in (``multicast``): :func:`multicast_capability`
refuses them while ``NCCL_NVLS_ENABLE=0`` or without device support.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import socket
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from ..._cache import BoundedCache
from ..._copies import Copy
from ..._dtypes import float32, normalize
from ..._errors import TideBackendError, TideInvalid, fail_together
from ..._topology import shared_devices
from .._base import (
    AccumPiece,
    Backend,
    Resolved,
    StepPool,
    SymmetricBuffer,
    TupleBatch,
    check_accumulate,
)
from . import driver, kernels, streams
from .accumulate import Accumulator
from .copies import Copier, CudaBatch
from .executor import CudaCompletion, CudaExecutor, Lanes
from .flags import FlagOps
from .memory import IpcSymmetricBuffer
from .nccl import NcclLink, put_signal_capability
from .watchdog import Watchdog

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..._group import Group

_D2D = 3  # cudaMemcpyDeviceToDevice
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types addressable as device memory
#: What an eager collective's plan depends on, per CuPy array (``array_key``). The
#: address names the device too: device memory shares one virtual address space (UVA).
_ARRAY_KEY = operator.attrgetter("data.ptr", "shape", "dtype", "_c_contiguous")
#: Arrays ``wrap`` keeps: a jitted step's callbacks meet a few per unit leaf, per address
#: set of XLA's (a scan unrolled ``k`` times has ``k``).
WRAPPED = 4096
_DL_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 13: "cuda_managed", 10: "rocm"}


def multicast_capability(device: int = 0) -> tuple[bool, str]:
    """Whether NVSwitch multicast may be used on ``device``, and why (not).

    Never creates a multicast object: it reads the environment and one device
    attribute. ``NCCL_NVLS_ENABLE=0`` is an operator's statement that multicast
    must stay off on this machine; it is honoured, never overridden.
    """
    if os.environ.get("NCCL_NVLS_ENABLE", "").strip() == "0":
        return False, "NCCL_NVLS_ENABLE=0 is set: multicast is switched off on this machine"
    try:
        from cuda.bindings import driver as cu

        cu.cuInit(0)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
        err, value = cu.cuDeviceGetAttribute(attr, device)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False, f"cuDeviceGetAttribute(MULTICAST_SUPPORTED) failed: {err}"
    except Exception as e:  # noqa: BLE001 - no cuda-bindings, or an old one without the attribute
        return False, f"cannot query CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED ({e})"
    if not value:
        return False, "the device lacks CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"
    if not hasattr(socket, "send_fds"):
        return False, "Python lacks socket.send_fds (3.9+), needed to share VMM handles"
    return True, ("allowed and supported: slots are VMM memory bound to a multicast object; "
                  "all-gather writes each shard once, to the multicast address")


#: Launchers' variables for a process's rank on its host (Open MPI, MPICH, Slurm, torchrun).
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                    "LOCAL_RANK")
_process_device: Optional[int] = None


def process_device(split_rank: int, count: int) -> int:
    """This process's GPU: its rank on the host (from the launcher) modulo ``count``.

    Chosen once per process and kept, so every group of the process (one over
    ``COMM_SELF`` too) uses the same GPU. Without a launcher variable, the rank
    among the group's ranks on this host (``split_rank``) decides.
    """
    global _process_device
    if _process_device is None:
        local = split_rank
        for var in _LOCAL_RANK_VARS:
            value = os.environ.get(var, "").strip()
            if value.isdigit():
                local = int(value)
                break
        _process_device = local % count
    return _process_device


def physical_local_rank(comm: MPI.Comm) -> int:
    """This process's rank among the ranks on its host (ignores emulated topologies)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.rank
    finally:
        node.Free()


#: numpy dtypes of the arrays seen, normalized.
_DTYPES: dict = {}


@functools.cache
def _is_capturing() -> Any:
    """``stream -> bool`` (``cudaStreamIsCapturing``), made once per process: the lanes'
    and a backend's without lanes (``array_backend``: the optimizer's, the norm's).

    Asked at every plan call: CuPy's compiled call where it has one (a ctypes call of the
    driver's costs several times its host time), the driver's otherwise. A capture that an
    earlier error invalidated counts as one, as the driver's status does (CuPy raises)."""
    import cupy

    query = getattr(cupy.cuda.runtime, "streamIsCapturing", None)
    if query is None:
        return driver.stream_is_capturing()

    def capturing(stream: int) -> bool:
        try:
            return query(stream)
        except RuntimeError as e:
            if "invalidated the capture" in str(e):
                return True
            raise
    return capturing


class CudaBackend(Backend):
    """CuPy arrays on one GPU per rank; see the module docstring."""

    name = "cuda"
    graphs = True
    device_kind = "gpu"

    def __init__(self, group: Group) -> None:
        super().__init__(group)
        self.device = -1
        self.lanes: Optional[Lanes] = None  # the streams and engines, made by setup
        self.vmm = False
        self.capabilities: dict[str, tuple[bool, str]] = {}
        self._allocs: list = []
        self._inflight: list = []
        self._wrapped = BoundedCache(WRAPPED)  # wrap's arrays, by address, shape and dtype

    # -- start-up -------------------------------------------------------------

    def setup(self) -> None:
        """Pick the device, make the lane streams, probe features, start NCCL. Collective."""
        import cupy

        self.xp = cupy
        local = physical_local_rank(self.group.comm)  # collective: before anything can fail
        with fail_together(self.group.comm, "cuda backend setup failed"):
            self._setup_device(local)
        self.capabilities["symmetric memory"] = self._choose_memory()
        if self.group.topology.num_nodes > 1:
            self._check_nccl_layout()
            self.lanes.nccl = NcclLink()
            self.lanes.nccl.setup(self.group.inter_comm)
            cupy.cuda.Device(self.device).use()  # whatever NCCL's start-up made current
        self.capabilities["nccl"] = ((True, "inter-node communicator over nccl4py")
                                     if self.lanes.nccl else (False, "single node: not needed"))

    def _check_nccl_layout(self) -> None:
        """Refuse, on every rank, an inter-node communicator with two ranks on one device.

        NCCL rejects it (``ncclInvalidUsage`` from ``ncclCommInitRank``), and
        can hang on the way; it happens when emulated nodes (``local_size``)
        share GPUs, e.g. 4 ranks on 2 GPUs with ``local_size=2``. Collective.
        """
        place = (self.group.local_rank, socket.gethostname(), self.device)
        places = self.group.comm.allgather(place)
        pairs = shared_devices(places)
        if pairs:
            a, b = pairs[0]
            raise TideInvalid(
                f"expected the ranks of each inter-node NCCL communicator on distinct GPUs, "
                f"got ranks {a} and {b} (local rank {places[a][0]}) both on device "
                f"{places[a][2]} of {places[a][1]} ({len(pairs)} such pair(s)); use fewer "
                "ranks per GPU, or a local_size that keeps emulated nodes on their own GPUs")

    def _setup_device(self, local_rank: int) -> None:
        """Pick the device and build the lanes."""
        import cupy

        # The host's rank, not the emulated topology's: TIDE_LOCAL_SIZE=1 must not
        # put every rank of a host on device 0; nor must a group over COMM_SELF.
        self.device = process_device(local_rank, cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(self.device).use()
        try:  # cuda-bindings' runtime keeps its own notion of the current device
            from cuda.bindings import runtime as cudart

            cudart.cudaSetDevice(self.device)
        except ImportError:
            pass
        config, local_size = self.group.config, self.group.local_size
        split = config.ce_split
        props = cupy.cuda.runtime.getDeviceProperties(self.device)
        sms = props["multiProcessorCount"]

        def stream() -> Any:
            return cupy.cuda.Stream(non_blocking=True)

        self.lanes = lanes = Lanes(
            device=self.device, local_rank=self.group.local_rank,
            # One non-blocking stream per lane: peers 0..L-1, COMPUTE, NET ([Note: streams]),
            # and split - 1 more per peer lane for pushes split over copy engines.
            streams=[stream() for _ in range(local_size + 2)],
            aux_streams=[[stream() for _ in range(split - 1)] for _ in range(local_size)],
            push_split=split, copier=Copier(config.batch_copies, config.local_copy_max,
                                            config.local_copy_kernel_min, self.device,
                                            max(1, sms // 4), config.copy_batch_max),
            flags=FlagOps(self.device, config.graph_flag_kernels),
            accumulator=Accumulator(self.device, sms, config.accum_ctas),
            watchdog=Watchdog(self.device, config.timeout), retire=self.retire,
            capturing=_is_capturing())
        probe_stream = lanes.streams[-1]
        self.capabilities = {
            "batched copies": lanes.copier.probe(probe_stream.ptr),
            "stream memory operations": lanes.flags.probe(probe_stream),
            "multicast": multicast_capability(self.device),
            "NCCL put/signal": put_signal_capability(),
            "split pushes": (split > 1, f"{split} copy-engine stream(s) per peer push "
                             "(TIDE_CE_SPLIT)"),
        }

    def _choose_memory(self) -> tuple[bool, str]:
        """The symmetric-memory route (``Config.symmetric_memory``). Collective over the node.

        ``auto`` tries a small VMM allocation on every node-local rank; any
        rank's failure (no descriptor passing between these processes, say)
        is learnt by all, which then use legacy IPC.
        """
        from .vmm import VmmSymmetricBuffer

        want = self.group.config.symmetric_memory
        ipc = "legacy CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle), handles over MPI"
        if want == "ipc":
            self.vmm = False
            return True, ipc + " (symmetric_memory='ipc')"
        try:
            VmmSymmetricBuffer(self.group.node_comm, 1, self.device).free()
        except TideBackendError as e:
            if want == "vmm":
                raise
            self.vmm = False
            # Said once here, and listed by tidearray.info with the other capabilities.
            warnings.warn(f"tidearray: VMM symmetric memory is unavailable here, so legacy "
                          f"CUDA IPC is used: {e}", RuntimeWarning, stacklevel=2)
            return True, f"{ipc}; VMM is unavailable here: {e}"
        self.vmm = True
        return True, ("VMM (cuMemCreate, POSIX file descriptors over Unix sockets, "
                      "cuMemMap by every peer)")

    def multicast_capability(self) -> tuple[bool, str]:
        """See :func:`multicast_capability`; never creates a multicast object."""
        return multicast_capability(max(self.device, 0))

    def _alloc_multicast(self, nbytes: int) -> Any:
        import cupy

        from .multicast import MulticastSymmetricBuffer

        with cupy.cuda.Device(self.device):
            return MulticastSymmetricBuffer(self.group.node_comm, nbytes, self.device)

    def close(self) -> None:
        self._allocs, self._inflight = [], []
        lanes = self.lanes
        if lanes is None:
            return
        lanes.watchdog.close()
        if lanes.nccl is not None:
            import cupy

            prev = cupy.cuda.runtime.getDevice()
            self.synchronize()
            lanes.nccl.close()
            lanes.nccl = None
            cupy.cuda.runtime.setDevice(prev)

    # -- arrays and memory ----------------------------------------------------

    def resolve(self, obj: Any) -> Resolved:
        """A CuPy view of ``obj`` on this rank's device: CuPy as is, else DLPack or CAI."""
        arr = obj if isinstance(obj, self.xp.ndarray) else self._import(obj)
        data = arr.data
        if data.device_id != self.device and arr.size:
            raise TideInvalid(f"expected an array on cuda:{self.device} (this rank's device), "
                              f"got one on cuda:{data.device_id}")
        # Units resolve hundreds of arrays per call: skip the flags object where
        # CuPy exposes the bit, and normalize each dtype once.
        contiguous = getattr(arr, "_c_contiguous", None)
        if contiguous is None:
            contiguous = arr.flags.c_contiguous
        dtype = _DTYPES.get(arr.dtype)
        if dtype is None:
            dtype = _DTYPES.setdefault(arr.dtype, normalize(arr.dtype))
        return Resolved(arr, data.ptr, arr.nbytes, arr.shape, dtype, bool(contiguous))

    def array_key(self, objs: Any) -> Optional[tuple]:
        if type(objs) not in (list, tuple) or set(map(type, objs)) != {self.xp.ndarray}:
            return None
        try:
            return tuple(map(_ARRAY_KEY, objs))
        except AttributeError:  # a CuPy without the flag attribute
            return None

    def compile_copies(self, copies: Sequence[Copy], local: bool = False,
                       split: bool = False) -> CudaBatch:
        lanes = self.lanes
        return lanes.copier.plan(copies, local, lanes.push_split if split else 1)

    def compile_pieces(self, pieces: Sequence[AccumPiece], src_dtype: Any,
                       out_dtype: Any = float32, alone: bool = False) -> Any:
        check_accumulate(src_dtype, out_dtype)
        pieces = [p for p in pieces if p.numel]
        if not pieces:
            return TupleBatch(())
        return self.lanes.accumulator.table(pieces, src_dtype, out_dtype, alone)

    def _import(self, obj: Any) -> Any:
        import cupy

        where = type(obj).__name__
        if hasattr(obj, "__dlpack_device__"):
            kind, dev = obj.__dlpack_device__()
            kind = int(kind)
            if kind not in (_DL_CUDA, _DL_CUDA_MANAGED) or int(dev) != self.device:
                raise TideInvalid(
                    f"expected an array on cuda:{self.device} (this rank's device), got "
                    f"{where} on {_DL_NAMES.get(kind, kind)}:{int(dev)}")
        if hasattr(obj, "__dlpack__"):
            try:
                return cupy.from_dlpack(obj)
            except Exception as e:  # noqa: BLE001 - BufferError, TypeError, unsupported dtype
                if not hasattr(obj, "__cuda_array_interface__"):
                    raise TideInvalid(f"expected a device array CuPy can import by DLPack, "
                                      f"got {where} ({e})") from None
        if hasattr(obj, "__cuda_array_interface__"):
            return cupy.asarray(obj)
        # The backends word this alike ("expected an array"), so a rank's error reads
        # the same whichever backend raised it.
        raise TideInvalid(f"expected an array (CuPy, or one with __dlpack__ or "
                          f"__cuda_array_interface__) on cuda:{self.device}, got {where}")

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            arr = cupy.empty(shape, normalize(dtype))
        self._allocs.append(arr)  # kept until the next collective's work is done
        return arr

    def alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        import cupy

        from .vmm import VmmSymmetricBuffer

        kind = VmmSymmetricBuffer if self.vmm else IpcSymmetricBuffer
        with cupy.cuda.Device(self.device):
            return kind(self.group.node_comm, nbytes, self.device)

    def executor(self, stream: Any = None) -> CudaExecutor:
        self.check()  # a timed-out collective broke the group ([Note: watchdog])
        return CudaExecutor(self.lanes, self.group.local_size, stream)

    def capture(self, issue: Any, what: str, ran: bool = False, stream: Any = None) -> Any:
        """One collective captured as a CUDA graph ([Note: graph plans on cuda] in ``graphs``)."""
        from .graphs import capture

        self.check()
        return capture(self.lanes, self.group.local_size, issue, what,
                       streams.stream_ptr(stream) if ran else None)

    def check(self) -> None:
        """Raise TideBackendError if a collective timed out ([Note: watchdog])."""
        if self.lanes is not None:
            self.lanes.watchdog.check()

    def retire(self, events: list) -> None:
        """Hold buffers allocated since the last collective until ``events`` fire.

        See [Note: buffer lifetimes] in ``executor``.
        """
        self._inflight = [(evs, bufs) for evs, bufs in self._inflight
                          if not all(ev.done for ev in evs)]
        if self._allocs:
            self._inflight.append((events, self._allocs))
            self._allocs = []

    def synchronize(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()

    # -- device work of the layers above ([Note: backend interface] in ``_base``) ----------

    def on_stream(self, stream: Any) -> Any:
        return streams.on_stream(stream)

    def on_device(self, array: Any = None) -> Any:
        import cupy

        return cupy.cuda.Device(self.device if array is None else array.device.id)

    def wrap(self, buffer: Any) -> Any:
        """A CuPy array straight over the pointer (``UnownedMemory``): ``cupy.asarray`` and
        DLPack may synchronize on the producer's stream ([Note: XLA's buffers on cuda] in
        ``tidearray.jax._buffers``).

        The array is kept by its address, shape and dtype and handed out again: XLA's
        buffer assignment repeats from step to step (and a scanned body's from iteration
        to iteration), and making a CuPy array costs microseconds of Python, for each of
        a unit's leaves, in each of its callbacks. So the array does not keep ``buffer``
        alive (XLA's buffer objects are valid for their callback only): like every array
        ``wrap`` returns, it is used only during a callback on a buffer at its address."""
        iface = buffer.__cuda_array_interface__
        dtype = np.dtype(buffer.dtype)
        key = (iface["data"][0], tuple(iface["shape"]), dtype)
        array = self._wrapped.get(key)
        if array is None:
            import cupy

            nbytes = math.prod(key[1]) * dtype.itemsize
            mem = cupy.cuda.UnownedMemory(key[0], nbytes, None, self.device)
            array = self._wrapped.put(key, cupy.ndarray(key[1], dtype,
                                                        cupy.cuda.MemoryPointer(mem, 0)))
        return array

    def asarray(self, obj: Any) -> Any:
        """A CUDA DLPack producer's memory through ``cupy.from_dlpack`` (a CUDA tensor:
        no copy), anything else (NumPy, a CPU tensor, a CuPy array) by ``cupy.asarray``."""
        import cupy

        if hasattr(obj, "__dlpack_device__") and not isinstance(obj, cupy.ndarray) \
                and int(obj.__dlpack_device__()[0]) in (_DL_CUDA, _DL_CUDA_MANAGED):
            return cupy.from_dlpack(obj)
        return cupy.asarray(obj if isinstance(obj, cupy.ndarray) else np.asarray(obj))

    def stream(self, stream: Any) -> Any:
        """``streams.cupy_stream(stream)``."""
        return streams.cupy_stream(stream)

    def completion(self, stream: Any) -> CudaCompletion:
        """An event recorded on ``stream`` now (what ``Stream.record`` would do, for any
        stream kind)."""
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        cupy.cuda.runtime.eventRecord(event.ptr, streams.stream_ptr(stream))
        return CudaCompletion([event])

    def step_pool(self) -> StepPool:
        """A new ``cupy.cuda.MemoryPool``, made after the eager steps' cached blocks go
        back to the device, so that it can take that memory instead of holding its own
        beside them (the captured trainer step peaked at 1.35x the eager one's with both
        held)."""
        import cupy

        from .graphs import CudaStepPool

        cupy.get_default_memory_pool().free_all_blocks()
        return CudaStepPool(cupy.cuda.MemoryPool())

    def copy_arrays(self, dsts: Sequence[Any], srcs: Sequence[Any], stream: Any) -> None:
        """One ``cudaMemcpyAsync`` (device to device) per non-empty pair."""
        import cupy

        ptr = streams.stream_ptr(stream)
        for d, s in zip(dsts, srcs):
            if d.nbytes:
                cupy.cuda.runtime.memcpyAsync(d.data.ptr, s.data.ptr, d.nbytes, _D2D, ptr)

    def settle(self) -> None:
        streams.settle()

    def capturing(self, stream: Any = None) -> bool:
        return _is_capturing()(streams.stream_ptr(stream))  # also without lanes

    def uploader(self) -> streams.HostUpload:
        return streams.HostUpload()

    def kernel(self, source: str, name: str, like: Any) -> Any:
        return kernels.function(source, name, like.device.id)
