"""The machine-wide testbed lock: switch, host and namespace names are fixed, so one testbed runs at a time.

Re-entrant within a process (a test can hold it around a Testbed); a forked child drops its reference so it
never keeps the lock alive after its parent died.  ``testbed.fabric`` re-exports these names.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

LOCK_FILE = "/run/vfab-testbed.lock"
LOCK_WAIT = 900

# The machine-wide testbed lock, re-entrant within this process (a test can hold it around a Testbed).
_lock_mutex = threading.Lock()
_lock_fh = None
_lock_depth = 0


def acquire_lock(wait: float = LOCK_WAIT) -> None:
    """Take the machine's testbed lock (switch and host names are fixed: one testbed at a time)."""
    global _lock_fh, _lock_depth
    with _lock_mutex:
        if _lock_depth:
            _lock_depth += 1
            return
        fh = open(LOCK_FILE, "w")
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > wait:
                    fh.close()
                    raise RuntimeError(f"another vfab testbed holds {LOCK_FILE} for over {wait:.0f} s: "
                                       "stop it ('vfab down') or wait") from None
                time.sleep(0.5)
        _lock_fh, _lock_depth = fh, 1


def _drop_lock_in_child() -> None:
    """A forked child (multiprocessing) must not keep the lock alive after its parent died."""
    global _lock_fh, _lock_depth
    if _lock_fh is not None:
        _lock_fh.close()  # only this process's reference: the parent still holds the flock
    _lock_fh, _lock_depth = None, 0


os.register_at_fork(after_in_child=_drop_lock_in_child)


def release_lock() -> None:
    global _lock_fh, _lock_depth
    with _lock_mutex:
        if not _lock_depth:
            return
        _lock_depth -= 1
        if not _lock_depth:
            _lock_fh.close()  # releases the flock
            _lock_fh = None
