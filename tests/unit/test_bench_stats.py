"""The lease bench's round statistics: per-round ratios to the peer and the interval of their median."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

import pytest

from bench.common import pin_threads
from bench.sdhcp_lease import median_interval, round_ratio, round_ratios, run_seconds, socket_drops


def runs(*times):
    return [{"udhcpc": {"time_s": t}} for t in times]


def test_ratios_pair_rounds_and_skip_rounds_without_a_time():
    mine, peer = runs(0.6, 0.7, None, 0.5), runs(0.5, 0.7, 0.6, 0.0)
    assert round_ratios(mine, peer, "udhcpc") == [1.2, 1.0]
    assert round_ratio(mine, peer, "udhcpc") == 1.1


def test_the_interval_holds_the_median_and_tells_spread_rounds_from_steady_ones():
    spread = [0.90, 1.10, 0.95, 1.08, 1.02, 0.97, 1.05]
    steady = [1.03, 1.04, 1.03, 1.05, 1.04, 1.03, 1.04]
    lo, hi = median_interval(spread)
    assert lo <= statistics.median(spread) <= hi and lo < 1.0 < hi
    lo2, hi2 = median_interval(steady)
    assert 1.0 < lo2 <= statistics.median(steady) <= hi2 and hi2 - lo2 < hi - lo
    assert median_interval(spread) == (lo, hi)   # a fixed seed: the same rounds print the same interval


def test_no_interval_from_fewer_than_three_rounds():
    assert median_interval([1.0, 1.1]) is None and median_interval([]) is None


def test_socket_drops_counts_what_a_full_receive_buffer_dropped_for_these_processes_only():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the kernel doubles it; a few datagrams fit
        rx.bind(("127.0.0.1", 0))
        before = socket_drops([os.getpid()])
        for _ in range(200):
            tx.sendto(b"x" * 512, rx.getsockname())
        after = socket_drops([os.getpid()])
        assert after - before >= 150, (before, after)
        other = subprocess.Popen(["sleep", "30"])
        try:
            assert socket_drops([other.pid]) == 0, "another process's sockets are not counted"
        finally:
            other.kill()
            other.wait()
    finally:
        rx.close()
        tx.close()


def test_run_seconds_counts_cpu_to_well_below_a_clock_tick():
    before = run_seconds(os.getpid())
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.003:   # 3 ms of CPU: a third of a 10 ms clock tick
        pass
    after = run_seconds(os.getpid())
    assert before is not None and 0.003 <= after - before < 0.5
    assert run_seconds(2 ** 22 + 12345) is None   # no such process


def test_pin_threads_moves_every_thread_of_a_process_and_its_later_threads_follow():
    """--pin: a server's threads (those it has and those it starts after) run on the servers' CPUs only."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs 2 CPUs")
    cpu = max(os.sched_getaffinity(0))
    code = ("import sys, threading, time\n"
            "ev = threading.Event()\n"
            "threading.Thread(target=ev.wait, daemon=True).start()\n"
            "print('up', flush=True); sys.stdin.readline()\n"
            "threading.Thread(target=ev.wait, daemon=True).start()\n"
            "print('more', flush=True); time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert pin_threads(child.pid, {cpu}) == 2

        def allowed():
            return {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{child.pid}/task")}
        assert all(v == {cpu} for v in allowed().values())
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "more"
        got = allowed()
        assert len(got) == 3 and all(v == {cpu} for v in got.values())
    finally:
        child.kill()
        child.wait()
