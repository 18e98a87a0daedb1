"""The control side of a memcached service on the fabric: one agent per process it runs and announces.

::

    python -m vfab.services.memcached_helper.agent memcached --service mc --name mc0 --iface vfh1-eth0 \\
        --netns /proc/PID/ns/net [--listen] [--threads 1]
    python -m vfab.services.memcached_helper.agent helper --service mc --name h1 --iface vfh2-eth0 \\
        --netns /proc/PID/ns/net [--binary mc-helper] [--lcores 1] [--stats-file F] [-- mc-helper options]

``memcached``: the helpee.  Starts Debian's memcached (``-U PORT -p PORT``) in the host's namespace and
announces it as an ``rx=ovs`` endpoint of the service, so the service's UDP front door (``udp, ip, port,
key=ip_src``) delivers the ranges it owns to its port rewritten to its MAC; ``--listen`` takes every
unassigned range.  memcached itself is unmodified and knows nothing of this.

``helper``: a PostMan helper.  Starts ``mc-helper`` (DPDK, ``--no-huge --no-pci
--vdev=net_af_packet0,iface=<the host's port>``, its own ``--file-prefix``) answering for the service's
front-door address, waits until its TCP connections to memcached are up, then announces it as an endpoint of
the same service (the compiler looks a range's helpers up among the service's endpoints) and writes its
``HelperStatus`` (S, T, batches: read from the stats file every ``--period`` s) under the endpoint's lease.
It is then a *live helper*: ``vfab helpers on`` can put it into ranges' ``select`` groups.

How the helper sits on the host (why it works on the fabric):

- **One port, two users.**  The fast path reads and writes the host's fabric port through ``af_packet``; the
  TCP leg to memcached is a kernel socket of the same host on the same port (the host's own IP and MAC), so
  it needs no second interface and no user-space TCP: memcached speaks only kernel TCP, a helper keeps a
  handful of connections carrying whole multi-gets (syscalls per batch, not per request), and TCP gives the
  reply splitter the ordered, lossless stream it needs.  ``af_packet`` also sees the leg's TCP segments and
  any other frame on the port; mc-helper takes only IPv4/UDP to the service address and port addressed to
  its port's MAC and counts the rest (``net_not_mine``, ``net_not_svc``) without touching them.
- **The host must not route.**  The frames a ``select`` bucket sends here carry the *service's* IP address;
  the host's kernel sees them too, and with ``ip_forward`` on (a namespace inherits it from the root one)
  it would forward each request to memcached as well: the agent turns ``net.ipv4.ip_forward`` off in the
  helper's namespace.
- **Replies pass port security.**  mc-helper answers from the service's IP and UDP port (so an unmodified
  client accepts them) but from its own port's MAC, which is what table 0 admits from that port.

Liveness: the agent is mc-helper's parent.  When mc-helper exits (``kill -9`` included) the agent revokes
the lease at once: endpoint and status vanish, the controller drops the helper's bucket, and its clients
hash to the remaining helpers (or the owner) with no reconnect; the agent exits 1.  When it makes no
progress for ``--stale`` s — its stats file not written (SIGSTOP, a starved host) or, though written, the
loop counter of any of its lcores in it standing still (a hung lcore: the file's writer is a thread of its
own, and each lcore serves its own queue, whose clients a hung one leaves unanswered) — the lease is revoked
the same way, but the agent stays: once all move again it announces the helper again (a new lease), and the
switches give it its bucket back.  A helper withdrawn for either reason comes back only after serving without
interruption for a hold that doubles with each withdrawal in the last 30 s (``readmit.py``: no flapping).  If the agent itself dies, mc-helper gets SIGTERM (parent-death signal) and
the lease expires after ``--ttl`` s.  SIGTERM/SIGINT: the lease goes first (clients leave the helper), then the child stops.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from vfab.fabric import frontdoor
from vfab.vid import api
from vfab.vid.errors import RegistryError, VfabError
from vfab.vid.netns import netns as in_netns
from vfab.vid.registry import Registry, schema
from vfab.vid.state.sched import proc_stat

from vfab.services.memcached_helper import control
from vfab.services.memcached_helper.readmit import Readmit
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.mc.agent")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BINARY = os.path.join(HERE, "dpdk", "build", "meson", "mc-helper")
PR_SET_PDEATHSIG = 1


class AgentError(VfabError):
    pass


def service_address(svc: schema.Service) -> tuple[str, int]:
    """(ip, port) of the service's memcached UDP front door (kind udp)."""
    problems: list[str] = []
    for door in frontdoor.service_doors(svc, problems):
        if door.kind == "udp":
            return str(ipaddress.IPv4Address(door.params["ip"])), int(door.params["port"])
    why = f" ({'; '.join(problems)})" if problems else ""
    raise AgentError(f"service {svc.name!r} has no valid udp front door{why}: create it with 'vfab service add "
                     f"{svc.name} --kind memcached --opt ip=ADDRESS' (or give its record a "
                     '{"kind": "udp", "ip": ..., "port": 11211} front door)')


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the agent dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def in_host(netns: str | None, cmd: list[str]) -> list[str]:
    """``cmd`` run inside the host's network namespace (nsenter execs it: the PID is the program's)."""
    return ["nsenter", f"--net={netns}", "--", *cmd] if netns else cmd


class Agent:
    """Start a child, announce it once ready, keep the lease while it lives, withdraw when it does not."""

    role = "process"

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.reg = Registry(args.etcd)
        self.svc = self.reg.service(args.service)
        self.addr = service_address(self.svc)
        self.child: subprocess.Popen | None = None
        self.server: api.Server | None = None
        self.stop = threading.Event()
        self.exit_code = 0
        self.logfile = None

    # -- what differs per role -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def announced(self) -> None:
        """Right after the endpoint is in etcd (under ``self.server.lease``)."""

    def tick(self) -> str | None:
        """Every poll while running; a reason to withdraw, or None."""
        return None

    def cleanup(self) -> None:
        pass

    # -- the life cycle ----------------------------------------------------------------------------------------
    def spawn(self) -> None:
        cmd = in_host(self.args.netns, self.command())
        out = self.args.child_log
        self.logfile = open(out, "ab") if out else None
        log.info("%s %s: starting %s", self.role, self.args.name, " ".join(cmd))
        self.child = subprocess.Popen(cmd, stdout=self.logfile or subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT if self.logfile else subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.child.poll() is not None:
                raise AgentError(f"{self.role} exited with {self.child.returncode} before it was ready"
                                 + (f" (log {self.args.child_log})" if self.args.child_log else ""))
            if time.monotonic() > deadline or self.stop.is_set():
                raise AgentError(f"{self.role} not ready after {timeout:.0f} s"
                                 + (f" (log {self.args.child_log})" if self.args.child_log else ""))
            time.sleep(0.05)

    def announce(self) -> None:
        self.server = api.announce(self.reg, self.svc.name, self.args.name, self.args.iface, rx="ovs",
                                   ttl=self.args.ttl, netns=self.args.netns)
        self.announced()

    def withdraw(self, why: str) -> None:
        """Revoke the lease now: endpoint (and status) leave etcd, the switches drop the route to us."""
        if self.server is None:
            return
        server, self.server = self.server, None
        t0 = time.monotonic()
        server.close()
        log.warning("%s %s: withdrawn (%s) in %.1f ms", self.role, self.args.name, why, (time.monotonic() - t0) * 1e3)

    def run(self) -> int:
        def on_signal(signum: int, _frame: object) -> None:
            self.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.spawn()
            self.wait_ready(self.args.ready_timeout)
            self.announce()
            stats, prefix = getattr(self, "stats_path", None), getattr(self, "prefix", None)
            print(f"ready pid={self.child.pid}" + (f" stats={stats}" if stats else "")
                  + (f" prefix={prefix}" if prefix else ""), flush=True)
            log.info("%s %s: announced (%s), %s pid %d", self.role, self.args.name, self.server.port.mac_str,
                     self.role, self.child.pid)
            while not self.stop.wait(self.args.poll):
                rc = self.child.poll()
                if rc is not None:
                    self.withdraw(f"{self.role} pid {self.child.pid} exited with {rc}")
                    self.exit_code = 1
                    break
                why = self.tick()
                if why:
                    self.withdraw(why)
                    self.exit_code = 1
                    break
        except (VfabError, OSError) as exc:
            log.error("%s %s: %s", self.role, self.args.name, exc)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            self.exit_code = 1
        finally:
            self.withdraw("agent stopping")
            self.stop_child()
            self.cleanup()
            self.reg.close()
        return self.exit_code

    def stop_child(self) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        self.child.terminate()
        try:
            self.child.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("%s pid %d ignored SIGTERM for 10 s: killing it", self.role, self.child.pid)
            self.child.kill()
            self.child.wait(5)


class MemcachedAgent(Agent):
    role = "memcached"

    def command(self) -> list[str]:
        port = str(self.addr[1])
        return ["memcached", "-U", port, "-p", port, "-t", str(self.args.threads), "-m", str(self.args.mem_mb),
                "-c", "4096", "-u", "root", *self.args.extra]

    def ready(self) -> bool:
        with in_netns(self.args.netns):
            s = socket.socket()
        try:
            s.settimeout(0.5)
            return s.connect_ex(self.addr) == 0
        finally:
            s.close()

    def announced(self) -> None:
        if not self.args.listen:
            return
        for rec, _ in self.reg.ranges(self.svc.name):
            if not rec.owner:
                self.server.listen(rec.lo, rec.hi)


STATS_MS = 100   # mc-helper's stats file period unless --stats-ms says (10 stats files per --stale second)


# A helper agent's own files are named by its PID (so sweep_stale can tell whose agent is gone); each pattern
# matches its maker's names below.
STATS_LEFT = re.compile(r"^vfab-mc-helper-.+-(\d+)\.stats(\.tmp)?$")
PREFIX_LEFT = re.compile(r"^vfmh-.+-(\d+)$")


def default_stats_path(name: str) -> str:
    """The helper's stats file unless --stats-file says: in memory (control.stats_dir), one per agent process."""
    return os.path.join(control.stats_dir(), f"vfab-mc-helper-{name}-{os.getpid()}.stats")


def default_prefix(name: str) -> str:
    """mc-helper's DPDK --file-prefix unless --file-prefix says: one per agent process."""
    return f"vfmh-{name}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs: a zombie (dead, not yet reaped by its parent, as an agent killed
    with -9 stays until its supervisor waits for it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_stale(stats_dir: str, dpdk_dir: str = control.DPDK_RUN_DIR) -> list[str]:
    """Remove what agents killed with -9 left: their stats files (in memory) and their DPDK runtime folders
    (``vfmh-NAME-PID``), named by the agent's PID, when no process has that PID any more.  A PID alive (the
    agent's, or a new process that got it) keeps its files: the next sweep after it ends takes them.  Returns
    the paths removed."""
    gone = []
    for folder, pattern in ((stats_dir, STATS_LEFT), (dpdk_dir, PREFIX_LEFT)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if not m or pid_alive(int(m.group(1))):
                continue
            path = os.path.join(folder, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue   # another agent's sweep took it
            except OSError as exc:
                log.warning("cannot remove %s, left by an agent that is gone: %s", path, exc)
                continue
            gone.append(path)
    return gone


class HelperAgent(Agent):
    role = "mc-helper"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        if not os.access(args.binary, os.X_OK):
            raise AgentError(f"mc-helper binary {args.binary} is missing: build it with 'make helper'")
        self.prefix = args.file_prefix or default_prefix(args.name)
        self.stats_path = args.stats_file or default_stats_path(args.name)
        left = sweep_stale(control.stats_dir())
        if left:
            log.info("helper %s: removed %d file(s) left by agents no longer running: %s", args.name, len(left),
                     ", ".join(left))
        self.last_publish = 0.0
        self.last_change = time.monotonic()
        self.last_stats: dict = {}
        self.stalled_at = 0.0
        self.down_noted = False
        self.held_noted = False
        self.readmit = Readmit(base=args.readmit_hold, cap=args.readmit_max)
        self.memcached = args.memcached or f"{self.addr[0]}:{self.addr[1]}"

    def command(self) -> list[str]:
        lcores = self.args.lcores
        nq = sum(len(range(int(a), int(b or a) + 1)) for a, _, b in (p.partition("-") for p in lcores.split(",")))
        # on the fabric a client's fragmented requests come to its helper too: frames that hold them (issue 43)
        vdev, rx_args = control.af_packet_vdev(self.args.iface, nq, large=True)
        return [self.args.binary, "-l", lcores, "--no-huge", "--no-pci", "-m", str(self.args.mem_mb),
                f"--file-prefix={self.prefix}", f"--vdev={vdev}", "--log-level=user1,info", "--",
                "--service", f"{self.addr[0]}:{self.addr[1]}", "--memcached", self.memcached,
                "--stats-file", self.stats_path, "--stats-ms", str(self.args.stats_ms), *rx_args, *self.args.extra]

    def spawn(self) -> None:
        # The host must not forward the service's frames it receives (see the module doc).
        res = subprocess.run(in_host(self.args.netns, ["sysctl", "-qw", "net.ipv4.ip_forward=0"]),
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise AgentError(f"cannot turn ip_forward off in the helper's namespace: {res.stderr.strip()}")
        if os.path.exists(self.stats_path):
            os.unlink(self.stats_path)
        super().spawn()

    def ready(self) -> bool:
        st = control.read_stats(self.stats_path)
        return bool(st) and st.get("conns", 0) > 0 and st.get("conns_up") == st.get("conns")

    def publish(self, stats: dict) -> None:
        rec = schema.HelperStatus(at=time.time(), serves=f"{self.addr[0]}:{self.addr[1]}", pid=self.child.pid,
                                  stats={k: stats[k] for k in control.SHOWN if k in stats}
                                  | {k: v for k, v in stats.items() if k.startswith("hist_keys_")})
        self.reg.put(schema.helper_key(self.svc.name, self.args.name), rec.to_json(), lease=self.server.lease)
        self.last_publish = time.monotonic()

    def announced(self) -> None:
        self.publish(control.read_stats(self.stats_path))

    def note_down(self, stats: dict, why: str) -> None:
        """After a withdrawal for not serving: the status record again, with the reason, without a lease (the
        endpoint is gone, so no bucket; ``vfab helpers`` shows why).  The next announce replaces it; the
        agent's exit deletes it."""
        rec = schema.HelperStatus(at=time.time(), serves=f"{self.addr[0]}:{self.addr[1]}", pid=self.child.pid,
                                  stats={k: stats[k] for k in control.SHOWN if k in stats}, down=why)
        try:
            self.reg.put(schema.helper_key(self.svc.name, self.args.name), rec.to_json())
            self.down_noted = True
        except RegistryError as exc:
            log.warning("helper %s: reason not written: %s", self.args.name, exc)

    def tick(self) -> str | None:
        now = time.monotonic()
        st = control.read_stats(self.stats_path)
        written = st.get("uptime_ms") != self.last_stats.get("uptime_ms")
        # The file is written by mc-helper's stats thread, which goes on if its lcores hang: progress is every
        # lcore's loop counter moving too (each moves when idle as well, at least once per --idle-us).
        still = still_lcores(st, self.last_stats) if written else []
        if written and not still:
            self.last_change = now
            self.last_stats = st
            down = control.not_serving(st, self.memcached)
            if down and self.server is not None:   # alive but cannot serve: give its clients back now
                self.stalled_at = now
                self.readmit.withdrawn(now)
                self.withdraw(f"mc-helper does not serve: {down}; announced again once it has served for "
                              f"{self.readmit.hold(now):.1f} s")
                self.note_down(st, down)
                self.held_noted = False
                return None
            if self.server is None and not self.readmit.may_return(now, not down):
                if not down and not self.held_noted:   # it serves, but not for long enough yet: say so once
                    self.note_down(st, self.readmit.explain(now))
                    self.held_noted = True
                elif down and self.held_noted:         # relapsed while held out: the reason again
                    self.note_down(st, down)
                    self.held_noted = False
                return None
            if self.server is None:   # it stalled or did not serve, was withdrawn, and has served for the hold
                log.warning("helper %s: its stats advance again and it has served for %.2f s, %.2f s after it was "
                            "withdrawn: announcing it again", self.args.name, now - self.readmit.serving_since,
                            now - self.stalled_at)
                try:
                    self.announce()
                except VfabError as exc:   # etcd away: the file's next advance tries again
                    log.warning("helper %s: not announced again yet: %s", self.args.name, exc)
                return None
        elif now - self.last_change > self.args.stale and self.server is not None:
            self.stalled_at = self.last_change
            self.readmit.withdrawn(now)
            what = (f"the loop counter of its lcore(s) {', '.join(still)} (in {self.stats_path}) has not changed"
                    if written else f"its stats file {self.stats_path} has not changed")
            self.withdraw(f"{what} for {now - self.last_change:.1f} s; announced again once it does; its "
                          f"threads: {thread_states(self.child.pid) if getattr(self, 'child', None) else 'none'}")
            return None
        if self.server is not None and now - self.last_publish >= self.args.period:
            try:
                self.publish(self.last_stats)
            except RegistryError as exc:   # a lease gone is announced again by the Server (vfab.vid.api)
                if "lease not found" not in str(exc):
                    log.warning("helper %s: status not written: %s", self.args.name, exc)
        return None

    def cleanup(self) -> None:
        if self.down_noted and self.server is None:
            try:
                self.reg.delete(schema.helper_key(self.svc.name, self.args.name))
            except RegistryError as exc:
                log.warning("helper %s: its down record not deleted: %s", self.args.name, exc)
        control.remove_runtime(self.prefix)
        if not self.args.stats_file:   # a stats file of its own choosing: removed with its .tmp
            control.remove_stats(self.stats_path)


def thread_states(pid: int) -> str:
    """Each thread of ``pid`` as "name state CPU-s" (/proc: R running or runnable, S sleeping, D in the kernel,
    T stopped): what a stall was — a stopped process, a starved thread, a blocked one."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return "gone"
    stats = [proc_stat(pid, int(tid)) for tid in tids]
    return ", ".join(f"{st.name} {st.state} {st.cpu_s:.2f}s" for st in stats if st is not None) or "gone"


def still_lcores(now: dict, before: dict) -> list[str]:
    """The lcores (their index, as a string) whose loop counter did not move from ``before`` to ``now``, two
    reads of mc-helper's stats file; a file without per-lcore counters is judged by the sum, named "all"."""
    n = now.get("lcores", 0)
    if n and "lcore_0_loops" in now:
        return [str(i) for i in range(n) if now.get(f"lcore_{i}_loops") == before.get(f"lcore_{i}_loops")]
    return ["all"] if now.get("loops") == before.get("loops") else []


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...] (default: $VFAB_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--service", required=True, help="the memcached service (its udp front door gives the address)")
    p.add_argument("--name", required=True, help="this endpoint's name")
    p.add_argument("--iface", required=True, help="the host's fabric port")
    p.add_argument("--netns", default=None, metavar="PATH",
                   help="network namespace of --iface (e.g. /proc/PID/ns/net of a testbed host); etcd is reached "
                        "from ours")
    p.add_argument("--ttl", type=int, default=2, help="endpoint lease TTL in s (default 2)")
    p.add_argument("--poll", type=float, default=0.02, help="s between checks of the child (default 0.02)")
    p.add_argument("--ready-timeout", type=float, default=30.0, help="s to wait for the child to be ready")
    p.add_argument("--child-log", default=None, help="file for the child's output (default: discarded)")
    p.add_argument("--mem-mb", type=int, default=64, help="memory of the child in MB (default 64)")
    p.add_argument("extra", nargs="*", help="after --: more options for the child")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.memcached_helper.agent",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    m = sub.add_parser("memcached", help="run and announce the helpee (Debian's memcached)")
    add_common(m)
    m.add_argument("--threads", type=int, default=1, help="memcached worker threads (default 1)")
    m.add_argument("--listen", action="store_true", help="take every unassigned range of the service")
    h = sub.add_parser("helper", help="run and announce a helper (mc-helper on DPDK)")
    add_common(h)
    h.add_argument("--binary", default=DEFAULT_BINARY, help=f"mc-helper (default {DEFAULT_BINARY})")
    h.add_argument("--lcores", default="1", help="DPDK lcores (-l), one queue pair each (default 1)")
    h.add_argument("--memcached", default=None, metavar="IP:PORT",
                   help="where the TCP leg goes (default: the service address)")
    h.add_argument("--stats-file", default=None, help="mc-helper's stats file (default: in /dev/shm, a memory file system)")
    h.add_argument("--stats-ms", type=int, default=STATS_MS, help=f"stats file period in ms (default {STATS_MS})")
    h.add_argument("--period", type=float, default=1.0, help="s between status records in etcd (default 1)")
    h.add_argument("--stale", type=float, default=1.0,
                   help="withdraw the helper while its stats file, or the loop counter of any of its lcores in "
                        "it, has not changed for this many s (default 1: 10 stats periods); it is announced again "
                        "once all advance")
    h.add_argument("--readmit-hold", type=float, default=0.5,
                   help="a helper withdrawn for not serving is announced again once it has served this many s "
                        "without interruption; doubled for each further withdrawal in the last 30 s (default 0.5)")
    h.add_argument("--readmit-max", type=float, default=8.0,
                   help="the longest such hold, s (default 8)")
    h.add_argument("--file-prefix", default=None, help="DPDK --file-prefix (default vfmh-NAME-PID)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        agent = MemcachedAgent(args) if args.role == "memcached" else HelperAgent(args)
    except (VfabError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
