"""A whole fabric on this machine: local etcd, Open vSwitch, the controller and a Mininet net.

Used by the integration tests, the benchmarks, the demo and ``vfab up``.
Everything it starts it stops by PID; every switch, host and veth carries the
project's prefix and goes away with ``stop()``.

``stop()`` also runs when the process is interrupted: SIGINT, and SIGTERM and
SIGHUP, which ``start()`` turns into the same exception (``procs.Interrupted``).
A run that dies without unwinding (SIGKILL, power loss) is cleaned up by the
next testbed: each run records what it creates in a run record before creating
it, and ``start()`` removes what dead runs recorded (``leftovers.sweep``),
logging each thing it removes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from vfab.fabric import ovs
from vfab.testbed import leftovers
from vfab.testbed.etcd import LocalEtcd
from vfab.testbed.lock import LOCK_FILE, LOCK_WAIT, acquire_lock, release_lock  # noqa: F401 (re-exported)
from vfab.testbed.net import TopoError, TopoSpec, build, describe
from vfab.testbed.procs import Supervisor, free_port, shielded, unwind_on_signals, wait_for
from vfab.vid.registry import schema
from vfab.vid.registry import Registry

log = logging.getLogger("vfab.testbed")


class Testbed:
    _running: "Testbed | None" = None  # the one started Testbed of this process

    def __init__(self, topo: str = "line,2,3", workdir: str | None = None, poll: float = 1.0,
                 etcd: str | None = None, etcd_members: int = 1):
        """``etcd``: members of a running etcd to use (else the testbed starts its own: ``etcd_members`` of
        them, 1 or a cluster of 3 or 5 on loopback, see testbed/etcd.py)."""
        self.spec = TopoSpec.parse(topo)
        self.topo = topo
        self.own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="vfab-")
        self.poll = poll
        self.sup = Supervisor(os.path.join(self.workdir, "logs"))
        self.etcd_endpoint = etcd
        self.etcd_members = etcd_members
        self.etcd: LocalEtcd | None = None
        self.ctl_port = free_port()
        self.controller = None
        self.net = None
        self.registry: Registry | None = None
        self.started_ovs = False
        self.hosts: dict[str, dict] = {}
        self.switches: dict[str, int] = {}
        self.record: leftovers.RunRecord | None = None
        self.swept: leftovers.Swept | None = None
        self._locked = False

    # -- life cycle ---------------------------------------------------------
    def start(self) -> "Testbed":
        if Testbed._running is not None and Testbed._running is not self:
            raise RuntimeError("a Testbed is already running in this process (names are fixed): stop it first")
        unwind_on_signals()
        acquire_lock()
        self._locked = True
        Testbed._running = self
        try:
            self.record = leftovers.RunRecord.create(topo=self.topo, workdir=self.workdir)
            if self.own_workdir:
                self.record.add("dirs", self.workdir)
            self.started_ovs = ovs.ensure_running()
            if self.started_ovs:
                self.record.set("ovs", {"started": True, "pids": leftovers.ovs_identities()})
            self.swept = leftovers.sweep(exclude=self.record.path)
            if self.swept.ovs_orphaned and not self.started_ovs:
                self.started_ovs = True
                self.record.set("ovs", {"started": True, "pids": leftovers.ovs_identities()})
            self._refuse_unrecorded()
            self.sup.on_start = lambda proc: self.track(proc.pid, proc.name)
            self.sup.on_stop = lambda proc: self.untrack(proc.pid)
            if self.etcd_endpoint is None:
                etcd_dir = os.path.join(self.workdir, "etcd")
                if not self.own_workdir:
                    self.record.add("dirs", etcd_dir)
                self.etcd = LocalEtcd(etcd_dir, members=self.etcd_members)
                self.etcd.on_spawn = lambda pid: self.track(pid, "etcd")
                self.etcd.start()
                self.etcd_endpoint = self.etcd.endpoint
            self.registry = Registry(self.etcd_endpoint)
            self.start_controller()
            self.record.add("bridges", *self.spec.switches)
            self.record.add("nodes", *self.spec.node_names())
            self.net = build(self.spec, self.ctl_port,
                             on_node=lambda node: self.track(node.pid, f"mininet:{node.name}"))
            self._register()
            self.wait_synced()
        except BaseException:
            self.stop()
            raise
        return self

    def track(self, pid: int, name: str) -> None:
        """Record a process this run started outside ``sup``/``run_on`` (call it right after the spawn):
        if the run dies without its teardown, the next testbed stops it (by PID and start time)."""
        record = self.record
        if record is not None:
            record.add_proc(pid, name)

    def track_many(self, procs: list[tuple[int, str]]) -> None:
        """``track`` for several (pid, name) at once, in one rewrite of the record."""
        record = self.record
        if record is not None and procs:
            record.add_procs(procs)

    def untrack(self, pid: int) -> None:
        self.untrack_many([pid])

    def untrack_many(self, pids: list[int]) -> None:
        record = self.record
        if record is not None and pids:
            record.drop_procs(pids)

    def _refuse_unrecorded(self) -> None:
        """Fail clearly (not with "RTNETLINK answers: File exists") if our names exist but no record owns them."""
        nodes = self.spec.node_names()
        pattern = re.compile(r"^(%s)-eth\d+$" % "|".join(map(re.escape, nodes)))
        clash = [f"OVS bridge {b}" for b in ovs.bridges() if b in self.spec.switches]
        clash += [f"link {n}" for n in leftovers.list_links() if n in nodes or pattern.match(n)]
        if not clash:
            return
        live = f"; live testbed runs: {', '.join(self.swept.live)}" if self.swept and self.swept.live else ""
        raise TopoError(
            f"{', '.join(clash)} already exist(s), and no dead testbed run recorded them{live}. "
            "They were left by a run from before run records, or are someone else's: check, then remove "
            "them by hand (ovs-vsctl del-br NAME; ip link del NAME)")

    def _register(self) -> None:
        switches, hosts, links = describe(self.net)
        for dpid, name in switches:
            self.registry.put_switch(schema.Switch(dpid=dpid, name=name))
            self.switches[name] = dpid
        for a, pa, b, pb in links:
            self.registry.put_link(schema.Link(dpid=a, port=pa, peer_dpid=b, peer_port=pb))
        for mac, dpid, port, name, iface, ip in hosts:
            # the source guard: front-door requests only from the host's own address
            self.hosts[name] = {"mac": mac, "dpid": dpid, "port": port, "iface": iface, "ips": [ip] if ip else []}
            self.registry.put_host(self.host_record(name))

    def host_record(self, host: str, ips: list[str] | None = None) -> schema.Host:
        """The registry record of Mininet host ``host``: its MAC and port, and ``ips`` (None: the addresses it
        was given, see :meth:`add_address`; [] registers it unguarded)."""
        h = self.hosts[host]
        return schema.Host(mac=h["mac"], dpid=h["dpid"], port=h["port"], name=host,
                           ips=h["ips"] if ips is None else ips)

    def add_address(self, host: str, ip: str, prefix: int = 8) -> int:
        """Give Mininet host ``host`` one more IPv4 address and register it (the source guard lets its
        front-door requests come from it); the registry revision of the host record."""
        res = subprocess.run(["nsenter", f"--net={self.netns(host)}", "--", "ip", "addr", "replace", f"{ip}/{prefix}",
                              "dev", self.hosts[host]["iface"]], capture_output=True, text=True)
        if res.returncode != 0:
            raise TopoError(f"cannot add {ip} to {host}: {res.stderr.strip()}")
        h = self.hosts[host]
        if ip not in h["ips"]:
            h["ips"] = h["ips"] + [ip]
        return self.registry.put_host(self.host_record(host))

    def wait_synced(self, timeout: float = 30.0) -> None:
        self.registry.wait_applied(self.registry.state_revision(), timeout=timeout)

    def stop(self) -> None:
        """Stop everything this testbed started; a signal meanwhile is held until the teardown is done."""
        with shielded():
            self._teardown()

    def _teardown(self) -> None:
        def step(what, fn):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every step runs; the run record catches the rest
                log.warning("teardown: %s: %s", what, exc)

        for proc in [p for p in self.sup.procs if p is not self.controller]:
            step(f"stop {proc.name}", lambda proc=proc: self.sup.stop(proc))
        if self.net is not None:
            step("mininet stop", self.net.stop)
            for ctl in self.net.controllers:  # RemoteController.stop() leaves its shell running
                step(f"mininet {ctl.name} shell", ctl.terminate)
            self.net = None
        if self.controller is not None:
            step("stop controller", lambda: self.sup.stop(self.controller))
            self.controller = None
        step("stop processes", self.sup.stop_all)
        if self.registry is not None:
            step("close registry", self.registry.close)
        if self.etcd is not None:
            step("stop etcd", self.etcd.stop)
            self.etcd = None
        if self.own_workdir and not os.environ.get("VFAB_KEEP_WORKDIR"):
            step("workdir data", self._prune_workdir)
        try:
            if self.record is not None:
                # Whatever the steps above missed (a step failed, the start was cut short).
                step("run record", lambda: leftovers.clean(self.record.data, "testbed teardown", dirs=False,
                                                                   settle=2.0))
                self.record.remove()
                self.record = None
            if self.started_ovs and not ovs.bridges():
                ovs.stop()
        finally:
            if Testbed._running is self:
                Testbed._running = None
            if self._locked:
                self._locked = False
                release_lock()

    def _prune_workdir(self) -> None:
        """Remove the folders of the run's own workdir (etcd's data, the services' stores: up to ~0.8 GB a run)
        and keep its files and ``logs/`` (what an operator reads after a failure).  Every run used to leave it
        all in /tmp; ``VFAB_KEEP_WORKDIR=1`` still does."""
        for entry in os.scandir(self.workdir):
            if entry.is_dir(follow_symlinks=False) and entry.name != "logs":
                shutil.rmtree(entry.path, ignore_errors=True)
        log.info("testbed logs kept in %s (VFAB_KEEP_WORKDIR=1 keeps the data too)", self.workdir)

    def __enter__(self) -> "Testbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- controller -----------------------------------------------------------
    def start_controller(self) -> None:
        cmd = [sys.executable, "-m", "vfab.controller", "--etcd", self.etcd_endpoint,
               "--port", str(self.ctl_port), "--poll", str(self.poll)]
        self.controller = self.sup.start("controller", cmd)
        wait_for(lambda: self._port_open(self.ctl_port) or not self.controller.alive(), 20,
                 "the controller to listen")
        if not self.controller.alive():
            raise RuntimeError(f"controller exited at start:\n{self.controller.tail()}")

    def kill_controller(self) -> None:
        self.sup.kill9(self.controller)
        self.controller = None

    @staticmethod
    def _port_open(port: int) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    # -- helpers --------------------------------------------------------------
    def host(self, name: str):
        return self.net.get(name)

    def netns(self, host: str) -> str:
        """Path of a Mininet host's network namespace."""
        return f"/proc/{self.host(host).pid}/ns/net"

    def run_on(self, host: str, name: str, args: list[str], stdout=None):
        """Start a vfab service for Mininet host ``host``, supervised.

        The process stays in the root namespace (etcd on loopback is the control
        network) and opens its data port inside the host: ``--netns`` is appended.
        """
        return self.sup.start(name, [sys.executable, *args, "--netns", self.netns(host)], stdout=stdout)

    def dump_flows(self, switch: str) -> list[str]:
        out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-flows", switch],
                             capture_output=True, text=True, check=True).stdout
        return [ln.strip() for ln in out.splitlines() if "cookie=" in ln]

    def wait_revision(self, revision: int, timeout: float = 10.0) -> float:
        return self.registry.wait_applied(revision, timeout=timeout)

    def sleep(self, s: float) -> None:
        time.sleep(s)
