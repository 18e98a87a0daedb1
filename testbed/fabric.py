"""A whole fabric on this machine: local etcd, Open vSwitch, the controller and a Mininet net.

Used by the integration tests, the benchmarks, the demo and ``vfab up``.
Everything it starts it stops by PID; every switch, host and veth carries the
project's prefix and goes away with ``stop()``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import time

from vfab.fabric import ovs
from vfab.testbed.etcd import LocalEtcd
from vfab.testbed.net import TopoSpec, build, describe
from vfab.testbed.procs import Supervisor, free_port, wait_for
from vfab.vid.registry import schema
from vfab.vid.registry import Registry

log = logging.getLogger("vfab.testbed")
LOCK_FILE = "/run/vfab-testbed.lock"
LOCK_WAIT = 900


class Testbed:
    def __init__(self, topo: str = "line,2,3", workdir: str | None = None, poll: float = 1.0,
                 etcd: str | None = None):
        self.spec = TopoSpec.parse(topo)
        self.workdir = workdir or tempfile.mkdtemp(prefix="vfab-")
        self.poll = poll
        self.sup = Supervisor(os.path.join(self.workdir, "logs"))
        self.etcd_endpoint = etcd
        self.etcd: LocalEtcd | None = None
        self.ctl_port = free_port()
        self.controller = None
        self.net = None
        self.registry: Registry | None = None
        self.started_ovs = False
        self.hosts: dict[str, dict] = {}
        self.switches: dict[str, int] = {}

    # -- life cycle ---------------------------------------------------------
    def start(self) -> "Testbed":
        # Switch and host names are fixed (vfbsN, vfhN): one testbed per machine at a time.
        self._lock = open(LOCK_FILE, "w")
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > LOCK_WAIT:
                    raise RuntimeError(f"another vfab testbed holds {LOCK_FILE} for over {LOCK_WAIT} s: "
                                       "stop it ('vfab down') or wait") from None
                time.sleep(0.5)
        try:
            self.started_ovs = ovs.ensure_running()
            if self.etcd_endpoint is None:
                self.etcd = LocalEtcd(os.path.join(self.workdir, "etcd"), free_port(), free_port())
                self.etcd.start()
                self.etcd_endpoint = self.etcd.endpoint
            self.registry = Registry(self.etcd_endpoint)
            self.start_controller()
            self.net = build(self.spec, self.ctl_port)
            self._register()
            self.wait_synced()
        except BaseException:
            self.stop()
            raise
        return self

    def _register(self) -> None:
        switches, hosts, links = describe(self.net)
        for dpid, name in switches:
            self.registry.put_switch(schema.Switch(dpid=dpid, name=name))
            self.switches[name] = dpid
        for a, pa, b, pb in links:
            self.registry.put_link(schema.Link(dpid=a, port=pa, peer_dpid=b, peer_port=pb))
        for mac, dpid, port, name, iface in hosts:
            self.registry.put_host(schema.Host(mac=mac, dpid=dpid, port=port, name=name))
            self.hosts[name] = {"mac": mac, "dpid": dpid, "port": port, "iface": iface}

    def wait_synced(self, timeout: float = 30.0) -> None:
        self.registry.wait_applied(self.registry.state_revision(), timeout=timeout)

    def stop(self) -> None:
        for proc in [p for p in self.sup.procs if p is not self.controller]:
            self.sup.stop(proc)
        if self.net is not None:
            try:
                self.net.stop()
            except Exception as exc:
                log.warning("mininet stop: %s", exc)
            self.net = None
        if self.controller is not None:
            self.sup.stop(self.controller)
            self.controller = None
        self.sup.stop_all()
        if self.registry is not None:
            self.registry.close()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self.started_ovs and not ovs.bridges():
            ovs.stop()
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # releases the flock
            self._lock = None

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
