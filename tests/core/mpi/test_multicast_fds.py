"""The cuda multicast transport's host-side logic, testable without a GPU.

``exchange_fds`` hands VMM file descriptors between a node's processes; here it
carries memfds whose contents name their owner, so a wrong routing or a lost
descriptor fails. The capability check must refuse while NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import os

import pytest

from ..._util import agree, child_env

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs os.memfd_create (Linux)")
def test_exchange_fds_routes_each_rank_descriptors(group):
    from tidearray.backends.cuda.vmm import exchange_fds

    comm = group.node_comm
    token = os.urandom(8).hex()
    mine = []
    for k in range(2):  # two descriptors per rank, like memory + multicast handles
        fd = os.memfd_create(f"tide-test-{k}")
        os.write(fd, f"{token}:{comm.rank}:{k}".encode())
        mine.append(fd)
    tokens = comm.allgather(token)
    got = exchange_fds(comm, mine)
    failures = [] if len(got) == comm.size else [f"got {len(got)} ranks' descriptors"]
    for r, fds in enumerate(got):
        for k, fd in enumerate(fds):
            # pread: passed descriptors share one file offset across processes, so
            # lseek + read races with the other ranks reading the same descriptor.
            text = os.pread(fd, 64, 0).decode()
            if text != f"{tokens[r]}:{r}:{k}":
                failures.append(f"descriptor {k} of rank {r} reads {text!r}")
            if r != comm.rank:
                os.close(fd)
        if len(fds) != 2:
            failures.append(f"rank {r}: expected 2 descriptors, got {len(fds)}")
    for fd in mine:
        os.close(fd)
    agree(comm, failures, "exchange_fds")


def test_multicast_refused_while_nvls_disabled(monkeypatch):
    from tidearray.backends.cuda import multicast_capability

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ok, why = multicast_capability(0)
    assert not ok and "NCCL_NVLS_ENABLE=0" in why


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs os.memfd_create (Linux)")
def test_exchange_fds_failure_raises_on_every_rank(group, monkeypatch):
    """One rank that cannot reach its peers (as in containers without a shared
    network namespace) makes every rank raise, none waits for it."""
    import socket

    from tidearray import TideBackendError
    from tidearray.backends.cuda.vmm import exchange_fds

    comm = group.node_comm
    if comm.size < 2:
        pytest.skip("needs 2 node-local ranks")
    if comm.rank == comm.size - 1:
        def refuse(self, addr):
            raise ConnectionRefusedError("refused (test)")

        monkeypatch.setattr(socket.socket, "connect", refuse)
    fd = os.memfd_create("tide-test")
    try:
        with pytest.raises(TideBackendError, match=f"rank {comm.size - 1}: .*refused"):
            exchange_fds(comm, [fd], timeout=2.0)
    finally:
        os.close(fd)


_INTRUDER = r"""
import os, socket, sys
fd = os.memfd_create("intruder")
os.write(fd, b"intruder")
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.connect(sys.argv[1].encode().replace(b"@", b"\0"))
    try:
        socket.send_fds(s, [(1).to_bytes(4, "little")], [fd])
    except OSError:  # refused and closed before the send finished: what should happen
        pass
"""


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs os.memfd_create (Linux)")
def test_exchange_fds_refuses_a_process_that_is_not_a_peer(group, monkeypatch):
    """Another local process connects to rank 0's socket first, claiming to be rank 1
    and sending a descriptor: rank 0 refuses it unread, warns, and still gets every
    real peer's descriptors."""
    import socket
    import subprocess
    import sys
    import warnings

    from tidearray.backends.cuda import vmm

    comm = group.node_comm
    if comm.size < 2:
        pytest.skip("needs 2+ ranks on one node")
    intruder: list = []
    if comm.rank == 1:  # the intruder connects to rank 0 before rank 1 does
        connect = socket.socket.connect

        def run_intruder(name: str) -> None:  # never raises: rank 0 is waiting for us
            try:
                done = subprocess.run([sys.executable, "-c", _INTRUDER,
                                       name.replace("\0", "@")], env=child_env(),
                                      capture_output=True, text=True, timeout=30)
                if done.returncode:
                    intruder.append(f"the intruder failed: {done.stderr[-300:]}")
            except (OSError, subprocess.SubprocessError) as e:
                intruder.append(f"the intruder did not run: {e}")

        def intrude_first(self, addr):  # rank 1's connection to rank 0, once
            if isinstance(addr, str) and addr.startswith("\0tidearray-") \
                    and addr.endswith("-0") and not intruder:
                intruder.append(None)
                run_intruder(addr)
            return connect(self, addr)

        monkeypatch.setattr(socket.socket, "connect", intrude_first)
    token = os.urandom(8).hex()
    fd = os.memfd_create("tide-test")
    os.write(fd, f"{token}:{comm.rank}".encode())
    tokens = comm.allgather(token)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = vmm.exchange_fds(comm, [fd])
    monkeypatch.undo()
    failures = [f for f in intruder if f is not None]
    if comm.rank == 1 and not intruder:
        failures.append("rank 1 never connected to rank 0: the intruder did not run")
    for r, fds in enumerate(got):
        text = os.pread(fds[0], 64, 0).decode()
        if text != f"{tokens[r]}:{r}":
            failures.append(f"rank {r}'s descriptor reads {text!r}")
        if r != comm.rank:
            os.close(fds[0])
    os.close(fd)
    refused = [w for w in caught if "refused a descriptor connection" in str(w.message)]
    if comm.rank == 0 and not refused:
        failures.append("the intruder was not refused")
    agree(comm, failures, "exchange_fds with an intruder")
