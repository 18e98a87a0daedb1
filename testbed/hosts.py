"""Several fabric hosts on this machine, made of the real parts (DESIGN.md §8, issue 45).

Each emulated host ``hostN`` is a network namespace ``vfnN`` with an Open vSwitch of its own
(``testbed.ovsinst``: ovsdb-server + ovs-vswitchd, netdev datapath) holding two bridges, as OVS's
userspace-tunneling howto lays a host out:

- ``vfphy``, the underlay bridge: the host's underlay port ``vfnNu`` (a veth to the underlay) and, on its
  internal port, the host's tunnel address 172.16.45.N/24 (``other_config:hwaddr`` = the veth's MAC);
- ``vfint``, the integration bridge (datapath id ``0xfb00 + N``): the tunnel ports the node agent builds
  and the host's service/client ports ``vfnNpK``, each a veth to a namespace ``vfnNpK`` of its own
  (``eth0`` there).

The underlay is a Linux bridge ``vfubr`` in a namespace of its own, ``vfnu``, holding the other ends
``vfuN`` (MTU 9000: a Geneve frame is 50 bytes longer than what it carries).  Tx offloads are off on every
veth end the datapath does not read.  The node agent runs in each host's namespace exactly as on a real
machine (``vfab node join --etcd 127.0.0.1:PORT ...`` under ``ip netns exec``); etcd (one member, on the
root namespace's loopback) reaches it through ``testbed.ctlnet``.

Faults: ``kill_host`` (its switch, agent and processes, SIGKILL), ``restart_host``, ``partition`` (off the
underlay, and by default off the control network too), ``heal``.

Names never collide with the Mininet testbed's (``vfbs*``, ``vfh*``, ``vfbc0``): all start with ``vfn``/``vfu``
and live inside the namespaces, never in the root one.  The machine's testbed lock is held while it runs;
what it creates is in a run record first (``testbed.leftovers``), so a killed run is swept by the next
testbed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile

from vfab.testbed import leftovers
from vfab.testbed.ctlnet import ControlNet
from vfab.testbed.etcd import LocalEtcd
from vfab.testbed.fabric import acquire_lock, release_lock
from vfab.testbed.net import TopoError
from vfab.testbed.ovsinst import OvsInstance
from vfab.testbed.procs import Proc, Supervisor, free_port, shielded, unwind_on_signals, wait_for
from vfab.testbed.routeagents import RouteAgents
from vfab.vid.registry import Registry, nodes

log = logging.getLogger("vfab.testbed.hosts")
PREFIX = "vfn"
UNDERLAY_NS = "vfnu"
UNDERLAY_BR = "vfubr"
PHY = "vfphy"
INT = "vfint"
SUBNET = "172.16.45"
UNDERLAY_MTU = 9000
MAX_HOSTS = 16
DPID_BASE = 0xFB00
PORT_OFPORT = 100


def sh(*cmd: str, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TopoError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def in_ns(ns: str, *cmd: str, check: bool = True) -> str:
    return sh("ip", "netns", "exec", ns, *cmd, check=check)


class Host:
    """One emulated host: its namespace, its Open vSwitch, its node agent and ports."""

    def __init__(self, n: int, workdir: str, sup: Supervisor):
        self.n = n
        self.name = f"host{n}"
        self.ns = f"{PREFIX}{n}"
        self.uplink = f"{PREFIX}{n}u"          # in the host's namespace, on vfphy
        self.downlink = f"vfu{n}"              # in the underlay namespace, on vfubr
        self.tunnel_ip = f"{SUBNET}.{n}"
        self.dpid = DPID_BASE + n
        self.rundir = os.path.join(workdir, self.name, "ovs")
        self.statedir = os.path.join(workdir, self.name, "node")
        self.ovs = OvsInstance(self.name, self.ns, self.rundir, sup)
        self.agent: Proc | None = None
        self.ports: dict[str, dict] = {}       # port name -> {ns, mac, ofport}
        self.procs: list[Proc] = []            # run_on processes

    @property
    def ns_path(self) -> str:
        return f"/var/run/netns/{self.ns}"


class HostsTestbed(RouteAgents):
    """``HostsTestbed(hosts=3).start()``: N emulated hosts, an underlay, one etcd, a node agent per host."""

    _running: "HostsTestbed | None" = None

    def __init__(self, hosts: int = 3, workdir: str | None = None, ttl: int = 2, agents: bool = True):
        if not 1 <= hosts <= MAX_HOSTS:
            raise TopoError(f"{hosts} hosts: the multi-host testbed builds 1..{MAX_HOSTS}")
        self.own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="vfab-hosts-")
        self.sup = Supervisor(os.path.join(self.workdir, "logs"))
        self.hosts = {f"host{n}": Host(n, self.workdir, self.sup) for n in range(1, hosts + 1)}
        self.ttl = ttl
        self.agents = agents
        self.etcd: LocalEtcd | None = None
        self.registry: Registry | None = None
        self.ctlnet: ControlNet | None = None
        self.record: leftovers.RunRecord | None = None
        self._locked = False

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> "HostsTestbed":
        if HostsTestbed._running is not None:
            raise RuntimeError("a HostsTestbed is already running in this process (names are fixed): stop it first")
        unwind_on_signals()
        acquire_lock()
        self._locked = True
        HostsTestbed._running = self
        try:
            self.record = leftovers.RunRecord.create(topo=f"hosts,{len(self.hosts)}", workdir=self.workdir)
            if self.own_workdir:
                self.record.add("dirs", self.workdir)
            leftovers.sweep(exclude=self.record.path)
            self._refuse_unrecorded()
            self.sup.on_start = lambda proc: self.record.add_proc(proc.pid, proc.name)
            self.sup.on_stop = lambda proc: self.record.drop_proc(proc.pid)
            self.etcd = LocalEtcd(os.path.join(self.workdir, "etcd"), free_port(), free_port())
            self.etcd.on_spawn = lambda pid: self.record.add_proc(pid, "etcd")
            self.etcd.start()
            self.registry = Registry(self.etcd.endpoint)
            self.ctlnet = ControlNet([self.etcd.client_port])
            self._underlay()
            for h in self.hosts.values():
                self._host(h)
            if self.agents:
                for h in self.hosts.values():
                    self.start_agent(h.name)
                self.wait_mesh()
        except BaseException:
            self.stop()
            raise
        return self

    def _refuse_unrecorded(self) -> None:
        ours = [ns for ns in leftovers.list_netns() if ns == UNDERLAY_NS or ns.startswith(PREFIX)]
        if ours:
            raise TopoError(f"network namespaces {', '.join(ours)} already exist and no dead testbed run recorded "
                            "them: another run's, or left from before run records; check, then 'ip netns del NAME'")

    def _netns(self, ns: str) -> None:
        self.record.add("netns", ns)
        sh("ip", "netns", "add", ns)
        in_ns(ns, "ip", "link", "set", "lo", "up")
        for knob in ("all", "default"):   # no IPv6 chatter (router solicitations) on the wires
            in_ns(ns, "sysctl", "-qw", f"net.ipv6.conf.{knob}.disable_ipv6=1")

    def _underlay(self) -> None:
        self._netns(UNDERLAY_NS)
        in_ns(UNDERLAY_NS, "ip", "link", "add", UNDERLAY_BR, "type", "bridge")
        in_ns(UNDERLAY_NS, "ip", "link", "set", UNDERLAY_BR, "up")

    def _host(self, h: Host) -> None:
        self._netns(h.ns)
        sh("ip", "link", "add", h.uplink, "netns", h.ns, "mtu", str(UNDERLAY_MTU), "type", "veth",
           "peer", "name", h.downlink, "netns", UNDERLAY_NS, "mtu", str(UNDERLAY_MTU))
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.downlink, "master", UNDERLAY_BR)
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.downlink, "up")
        in_ns(UNDERLAY_NS, "ethtool", "-K", h.downlink, "tx", "off")
        in_ns(h.ns, "ip", "link", "set", h.uplink, "up")
        h.ovs.start()
        mac = in_ns(h.ns, "cat", f"/sys/class/net/{h.uplink}/address").strip()
        h.ovs.vsctl("--may-exist", "add-br", PHY, "--", "set", "bridge", PHY, "datapath_type=netdev",
                    f"other_config:hwaddr={mac}", "--", "--may-exist", "add-port", PHY, h.uplink,
                    "--", "--may-exist", "add-br", INT, "--", "set", "bridge", INT, "datapath_type=netdev",
                    "fail_mode=secure", "protocols=OpenFlow13,OpenFlow14", f"other_config:datapath-id={h.dpid:016x}")
        self._address(h)
        self.ctlnet.add(h.name, h.ns_path)

    def _address(self, h: Host) -> None:
        """The tunnel address on vfphy's internal port (a tap ovs-vswitchd makes: again after a restart)."""
        wait_for(lambda: in_ns(h.ns, "ip", "link", "show", PHY, check=False), 10, f"{h.name}'s {PHY} device")
        in_ns(h.ns, "ip", "addr", "replace", f"{h.tunnel_ip}/24", "dev", PHY)
        in_ns(h.ns, "ip", "link", "set", PHY, "up")

    def stop(self) -> None:
        with shielded():
            self._teardown()

    def _teardown(self) -> None:
        def step(what, fn):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every step runs; the run record catches the rest
                log.warning("teardown: %s: %s", what, exc)

        for h in self.hosts.values():
            for p in [*h.procs, h.agent]:
                if p is not None:
                    step(f"stop {p.name}", lambda p=p: self.sup.stop(p))
            step(f"{h.name} ovs", h.ovs.stop)
        step("stop processes", self.sup.stop_all)
        made = set(self.record.data["netns"]) if self.record is not None else set()
        for ns in sorted(made & set(leftovers.list_netns())):   # their veths and taps go with them
            step(f"namespace {ns}", lambda ns=ns: sh("ip", "netns", "del", ns))
        if self.ctlnet is not None:
            step("control network", self.ctlnet.close)
            self.ctlnet = None
        if self.registry is not None:
            step("close registry", self.registry.close)
        if self.etcd is not None:
            step("stop etcd", self.etcd.stop)
            self.etcd = None
        try:
            if self.record is not None:
                step("run record", lambda: leftovers.clean(self.record.data, "hosts testbed teardown", dirs=False,
                                                           settle=2.0))
                self.record.remove()
                self.record = None
            if self.own_workdir and not os.environ.get("VFAB_KEEP_WORKDIR"):
                for h in self.hosts.values():
                    shutil.rmtree(os.path.join(self.workdir, h.name), ignore_errors=True)
                shutil.rmtree(os.path.join(self.workdir, "etcd"), ignore_errors=True)
        finally:
            if HostsTestbed._running is self:
                HostsTestbed._running = None
            if self._locked:
                self._locked = False
                release_lock()

    def __enter__(self) -> "HostsTestbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- node agents ------------------------------------------------------------------------------
    def join_command(self, host: str, *extra: str) -> list[str]:
        """``vfab node join`` for ``host``, as run inside its namespace (the same line a real machine runs)."""
        h = self.hosts[host]
        return ["ip", "netns", "exec", h.ns, sys.executable, "-m", "vfab.cli", "-v", "node", "join",
                "--etcd", self.etcd.endpoint, "--tunnel-ip", h.tunnel_ip, "--name", h.name, "--bridge", INT,
                "--ovs-rundir", h.rundir, "--state-dir", h.statedir, "--ttl", str(self.ttl), *extra]

    def start_agent(self, host: str) -> Proc:
        h = self.hosts[host]
        h.agent = self.sup.start(f"{host}-agent", self.join_command(host))
        return h.agent

    def stop_agent(self, host: str) -> None:
        h = self.hosts[host]
        if h.agent is not None:
            self.sup.stop(h.agent)
            h.agent = None

    def node_in_ns(self, host: str, *args: str) -> subprocess.CompletedProcess:
        """Run ``vfab ARGS`` inside ``host``'s namespace (e.g. a second join, to see it refused)."""
        h = self.hosts[host]
        return subprocess.run(["ip", "netns", "exec", h.ns, sys.executable, "-m", "vfab.cli", *args],
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, OVS_RUNDIR=h.rundir))

    def peers(self, host: str) -> set[str]:
        """The nodes ``host``'s switch has a tunnel port to, by the ports' ``external_ids``."""
        from vfab.fabric import tunnels

        return {t.peer for t in tunnels.current(INT, rundir=self.hosts[host].rundir).values()}

    def refused(self, host: str) -> int:
        """Tunnel packets ``host``'s underlay filter dropped (from addresses that are no node's)."""
        from vfab.fabric import tunnels

        return tunnels.dropped(PHY, rundir=self.hosts[host].rundir)

    def wait_mesh(self, timeout: float = 30.0, hosts: list[str] | None = None) -> None:
        """Until every live host (``hosts``) is registered and has a tunnel to every other one."""
        names = set(hosts or [h.name for h in self.hosts.values() if h.ovs.alive()])

        def meshed() -> bool:
            registered = nodes.nodes(self.registry)
            if not names <= set(registered):
                return False
            return all(set(registered[n].peers) >= names - {n} and self.peers(n) >= names - {n} for n in names)

        wait_for(meshed, timeout, f"tunnels between {', '.join(sorted(names))}", interval=0.1)

    # -- ports ------------------------------------------------------------------------------------
    def add_port(self, host: str, index: int | None = None) -> str:
        """A service/client port on ``host``: a namespace ``vfnNpK`` whose ``eth0`` is a veth to ``vfint``;
        its name (= its namespace's)."""
        h = self.hosts[host]
        k = index or len(h.ports) + 1
        name = f"{h.ns}p{k}"
        mac = f"02:fb:00:{h.n:02x}:00:{k:02x}"
        self._netns(name)
        sh("ip", "link", "add", name, "netns", h.ns, "type", "veth", "peer", "name", "eth0", "netns", name)
        in_ns(name, "ip", "link", "set", "eth0", "address", mac)
        in_ns(name, "ip", "link", "set", "eth0", "up")
        in_ns(name, "ethtool", "-K", "eth0", "tx", "off")   # the datapath never completes partial checksums
        in_ns(h.ns, "ip", "link", "set", name, "up")
        # OpenFlow port PORT_OFPORT + K: clear of the tunnel ports, which take the lowest free numbers
        h.ovs.vsctl("--may-exist", "add-port", INT, name, "--", "set", "interface", name,
                    f"ofport_request={PORT_OFPORT + k}")
        ofport = int(h.ovs.vsctl("get", "interface", name, "ofport"))
        h.ports[name] = {"ns": name, "mac": mac, "ofport": ofport}
        return name

    def port_ns(self, port: str) -> str:
        return f"/var/run/netns/{port}"

    def tunnel_port(self, host: str, peer: str) -> int:
        """The OpenFlow port number of ``host``'s tunnel to node ``peer``."""
        from vfab.fabric import tunnels

        name = tunnels.port_name(self.hosts[peer].tunnel_ip)
        return int(self.hosts[host].ovs.vsctl("get", "interface", name, "ofport"))

    def run_on(self, host: str, name: str, cmd: list[str]) -> Proc:
        """A process inside ``host``'s namespace, supervised (killed with the host)."""
        proc = self.sup.start(name, ["ip", "netns", "exec", self.hosts[host].ns, *cmd])
        self.hosts[host].procs.append(proc)
        return proc

    # -- faults -----------------------------------------------------------------------------------
    def kill_host(self, host: str) -> None:
        """The whole host crashes: its agent, its processes and its Open vSwitch, SIGKILL (its wires stay)."""
        h = self.hosts[host]
        for p in [h.agent, *h.procs]:
            if p is not None:
                self.sup.kill9(p)
        h.agent, h.procs = None, []
        h.ovs.kill()
        log.warning("%s killed (agent, processes, ovsdb-server, ovs-vswitchd)", host)

    def restart_host(self, host: str, agent: bool = True) -> None:
        """Boot a killed host again: its Open vSwitch from its database, its tunnel address, its agent."""
        h = self.hosts[host]
        h.ovs.start()
        self._address(h)
        if agent:
            self.start_agent(host)

    def partition(self, host: str, control: bool = True) -> None:
        """Cut ``host`` off the underlay (its underlay link goes down) and, with ``control``, off the control
        network (etcd) too."""
        h = self.hosts[host]
        in_ns(UNDERLAY_NS, "ip", "link", "set", self.hosts[host].downlink, "down")
        if control:
            self.ctlnet.cut(host)
        log.warning("%s partitioned (underlay%s)", host, " and control network" if control else "")
        return h

    def heal(self, host: str) -> None:
        in_ns(UNDERLAY_NS, "ip", "link", "set", self.hosts[host].downlink, "up")
        self.ctlnet.heal(host)
        log.warning("%s healed", host)

