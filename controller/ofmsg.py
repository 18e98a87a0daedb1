"""Translation between switch-neutral specs (fabric/flows.py) and os-ken OpenFlow 1.4 messages.

``to_*`` build messages for a datapath; ``from_*`` turn stats replies back into
specs, so what a switch holds can be diffed against what it should hold.
"""

from __future__ import annotations

from vfab.fabric.flows import Bucket, FlowSpec, GroupSpec, match as make_match
from vfab.vid.codec import int_to_mac, mac_to_int

MAC_FIELDS = ("eth_dst", "eth_src")


def _ofp_match(dp, m):
    kwargs = {}
    for name, value, mask in m:
        if name in MAC_FIELDS:
            value = int_to_mac(value)
            mask = int_to_mac(mask) if mask is not None else None
        kwargs[name] = (value, mask) if mask is not None else value
    return dp.ofproto_parser.OFPMatch(**kwargs)


def _ofp_actions(dp, actions):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    acts, inst = [], []
    for a in actions:
        op = a[0]
        if op == "output":
            acts.append(parser.OFPActionOutput(a[1]))
        elif op == "set_eth_dst":
            acts.append(parser.OFPActionSetField(eth_dst=int_to_mac(a[1])))
        elif op == "group":
            acts.append(parser.OFPActionGroup(a[1]))
        elif op == "normal":
            acts.append(parser.OFPActionOutput(ofp.OFPP_NORMAL))
        elif op == "flood":
            acts.append(parser.OFPActionOutput(ofp.OFPP_FLOOD))
        elif op == "controller":
            acts.append(parser.OFPActionOutput(ofp.OFPP_CONTROLLER, ofp.OFPCML_NO_BUFFER))
        elif op == "goto":
            inst.append(parser.OFPInstructionGotoTable(a[1]))
        else:
            raise ValueError(f"unknown action {a!r}")
    if acts:
        inst.insert(0, parser.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, acts))
    return acts, inst


def flow_add(dp, f: FlowSpec):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    _, inst = _ofp_actions(dp, f.actions)
    return parser.OFPFlowMod(dp, cookie=f.cookie, table_id=f.table, command=ofp.OFPFC_ADD,
                             priority=f.priority, buffer_id=ofp.OFP_NO_BUFFER, out_port=ofp.OFPP_ANY,
                             out_group=ofp.OFPG_ANY, match=_ofp_match(dp, f.match), instructions=inst)


def flow_delete(dp, f: FlowSpec):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    return parser.OFPFlowMod(dp, table_id=f.table, command=ofp.OFPFC_DELETE_STRICT, priority=f.priority,
                             out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY, match=_ofp_match(dp, f.match))


def group_mod(dp, g: GroupSpec | None, command: str, group_id: int | None = None):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    cmd = {"add": ofp.OFPGC_ADD, "modify": ofp.OFPGC_MODIFY, "delete": ofp.OFPGC_DELETE}[command]
    if g is None:
        return parser.OFPGroupMod(dp, command=cmd, type_=ofp.OFPGT_ALL, group_id=group_id, buckets=[])
    gtype = {"all": ofp.OFPGT_ALL, "select": ofp.OFPGT_SELECT}[g.type]
    buckets = [parser.OFPBucket(weight=b.weight if g.type == "select" else 0, watch_port=ofp.OFPP_ANY,
                                watch_group=ofp.OFPG_ANY, actions=_ofp_actions(dp, b.actions)[0])
               for b in g.buckets]
    return parser.OFPGroupMod(dp, command=cmd, type_=gtype, group_id=g.group_id, buckets=buckets)


def _spec_actions(ofp, actions) -> list[tuple]:
    out = []
    for act in actions:
        name = type(act).__name__
        if name == "OFPActionOutput":
            port = act.port
            if port == ofp.OFPP_NORMAL:
                out.append(("normal",))
            elif port == ofp.OFPP_FLOOD:
                out.append(("flood",))
            elif port == ofp.OFPP_CONTROLLER:
                out.append(("controller",))
            else:
                out.append(("output", port))
        elif name == "OFPActionSetField" and act.key == "eth_dst":
            out.append(("set_eth_dst", mac_to_int(act.value)))
        elif name == "OFPActionGroup":
            out.append(("group", act.group_id))
        else:
            out.append(("unknown", name))
    return out


def flow_from_stats(ofp, stat) -> FlowSpec:
    fields = {}
    for name, value in stat.match.items():
        if isinstance(value, tuple):
            v, m = value
            if name in MAC_FIELDS:
                v, m = mac_to_int(v), mac_to_int(m)
            fields[name] = (v, m)
        else:
            fields[name] = mac_to_int(value) if name in MAC_FIELDS else value
    try:
        m = make_match(**fields)
    except ValueError:
        m = tuple(sorted((k, str(v), None) for k, v in fields.items()))  # foreign: will be deleted
    actions: list[tuple] = []
    goto = []
    for inst in stat.instructions:
        name = type(inst).__name__
        if name == "OFPInstructionActions":
            actions.extend(_spec_actions(ofp, inst.actions))
        elif name == "OFPInstructionGotoTable":
            goto.append(("goto", inst.table_id))
        else:
            actions.append(("unknown", name))
    return FlowSpec(stat.table_id, stat.priority, m, tuple(actions + goto), stat.cookie)


def group_from_desc(ofp, desc) -> GroupSpec:
    gtype = {ofp.OFPGT_ALL: "all", ofp.OFPGT_SELECT: "select"}.get(desc.type, str(desc.type))
    buckets = tuple(Bucket(b.weight if gtype == "select" else 1, tuple(_spec_actions(ofp, b.actions)))
                    for b in desc.buckets)
    return GroupSpec(desc.group_id, gtype, buckets)
