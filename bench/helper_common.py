"""Pieces the PostMan-helper benchmarks share (bench/helper_*.py): loading the helper package, CPU time of a
process and of one CPU's interrupt work, and a CPU cap (a cpu cgroup) for a device under test."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER_DIR = os.path.join(os.path.dirname(HERE), "services", "memcached-helper")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def helper_pkg():
    """vfab.services.memcached_helper (loaded from its folder if setup.py does not map it)."""
    try:
        import vfab.services.memcached_helper as pkg
    except ImportError:
        spec = importlib.util.spec_from_file_location("vfab.services.memcached_helper",
                                                      os.path.join(HELPER_DIR, "__init__.py"),
                                                      submodule_search_locations=[HELPER_DIR])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pkg
        spec.loader.exec_module(pkg)
    return pkg


@contextmanager
def quiet_machine(name: str):
    """Hold the machine's testbed lock (vfab.testbed.fabric) while measuring: these benchmarks compare CPU
    seconds on a 2-core machine, and another run's fabric testbed on the same cores would be in every number.
    (It does not stop work that takes no lock.)"""
    from vfab.testbed.fabric import acquire_lock, release_lock
    t0 = time.monotonic()
    acquire_lock()
    if time.monotonic() - t0 > 1:
        print(f"{name}: waited {time.monotonic() - t0:.0f} s for the machine's testbed lock", flush=True)
    try:
        yield
    finally:
        release_lock()


def ksoftirqd_pid(cpu: int) -> int:
    """The PID of ``ksoftirqd/<cpu>``: the kernel thread that runs a CPU's deferred packet work when the
    interrupted task cannot (its time is a packet program's cost too)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    if fh.read().strip() == f"ksoftirqd/{cpu}":
                        return int(pid)
            except OSError:
                continue
    raise RuntimeError(f"no ksoftirqd/{cpu} thread")


def cpu_irq_s(cpu: int) -> float:
    """Seconds CPU ``cpu`` spent in hard and soft interrupts so far (/proc/stat).  Without IRQ time accounting
    (Debian's default: tick based) this time is also in the stime of the task the interrupt ran in."""
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith(f"cpu{cpu} "):
                f = line.split()
                return (int(f[6]) + int(f[7])) / CLK_TCK
    raise RuntimeError(f"/proc/stat has no line for cpu{cpu}")


class CpuCap:
    """A cpu cgroup that caps its processes at ``share`` of one CPU (CFS bandwidth: quota per period).

    cgroup v1 (``/sys/fs/cgroup/cpu``, cpu.cfs_quota_us) or v2 (``/sys/fs/cgroup`` with the cpu controller,
    cpu.max).  Named ``vfm-<tag>-cap``; ``remove()`` moves its processes back and deletes it.
    """

    V1 = "/sys/fs/cgroup/cpu"
    V2 = "/sys/fs/cgroup"

    def __init__(self, tag: str, share: float, period_us: int = 10000):
        if not 0.01 <= share <= 1.0:
            raise ValueError(f"CPU share {share}: must be in 0.01..1 of one CPU")
        self.period_us, self.quota_us = period_us, int(period_us * share)
        if os.path.exists(os.path.join(self.V1, "cpu.cfs_quota_us")):
            self.root, self.v2 = self.V1, False
        elif "cpu" in _read(os.path.join(self.V2, "cgroup.controllers"), "").split():
            self.root, self.v2 = self.V2, True
        else:
            raise RuntimeError("no cpu cgroup controller (cgroup v1 /sys/fs/cgroup/cpu or v2 cpu.max): the CPU "
                               "cap needs one; run with --share 1 to measure without a cap")
        self.path = os.path.join(self.root, f"vfm-{tag}-cap")
        os.makedirs(self.path, exist_ok=True)
        if self.v2:
            _write(os.path.join(self.path, "cpu.max"), f"{self.quota_us} {self.period_us}")
        else:
            _write(os.path.join(self.path, "cpu.cfs_period_us"), str(self.period_us))
            _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(self.quota_us))

    def add(self, pid: int) -> None:
        """Move a process (all its threads) into the cap."""
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def throttled(self) -> int:
        """Periods in which the cap stopped its processes so far."""
        for line in _read(os.path.join(self.path, "cpu.stat"), "").splitlines():
            k, _, v = line.partition(" ")
            if k == "nr_throttled":
                return int(v)
        return 0

    def remove(self) -> None:
        for pid in _read(os.path.join(self.path, "cgroup.procs"), "").split():
            try:
                _write(os.path.join(self.root, "cgroup.procs"), pid)
            except OSError:
                pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _read(path: str, default: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return default


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


# mc-helper settings the benchmarks compare: its defaults (2 connections, T <= 200 us) and two that trade latency
# for larger multi-gets (1 connection, T <= 1 ms or 3 ms: at 10,000-20,000 gets/s per helper only a bound of 2-3 ms
# lets a batch reach the paper's S_min of 1,500 bytes, ~45 keys of 32 B)
HELPER_CONFIGS = {"default": (), "1conn_tmax1ms": ("--conns", "1", "--t-max", "1000"),
                  "1conn_tmax3ms": ("--conns", "1", "--t-max", "3000")}


# The fabric rig of helper_activation.py and helper_failover.py: memcached on vfh1 (service "mc"), helpers h1
# (vfh2) and h2 (vfh5, across the trunk), clients on vfh3, vfh4, vfh6 with 4 addresses each.
FABRIC_CLIENTS = ("vfh3", "vfh4", "vfh6")
FABRIC_HELPERS = {"h1": "vfh2", "h2": "vfh5"}
FABRIC_KEYS = 2000
FABRIC_HELPER_OPTS = ("--idle-us", "50", "--conns", "1", "--t-max", "1000")


@contextmanager
def helper_fabric(binary: str | None, stats_ms: int | None = None, report_every: float | None = None):
    """A started ``line,2,3`` testbed with memcached preloaded and both helpers announced; yields
    (testbed, McFabric, {client host: its 4 source addresses}).  ``binary``: mc-helper (default: the one
    'make helper' built, else one built now in a temporary folder, removed afterwards); ``report_every``:
    s between memcached's agent's reads of its stats for the usage report the balancer reads (its default
    0.1 s)."""
    import shutil
    import tempfile

    from vfab.services.memcached_helper import agent, topo
    from vfab.services.memcached_helper.onfabric import McFabric
    from vfab.testbed.fabric import Testbed
    binary = binary or agent.DEFAULT_BINARY
    build = None
    if not os.path.exists(binary):   # not built by 'make helper': build it for this run (as CI's smoke run does)
        build = tempfile.mkdtemp(prefix="vfab-bench-mch-")
        binary = topo.build_helper(build)
    tb = Testbed("line,2,3", poll=1.0)
    tb.start()
    try:
        mc = McFabric(tb, "mc", "vfh1", binary=binary)
        mc.start_memcached(**({"report_every": report_every} if report_every is not None else {}))
        mc.preload("vfh3", FABRIC_KEYS)
        for name, host in FABRIC_HELPERS.items():
            mc.start_helper(name, host, extra=FABRIC_HELPER_OPTS, stats_ms=stats_ms)
        bind = {h: ",".join(mc.client_addresses(h, 4)) for h in FABRIC_CLIENTS}
        tb.wait_revision(tb.registry.state_revision())
        yield tb, mc, bind
    finally:
        tb.stop()
        if build is not None:
            shutil.rmtree(build, ignore_errors=True)
