"""IP fragments follow their client through a udp front door (issue 43): compiler, fake table and wire format.

OVS's default fragment handling gives every fragment (the first one too) UDP ports 0, so a door matching
``udp_dst`` never saw a fragmented request: its fragments went to memcached's host by NORMAL while the same
client's small requests went through a helper.  The door's fragment twin (``Door.fragment_door``) classifies
them by the client's address.  Same topology as tests/unit/test_frontdoor.py, plus two helpers.
"""

from __future__ import annotations

import struct

from vfab.controller import ofmsg
from vfab.fabric.compiler import compile_fabric
from vfab.fabric.flows import FRAG_ANY, FRAG_LATER, FlowSpec, Kind, match
from vfab.fabric.state import FabricState
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec
from vfab.vid.registry import schema

from tests.unit.test_frontdoor import CLIENTS, IPV4, OWNERS, RANGES, S1, S2, SID, SVC_IP, TRUNK, UDP, make_items

DOOR = {"kind": "udp", "ip": "10.0.0.100", "port": 11211}
HELPERS = {"h1": (0x02EE000000A1, S1, 50), "h2": (0x02EE000000A2, S2, 50)}
C4_IP, C20_IP = 0x0A010004, 0x0A020014   # registered addresses of c4 (on s1) and c20 (on s2)


def fabric(helpers: bool = True, doors=(DOOR,)) -> tuple[FabricState, FakeFabric]:
    items = make_items(doors=list(doors))
    for name, ip in (("c4", C4_IP), ("c20", C20_IP)):
        mac, dpid, port = CLIENTS[name]
        items[schema.host_key(codec.int_to_mac(mac))] = schema.Host(
            mac=codec.int_to_mac(mac), dpid=dpid, port=port, name=name,
            ips=[f"{ip >> 24}.{ip >> 16 & 255}.{ip >> 8 & 255}.{ip & 255}"]).to_json().encode()
    if helpers:
        for name, (mac, dpid, port) in HELPERS.items():
            m = codec.int_to_mac(mac)
            items[schema.host_key(m)] = schema.Host(mac=m, dpid=dpid, port=port, name=name).to_json().encode()
            items[schema.endpoint_key("dhcp", name)] = schema.Endpoint(service="dhcp", name=name, mac=m,
                                                                       rx="ovs").to_json().encode()
        for e, (lo, hi, owner) in enumerate(RANGES):
            items[schema.range_key("dhcp", lo)] = schema.RangeRec(lo=lo, hi=hi, owner=owner, epoch=e + 1,
                                                                  helpers=list(HELPERS)).to_json().encode()
    st = FabricState.from_items(items)
    return st, FakeFabric(compile_fabric(st), TRUNK)


def send(fab: FakeFabric, client: str, src_ip: int, frag: int | None = None, dst_ip: int = SVC_IP, **more):
    """A client's UDP datagram to the door (frag None), or one of its fragments (ports zeroed, as OVS has them)."""
    mac, dpid, port = CLIENTS[client]
    pkt = dict(ip_proto=UDP, ipv4_src=src_ip, ipv4_dst=dst_ip, **more)
    if frag is None:
        pkt.update(udp_src=40000, udp_dst=11211)
    else:
        pkt["ip_frag"] = frag
    return fab.inject(dpid, port, mac, 0x02AB00000001, IPV4, **pkt)


FIRST, LATER = FRAG_ANY, FRAG_ANY | FRAG_LATER


def test_every_fragment_of_a_request_goes_where_the_clients_small_requests_go():
    st, fab = fabric()
    assert st.problems == []
    for client, ip in (("c4", C4_IP), ("c20", C20_IP)):
        whole = send(fab, client, ip)
        assert len(whole) == 1 and whole[0][2] in {m for m, _, _ in HELPERS.values()}   # one helper
        assert send(fab, client, ip, FIRST) == whole
        assert send(fab, client, ip, LATER) == whole
    # without helpers: the range's owner, as the whole datagram
    _, fab = fabric(helpers=False)
    owner = next(o for lo, hi, o in RANGES if lo <= C4_IP & 0xFFFFFF <= hi)
    want = [(OWNERS[owner][1], OWNERS[owner][2], OWNERS[owner][0])]
    assert send(fab, "c4", C4_IP) == want == send(fab, "c4", C4_IP, FIRST) == send(fab, "c4", C4_IP, LATER)


def test_fragments_from_an_address_the_host_does_not_own_are_dropped_like_its_datagrams():
    """The reflection guard holds for fragments: else a 60 KB multi-get from a forged source, in fragments,
    had its replies sent to that source."""
    _, fab = fabric()
    for frag in (None, FIRST, LATER):
        assert send(fab, "c4", C20_IP, frag) == []
    assert fab.drop_count(Kind.SPOOF) == 3 and fab.drop_count() == 3


def test_fragments_to_another_address_and_from_the_services_own_hosts_are_left_alone():
    """Only fragments to the door's address are taken; a helper's relay (its kernel fragments a large
    request) reaches memcached past the door, as its whole datagrams do."""
    _, fab = fabric()
    assert send(fab, "c4", C4_IP, LATER, dst_ip=SVC_IP + 1) == [(S1, "NORMAL", 0x02AB00000001)]
    mac, dpid, port = HELPERS["h1"]
    got = fab.inject(dpid, port, mac, 0x02AB00000001, IPV4, ip_proto=UDP, ipv4_src=0x0A0000A1, ipv4_dst=SVC_IP,
                     ip_frag=LATER)
    assert got == [(S1, "NORMAL", 0x02AB00000001)]


def test_answer_fragments_from_a_host_serving_nothing_are_dropped():
    _, fab = fabric()
    mac, dpid, port = CLIENTS["c7"]
    assert fab.inject(dpid, port, mac, CLIENTS["c4"][0], IPV4, ip_proto=UDP, ipv4_src=SVC_IP, ipv4_dst=C4_IP,
                      ip_frag=LATER) == []
    assert fab.drop_count(Kind.GUARD) == 1


def test_two_udp_doors_on_one_address_clash_over_their_fragments():
    st, _ = fabric(doors=(DOOR, {"kind": "udp", "ip": "10.0.0.100", "port": 11212}))
    assert any("already claimed" in p for p in st.problems)
    st, _ = fabric(doors=(DOOR, {"kind": "udp", "ip": "10.0.0.101", "port": 11211}))
    assert st.problems == []


def test_the_fragment_flows_on_the_wire():
    """ip_frag is NXM_NX_IP_FRAG (class 0x0001, field 26, one byte), masked; it parses back from a dump."""
    st, _ = fabric()
    cfg = compile_fabric(st)
    frag_flows = [f for c in cfg.values() for f in c.flows.values() if "ip_frag" in {n for n, _, _ in f.match}]
    assert {dict((n, (v, m)) for n, v, m in f.match)["ip_frag"] for f in frag_flows} == {(FRAG_ANY, FRAG_ANY)}
    kinds = {(f.priority, int(f.cookie >> 56)) for f in frag_flows}
    assert {k for _, k in kinds} >= {Kind.FRONTDOOR, Kind.SPOOF, Kind.GUARD}
    f = FlowSpec(0, 400, match(eth_type=IPV4, ip_proto=UDP, ipv4_dst=SVC_IP, ip_frag=(1, 1)), (("goto", 1),), 5)
    body = ofmsg.encode_match(f.match)
    assert struct.pack("!IBB", 0x00013502, 1, 1) in body
    m, end = ofmsg.decode_match(body, 0)
    assert m == f.match and end == len(body)
    entry = struct.pack("!HBxIIHHHHH2xQQQ", 48 + len(body) + 8, 0, 1, 2, 400, 0, 0, 0, 0, 5, 7, 700) + body \
        + ofmsg.encode_instructions((("goto", 1),))
    assert list(ofmsg.parse_flow_stats(entry)) == [(f, 7, 700)]


def test_a_door_without_fragments_is_unchanged():
    _, fab = fabric(doors=({"kind": "dhcp4"},))
    mac, dpid, port = CLIENTS["c4"]
    assert fab.inject(dpid, port, mac, 0x02AB00000001, IPV4, ip_proto=UDP, ipv4_src=C4_IP, ipv4_dst=SVC_IP,
                      ip_frag=LATER) == [(S1, "NORMAL", 0x02AB00000001)]
    assert SID and S2
