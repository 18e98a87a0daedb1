"""Flow compiler: range map + endpoints + topology → per-switch flows and groups.

Pure function of a ``FabricState`` (DESIGN.md §3): no I/O, no clock.

table 0 (admit): a registered host port may source its own MAC (priority 300)
and the VIDs of the services its endpoints serve (301); anything else from it is dropped and counted
(200).  Trunk ports are trusted (300).  Front doors sit at 400.  Unregistered
ports go on to table 1 (priority 0).

table 1 (route): one masked ``eth_dst`` match per range block (1000) → towards
the owner.  For ``rx=ovs`` endpoints the *first* switch rewrites ``eth_dst`` to
the owner's MAC and host routes carry the frame from there: the switch where a
frame enters decides its whole path, so a cut-over is consistent per packet
however far the other switches' datapaths lag their tables (a frame goes to
the old owner or to the new one, never into a half-turned path), and transit
switches hold nothing a cut-over changes.  (DESIGN.md §3 rewrote at the last
hop; the README, "Cut-overs on a busy switch", says why.)  ``rx=bpf``/``promisc``
endpoints need the VID on the wire: they are reached hop by hop (next hop
towards them, the VID kept).  Mirrors → group ``all`` (one bucket per
endpoint); helpers → group ``select`` at the first switch, one bucket per
helper, rewritten to the helper's MAC, weighted by the range's ``weights``
(∝ spare capacity, from the balancer; equal when it names none).  Group ids
here are in compile order; the controller's engine keeps each range's group
id stable on a switch (``engine.place_groups``).  Known host MACs (500) → their port.
VIDs of no live range (10) → the miss policy.  Everything else (0) → NORMAL.

Front doors (``fabric/frontdoor.py``): per service, per registered host (its
port and MAC; never a trunk), a 400 flow that rewrites a real protocol's frames to the service's VIDs and goes on to
table 1; per registered host port without a live endpoint of the service, a 450 flow that drops (and counts)
the protocol's server answers (a rogue DHCP server, a forged memcached reply); for a host registered with its
IPv4 addresses, a udp door's 400 flows match each of them and a 399 flow drops (and counts) its requests from
any other address (the source guard); a ``dhcp`` host's addresses are its registered ones plus the one its
``Binding`` (an sdhcp lease) gives until ``until``: the caller passes ``now`` (no binding with one yet: only
the 399 flow).  A bad or clashing front door is a line in ``problems`` (by default
the state's own ``FabricState.problems``) and is skipped.
"""

from __future__ import annotations

import functools
import ipaddress

from vfab.fabric import frontdoor
from vfab.fabric.flows import (TABLE_ADMIT, TABLE_ROUTE, Bucket, FlowSpec, GroupSpec, Kind,
                               SwitchConfig, gc_paused, make_cookie, match)
from vfab.fabric.frontdoor import FrontDoorError
from vfab.fabric.state import FabricState
from vfab.fabric.topology import next_hops
from vfab.vid import codec
from vfab.vid.ranges import Range, to_masks

PRIO_FRONTDOOR = 400   # and 399: a source-guarded door's drop of requests from unregistered addresses
PRIO_GUARD = 450
PRIO_ADMIT = 300
# A server answers from the VID of the key it was asked (its reply's source).  Above the own-MAC admit flows,
# so the classifier finds these first and stops: a reply's megaflow then keeps the VID source masked to the
# service (one datapath flow per server and client), instead of un-wildcarding the whole source in the own-MAC
# subtable's lookup (one datapath flow per key and client: bench/own_flows.py measured 256 of them for 256 keys).
PRIO_ADMIT_VID = 301
PRIO_DENY = 200
PRIO_VID = 1000
PRIO_HOST = 500
PRIO_MISS = 10
PRIO_BASE = 0
GROUP_BASE = 1


_mac = functools.lru_cache(maxsize=65536)(codec.mac_to_int)  # endpoint MACs recur once per range and switch


def _deliver(sw: int, ep_hosts: list, hops: dict) -> list[tuple]:
    """Distinct action lists reaching each (endpoint, host) from switch sw.

    rx=ovs: the endpoint's MAC replaces the VID here, whichever hop this is (host routes do the rest);
    otherwise the VID stays and the frame goes to the next hop (or the endpoint's port).
    """
    outs: dict[tuple, None] = {}
    for ep, host in ep_hosts:
        port = host.port if host.dpid == sw else hops.get((sw, host.dpid))
        if port is None:
            continue
        acts = (("output", port),) if ep.rx != "ovs" else (("set_eth_dst", _mac(ep.mac)), ("output", port))
        outs[acts] = None
    return list(outs)


def _select(sw: int, ep_hosts: list, hops: dict, weight) -> list[tuple[int, tuple]]:
    """(bucket weight, actions) per reachable helper, chosen once at the first switch.

    Each bucket rewrites ``eth_dst`` to the helper's MAC, so transit switches
    forward it by host route and never select again (a second selection could
    pick the trunk the frame came in on, and OVS drops output to the in-port).
    ``weight(name)``: the helper's bucket weight (the range record's, ∝ spare capacity).
    """
    outs = []
    for ep, host in ep_hosts:
        port = host.port if host.dpid == sw else hops.get((sw, host.dpid))
        if port is not None:
            outs.append((weight(ep.name), (("set_eth_dst", _mac(ep.mac)), ("output", port))))
    return outs


def block_matcher(service: int, layout: codec.Layout | str):
    """A fast ``codec.block_match`` for one service: (key value, key mask) → (MAC value, MAC mask).

    The service's bits and the key's position are taken from the codec once; a
    range of many blocks then costs two shifts per block instead of a Vid object.
    """
    base_v, base_m = codec.service_match(service, layout=layout)
    key_ofs = (codec.encode(service, 1, layout=layout).value ^ base_v).bit_length() - 1

    def block(key_value: int, key_mask: int) -> tuple[int, int]:
        return base_v | (key_value & key_mask) << key_ofs, base_m | key_mask << key_ofs
    return block


def compile_fabric(st: FabricState, hops: dict[tuple[int, int], int] | None = None,
                   problems: list[str] | None = None, now: float | None = None) -> dict[int, SwitchConfig]:
    """Every switch's flows and groups.  ``hops``: ``topology.next_hops`` of ``st`` if the caller has it.
    ``now`` (unix s): bindings that ended by then guard nothing (None: every binding counts)."""
    with gc_paused():
        return _compile(st, hops, st.problems if problems is None else problems, now)


def live_bindings(st: FabricState, now: float | None) -> dict[str, str]:
    """host MAC → the address its binding gives, for the ``dhcp`` hosts whose binding has not ended."""
    return {mac: b.ip for mac, b in st.bindings.items()
            if (now is None or b.until > now) and getattr(st.hosts.get(mac), "dhcp", False)}


def _compile(st: FabricState, hops: dict[tuple[int, int], int] | None, problems: list[str],
             now: float | None) -> dict[int, SwitchConfig]:
    dpids = sorted(st.switches)
    if hops is None:
        hops = next_hops(dpids, [(lk.dpid, lk.port, lk.peer_dpid, lk.peer_port) for lk in st.links])
    trunks = {(lk.dpid, lk.port) for lk in st.links}
    out = {d: SwitchConfig(d) for d in dpids}

    def live(service: str, name: str, linger: bool = False):
        ep = st.owner_endpoint(service, name) if linger else st.endpoints.get((service, name))
        host = st.hosts.get(ep.mac) if ep else None
        return (ep, host) if host else None

    for cfg in out.values():
        cfg.add(FlowSpec(TABLE_ADMIT, PRIO_BASE, match(), (("goto", TABLE_ROUTE),), make_cookie(Kind.BASE)))
        cfg.add(FlowSpec(TABLE_ROUTE, PRIO_BASE, match(), (("normal",),), make_cookie(Kind.BASE)))
        miss = {"drop": (), "controller": (("controller",),), "flood": (("flood",),)}[st.miss]
        cfg.add(FlowSpec(TABLE_ROUTE, PRIO_MISS, match(eth_dst=codec.ANY_VID), miss,
                         make_cookie(Kind.VID_MISS)))
    for dpid, port in trunks:
        if dpid in out:
            out[dpid].add(FlowSpec(TABLE_ADMIT, PRIO_ADMIT, match(in_port=port),
                                   (("goto", TABLE_ROUTE),), make_cookie(Kind.ADMIT, lo=port)))

    # Host ports: own MAC in, everything else not owned dropped; host MAC routes everywhere.
    host_ports = []  # (dpid, port, mac) of every registered host port (front doors sit on these)
    sources: dict[int, list[int]] = {}   # guarded host MAC -> the IPv4 addresses it may send requests from
    bound = live_bindings(st, now)
    for mac, host in st.hosts.items():
        mac_i = codec.mac_to_int(mac)
        if host.dpid in out and (host.dpid, host.port) not in trunks:
            host_ports.append((host.dpid, host.port, mac_i))
            if host.ips or host.dhcp:
                ips = {int(ipaddress.IPv4Address(ip)) for ip in host.ips}
                if mac in bound:
                    ips.add(int(ipaddress.IPv4Address(bound[mac])))
                sources[mac_i] = sorted(ips)
        if host.dpid in out:
            cfg = out[host.dpid]
            cfg.add(FlowSpec(TABLE_ADMIT, PRIO_ADMIT, match(in_port=host.port, eth_src=mac_i),
                             (("goto", TABLE_ROUTE),), make_cookie(Kind.ADMIT, lo=host.port)))
            cfg.add(FlowSpec(TABLE_ADMIT, PRIO_DENY, match(in_port=host.port), (),
                             make_cookie(Kind.DENY, lo=host.port)))
        for sw, cfg in out.items():
            if sw == host.dpid:
                acts = (("output", host.port),)
            elif (sw, host.dpid) in hops:
                acts = (("output", hops[(sw, host.dpid)]),)
            else:
                continue
            cfg.add(FlowSpec(TABLE_ROUTE, PRIO_HOST, match(eth_dst=mac_i), acts,
                             make_cookie(Kind.HOST_ROUTE)))

    next_group = {d: GROUP_BASE for d in dpids}
    claimed: list = []  # front doors compiled so far (a frame may be claimed by one service only)
    # Each service's live and lingering endpoints, by name: once, not a sort of every endpoint per service
    # (that was 0.76 s of a node's compile at 1,000 services with 4,000 endpoints, bench/scale.py).
    endpoints_of: dict[str, list] = {}
    for (s_name, _), ep in sorted({**st.lingering, **st.endpoints}.items()):
        endpoints_of.setdefault(s_name, []).append(ep)
    for sname, svc in sorted(st.services.items()):
        layout = codec.Layout.parse(svc.layout)
        block = block_matcher(svc.id, layout)
        # Sources: a host port carrying a live endpoint of the service may send from any of its VIDs (the
        # endpoints of a service are its servers; a range's new owner can answer from the range's VIDs
        # the moment it takes the range over, before its route reaches the switches).
        every_key = block(0, 0)
        serving: set[tuple[int, int]] = set()   # (dpid, port) of the hosts carrying a live endpoint of it
        # A lingering endpoint (etcd deleted its record moments ago, see FabricState) may still answer: what
        # it holds was sent to it while it was live.
        for ep in endpoints_of.get(sname, ()):
            host = st.hosts.get(ep.mac)
            if host is not None:
                serving.add((host.dpid, host.port))
            if host is not None and host.dpid in out:
                out[host.dpid].add(FlowSpec(TABLE_ADMIT, PRIO_ADMIT_VID, match(in_port=host.port, eth_src=every_key),
                                            (("goto", TABLE_ROUTE),), make_cookie(Kind.ADMIT, svc.id, host.port)))
        for rec in st.ranges.get(sname, []):
            if not rec.owner or rec.state == "unassigned":
                continue
            cookie = make_cookie(Kind.VID_ROUTE, svc.id, rec.lo, rec.epoch)
            blocks = [block(v, m) for v, m in to_masks(Range(rec.lo, rec.hi))]
            # The owner lingers (its frames still reach it while nobody else serves the range: a machine paused
            # past the endpoints' leases gets them all expired at once, and each registers again within its
            # keep-alive period); helpers and mirrors do not: the others take over their frames at once.
            owner = live(sname, rec.owner, linger=True)
            helpers = [h for h in (live(sname, n) for n in rec.helpers) if h]
            mirrors = [m for m in (live(sname, n) for n in rec.mirrors) if m]
            dst_matches = None
            for sw, cfg in out.items():
                if helpers:
                    targets, gtype = helpers, "select"
                elif owner:
                    targets, gtype = [owner, *mirrors], "all"
                else:
                    continue
                if gtype == "select":
                    outs = _select(sw, targets, hops, rec.weight)
                else:
                    outs = [(1, a) for a in _deliver(sw, targets, hops)]
                if not outs:
                    continue
                if len(outs) == 1:
                    acts = outs[0][1]
                else:
                    gid = next_group[sw]
                    next_group[sw] += 1
                    cfg.groups[gid] = GroupSpec(gid, gtype, tuple(Bucket(w, a) for w, a in outs))
                    acts = (("group", gid),)
                if dst_matches is None:  # the same matches on every switch: build them once
                    dst_matches = [match(eth_dst=b) for b in blocks]
                for m in dst_matches:
                    cfg.add(FlowSpec(TABLE_ROUTE, PRIO_VID, m, acts, cookie))
        unserved = sorted({(dpid, port) for dpid, port, _ in host_ports} - serving)   # where answers are guarded
        for door in frontdoor.service_doors(svc, problems):
            clash = next((c for c in claimed if frontdoor.overlap(c, door)), None)
            if clash is not None:
                problems.append(str(FrontDoorError(
                    f"{door.label} is skipped: its frames are already claimed by {clash.label}; "
                    "give one of them another port or address")))
                continue
            claimed.append(door)
            # A guarded (udp) door leaves the service's own hosts alone: a helper relays what it does not batch
            # to the service's address, and that must reach memcached, not come back through the door into the
            # helpers' select group (issue 43; the helpers' TCP legs are not UDP and never matched).
            door_ports = [hp for hp in host_ports if not (door.source_guard and hp[:2] in serving)]
            # Its requests' IP fragments take the same way (``Door.fragment_door``: classified by the client's
            # address, not by a port they do not carry), so a large request follows its client (issue 43).
            for d in (door, door.fragment_door()):
                if d is None:
                    continue
                for dpid, flow in frontdoor.door_flows(d, svc.id, layout, door_ports, PRIO_FRONTDOOR, sources):
                    out[dpid].add(flow)
                for dpid, flow in frontdoor.guard_flows(d, svc.id, unserved, PRIO_GUARD):
                    out[dpid].add(flow)
    return out


def route_destinations(st: FabricState) -> dict[tuple[int, int], int]:
    """(service id, range lo) → dpid of the switch where the range's traffic now ends."""
    out = {}
    for sname, svc in st.services.items():
        for rec in st.ranges.get(sname, []):
            ep = st.owner_endpoint(sname, rec.owner) if rec.owner else None
            host = st.hosts.get(ep.mac) if ep else None
            if host:
                out[(svc.id, rec.lo)] = host.dpid
    return out
