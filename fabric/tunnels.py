"""Tunnels between fabric nodes: one Geneve port per remote node, and the underlay filter in front of them.

Why Geneve, one port per remote node, and a filter on the underlay bridge: docs/architecture.md, "Hosts and
tunnels".  What a node wants is computed by pure functions (``wanted``, ``plan``, ``filter_flows``) from the
registry's node records; ``apply_*`` make the local Open vSwitch hold it (``ovs-vsctl``/``ovs-ofctl`` on the
daemon that ``$OVS_RUNDIR`` names, the machine's own by default).

Ports are named after the remote's tunnel address (``vft`` + its IPv4 in hex, e.g. ``vftac102d03`` for
172.16.45.3: at most 15 characters, the kernel's limit where the datapath makes devices), and carry the
remote node's name in ``external_ids:vfab-node``.

The filter (userspace datapath: the tunnel address sits on a netdev bridge holding the underlay port) lets
tunnel packets to this node's address pass only from registered nodes' addresses and drops the rest with a
counter, before they are decapsulated::

    priority=200 udp,nw_src=<peer>,nw_dst=<me>,tp_dst=<port>  NORMAL     (one per registered peer)
    priority=190 udp,nw_dst=<me>,tp_dst=<port>                drop       (counted: ``dropped()``)
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from vfab.fabric import ovs
from vfab.vid.registry.schema import Node

log = logging.getLogger("vfab.tunnels")
ENCAP = "geneve"
UDP_PORTS = {"geneve": 6081, "vxlan": 4789}
FABRIC_VNI = 0xFAB                     # the fabric's virtual network id (Geneve VNI / VXLAN key)
PORT_PREFIX = "vft"
NODE_ID = "vfab-node"                  # external_ids key naming the remote node of a tunnel port
COOKIE_ALLOW = 0xFAB7_0000_0000_0001
COOKIE_DROP = 0xFAB7_0000_0000_0002
COOKIE_MASK = 0xFFFF_0000_0000_0000    # both filter cookies, nothing of the controller's
PRIO_ALLOW, PRIO_DROP = 200, 190


@dataclass(frozen=True)
class Tunnel:
    """One tunnel port: to node ``peer`` at ``remote_ip`` from ``local_ip``."""

    name: str
    peer: str
    remote_ip: str
    local_ip: str
    encap: str = ENCAP
    key: int = FABRIC_VNI


def port_name(ip: str) -> str:
    return f"{PORT_PREFIX}{int(ipaddress.IPv4Address(ip)):08x}"


def wanted(me: Node, nodes: dict[str, Node]) -> dict[str, Tunnel]:
    """The tunnel ports ``me`` should have: one to every other node that speaks its encapsulation and key,
    by port name.  A node with another encapsulation or key is left out (logged by the caller: ``mismatched``)."""
    out = {}
    for node in nodes.values():
        if node.name == me.name or node.tunnel_ip == me.tunnel_ip or mismatched(me, node):
            continue
        t = Tunnel(port_name(node.tunnel_ip), node.name, node.tunnel_ip, me.tunnel_ip, me.encap, me.key)
        out[t.name] = t
    return out


def mismatched(me: Node, other: Node) -> str:
    """Why ``me`` cannot tunnel to ``other`` ("" if it can)."""
    if (other.encap, other.key) != (me.encap, me.key):
        return (f"node {other.name} uses {other.encap} key {other.key}, this node {me.encap} key {me.key}: "
                "no tunnel between them")
    return ""


def plan(want: dict[str, Tunnel], have: dict[str, Tunnel]) -> tuple[list[Tunnel], list[str]]:
    """(ports to create, port names to delete); a port whose options changed is deleted and created."""
    add = [t for name, t in sorted(want.items()) if have.get(name) != t]
    remove = [name for name, t in sorted(have.items()) if want.get(name) != t]
    return add, remove


def filter_flows(local_ip: str, peers: list[str], encap: str = ENCAP) -> list[str]:
    """The underlay filter of a node at ``local_ip`` whose registered peers are at ``peers`` (flows in
    ``ovs-ofctl`` syntax, all under the filter cookies)."""
    port = UDP_PORTS[encap]
    flows = [f"cookie={COOKIE_ALLOW:#x},priority={PRIO_ALLOW},udp,nw_src={ip},nw_dst={local_ip},tp_dst={port},"
             "actions=NORMAL" for ip in sorted(set(peers), key=ipaddress.IPv4Address)]
    flows.append(f"cookie={COOKIE_DROP:#x},priority={PRIO_DROP},udp,nw_dst={local_ip},tp_dst={port},actions=drop")
    return flows


# -- the local Open vSwitch ---------------------------------------------------------------
def current(bridge: str, rundir: str | None = None) -> dict[str, Tunnel]:
    """The tunnel ports ``bridge`` holds now (those this module made: named ``vft…``), by name."""
    names = [p for p in ovs.vsctl("list-ports", bridge, rundir=rundir).split() if p.startswith(PORT_PREFIX)]
    out = {}
    for row in ovs.rows("Interface", "name", "type", "options", "external_ids", rundir=rundir) if names else []:
        if row["name"] not in names:
            continue
        opts = row["options"] if isinstance(row["options"], dict) else {}
        ext = row["external_ids"] if isinstance(row["external_ids"], dict) else {}
        try:
            key = int(opts.get("key", "0"), 0)
        except ValueError:
            key = -1
        out[row["name"]] = Tunnel(row["name"], ext.get(NODE_ID, ""), opts.get("remote_ip", ""),
                                  opts.get("local_ip", ""), row["type"], key)
    return out


def apply_ports(bridge: str, add: list[Tunnel], remove: list[str]) -> None:
    """Delete and create tunnel ports in one ``ovs-vsctl`` transaction."""
    args: list[str] = []
    for name in remove:
        args += ["--", "--if-exists", "del-port", bridge, name]
    for t in add:
        args += ["--", "add-port", bridge, t.name, "--", "set", "interface", t.name, f"type={t.encap}",
                 f"options:remote_ip={t.remote_ip}", f"options:local_ip={t.local_ip}", f"options:key={t.key}",
                 f"external_ids:{NODE_ID}={t.peer}"]
    if args:
        ovs.vsctl(*args[1:])


def apply_filter(phy: str, flows: list[str]) -> None:
    """Replace the filter on the underlay bridge ``phy`` by ``flows`` in one bundle (never a moment without
    it); ``flows=[]`` removes it."""
    lines = [f"delete cookie={COOKIE_ALLOW & COOKIE_MASK:#x}/{COOKIE_MASK:#x}"]
    lines += [f"add {f}" for f in flows]
    ovs.ofctl("--bundle", "add-flows", phy, "-", stdin="\n".join(lines) + "\n")


def dropped(phy: str, rundir: str | None = None) -> int:
    """Tunnel packets the filter on ``phy`` dropped (from addresses that are no fabric node's)."""
    out = ovs.ofctl("dump-flows", phy, f"cookie={COOKIE_DROP:#x}/-1", rundir=rundir)
    total = 0
    for part in out.split():
        if part.startswith("n_packets="):
            total += int(part.split("=", 1)[1].rstrip(","))
    return total


def local_ports(bridge: str) -> dict[str, int]:
    """``bridge``'s own ports (tunnels left out): name -> OpenFlow port number (ports still without one left
    out)."""
    names = {p for p in ovs.vsctl("list-ports", bridge).split() if not p.startswith(PORT_PREFIX)}
    out = {}
    for row in ovs.rows("Interface", "name", "ofport") if names else []:
        if row["name"] in names and isinstance(row["ofport"], int) and row["ofport"] > 0:
            out[row["name"]] = row["ofport"]
    return out
