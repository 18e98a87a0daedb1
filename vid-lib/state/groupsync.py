"""The group fsync of a stateful endpoint, on a thread of its own.

Under group commit (:mod:`.backend`) a batch commits without waiting for the
disk and its replies wait until an fsync covers it.  The loop used to run that
fsync itself, and every request that came meanwhile (and every reply that
needed no disk) waited behind it: 4 ms on average on this machine, 219 times
in one sdhcp lease burst.  Here the loop hands the syncer the number of the
newest batch it has committed and goes on serving; the syncer fsyncs (the
GIL is free meanwhile), queues what it covered and how it went, and wakes the
loop, which then sends the covered replies (or answers them UNAVAILABLE if
the fsync failed).  At most one fsync runs at a time: the batches committed
while it runs are covered by the next one, started as soon as it ends.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from vfab.vid.state.backend import BackendError

log = logging.getLogger("vfab.state.groupsync")


class DiskSyncer:
    """One thread that runs ``sync()`` when asked and reports back through ``done`` and ``wake()``."""

    def __init__(self, sync: Callable[[], None], wake: Callable[[], None], name: str):
        self._sync = sync
        self._wake = wake
        self._cv = threading.Condition()
        self._asked = 0            # the newest batch the next fsync must cover (0: nothing asked)
        self._stop = False
        self.busy = False          # (loop thread) an fsync was asked and its result not yet taken
        self.done: collections.deque = collections.deque()   # (covered up to, error or '', seconds)
        self._thread = threading.Thread(target=self._run, name=f"{name}-fsync", daemon=True)
        self._thread.start()

    def start(self, upto: int) -> None:
        """(loop thread) fsync now; every batch up to ``upto`` has committed (its writes are in the file)."""
        self.busy = True
        with self._cv:
            self._asked = upto
            self._cv.notify()

    def take(self) -> list[tuple[int, str, float]]:
        """(loop thread) The fsyncs that ended since the last call."""
        out = []
        while self.done:
            out.append(self.done.popleft())
        if out:
            self.busy = False
        return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._asked and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                upto, self._asked = self._asked, 0
            t0 = time.monotonic()
            try:
                self._sync()
                error = ""
            except BackendError as exc:   # names its cause
                error = str(exc)
            except Exception as exc:      # a bug: still answer what waited rather than leave it hanging
                log.exception("the group fsync failed unexpectedly")
                error = f"{type(exc).__name__}: {exc}"
            self.done.append((upto, error, time.monotonic() - t0))
            try:
                self._wake()
            except OSError:   # the loop closed its wake-up fd: shutting down
                return

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread once a running fsync returns (the loop syncs what is left itself)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


__all__ = ["DiskSyncer"]
