"""A host-side watchdog over the cuda backend's collectives: no wait lasts forever.

A collective's lanes wait on flag words (``cuStreamWaitValue32``) that peers
write. A peer that died or stopped never writes them, and the wait would hold
its lane, and every stream ordered after it, for ever. The watchdog notices.

[Note: watchdog]
Every collective is registered when issued, with its completion events and the
(flag address, value) pairs its lanes wait for. A daemon thread polls the
events. When a collective has not completed ``Config.timeout`` seconds after it
was issued, the thread

* writes each awaited value into its flag word itself (``cuMemsetD32Async`` on
  a stream of its own), which releases the waits, so the lanes and the
  caller's streams drain instead of hanging;
* aborts the NCCL communicator (``ncclCommAbort``) if the collective used it
  (across nodes), which ends NCCL kernels waiting for the peer;
* marks the backend broken, with a message naming the collective's sequence
  number, its kind and how long it waited.

The collective that timed out delivered garbage (its peers' data never came);
every later call on the group raises :class:`TideBackendError` at once, and
:meth:`CudaBackend.check` raises it on demand, for example before using results
read after a host synchronization. ``group.close()`` still frees everything.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ..._errors import TideBackendError
from . import driver

#: Seconds between polls of the registered collectives' events.
POLL_S = 0.05


class Watchdog:
    """Registers collectives and releases the waits of any that outlive ``timeout``.

    Args:
        device: the CUDA device the collectives run on.
        timeout: seconds a collective may take from issue to completion.
    """

    def __init__(self, device: int, timeout: float) -> None:
        self.device = device
        self.timeout = timeout
        self.broken: Optional[str] = None
        # Registrations, appended by the issuing thread and taken by the watchdog's: a
        # deque's append and popleft are atomic, so registering takes no lock (it is on
        # every call's host time: [Note: graph launch cost] in ``graphs``).
        self._pending: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._memset: Any = None
        self._stream: Any = None
        self._seq = 0

    def watch(self, what: str, events: Sequence[Any], waits: Sequence[tuple[int, int]],
              abort: Optional[Callable[[], None]] = None) -> None:
        """Register one issued collective: its completion ``events``, the flag
        ``waits`` its lanes hold on, and ``abort`` for the NCCL work it issued. Both
        sequences are kept as given (a graph passes the same ones at every launch):
        callers do not change them afterwards."""
        self._seq += 1
        if not waits and abort is None:
            return  # nothing it does can wait on a peer
        if self._thread is None:
            self._start()
        self._pending.append((time.monotonic() + self.timeout, self._seq, what, events,
                              waits, abort))

    def check(self) -> None:
        """Raise TideBackendError if a collective has timed out."""
        if self.broken is not None:
            raise TideBackendError(self.broken)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _start(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._memset = driver.memset_d32_async()
        self._thread = threading.Thread(target=self._run, name="tidearray-watchdog",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import cupy

        cupy.cuda.Device(self.device).use()
        driver.relax_capture_mode()  # its queries must not break a user's capture
        registered, keep = self._pending, []  # keep: registered, not yet done
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            pending, keep = keep, []
            while registered:
                pending.append(registered.popleft())
            for entry in pending:
                deadline, seq, what, events, waits, abort = entry
                if all(ev.done for ev in events):
                    continue
                if now < deadline:
                    keep.append(entry)
                    continue
                self._expire(seq, what, waits, abort)

    def _expire(self, seq: int, what: str, waits: list,
                abort: Optional[Callable[[], None]]) -> None:
        # Broken first: releasing the waits lets the caller's host synchronization
        # return, and it must then find the group broken, not a window before it is.
        self.broken = (f"collective #{seq} ({what}) did not complete within "
                       f"{self.timeout:g} s: a peer never signalled (dead, stopped, or "
                       "calling other collectives); its waits were released"
                       + (" and its NCCL communicator aborted" if abort else "")
                       + ", its results are garbage, and this group can no longer be used")
        if abort is not None:
            try:
                abort()
            except Exception as e:  # noqa: BLE001 - report it; the group is broken either way
                self.broken += f" (ncclCommAbort failed: {e})"
        for addr, value in waits:
            err = self._memset(addr, value & 0xFFFFFFFF, 1, self._stream.ptr)
            if err:
                self.broken += f" (releasing a wait failed: CUresult {err})"
                return
