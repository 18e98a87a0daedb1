"""controller/ofmsg.py: the bytes it builds parse back, with os-ken's own parser, into the same specs.

And its fast flow-stats parser reads both its own encoding and os-ken's back
into the spec that was installed, so the diff against a switch dump never churns.
"""

from __future__ import annotations

import random
import struct

import pytest
from os_ken.ofproto import ofproto_parser, ofproto_v1_4 as ofp, ofproto_v1_4_parser as osk

from tests.unit.test_frontdoor import make_items as door_items
from vfab.controller import ofmsg
from vfab.fabric.compiler import compile_fabric
from vfab.fabric.flows import Bucket, FlowSpec, GroupSpec, match, move
from vfab.fabric.state import FabricState
from vfab.vid.registry import schema


def compiled_specs() -> tuple[list[FlowSpec], list[GroupSpec]]:
    """Every flow and group the compiler emits for a fabric with front doors, mirrors and helpers."""
    flows, groups = [], []
    for policy in ("drop", "controller", "flood"):
        items = door_items(doors=[{"kind": "dhcp4"}, {"kind": "udp", "ip": "10.0.0.9", "port": 9}],
                           layout="suffix" if policy == "flood" else "prefix",
                           ranges=[(0, 0x3FFFFF, "e1"), (0x400000, 0x9FFFFF, "e2"), (0xA00000, 0xFFFFFF, "e3")])
        items[schema.MISS_KEY] = policy.encode()
        # A mirrored range (group all) and a helped one (group select).
        items[schema.range_key("dhcp", 0)] = schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", mirrors=["e3"],
                                                             epoch=3).to_json().encode()
        items[schema.range_key("dhcp", 0xA00000)] = schema.RangeRec(lo=0xA00000, hi=0xFFFFFF, owner="e3",
                                                                    helpers=["e2", "e3"], epoch=4).to_json().encode()
        st = FabricState.from_items(items)
        for cfg in compile_fabric(st).values():
            flows += cfg.flows.values()
            groups += cfg.groups.values()
        assert st.problems == []
    return flows, groups


FLOWS, GROUPS = compiled_specs()
EXTRA = [  # actions and fields the compiler does not emit today
    FlowSpec(0, 7, match(ipv4_src=(0x0A000000, 0xFF000000), ipv4_dst=0x0A000001, eth_type=0x0800, ip_proto=17,
                         udp_src=5, udp_dst=(0x100, 0xFF00)),
             (("flood",), ("normal",), ("group", 9), move("ipv4_dst", 8, "eth_src", 0, 24), ("goto", 3)), 1 << 63),
    FlowSpec(254, 0xFFFF, match(), (), (1 << 64) - 1),
]


def osk_parse(data: bytes):
    version, msg_type, length, xid = ofproto_parser.header(data)
    assert length == len(data)
    return ofproto_parser.msg(None, version, msg_type, length, xid, bytearray(data))


def stats_entry(f: FlowSpec, tail: bytes, packets: int = 0, nbytes: int = 0) -> bytes:
    """An ofp_flow_stats entry as a switch would send it, around a flow mod's match + instructions."""
    return struct.pack("!HBxIIHHHHH2xQQQ", 48 + len(tail), f.table, 1, 2, f.priority, 0, 0, 0, 0, f.cookie,
                       packets, nbytes) + tail


def test_compiled_specs_cover_everything():
    ops = {a[0] for f in FLOWS for a in f.actions}
    assert len(FLOWS) > 500
    assert ops == {"output", "set_eth_dst", "group", "goto", "move", "normal", "controller", "flood"}
    fields = {name for f in FLOWS for name, _, _ in f.match}
    assert fields == {"in_port", "eth_src", "eth_dst", "eth_type", "ip_proto", "udp_dst", "ipv4_dst", "udp_src",
                      "ipv4_src", "ip_frag"}
    assert {g.type for g in GROUPS} == {"all", "select"}


def test_flow_add_parses_back_with_os_ken_into_the_same_spec():
    for f in FLOWS + EXTRA:
        data = ofmsg.flow_add(f, xid=77)
        msg = osk_parse(data)
        assert isinstance(msg, osk.OFPFlowMod) and msg.xid == 77 and msg.command == ofp.OFPFC_ADD
        assert msg.buffer_id == ofp.OFP_NO_BUFFER and msg.out_port == ofp.OFPP_ANY
        assert ofmsg.flow_from_stats(msg) == f, f
        # As a flow-stats entry: both parsers read the spec back; counters too.
        entry = stats_entry(f, data[48:], packets=5, nbytes=600)
        assert list(ofmsg.parse_flow_stats(entry)) == [(f, 5, 600)], f
        assert list(ofmsg.parse_flow_counters(entry)) == [(f.table, f.cookie, 5, 600)]
        assert ofmsg.flow_from_stats(osk.OFPFlowStats.parser(entry, 0)) == f, f


def test_os_ken_encoding_parses_into_the_same_spec_too():
    """What os-ken's generic classes would have sent reads back identically (old switches, old dumps)."""
    from vfab.vid.codec import int_to_mac

    for f in FLOWS[:200]:
        kwargs = {n: ((int_to_mac(v), int_to_mac(m)) if m is not None else int_to_mac(v))
                  if n.startswith("eth_") and n != "eth_type" else ((v, m) if m is not None else v)
                  for n, v, m in f.match}
        if "ipv4_dst" in kwargs:
            kwargs["ipv4_dst"] = ".".join(str(b) for b in kwargs["ipv4_dst"].to_bytes(4, "big"))
        acts, inst = [], []
        for a in f.actions:
            if a[0] == "output":
                acts.append(osk.OFPActionOutput(a[1]))
            elif a[0] == "set_eth_dst":
                acts.append(osk.OFPActionSetField(eth_dst=int_to_mac(a[1])))
            elif a[0] == "group":
                acts.append(osk.OFPActionGroup(a[1]))
            elif a[0] in ("normal", "flood", "controller"):
                acts.append(osk.OFPActionOutput({"normal": ofp.OFPP_NORMAL, "flood": ofp.OFPP_FLOOD,
                                                 "controller": ofp.OFPP_CONTROLLER}[a[0]], ofp.OFPCML_NO_BUFFER))
            elif a[0] == "move":
                acts.append(osk.NXActionRegMove(src_field=a[1], src_ofs=a[2], dst_field=a[3], dst_ofs=a[4],
                                                n_bits=a[5]))
            elif a[0] == "goto":
                inst.append(osk.OFPInstructionGotoTable(a[1]))
        if acts:
            inst.insert(0, osk.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, acts))
        msg = osk.OFPFlowMod(_Dp(), cookie=f.cookie, table_id=f.table, priority=f.priority,
                             match=osk.OFPMatch(**kwargs), instructions=inst)
        msg.serialize()
        (got, _, _), = ofmsg.parse_flow_stats(stats_entry(f, bytes(msg.buf[48:])))
        assert got == f


class _Dp:
    ofproto, ofproto_parser, id = ofp, osk, 1


def test_deletes_parse_back():
    f = next(f for f in FLOWS if f.priority == 400)
    msg = osk_parse(ofmsg.flow_delete_strict(f, xid=3))
    assert msg.command == ofp.OFPFC_DELETE_STRICT and msg.instructions == []
    assert (msg.table_id, msg.priority, msg.cookie_mask) == (f.table, f.priority, 0)
    assert ofmsg.flow_from_stats(msg).match == f.match
    msg = osk_parse(ofmsg.flow_delete_cookie(0x0500150000000000, 0xFFFFFF << 40, xid=4))
    assert (msg.command, msg.table_id, msg.cookie, msg.cookie_mask) == \
        (ofp.OFPFC_DELETE, ofp.OFPTT_ALL, 0x0500150000000000, 0xFFFFFF << 40)
    assert msg.out_port == ofp.OFPP_ANY and msg.out_group == ofp.OFPG_ANY and not dict(msg.match.items())


def test_group_mods_parse_back():
    for g in GROUPS:
        for command, code in (("add", ofp.OFPGC_ADD), ("modify", ofp.OFPGC_MODIFY)):
            msg = osk_parse(ofmsg.group_mod(g, command, xid=8))
            assert msg.command == code and ofmsg.group_from_desc(msg) == g
        msg = osk_parse(ofmsg.group_mod(None, "delete", xid=9, group_id=g.group_id))
        assert (msg.command, msg.group_id, msg.buckets) == (ofp.OFPGC_DELETE, g.group_id, [])


def test_bundle_messages():
    msg = osk_parse(ofmsg.bundle_ctrl(12, ofp.OFPBCT_COMMIT_REQUEST, 3, xid=41))
    assert (msg.bundle_id, msg.type, msg.flags, msg.xid) == (12, ofp.OFPBCT_COMMIT_REQUEST, 3, 41)
    flows = FLOWS[:50]
    fast = list(ofmsg.bundled_adds(12, 3, flows, 100))
    assert fast == [ofmsg.bundle_add(12, 3, ofmsg.flow_add(f), 100 + i) for i, f in enumerate(flows)]
    for i, (f, data) in enumerate(zip(flows, fast)):
        version, mtype, length, xid = ofmsg.HEADER.unpack_from(data)
        bid, flags = struct.unpack_from("!IxxH", data, 8)
        assert (version, mtype, length, xid, bid, flags) == (5, ofp.OFPT_BUNDLE_ADD_MESSAGE, len(data), 100 + i, 12, 3)
        inner = osk_parse(data[16:])
        assert inner.xid == xid and ofmsg.flow_from_stats(inner) == f   # inner xid = outer xid (OF 1.4 §7.3.9.2)
    # xids wrap at 2^32 - 1.
    assert [ofmsg.HEADER.unpack_from(d)[3] for d in ofmsg.bundled_adds(1, 3, flows[:3], 0xFFFFFFFF)] == [0xFFFFFFFF, 0, 1]


def test_requests_match_os_ken_serialization():
    dp = _Dp()
    req = osk.OFPFlowStatsRequest(dp, 0, 1, ofp.OFPP_ANY, ofp.OFPG_ANY, 5 << 56, 0xFF << 56, osk.OFPMatch())
    req.set_xid(7)
    req.serialize()
    assert ofmsg.flow_stats_request(7, 1, 5 << 56, 0xFF << 56) == bytes(req.buf)
    req = osk.OFPGroupDescStatsRequest(dp, 0)
    req.set_xid(8)
    req.serialize()
    assert ofmsg.group_desc_request(8) == bytes(req.buf)


def test_foreign_flows_keep_their_match_bytes_for_an_exact_delete():
    # vlan_vid (OXM field 6) is no field of ours: the match comes back raw, and deletes byte for byte.
    oxm = struct.pack("!IH", 0x80000C02, 0x1064) + struct.pack("!I", 0x80000004) + struct.pack("!I", 3)
    tail = struct.pack("!HH", 1, 4 + len(oxm)) + oxm + b"\0" * (-(4 + len(oxm)) % 8)
    f0 = FlowSpec(1, 5, (), (), 0x99)
    (f, _, _), = ofmsg.parse_flow_stats(stats_entry(f0, tail + struct.pack("!HHB3x", 1, 8, 2)))
    assert f.match == ((ofmsg.RAW, oxm, None),) and f.actions == (("goto", 2),)
    assert ofmsg.flow_delete_strict(f)[48:] == tail
    # Unknown actions are kept as such (so the diff replaces the flow).
    odd = struct.pack("!HH4x", 4, 16) + struct.pack("!HHI", 11, 8, 0)   # apply-actions [OFPAT_DEC_MPLS_TTL...]
    (f, _, _), = ofmsg.parse_flow_stats(stats_entry(f0, struct.pack("!HH4x", 1, 4) + odd))
    assert f.actions[0][0] == "unknown"


def test_malformed_stats_never_crash_or_hang():
    rng = random.Random(3)
    good = b"".join(stats_entry(f, ofmsg.flow_add(f)[48:]) for f in FLOWS[:40])
    assert len(list(ofmsg.parse_flow_stats(good))) == 40
    for _ in range(3000):
        data = bytearray(good[:rng.randrange(len(good))] if rng.random() < 0.3 else good)
        for _ in range(rng.randrange(1, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            for f, _, _ in ofmsg.parse_flow_stats(bytes(data)):
                assert isinstance(f, FlowSpec)
        except ofmsg.WireError:
            pass
        try:
            list(ofmsg.parse_flow_counters(bytes(data)))
        except ofmsg.WireError:
            pass


def test_unknown_action_is_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="cannot be encoded"):
        ofmsg.flow_add(FlowSpec(0, 1, match(), (("teleport", 1),)))
    with pytest.raises(ValueError, match="cannot be encoded"):
        list(ofmsg.bundled_adds(1, 3, [FlowSpec(0, 1, match(), (("unknown", 5),))], 1))


def test_bucket_weights_only_for_select():
    g = GroupSpec(4, "all", (Bucket(1, (("output", 1),)), Bucket(1, (("output", 2),))))
    msg = osk_parse(ofmsg.group_mod(g, "add"))
    assert [b.weight for b in msg.buckets] == [0, 0] and ofmsg.group_from_desc(msg) == g


# -- ofconn: bundles over a fake datapath (no switch) -------------------------------------------------
class FakeDp:
    """Captures what the controller writes; answers a bundle commit (or fails one message) like OVS."""

    def __init__(self, fail_xid_offset: int | None = None):
        self.id, self.xid, self.sent, self.conn = 0xFA01, 0xFFFFFFF0, [], None
        self.fail = fail_xid_offset

    def send(self, data: bytes) -> bool:
        from os_ken.lib import hub

        self.sent.append(data)
        msgs = list(split_msgs(b"".join(self.sent)))
        last = msgs[-1]
        if last[1] == ofp.OFPT_BUNDLE_CONTROL and struct.unpack_from("!H", last, 12)[0] == ofp.OFPBCT_COMMIT_REQUEST:
            xid = ofmsg.HEADER.unpack_from(last)[3]
            if self.fail is not None:
                bad = ofmsg.HEADER.unpack_from(msgs[self.fail])[3]
                hub.spawn(self.conn.on_reply, bad, (), False, "OpenFlow error type=1 code=8")
                hub.spawn(self.conn.on_reply, xid, (), False, "OpenFlow error type=17 code=13")
            else:
                hub.spawn(self.conn.on_reply, xid)
        return True


def split_msgs(data: bytes):
    off = 0
    while off < len(data):
        length = ofmsg.HEADER.unpack_from(data, off)[2]
        yield data[off:off + length]
        off += length


def test_a_plan_is_one_bundle_with_consecutive_xids():
    from vfab.controller.ofconn import OFConn
    from vfab.controller.reconcile import Plan

    dp = FakeDp()
    conn = dp.conn = OFConn(dp, timeout=5)
    g = GROUPS[0]
    adds = (FLOWS * 5)[:3000]
    plan = Plan(add_groups=[g], add_flows=adds, del_flows=FLOWS[:2],
                del_cookies={(0x0500000000000000, 0xFF << 56): 7}, del_groups=[99])
    assert conn.commit(plan) == 3000 + 2 + 1 + 1 + 1
    assert len(dp.sent) > 1  # several writes of many messages each, not one per message
    msgs = list(split_msgs(b"".join(dp.sent)))
    xids = [ofmsg.HEADER.unpack_from(m)[3] for m in msgs]
    assert xids == [(0xFFFFFFF1 + i) & 0xFFFFFFFF for i in range(len(msgs))] or xids == list(range(1, len(msgs) + 1))
    kinds = [m[1] for m in msgs]
    assert kinds[0] == kinds[-1] == ofp.OFPT_BUNDLE_CONTROL and set(kinds[1:-1]) == {ofp.OFPT_BUNDLE_ADD_MESSAGE}
    inner = [osk_parse(m[16:]) for m in msgs[1:-1]]
    # Order: groups, cookie deletes, strict deletes, adds, group deletes.
    assert isinstance(inner[0], osk.OFPGroupMod) and inner[0].command == ofp.OFPGC_ADD
    assert inner[1].command == ofp.OFPFC_DELETE and inner[1].cookie_mask == 0xFF << 56
    assert [m.command for m in inner[2:4]] == [ofp.OFPFC_DELETE_STRICT] * 2
    assert [ofmsg.flow_from_stats(m) for m in inner[4:-1]] == adds
    assert inner[-1].command == ofp.OFPGC_DELETE and inner[-1].group_id == 99
    assert conn._pending == []


def test_a_refused_message_fails_the_bundle_and_late_errors_are_expected():
    from vfab.controller.ofconn import OFConn, OpError
    from vfab.controller.reconcile import Plan

    dp = FakeDp(fail_xid_offset=5)
    conn = dp.conn = OFConn(dp, timeout=5)
    with pytest.raises(OpError, match="type=1 code=8"):
        conn.commit(Plan(add_flows=FLOWS[:10]))
    from os_ken.lib import hub

    hub.sleep(0)  # the commit error arrives after the first one: known, not "unsolicited"
    first = ofmsg.HEADER.unpack_from(dp.sent[0])[3]
    assert conn.on_reply(first + 11, (), False, "late") is True
    assert conn.on_reply(first + 500, (), False, "other") is False


def test_no_reply_times_out():
    from vfab.controller.ofconn import OFConn, OpError
    from vfab.controller.reconcile import Plan

    class Silent(FakeDp):
        def send(self, data):
            self.sent.append(data)
            return True

    dp = Silent()
    conn = OFConn(dp, timeout=0.2)
    with pytest.raises(OpError, match="no reply to bundle"):
        conn.commit(Plan(add_flows=FLOWS[:2]))
    # A message that cannot be encoded: the bundle is discarded before anything is committed.
    with pytest.raises(OpError, match="not sent"):
        conn.commit(Plan(add_flows=[FlowSpec(0, 1, match(), (("teleport",),))]))
    assert struct.unpack_from("!H", dp.sent[-1], 12)[0] == ofp.OFPBCT_DISCARD_REQUEST


def test_raw_flow_stats_replies(monkeypatch):
    from vfab.controller import ofconn

    monkeypatch.setitem(osk.OFPMultipartReply._STATS_MSG_TYPES, ofp.OFPMP_FLOW,
                        osk.OFPMultipartReply._STATS_MSG_TYPES[ofp.OFPMP_FLOW])
    ofconn.install_raw_flow_stats()
    ofconn.install_raw_flow_stats()  # idempotent
    entries = b"".join(stats_entry(f, ofmsg.flow_add(f)[48:], 3, 4) for f in FLOWS[:20])
    for body in (entries, b""):  # an empty reply too (no flow of the asked kind)
        data = ofmsg.header(ofp.OFPT_MULTIPART_REPLY, 16 + len(body), 5) + struct.pack("!HH4x", 1, 1) + body
        msg = osk_parse(data)
        assert type(msg).__name__ == "OFPFlowStatsReply" and msg.flags == 1
        parts = msg.body
        got = [f for p in parts for f, _, _ in ofmsg.parse_flow_stats(p.buf, p.offset, p.offset + p.length)]
        assert got == (FLOWS[:20] if body else [])
