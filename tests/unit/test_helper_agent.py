"""The helper agent's liveness check (services/memcached-helper/agent.py, HelperAgent.tick), without a helper.

The agent withdraws its helper when it makes no progress for --stale s and announces it again once it
does.  Progress is the stats file being written *and* the lcores' loop counter moving: the file's writer is
mc-helper's stats thread, which goes on writing if every lcore hangs.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from vfab.services.memcached_helper.agent import HelperAgent

STALE = 0.15


def agent(tmp_path) -> tuple[HelperAgent, list]:
    events: list = []
    a = object.__new__(HelperAgent)
    a.args = SimpleNamespace(name="h1", stale=STALE, period=1e9)
    a.stats_path = str(tmp_path / "h1.stats")
    a.last_stats, a.last_change, a.stalled_at, a.last_publish = {}, time.monotonic(), 0.0, time.monotonic()
    a.server = "announced"

    def withdraw(why: str) -> None:
        events.append(("withdraw", why))
        a.server = None

    def announce() -> None:
        events.append(("announce",))
        a.server = "announced"

    a.withdraw, a.announce = withdraw, announce
    return a, events


def write(a: HelperAgent, uptime: int, loops: int) -> None:
    with open(a.stats_path, "w") as fh:
        fh.write(f"uptime_ms {uptime}\nloops {loops}\nconns 1\n")


def run_for(a: HelperAgent, seconds: float, uptime: list, loops: list) -> None:
    """Tick every 10 ms for ``seconds``; each tick writes uptime/loops, advanced by the callers' steps."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        uptime[0] += uptime[1]
        loops[0] += loops[1]
        write(a, uptime[0], loops[0])
        a.tick()
        time.sleep(0.01)


def test_a_hung_lcore_is_withdrawn_though_its_stats_file_is_still_written(tmp_path):
    a, events = agent(tmp_path)
    uptime, loops = [0, 10], [0, 500]
    run_for(a, 3 * STALE, uptime, loops)                 # healthy: file written, loops moving
    assert events == []
    loops[1] = 0                                         # every lcore hangs; the stats thread goes on
    run_for(a, 3 * STALE, uptime, loops)
    assert len(events) == 1 and events[0][0] == "withdraw", events
    assert "its lcores' loop counter" in events[0][1] and "has not changed for" in events[0][1], events
    loops[1] = 500                                       # it moves again: announced again, once
    run_for(a, 2 * STALE, uptime, loops)
    assert events[1:] == [("announce",)], events


def test_a_stopped_helper_is_withdrawn_by_its_still_stats_file(tmp_path):
    """SIGSTOP stops both: the file itself stands still (what the SIGSTOP fabric test sees in the log)."""
    a, events = agent(tmp_path)
    uptime, loops = [0, 10], [0, 500]
    run_for(a, 2 * STALE, uptime, loops)
    run_for(a, 3 * STALE, [uptime[0], 0], [loops[0], 0])
    assert len(events) == 1 and events[0][0] == "withdraw", events
    assert events[0][1].startswith("its stats file ") and "has not changed for" in events[0][1], events
