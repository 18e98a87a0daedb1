"""testbed/fakeoftable.py: the fake pipeline itself behaves like OpenFlow."""

from __future__ import annotations

import pytest

from vfab.fabric.flows import Bucket, FlowSpec, GroupSpec, Kind, SwitchConfig, make_cookie, match, move
from vfab.testbed.fakeoftable import FakeFabric, FakeTableError

A, B = 0x020000000001, 0x020000000002
VID = 0x0E0001000005


def cfg(dpid, *flows, groups=()):
    c = SwitchConfig(dpid)
    for f in flows:
        c.add(f)
    c.groups = {g.group_id: g for g in groups}
    return c


def goto1(prio=0, **m):
    return FlowSpec(0, prio, match(**m), (("goto", 1),))


def test_highest_priority_wins_and_masks_apply():
    sw = cfg(1, goto1(),
             FlowSpec(1, 10, match(eth_dst=(0x0E0000000000, 0x0F0000000000)), (("output", 5),)),
             FlowSpec(1, 20, match(eth_dst=(VID, 0xFFFFFFFFFFF0)), (("set_eth_dst", B), ("output", 6))),
             FlowSpec(1, 0, match(), (("normal",),)))
    fab = FakeFabric({1: sw})
    assert fab.inject(1, 1, A, VID, 0x88B5) == [(1, 6, B)]
    assert fab.inject(1, 1, A, VID + 0x10, 0x88B5) == [(1, 5, VID + 0x10)]
    assert fab.inject(1, 1, A, B, 0x0800) == [(1, "NORMAL", B)]
    assert [t for _, t, _ in fab.trace] == [0, 1]


def test_drops_are_counted_per_flow_and_misses_per_table():
    deny = FlowSpec(0, 200, match(in_port=3), (), make_cookie(Kind.DENY, lo=3))
    fab = FakeFabric({1: cfg(1, deny)})
    assert fab.inject(1, 3, A, B, 0x0800) == []
    assert fab.inject(1, 4, A, B, 0x0800) == []  # no flow at all in table 0
    assert fab.drops[(1, deny.key)] == 1 and fab.drops[(1, (0, None, None))] == 1
    assert fab.drop_count(Kind.DENY) == 1 and fab.drop_count() == 2
    assert fab.packets[(1, deny.key)] == 1


def test_trunks_groups_and_in_port():
    s1 = cfg(1, goto1(), FlowSpec(1, 5, match(eth_dst=VID), (("group", 1),)),
             groups=[GroupSpec(1, "all", (Bucket(1, (("output", 2),)), Bucket(1, (("output", 9),)))),])
    s2 = cfg(2, goto1(), FlowSpec(1, 5, match(eth_dst=VID), (("set_eth_dst", B), ("output", 3), ("output", 8))))
    fab = FakeFabric({1: s1, 2: s2}, [(1, 9, 2, 8), (2, 8, 1, 9)])
    # s1 floods to port 2 and over the trunk; s2 never sends back out of in_port 8.
    assert sorted(fab.inject(1, 1, A, VID, 0x88B5)) == [(1, 2, VID), (2, 3, B)]
    # Entering on port 2 of s1: the "all" bucket to port 2 is suppressed.
    assert fab.inject(1, 2, A, VID, 0x88B5) == [(2, 3, B)]


def test_select_group_is_one_weighted_bucket_by_source():
    g = GroupSpec(1, "select", (Bucket(3, (("output", 2),)), Bucket(1, (("output", 3),)),
                                Bucket(0, (("output", 4),))))
    fab = FakeFabric({1: cfg(1, goto1(), FlowSpec(1, 5, match(eth_dst=VID), (("group", 1),)), groups=[g])})
    ports = [fab.inject(1, 1, A + i, VID, 0x88B5) for i in range(400)]
    assert all(len(p) == 1 for p in ports)
    counts = {port: sum(1 for p in ports if p[0][1] == port) for port in (2, 3, 4)}
    assert counts[4] == 0 and counts[2] > 2 * counts[3] > 0
    assert fab.inject(1, 1, A, VID, 0x88B5) == fab.inject(1, 1, A, VID, 0x88B5)  # stable per source


def test_pipeline_errors_are_reported():
    amb = cfg(1, goto1(), FlowSpec(1, 5, match(eth_dst=VID), (("output", 1),)),
              FlowSpec(1, 5, match(eth_src=A), (("output", 2),)))
    with pytest.raises(FakeTableError, match="both match"):
        FakeFabric({1: amb}).inject(1, 9, A, VID, 0x88B5)
    assert FakeFabric({1: amb}, strict=False).inject(1, 9, A, VID, 0x88B5) in ([(1, 1, VID)], [(1, 2, VID)])
    with pytest.raises(FakeTableError, match="missing group 7"):
        FakeFabric({1: cfg(1, goto1(), FlowSpec(1, 0, match(), (("group", 7),)))}).inject(1, 1, A, B, 0)
    back = cfg(1, FlowSpec(0, 0, match(), (("goto", 0),)))
    with pytest.raises(FakeTableError, match="backwards"):
        FakeFabric({1: back}).inject(1, 1, A, B, 0)
    # Two parallel trunks and flood-like flows: a broadcast storm.
    loop = {1: cfg(1, FlowSpec(0, 0, match(), (("output", 2), ("output", 3)))),
            2: cfg(2, FlowSpec(0, 0, match(), (("output", 1), ("output", 4))))}
    links = [(1, 2, 2, 1), (2, 1, 1, 2), (1, 3, 2, 4), (2, 4, 1, 3)]
    with pytest.raises(FakeTableError, match="forwarding loop"):
        FakeFabric(loop, links).inject(1, 5, A, B, 0)


def test_move_copies_bits_between_fields():
    rewrite = FlowSpec(0, 400, match(eth_type=0x0800, ip_proto=17, udp_dst=67),
                       (("set_eth_dst", 0x0E0007000000), move("eth_src", 0, "eth_dst", 0, 24), ("goto", 1)))
    to_ip = FlowSpec(0, 300, match(eth_type=0x0800, udp_dst=53),
                     (("set_eth_dst", 0x0E0000000000), move("ipv4_src", 0, "eth_dst", 16, 24), ("goto", 1)))
    fab = FakeFabric({1: cfg(1, goto1(), rewrite, to_ip, FlowSpec(1, 0, match(), (("normal",),)))})
    assert fab.inject(1, 1, 0x02AABBCCDDEE, 0xFFFFFFFFFFFF, 0x0800, ip_proto=17, udp_dst=67) == \
        [(1, "NORMAL", 0x0E0007CCDDEE)]
    assert fab.inject(1, 1, A, B, 0x0800, ip_proto=17, udp_dst=53, ipv4_src=0x0A010203) == \
        [(1, "NORMAL", 0x0E0102030000)]
    # A field the packet lacks: the flow does not match (no udp_dst) ...
    assert fab.inject(1, 1, A, B, 0x0800) == [(1, "NORMAL", B)]
    # ... and a move from an absent field is a pipeline error.
    with pytest.raises(FakeTableError, match="without ipv4_src"):
        fab.inject(1, 1, A, B, 0x0800, udp_dst=53)
    with pytest.raises(ValueError, match="outside eth_dst"):
        move("eth_src", 0, "eth_dst", 40, 24)
    with pytest.raises(ValueError, match="not movable"):
        move("in_port", 0, "eth_dst", 0, 8)
