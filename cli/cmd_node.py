"""``vfab node join|leave|list``: the machines of a fabric that spans hosts (DESIGN.md §8).

``join`` runs the node agent (``vfab.controller.node_agent``) in the foreground: under systemd on a real
machine, under ``ip netns exec`` in the multi-host testbed (``vfab.testbed.hosts``).  Same command line in
both places.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import click

from vfab.cli.cmd_metrics import metrics_options, start_metrics
from vfab.cli.common import NameType, errors, pass_ctx, table
from vfab.vid import metrics
from vfab.vid.errors import VidError
from vfab.vid.registry import Registry, nodes, schema

DEFAULT_BRIDGE = "br-vfab"
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def parse_endpoints(text: str) -> list[str]:
    """``URL[,URL...]`` (``http://HOST:PORT`` or ``HOST:PORT``) as ``HOST:PORT`` items, checked."""
    out = []
    for item in (p.strip() for p in text.split(",")):
        bare = re.sub(r"^https?://", "", item).rstrip("/")
        m = _HOSTPORT.match(bare)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise click.BadParameter(f"{item!r} is not an etcd client URL: write HOST:PORT or http://HOST:PORT, "
                                     "several separated by commas (e.g. 10.0.0.1:2379,10.0.0.2:2379)",
                                     param_hint="--etcd")
        if bare not in out:
            out.append(bare)
    return out


def registry_for(c, etcd: str | None) -> Registry:
    """The registry of ``--etcd`` (the command's own, else the group's): the whole member list is passed on
    (the registry fails over among them where it supports that)."""
    if etcd is None:
        return c.registry
    return Registry(",".join(parse_endpoints(etcd)))


def default_name() -> str:
    name = re.sub(r"[^a-z0-9_.-]", "-", socket.gethostname().split(".")[0].lower()).strip("-_.")
    return name or "node"


_ETCD = click.option("--etcd", "etcd", metavar="URL[,URL...]",
                     help="etcd members holding the fabric, comma-separated (default: the group's --etcd).")


@click.group("node")
def node() -> None:
    """Fabric nodes: machines with their own Open vSwitch joined by tunnels (join, leave, list)."""


@node.command("join")
@_ETCD
@click.option("--tunnel-ip", required=True, metavar="IP",
              help="This machine's IPv4 address on the underlay; it must sit on an Open vSwitch bridge holding "
                   "the underlay port (userspace datapath: OVS's br-phy).")
@click.option("--name", type=NameType("node"), default=None, help="Node name (default: the host name).")
@click.option("--bridge", default=DEFAULT_BRIDGE, show_default=True, help="Integration bridge (made if missing).")
@click.option("--ovs-rundir", envvar="OVS_RUNDIR", type=click.Path(file_okay=False), default=None,
              help="Open vSwitch run directory (db.sock, control sockets); default $OVS_RUNDIR or "
                   "/var/run/openvswitch.")
@click.option("--ttl", type=click.IntRange(2, 3600), default=5, show_default=True,
              help="Lease of the registration, s: the node is gone this long after its agent stops.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where the agent keeps its lease id, to take its registration back after a restart "
                   "(default /var/lib/vfab/node).")
@metrics_options
@pass_ctx
@errors
def join(c, etcd, tunnel_ip, name, bridge, ovs_rundir, ttl, state_dir, **exporter) -> None:
    """Register this machine as a fabric node and keep its tunnels to every other node, until stopped.

    Refused: a tunnel address that is not this machine's, or is another node's; a name a live node holds.
    Stopping the agent (SIGTERM) keeps the tunnels: its registration ends --ttl s later unless it is started
    again.  'vfab node leave' drains the node (its endpoints' ranges go to other nodes), then removes it."""
    from vfab.controller import ctlmetrics
    from vfab.controller.node_agent import NodeAgent

    if ovs_rundir:
        os.environ["OVS_RUNDIR"] = ovs_rundir
    try:
        tunnel_ip = schema.check_tunnel_ip(tunnel_ip)
    except VidError as exc:
        raise click.BadParameter(str(exc), param_hint="--tunnel-ip") from None
    name = name or default_name()
    agent = NodeAgent(registry_for(c, etcd), name, tunnel_ip, bridge, ttl=ttl, state_dir=state_dir)
    agent.check_machine()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    agent.on_joined = lambda: click.echo(f"node {name}: joined at {tunnel_ip} (bridge {bridge}, underlay bridge "
                                         f"{agent.phy}); following the other nodes", err=True)
    if not exporter["no_metrics"]:
        metrics.REGISTRY.register(ctlmetrics.NodeCollector(lambda: agent.record))
    exp = start_metrics(exporter, "agent", name, agent.reg.endpoint)
    try:
        agent.run(stop)
    finally:
        if exp is not None:
            exp.close()
    if agent.left:
        click.echo(f"node {name}: left the fabric", err=True)


@node.command("leave")
@_ETCD
@click.option("--name", type=NameType("node"), default=None, help="Node name (default: the host name).")
@click.option("--no-drain", is_flag=True,
              help="Leave at once: endpoints on the node keep their ranges until their own leases end.")
@pass_ctx
@errors
def leave(c, etcd, name, no_drain) -> None:
    """Remove a node from the fabric, after draining it: every range an endpoint on it owns goes to an
    endpoint of the same service on another node first (stateful ones with their state), step by step as
    shown; refused, with nothing changed, when no other node can take them.  Then every other node drops its
    tunnel to it, and its own agent removes its tunnels and exits."""
    from vfab.controller.drain import DrainError, drain

    name = name or default_name()
    reg = registry_for(c, etcd)
    if no_drain:
        rec = nodes.leave(reg, name)
        click.echo(f"node {name} ({rec.tunnel_ip}) left the fabric without draining (--no-drain): its endpoints "
                   "keep their ranges until their leases end; its agent removes its tunnels")
        return
    try:
        steps = drain(reg, name, say=lambda text: click.echo(text, err=True))
    except DrainError as exc:
        raise click.ClickException(str(exc)) from None
    moved = sum(len(s.ranges) for s in steps)
    click.echo(f"node {name} drained ({moved} range(s) of {len(steps)} endpoint(s) moved to other nodes) and left "
               "the fabric; its agent removes its tunnels")


@node.command("list")
@_ETCD
@click.option("--json", "as_json", is_flag=True, help="Print the nodes as JSON.")
@pass_ctx
@errors
def list_(c, etcd, as_json) -> None:
    """The fabric's nodes: tunnel address, bridge, ports, the peers each has a tunnel to, foreign tunnel
    packets its filter dropped."""
    found = nodes.nodes(registry_for(c, etcd))
    if as_json:
        click.echo(json.dumps({n: json.loads(rec.to_json()) for n, rec in sorted(found.items())}, indent=2))
        return
    now = time.time()
    rows = []
    for name, rec in sorted(found.items()):
        others = sorted(set(found) - {name})
        missing = sorted(set(others) - set(rec.peers))
        mesh = f"{len(set(rec.peers) & set(others))}/{len(others)}" + (f" (no tunnel to {', '.join(missing)})"
                                                                        if missing else "")
        rows.append([name, rec.tunnel_ip, f"{rec.dpid:016x}", rec.bridge, len(rec.ports), mesh, rec.refused,
                     f"{now - rec.joined:.0f} s", rec.agent])
    c.console.print(table(f"nodes ({len(found)})", ["name", "tunnel ip", "dpid", "bridge", "ports", "tunnels",
                                                     "refused", "up", "agent"], rows))


UNIT = """\
[Unit]
Description=vfab node agent ({name}): registration and tunnels of this machine in the vfab fabric
After=network-online.target openvswitch-switch.service
Wants=network-online.target
Requires=openvswitch-switch.service

[Service]
Type=simple
ExecStart={exe} node join --etcd {etcd} --tunnel-ip {ip} --name {name} --bridge {bridge} --ttl {ttl}
# exit 0 = 'vfab node leave' removed this node: stay stopped; anything else: start again (the lease is
# taken back if it is still alive, see --state-dir)
Restart=on-failure
RestartSec=1
KillSignal=SIGTERM

[Install]
WantedBy=multi-user.target
"""


@node.command("unit")
@_ETCD
@click.option("--tunnel-ip", required=True, metavar="IP", help="This machine's IPv4 address on the underlay.")
@click.option("--name", type=NameType("node"), default=None, help="Node name (default: the host name).")
@click.option("--bridge", default=DEFAULT_BRIDGE, show_default=True, help="Integration bridge.")
@click.option("--ttl", type=click.IntRange(2, 3600), default=5, show_default=True, help="Lease of the registration, s.")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the unit here (e.g. /etc/systemd/system/vfab-node.service) instead of printing it.")
@pass_ctx
@errors
def unit(c, etcd, tunnel_ip, name, bridge, ttl, out) -> None:
    """A systemd unit that runs 'vfab node join' with these settings (their form is checked here, the machine
    when the agent starts).

    Example, on each of three machines: vfab node unit --etcd 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379
    --tunnel-ip 10.0.1.N --out /etc/systemd/system/vfab-node.service && systemctl enable --now vfab-node"""
    import shutil
    import sys

    try:
        tunnel_ip = schema.check_tunnel_ip(tunnel_ip)
    except VidError as exc:
        raise click.BadParameter(str(exc), param_hint="--tunnel-ip") from None
    members = ",".join(parse_endpoints(etcd)) if etcd else c.etcd
    exe = shutil.which("vfab") or f"{sys.executable} -m vfab.cli"
    text = UNIT.format(name=name or default_name(), exe=exe, etcd=members,
                       ip=tunnel_ip, bridge=bridge, ttl=ttl)
    if out is None:
        click.echo(text, nl=False)
        return
    with open(out, "w") as fh:
        fh.write(text)
    click.echo(f"wrote {out}: 'systemctl daemon-reload && systemctl enable --now {os.path.basename(out)}'", err=True)


COMMANDS = [node]
