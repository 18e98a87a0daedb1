"""The scale bench's pure parts: the workload, the model, the agent's view of etcd, and the flows-per-switch
bounds on the fake flow table (a compiler change that makes a switch hold more flows fails here)."""

from __future__ import annotations

import random

import pytest

from bench import scale_model as model
from bench.scale import records, tunnel_ports
from bench.scale_agent import RouteView, Shared
from vfab.fabric.flows import TABLE_ADMIT, TABLE_ROUTE, FlowSpec, Kind, SwitchConfig, make_cookie, match
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec
from vfab.vid.ranges import Range, check_partition, to_masks
from vfab.vid.registry.etcd import Event
from vfab.vid.registry import schema


@pytest.mark.parametrize("n", [1, 2, 5, 100, 128, 1000])
def test_split_ranges_partition_the_key_space_in_aligned_blocks(n):
    rs = model.split_ranges(n)
    assert len(rs) == n
    check_partition([Range(lo, hi) for lo, hi in rs])
    assert all(len(to_masks(Range(lo, hi))) == 1 for lo, hi in rs)


def test_bad_workloads_are_refused_with_the_limit():
    with pytest.raises(model.WorkloadError, match=r"1\.\.8"):
        model.Workload(10, 100, 8, per_service=9)
    with pytest.raises(model.WorkloadError, match="aligned, contiguous, interleaved"):
        model.Workload(10, 100, 8, placement="random")
    with pytest.raises(model.WorkloadError, match="ranges per service"):
        model.split_ranges(0)


@pytest.mark.parametrize("placement", model.PLACEMENTS)
def test_every_service_is_a_partition_spread_over_its_nodes(placement):
    w = model.Workload(30, 100, 16, per_service=4, placement=placement)
    assert w.total_ranges == 3000
    assert sum(w.local_ranges(model.node_name(j)) for j in range(1, 17)) == 3000
    for sid, rs in w.owned.items():
        check_partition([Range(r.lo, r.hi) for r in rs])
        assert {r.node for r in rs} <= set(w.service_nodes(sid))


def test_a_move_changes_the_old_and_new_owner_and_leaves_the_workload_alone():
    w = model.Workload(10, 100, 8, per_service=4)
    rnd = random.Random(1)
    for _ in range(20):
        sid, index, to = model.pick_change(w, rnd)
        before = w.owned[sid][index]
        after = model.move(w, sid, index, to)
        assert w.owned[sid][index] == before
        assert after.owned[sid][index].node == to and after.owned[sid][index].epoch == before.epoch + 1
        need = model.needed(w, after, sid)
        assert {before.node, to} <= set(need)
        w = after


def test_the_model_is_the_slowest_of_n_and_grows_with_n():
    assert model.fabric_latency([0.002] * 10, 64, fanout=0.001)["p99_ms"] == pytest.approx(3.0)
    samples = [0.001 * i for i in range(1, 101)]
    few, many = model.fabric_latency(samples, 4), model.fabric_latency(samples, 64)
    assert few["median_ms"] < many["median_ms"] <= 100.0
    with pytest.raises(ValueError, match="measured"):
        model.fabric_latency([], 64)


def fake_fabric(w: model.Workload) -> FakeFabric:
    configs = {}
    for j in range(1, w.nodes + 1):
        cfg = SwitchConfig(dpid=j)
        cfg.add(FlowSpec(TABLE_ADMIT, 0, match(), (("goto", TABLE_ROUTE),), make_cookie(Kind.BASE)))
        for f in model.node_flows(w, model.node_name(j)):
            cfg.add(f)
        configs[j] = cfg
    tb = model.TUNNEL_BASE
    links = [(i, tb + j, j, tb + i) for i in range(1, w.nodes + 1) for j in range(1, w.nodes + 1) if i != j]
    return FakeFabric(configs, links)


@pytest.mark.parametrize("placement", model.PLACEMENTS)
def test_every_key_reaches_its_owners_node_from_every_node(placement):
    w = model.Workload(6, 100, 6, per_service=3, placement=placement)
    table = fake_fabric(w)
    rnd = random.Random(4)
    for _ in range(150):
        sid = rnd.randrange(1, 7)
        key = rnd.randrange(codec.KEY_MAX + 1)
        owner = next(r.node for r in w.owned[sid] if r.lo <= key <= r.hi)
        vid = codec.encode(sid, key).value
        for ingress in range(1, 7):
            got = table.inject(ingress, 2, 0x02FB00000001, vid, 0x88B5)
            assert got == [(int(owner[1:]), model.LOCAL_PORT, vid)], (sid, key, ingress)


def test_flows_per_switch_grow_with_own_ranges_and_nodes_not_with_the_fabrics_ranges():
    # 100 services on 64 nodes: each switch holds its own ranges' blocks plus at most one prefix per
    # (service, other node of that service); ten times the ranges per service adds only the local ones
    for per in (1, 2, 4):
        w = model.Workload(100, 100, 64, per_service=per)
        big = model.Workload(100, 1000, 64, per_service=per)
        for me in ("n1", "n2", "n40"):
            flows = len(model.node_flows(w, me))
            assert flows <= w.local_ranges(me) + 100 * per, (per, me, flows)
            assert len(model.node_flows(big, me)) - big.local_ranges(me) <= 100 * per


def test_the_goal_holds_at_100000_ranges_on_64_nodes_for_services_on_two_nodes():
    # issue 45's bound: <= 5,000 flows per switch at 1,000 services x 100 ranges, 64 nodes (services spread
    # over 2 nodes each; over 4 each it is ~5,950, the bench reports it)
    w = model.Workload(1000, 100, 64, per_service=2)
    for me in ("n1", "n17", "n64"):
        assert len(model.node_flows(w, me)) <= 5000


def test_the_agents_view_of_the_etcd_records_compiles_what_the_model_does():
    w = model.Workload(12, 100, 6, per_service=3)
    items = {k: v.encode() for k, v in records(w).items()}
    shared = Shared.load(items, 1, tunnel_ports(6))
    views = {me: RouteView(me, shared) for me in ("n1", "n4")}
    for me, view in views.items():
        assert view.all_flows().flows == {f.key: f for f in model.node_flows(w, me)}
    sid, index, to = 5, 7, next(n for n in w.service_nodes(5) if n != w.owned[5][7].node)
    after = model.move(w, sid, index, to)
    r = after.owned[sid][index]
    rec = schema.RangeRec(lo=r.lo, hi=r.hi, owner=f"e{w.service_nodes(sid).index(to)}", epoch=r.epoch)
    ev = Event(schema.range_key(f"s{sid}", r.lo), rec.to_json().encode(), 2)
    assert views["n1"].apply([ev]) == {f"s{sid}"}
    assert views["n1"].service_flows(f"s{sid}") == model.service_flows(after, sid, "n1")
    # the other view shares the records, not the change
    assert views["n4"].service_flows(f"s{sid}") == model.service_flows(w, sid, "n4")
