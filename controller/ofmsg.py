"""OpenFlow 1.4 wire format for the subset vfab uses, packed and parsed with ``struct``.

The only module that knows these layouts.  os-ken's generic classes cost
60-100 µs per flow (MACs go int → text → netaddr → bytes); here a bundled flow
is one ``struct`` pack plus cached match/instruction pieces.  Specs are the
switch-neutral ones of ``fabric/flows.py``; ``parse_flow_stats`` turns a dump
back into specs that compare equal to what was installed (no churn at audits).
``flow_from_stats``/``group_from_desc`` do the same from os-ken's parsed
objects (group replies, and the tests that check these bytes with os-ken's
own parser).

Every message starts with the OpenFlow header (8 bytes)::

    0        1        2                 4                                  8
    +--------+--------+-----------------+----------------------------------+
    | version| type   | length          | xid                              |
    +--------+--------+-----------------+----------------------------------+

    bundle add (34) : header | bundle_id u32 | pad 2 | flags u16 | inner message (same xid)
    bundle ctrl (33): header | bundle_id u32 | type u16 | flags u16
    flow mod (14)   : header | cookie u64 | cookie_mask u64 | table u8 | command u8 | idle u16 |
                      hard u16 | priority u16 | buffer_id u32 | out_port u32 | out_group u32 |
                      flags u16 | importance u16 | match | instructions          (48 + match + ...)
    group mod (15)  : header | command u16 | type u8 | pad | group_id u32 | buckets
                      bucket: len u16 | weight u16 | watch_port u32 | watch_group u32 | pad 4 | actions
    match           : type u16 = 1 (OXM) | length u16 (without padding) | OXM TLVs | pad to 8
                      OXM TLV: class u16 = 0x8000 | field u7 | hasmask u1 | len u8 | value [| mask]
    instructions    : apply-actions (4): type u16 | len u16 | pad 4 | actions
                      goto-table (1)   : type u16 | len u16 = 8 | table u8 | pad 3
    actions         : output (0)      : type | len = 16 | port u32 | max_len u16 | pad 6
                      group (22)      : type | len = 8 | group_id u32
                      set-field (25)  : type | len | OXM TLV | pad to 8
                      Nicira move     : type = 0xffff | len = 24 | vendor u32 = 0x2320 | subtype u16 = 6 |
                                        n_bits u16 | src_ofs u16 | dst_ofs u16 | src OXM hdr | dst OXM hdr
    flow stats entry (multipart reply type 1):
                      length u16 | table u8 | pad | duration s u32, ns u32 | priority u16 | idle u16 |
                      hard u16 | flags u16 | importance u16 | pad 2 | cookie u64 | packets u64 |
                      bytes u64 | match | instructions                          (48 + match + ...)
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Iterable, Iterator

from os_ken.ofproto import ofproto_v1_4 as ofp

from vfab.fabric.flows import FIELD_BITS, Bucket, FlowSpec, GroupSpec, match as make_match
from vfab.vid.codec import mac_to_int

VERSION = ofp.OFP_VERSION
HEADER = struct.Struct("!BBHI")
MIN_LEN = HEADER.size
NX_VENDOR = 0x00002320
NXAST_REG_MOVE = 6
NXAST_MULTIPATH = 10          # nx_action_multipath, 32 B; fields 0 = eth_src, algorithm 0 = modulo_n
MULTIPATH = struct.Struct("!HHIHHHHHHIHHI")
OXM_BASIC = ofp.OFPXMC_OPENFLOW_BASIC
MAX_XID = 0xFFFFFFFF

# name -> (OXM field number, value bytes)
OXM_FIELDS = {"in_port": (0, 4), "eth_dst": (3, 6), "eth_src": (4, 6), "eth_type": (5, 2), "ip_proto": (10, 1),
              "ipv4_src": (11, 4), "ipv4_dst": (12, 4), "udp_src": (15, 2), "udp_dst": (16, 2)}
OXM_FIELDS["ip_frag"] = (26, 1)   # NXM_NX_IP_FRAG, an NXM1 field: OVS takes it in OpenFlow 1.2+ matches
NXM1 = 0x0001
OXM_CLASS = {"ip_frag": NXM1}     # fields outside OpenFlow's basic class
assert set(OXM_FIELDS) == set(FIELD_BITS)
_OXM_NAME = {(OXM_BASIC, num): name for name, (num, _) in OXM_FIELDS.items()}
# OVS may name move operands by their older NXM headers: class 0, fields eth_dst 1, eth_src 2, ip_src 7, ip_dst 8.
_OXM_NAME.update({(0, 1): "eth_dst", (0, 2): "eth_src", (0, 7): "ipv4_src", (0, 8): "ipv4_dst"})
_OXM_NAME[NXM1, 26] = "ip_frag"
_OXM_NAME.pop((OXM_BASIC, 26), None)
RAW = "_raw"  # match of a foreign flow: its OXM bytes kept as they came, so it can be deleted exactly

_RESERVED_PORTS = {ofp.OFPP_NORMAL: ("normal",), ofp.OFPP_FLOOD: ("flood",),
                   ofp.OFPP_CONTROLLER: ("controller",), ofp.OFPP_IN_PORT: ("in_port",)}
_PORT_OF = {"normal": ofp.OFPP_NORMAL, "flood": ofp.OFPP_FLOOD, "controller": ofp.OFPP_CONTROLLER,
            "in_port": ofp.OFPP_IN_PORT}


class WireError(ValueError):
    """Bytes that do not parse as the OpenFlow 1.4 this module speaks."""


def _oxm_header(name: str, masked: bool) -> int:
    num, n = OXM_FIELDS[name]
    return OXM_CLASS.get(name, OXM_BASIC) << 16 | num << 9 | int(masked) << 8 | (2 * n if masked else n)


_OXM_HDR = {(name, masked): struct.pack("!I", _oxm_header(name, masked))
            for name in OXM_FIELDS for masked in (False, True)}


def _pad8(n: int) -> bytes:
    return b"\0" * (-n % 8)


# -- match -------------------------------------------------------------------------------
def encode_match(m: tuple) -> bytes:
    """ofp_match (OXM), padded to 8."""
    if m and m[0][0] == RAW:
        body = m[0][1]
    else:
        parts = []
        for name, value, mask in m:
            n = OXM_FIELDS[name][1]
            if mask is None:
                parts.append(_OXM_HDR[name, False] + value.to_bytes(n, "big"))
            else:
                parts.append(_OXM_HDR[name, True] + value.to_bytes(n, "big") + mask.to_bytes(n, "big"))
        body = b"".join(parts)
    length = 4 + len(body)
    return struct.pack("!HH", ofp.OFPMT_OXM, length) + body + _pad8(length)


def decode_match(buf, off: int) -> tuple[tuple, int]:
    """(canonical match, offset after the padded match)."""
    mtype, length = struct.unpack_from("!HH", buf, off)
    if mtype != ofp.OFPMT_OXM or length < 4:
        raise WireError(f"match type {mtype} length {length}: only OXM matches are understood")
    end = off + length
    pos = off + 4
    fields = []
    foreign = False
    while pos < end:
        (hdr,) = struct.unpack_from("!I", buf, pos)
        cls, num, hasmask, n = hdr >> 16, (hdr >> 9) & 0x7F, (hdr >> 8) & 1, hdr & 0xFF
        name = _OXM_NAME.get((cls, num)) if cls in (OXM_BASIC, NXM1) else None
        size = OXM_FIELDS[name][1] if name else 0
        if name is None or n != (2 * size if hasmask else size):
            foreign = True
        else:
            value = int.from_bytes(buf[pos + 4:pos + 4 + size], "big")
            mask = int.from_bytes(buf[pos + 4 + size:pos + 4 + n], "big") if hasmask else None
            full = (1 << FIELD_BITS[name]) - 1
            if mask == full:
                mask = None
            if mask != 0:
                fields.append((name, value if mask is None else value & mask, mask))
        pos += 4 + n
    if pos != end:
        raise WireError(f"match at {off}: OXM fields overrun its length {length}")
    if foreign:
        return ((RAW, bytes(buf[off + 4:end]), None),), end + (-length % 8)
    return tuple(sorted(fields)), end + (-length % 8)


# -- actions and instructions ----------------------------------------------------------------
def _encode_action(a: tuple) -> bytes:
    op = a[0]
    if op == "output":
        return struct.pack("!HHIH6x", ofp.OFPAT_OUTPUT, 16, a[1], 0)
    if op in _PORT_OF:
        max_len = ofp.OFPCML_NO_BUFFER if op == "controller" else 0
        return struct.pack("!HHIH6x", ofp.OFPAT_OUTPUT, 16, _PORT_OF[op], max_len)
    if op == "set_eth_dst":
        return struct.pack("!HH", ofp.OFPAT_SET_FIELD, 16) + _OXM_HDR["eth_dst", False] + a[1].to_bytes(6, "big") \
            + b"\0\0"
    if op == "group":
        return struct.pack("!HHI", ofp.OFPAT_GROUP, 8, a[1])
    if op == "move":
        _, src, src_ofs, dst, dst_ofs, n_bits = a
        return struct.pack("!HHIHHHH", ofp.OFPAT_EXPERIMENTER, 24, NX_VENDOR, NXAST_REG_MOVE, n_bits, src_ofs,
                           dst_ofs) + _OXM_HDR[src, False] + _OXM_HDR[dst, False]
    if op == "multipath":
        _, _src, basis, n_links, dst, dst_ofs, n_bits = a
        hdr = int.from_bytes(_OXM_HDR[dst, False], "big")
        return MULTIPATH.pack(ofp.OFPAT_EXPERIMENTER, MULTIPATH.size, NX_VENDOR, NXAST_MULTIPATH, 0, basis, 0, 0,
                              n_links - 1, 0, 0, dst_ofs << 6 | (n_bits - 1), hdr)
    raise ValueError(f"action {a!r} cannot be encoded: known actions are output, normal, flood, controller, in_port, "
                     "set_eth_dst, group, move, multipath, goto")


def encode_actions(actions: Iterable[tuple]) -> bytes:
    return b"".join(_encode_action(a) for a in actions)


_INST_CACHE: dict[tuple, bytes] = {}


def encode_instructions(actions: tuple) -> bytes:
    """Apply-actions (everything but goto) then goto-table; nothing at all drops."""
    got = _INST_CACHE.get(actions)
    if got is not None:
        return got
    acts = encode_actions(a for a in actions if a[0] != "goto")
    out = struct.pack("!HH4x", ofp.OFPIT_APPLY_ACTIONS, 8 + len(acts)) + acts if acts else b""
    for a in actions:
        if a[0] == "goto":
            out += struct.pack("!HHB3x", ofp.OFPIT_GOTO_TABLE, 8, a[1])
    if len(_INST_CACHE) > 4096:
        _INST_CACHE.clear()
    _INST_CACHE[actions] = out
    return out


def decode_actions(buf, off: int, end: int) -> list[tuple]:
    out: list[tuple] = []
    while off < end:
        atype, alen = struct.unpack_from("!HH", buf, off)
        if alen < 8 or off + alen > end:
            raise WireError(f"action at {off}: length {alen} runs past its list")
        if atype == ofp.OFPAT_OUTPUT:
            (port,) = struct.unpack_from("!I", buf, off + 4)
            out.append(_RESERVED_PORTS.get(port) or ("output", port))
        elif atype == ofp.OFPAT_GROUP:
            out.append(("group", struct.unpack_from("!I", buf, off + 4)[0]))
        elif atype == ofp.OFPAT_SET_FIELD and buf[off + 4:off + 8] == _OXM_HDR["eth_dst", False]:
            out.append(("set_eth_dst", int.from_bytes(buf[off + 8:off + 14], "big")))
        elif atype == ofp.OFPAT_EXPERIMENTER and alen >= 24 and \
                struct.unpack_from("!IH", buf, off + 4) == (NX_VENDOR, NXAST_REG_MOVE):
            n_bits, src_ofs, dst_ofs, src, dst = struct.unpack_from("!HHHII", buf, off + 10)
            names = [_OXM_NAME.get((h >> 16, (h >> 9) & 0x7F)) if not h & 0x100 else None for h in (src, dst)]
            if None in names:
                out.append(("unknown", "move", src, dst))
            else:
                out.append(("move", names[0], src_ofs, names[1], dst_ofs, n_bits))
        elif atype == ofp.OFPAT_EXPERIMENTER and alen >= MULTIPATH.size and \
                struct.unpack_from("!IH", buf, off + 4) == (NX_VENDOR, NXAST_MULTIPATH):
            out.append(_multipath(*MULTIPATH.unpack_from(buf, off)[4:]))
        else:
            out.append(("unknown", atype, bytes(buf[off:off + alen])))
        off += alen
    return out


def _multipath(fields: int, basis: int, _pad: int, algorithm: int, max_link: int, arg: int, _pad1: int,
               ofs_nbits: int, dst) -> tuple:
    """The action tuple of a multipath (dst: an OXM/NXM header or os-ken's field name); unknown if not ours."""
    name = dst if isinstance(dst, str) else (_OXM_NAME.get((dst >> 16, (dst >> 9) & 0x7F)) if not dst & 0x100
                                            else None)
    if fields != 0 or algorithm != 0 or arg != 0 or name is None:
        return ("unknown", "multipath", fields, algorithm, dst)
    return ("multipath", "eth_src", basis, max_link + 1, name, ofs_nbits >> 6, (ofs_nbits & 0x3F) + 1)


_DECODED: dict[bytes, tuple] = {}


def decode_instructions(buf, off: int, end: int) -> tuple:
    """Action tuple (apply-actions first, goto last) of an instruction list; cached by its bytes."""
    raw = bytes(buf[off:end])
    got = _DECODED.get(raw)
    if got is not None:
        return got
    actions: list[tuple] = []
    goto: list[tuple] = []
    pos = off
    while pos < end:
        itype, ilen = struct.unpack_from("!HH", buf, pos)
        if ilen < 8 or pos + ilen > end:
            raise WireError(f"instruction at {pos}: length {ilen} runs past the flow")
        if itype == ofp.OFPIT_APPLY_ACTIONS:
            actions.extend(decode_actions(buf, pos + 8, pos + ilen))
        elif itype == ofp.OFPIT_GOTO_TABLE:
            goto.append(("goto", buf[pos + 4]))
        else:
            actions.append(("unknown", f"instruction {itype}"))
        pos += ilen
    got = tuple(actions + goto)
    if len(_DECODED) > 4096:
        _DECODED.clear()
    _DECODED[raw] = got
    return got


# -- messages ------------------------------------------------------------------------------
_FLOW_MOD = struct.Struct("!QQBBHHHIIIHH")   # flow-mod body up to the match (40 bytes)
_BUNDLED_FLOW = struct.Struct("!BBHIIxxHBBHIQQBBHHHIIIHH")  # bundle-add + its flow-mod header, 64 bytes


def header(msg_type: int, length: int, xid: int) -> bytes:
    return HEADER.pack(VERSION, msg_type, length, xid)


def flow_mod(f: FlowSpec, command: int, xid: int = 0, *, cookie_mask: int = 0, table: int | None = None) -> bytes:
    """A flow mod: ADD carries the spec's actions; DELETE/DELETE_STRICT none."""
    body = encode_match(f.match)
    if command == ofp.OFPFC_ADD:
        body += encode_instructions(f.actions)
    fixed = _FLOW_MOD.pack(f.cookie, cookie_mask, f.table if table is None else table, command, 0, 0, f.priority,
                           ofp.OFP_NO_BUFFER, ofp.OFPP_ANY, ofp.OFPG_ANY, 0, 0)
    return header(ofp.OFPT_FLOW_MOD, 8 + len(fixed) + len(body), xid) + fixed + body


def flow_add(f: FlowSpec, xid: int = 0) -> bytes:
    return flow_mod(f, ofp.OFPFC_ADD, xid)


def flow_delete_strict(f: FlowSpec, xid: int = 0) -> bytes:
    return flow_mod(FlowSpec(f.table, f.priority, f.match), ofp.OFPFC_DELETE_STRICT, xid)


def flow_delete_cookie(cookie: int, mask: int, xid: int = 0) -> bytes:
    """Delete every flow, in every table, whose cookie matches ``cookie``/``mask``."""
    return flow_mod(FlowSpec(ofp.OFPTT_ALL, 0, (), (), cookie), ofp.OFPFC_DELETE, xid, cookie_mask=mask)


def _bucket(g: GroupSpec, b: Bucket) -> bytes:
    acts = encode_actions(b.actions)
    return struct.pack("!HHII4x", 16 + len(acts), b.weight if g.type == "select" else 0, ofp.OFPP_ANY,
                       ofp.OFPG_ANY) + acts


GROUP_TYPES = {"all": ofp.OFPGT_ALL, "select": ofp.OFPGT_SELECT}
GROUP_COMMANDS = {"add": ofp.OFPGC_ADD, "modify": ofp.OFPGC_MODIFY, "delete": ofp.OFPGC_DELETE}


def group_mod(g: GroupSpec | None, command: str, xid: int = 0, group_id: int | None = None) -> bytes:
    """``g`` None: a bucketless group (what a delete needs) with ``group_id``."""
    if g is None:
        gtype, gid, buckets = ofp.OFPGT_ALL, group_id, b""
    else:
        gtype, gid, buckets = GROUP_TYPES[g.type], g.group_id, b"".join(_bucket(g, b) for b in g.buckets)
    body = struct.pack("!HBxI", GROUP_COMMANDS[command], gtype, gid) + buckets
    return header(ofp.OFPT_GROUP_MOD, 8 + len(body), xid) + body


def bundle_ctrl(bundle_id: int, ctrl_type: int, flags: int, xid: int) -> bytes:
    return header(ofp.OFPT_BUNDLE_CONTROL, 16, xid) + struct.pack("!IHH", bundle_id, ctrl_type, flags)


def bundle_add(bundle_id: int, flags: int, inner: bytes, xid: int) -> bytes:
    """Wrap an encoded message; its xid is rewritten to ``xid`` (OpenFlow 1.4 §7.3.9.2 wants them equal)."""
    inner = inner[:4] + struct.pack("!I", xid) + inner[8:]
    return header(ofp.OFPT_BUNDLE_ADD_MESSAGE, 16 + len(inner), xid) + struct.pack("!IxxH", bundle_id, flags) \
        + inner


def bundled_adds(bundle_id: int, flags: int, flows: Iterable[FlowSpec], xid: int) -> Iterator[bytes]:
    """Bundle-add messages of ADD flow mods, xids ``xid``, ``xid``+1, ...: the hot path of an install."""
    pack = _BUNDLED_FLOW.pack
    add, msg_add, msg_flow = ofp.OFPFC_ADD, ofp.OFPT_BUNDLE_ADD_MESSAGE, ofp.OFPT_FLOW_MOD
    nobuf, anyp, anyg = ofp.OFP_NO_BUFFER, ofp.OFPP_ANY, ofp.OFPG_ANY
    for f in flows:
        tail = encode_match(f.match) + encode_instructions(f.actions)
        n = 48 + len(tail)
        yield pack(VERSION, msg_add, n + 16, xid, bundle_id, flags, VERSION, msg_flow, n, xid, f.cookie, 0,
                   f.table, add, 0, 0, f.priority, nobuf, anyp, anyg, 0, 0) + tail
        xid = (xid + 1) & MAX_XID


def flow_stats_request(xid: int, table: int = ofp.OFPTT_ALL, cookie: int = 0, cookie_mask: int = 0) -> bytes:
    body = struct.pack("!HH4xB3xII4xQQ", ofp.OFPMP_FLOW, 0, table, ofp.OFPP_ANY, ofp.OFPG_ANY, cookie,
                       cookie_mask) + encode_match(())
    return header(ofp.OFPT_MULTIPART_REQUEST, 8 + len(body), xid) + body


def group_desc_request(xid: int) -> bytes:
    return header(ofp.OFPT_MULTIPART_REQUEST, 16, xid) + struct.pack("!HH4x", ofp.OFPMP_GROUP_DESC, 0)


# -- flow stats (multipart reply bodies) ---------------------------------------------------
_STATS = struct.Struct("!HBxIIHHHHH2xQQQ")  # 48 bytes before the match


def parse_flow_stats(buf, off: int = 0, end: int | None = None) -> Iterator[tuple[FlowSpec, int, int]]:
    """(spec, packets, bytes) for each ofp_flow_stats entry in ``buf[off:end]``; WireError if malformed."""
    end = len(buf) if end is None else end
    unpack = _STATS.unpack_from
    while off < end:
        try:
            length, table, _, _, prio, _, _, _, _, cookie, packets, nbytes = unpack(buf, off)
            if length < _STATS.size + 8 or off + length > end:
                raise WireError(f"flow stats entry at {off}: length {length} does not fit in {end - off} bytes")
            m, pos = decode_match(buf, off + _STATS.size)
            if pos > off + length:
                raise WireError(f"flow stats entry at {off}: its match runs past the entry")
            actions = decode_instructions(buf, pos, off + length)
        except (struct.error, IndexError) as exc:
            raise WireError(f"flow stats entry at {off} is truncated: {exc}") from None
        yield FlowSpec(table, prio, m, actions, cookie), packets, nbytes
        off += length


def parse_flow_counters(buf, off: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """(table, cookie, packets, bytes) per entry, without decoding matches or actions."""
    end = len(buf) if end is None else end
    unpack = _STATS.unpack_from
    while off < end:
        try:
            length, table, _, _, _, _, _, _, _, cookie, packets, nbytes = unpack(buf, off)
        except struct.error as exc:
            raise WireError(f"flow stats entry at {off} is truncated: {exc}") from None
        if length < _STATS.size or off + length > end:
            raise WireError(f"flow stats entry at {off}: length {length} does not fit in {end - off} bytes")
        yield table, cookie, packets, nbytes
        off += length


# -- from os-ken's parsed objects --------------------------------------------------------------
MAC_FIELDS = ("eth_dst", "eth_src")
IPV4_FIELDS = ("ipv4_src", "ipv4_dst")


def _field_int(name: str, value) -> int:
    if name in MAC_FIELDS:
        return mac_to_int(value)
    if name in IPV4_FIELDS and isinstance(value, str):
        return int(ipaddress.IPv4Address(value))
    return value


def _spec_actions(actions) -> list[tuple]:
    out: list[tuple] = []
    for act in actions:
        name = type(act).__name__
        if name == "OFPActionOutput":
            out.append(_RESERVED_PORTS.get(act.port) or ("output", act.port))
        elif name == "OFPActionSetField" and act.key == "eth_dst":
            out.append(("set_eth_dst", mac_to_int(act.value)))
        elif name == "OFPActionGroup":
            out.append(("group", act.group_id))
        elif name == "NXActionRegMove":
            out.append(("move", act.src_field, act.src_ofs, act.dst_field, act.dst_ofs, act.n_bits))
        elif name == "NXActionMultipath":
            out.append(_multipath(act.fields, act.basis, 0, act.algorithm, act.max_link, act.arg, 0, act.ofs_nbits,
                                  act.dst))
        else:
            out.append(("unknown", name))
    return out


def flow_from_stats(stat) -> FlowSpec:
    """Spec of an os-ken OFPFlowStats (or OFPFlowMod) object."""
    fields = {}
    for name, value in stat.match.items():
        if isinstance(value, tuple):
            fields[name] = (_field_int(name, value[0]), _field_int(name, value[1]))
        else:
            fields[name] = _field_int(name, value)
    try:
        m = make_match(**fields)
    except ValueError:
        m = tuple(sorted((k, str(v), None) for k, v in fields.items()))  # foreign: will be deleted
    actions: list[tuple] = []
    goto = []
    for inst in stat.instructions:
        name = type(inst).__name__
        if name == "OFPInstructionActions":
            actions.extend(_spec_actions(inst.actions))
        elif name == "OFPInstructionGotoTable":
            goto.append(("goto", inst.table_id))
        else:
            actions.append(("unknown", name))
    return FlowSpec(stat.table_id, stat.priority, m, tuple(actions + goto), stat.cookie)


def group_from_desc(desc) -> GroupSpec:
    """Spec of an os-ken OFPGroupDescStats (or OFPGroupMod) object."""
    gtype = {ofp.OFPGT_ALL: "all", ofp.OFPGT_SELECT: "select"}.get(desc.type, str(desc.type))
    buckets = tuple(Bucket(b.weight if gtype == "select" else 1, tuple(_spec_actions(b.actions)))
                    for b in desc.buckets)
    return GroupSpec(desc.group_id, gtype, buckets)
