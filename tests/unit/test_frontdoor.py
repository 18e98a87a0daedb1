"""fabric/frontdoor.py: kinds and their validation, and front doors through the compiler on a fake pipeline.

    clients c0..c15 ─p30..45─┐              ┌─p30..45─ clients c16..c31
    owner e1 (ovs)  ─p20────┤ s1 ─p10══p20─ s2 ├─p21──── owner e3 (ovs)
                            └                └─p22──── owner e2 (bpf)
"""

from __future__ import annotations

import ipaddress
import json
import random
import re

import pytest

from vfab.fabric import frontdoor
from vfab.fabric.compiler import PRIO_FRONTDOOR, PRIO_GUARD, compile_fabric
from vfab.fabric.flows import TABLE_ADMIT, Kind, split_cookie
from vfab.fabric.frontdoor import FrontDoorError
from vfab.fabric.state import FabricState
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec
from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema

SID = 21
S1, S2 = 1, 2
TRUNK = [(S1, 10, S2, 20), (S2, 20, S1, 10)]
BCAST = 0xFFFFFFFFFFFF
IPV4, UDP = 0x0800, 17
rng = random.Random(5)
CLIENTS = {f"c{i}": (rng.randrange(1 << 24) | 0x020000000000 | rng.randrange(256) << 24, S1 if i < 16 else S2,
                     30 + i % 16) for i in range(32)}
OWNERS = {"e1": (0x02EE00000001, S1, 20, "ovs"), "e3": (0x02EE00000003, S2, 21, "ovs"),
          "e2": (0x02EE00000002, S2, 22, "bpf")}
RANGES = [(0, 0x3FFFFF, "e1"), (0x400000, 0x9FFFFF, "e2"), (0xA00000, codec.KEY_MAX, "e3")]
SVC_IP = 0x0A000064  # 10.0.0.100


def make_items(doors=({"kind": "dhcp4"},), layout="prefix", ranges=RANGES, others=()) -> dict[str, bytes]:
    recs: list[tuple[str, schema.Record]] = [
        (schema.service_key("dhcp"), schema.Service(name="dhcp", id=SID, layout=layout, frontdoors=list(doors))),
        (schema.switch_key(S1), schema.Switch(dpid=S1)), (schema.switch_key(S2), schema.Switch(dpid=S2))]
    for name, sid, svc_doors in others:
        recs.append((schema.service_key(name), schema.Service(name=name, id=sid, frontdoors=list(svc_doors))))
    recs += [(schema.link_key(d, p), schema.Link(d, p, pd, pp)) for d, p, pd, pp in TRUNK]
    for name, (mac, dpid, port, *_) in {**CLIENTS, **OWNERS}.items():
        recs.append((schema.host_key(codec.int_to_mac(mac)),
                     schema.Host(mac=codec.int_to_mac(mac), dpid=dpid, port=port, name=name)))
    for ep, (mac, _, _, rx) in OWNERS.items():
        recs.append((schema.endpoint_key("dhcp", ep),
                     schema.Endpoint(service="dhcp", name=ep, mac=codec.int_to_mac(mac), rx=rx)))
    for e, (lo, hi, owner) in enumerate(ranges):
        recs.append((schema.range_key("dhcp", lo), schema.RangeRec(lo=lo, hi=hi, owner=owner, epoch=e + 1)))
    return {k: v.to_json().encode() for k, v in recs}


def build(**kw) -> tuple[FabricState, dict, FakeFabric]:
    st = FabricState.from_items(make_items(**kw))
    cfg = compile_fabric(st)
    return st, cfg, FakeFabric(cfg, TRUNK)


def owner_delivery(key: int, layout: str = "prefix"):
    owner = next(o for lo, hi, o in RANGES if lo <= key <= hi)
    mac, dpid, port, rx = OWNERS[owner]
    return dpid, port, mac if rx == "ovs" else codec.encode(SID, key, layout=layout).value


def dhcp_from(fab: FakeFabric, client: str, src: int | None = None, **fields):
    mac, dpid, port = CLIENTS[client]
    pkt = dict(ip_proto=UDP, udp_src=68, udp_dst=67, ipv4_src=0, ipv4_dst=0xFFFFFFFF)
    pkt.update(fields)
    return fab.inject(dpid, port, mac if src is None else src, BCAST, IPV4, **pkt)


# -- DHCP ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["prefix", "suffix"])
def test_dhcp_reaches_the_owner_of_the_client_mac_key(layout):
    st, _, fab = build(layout=layout)
    assert st.problems == []
    owners = set()
    for client, (mac, _, _) in CLIENTS.items():
        want = owner_delivery(mac & 0xFFFFFF, layout)
        assert dhcp_from(fab, client) == [want], f"{client} ({codec.int_to_mac(mac)})"
        owners.add(want[:2])
    assert len(owners) == 3  # the clients' keys spread over all three owners, on both switches
    assert fab.drop_count() == 0


def test_cutover_moves_dhcp_with_the_range():
    _, _, fab = build(ranges=[(0, codec.KEY_MAX, "e3")])
    for client in CLIENTS:
        assert dhcp_from(fab, client) == [(S2, 21, OWNERS["e3"][0])]


def test_forged_source_is_dropped_by_port_security():
    _, cfg, fab = build()
    other = CLIENTS["c5"][0]
    assert dhcp_from(fab, "c1", src=other) == []
    assert dhcp_from(fab, "c1", src=0x02DEADBEEF01) == []
    assert fab.drop_count(Kind.DENY) == 2 and fab.drop_count() == 2


def test_trunk_frames_are_not_classified_again():
    _, _, fab = build()
    mac = CLIENTS["c3"][0]
    # A DHCP broadcast arriving over the trunk is not rewritten: it goes on as it came.
    got = fab.inject(S2, 20, mac, BCAST, IPV4, ip_proto=UDP, udp_dst=67, ipv4_src=0, ipv4_dst=0xFFFFFFFF)
    assert got == [(S2, "NORMAL", BCAST)]
    # One classified at s1 crosses the trunk once, as a VID, to its owner on s2.
    key = 0x700000
    vid = codec.encode(SID, key).value
    assert fab.inject(S2, 20, mac, vid, IPV4, ip_proto=UDP, udp_dst=67) == [owner_delivery(key)]


def test_other_udp_and_other_frames_are_untouched():
    _, _, fab = build()
    assert dhcp_from(fab, "c2", udp_dst=68) == [(S1, "NORMAL", BCAST)]
    mac, dpid, port = CLIENTS["c2"]
    assert fab.inject(dpid, port, mac, BCAST, 0x0806) == [(S1, "NORMAL", BCAST)]


def test_door_flows_sit_on_host_ports_only():
    st, cfg, _ = build()
    for sw in (S1, S2):
        doors = [f for f in cfg[sw].flows.values() if split_cookie(f.cookie)[0] == Kind.FRONTDOOR]
        host_ports = {h.port for h in st.hosts.values() if h.dpid == sw}
        assert {dict((n, v) for n, v, _ in f.match)["in_port"] for f in doors} == host_ports
        assert all(f.table == TABLE_ADMIT and f.priority == PRIO_FRONTDOOR for f in doors)
        assert all(split_cookie(f.cookie)[:3] == (Kind.FRONTDOOR, SID, 0) for f in doors)
        trunk = {S1: 10, S2: 20}[sw]
        assert not any(dict((n, v) for n, v, _ in f.match)["in_port"] == trunk for f in doors)
    # No front door: no such flow.
    _, cfg, _ = build(doors=())
    assert not any(split_cookie(f.cookie)[0] == Kind.FRONTDOOR for c in cfg.values() for f in c.flows.values())


# -- UDP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["prefix", "suffix"])
def test_udp_door_keys_on_the_client_address(layout):
    _, _, fab = build(doors=[{"kind": "udp", "ip": "10.0.0.100", "port": 11211}], layout=layout)
    for i, client in enumerate(CLIENTS):
        src_ip = rng.randrange(1 << 32)
        want = owner_delivery(src_ip & 0xFFFFFF, layout)
        assert dhcp_from(fab, client, udp_dst=11211, ipv4_src=src_ip, ipv4_dst=SVC_IP) == [want]
    # Another address or port: not this door's.
    assert dhcp_from(fab, "c1", udp_dst=11211, ipv4_src=5, ipv4_dst=SVC_IP + 1) == [(S1, "NORMAL", BCAST)]
    assert dhcp_from(fab, "c1", udp_dst=11212, ipv4_src=5, ipv4_dst=SVC_IP) == [(S1, "NORMAL", BCAST)]
    # DHCP is not this service's door.
    assert dhcp_from(fab, "c1") == [(S1, "NORMAL", BCAST)]


def test_udp_door_may_key_on_the_client_mac():
    _, _, fab = build(doors=[{"kind": "udp", "ip": "10.0.0.100", "port": 53, "key": "eth_src"}])
    mac = CLIENTS["c20"][0]
    assert dhcp_from(fab, "c20", udp_dst=53, ipv4_src=7, ipv4_dst=SVC_IP) == [owner_delivery(mac & 0xFFFFFF)]


# -- answers: only the service's hosts may send them ----------------------------------------------------
def test_a_rogue_dhcp_server_on_a_client_port_is_dropped_and_counted():
    """A tenant runs its own DHCP server: its OFFERs and ACKs (67 -> 68) reached every client through NORMAL,
    and the clients cannot tell.  Dropped on every port without a shard; a shard's port still answers."""
    _, _, fab = build()
    for client in ("c4", "c20"):   # one per switch
        assert dhcp_from(fab, client, udp_src=67, udp_dst=68, ipv4_src=0x0A000001) == []
    assert fab.drop_count(Kind.GUARD) == 2 and fab.drop_count() == 2
    mac, dpid, port, _ = OWNERS["e1"]   # a shard's host: its answers go on (here: plain Ethernet, NORMAL)
    assert fab.inject(dpid, port, mac, BCAST, IPV4, ip_proto=UDP, udp_src=67, udp_dst=68) == [(S1, "NORMAL", BCAST)]
    # A relay's traffic (67 -> 67) is a request to the door, not an answer: still served
    assert dhcp_from(fab, "c3", udp_src=67, udp_dst=67) == [owner_delivery(CLIENTS["c3"][0] & 0xFFFFFF)]


def test_forged_replies_from_the_services_address_are_dropped_and_counted():
    """A host forges memcached's replies (source 10.0.0.100:11211): dropped on every port that carries no
    endpoint of the service; the service's own hosts (its servers, its helpers) answer freely, and other UDP
    from port 11211 of another address is not this door's business."""
    _, _, fab = build(doors=[{"kind": "udp", "ip": "10.0.0.100", "port": 11211}])
    forged = dict(udp_src=11211, udp_dst=40000, ipv4_src=SVC_IP, ipv4_dst=0x0A000005)
    assert dhcp_from(fab, "c7", **forged) == []
    assert dhcp_from(fab, "c7", **{**forged, "udp_dst": 11211, "ipv4_dst": SVC_IP}) == []   # even to the door
    assert fab.drop_count(Kind.GUARD) == 2
    assert dhcp_from(fab, "c7", **{**forged, "ipv4_src": SVC_IP + 1}) == [(S1, "NORMAL", BCAST)]
    for ep in ("e1", "e2", "e3"):
        mac, dpid, port, _ = OWNERS[ep]
        assert fab.inject(dpid, port, mac, BCAST, IPV4, ip_proto=UDP, **forged) == [(dpid, "NORMAL", BCAST)]
    assert fab.drop_count() == 2


def test_the_services_own_hosts_reach_its_address_past_its_udp_door():
    """Issue 43: a helper relays what it does not batch to the service's address over UDP; from a host carrying
    an endpoint of the service (its owner, its helpers) that goes to the address as plain traffic, never back
    through the door into the range's route (a helper's own key could be steered to the helpers again, or to
    itself).  Clients are still classified; a DHCP door is not changed by this."""
    _, _, fab = build(doors=[{"kind": "udp", "ip": "10.0.0.100", "port": 11211}])
    req = dict(ip_proto=UDP, udp_src=40000, udp_dst=11211, ipv4_dst=SVC_IP)
    for ep in ("e1", "e2", "e3"):
        mac, dpid, port, _ = OWNERS[ep]
        assert fab.inject(dpid, port, mac, BCAST, IPV4, ipv4_src=0x0A000042, **req) == [(dpid, "NORMAL", BCAST)]
    src_ip = 0x0A000005
    assert dhcp_from(fab, "c3", **req, ipv4_src=src_ip) == [owner_delivery(src_ip & 0xFFFFFF)]
    # a DHCP door (not source-guarded) keeps its flows on every host port, its servers' included
    st, cfg, _ = build()
    doors = {dict((n, v) for n, v, _ in f.match)["in_port"] for sw in (S1, S2) for f in cfg[sw].flows.values()
             if split_cookie(f.cookie)[0] == Kind.FRONTDOOR}
    assert {OWNERS[e][2] for e in OWNERS} <= doors


def test_guard_flows_sit_on_host_ports_without_a_server_and_follow_the_endpoints():
    st, cfg, _ = build()
    for sw in (S1, S2):
        guards = [f for f in cfg[sw].flows.values() if split_cookie(f.cookie)[0] == Kind.GUARD]
        servers = {h.port for h in st.hosts.values() if h.dpid == sw and h.name in OWNERS}
        clients = {h.port for h in st.hosts.values() if h.dpid == sw and h.name in CLIENTS}
        ports = {dict((n, v) for n, v, _ in f.match)["in_port"] for f in guards}
        assert ports == clients and servers and not servers & ports
        assert all(f.table == TABLE_ADMIT and f.priority == PRIO_GUARD and f.actions == () for f in guards)
        assert all(split_cookie(f.cookie)[:2] == (Kind.GUARD, SID) for f in guards)
    # an endpoint gone (its lease expired): its host port is guarded too
    items = make_items()
    del items[schema.endpoint_key("dhcp", "e1")]
    cfg = compile_fabric(FabricState.from_items(items))
    guarded = {dict((n, v) for n, v, _ in f.match)["in_port"] for f in cfg[S1].flows.values()
               if split_cookie(f.cookie)[0] == Kind.GUARD}
    assert OWNERS["e1"][2] in guarded
    # no front door: no guard
    _, cfg, _ = build(doors=())
    assert not any(split_cookie(f.cookie)[0] == Kind.GUARD for c in cfg.values() for f in c.flows.values())


def test_guard_drops_are_published_per_service():
    from vfab.controller.report import counters_from_stats
    from vfab.fabric.flows import make_cookie

    rows = [(0, make_cookie(Kind.GUARD, SID, lo=30), 3, 900), (0, make_cookie(Kind.GUARD, SID, lo=31), 2, 600),
            (0, make_cookie(Kind.DENY, lo=30), 1, 60)]
    assert counters_from_stats(rows) == {f"guard/{SID}": [5, 1500], "deny/30": [1, 60]}


# -- requests: a guarded host only from its own addresses ----------------------------------------------
def guarded_build(doors, ips):
    """build() with the hosts named in ``ips`` registered with those IPv4 addresses."""
    items = make_items(doors=doors)
    for name, addrs in ips.items():
        mac, dpid, port = CLIENTS[name]
        items[schema.host_key(codec.int_to_mac(mac))] = schema.Host(
            mac=codec.int_to_mac(mac), dpid=dpid, port=port, name=name, ips=addrs).to_json().encode()
    st = FabricState.from_items(items)
    cfg = compile_fabric(st)
    return cfg, FakeFabric(cfg, TRUNK)


def test_a_guarded_host_reaches_a_udp_door_only_from_its_own_addresses():
    """A tenant sends memcached requests from another host's address: the replies (memcached's, or a helper's
    multi-get answers) went to that host (UDP reflection; memcached is the classic amplifier).  A host
    registered with its addresses reaches the door only from them; anything else is dropped at its port and
    counted; a host registered without addresses is not guarded; DHCP (the clients have no address yet) is
    not."""
    door = {"kind": "udp", "ip": "10.0.0.100", "port": 11211}
    ips = {"c4": ["10.1.0.5", "10.1.0.4"], "c20": ["10.2.0.20"]}
    cfg, fab = guarded_build([door], ips)
    req = dict(udp_dst=11211, ipv4_dst=SVC_IP)
    for name, addrs in ips.items():
        for a in addrs:
            ip = int(ipaddress.IPv4Address(a))
            assert dhcp_from(fab, name, ipv4_src=ip, **req) == [owner_delivery(ip & 0xFFFFFF)]
    assert dhcp_from(fab, "c4", ipv4_src=int(ipaddress.IPv4Address("10.2.0.20")), **req) == []   # c20's address
    assert dhcp_from(fab, "c20", ipv4_src=0x0A0A0A0A, **req) == []
    assert fab.drop_count(Kind.SPOOF) == 2 and fab.drop_count() == 2
    assert dhcp_from(fab, "c7", ipv4_src=0x0A0A0A0A, **req) == [owner_delivery(0x0A0A0A)]         # not guarded
    assert dhcp_from(fab, "c4", udp_dst=11212, ipv4_src=5, ipv4_dst=SVC_IP) == [(S1, "NORMAL", BCAST)]  # not the door
    c4_port = CLIENTS["c4"][2]
    flows = [f for f in cfg[S1].flows.values() if dict((n, v) for n, v, _ in f.match).get("in_port") == c4_port
             and split_cookie(f.cookie)[0] in (Kind.FRONTDOOR, Kind.SPOOF)
             and "ip_frag" not in {n for n, _, _ in f.match}]   # its fragments' twins: test_frontdoor_fragments.py
    assert sorted((f.priority, split_cookie(f.cookie)[0]) for f in flows) == \
        [(PRIO_FRONTDOOR - 1, Kind.SPOOF), (PRIO_FRONTDOOR, Kind.FRONTDOOR), (PRIO_FRONTDOOR, Kind.FRONTDOOR)]
    # the dhcp4 door is not source-guarded
    _, fab = guarded_build([{"kind": "dhcp4"}], ips)
    assert dhcp_from(fab, "c4") == [owner_delivery(CLIENTS["c4"][0] & 0xFFFFFF)]


def test_a_dhcp_host_reaches_a_udp_door_from_the_address_its_lease_binds_until_the_lease_ends():
    """A host whose address comes from DHCP (``dhcp``) cannot be registered with it: without a lease it
    reaches the door from no address; with a binding (an sdhcp shard's lease of it) from that address and its
    registered ones, until the lease ends (``now``).  A binding of a host not marked ``dhcp`` guards nothing,
    and the engine asks for a round when the next binding ends."""
    from vfab.controller import engine

    door = {"kind": "udp", "ip": "10.0.0.100", "port": 11211}
    items = make_items(doors=[door])
    for name, ips in (("c4", []), ("c20", ["10.2.0.9"])):
        mac, dpid, port = CLIENTS[name]
        items[schema.host_key(codec.int_to_mac(mac))] = schema.Host(
            mac=codec.int_to_mac(mac), dpid=dpid, port=port, name=name, ips=ips, dhcp=True).to_json().encode()
    req = dict(udp_dst=11211, ipv4_dst=SVC_IP)
    leased = {"c4": 0x0A010005, "c20": 0x0A020014, "c7": 0x0A010007}

    def fabric(now, bindings):
        its = dict(items)
        for name, until in bindings.items():
            mac = codec.int_to_mac(CLIENTS[name][0])
            its[schema.binding_key(mac)] = schema.Binding(
                mac=mac, ip=str(ipaddress.IPv4Address(leased[name])), until=until, service="dhcp",
                shard="e1").to_json().encode()
        return FakeFabric(compile_fabric(FabricState.from_items(its), now=now), TRUNK), its

    def reaches(fab, name, ip):
        return dhcp_from(fab, name, ipv4_src=ip, **req) == [owner_delivery(ip & 0xFFFFFF)]

    fab, _ = fabric(1000.0, {})
    assert not reaches(fab, "c4", leased["c4"]) and not reaches(fab, "c20", leased["c20"])
    assert reaches(fab, "c20", 0x0A020009)                               # its registered address
    assert fab.drop_count(Kind.SPOOF) == 2
    fab, its = fabric(1000.0, {"c4": 1600.0, "c20": 1300.5, "c7": 1200.0})
    assert reaches(fab, "c4", leased["c4"]) and reaches(fab, "c20", leased["c20"])
    assert reaches(fab, "c20", 0x0A020009)
    assert not reaches(fab, "c4", leased["c20"])                          # another client's lease
    assert reaches(fab, "c7", 0x0A0A0A0A)                                 # not a dhcp host: not guarded
    rnd = engine.plan_round(its, 1, {}, now=1000.0)
    assert rnd.error is None and rnd.next_change == 1300.5                # c7's binding does not count
    fab, _ = fabric(1400.0, {"c4": 1600.0, "c20": 1300.5})                # c20's lease ended
    assert reaches(fab, "c4", leased["c4"]) and not reaches(fab, "c20", leased["c20"])
    assert engine.plan_round(its, 1, {}, now=1700.0).next_change is None


@pytest.mark.parametrize("field, value, says", [("ip", "10.0.0.256", "is not an IPv4 address"),
                                                ("until", "soon", "field 'until' has the wrong type"),
                                                ("service", "Bad Name", "service name 'Bad Name' is invalid")])
def test_bindings_are_checked(field, value, says):
    rec = json.loads(schema.Binding(mac="02:00:00:00:00:01", ip="10.0.0.1", until=5.0, service="dhcp").to_json())
    rec[field] = value
    with pytest.raises(RegistryError, match=re.escape(says)):
        schema.Binding.from_json(json.dumps(rec), "bindings/x")


def test_spoofed_drops_are_published_per_service():
    from vfab.controller.report import counters_from_stats
    from vfab.fabric.flows import make_cookie

    rows = [(0, make_cookie(Kind.SPOOF, SID, lo=30), 4, 400), (0, make_cookie(Kind.SPOOF, SID, lo=31), 1, 100)]
    assert counters_from_stats(rows) == {f"spoofed/{SID}": [5, 500]}


@pytest.mark.parametrize("ips, says", [(["10.0.0.300"], "'10.0.0.300' in 'ips' is not an IPv4 address"),
                                       ([167772161], "167772161 in 'ips' is not an IPv4 address"),
                                       ("10.0.0.1", "field 'ips' has the wrong type")])
def test_host_addresses_are_checked(ips, says):
    raw = schema.Host(mac="02:00:00:00:00:01", dpid=1, port=2).to_json().replace('"ips":[]', f'"ips":{json.dumps(ips)}')
    with pytest.raises(RegistryError, match=re.escape(says)):
        schema.Host.from_json(raw, "hosts/x")
    old = '{"mac":"02:00:00:00:00:01","dpid":1,"port":2,"name":"h"}'   # a record from before: not guarded
    assert schema.Host.from_json(old).ips == []
    assert schema.Host(mac="02:00:00:00:00:01", dpid=1, port=2, ips=["10.0.0.9", "10.0.0.10", "10.0.0.9"]).ips == \
        ["10.0.0.9", "10.0.0.10"]


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry, says", [
    ({"kind": "tftp"}, "kind 'tftp' is unknown: known kinds are dhcp4, udp"),
    ({"kind": "dhcp4", "port": 67}, "unknown parameter(s) 'port': dhcp4 takes key"),
    ({"kind": "udp", "port": 11211}, "parameter 'ip' is missing"),
    ({"kind": "udp", "ip": "10.0.0.300", "port": 1}, "parameter 'ip' must be an IPv4 address"),
    ({"kind": "udp", "ip": "224.0.0.1", "port": 1}, "must be a unicast IPv4 address"),
    ({"kind": "udp", "ip": 167772260, "port": 1}, "must be an IPv4 address"),
    ({"kind": "udp", "ip": "10.0.0.1", "port": 0}, "parameter 'port' must be a UDP port, an integer in 1..65535"),
    ({"kind": "udp", "ip": "10.0.0.1", "port": "53"}, "got '53'"),
    ({"kind": "udp", "ip": "10.0.0.1", "port": 53, "key": "ip_dst"}, "'key' must be one of ip_src, eth_src"),
    ({"kind": "udp", "ip": "10.0.0.1", "port": 53, "ttl": 5}, "unknown parameter(s) 'ttl': udp takes ip, key, port"),
    ({"port": 53}, "each front door is an object with a \"kind\""),
    ("dhcp4", "each front door is an object with a \"kind\""),
])
def test_bad_doors_are_clear_errors(entry, says):
    with pytest.raises(FrontDoorError) as exc:
        frontdoor.parse("dhcp", 3, entry)
    assert says in str(exc.value) and "front door #3 of service 'dhcp'" in str(exc.value)


def test_bad_door_is_a_problem_and_the_rest_still_compiles():
    doors = [{"kind": "udp", "ip": "10.0.0.100"}, {"kind": "dhcp4"}]
    st, cfg, fab = build(doors=doors)
    assert len(st.problems) == 1 and "parameter 'port' is missing" in st.problems[0]
    mac = CLIENTS["c7"][0]
    assert dhcp_from(fab, "c7") == [owner_delivery(mac & 0xFFFFFF)]
    # The record level: a Service the schema rejects never reaches the compiler, and nothing crashes.
    items = make_items()
    items[schema.service_key("junk")] = b'{"name": "junk", "id": 99, "frontdoors": [{"kind": 5}]}'
    st = FabricState.from_items(items)
    compile_fabric(st)
    assert len(st.problems) == 1 and "malformed" in st.problems[0]


def test_two_services_cannot_claim_the_same_frames():
    others = [("zdhcp", 40, [{"kind": "dhcp4"}]),                                     # dhcp again: clash
              ("zmc", 41, [{"kind": "udp", "ip": "10.0.0.100", "port": 67}]),          # overlaps dhcp4
              ("zdns", 42, [{"kind": "udp", "ip": "10.0.0.53", "port": 53}]),          # fine
              ("zdns2", 43, [{"kind": "udp", "ip": "10.0.0.54", "port": 53}])]         # other address: fine
    st, cfg, fab = build(others=others)
    assert len(st.problems) == 2, st.problems
    assert all("already claimed by front door #0 (dhcp4) of service 'dhcp'" in p for p in st.problems)
    sids = {split_cookie(f.cookie)[1] for f in cfg[S1].flows.values() if split_cookie(f.cookie)[0] == Kind.FRONTDOOR}
    assert sids == {SID, 42, 43}
    mac = CLIENTS["c9"][0]
    assert dhcp_from(fab, "c9") == [owner_delivery(mac & 0xFFFFFF)]


def test_key_rewrite_uses_the_codec_for_both_layouts():
    for layout in ("prefix", "suffix"):
        set_dst, mv = frontdoor.key_rewrite(SID, layout, "eth_src")
        assert set_dst == ("set_eth_dst", codec.encode(SID, 0, layout=layout).value)
        key = 0xABCDEF
        vid = set_dst[1] | key << mv[4]
        assert codec.decode(vid, layout=layout) == codec.encode(SID, key, layout=layout)
        assert mv[5] == codec.KEY_BITS
