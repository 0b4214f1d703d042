"""The cuda group refuses layouts NCCL cannot take, on every rank, before NCCL sees them."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import tidearray

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


def test_emulated_nodes_sharing_a_gpu_are_refused(comm):
    """4 ranks on 2 GPUs as 2 emulated nodes of 2: the inter-node communicators would
    put two ranks on one device. Every rank raises TideInvalid, and the world goes on."""
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    per_host = node.size
    node.Free()
    if comm.size != per_host or per_host <= count or per_host % 2:
        pytest.skip("needs one host with more ranks than GPUs, an even number of them")
    with pytest.raises(tidearray.TideInvalid, match="distinct GPUs"):
        tidearray.init(backend="cuda", local_size=per_host // 2)
    comm.Barrier()
