"""Draining a node before it leaves: every range an endpoint on it owns goes to an endpoint on another node.

``vfab node leave`` runs it (issue 45).  An endpoint's record names the machine it runs on (``host``: its host
name); the node's record names its agent's machine (``agent``: ``PID@HOST``), so the endpoints on a node are
the ones with that host name.  ``plan`` is pure: it takes the records and returns the steps, or why the
node cannot be drained; ``drain`` carries the steps out and then removes the node.

- a **stateful** endpoint (it has a control address) is moved with its state (``vfab.vid.state.ctl.move``) to
  a stateful endpoint of the same service on another node, the one that owns the fewest ranges;
- a **stateless** one has its ranges given to such an endpoint (one etcd transaction per range, comparing
  its epoch, like ``vfab route``).

Refused, with nothing changed, when an endpoint on the node owns ranges and no endpoint of its service runs
on another node, or when the node's host name is shared with another node (its endpoints cannot be told
apart).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from vfab.vid.errors import Conflict, VfabError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, nodes, schema

log = logging.getLogger("vfab.drain")


class DrainError(VfabError):
    pass


@dataclass
class Step:
    service: str
    source: str                # endpoint on the leaving node
    peer: str                  # endpoint on another node that takes its ranges
    ranges: list[Range]
    stateful: bool

    def __str__(self) -> str:
        how = "moved with their state" if self.stateful else "reassigned"
        return f"{self.service}: {self.source} -> {self.peer}, {len(self.ranges)} range(s) {how}"


def machine(node: schema.Node) -> str:
    """The host name of the machine a node's agent runs on ('' if its record does not say)."""
    return node.agent.rpartition("@")[2]


def plan(node: schema.Node, others: list[schema.Node], endpoints: dict[str, list[schema.Endpoint]],
         ranges: dict[str, list[schema.RangeRec]]) -> list[Step]:
    """The steps that empty ``node`` (every other node in ``others``), or DrainError saying why it cannot be."""
    host = machine(node)
    if not host:
        raise DrainError(f"node {node.name}'s record does not name its machine (agent {node.agent!r}): its "
                         "endpoints cannot be found; leave with --no-drain")
    twins = sorted(o.name for o in others if machine(o) == host)
    if twins:
        raise DrainError(f"node {node.name} shares its host name {host!r} with node(s) {', '.join(twins)}: the "
                         "endpoints on it cannot be told apart; give each machine its own host name, or leave "
                         "with --no-drain")
    steps: list[Step] = []
    why: list[str] = []
    for service, eps in sorted(endpoints.items()):
        owned: dict[str, list[Range]] = {}
        for rec in ranges.get(service, []):
            if rec.owner:
                owned.setdefault(rec.owner, []).append(rec.range)
        load = {e.name: len(owned.get(e.name, [])) for e in eps}
        for ep in sorted((e for e in eps if e.host == host), key=lambda e: e.name):
            mine = owned.get(ep.name, [])
            if not mine:
                continue
            stateful = bool(ep.ctl)
            fits = [e for e in eps if e.host != host and bool(e.ctl) == stateful]
            if not fits:
                kind = "stateful " if stateful else ""
                why.append(f"{service}/{ep.name} owns {len(mine)} range(s) and no {kind}endpoint of {service} runs "
                           "on another node")
                continue
            peer = min(fits, key=lambda e: (load[e.name], e.name))
            load[peer.name] += len(mine)
            steps.append(Step(service, ep.name, peer.name, mine, stateful))
    if why:
        raise DrainError(f"node {node.name} cannot be drained: {'; '.join(why)}. Start such endpoints on another "
                         "node first, or leave with --no-drain (its endpoints then keep their ranges until their "
                         "leases end)")
    return steps


def drain(reg: Registry, name: str, say: Callable[[str], None] = lambda text: None,
          timeout: float = 600.0) -> list[Step]:
    """Move every range off node ``name``'s endpoints (``say`` is told each step), then remove the node."""
    from vfab.vid.state import ctl as statectl

    found = nodes.nodes(reg)
    if name not in found:
        nodes.leave(reg, name)   # NotFound naming the nodes
    services = [s.name for s in reg.services()]
    endpoints = {s: reg.endpoints(s) for s in services}
    ranges = {s: [r for r, _ in reg.ranges(s)] for s in services}
    steps = plan(found[name], [n for n in found.values() if n.name != name], endpoints, ranges)
    if not steps:
        say(f"node {name}: no endpoint on it owns a range: nothing to drain")
    for i, step in enumerate(steps, 1):
        say(f"draining node {name} ({i}/{len(steps)}): {step}")
        if step.stateful:
            started = statectl.move(reg, step.service, step.source, step.peer)
            rec = statectl.wait(reg, step.service, started.op, timeout=timeout,
                                progress=lambda op: say(f"  {op.op} {op.phase} {op.done}/{op.total}"))
            if rec.phase != "done":
                raise DrainError(f"moving {step.service}/{step.source} to {step.peer} ended {rec.phase}: "
                                 f"{rec.error or 'no reason given'}; node {name} was not removed")
            continue
        for rng in step.ranges:
            rec = next((r for r, _ in reg.ranges(step.service) if r.range == rng and r.owner == step.source), None)
            if rec is None:
                raise Conflict(f"range {rng} of {step.service} changed while node {name} was drained: run "
                               "'vfab node leave' again")
            reg.assign(step.service, rng, step.peer, expect_epoch=rec.epoch, mirrors=rec.mirrors,
                       helpers=rec.helpers, state=rec.state, weights=rec.weights)
            say(f"  {step.service} {rng}: {step.source} -> {step.peer}")
    nodes.leave(reg, name)
    return steps
