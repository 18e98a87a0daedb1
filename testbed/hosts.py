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
veth end the datapath does not read.

The control network (the management network of real machines) is a second Linux bridge there, ``vfcbr``
(address 172.16.46.254, "the console"), with a veth ``vfnNc`` to each host carrying 172.16.46.N.  The etcd
cluster runs on it: one member per host on the first 3 hosts (``etcd_members``: 1 below 3 hosts, else 3 by
default; 5 allowed from 5 hosts), inside the host's namespace at 172.16.46.N:2379 (peers :2380), its data in
the host's directory.  Every process on a host lists its own member first (``etcd_endpoint(host)``).  The
root namespace (the test, an operator's ``vfab`` after ``vfab up --hosts N``) reaches each member through a
loopback relay (``testbed.ctlnet``, ``etcd_endpoint()``), also opened inside each host, so the relay list
works anywhere.  The node agent runs in each host's namespace exactly as on a real machine (``vfab node join
--etcd 172.16.46.N:2379,... ...`` under ``ip netns exec``).

Faults: ``kill_host`` (its switch, etcd member, agent and processes, SIGKILL), ``restart_host`` (the member on
its data), ``partition`` (off the underlay, and by default off the control network too: its member loses the
majority, the relays to it and on it close), ``heal``.

Names never collide with the Mininet testbed's (``vfbs*``, ``vfh*``, ``vfbc0``): all start with ``vfn``/``vfu``
(``vfc`` for the control network's) and live inside the namespaces, never in the root one.  The machine's testbed lock is held while it runs;
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
from vfab.testbed.etcd import LocalEtcd, Placement
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
CTL_SUBNET = "172.16.46"       # the control network: hosts .N, the console (vfnu's bridge) .254
CTL_BR = "vfcbr"
CTL_CONSOLE = f"{CTL_SUBNET}.254"
CONSOLE_NS = f"/var/run/netns/{UNDERLAY_NS}"   # where the relays reach the control network from
ETCD_CLIENT, ETCD_PEER = 2379, 2380


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
        self.ctl_if = f"{PREFIX}{n}c"          # in the host's namespace: its control-network address
        self.ctl_down = f"vfc{n}"              # in the underlay namespace, on vfcbr
        self.ctl_ip = f"{CTL_SUBNET}.{n}"
        self.member = None                     # its etcd member (an EtcdMember), if it runs one
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

    def enter(self) -> list[str]:
        """The command prefix that runs a program on this host: in its network namespace, under its own host
        name (a UTS namespace of its own: what endpoints and node agents record as their machine)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name]


# -- the control network and the etcd cluster (one member per host) --------------------------------------------
def default_members(hosts: int) -> int:
    """etcd members a testbed of ``hosts`` hosts runs: 1 below 3 hosts (a cluster of 2 stops when either dies),
    else 3."""
    return 1 if hosts < 3 else 3


def check_size(hosts: int, members: int | None) -> int:
    """The member count for ``hosts`` hosts (``members`` None: the default); TopoError saying what to give."""
    if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise TopoError(f"{hosts!r} hosts: the multi-host testbed builds 1 to {MAX_HOSTS} hosts on this machine "
                        "(each is a network namespace with its own Open vSwitch)")
    if members is None:
        return default_members(hosts)
    if members not in (1, 3, 5):
        raise TopoError(f"an etcd cluster of {members} members: give 1, 3 or 5 (an even count tolerates no more "
                        "failures than one less, and more than 5 only slows every write)")
    if members > hosts:
        raise TopoError(f"{members} etcd members on {hosts} hosts: one member per host, so at most {hosts}; give "
                        f"--hosts {members} or more, or fewer members")
    return members


class _EtcdOnHosts:
    """The control network and the etcd cluster of a ``HostsTestbed`` (its members in the hosts)."""

    hosts: dict[str, Host]
    etcd_options: dict = {}   # more LocalEtcd settings (e.g. {"pre_vote": False}, to compare)

    @staticmethod
    def _relay_tags(h: Host) -> tuple[str, str]:
        return f"member:{h.name}", f"on:{h.name}"

    def _control_bridge(self) -> None:
        in_ns(UNDERLAY_NS, "ip", "link", "add", CTL_BR, "type", "bridge")
        in_ns(UNDERLAY_NS, "ip", "addr", "add", f"{CTL_CONSOLE}/24", "dev", CTL_BR)
        in_ns(UNDERLAY_NS, "ip", "link", "set", CTL_BR, "up")

    def _control_link(self, h: Host) -> None:
        """The host's veth onto the control network, with its address there."""
        sh("ip", "link", "add", h.ctl_if, "netns", h.ns, "type", "veth", "peer", "name", h.ctl_down, "netns",
           UNDERLAY_NS)
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.ctl_down, "master", CTL_BR)
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.ctl_down, "up")
        in_ns(h.ns, "ip", "addr", "add", f"{h.ctl_ip}/24", "dev", h.ctl_if)
        in_ns(h.ns, "ip", "link", "set", h.ctl_if, "up")

    def _etcd(self) -> None:
        """One member in each of the first ``etcd_members`` hosts, on its control address; the relays to them
        (tagged ``member:HOST``, and ``on:HOST`` for the ones listening inside a host)."""
        holders = list(self.hosts.values())[:self.etcd_members]
        relay = {h.name: free_port() for h in holders}
        places = [Placement(ip=h.ctl_ip, wrap=("ip", "netns", "exec", h.ns), client_port=ETCD_CLIENT,
                            peer_port=ETCD_PEER, via=f"127.0.0.1:{relay[h.name]}") for h in holders]
        self.etcd = LocalEtcd(os.path.join(self.workdir, "etcd"), members=places, **self.etcd_options)
        for h, m in zip(holders, self.etcd.members):
            h.member = m
            for where in [None, *(x.ns_path for x in self.hosts.values())]:   # this namespace's loopback, each host's
                tags = (f"member:{h.name}",) + ((f"on:{self._host_of(where)}",) if where else ())
                self.ctlnet.forward(where, relay[h.name], (h.ctl_ip, ETCD_CLIENT), CONSOLE_NS, tags=tags)
        self.etcd.on_spawn = lambda pid: self.record.add_proc(pid, "etcd")
        self.etcd.start(timeout=30)
        self.registry = Registry(self.etcd.endpoint)
        log.info("etcd: %d member(s) on %s; from this namespace: %s", len(holders),
                 ", ".join(h.name for h in holders), self.etcd.endpoint)

    def _host_of(self, ns_path: str) -> str:
        return next(h.name for h in self.hosts.values() if h.ns_path == ns_path)

    def etcd_endpoint(self, host: str | None = None) -> str:
        """The etcd member list a process on ``host`` takes (its own member first, then the others on the control
        network); with no host, the list through the relays (this namespace, or any host's loopback)."""
        if host is None:
            return self.etcd.endpoint
        own = self.hosts[host].member
        ms = sorted(self.etcd.members, key=lambda m: m is not own)
        return ",".join(m.endpoint for m in ms)

    def kill_member(self, host: str) -> None:
        """SIGKILL ``host``'s etcd member (none: nothing); its relays refuse connections until it is back."""
        m = self.hosts[host].member
        if m is not None:
            self.ctlnet.cut(f"member:{host}")
            self.etcd.kill9(m)

    def restart_member(self, host: str) -> None:
        """Start ``host``'s member again on its data and wait until it answers; its relays open again."""
        m = self.hosts[host].member
        if m is not None:
            self.ctlnet.heal(f"member:{host}")
            self.etcd.start(timeout=30)

    def _cut_control(self, host: str) -> None:
        h = self.hosts[host]
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.ctl_down, "down")
        for tag in self._relay_tags(h):
            self.ctlnet.cut(tag)

    def _heal_control(self, host: str) -> None:
        h = self.hosts[host]
        in_ns(UNDERLAY_NS, "ip", "link", "set", h.ctl_down, "up")
        for tag in self._relay_tags(h):
            if tag != f"member:{host}" or h.member is None or h.member.alive():
                self.ctlnet.heal(tag)


class HostsTestbed(_EtcdOnHosts, RouteAgents):
    """``HostsTestbed(hosts=3).start()``: N emulated hosts, an underlay, a control network with an etcd member in
    each of the first 3 hosts (``etcd_members``), a node agent per host (route agents: ``RouteAgents``)."""

    _running: "HostsTestbed | None" = None
    int_bridge = INT

    def __init__(self, hosts: int = 3, workdir: str | None = None, ttl: int = 2, agents: bool = True,
                 etcd_members: int | None = None):
        self.etcd_members = check_size(hosts, etcd_members)
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
            self.ctlnet = ControlNet()
            self._underlay()
            for h in self.hosts.values():
                self._host(h)
            self._etcd()
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
        self._control_bridge()

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
        self._control_link(h)

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
        if self.etcd is not None:   # before the namespaces it runs in go
            step("stop etcd", self.etcd.stop)
        made = set(self.record.data["netns"]) if self.record is not None else set()
        for ns in sorted(made & set(leftovers.list_netns())):   # their veths and taps go with them
            step(f"namespace {ns}", lambda ns=ns: sh("ip", "netns", "del", ns))
        if self.ctlnet is not None:
            step("control network", self.ctlnet.close)
            self.ctlnet = None
        if self.registry is not None:
            step("close registry", self.registry.close)
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
        return [*h.enter(), sys.executable, "-m", "vfab.cli", "-v", "node", "join",
                "--etcd", self.etcd_endpoint(host), "--tunnel-ip", h.tunnel_ip, "--name", h.name, "--bridge", INT,
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
                              env=dict(os.environ, OVS_RUNDIR=h.rundir, VFAB_ETCD=self.etcd_endpoint(host)))

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
        """A process inside ``host``'s namespace, supervised (killed with the host); ``VFAB_ETCD`` is the host's
        member list (its own member first), the default of every ``vfab`` command."""
        proc = self.sup.start(name, [*self.hosts[host].enter(), *cmd],
                              env={"VFAB_ETCD": self.etcd_endpoint(host)})
        self.hosts[host].procs.append(proc)
        return proc

    # -- faults -----------------------------------------------------------------------------------
    def kill_host(self, host: str) -> None:
        """The whole host crashes: its agent, its processes, its etcd member and its Open vSwitch, SIGKILL (its
        wires stay)."""
        h = self.hosts[host]
        for p in [h.agent, *h.procs]:
            if p is not None:
                self.sup.kill9(p)
        h.agent, h.procs = None, []
        self.kill_member(host)
        h.ovs.kill()
        log.warning("%s killed (agent, processes, %sovsdb-server, ovs-vswitchd)", host,
                    "etcd member, " if h.member is not None else "")

    def restart_host(self, host: str, agent: bool = True) -> None:
        """Boot a killed host again: its Open vSwitch from its database, its tunnel address, its etcd member on
        its data, its agent."""
        h = self.hosts[host]
        h.ovs.start()
        self._address(h)
        self.restart_member(host)
        if agent:
            self.start_agent(host)

    def partition(self, host: str, control: bool = True) -> None:
        """Cut ``host`` off the underlay (its underlay link goes down) and, with ``control``, off the control
        network too: its etcd member loses the majority, and the relays on it and to its member close."""
        in_ns(UNDERLAY_NS, "ip", "link", "set", self.hosts[host].downlink, "down")
        if control:
            self._cut_control(host)
        log.warning("%s partitioned (underlay%s)", host, " and control network" if control else "")

    def heal(self, host: str) -> None:
        in_ns(UNDERLAY_NS, "ip", "link", "set", self.hosts[host].downlink, "up")
        self._heal_control(host)
        log.warning("%s healed", host)

