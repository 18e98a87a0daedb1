"""A fake OpenFlow pipeline for fast tests (in the spirit of faucet's clib/fakeoftable.py).

It runs packets through the ``SwitchConfig``s the compiler emits
(``vfab.fabric.flows``), switch by switch, the way Open vSwitch would:

- per table the highest-priority matching flow wins (two flows of equal
  priority that both match are ambiguous in OpenFlow: with ``strict`` that is
  an error, since it means the compiler emitted overlapping rules);
- actions run in order on the packet (``set_eth_dst`` changes what later
  ``output``s send; ``move`` copies bits between header fields as OVS's
  Nicira move does, and fails if either field is absent from the packet);
  ``goto`` continues in a later table afterwards;
- groups: ``all`` runs every bucket on its own copy, ``select`` runs one
  bucket picked by a stable hash of ``eth_src`` (weighted);
- ``output`` to a trunk port continues at the peer switch's table 0 with
  ``in_port`` = the peer port; output to the packet's own ``in_port`` is
  dropped as OVS does (it needs the IN_PORT port);
- packets are dicts of header fields (``in_port``, ``eth_*``, ``ip_proto``,
  ``ipv4_src``/``ipv4_dst``, ``udp_src``/``udp_dst``, ...); a flow matching a
  field the packet lacks does not match (as OpenFlow prerequisites would);
  an IP fragment carries ``ip_frag`` (OVS's nw_frag bits) and, as OVS's
  default fragment handling gives them, no UDP ports; ``ip_frag`` of another
  IPv4 packet is 0;
- ``normal``/``controller``/``flood`` are recorded as deliveries to the pseudo
  ports ``"NORMAL"``/``"CONTROLLER"``/``"FLOOD"``;
- a flow without actions drops: counted in ``drops`` per (dpid, flow key);
  a table miss drops too, counted under (dpid, (table, None, None)).

Every flow hit is counted in ``packets`` so tests can assert on counters the
way the controller reads them from a real switch.
"""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Iterable

from vfab.fabric.flows import TABLE_ADMIT, FlowSpec, GroupSpec, SwitchConfig, split_cookie
from vfab.vid import mackey

PSEUDO_PORTS = {"normal": "NORMAL", "controller": "CONTROLLER", "flood": "FLOOD"}
Delivery = tuple[int, "int | str", int]  # (dpid, port, eth_dst)


class FakeTableError(AssertionError):
    """The pipeline itself is wrong: ambiguous flows, unknown group, loop, bad goto."""


def flow_matches(flow: FlowSpec, pkt: dict) -> bool:
    for name, value, mask in flow.match:
        got = pkt.get(name)
        if got is None and name == "ip_frag" and pkt.get("eth_type") == 0x0800:
            got = 0   # an IPv4 packet that is no fragment (a fragment carries ip_frag: FRAG_ANY[|FRAG_LATER])
        if got is None:
            return False
        if mask is None:
            if got != value:
                return False
        elif got & mask != value:
            return False
    return True


class FakeFabric:
    """Switches holding compiled configs, joined by trunk links."""

    def __init__(self, configs: dict[int, SwitchConfig],
                 links: Iterable[tuple[int, int, int, int]] = (), *, strict: bool = True,
                 max_hops: int = 64):
        self.configs = configs
        self.links = {(d, p): (pd, pp) for d, p, pd, pp in links}
        self.strict = strict
        self.max_hops = max_hops
        self.packets: Counter = Counter()   # (dpid, flow key) -> packets that hit it
        self.drops: Counter = Counter()     # (dpid, flow key) -> packets it dropped
        self.trace: list[tuple[int, int, FlowSpec | None]] = []  # of the last inject
        # Per switch and table, flows by descending priority.
        self._tables: dict[int, dict[int, list[FlowSpec]]] = {}
        for dpid, cfg in configs.items():
            tables: dict[int, list[FlowSpec]] = {}
            for flow in cfg.flows.values():
                tables.setdefault(flow.table, []).append(flow)
            for flows in tables.values():
                flows.sort(key=lambda f: (-f.priority, f.match))
            self._tables[dpid] = tables

    # -- lookup -----------------------------------------------------------
    def lookup(self, dpid: int, table: int, pkt: dict) -> FlowSpec | None:
        best: FlowSpec | None = None
        for flow in self._tables.get(dpid, {}).get(table, []):
            if best is not None and flow.priority < best.priority:
                break
            if flow_matches(flow, pkt):
                if best is None:
                    best = flow
                    if not self.strict:
                        break
                else:
                    raise FakeTableError(
                        f"switch {dpid:#x} table {table}: flows {best.match} and {flow.match} both "
                        f"match {pkt} at priority {flow.priority}"
                    )
        return best

    # -- packets ----------------------------------------------------------
    def inject(self, dpid: int, in_port: int, eth_src: int, eth_dst: int, eth_type: int,
               **fields: int) -> list[Delivery]:
        """Send one packet into ``dpid`` on ``in_port``; every copy that leaves the fabric."""
        self.trace = []
        out: list[Delivery] = []
        pkt = dict(fields, in_port=in_port, eth_src=eth_src, eth_dst=eth_dst, eth_type=eth_type)
        self._switch(dpid, pkt, out, hops=0)
        return out

    def _switch(self, dpid: int, pkt: dict, out: list, hops: int) -> None:
        if hops > self.max_hops:
            raise FakeTableError(f"forwarding loop: more than {self.max_hops} switch hops")
        if dpid not in self.configs:
            raise FakeTableError(f"packet reached unknown switch {dpid:#x}")
        table = TABLE_ADMIT
        while table is not None:
            flow = self.lookup(dpid, table, pkt)
            self.trace.append((dpid, table, flow))
            if flow is None:
                self.drops[(dpid, (table, None, None))] += 1
                return
            self.packets[(dpid, flow.key)] += 1
            if not flow.actions:
                self.drops[(dpid, flow.key)] += 1
                return
            nxt = self._actions(dpid, flow.actions, pkt, out, hops)
            if nxt is not None and nxt <= table:
                raise FakeTableError(f"switch {dpid:#x}: goto {nxt} from table {table} goes backwards")
            table = nxt

    def _actions(self, dpid: int, actions: tuple, pkt: dict, out: list, hops: int) -> int | None:
        """Run actions on pkt (mutated); returns the goto table or None."""
        goto = None
        for act in actions:
            op = act[0]
            if op == "output":
                self._output(dpid, act[1], dict(pkt), out, hops)
            elif op == "set_eth_dst":
                pkt["eth_dst"] = act[1]
            elif op == "move":
                _, src, src_ofs, dst, dst_ofs, n_bits = act
                if src not in pkt or dst not in pkt:
                    raise FakeTableError(f"switch {dpid:#x}: {act!r} on a packet without {src} or {dst}")
                bits = (1 << n_bits) - 1
                pkt[dst] = pkt[dst] & ~(bits << dst_ofs) | ((pkt[src] >> src_ofs) & bits) << dst_ofs
            elif op == "multipath":   # OVS: jhash of eth_src modulo n_links (vfab.vid.mackey reproduces it)
                _, src, basis, n_links, dst, dst_ofs, n_bits = act
                link = mackey.jhash_bytes(pkt[src].to_bytes(6, "big"), basis) % n_links
                bits = (1 << n_bits) - 1
                pkt[dst] = pkt[dst] & ~(bits << dst_ofs) | link << dst_ofs
            elif op == "group":
                self._group(dpid, act[1], pkt, out, hops)
            elif op == "in_port":   # OFPP_IN_PORT: the one way back out of the port it came in on
                self._output(dpid, pkt["in_port"], dict(pkt), out, hops, back=True)
            elif op == "goto":
                goto = act[1]
            elif op in PSEUDO_PORTS:
                out.append((dpid, PSEUDO_PORTS[op], pkt["eth_dst"]))
            else:
                raise FakeTableError(f"switch {dpid:#x}: unknown action {act!r}")
        return goto

    def _group(self, dpid: int, gid: int, pkt: dict, out: list, hops: int) -> None:
        group: GroupSpec | None = self.configs[dpid].groups.get(gid)
        if group is None:
            raise FakeTableError(f"switch {dpid:#x}: flow points at missing group {gid}")
        if group.type == "all":
            for bucket in group.buckets:
                self._actions(dpid, bucket.actions, dict(pkt), out, hops)
        elif group.type == "select":
            live = [b for b in group.buckets if b.weight > 0]
            if not live:
                return
            point = zlib.crc32(pkt["eth_src"].to_bytes(6, "big")) % sum(b.weight for b in live)
            for bucket in live:
                if point < bucket.weight:
                    self._actions(dpid, bucket.actions, dict(pkt), out, hops)
                    return
                point -= bucket.weight
        else:
            raise FakeTableError(f"switch {dpid:#x}: group {gid} has unknown type {group.type!r}")

    def _output(self, dpid: int, port: int, pkt: dict, out: list, hops: int, back: bool = False) -> None:
        if port == pkt["in_port"] and not back:
            return  # OpenFlow never sends a packet back out of its in_port via output:N
        peer = self.links.get((dpid, port))
        if peer is None:
            out.append((dpid, port, pkt["eth_dst"]))
            return
        peer_dpid, peer_port = peer
        pkt["in_port"] = peer_port
        self._switch(peer_dpid, pkt, out, hops + 1)

    # -- counters ---------------------------------------------------------
    def flow_by_key(self, dpid: int, key: tuple) -> FlowSpec | None:
        return self.configs[dpid].flows.get(key)

    def drop_count(self, kind: int | None = None, dpid: int | None = None) -> int:
        """Packets dropped by flows of a cookie kind (None: every drop, table misses too)."""
        total = 0
        for (d, key), n in self.drops.items():
            if dpid is not None and d != dpid:
                continue
            if kind is not None:
                flow = self.flow_by_key(d, key)
                if flow is None or split_cookie(flow.cookie)[0] != int(kind):
                    continue
            total += n
        return total

    def reset_counters(self) -> None:
        self.packets.clear()
        self.drops.clear()
