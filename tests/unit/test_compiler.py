"""fabric/compiler.py through a fake OpenFlow pipeline: two switches, one trunk, four hosts.

    h1 (client) ─p1─┐            ┌─p1─ h3 (e2, rx=bpf)
    h2 (e1, ovs) ─p2─ s1 ─p10══p20─ s2 ─p2─ h4 (e3, ovs)
"""

from __future__ import annotations

import random
import pytest

from vfab.fabric.compiler import compile_fabric
from vfab.fabric.flows import TABLE_ADMIT, TABLE_ROUTE, Kind, split_cookie
from vfab.fabric.state import FabricState
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec
from vfab.vid.registry import schema
from vfab.vid.codec import KEY_MAX, Layout
from vfab.vid.frame import ETH_TYPE
from vfab.vid.ranges import Range, check_partition, to_masks

SID = 7
S1, S2 = 1, 2
TRUNK = [(S1, 10, S2, 20), (S2, 20, S1, 10)]
HOSTS = {  # name -> (mac, dpid, port)
    "h1": ("02:00:00:00:00:01", S1, 1),
    "h2": ("02:00:00:00:00:02", S1, 2),
    "h3": ("02:00:00:00:00:03", S2, 1),
    "h4": ("02:00:00:00:00:04", S2, 2),
}
ENDPOINTS = {"e1": ("h2", "ovs"), "e2": ("h3", "bpf"), "e3": ("h4", "ovs")}
RANGES = [  # (lo, hi, owner)
    (0x000000, 0x3FFFFF, "e1"),
    (0x400000, 0x9ABCDE, "e2"),
    (0x9ABCDF, 0xF00000, "e3"),
    (0xF00001, 0xF7FFFF, "ghost"),  # owner without a live endpoint
    (0xF80000, KEY_MAX, ""),  # unassigned
]


def mac_i(host: str) -> int:
    return codec.mac_to_int(HOSTS[host][0])


def make_items(ranges=None, layout="prefix", miss=None, endpoints=None) -> dict[str, bytes]:
    ranges = RANGES if ranges is None else ranges
    endpoints = ENDPOINTS if endpoints is None else endpoints
    recs: list[tuple[str, schema.Record]] = [
        (schema.service_key("echo"), schema.Service(name="echo", id=SID, layout=layout)),
        (schema.switch_key(S1), schema.Switch(dpid=S1, name="s1")),
        (schema.switch_key(S2), schema.Switch(dpid=S2, name="s2")),
    ]
    for d, p, pd, pp in TRUNK:
        recs.append((schema.link_key(d, p), schema.Link(d, p, pd, pp)))
    for name, (mac, dpid, port) in HOSTS.items():
        recs.append((schema.host_key(mac), schema.Host(mac=mac, dpid=dpid, port=port, name=name)))
    for ep, (host, rx) in endpoints.items():
        recs.append((schema.endpoint_key("echo", ep),
                     schema.Endpoint(service="echo", name=ep, mac=HOSTS[host][0], rx=rx, host=host)))
    for r in ranges:
        rec = r if isinstance(r, schema.RangeRec) else schema.RangeRec(
            lo=r[0], hi=r[1], owner=r[2], epoch=1, state="active" if r[2] else "unassigned")
        recs.append((schema.range_key("echo", rec.lo), rec))
    items = {k: v.to_json().encode() for k, v in recs}
    items[schema.service_id_key(SID)] = b"echo"
    if miss:
        items[schema.MISS_KEY] = miss.encode()
    return items


def build(**kw) -> tuple[FabricState, dict, FakeFabric]:
    st = FabricState.from_items(make_items(**kw))
    assert st.problems == []
    configs = compile_fabric(st)
    return st, configs, FakeFabric(configs, TRUNK)


def expected(st: FabricState, key: int):
    """(dpid, port, eth_dst) the owner of key should receive, or None for no live owner."""
    layout = Layout.parse(st.services["echo"].layout)
    vid = codec.encode(SID, key, layout=layout).value
    for rec in st.ranges["echo"]:
        if rec.lo <= key <= rec.hi:
            ep = st.endpoints.get(("echo", rec.owner))
            if not rec.owner or ep is None:
                return None
            host = st.hosts[ep.mac]
            return host.dpid, host.port, codec.mac_to_int(ep.mac) if ep.rx == "ovs" else vid
    raise AssertionError(f"key {key:#x} in no range")


def random_keys(n: int, seed: int, ranges=RANGES) -> list[int]:
    rng = random.Random(seed)
    edges = [k for lo, hi, _ in ranges for k in (lo, hi)]
    return edges + [rng.randrange(KEY_MAX + 1) for _ in range(n - len(edges))]


def client_for(owner_host: tuple[int, int] | None, rng: random.Random) -> str:
    names = [h for h, (_, d, p) in HOSTS.items() if (d, p) != owner_host]
    return rng.choice(names)


def send(fab: FakeFabric, host: str, dst: int, src: int | None = None):
    _, dpid, port = HOSTS[host]
    return fab.inject(dpid, port, mac_i(host) if src is None else src, dst, ETH_TYPE)


# -- delivery ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["prefix", "suffix"])
def test_random_keys_reach_exactly_their_owner(layout):
    st, _, fab = build(layout=layout)
    check_partition(rec.range for rec in st.ranges["echo"])
    rng = random.Random(1)
    missed = 0
    for key in random_keys(1000, seed=2):
        want = expected(st, key)
        client = client_for(want[:2] if want else None, rng)
        vid = codec.encode(SID, key, layout=Layout(layout)).value
        got = send(fab, client, vid)
        if want is None:
            assert got == [], f"key {key:#x} has no live owner, yet reached {got}"
            missed += 1
            assert fab.drop_count(Kind.VID_MISS) == missed
        else:
            assert got == [want], f"key {key:#x} from {client}: got {got}, want {want}"
    assert missed > 0 and fab.drop_count() == missed  # nothing else was dropped


def test_rx_mode_decides_the_rewrite():
    st, _, fab = build()
    vid_e1 = codec.encode(SID, 5).value
    vid_e2 = codec.encode(SID, 0x500000).value
    assert send(fab, "h1", vid_e1) == [(S1, 2, mac_i("h2"))]  # ovs: owner MAC, same switch
    assert send(fab, "h1", vid_e2) == [(S2, 1, vid_e2)]  # bpf: VID kept, across the trunk
    assert send(fab, "h4", vid_e1) == [(S1, 2, mac_i("h2"))]  # ovs across the trunk


def test_reassigning_a_range_changes_delivery():
    split = [(0x000000, 0x1FFFFF, "e1"), (0x200000, 0x3FFFFF, "e3"), *RANGES[1:]]
    recs = [schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=2 if lo < 0x400000 else 1,
                            state="active" if o else "unassigned") for lo, hi, o in split]
    st0, cfg0, fab0 = build()
    st1, cfg1, fab1 = build(ranges=recs)
    moved = codec.encode(SID, 0x2ABCDE).value
    kept = codec.encode(SID, 0x1ABCDE).value
    assert send(fab0, "h1", moved) == [(S1, 2, mac_i("h2"))]
    assert send(fab1, "h1", moved) == [(S2, 2, mac_i("h4"))]
    assert send(fab1, "h1", kept) == send(fab0, "h1", kept) == [(S1, 2, mac_i("h2"))]
    for key in random_keys(300, seed=3, ranges=split):
        vid = codec.encode(SID, key).value
        assert send(fab1, "h1", vid) == ([expected(st1, key)] if expected(st1, key) else [])
    # The new flows carry the new epoch in their cookies.
    epochs = {split_cookie(f.cookie)[3] for f in cfg1[S1].flows.values()
              if split_cookie(f.cookie)[0] == Kind.VID_ROUTE and split_cookie(f.cookie)[2] < 0x400000}
    assert epochs == {2}


@pytest.mark.parametrize("s1_new, s2_new", [(True, False), (False, True)])
def test_a_cut_over_is_consistent_per_packet_while_switches_disagree(s1_new, s2_new):
    """A range moves e1 (h2 on s1) -> e3 (h4 on s2), both rx=ovs.  Each switch turns atomically, but
    not at the same time (and a datapath lags its tables): with one switch turned and the other not,
    every frame, whichever switch it enters at, still reaches the old owner or the new one.  (With the
    rewrite at the last hop, a frame turned towards s2 by s1 met s2's old route back to s1, its own
    in-port, and was dropped.)"""
    moved = [(0x000000, 0x3FFFFF, "e3"), *RANGES[1:]]
    recs = [schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=2 if lo == 0 else 1, state="active" if o else "unassigned")
            for lo, hi, o in moved]
    _, old, _ = build()
    _, new, _ = build(ranges=recs)
    for back in (False, True):  # the move and the move back
        a, b = (old, new) if not back else (new, old)
        mixed = FakeFabric({S1: (b if s1_new else a)[S1], S2: (b if s2_new else a)[S2]}, TRUNK)
        owners = {(S1, 2, mac_i("h2")), (S2, 2, mac_i("h4"))}
        for client in ("h1", "h3"):
            for key in (0, 0x12345, 0x2ABCDE, 0x3FFFFF):
                got = send(mixed, client, codec.encode(SID, key).value)
                assert len(got) == 1 and got[0] in owners, f"{client} key {key:#x}: {got}"
        assert mixed.drop_count() == 0


def test_reassigning_to_unassigned_falls_to_miss():
    st, _, fab = build(ranges=[(0, 0x3FFFFF, ""), *RANGES[1:]])
    assert send(fab, "h1", codec.encode(SID, 5).value) == []
    assert fab.drop_count(Kind.VID_MISS) == 1


def test_plain_macs_and_foreign_traffic():
    _, _, fab = build()
    assert send(fab, "h1", mac_i("h4")) == [(S2, 2, mac_i("h4"))]
    assert send(fab, "h3", mac_i("h1")) == [(S1, 1, mac_i("h1"))]
    # Not a VID, not a known host: NORMAL.
    assert send(fab, "h1", 0x02AAAAAAAAAA) == [(S1, "NORMAL", 0x02AAAAAAAAAA)]
    # VID of another service: no live range anywhere -> miss.
    assert send(fab, "h1", codec.encode(SID + 1, 5).value) == []
    assert fab.drop_count(Kind.VID_MISS) == 1


@pytest.mark.parametrize("policy, port", [("controller", "CONTROLLER"), ("flood", "FLOOD")])
def test_miss_policy(policy, port):
    _, _, fab = build(miss=policy)
    vid = codec.encode(SID, 0xF00001).value  # ghost's range
    assert send(fab, "h1", vid) == [(S1, port, vid)]
    assert fab.drop_count() == 0


def test_no_live_owner_hits_the_counted_miss_flow():
    _, cfg, fab = build()
    for key in (0xF00001, 0xF7FFFF, 0xF80000, KEY_MAX):
        assert send(fab, "h3", codec.encode(SID, key).value) == []
    miss = [f for f in cfg[S2].flows.values() if split_cookie(f.cookie)[0] == Kind.VID_MISS]
    assert len(miss) == 1 and miss[0].table == TABLE_ROUTE and miss[0].actions == ()
    assert fab.drops[(S2, miss[0].key)] == 4
    assert fab.drop_count(Kind.VID_MISS, dpid=S1) == 0


# -- port security -----------------------------------------------------------------------
def test_foreign_source_mac_is_denied_and_counted():
    _, cfg, fab = build()
    assert send(fab, "h1", mac_i("h4"), src=mac_i("h2")) == []
    deny = cfg[S1].flows[(TABLE_ADMIT, 200, (("in_port", 1, None),))]
    assert split_cookie(deny.cookie)[:3] == (Kind.DENY, 0, 1) and deny.actions == ()
    assert fab.drops[(S1, deny.key)] == 1
    assert fab.drop_count(Kind.DENY) == 1


def test_vid_sources_only_from_the_services_endpoints():
    """A host carrying an endpoint of the service may source any of its VIDs (a new owner answers at once);
    a client may not, nor may an endpoint source another service's VIDs."""
    _, _, fab = build()
    own = codec.encode(SID, 0x123).value  # e1 (h2) owns it
    foreign = codec.encode(SID, 0x500000).value  # e2 (h3) owns it
    unowned = codec.encode(SID, 0xF90000).value  # nobody
    other_service = codec.encode(SID + 1, 0x123).value
    assert send(fab, "h2", mac_i("h1"), src=own) == [(S1, 1, mac_i("h1"))]
    assert send(fab, "h2", mac_i("h1"), src=foreign) == [(S1, 1, mac_i("h1"))]
    assert send(fab, "h2", mac_i("h1"), src=unowned) == [(S1, 1, mac_i("h1"))]
    assert send(fab, "h2", mac_i("h1"), src=other_service) == []
    assert send(fab, "h1", mac_i("h4"), src=own) == []  # a client may not source a VID
    assert send(fab, "h3", mac_i("h1"), src=foreign) == [(S1, 1, mac_i("h1"))]
    assert fab.drop_count(Kind.DENY) == 2
    assert fab.drop_count(Kind.DENY, dpid=S1) == 2


def test_vid_source_admit_outranks_own_mac_admit():
    """OVS's classifier visits subtables by priority and stops at a match that outranks the rest: a server's
    reply (source = the key's VID) must meet the masked VID-source flow before the own-MAC flow, whose exact
    source lookup would otherwise un-wildcard the whole source, one datapath flow per key and client."""
    st, _, _ = build()
    checked = False
    for cfg in compile_fabric(st).values():
        admit = [f for f in cfg.flows.values() if f.table == TABLE_ADMIT and split_cookie(f.cookie)[0] == Kind.ADMIT]
        src = {f: next((mask for name, _, mask in f.match if name == "eth_src"), "none") for f in admit}
        vid_src = [f for f, mask in src.items() if mask not in ("none", None)]    # masked: a service's VIDs
        own_mac = [f for f, mask in src.items() if mask is None]                 # exact: the host's own MAC
        assert vid_src and own_mac or not vid_src
        if vid_src:
            assert min(f.priority for f in vid_src) > max(f.priority for f in own_mac)
            checked = True
    assert checked, "no switch had both kinds of admit flow: the test proves nothing"


def test_trunk_and_unregistered_ports_are_admitted():
    _, _, fab = build()
    vid = codec.encode(SID, 5).value
    # Back out of the trunk it came in on: OpenFlow drops it rather than bounce it.
    assert fab.inject(S2, 20, 0x02DEADBEEF00, vid, ETH_TYPE) == []
    # From the trunk into s1: trusted whatever the source.
    assert fab.inject(S1, 10, mac_i("h4"), vid, ETH_TYPE) == [(S1, 2, mac_i("h2"))]
    # A port nobody registered (priority-0 admit) goes on to routing.
    assert fab.inject(S1, 7, 0x02DEADBEEF00, vid, ETH_TYPE) == [(S1, 2, mac_i("h2"))]
    assert fab.drop_count() == 0


# -- groups -----------------------------------------------------------------------------
def test_mirror_gets_an_all_group():
    ranges = [schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", mirrors=["e3"], epoch=1),
              *[schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=1, state="active" if o else "unassigned")
                for lo, hi, o in RANGES[1:]]]
    st, cfg, fab = build(ranges=ranges)
    for sw in (S1, S2):
        groups = list(cfg[sw].groups.values())
        assert [g.type for g in groups] == ["all"] and len(groups[0].buckets) == 2
        routes = [f for f in cfg[sw].flows.values() if split_cookie(f.cookie)[0] == Kind.VID_ROUTE
                  and split_cookie(f.cookie)[2] == 0 and f.table == TABLE_ROUTE]
        assert len(routes) == len(to_masks(Range(0, 0x3FFFFF)))
        assert {f.actions for f in routes} == {(("group", groups[0].group_id),)}
    vid = codec.encode(SID, 0x1234).value
    both = sorted([(S1, 2, mac_i("h2")), (S2, 2, mac_i("h4"))])
    assert sorted(send(fab, "h1", vid)) == both
    assert sorted(send(fab, "h3", vid)) == both
    # The mirror may source the range's VIDs too.
    assert send(fab, "h4", mac_i("h1"), src=vid) == [(S1, 1, mac_i("h1"))]
    assert fab.drop_count() == 0


def test_helpers_on_one_switch_get_a_select_group():
    endpoints = dict(ENDPOINTS, e4=("h3", "ovs"), e5=("h4", "ovs"))
    ranges = [schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", helpers=["e4", "e5"], epoch=1),
              *[schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=1, state="active" if o else "unassigned")
                for lo, hi, o in RANGES[1:]]]
    _, cfg, fab = build(ranges=ranges, endpoints=endpoints)
    # Selection happens once, at the first switch: one bucket per helper on every switch.
    for sw in (S1, S2):
        groups = list(cfg[sw].groups.values())
        assert [g.type for g in groups] == ["select"] and len(groups[0].buckets) == 2
    vid = codec.encode(SID, 0x1234).value
    seen = set()
    for i in range(64):
        got = fab.inject(S1, 7, 0x020000001000 + i, vid, ETH_TYPE)
        assert len(got) == 1 and got[0][:2] in {(S2, 1), (S2, 2)}, got
        seen.add(got[0][:2])
    assert seen == {(S2, 1), (S2, 2)}  # the hash spreads sources over both helpers


def test_helpers_across_the_trunk_never_lose_a_frame():
    endpoints = dict(ENDPOINTS, e4=("h3", "ovs"), e5=("h4", "ovs"))
    ranges = [schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", helpers=["e1", "e4", "e5"], epoch=1),
              *[schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=1, state="active" if o else "unassigned")
                for lo, hi, o in RANGES[1:]]]
    _, _, fab = build(ranges=ranges, endpoints=endpoints)
    vid = codec.encode(SID, 0x1234).value
    for i in range(64):
        assert len(fab.inject(S1, 7, 0x020000001000 + i, vid, ETH_TYPE)) == 1


def test_helper_buckets_carry_the_range_weights():
    """Weights from the range record (∝ spare capacity): the buckets carry them and the (weighted) hash
    sends each helper its share; a helper the record does not weigh gets the default; no weights = equal."""
    endpoints = dict(ENDPOINTS, e4=("h3", "ovs"), e5=("h4", "ovs"))
    rest = [schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=1, state="active" if o else "unassigned")
            for lo, hi, o in RANGES[1:]]

    def shares(weights: dict) -> tuple[dict, dict]:
        rec = schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", helpers=["e4", "e5"], epoch=1, weights=weights)
        _, cfg, fab = build(ranges=[rec, *rest], endpoints=endpoints)
        for sw in (S1, S2):
            (g,) = cfg[sw].groups.values()
            by_port = {}
            for b in g.buckets:
                mac = next(v for n, v in b.actions if n == "set_eth_dst")
                by_port[mac] = b.weight
        vid = codec.encode(SID, 0x1234).value
        seen = {mac_i("h3"): 0, mac_i("h4"): 0}
        for i in range(2000):
            (got,) = fab.inject(S1, 7, 0x020000001000 + i, vid, ETH_TYPE)
            seen[got[2]] += 1
        return by_port, seen

    weights, seen = shares({"e4": 90, "e5": 30})
    assert weights == {mac_i("h3"): 90, mac_i("h4"): 30}
    assert 2.4 < seen[mac_i("h3")] / seen[mac_i("h4")] < 3.6, seen        # 3:1
    weights, seen = shares({"e5": 25})
    assert weights == {mac_i("h3"): schema.WEIGHT_DEFAULT, mac_i("h4"): 25}
    weights, seen = shares({})
    assert set(weights.values()) == {schema.WEIGHT_DEFAULT} and 0.8 < seen[mac_i("h3")] / seen[mac_i("h4")] < 1.25


def test_range_weights_are_validated():
    for bad, says in [({"e9": 5}, "names no helper of the range"), ({"e4": 0}, "out of range: an integer 1..65535"),
                      ({"e4": 70000}, "1..65535"), ({"e4": 1.5}, "out of range"), ({"e4": True}, "out of range")]:
        with pytest.raises(Exception, match=says):
            schema.RangeRec(lo=0, hi=5, owner="e1", helpers=["e4"], weights=bad)
    rec = schema.RangeRec(lo=0, hi=5, owner="e1", helpers=["e4"])
    assert "weights" not in rec.to_json()                    # records without weights are unchanged
    again = schema.RangeRec.from_json(schema.RangeRec(lo=0, hi=5, owner="e1", helpers=["e4"],
                                                      weights={"e4": 7}).to_json())
    assert again.weights == {"e4": 7} and again.weight("e4") == 7 and rec.weight("e4") == schema.WEIGHT_DEFAULT


# -- shape of the output -------------------------------------------------------------------
def test_vid_route_flow_count_is_the_sum_of_mask_covers():
    st, cfg, _ = build()
    live = [r for r in st.ranges["echo"] if r.owner in {"e1", "e2", "e3"}]
    want = sum(len(to_masks(r.range)) for r in live)
    assert want > len(live)  # the odd boundaries need several blocks each
    for sw in (S1, S2):
        routes = [f for f in cfg[sw].flows.values() if split_cookie(f.cookie)[0] == Kind.VID_ROUTE
                  and f.table == TABLE_ROUTE]
        assert len(routes) == want
        assert all(f.priority == 1000 and len(f.match) == 1 and f.match[0][0] == "eth_dst" for f in routes)
    # Source admission: one flow per endpoint port and service (whatever its ranges), on its switch only.
    for sw in (S1, S2):
        admits = [f for f in cfg[sw].flows.values() if split_cookie(f.cookie)[:2] == (Kind.ADMIT, SID)]
        ports = {st.hosts[e.mac].port for e in st.endpoints.values() if st.hosts[e.mac].dpid == sw}
        assert sorted(next(v for n, v, _ in f.match if n == "in_port") for f in admits) == sorted(ports)
    assert not [f for f in cfg[S1].flows.values() if split_cookie(f.cookie)[0] == Kind.VID_ROUTE
                and f.table == TABLE_ADMIT]


def test_compile_is_deterministic():
    items = make_items()
    a = compile_fabric(FabricState.from_items(items))
    b = compile_fabric(FabricState.from_items(items))
    c = compile_fabric(FabricState.from_items(dict(reversed(list(items.items())))))
    for other in (b, c):
        assert a == other
        for sw in a:
            assert list(a[sw].flows) == list(other[sw].flows)
            assert list(a[sw].flows.values()) == list(other[sw].flows.values())
            assert a[sw].groups == other[sw].groups


def test_state_from_items_skips_bad_records():
    items = make_items()
    items[schema.endpoint_key("echo", "bad")] = b'{"service": "echo", "name": "bad", "mac": "zz"}'
    items[schema.MISS_KEY] = b"explode"
    items["/elsewhere/x"] = b"ignored"
    st = FabricState.from_items(items)
    assert len(st.problems) == 2 and st.miss == "drop"
    assert ("echo", "bad") not in st.endpoints and len(st.endpoints) == 3


def test_unreachable_owner_gets_no_route_on_the_cut_off_switch():
    st = FabricState.from_items(make_items())
    st.links = []  # the trunk is down
    cfg = compile_fabric(st)
    fab = FakeFabric(cfg, [])
    assert send(fab, "h1", codec.encode(SID, 5).value) == [(S1, 2, mac_i("h2"))]
    assert send(fab, "h1", codec.encode(SID, 0x500000).value) == []  # e2 is on s2
    assert fab.drop_count(Kind.VID_MISS) == 1


def test_update_order_commits_nearest_to_the_new_owner_first():
    from vfab.controller.reconcile import Plan, update_order
    from vfab.fabric.flows import FlowSpec, make_cookie, match
    from vfab.fabric.topology import distances, next_hops

    # line a - b - c; a range moves to an owner on c: c, then b, then a.
    links = [(1, 9, 2, 8), (2, 8, 1, 9), (2, 7, 3, 6), (3, 6, 2, 7)]
    dist = distances([1, 2, 3], next_hops([1, 2, 3], links), links)
    assert dist[(1, 3)] == 2 and dist[(3, 3)] == 0 and dist[(2, 1)] == 1
    route = FlowSpec(1, 1000, match(eth_dst=(0x0E0001000000, 0xFFFFFF800000)), (("output", 1),),
                     make_cookie(Kind.VID_ROUTE, 1, 0, 2))
    plans = {1: Plan(add_flows=[route]), 2: Plan(add_flows=[route]), 3: Plan(add_flows=[route]), 4: Plan()}
    assert update_order(plans, lambda cookie: 3, dist) == [4, 3, 2, 1]


@pytest.mark.parametrize("layout", ["prefix", "suffix"])
def test_block_matcher_agrees_with_the_codec(layout):
    from vfab.fabric.compiler import block_matcher

    rng = random.Random(9)
    for sid in (1, SID, codec.SERVICE_MAX):
        block = block_matcher(sid, layout)
        for _ in range(300):
            mask = KEY_MAX ^ ((1 << rng.randrange(25)) - 1)
            value = rng.randrange(KEY_MAX + 1)
            assert block(value, mask) == codec.block_match(sid, value, mask, layout=Layout(layout))


def test_next_hops_may_be_handed_in():
    from vfab.fabric.topology import next_hops

    st = FabricState.from_items(make_items())
    hops = next_hops(sorted(st.switches), [(lk.dpid, lk.port, lk.peer_dpid, lk.peer_port) for lk in st.links])
    assert compile_fabric(st, hops=hops) == compile_fabric(st)
    # No paths handed in: nothing is routed over the trunk.
    cut = compile_fabric(st, hops={})
    assert not any(("output", 10) in f.actions for f in cut[S1].flows.values())
    assert any(("output", 10) in f.actions for f in compile_fabric(st)[S1].flows.values())


# -- endpoints whose record etcd deleted moments ago (the controller's linger) ---------------------------------
def test_a_lingering_owner_still_gets_its_range_and_may_answer_but_a_lingering_helper_gets_no_bucket():
    """etcd expired e1's lease (a machine paused past it expires every lease at once): its record is gone, but
    while it lingers its range still reaches it (nobody else serves it) and its host may still answer from the
    service's VIDs.  A lingering helper gets no bucket: the live ones (or the owner) take its frames at once."""
    endpoints = dict(ENDPOINTS, e4=("h3", "ovs"), e5=("h4", "ovs"))
    ranges = [schema.RangeRec(lo=0, hi=0x3FFFFF, owner="e1", helpers=["e4", "e5"], epoch=1),
              *[schema.RangeRec(lo=lo, hi=hi, owner=o, epoch=1, state="active" if o else "unassigned")
                for lo, hi, o in RANGES[1:]]]
    items = make_items(ranges=ranges, endpoints=endpoints)
    gone = {k: items.pop(k) for k in (schema.endpoint_key("echo", "e1"), schema.endpoint_key("echo", "e4"))}
    vid = codec.encode(SID, 0x1234).value

    # Without the linger (before): e1's range reaches only e5 now; had e5 gone too, nothing at all.
    st = FabricState.from_items(items)
    fab = FakeFabric(compile_fabric(st), TRUNK)
    assert all(fab.inject(S1, 7, 0x020000001000 + i, vid, ETH_TYPE)[0][:2] == (S2, 2) for i in range(16))

    st = FabricState.from_items(items, lingering=gone)
    assert set(st.lingering) == {("echo", "e1"), ("echo", "e4")} and ("echo", "e1") not in st.endpoints
    cfg = compile_fabric(st)
    fab = FakeFabric(cfg, TRUNK)
    # e4 lingers but gets no bucket: one live helper left, so no group at all
    assert all(fab.inject(S1, 7, 0x020000001000 + i, vid, ETH_TYPE)[0][:2] == (S2, 2) for i in range(16))
    assert not any(g.type == "select" for c in cfg.values() for g in c.groups.values())

    # every helper gone: the lingering owner gets the range (before, these frames were dropped)
    items.pop(schema.endpoint_key("echo", "e5"))
    st = FabricState.from_items(items, lingering=gone)
    fab = FakeFabric(compile_fabric(st), TRUNK)
    assert send(fab, "h3", vid) == [(S1, 2, mac_i("h2"))]
    assert send(fab, "h2", mac_i("h1"), src=vid) == [(S1, 1, mac_i("h1"))]   # it may answer from the VID
    assert fab.drop_count() == 0
    st = FabricState.from_items(items)
    fab = FakeFabric(compile_fabric(st), TRUNK)
    assert send(fab, "h3", vid) == [] and send(fab, "h2", mac_i("h1"), src=vid) == []


def test_a_lingering_record_yields_to_a_live_one_and_to_a_new_owner():
    """Lingering never overrides etcd: the record back (a new registration, perhaps elsewhere) wins, and a range
    handed to another owner goes there; a lingering record that does not parse is left out."""
    items = make_items()
    key = schema.endpoint_key("echo", "e1")
    old = items[key]
    moved = dict(ENDPOINTS, e1=("h1", "ovs"))
    items = make_items(endpoints=moved)                      # e1 registered again, at h1
    st = FabricState.from_items(items, lingering={key: old})
    assert st.lingering == {} and st.endpoints[("echo", "e1")].host == "h1"
    fab = FakeFabric(compile_fabric(st), TRUNK)
    assert send(fab, "h3", codec.encode(SID, 0x1234).value) == [(S1, 1, mac_i("h1"))]

    ranges = [(0x000000, 0x3FFFFF, "e3"), *RANGES[1:]]         # its range went to e3 meanwhile
    items = make_items(ranges=ranges)
    items.pop(key)
    st = FabricState.from_items(items, lingering={key: old, schema.endpoint_key("echo", "bad"): b"{"})
    assert set(st.lingering) == {("echo", "e1")}
    fab = FakeFabric(compile_fabric(st), TRUNK)
    assert send(fab, "h1", codec.encode(SID, 0x1234).value) == [(S2, 2, mac_i("h4"))]
