"""Two-level routing on the fake flow table: every key reaches its owner's node and port from any node, and
a switch's flows grow with its own ranges and the number of nodes, not with the fabric's ranges."""

from __future__ import annotations

import random

from vfab.fabric.flows import TABLE_ADMIT, TABLE_ROUTE, FlowSpec, Kind, SwitchConfig, make_cookie, match
from vfab.fabric.tworoute import MISS, Owned, node_routes, remote_prefixes
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec

SVC = 7
LOCAL_PORT, CLIENT_PORT = 1, 2


def tport(a: int, b: int) -> int:
    """On node a, the port of the tunnel to node b."""
    return 10 + b


def fabric(ranges: list[Owned], n: int) -> tuple[FakeFabric, dict[int, int]]:
    configs, sizes = {}, {}
    names = [f"n{i}" for i in range(1, n + 1)]
    for i, me in enumerate(names, 1):
        cfg = SwitchConfig(dpid=i)
        cfg.add(FlowSpec(TABLE_ADMIT, 0, match(), (("goto", TABLE_ROUTE),), make_cookie(Kind.BASE)))
        routes = node_routes(SVC, "prefix", ranges, me, {f"n{j}": tport(i, j) for j in range(1, n + 1) if j != i},
                             lambda r: (("output", LOCAL_PORT),))
        for f in routes:
            cfg.add(f)
        configs[i] = cfg
        sizes[i] = len(routes)
    links = [(i, tport(i, j), j, tport(j, i)) for i in range(1, n + 1) for j in range(1, n + 1) if i != j]
    return FakeFabric(configs, links), sizes


def owner_of(ranges: list[Owned], key: int) -> str:
    return next((r.node for r in ranges if r.lo <= key <= r.hi), MISS)


def check_every_node_reaches_the_owner(ranges: list[Owned], n: int, samples: int = 300) -> dict[int, int]:
    table, sizes = fabric(ranges, n)
    rnd = random.Random(5)
    keys = [r.lo for r in ranges] + [r.hi for r in ranges] + [rnd.randrange(1 << 24) for _ in range(samples)]
    for key in keys:
        vid = codec.encode(SVC, key).value
        owner = owner_of(ranges, key)
        for ingress in range(1, n + 1):
            got = table.inject(ingress, CLIENT_PORT, 0x02FB00000001, vid, 0x88B5)
            want = [] if owner == MISS else [(int(owner[1:]), LOCAL_PORT, vid)]
            assert got == want, f"key {key:#x} from n{ingress}: {got}, owner {owner or 'none'}"
            if owner == MISS:   # not even sent into a tunnel to be dropped there
                hit = table.lookup(ingress, TABLE_ROUTE, {"in_port": CLIENT_PORT, "eth_dst": vid, "eth_type": 0x88B5})
                assert hit is None or hit.actions == (), f"key {key:#x} of no range from n{ingress}: {hit}"
    return sizes


def split(n_ranges: int, owners) -> list[Owned]:
    step = (1 << 24) // n_ranges
    return [Owned(i * step, (i + 1) * step - 1, owners(i)) for i in range(n_ranges)]


def test_contiguous_ownership_is_one_prefix_per_remote_node():
    n, per = 4, 64
    ranges = split(n * per, lambda i: f"n{i // per + 1}")
    sizes = check_every_node_reaches_the_owner(ranges, n)
    for node in range(1, n + 1):
        assert sizes[node] == per + (n - 1)       # its own 64 ranges' blocks + one prefix per other node
    assert len(remote_prefixes(ranges, "n1")) == 3


def test_flows_per_switch_do_not_grow_with_the_fabrics_ranges():
    # the same 4 nodes with 16x the ranges: each switch grows with its own ranges only
    small = split(4 * 4, lambda i: f"n{i // 4 + 1}")
    big = split(4 * 64, lambda i: f"n{i // 64 + 1}")
    assert len(remote_prefixes(small, "n2")) == len(remote_prefixes(big, "n2")) == 3


def test_interleaved_and_uneven_ownership_still_routes_right():
    rnd = random.Random(3)
    bounds = sorted(rnd.sample(range(1, 1 << 24), 40))
    los = [0, *bounds]
    his = [b - 1 for b in bounds] + [(1 << 24) - 1]
    ranges = [Owned(lo, hi, rnd.choice(["n1", "n2", "n3", MISS])) for lo, hi in zip(los, his)]
    check_every_node_reaches_the_owner(ranges, 3, samples=200)


def test_unowned_keys_and_a_node_without_a_tunnel_go_nowhere():
    ranges = [Owned(0, 0x7FFFFF, "n1"), Owned(0x800000, 0xBFFFFF, MISS), Owned(0xC00000, 0xFFFFFF, "n2")]
    check_every_node_reaches_the_owner(ranges, 2)
    flows = node_routes(SVC, "prefix", ranges, "n1", {}, lambda r: (("output", 1),))
    rest = [f for f in flows if f.actions != (("output", 1),)]
    assert rest and all(f.actions == () for f in rest), rest   # no tunnel yet: dropped


def test_keys_no_range_covers_go_nowhere():
    # a gap (no record at all) inside what n2 owns: n2's prefix must not swallow it
    ranges = [Owned(0, 0x4FFFFF, "n2"), Owned(0x500000, 0x5FFFFF, "n1"), Owned(0x800000, 0xFFFFFF, "n2")]
    check_every_node_reaches_the_owner(ranges, 2)


def test_ranges_in_any_order_and_neighbours_of_one_owner_route_right():
    # the compiler merges neighbouring ranges of one node into one stretch: given shuffled, with runs of one
    # owner, unowned records and gaps, every key still reaches its owner from every node
    rnd = random.Random(11)
    bounds = sorted(rnd.sample(range(1, 1 << 24), 60))
    los, his = [0, *bounds], [b - 1 for b in bounds] + [(1 << 24) - 1]
    owner = "n1"
    ranges = []
    for lo, hi in zip(los, his):
        if rnd.random() < 0.3:
            owner = rnd.choice(["n1", "n2", "n3", "n4", MISS])
        if rnd.random() < 0.9:      # else a gap: no record
            ranges.append(Owned(lo, hi, owner))
    rnd.shuffle(ranges)
    check_every_node_reaches_the_owner(ranges, 4, samples=200)


def test_a_node_owning_one_stretch_costs_one_prefix_elsewhere_however_many_ranges_it_holds():
    # 1,024 ranges, n2 owns the upper half (512 of them): on n1 one prefix (n1's own keys are don't-care, so
    # it may cover them: its exact flows sit above), on n3 one per owner; not 512 or their blocks
    ranges = split(1024, lambda i: "n1" if i < 512 else "n2")
    assert remote_prefixes(ranges, "n1") == [(0, 0, "n2")]
    assert [p for p in remote_prefixes(ranges, "n3") if p[2] != MISS] in ([(0, 0, "n1"), (1 << 23, 1, "n2")],
                                                                            [(0, 0, "n2"), (0, 1, "n1")])
