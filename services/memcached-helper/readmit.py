"""When a helper withdrawn for not serving may come back: re-admission with hysteresis (issue 43).

A helper whose leg to memcached stalls is withdrawn at once (its clients go to the other helpers or to
memcached).  Announcing it again the moment it serves lets a leg that keeps failing pull clients in and out
of it, each time paying the switches' cut-over and the stall bound.  The rule:

- it is announced again only after it has served **without interruption** for a hold time;
- the hold is ``base`` after one withdrawal and doubles with each further withdrawal within ``window``
  seconds (``base * 2**(n-1)`` for n withdrawals in the window), up to ``cap``;
- a withdrawal older than ``window`` no longer counts, so a helper that stalls once in a long while always
  comes back after ``base``.

Pure: every call takes ``now`` (monotonic seconds); the agent (``agent.py``) feeds it.  Unit-tested in
``tests/unit/test_helper_readmit.py``; on the fabric by ``test_mc_fabric.py``'s flapping-leg test.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Readmit:
    base: float = 0.5      # hold after a single withdrawal, s
    cap: float = 8.0       # longest hold, s
    window: float = 30.0   # withdrawals this recent count, s
    withdrawals: list[float] = field(default_factory=list)
    serving_since: float | None = None

    def withdrawn(self, now: float) -> None:
        self.withdrawals = [t for t in self.withdrawals if now - t <= self.window] + [now]
        self.serving_since = None

    def recent(self, now: float) -> int:
        return sum(1 for t in self.withdrawals if now - t <= self.window)

    def hold(self, now: float) -> float:
        n = self.recent(now)
        return min(self.cap, self.base * 2 ** (n - 1)) if n else 0.0

    def may_return(self, now: float, serving: bool) -> bool:
        """Whether a withdrawn helper seen ``serving`` (or not) at ``now`` may be announced again."""
        if not serving:
            self.serving_since = None
            return False
        if self.serving_since is None:
            self.serving_since = now
        return now - self.serving_since >= self.hold(now)

    def explain(self, now: float) -> str:
        """For an operator, while it serves but is still held out."""
        since = now - self.serving_since if self.serving_since is not None else 0.0
        return (f"serves again for {since:.1f} s; re-admitted after {self.hold(now):.1f} s of serving without a "
                f"stall ({self.recent(now)} withdrawal(s) in the last {self.window:.0f} s; the hold doubles with "
                f"each, up to {self.cap:.0f} s)")
