"""`vfab up`'s daemon stops on a signal even while it still waits for the testbed lock (it kept waiting: a
signal only set a flag it read once the fabric was up, so a leaked daemon sat in the lock queue)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

from vfab.testbed.procs import wait_for

CHILD = """
import sys
from vfab.testbed import lock
lock.LOCK_FILE = sys.argv[1]
from vfab.testbed import daemon
daemon.main(["--state-file", sys.argv[2]])
"""


def test_a_daemon_waiting_for_the_lock_exits_on_sigterm(tmp_path):
    lock_file, state = tmp_path / "lock", tmp_path / "up.json"
    with open(lock_file, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                 # another testbed holds the lock
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(lock_file), str(state)],
                                stderr=subprocess.PIPE, text=True)
        try:
            said: list[str] = []
            wait_for(lambda: said.append(proc.stderr.readline()) or "waiting for the testbed lock" in said[-1],
                     20, "the daemon to say it waits for the lock")
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(10)
            assert time.monotonic() - t0 < 5
            assert not state.exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
