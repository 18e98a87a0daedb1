"""A failure that can repeat at the request rate (a full disk fails every batch), logged without flooding."""

from __future__ import annotations

import logging
import time

FAILURE_LOG_EVERY = 10.0  # s: a failure that repeats (a full disk fails every batch) is logged once per this


class FailureLog:
    """Log a failure that may repeat at the request rate without flooding the log.

    The first failure is logged at once; while it goes on, one line per ``every`` seconds says how many
    more there were and the latest error; the first success after failures says that it recovered.
    """

    def __init__(self, logger: logging.Logger, what: str, every: float = FAILURE_LOG_EVERY):
        self.log, self.what, self.every = logger, what, every
        self.failing = 0           # failures since the last success
        self.unlogged = 0          # failures not yet in the log
        self.logged_at = -1e18

    def failed(self, name: str, error: object) -> None:
        self.failing += 1
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at < self.every:
            return
        if self.failing == 1:
            self.log.error("%s: %s failed: %s", name, self.what, error)
        else:
            self.log.error("%s: %s failed %d more time(s) in the last %.0f s (%d in a row), latest: %s", name,
                           self.what, self.unlogged, now - self.logged_at, self.failing, error)
        self.logged_at, self.unlogged = now, 0

    def succeeded(self, name: str) -> None:
        if self.failing:
            self.log.warning("%s: %s works again after %d failure(s)", name, self.what, self.failing)
            self.failing = self.unlogged = 0
            self.logged_at = -1e18
