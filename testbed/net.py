"""Mininet fabrics on OVS userspace switches; every name carries the project's prefix.

Topologies: ``single,N`` (one switch, N hosts) and ``tree,S,H`` (a core switch
linked to S edge switches with H hosts each) and ``line,S,H`` (S switches in
a chain, H hosts each).  Switch names ``vfbsN``, hosts ``vfhN``.
"""

from __future__ import annotations

import contextlib

import logging
from dataclasses import dataclass, field
from functools import partial

from vfab.vid.errors import VfabError

log = logging.getLogger("vfab.net")
SWITCH_PREFIX = "vfbs"
HOST_PREFIX = "vfh"
CONTROLLER_NAME = "vfbc0"


class TopoError(VfabError):
    pass


@dataclass
class TopoSpec:
    switches: list[str] = field(default_factory=list)
    hosts: list[tuple[str, str]] = field(default_factory=list)          # (host, switch)
    links: list[tuple[str, str]] = field(default_factory=list)          # (switch, switch)

    @classmethod
    def parse(cls, text: str) -> "TopoSpec":
        parts = text.split(",")
        kind = parts[0]
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            raise TopoError(f"topology {text!r} is malformed: use single,N | line,S,H | tree,S,H") from None
        spec = cls()
        if kind == "single" and len(nums) == 1 and 1 <= nums[0] <= 500:
            spec.switches = [f"{SWITCH_PREFIX}1"]
            spec.hosts = [(f"{HOST_PREFIX}{i + 1}", spec.switches[0]) for i in range(nums[0])]
        elif kind in ("line", "tree") and len(nums) == 2 and 1 <= nums[0] <= 16 and 1 <= nums[1] <= 200:
            s, h = nums
            edges = [f"{SWITCH_PREFIX}{i + 1}" for i in range(s)]
            if kind == "line":
                spec.switches = edges
                spec.links = [(edges[i], edges[i + 1]) for i in range(s - 1)]
            else:
                core = f"{SWITCH_PREFIX}{s + 1}"
                spec.switches = edges + [core]
                spec.links = [(e, core) for e in edges]
            n = 0
            for e in edges:
                for _ in range(h):
                    n += 1
                    spec.hosts.append((f"{HOST_PREFIX}{n}", e))
        else:
            raise TopoError(
                f"topology {text!r} is not supported: use single,N (N<=500), line,S,H or tree,S,H "
                "(S<=16 switches, H<=200 hosts each)")
        return spec

    def node_names(self) -> list[str]:
        """Every Mininet node this spec makes (each has a shell process; links are named NODE-ethN)."""
        return [*self.switches, *(h for h, _ in self.hosts), CONTROLLER_NAME]


RMEM_PATH = "/proc/sys/net/core/rmem_default"
PORT_RCVBUF = 8 << 20   # bytes of receive buffer for each port the userspace datapath reads


@contextlib.contextmanager
def _port_buffers():
    """Give the datapath's port sockets room: ``net.core.rmem_default`` raised while the ports are added.

    The userspace datapath reads each veth through an AF_PACKET socket sized by rmem_default when the
    port is added (212,992 B here: ~270 small frames).  While ovs-vswitchd's main thread is held up (a
    revalidator evicting thousands of flows, a large bundle), every port's frames queue there, and past
    that the kernel drops them silently: with 30 k+ cached flows clients lost bursts of 50-670 frames
    (25-340 ms of traffic) with no change to their own routes (bench/reroute_busy.py).  8 MiB holds
    about a second of such traffic.  Restored right after (a machine-wide setting).
    """
    try:
        with open(RMEM_PATH) as fh:
            old = int(fh.read())
    except (OSError, ValueError):
        yield
        return
    if old >= PORT_RCVBUF:
        yield
        return
    with open(RMEM_PATH, "w") as fh:
        fh.write(str(PORT_RCVBUF))
    try:
        yield
    finally:
        with open(RMEM_PATH, "w") as fh:
            fh.write(str(old))


def build(spec: TopoSpec, controller_port: int, on_node=None):
    """Build and start a Mininet net for ``spec``; returns the Mininet object.

    ``on_node(node)`` is called as soon as each node (switch, host, controller)
    exists, i.e. its shell process is running: the testbed records the PID.
    """
    on_node = on_node or (lambda node: None)
    try:
        from mininet.net import Mininet
        from mininet.node import OVSSwitch, RemoteController
    except ImportError:
        raise TopoError("Mininet is not importable: run 'make bootstrap' (Debian package mininet, "
                        "and a venv made from /usr/bin/python3 with system site packages)") from None
    class Controller(RemoteController):
        def checkListening(self):
            # Mininet probes with telnet, whose output can hold the controller's binary OpenFlow
            # HELLO (random xid bytes) and then fails to decode as UTF-8; the testbed has already
            # waited for the controller's port.
            pass

    switch = partial(OVSSwitch, datapath="user", batch=True, failMode="secure",
                     protocols="OpenFlow13,OpenFlow14")
    net = Mininet(switch=switch, controller=None, autoSetMacs=True, build=False, waitConnected=False)
    on_node(net.addController(CONTROLLER_NAME, controller=Controller, ip="127.0.0.1",
                              port=controller_port))
    for i, name in enumerate(spec.switches):
        on_node(net.addSwitch(name, dpid=f"{0xFA00 + i + 1:016x}"))
    for host, sw in spec.hosts:
        on_node(net.addHost(host))
        net.addLink(host, sw)
    for a, b in spec.links:
        net.addLink(a, b)
    net.build()
    with _port_buffers():
        net.start()  # batch=True: every port is added here, in one ovs-vsctl call
    for h in net.hosts:
        for intf in h.intfList():
            # The userspace datapath never completes partial checksums (TESTBED-NOTES.md).
            h.cmd(f"ethtool -K {intf.name} tx off >/dev/null 2>&1")
    return net


def describe(net) -> tuple[list, list, list]:
    """(switches [(dpid, name)], hosts [(mac, dpid, port, name, iface, IPv4 address or "")],
    links [(dpid, port, peer_dpid, peer_port)])."""
    switches = [(int(s.dpid, 16), s.name) for s in net.switches]
    hosts, links = [], []
    for h in net.hosts:
        intf = h.defaultIntf()
        peer = intf.link.intf2 if intf.link.intf1 is intf else intf.link.intf1
        sw = peer.node
        hosts.append((intf.MAC(), int(sw.dpid, 16), sw.ports[peer], h.name, intf.name, intf.IP() or ""))
    for link in net.links:
        a, b = link.intf1, link.intf2
        if a.node in net.switches and b.node in net.switches:
            pa, pb = a.node.ports[a], b.node.ports[b]
            da, db = int(a.node.dpid, 16), int(b.node.dpid, 16)
            links += [(da, pa, db, pb), (db, pb, da, pa)]
    return switches, hosts, links
