"""The tunnel plan between fabric nodes (vfab.fabric.tunnels) and the node record (schema.Node)."""

from __future__ import annotations

import pytest

from vfab.fabric import tunnels
from vfab.vid.errors import RegistryError, VidError
from vfab.vid.registry import schema


def node(name: str, ip: str, **kw) -> schema.Node:
    return schema.Node(name=name, tunnel_ip=ip, dpid=0xFB00, bridge="br-vfab", encap="geneve",
                       key=tunnels.FABRIC_VNI, **kw)


def test_port_names_fit_a_device_name_and_name_the_address():
    assert tunnels.port_name("172.16.45.3") == "vftac102d03"
    assert len(tunnels.port_name("255.255.255.254")) <= 15
    assert tunnels.port_name("10.0.0.1") != tunnels.port_name("10.0.0.2")


def test_wanted_is_one_port_per_other_node():
    me = node("a", "10.1.0.1")
    view = {n.name: n for n in (me, node("b", "10.1.0.2"), node("c", "10.1.0.3"))}
    want = tunnels.wanted(me, view)
    assert sorted(t.peer for t in want.values()) == ["b", "c"]
    t = want[tunnels.port_name("10.1.0.2")]
    assert (t.remote_ip, t.local_ip, t.encap, t.key) == ("10.1.0.2", "10.1.0.1", "geneve", tunnels.FABRIC_VNI)


def test_nodes_that_cannot_tunnel_to_us_are_left_out():
    me = node("a", "10.1.0.1")
    vx = schema.Node(name="v", tunnel_ip="10.1.0.9", dpid=1, bridge="b", encap="vxlan", key=tunnels.FABRIC_VNI)
    other_key = schema.Node(name="k", tunnel_ip="10.1.0.8", dpid=1, bridge="b", key=7)
    same_ip = node("twin", "10.1.0.1")
    want = tunnels.wanted(me, {n.name: n for n in (me, vx, other_key, same_ip)})
    assert want == {}
    assert "vxlan" in tunnels.mismatched(me, vx) and "key 7" in tunnels.mismatched(me, other_key)
    assert tunnels.mismatched(me, node("b", "10.1.0.2")) == ""


def test_plan_adds_removes_and_replaces_changed_ports():
    me = node("a", "10.1.0.1")
    want = tunnels.wanted(me, {"b": node("b", "10.1.0.2"), "c": node("c", "10.1.0.3")})
    assert tunnels.plan(want, want) == ([], [])
    add, remove = tunnels.plan(want, {})
    assert [t.peer for t in add] == ["b", "c"] and remove == []
    stale = tunnels.Tunnel(tunnels.port_name("10.1.0.4"), "d", "10.1.0.4", "10.1.0.1")
    moved = tunnels.Tunnel(tunnels.port_name("10.1.0.2"), "b", "10.1.0.2", "10.1.0.99")   # our address changed
    have = {stale.name: stale, moved.name: moved}
    add, remove = tunnels.plan(want, have)
    assert sorted(t.peer for t in add) == ["b", "c"]
    assert sorted(remove) == sorted([stale.name, moved.name])


def test_filter_admits_only_registered_peers_and_drops_the_rest():
    flows = tunnels.filter_flows("10.1.0.1", ["10.1.0.3", "10.1.0.2", "10.1.0.3"])
    assert len(flows) == 3                                     # one per peer (deduplicated) + the drop
    assert flows[0].startswith(f"cookie={tunnels.COOKIE_ALLOW:#x},priority=200,udp,nw_src=10.1.0.2,")
    assert "nw_src=10.1.0.3,nw_dst=10.1.0.1,tp_dst=6081,actions=NORMAL" in flows[1]
    assert flows[2] == f"cookie={tunnels.COOKIE_DROP:#x},priority=190,udp,nw_dst=10.1.0.1,tp_dst=6081,actions=drop"
    assert tunnels.filter_flows("10.1.0.1", [], "vxlan") == [
        f"cookie={tunnels.COOKIE_DROP:#x},priority=190,udp,nw_dst=10.1.0.1,tp_dst=4789,actions=drop"]
    # both cookies fall under the mask the filter is replaced by, the controller's cookies (kind in the top
    # byte, 0x01.. upwards) never do
    for c in (tunnels.COOKIE_ALLOW, tunnels.COOKIE_DROP):
        assert c & tunnels.COOKIE_MASK == tunnels.COOKIE_ALLOW & tunnels.COOKIE_MASK


def test_node_record_round_trips_and_rejects_bad_fields():
    n = node("h1", "172.16.45.1", ports={"p1": 1}, peers=["h2"], refused=3)
    assert schema.Node.from_json(n.to_json()) == n
    with pytest.raises(VidError, match="not an IPv4 address"):
        node("h1", "172.16.45")
    with pytest.raises(VidError, match="cannot carry tunnels"):
        node("h1", "127.0.0.1")
    with pytest.raises(VidError, match="cannot carry tunnels"):
        node("h1", "224.0.0.5")
    with pytest.raises(VidError, match="encapsulation 'gre' is unknown"):
        schema.Node(name="h1", tunnel_ip="10.0.0.1", dpid=1, bridge="b", encap="gre")
    with pytest.raises(VidError, match="tunnel key 16777216 is out of range"):
        schema.Node(name="h1", tunnel_ip="10.0.0.1", dpid=1, bridge="b", key=1 << 24)
    with pytest.raises(VidError, match="node name"):
        node("Bad Name", "10.0.0.1")
    with pytest.raises(RegistryError, match="unknown fields"):
        schema.Node.from_json('{"name": "h1", "tunnel_ip": "10.0.0.1", "dpid": 1, "bridge": "b", "x": 1}')
    assert schema.node_key("h1") == "/vfab/v1/nodes/h1"
    assert schema.node_ip_key("010.0.0.1".lstrip("0")) == "/vfab/v1/node-ips/10.0.0.1"
    assert "nodes" in schema.PASSIVE and "node-ips" in schema.PASSIVE   # the controller never recompiles on them
