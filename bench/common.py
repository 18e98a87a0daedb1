"""Shared bits of the benchmarks: argument parsing, statistics, and writing results.

Each benchmark prints its numbers and writes them to bench/results/NAME.json
(with the machine, the time and the parameters), so the README's tables can be
reproduced with the command shown there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from vfab.testbed.procs import unwind_on_signals

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parser(description: str) -> argparse.ArgumentParser:
    """The benchmark's argument parser.

    Also makes SIGTERM and SIGHUP unwind the benchmark like SIGINT (``timeout``
    or CI stopping a run): its ``finally`` blocks run and its testbed stops.
    """
    unwind_on_signals()
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny run that only proves the benchmark works (CI)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/NAME.json)")
    return ap


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit their creator's set);
    how many threads were pinned.  A thread that exits meanwhile is skipped."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:
            pass
    return pinned


def not_root(name: str, needs: str) -> bool:
    """True (and says why on stderr) when the benchmark ``name`` does not run as root: it needs ``needs``."""
    if os.geteuid() == 0:
        return False
    print(f"{name}: needs root ({needs})", file=sys.stderr)
    return True


def summary(samples: list[float]) -> dict:
    """median, p99, mean, min, max, n of samples (seconds in, milliseconds out)."""
    if not samples:
        return {"n": 0}
    ms = sorted(x * 1e3 for x in samples)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p99_ms": round(p99, 3),
            "mean_ms": round(statistics.fmean(ms), 3), "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3)}


def write(name: str, params: dict, results: dict, out: str | None = None) -> str:
    path = out or os.path.join(RESULTS, f"{name}{'-smoke' if params.get('smoke') else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"benchmark": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"node": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
           "params": params, "results": results}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(results, indent=1))
    print(f"results written to {path}")
    return path


def cpu_busy_s(cpu: int | None = None) -> float:
    """Seconds CPU ``cpu`` (None: every CPU of the machine, added up) was busy so far (/proc/stat: user, nice,
    system, irq, softirq, steal): whatever ran there, tasks and interrupts alike."""
    key = "cpu " if cpu is None else f"cpu{cpu} "
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith(key):
                f = [int(x) for x in line.split()[1:9]]
                return (sum(f[0:3]) + sum(f[5:8])) / CLK_TCK
    raise RuntimeError(f"/proc/stat has no line for {key.strip()}")
