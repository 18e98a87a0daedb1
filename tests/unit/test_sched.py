"""``vfab.vid.state.sched``: /proc/PID/stat read by one function (state, CPU, start), and the run-queue delay."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from vfab.testbed.procs import wait_for
from vfab.vid.state.sched import RunDelay, proc_stat


def test_proc_stat_of_this_process_and_one_of_its_threads():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:   # some CPU to count
        pass
    me = proc_stat(os.getpid())
    assert me is not None and me.state == "R" and me.cpu_s >= 0.05 - 0.02 and me.start > 0
    assert me.cpu_s == me.user_s + me.system_s
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="vfab-sleeper")
    t.start()
    try:
        st = wait_for(lambda: (s := proc_stat(os.getpid(), t.native_id)) is not None and s.state == "S" and s,
                      5, "the thread to sleep")
        assert st.start >= me.start and st.name == me.name   # Python 3.11 names no thread for the kernel
    finally:
        stop.set()
        t.join()


def test_proc_stat_reads_a_name_with_parentheses_and_spaces_and_none_for_a_gone_process():
    code = "open('/proc/self/comm', 'w').write('a) b (c'); import sys; sys.stdout.write('x\\n'); sys.stdout.flush(); " \
           "import time; time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"x\n"
        st = proc_stat(p.pid)
        assert st is not None and st.name == "a) b (c" and st.state in ("S", "R")
    finally:
        p.kill()
        p.wait()
    assert proc_stat(p.pid) is None


def test_run_delay_counts_up_from_the_reading_thread():
    rd = RunDelay()
    try:
        a = rd()
        b = rd()
        assert 0.0 <= a <= b
    finally:
        rd.close()
    assert rd() == 0.0   # closed: says nothing rather than failing
