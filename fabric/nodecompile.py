"""One node's switch, compiled from etcd alone (the route agent's logic, DESIGN.md §8): pure.

``compile_node(items, me, revision, memory)`` takes the ``/vfab/v1/`` mirror, this node's name, the mirror's
revision and what the previous call returned as ``memory``; it gives the node's ``SwitchConfig`` and the
memory for the next call.  No I/O, no clock (``now`` comes in): the route agent (controller/app.py with a
node name) and the scale bench call the same function.

What the node's switch holds (``fabric/compiler.py``'s tables, two-level routing of ``fabric/tworoute.py``):

- everything local exactly as the single-host compiler makes it for a switch that is alone: the host ports
  attached to this node's bridge (a ``hosts/`` record whose dpid is the node's), their port security and
  front doors, and the ranges whose owner is attached here (their blocks, rewritten to the owner's MAC);
- per other node, its ranges as the fewest prefixes ORTC finds (``tworoute.remote_prefixes``), each to the
  tunnel port of that node (``tunnel_ports``: node name -> OpenFlow port, read off the switch); a node with
  no tunnel yet gets its prefixes dropped;
- the host MACs of other nodes' ports to the tunnel of their node (replies to clients on other hosts);
- per tunnel port: admitted in table 0 (tunnels are trusted like trunks), and in table 1 a drop below
  every route, so a frame from a tunnel never reaches NORMAL (which would flood it into the other tunnels).

**Cut-over order across nodes.**  A range whose owner moves to another node ``W`` is pointed at ``W``
only once ``W``'s switch reported (``applied/<W's dpid>``) a revision at or past the one at which this
node first saw the move; until then this node keeps routing it as it did (to the old owner's node, or to
the old owner's port when that was here).  ``W`` itself turns at once (the new owner's node first).  A
straggler (a frame that an ingress node sent to the old owner's node before the ingress turned) meets the
old owner's node's new route and goes on through the tunnel to ``W``, which holds the range by then.
A straggler that comes back to the node it came from (the ingress was the new owner's node: it turned at
once, the old owner's node turned later and now points at it) is sent back through ``IN_PORT`` (OpenFlow never
outputs a frame to its in-port otherwise, which dropped such frames: 19 of 6,468 in bench/cutover_hosts.py at
4 hosts).  The bound on such bounces is the order, not a mark in the frame: a node points a range at another
only once that one applied the move, so two nodes never point at each other (after a restart an agent has no
memory and routes straight to the owner's node; until that one applies, a frame can pass between them).  A
Geneve option counting hops would make it a bound by construction; not done.

Limits (not done): mirrors and helpers on another node than the range's owner are left out (the owner's
node delivers to its local targets only); host MAC routes grow with the fabric's registered host ports.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

from vfab.fabric.compiler import GROUP_BASE, PRIO_ADMIT, PRIO_HOST, PRIO_VID, block_matcher, compile_fabric
from vfab.fabric.flows import (TABLE_ADMIT, TABLE_ROUTE, FlowSpec, Kind, SwitchConfig, make_cookie, match,
                              split_cookie)
from vfab.fabric.state import FabricState
from vfab.fabric.tworoute import MISS, Owned, remote_prefixes
from vfab.vid import codec
from vfab.vid.codec import KEY_BITS
from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema

PRIO_TUNNEL_DROP = 1       # table 1: a frame from a tunnel that no route took (never NORMAL)
# Remote prefixes of length L at PRIO_REMOTE + 2L (longest first), and + 1 for the same prefix's frames that came
# in from the node it points at (sent back through IN_PORT): never two overlapping flows at one priority.
PRIO_REMOTE = PRIO_VID - 100 - 2 * KEY_BITS - 2


@dataclass
class Memory:
    """What a node's previous compile decided, for the next one.  ``routes``: service -> the range records
    compiled last time, each with the node it was routed to (records of no node: ``MISS``); ``seen``: service ->
    (lo, hi, node) -> the revision at which this node first saw that range owned on that node; ``waits``:
    service -> node -> the revision its held ranges wait for that node to apply (held services only);
    ``base``: what an incremental compile (``changed``) starts from (None: the next compile is a full one)."""

    routes: dict[str, list[tuple[schema.RangeRec, str]]] = field(default_factory=dict)
    seen: dict[str, dict[tuple[int, int, str], int]] = field(default_factory=dict)
    waits: dict[str, dict[str, int]] = field(default_factory=dict)
    base: "Base | None" = None


@dataclass
class Base:
    """The last full compile's inputs and the flows each service's ranges made (kept between incremental
    compiles, updated by them): a change of ranges or an applied report recompiles only its services."""

    st: FabricState                       # the parsed mirror (ranges kept current by incremental compiles)
    node: schema.Node
    nodes: dict[str, schema.Node]
    tunnel_ports: dict[str, int]
    lingering: dict[str, bytes]
    config: SwitchConfig
    range_flows: dict[int, list]          # service id -> keys of its VID_ROUTE and REMOTE flows in ``config``
    range_keys: dict[str, set[str]]       # service -> the keys of its range records
    next_change: float | None


@dataclass
class NodeCompile:
    config: SwitchConfig | None
    memory: Memory
    waiting: dict[str, int] = field(default_factory=dict)   # node -> the revision this node waits for it to apply
    problems: list[str] = field(default_factory=list)
    error: str = ""
    next_change: float | None = None


def nodes_of(items: dict[str, bytes]) -> dict[str, schema.Node]:
    """The well-formed node records of the mirror, by name."""
    out = {}
    prefix = schema.folder("nodes")
    for key, raw in items.items():
        if key.startswith(prefix):
            try:
                node = schema.Node.from_json(raw, key)
            except RegistryError:
                continue
            out[node.name] = node
    return out


def known_nodes(items: dict[str, bytes], memory: Memory | None, changed: set[str] | None) -> dict[str, schema.Node]:
    """``nodes_of(items)``, without reading the whole mirror where ``changed`` (the keys that changed since
    the compile that made ``memory``) names no node record: the last full compile's then."""
    prefix = schema.folder("nodes")
    if changed is not None and memory is not None and memory.base is not None \
            and not any(k.startswith(prefix) for k in changed):
        return memory.base.nodes
    return nodes_of(items)


def applied_of(items: dict[str, bytes], nodes: dict[str, schema.Node]) -> dict[str, int]:
    """node -> the revision its switch reported applied (``applied/<dpid>``)."""
    by_dpid = {n.dpid: n.name for n in nodes.values()}
    out = {}
    prefix = schema.folder("applied")
    for key, raw in items.items():
        if key.startswith(prefix):
            try:
                rec = schema.Applied.from_json(raw, key)
            except RegistryError:
                continue
            if rec.dpid in by_dpid:
                out[by_dpid[rec.dpid]] = rec.revision
    return out


def _clip(rec: schema.RangeRec, lo: int, hi: int) -> schema.RangeRec | None:
    a, b = max(rec.lo, lo), min(rec.hi, hi)
    return replace(rec, lo=a, hi=b) if a <= b else None


def _overlaps(before: list[tuple[schema.RangeRec, str]]):
    """``(lo, hi) ->`` the entries of ``before`` (a previous compile's routes of one service) that overlap
    ``[lo, hi]``.  A compile's routes are sorted and disjoint: two binary searches find them (a scan per range
    made a service of n ranges cost n² clips: 4.6 s of a node's compile at 1,000 services x 100 ranges,
    bench/scale.py); routes that are not (records that overlap in etcd) are scanned."""
    los = [r.lo for r, _ in before]
    his = [r.hi for r, _ in before]
    if all(his[i] < los[i + 1] for i in range(len(before) - 1)):
        return lambda lo, hi: before[bisect.bisect_left(his, lo):bisect.bisect_right(los, hi)]
    return lambda lo, hi: [(r, node) for r, node in before if r.lo <= hi and lo <= r.hi]


def _decide(st: FabricState, me: str, dpid_node: dict[int, str], revision: int, memory: Memory,
            applied: dict[str, int]) -> tuple[Memory, dict[str, list[tuple[schema.RangeRec, str]]], dict[str, int]]:
    """Per service, the records to compile now with the node each is routed to (held where a move's new node
    has not applied it yet), the new memory, and node -> revision waited for."""
    new = Memory()
    for sname, recs in st.ranges.items():
        _decide_service(st, sname, recs, me, dpid_node, revision, memory, applied, new)
    return new, new.routes, _waiting(new)


def _waiting(memory: Memory) -> dict[str, int]:
    out: dict[str, int] = {}
    for waits in memory.waits.values():
        for node, rev in waits.items():
            out[node] = max(out.get(node, 0), rev)
    return out


def _decide_service(st: FabricState, sname: str, recs: list[schema.RangeRec], me: str, dpid_node: dict[int, str],
                    revision: int, memory: Memory, applied: dict[str, int], new: Memory) -> None:
    """One service's part of ``_decide``: its routes, seen revisions and waits into ``new``."""
    before = memory.routes.get(sname, [])
    seen_before = memory.seen.get(sname, {})
    overlapping = _overlaps(before)
    out: list[tuple[schema.RangeRec, str]] = []
    seen: dict[tuple[int, int, str], int] = {}
    waiting: dict[str, int] = {}
    for rec in recs:
        if not rec.owner or rec.state == "unassigned":
            continue
        ep = st.owner_endpoint(sname, rec.owner)
        host = st.hosts.get(ep.mac) if ep else None
        want = dpid_node.get(host.dpid, MISS) if host else MISS
        seen_key = (rec.lo, rec.hi, want)
        since = seen_before.get(seen_key, revision)
        seen[seen_key] = since
        near = overlapping(rec.lo, rec.hi)
        ready = (want in (me, MISS) or not near or all(node == want for _, node in near)
                 or applied.get(want, -1) >= since)
        if ready:
            out.append((rec, want))
            continue
        prev = [(c, node) for r, node in near if (c := _clip(r, rec.lo, rec.hi)) is not None]
        waiting[want] = max(waiting.get(want, 0), since)
        covered = sorted(prev, key=lambda p: p[0].lo)
        at = rec.lo
        for c, node in covered:   # the keys the previous compile did not route go to the new node at once
            if c.lo > at:
                out.append((replace(rec, lo=at, hi=c.lo - 1), want))
            out.append((c, node))
            at = c.hi + 1
        if at <= rec.hi:
            out.append((replace(rec, lo=at, hi=rec.hi), want))
    new.routes[sname] = out
    if seen:
        new.seen[sname] = seen
    if waiting:
        new.waits[sname] = waiting


def compile_node(items: dict[str, bytes], me: str, revision: int, memory: Memory | None = None, *,
                 tunnel_ports: dict[str, int] | None = None, now: float | None = None,
                 lingering: dict[str, bytes] | None = None, cache: dict | None = None,
                 changed: set[str] | None = None) -> NodeCompile:
    """Node ``me``'s switch from the mirror ``items`` at ``revision``; see the module's docstring.

    ``changed``: the keys that changed since the compile that made ``memory`` (None: unknown).  Where they
    are only range records and applied reports, only the services they touch are compiled again (the ranges
    of a service make only that service's route flows, see ``_incremental``); anything else, or no ``base``
    in ``memory``, compiles the whole switch."""
    memory = memory or Memory()
    tunnel_ports = tunnel_ports or {}
    lingering = lingering or {}
    if changed is not None and memory.base is not None:
        done = _incremental(items, me, revision, memory, changed, tunnel_ports, now, lingering, cache)
        if done is not None:
            return done
    nodes = nodes_of(items)
    node = nodes.get(me)
    if node is None:
        return NodeCompile(None, memory, error=f"node {me!r} is not registered (no {schema.node_key(me)}): "
                                               "run 'vfab node join' on it first")
    try:
        st = FabricState.from_items(items, cache, lingering)
        dpid_node = {n.dpid: n.name for n in nodes.values()}
        new, routes, waiting = _decide(st, me, dpid_node, revision, memory, applied_of(items, nodes))
        local = _local(st, node)
        local.ranges = {s: [r for r, n in rs if n == me] for s, rs in routes.items()}
        cfg = compile_fabric(local, hops={}, now=now)[node.dpid]
        _remote(cfg, st, routes, me, tunnel_ports)
        _hosts_elsewhere(cfg, st, node.dpid, dpid_node, tunnel_ports)
        _tunnels(cfg, tunnel_ports)
    except Exception as exc:   # a record the parser let through but the compiler cannot use
        return NodeCompile(None, memory, error=f"{type(exc).__name__}: {exc}")
    ends = [b.until for m, b in st.bindings.items() if now is not None and b.until > now and m in local.hosts]
    next_change = min(ends) if ends else None
    ids = [svc.id for svc in st.services.values()]
    if not st.problems and len(set(ids)) == len(ids):   # a problem or two services of one id: always whole
        range_flows: dict[int, list] = {}
        for key, flow in cfg.flows.items():
            kind, sid, _, _ = split_cookie(flow.cookie)
            if kind in (Kind.VID_ROUTE, Kind.REMOTE):
                range_flows.setdefault(sid, []).append(key)
        range_keys: dict[str, set[str]] = {}
        prefix = schema.folder("ranges")
        for key in items:
            if key.startswith(prefix) and (parsed := schema.parse_key(key)) and parsed[1]:
                range_keys.setdefault(parsed[1][0], set()).add(key)
        new.base = Base(st, node, nodes, dict(tunnel_ports), dict(lingering), cfg, range_flows, range_keys,
                        next_change)
    return NodeCompile(cfg, new, waiting, list(st.problems), next_change=next_change)


def _local(st: FabricState, node: schema.Node) -> FabricState:
    """What the single-host compiler sees of ``st`` for node ``node``'s switch alone (ranges: the caller's)."""
    return FabricState(services=st.services, endpoints=st.endpoints, lingering=st.lingering,
                       hosts={m: h for m, h in st.hosts.items() if h.dpid == node.dpid},
                       bindings=st.bindings, switches={node.dpid: schema.Switch(dpid=node.dpid, name=node.name)},
                       miss=st.miss, problems=st.problems)


def _touched(memory: Memory, changed: set[str]) -> set[str] | None:
    """The services to compile again for ``changed`` (None: something else changed, compile the whole switch):
    those whose range records changed, and the held ones (few: moves in flight; a report may release them,
    and one may have come in unnoticed while the last round ran)."""
    touched = set(memory.waits)
    for key in changed:
        parsed = schema.parse_key(key)
        if parsed is None or not parsed[1] or parsed[0] not in ("ranges", "applied"):
            return None
        if parsed[0] == "ranges":
            touched.add(parsed[1][0])
    return touched


def _incremental(items: dict[str, bytes], me: str, revision: int, memory: Memory, changed: set[str],
                 tunnel_ports: dict[str, int], now: float | None, lingering: dict[str, bytes],
                 cache: dict | None) -> NodeCompile | None:
    """``compile_node`` for the services ``changed`` touched, the rest from ``memory.base``; None where the
    whole switch must be compiled: a change of anything but range records and applied reports (services,
    endpoints, hosts, nodes, bindings: they reach across services or into the host flows), other tunnel
    ports or lingering endpoints, a binding that ended since, or a range record that does not parse.

    Why a service's range records are all a compile of it needs: in ``compile_fabric`` they make only that
    service's VID_ROUTE flows and their groups (cookies carry the service's id); ``_remote`` makes its REMOTE
    flows from its routes alone; ``_decide_service`` reads the service's own memory.  A service that no
    change touched and that holds no move compiles to what it compiled last (its routes all ready: a route
    that points at a node stays ready whatever that node reports); the held ones are compiled again every
    time (``_touched``).  Groups of the services compiled again take ids above the kept ones (ids are the
    compile's order; ``engine.place_groups`` maps them to the switch's)."""
    base = memory.base
    if (tunnel_ports != base.tunnel_ports or lingering != base.lingering
            or (base.next_change is not None and (now is None or now >= base.next_change))):
        return None
    touched = _touched(memory, changed)
    if touched is None:
        return None
    st = base.st
    ranges = dict(st.ranges)
    range_keys = dict(base.range_keys)
    for key in changed:
        parsed = schema.parse_key(key)
        if parsed[0] != "ranges":
            continue
        sname = parsed[1][0]
        keys = range_keys[sname] = set(range_keys.get(sname, ()))
        (keys.add if key in items else keys.discard)(key)
    parsed_recs = {}
    for sname in touched:
        recs = []
        for key in range_keys.get(sname, ()):
            hit = cache.get(key) if cache is not None else None
            if hit is not None and hit[0] == items[key]:
                rec = hit[1]
            else:
                try:
                    rec = schema.RECORDS["ranges"].from_json(items[key], key)
                except RegistryError:
                    return None
                parsed_recs[key] = (items[key], rec)
            recs.append(rec)
        recs.sort(key=lambda r: r.lo)
        if recs:
            ranges[sname] = recs
        else:
            ranges.pop(sname, None)
    if cache is not None:
        cache.update(parsed_recs)
        for key in changed:
            if key not in items:
                cache.pop(key, None)
    st = replace(st, ranges=ranges)
    keys = (schema.folder("applied") + f"{n.dpid:016x}" for n in base.nodes.values())
    applied = applied_of({k: items[k] for k in keys if k in items}, base.nodes)
    dpid_node = {n.dpid: n.name for n in base.nodes.values()}
    new = Memory(routes=dict(memory.routes), seen=dict(memory.seen), waits=dict(memory.waits))
    for sname in touched:
        new.routes.pop(sname, None)
        new.seen.pop(sname, None)
        new.waits.pop(sname, None)
        if sname in ranges:
            _decide_service(st, sname, ranges[sname], me, dpid_node, revision, memory, applied, new)
    cfg = SwitchConfig(base.config.dpid, dict(base.config.flows), dict(base.config.groups))
    range_flows = dict(base.range_flows)
    try:
        ids = {st.services[s].id: s for s in touched if s in st.services}
        for sid in ids:
            for key in range_flows.pop(sid, ()):
                flow = cfg.flows.pop(key)
                for act in flow.actions:
                    if act[0] == "group":
                        cfg.groups.pop(act[1], None)
        local = _local(replace(st, problems=[]), base.node)
        local.services = {s: st.services[s] for s in ids.values()}
        local.endpoints = {k: ep for k, ep in st.endpoints.items() if k[0] in touched}
        local.lingering = {k: ep for k, ep in st.lingering.items() if k[0] in touched}
        local.ranges = {s: [r for r, n in new.routes.get(s, ()) if n == me] for s in ids.values()}
        part = compile_fabric(local, hops={}, now=now)[base.node.dpid]
        _remote(part, st, {s: new.routes.get(s, []) for s in ids.values()}, me, tunnel_ports)
    except Exception as exc:   # as compile_node's
        return NodeCompile(None, memory, error=f"{type(exc).__name__}: {exc}")
    fresh = itertools.count(max(cfg.groups, default=GROUP_BASE - 1) + 1)
    renumber = {gid: next(fresh) for gid in sorted(part.groups)}
    for gid, group in part.groups.items():
        cfg.groups[renumber[gid]] = replace(group, group_id=renumber[gid])
    for key, flow in part.flows.items():
        kind, sid, _, _ = split_cookie(flow.cookie)
        if kind not in (Kind.VID_ROUTE, Kind.REMOTE) or sid not in ids:
            continue
        if any(a[0] == "group" for a in flow.actions):
            flow = replace(flow, actions=tuple(("group", renumber[a[1]]) if a[0] == "group" else a
                                               for a in flow.actions))
        cfg.flows[key] = flow
        range_flows.setdefault(sid, []).append(key)
    new.base = replace(base, st=st, config=cfg, range_flows=range_flows, range_keys=range_keys)
    return NodeCompile(cfg, new, _waiting(new), [], next_change=base.next_change)


def _remote(cfg: SwitchConfig, st: FabricState, routes: dict, me: str, tunnel_ports: dict[str, int]) -> None:
    """Each service's ranges owned on other nodes, as prefixes into the tunnel to their node."""
    full = (1 << KEY_BITS) - 1
    for sname, rs in sorted(routes.items()):
        svc = st.services.get(sname)
        if svc is None:
            continue
        labelled = [Owned(r.lo, r.hi, n, r.epoch) for r, n in rs]
        if all(o.node in (me, MISS) for o in labelled):
            continue
        block = block_matcher(svc.id, svc.layout)
        for value, plen, node in remote_prefixes(labelled, me):
            mask = full ^ (full >> plen)
            port = tunnel_ports.get(node) if node != MISS else None
            acts = (("output", port),) if port is not None else ()
            cookie = make_cookie(Kind.REMOTE, svc.id, value, plen)
            cfg.add(FlowSpec(TABLE_ROUTE, PRIO_REMOTE + 2 * plen, match(eth_dst=block(value, mask)), acts, cookie))
            if port is not None:   # a straggler from that very node goes back to it (OpenFlow's output:N would not)
                cfg.add(FlowSpec(TABLE_ROUTE, PRIO_REMOTE + 2 * plen + 1,
                                 match(in_port=port, eth_dst=block(value, mask)), (("in_port",),), cookie))


def _hosts_elsewhere(cfg: SwitchConfig, st: FabricState, mine: int, dpid_node: dict[int, str],
                     tunnel_ports: dict[str, int]) -> None:
    for mac, host in st.hosts.items():
        node = dpid_node.get(host.dpid)
        if host.dpid == mine or node is None or node not in tunnel_ports:
            continue
        cfg.add(FlowSpec(TABLE_ROUTE, PRIO_HOST, match(eth_dst=codec.mac_to_int(mac)),
                         (("output", tunnel_ports[node]),), make_cookie(Kind.HOST_ROUTE)))


def _tunnels(cfg: SwitchConfig, tunnel_ports: dict[str, int]) -> None:
    for port in sorted(set(tunnel_ports.values())):
        cfg.add(FlowSpec(TABLE_ADMIT, PRIO_ADMIT, match(in_port=port), (("goto", TABLE_ROUTE),),
                         make_cookie(Kind.ADMIT, lo=port)))
        cfg.add(FlowSpec(TABLE_ROUTE, PRIO_TUNNEL_DROP, match(in_port=port), (), make_cookie(Kind.BASE, lo=port)))
