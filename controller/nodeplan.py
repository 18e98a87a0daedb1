"""The route agent's round, pure: etcd items + what its one switch holds → an ``engine.Round``.

A controller started with a node name (``--node``) is that node's route agent: it programs only its own
host's switch, compiled by ``fabric.nodecompile`` (two-level routing, the cross-node cut-over order).  This
module turns that compile into the same ``Round`` the single-host engine returns (one ``Commit`` for the
node's switch, its ``Report``), so the app commits, holds groups and reports exactly as it does for many
switches.  The switch's tunnel ports are found by name (``tunnels.port_name`` of each node's address)
among the ports the switch announced.
"""

from __future__ import annotations

from vfab.controller.engine import Commit, Installed, Report, Round, place_groups
from vfab.controller.reconcile import diff
from vfab.fabric import tunnels
from vfab.fabric.nodecompile import Memory, NodeCompile, compile_node, known_nodes
from vfab.vid.registry.schema import Node


def tunnel_ports(nodes: dict[str, Node], me: str, switch_ports: dict[str, int]) -> dict[str, int]:
    """node name -> the OpenFlow port of this switch's tunnel to it (``nodes``: the node records by name,
    ``switch_ports``: port name -> number)."""
    out = {}
    for node in nodes.values():
        port = switch_ports.get(tunnels.port_name(node.tunnel_ip))
        if node.name != me and port is not None:
            out[node.name] = port
    return out


def plan_node_round(items: dict[str, bytes], revision: int, installed: dict[int, Installed], node: str,
                    memory: Memory, *, switch_ports: dict[str, int], reported: dict[int, int] | None = None,
                    hold: dict[int, set[int]] | None = None, retired: dict[int, set[int]] | None = None,
                    now: float | None = None, lingering: dict[str, bytes] | None = None,
                    cache: dict | None = None, changed: set[str] | None = None) -> tuple[Round, NodeCompile]:
    """One round for node ``node``'s switch.  The compile's ``memory`` is the caller's to keep once the
    commit succeeded (or nothing needed committing); ``changed``: the keys that changed since the compile
    that made ``memory`` (None: unknown, the whole switch is compiled); the rest as ``engine.plan_round``'s."""
    nodes = known_nodes(items, memory, changed)
    nc = compile_node(items, node, revision, memory, tunnel_ports=tunnel_ports(nodes, node, switch_ports),
                      now=now, lingering=lingering, cache=cache, changed=changed)
    rnd = Round(revision, problems=nc.problems, next_change=nc.next_change)
    if nc.config is None:
        rnd.error = nc.error
        return rnd, nc
    dpid = nc.config.dpid
    rnd.configs[dpid] = nc.config
    if dpid not in installed:     # not read yet (not connected): planned once its tables are known
        return rnd, nc
    want, kept = place_groups(nc.config, *installed[dpid], hold=(hold or {}).get(dpid, ()),
                              avoid=(retired or {}).get(dpid, ()))
    rnd.configs[dpid] = want
    if kept:
        rnd.held[dpid] = kept
    plan = diff(want, *installed[dpid])
    if plan:
        rnd.steps.append(Commit(dpid, plan, want))
    if (reported or {}).get(dpid, -1) < revision:
        rnd.reports.append(Report(dpid, revision, len(want.flows), len(want.groups)))
    return rnd, nc
