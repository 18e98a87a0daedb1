"""Group commit for the endpoint's loop: one thread fsyncs the store while the loop serves the next batches.

A backend that opts in (``group_commit = True``) commits each batch without waiting for the disk and says
whether the batch wrote something that must be durable before its replies leave (``batch_unsynced``).  The
loop then keeps that batch's replies, in order behind every earlier batch's, and asks the :class:`Syncer`
for the disk; the syncer runs ``backend.sync()`` (an fsync of the write-ahead log, releasing the GIL) and
tells the loop which batches it covered: every batch committed before the fsync began.  Meanwhile the loop
reads, serves and commits the next batches, and one fsync covers all of them that were committed by then.

Why: a shard's fsync took 1-2 ms on this machine's shared disk with 4 shards syncing (ext4 serializes them
in its journal), and the loop did nothing else meanwhile.  bench/sdhcp_lease.py, 4 shards, 2026-11-25:
with REQUEST batches left unsynced (an experiment, not a setting), 245 udhcpc clients leased in 0.99 s
instead of 1.14 s and 1,000 perfdhcp clients at 4,000/s in 0.30 s instead of 0.35 s; group commit against
the fsync in the loop, alternated, 6 runs each: medians 1.08 vs 1.16 s and 0.305 vs 0.36 s (a noisy
machine: single runs spread 0.99-1.34 s).

Nothing acknowledges early: a reply leaves only after an fsync that began after its batch's commit (or,
for a batch that wrote nothing durable, after every earlier batch's replies).  A failed fsync turns the
replies it held into the backend's UNAVAILABLE errors (the client retries).
"""

from __future__ import annotations

import logging
import threading

from vfab.vid.state.faillog import FailureLog

log = logging.getLogger("vfab.state.loop")


class Syncer:
    """The thread that makes a group-commit backend's batches durable; results go back through ``loop.call``."""

    def __init__(self, loop):
        self.loop = loop
        self.backend = loop.backend
        self.want = 0          # the newest batch number that asked for the disk
        self.done = 0          # the newest batch number an fsync covered
        self.syncs = 0
        self.failures = FailureLog(log, "fsync of the store (its replies are answered UNAVAILABLE)")
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"{loop.name}-syncer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)

    def request(self, seq: int) -> None:
        """(loop thread) Batch ``seq`` committed and needs the disk."""
        with self._cv:
            if seq > self.want:
                self.want = seq
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self.want <= self.done:
                    self._cv.wait()
                if self._stop:
                    return
                target = self.want   # every batch up to here committed before the fsync below begins
            error = ""
            try:
                self.backend.sync()
            except Exception as exc:  # noqa: BLE001 - reported to the loop, which answers with errors
                error = str(exc) or type(exc).__name__
                self.failures.failed(self.loop.name, error)
            else:
                if self.failures.failing:
                    self.failures.succeeded(self.loop.name)
            with self._cv:
                self.done = target
                self.syncs += 1
            self.loop.call(lambda t=target, e=error: self.loop.synced(t, e), wait=False)
