"""Driver entry points on the issue path of every collective, called through ctypes.

cuda-python converts its arguments on every call (a batch's address lists
element by element, microseconds per copy); a collective issues tens of these
calls per step. Taking the C entry points with ``cuGetProcAddress`` at a
fixed ABI version and calling them through ctypes costs the same small amount
per call, whatever the batch length. Everything else stays with cuda-python.

Only the calls are ctypes: the structs they take and the enum and flag values
they pass come from cuda.bindings (``copies.stream_order_attrs``, the flags in
``flags.FlagOps.probe``), so no layout or number is copied here by hand.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

_lib: Any = None

#: The ABI versions asked for: the first release of each signature used here.
CUDA_12_0 = 12000
CUDA_12_8 = 12080


def entry(name: str, version: int, *argtypes: Any) -> Callable[..., int]:
    """The driver function ``name`` at ABI ``version``, returning its CUresult.

    Raises:
        OSError: no ``libcuda.so.1``.
        RuntimeError: the driver has no such entry point at that version.
    """
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        _lib.cuGetProcAddress_v2.restype = ctypes.c_int
        _lib.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                             ctypes.c_int, ctypes.c_uint64,
                                             ctypes.POINTER(ctypes.c_int)]
    pfn, status = ctypes.c_void_p(), ctypes.c_int()
    err = _lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(pfn), version, 0,
                                   ctypes.byref(status))
    if err or not pfn.value:
        raise RuntimeError(f"cuGetProcAddress({name}, {version}): CUresult {err}, "
                           f"symbol status {status.value}")
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pfn.value)


def memcpy_batch_async() -> Callable[..., int]:
    """``cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
    failIdx, stream)``, the CUDA 12.8 signature (13.0 dropped ``failIdx`` in ``_v2``)."""
    p = ctypes.c_void_p
    return entry("cuMemcpyBatchAsync", CUDA_12_8, p, p, p, ctypes.c_size_t, p, p,
                 ctypes.c_size_t, p, p)


def stream_value32(op: str) -> Callable[..., int]:
    """``cuStream{Write,Wait}Value32(stream, addr, value, flags)`` (``op``: Write or Wait)."""
    return entry(f"cuStream{op}Value32", CUDA_12_0, ctypes.c_void_p, ctypes.c_uint64,
                 ctypes.c_uint32, ctypes.c_uint)


def memset_d32_async() -> Callable[..., int]:
    """``cuMemsetD32Async(dst, value, count, stream)``: the watchdog's flag writes."""
    return entry("cuMemsetD32Async", CUDA_12_0, ctypes.c_uint64, ctypes.c_uint,
                 ctypes.c_size_t, ctypes.c_void_p)


def address_range() -> Callable[[int], tuple[int, int]]:
    """``ptr -> (base, size)`` of the allocation holding ``ptr`` (``cuMemGetAddressRange``);
    ``(0, 0)`` where the driver does not know the address."""
    fn = entry("cuMemGetAddressRange", CUDA_12_0, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_uint64)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    pbase, psize = ctypes.addressof(base), ctypes.addressof(size)

    def query(ptr: int) -> tuple[int, int]:
        if fn(pbase, psize, ptr):
            return 0, 0
        return base.value, size.value
    return query


def stream_is_capturing() -> Callable[[int], bool]:
    """``stream -> bool``: whether ``stream`` is capturing a graph (``cuStreamIsCapturing``)."""
    fn = entry("cuStreamIsCapturing", CUDA_12_0, ctypes.c_void_p, ctypes.c_void_p)
    status = ctypes.c_int()
    pstatus = ctypes.addressof(status)

    def query(stream: int) -> bool:
        err = fn(stream, pstatus)
        if err:
            raise RuntimeError(f"cuStreamIsCapturing: CUresult {err}")
        return status.value != 0  # ACTIVE, or INVALIDATED by an earlier error
    return query


class GraphCalls:
    """The graph entry points: capture on a stream, instantiate, launch, destroy."""

    def __init__(self) -> None:
        p = ctypes.c_void_p
        self.begin = entry("cuStreamBeginCapture", CUDA_12_0, p, ctypes.c_int)
        self.end = entry("cuStreamEndCapture", CUDA_12_0, p, p)
        self.instantiate = entry("cuGraphInstantiateWithFlags", CUDA_12_0, p, p,
                                 ctypes.c_ulonglong)
        self.upload = entry("cuGraphUpload", CUDA_12_0, p, p)
        self.launch = entry("cuGraphLaunch", CUDA_12_0, p, p)
        self.destroy_exec = entry("cuGraphExecDestroy", CUDA_12_0, p)
        self.destroy = entry("cuGraphDestroy", CUDA_12_0, p)


def relax_capture_mode() -> bool:
    """Set this thread's stream-capture interaction mode to relaxed
    (``cuThreadExchangeStreamCaptureMode``): its event queries then never invalidate a
    global-mode capture running on another thread (``torch.cuda.graph``'s default), as
    PyTorch's NCCL watchdog does for itself. False where the driver has no such call."""
    try:
        fn = entry("cuThreadExchangeStreamCaptureMode", CUDA_12_0, ctypes.c_void_p)
    except (OSError, RuntimeError):
        return False
    mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
    return fn(ctypes.byref(mode)) == 0
