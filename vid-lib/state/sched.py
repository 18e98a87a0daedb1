"""The scheduler's account of one thread: how long it has been runnable but not running (waiting for a core).

Read from ``/proc/thread-self/schedstat`` ("<ns on a CPU> <ns waiting for one> <slices>"), which names the
*reading* thread: open a :class:`RunDelay` in the thread it is to measure.  The stateful-endpoint loop uses it
to tell a long pass's wait for a core from its work; the kvs load generator to tell its own waits from the
service's latency.
"""

from __future__ import annotations

import os

SCHEDSTAT = "/proc/thread-self/schedstat"


class RunDelay:
    """The opening thread's run-queue delay so far (s), read by calling it; 0 if the kernel does not say."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open(SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self.fd = None

    def __call__(self) -> float:
        if self.fd is None:
            return 0.0
        try:
            return int(os.pread(self.fd, 64, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
