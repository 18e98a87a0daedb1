"""compile_node at scale: a recompile finds the previous compile's overlapping routes by binary search, not by
clipping every previous range of the service against each range (n² clips: 4.6 s per node at 1,000 services
x 100 ranges)."""

from __future__ import annotations

from bench import scale_model as model
from bench.scale import range_record, records
from vfab.fabric import nodecompile
from vfab.vid.registry import schema


def test_a_recompile_clips_only_where_a_move_waits(monkeypatch):
    w = model.Workload(20, 100, 8, per_service=4)
    items = {k: v.encode() for k, v in records(w).items()}
    ports = model.tunnel_ports(8, "n1")
    first = nodecompile.compile_node(items, "n1", 1, tunnel_ports=ports)
    calls = []
    real_clip = nodecompile._clip
    monkeypatch.setattr(nodecompile, "_clip", lambda *a: calls.append(a) or real_clip(*a))
    again = nodecompile.compile_node(items, "n1", 2, first.memory, tunnel_ports=ports)
    assert again.config.flows == first.config.flows
    assert calls == []                      # nothing moved: nothing to clip (2,000 ranges: 20 x 100² before)
    # a range moving to another node, which has not applied it: only that range's old route is clipped
    sid = next(s for s in w.owned if any(r.node != "n1" for r in w.owned[s]))
    index = next(i for i, r in enumerate(w.owned[sid]) if r.node != "n1")
    to = next(n for n in w.service_nodes(sid) if n not in ("n1", w.owned[sid][index].node))
    after = model.move(w, sid, index, to)
    r = after.owned[sid][index]
    items[schema.range_key(f"s{sid}", r.lo)] = range_record(after, sid, r).to_json().encode()
    moved = nodecompile.compile_node(items, "n1", 3, again.memory, tunnel_ports=ports)
    assert moved.waiting == {to: 3} and len(calls) == 1


def test_compile_fabric_sorts_the_endpoints_once_not_once_per_service(monkeypatch):
    # 200 services with 4 endpoints each: sorting all 800 endpoints for each service sorted 160,000 items
    # (0.76 s of a node's compile at 1,000 services x 4 endpoints); once is 800
    from vfab.fabric import compiler
    from vfab.fabric.state import FabricState

    w = model.Workload(200, 4, 8, per_service=4)
    st = FabricState.from_items({k: v.encode() for k, v in records(w).items()})
    st.switches = {j: schema.Switch(dpid=j, name=f"n{j}") for j in range(1, 9)}
    items_sorted = []

    def counting(it, *a, **kw):
        out = sorted(it, *a, **kw)
        items_sorted.append(len(out))
        return out
    monkeypatch.setattr(compiler, "sorted", counting, raising=False)
    compiler.compile_fabric(st, hops={})
    assert sum(items_sorted) < 10 * (800 + 200 + 800), sum(items_sorted)
