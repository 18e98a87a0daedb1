"""The scheduler's account of processes and threads.

:func:`proc_stat` reads ``/proc/PID/stat`` (or one thread's): state, CPU seconds, start time.  The helper
agent lists a stalled helper's threads with it, the benchmarks count CPU with it, the testbed tells a
process from one that took its PID.  :func:`run_seconds`: a process's CPU time to the nanosecond.

:class:`RunDelay`: how long one thread has been runnable but not running (waiting for a core).  Read from
``/proc/thread-self/schedstat`` ("<ns on a CPU> <ns waiting for one> <slices>"), which names the *reading*
thread: open a :class:`RunDelay` in the thread it is to measure.  The stateful-endpoint loop uses it
to tell a long pass's wait for a core from its work; the kvs load generator to tell its own waits from the
service's latency.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SCHEDSTAT = "/proc/thread-self/schedstat"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    name: str           # comm: the process's or thread's name
    state: str          # R running or runnable, S sleeping, D in the kernel, T stopped, Z zombie, ...
    user_s: float
    system_s: float
    start: int          # clock ticks since boot: with the PID, names one process for good

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.system_s


def proc_stat(pid: int, tid: int | None = None) -> ProcStat | None:
    """``/proc/PID/stat``, or thread TID's (``/proc/PID/task/TID/stat``); None if there is no such process."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: it ends at the last ')'
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    try:
        return ProcStat(head[head.index("(") + 1:], fields[0], int(fields[11]) / CLK_TCK,
                        int(fields[12]) / CLK_TCK, int(fields[19]))
    except (ValueError, IndexError):
        return None


def run_seconds(pid: int) -> float | None:
    """The CPU time of process PID's live threads so far, to the nanosecond (each thread's ``schedstat`` run
    time; :func:`proc_stat`'s user and system times come in clock ticks, 10 ms here, too coarse for 4 sdhcp
    shards' share of a 0.6 s lease-bench phase); None without schedstat or such a process."""
    total, seen = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended meanwhile
    return total / 1e9 if seen else None


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
