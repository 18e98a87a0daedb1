"""The helper agent's liveness check (services/memcached-helper/agent.py, HelperAgent.tick), without a helper.

The agent withdraws its helper when it makes no progress for --stale s and announces it again once it
does.  Progress is the stats file being written *and* every lcore's loop counter moving: the file's writer is
mc-helper's stats thread, which goes on writing if lcores hang.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from vfab.services.memcached_helper.agent import HelperAgent, default_stats_path
from vfab.services.memcached_helper.readmit import Readmit
from vfab.testbed.procs import wait_for

STALE = 0.15


def agent(tmp_path, hold: float = 0.0) -> tuple[HelperAgent, list]:
    """``hold``: the re-admission hold after one withdrawal (0: announced again at the first sign of serving)."""
    events: list = []
    a = object.__new__(HelperAgent)
    a.args = SimpleNamespace(name="h1", stale=STALE, period=1e9)
    a.readmit, a.held_noted = Readmit(base=hold, cap=8 * hold), False
    a.stats_path = str(tmp_path / "h1.stats")
    a.last_stats, a.last_change, a.stalled_at, a.last_publish = {}, time.monotonic(), 0.0, time.monotonic()
    a.server = "announced"

    def withdraw(why: str) -> None:
        events.append(("withdraw", why))
        a.server = None

    def announce() -> None:
        events.append(("announce",))
        a.server = "announced"

    def note_down(stats: dict, why: str) -> None:
        events.append(("note_down", why))

    a.withdraw, a.announce, a.note_down, a.memcached = withdraw, announce, note_down, "10.0.0.1:11211"
    return a, events


def write(a: HelperAgent, uptime: int, loops: int, per_lcore: list[int] | None = None,
          extra: tuple[str, ...] = ()) -> None:
    """The file as an older mc-helper wrote it (``loops``, the sum, only), or with ``per_lcore`` counters."""
    lines = [f"uptime_ms {uptime}", f"loops {loops if per_lcore is None else sum(per_lcore)}", "conns 1", *extra]
    if per_lcore is not None:
        lines += [f"lcores {len(per_lcore)}"] + [f"lcore_{i}_loops {n}" for i, n in enumerate(per_lcore)]
    with open(a.stats_path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def run_for(a: HelperAgent, seconds: float, uptime: list, loops: list, lcores: list | None = None) -> None:
    """Tick every 10 ms for ``seconds``; each tick writes uptime/loops, advanced by the callers' steps
    (``lcores``: [counter, step] per lcore, written per lcore)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        uptime[0] += uptime[1]
        loops[0] += loops[1]
        for lc in lcores or []:
            lc[0] += lc[1]
        write(a, uptime[0], loops[0], None if lcores is None else [lc[0] for lc in lcores])
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
    assert "the loop counter of its lcore(s) all" in events[0][1] and "has not changed for" in events[0][1], events
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


def test_one_hung_lcore_of_several_withdraws_the_helper_and_is_named(tmp_path):
    """Each lcore serves its own queue: one that hangs leaves its clients unanswered while the sum moves."""
    a, events = agent(tmp_path)
    uptime, lcores = [0, 10], [[0, 500], [0, 500], [0, 500]]
    run_for(a, 3 * STALE, uptime, [0, 0], lcores)       # healthy
    assert events == []
    lcores[1][1] = 0                                     # lcore 1 hangs; 0 and 2 go on
    run_for(a, 3 * STALE, uptime, [0, 0], lcores)
    assert len(events) == 1 and events[0][0] == "withdraw", events
    assert "the loop counter of its lcore(s) 1 (in " in events[0][1], events
    assert events[0][1].endswith("its threads: none"), events     # no child here (see thread_states)
    lcores[1][1] = 500
    run_for(a, 2 * STALE, uptime, [0, 0], lcores)
    assert events[1:] == [("announce",)], events


def test_still_lcores_reads_per_lcore_counters_and_falls_back_to_the_sum():
    from vfab.services.memcached_helper.agent import still_lcores

    before = {"lcores": 2, "loops": 10, "lcore_0_loops": 4, "lcore_1_loops": 6}
    assert still_lcores({**before, "loops": 11, "lcore_1_loops": 7}, before) == ["0"]
    assert still_lcores({**before, "lcore_0_loops": 5, "lcore_1_loops": 7}, before) == []
    assert still_lcores({"loops": 10}, {"loops": 10}) == ["all"] and still_lcores({"loops": 11}, {"loops": 10}) == []
    assert still_lcores(before, {}) == []                # the first read: everything moved


def test_thread_states_say_what_each_thread_of_a_process_does():
    import os
    import subprocess
    import time as _time

    from vfab.services.memcached_helper.agent import thread_states

    def settles(want: str) -> str:
        """thread_states of p once it reads ``want`` (the exec and the stop take a moment), or as it is after 5 s."""
        end = _time.monotonic() + 5.0
        while (got := thread_states(p.pid)) != want and _time.monotonic() < end:
            _time.sleep(0.01)
        return got

    p = subprocess.Popen(["sleep", "30"])
    try:
        assert settles("sleep S 0.00s") == "sleep S 0.00s"
        os.kill(p.pid, 19)                                   # SIGSTOP
        assert settles("sleep T 0.00s") == "sleep T 0.00s"
    finally:
        p.kill()
        p.wait()
    assert thread_states(p.pid) == "gone"


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (/proc/mounts, longest mount point that contains it)."""
    best, kind = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            _dev, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def test_stats_files_go_to_a_memory_file_system():
    """mc-helper replaces its stats file every --stats-ms: on ext4 each replacement was a disk write (6-9 CPU-ms a
    second of the helper's own budget at 50 ms).  The agent's default is in memory."""
    from vfab.services.memcached_helper import control
    d = control.stats_dir()
    assert fs_type(os.path.realpath(d)) in ("tmpfs", "ramfs"), f"{d} is on {fs_type(d)!r}"
    path = default_stats_path("h1")
    assert os.path.dirname(path) == d and os.path.basename(path).startswith("vfab-mc-helper-h1-")


def test_the_rigs_stats_files_are_in_memory_and_removed_with_it(tmp_path):
    from vfab.services.memcached_helper.topo import HelperTopo
    t = HelperTopo(str(tmp_path / "rig"), clients=1)
    try:
        assert os.path.dirname(t.stats_path) == t.stats_dir
        assert fs_type(os.path.realpath(t.stats_dir)) in ("tmpfs", "ramfs"), t.stats_dir
        assert t.stats_dir in t.leftovers()
    finally:
        t.destroy()
    assert not os.path.exists(t.stats_dir) and t.leftovers() == []


def test_what_agents_killed_with_minus_9_left_is_swept_and_nothing_else(tmp_path):
    """An agent killed with -9 cannot remove its stats file (in memory) nor mc-helper's DPDK runtime folder:
    the next helper agent's start removes those whose agent PID no longer runs, and leaves a live agent's
    files, other names and a folder it cannot tell apart alone."""
    import subprocess
    import sys

    from vfab.services.memcached_helper.agent import sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    stats, dpdk = tmp_path / "shm", tmp_path / "dpdk"
    stats.mkdir()
    dpdk.mkdir()
    gone = [stats / f"vfab-mc-helper-h1-{dead.pid}.stats", stats / f"vfab-mc-helper-h-2-{dead.pid}.stats.tmp",
            dpdk / f"vfmh-h1-{dead.pid}"]
    kept = [stats / f"vfab-mc-helper-h1-{live}.stats", stats / "vfab-mc-helper-h1.stats", stats / "other-1.stats",
            dpdk / f"vfmh-h1-{live}", dpdk / "vfmhh1", dpdk / "rte"]
    for p in gone + kept:
        if p.parent == dpdk:
            p.mkdir()
            (p / "config").write_text("x")
        else:
            p.write_text("loops 1\n")
    removed = sweep_stale(str(stats), str(dpdk))
    assert sorted(removed) == sorted(str(p) for p in gone)
    assert not any(p.exists() for p in gone)
    assert all(p.exists() for p in kept)
    assert sweep_stale(str(stats), str(dpdk)) == []            # nothing more, and missing folders are no error
    assert sweep_stale(str(tmp_path / "none"), str(tmp_path / "none2")) == []


def test_an_agent_killed_but_not_yet_reaped_counts_as_gone(tmp_path):
    """An agent killed with -9 under a supervisor that has not waited for it yet is a zombie: its PID still
    answers kill(pid, 0), but it runs no more, and its files are swept (the fabric's kill -9 of an agent left
    them there before)."""
    import signal
    import subprocess
    import sys

    from vfab.services.memcached_helper.agent import pid_alive, sweep_stale

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        wait_for(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 5, "a zombie")
        stats = tmp_path / "shm"
        stats.mkdir()
        left = stats / f"vfab-mc-helper-h1-{p.pid}.stats"
        left.write_text("loops 1\n")
        assert not pid_alive(p.pid)
        assert sweep_stale(str(stats), str(tmp_path / "no-dpdk")) == [str(left)] and not left.exists()
    finally:
        p.kill()
        p.wait()


STALLED = ("serving 0", "conns_down 1", "down_why_unacked 1", "down_waited_ms 51", "down_unacked_bytes 139264",
           "down_backoff 3")


def test_a_helper_that_says_it_does_not_serve_is_withdrawn_at_its_first_report_and_comes_back(tmp_path):
    """Issue 43: mc-helper alive and looping but its leg to memcached stalled (``serving 0``): the agent withdraws
    it at the first file that says so (not after --stale s), writes why, and announces it again at the first
    file that says it serves."""
    a, events = agent(tmp_path)
    write(a, 10, 500, extra=("serving 1",))
    a.tick()
    assert events == []
    write(a, 20, 1000, extra=STALLED)
    a.tick()
    assert [e[0] for e in events] == ["withdraw", "note_down"], events
    assert "139264 B not acknowledged" in events[0][1] and "10.0.0.1:11211" in events[0][1], events
    write(a, 30, 1500, extra=STALLED)
    a.tick()
    assert len(events) == 2, "withdrawn once, not again while it stays down"
    write(a, 40, 2000, extra=("serving 1",))
    a.tick()
    assert events[2:] == [("announce",)], events


def test_a_withdrawn_helper_comes_back_only_after_serving_for_the_hold_which_doubles(tmp_path):
    """Issue 43, no flapping: after a withdrawal the agent waits until the helper has served without interruption
    for the hold (saying so once in its down record), a relapse restarts the count, and a second withdrawal within
    the window doubles the hold."""
    a, events = agent(tmp_path, hold=0.2)
    up, n = [0], [0]

    def report(serving: bool) -> None:
        up[0] += 10
        n[0] += 500
        write(a, up[0], n[0], extra=("serving 1",) if serving else STALLED)
        a.tick()

    report(True)
    report(False)
    assert [e[0] for e in events] == ["withdraw", "note_down"], events
    assert "once it has served for 0.2 s" in events[0][1], events
    report(True)                                   # serves again, but not yet for the hold: said once
    report(True)
    assert [e[0] for e in events[2:]] == ["note_down"] and "serves again for" in events[2][1], events
    time.sleep(0.12)
    report(False)                                  # relapse while held out: the reason again, the count restarts
    report(True)
    time.sleep(0.12)
    report(True)
    assert "announce" not in [e[0] for e in events], events
    time.sleep(0.1)
    report(True)
    assert events[-1] == ("announce",), events
    report(False)                                  # a second withdrawal in the window: the hold is 0.4 s
    assert "once it has served for 0.4 s" in events[-2][1], events
    t0 = time.monotonic()
    while events[-1] != ("announce",):
        report(True)
        time.sleep(0.01)
        assert time.monotonic() - t0 < 2.0, events
    assert time.monotonic() - t0 >= 0.4


def test_not_serving_says_why_in_words_and_none_while_serving():
    from vfab.services.memcached_helper.control import not_serving

    assert not_serving({}) is None and not_serving({"serving": 1}) is None
    why = not_serving({"serving": 0, "conns": 2, "conns_down": 1, "down_why_no_answers": 1, "down_waited_ms": 50},
                      "mc:11211")
    assert why.startswith("1 of 2 connection(s) down: no answer from mc:11211 for 50 ms"), why
    assert "cannot connect" in not_serving({"serving": 0, "down_why_connect": 1})
