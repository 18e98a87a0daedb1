"""fabric/nodecompile.py on the fake flow table: three nodes, each switch compiled from etcd alone.

Node ``nK`` has dpid K, a client port 1, a server port 2, and a tunnel to node ``nJ`` on port 10 + J (the
fake fabric links them like trunks).  Frames from node 1's client must reach the range's owner however the
nodes' compiles interleave during a move from a server on n3 to one on n2; a switch holds its own ranges
plus about one prefix per other node.
"""

from __future__ import annotations

import itertools

from vfab.fabric.flows import TABLE_ROUTE, Kind, split_cookie
from vfab.fabric.nodecompile import Memory, compile_node
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid import codec
from vfab.vid.registry import schema

SID = 9
N = 3
CLIENT, SERVER = 1, 2


def mac(n: int, port: int) -> str:
    return f"02:fb:00:{n:02x}:00:{port:02x}"


def tport(a: int, b: int) -> int:
    return 10 + b


def items(ranges, applied: dict[int, int] | None = None, nodes: int = N) -> dict[str, bytes]:
    """``ranges``: (lo, hi, owner endpoint) with endpoint ``sK`` the server on node K."""
    recs: list[tuple[str, schema.Record]] = [(schema.service_key("kv"), schema.Service(name="kv", id=SID))]
    for n in range(1, nodes + 1):
        recs.append((schema.node_key(f"n{n}"), schema.Node(name=f"n{n}", tunnel_ip=f"172.16.45.{n}", dpid=n,
                                                           bridge="vfint")))
        for port in (CLIENT, SERVER):
            recs.append((schema.host_key(mac(n, port)), schema.Host(mac=mac(n, port), dpid=n, port=port)))
        recs.append((schema.endpoint_key("kv", f"s{n}"), schema.Endpoint(service="kv", name=f"s{n}",
                                                                          mac=mac(n, SERVER))))
    for e, (lo, hi, owner) in enumerate(ranges):
        recs.append((schema.range_key("kv", lo), schema.RangeRec(lo=lo, hi=hi, owner=owner, epoch=e + 1)))
    for n, rev in (applied or {}).items():
        recs.append((schema.applied_key(n), schema.Applied(dpid=n, revision=rev, flows=0)))
    return {k: v.to_json().encode() for k, v in recs}


def compile_(n: int, its: dict, rev: int, mem: Memory | None = None, nodes: int = N):
    out = compile_node(its, f"n{n}", rev, mem, tunnel_ports={f"n{j}": tport(n, j) for j in range(1, nodes + 1)
                                                             if j != n})
    assert out.error == "", out.error
    return out


def fabric(configs: dict) -> FakeFabric:
    n = len(configs)
    links = [(i, tport(i, j), j, tport(j, i)) for i in range(1, n + 1) for j in range(1, n + 1) if i != j]
    return FakeFabric(configs, links)


def send(fab: FakeFabric, ingress: int, key: int):
    vid = codec.encode(SID, key).value
    return fab.inject(ingress, CLIENT, codec.mac_to_int(mac(ingress, CLIENT)), vid, 0x88B5)


def at(n: int) -> tuple[int, int, int]:
    """Where a frame for a range owned by ``sN`` must leave: node N's server port, rewritten to its MAC."""
    return (n, SERVER, codec.mac_to_int(mac(n, SERVER)))


HALF = codec.KEY_MAX // 2
BEFORE = [(0, 99, "s1"), (100, 199, "s3"), (200, HALF, "s2"), (HALF + 1, codec.KEY_MAX, "s3")]


def test_every_node_reaches_every_owner_through_the_tunnels():
    its = items(BEFORE)
    fab = fabric({n: compile_(n, its, 10).config for n in range(1, N + 1)})
    for ingress in range(1, N + 1):
        for key, owner in ((5, 1), (150, 3), (300, 2), (HALF + 7, 3), (codec.KEY_MAX, 3)):
            assert send(fab, ingress, key) == [at(owner)], (ingress, key)
    # the reply path: a server's answer to a client on another node is a host route into the tunnel
    got = fab.inject(3, SERVER, codec.mac_to_int(mac(3, SERVER)), codec.mac_to_int(mac(1, CLIENT)), 0x88B5)
    assert got == [(1, CLIENT, codec.mac_to_int(mac(1, CLIENT)))]


def test_a_frame_from_a_tunnel_is_never_flooded():
    fab = fabric({n: compile_(n, items(BEFORE), 10).config for n in range(1, N + 1)})
    stranger = 0x020000000099
    assert fab.inject(2, tport(2, 1), codec.mac_to_int(mac(1, CLIENT)), stranger, 0x0800) == []
    # while a local port's unknown frame still goes to NORMAL (the single-host behaviour)
    assert fab.inject(2, CLIENT, codec.mac_to_int(mac(2, CLIENT)), stranger, 0x0800) == [(2, "NORMAL", stranger)]


def test_flows_per_switch_grow_with_local_ranges_and_nodes_not_with_the_fabric():
    def routes(k: int) -> list[int]:
        """4k ranges of 2^n keys: the first quarter on s1, the second on s2, the second half on s3."""
        step = (codec.KEY_MAX + 1) // (4 * k)
        rs = [(i * step, (i + 1) * step - 1, f"s{min(i // k + 1, 3)}") for i in range(4 * k)]
        its = items(rs)
        out = []
        for n in range(1, N + 1):
            cfg = compile_(n, its, 10).config
            out.append(sum(1 for f in cfg.flows.values()
                           if split_cookie(f.cookie)[0] in (Kind.VID_ROUTE, Kind.REMOTE)))
        return out
    small, big = routes(2), routes(64)
    # own ranges (a range of 2^n keys is one block) + per other node one prefix and its way back (IN_PORT)
    assert small == [2 + 4, 2 + 4, 4 + 4], small
    assert big == [64 + 4, 64 + 4, 128 + 4], big


def test_move_between_nodes_in_any_interleaving_loses_no_frame():
    """A range moves from s3 (node 3) to s2 (node 2).  Each node compiles the new state, in every order,
    and keeps the old route until node 2 has reported the move applied; frames from every ingress reach the
    old or the new owner at every moment, never nobody."""
    before = items(BEFORE)
    after_ranges = [r if r[0] != 100 else (100, 199, "s2") for r in BEFORE]
    old = {n: compile_(n, before, 10) for n in range(1, N + 1)}
    seen_rev = 20
    pending = {n: compile_(n, items(after_ranges), seen_rev, old[n].memory) for n in range(1, N + 1)}
    # node 2 (the new owner's) turns at once; nodes 1 and 3 wait for it
    assert pending[2].waiting == {}
    assert pending[1].waiting == {"n2": seen_rev} and pending[3].waiting == {"n2": seen_rev}
    done = {n: compile_(n, items(after_ranges, applied={2: 21}), 22, pending[n].memory) for n in range(1, N + 1)}
    assert all(d.waiting == {} for d in done.values())
    stages = [old, pending, done]
    for combo in itertools.product(range(3), repeat=N):
        # node 2 only reports once it committed: a node can be at stage 2 only if node 2 is past stage 0
        if combo[1] == 0 and max(combo) == 2:
            continue
        fab = fabric({n: stages[s][n].config for n, s in zip(range(1, N + 1), combo)})
        for ingress in range(1, N + 1):
            got = send(fab, ingress, 150)
            assert got in ([at(3)], [at(2)]), (combo, ingress, got)
        if combo[2] == 2:   # the old owner's node turned: a straggler still on its way there goes on to node 2
            straggler = fab.inject(3, tport(3, 1), codec.mac_to_int(mac(1, CLIENT)), codec.encode(SID, 150).value,
                                   0x88B5)
            assert straggler == [at(2)], combo
    # all turned: every ingress reaches node 2
    fab = fabric({n: done[n].config for n in done})
    assert all(send(fab, i, 150) == [at(2)] for i in range(1, N + 1))


def test_a_straggler_goes_back_to_the_ingress_that_became_the_owner():
    """The range moves from s3 to s1, on the ingress node itself: node 1 turns at once, node 3 once node 1 has
    applied.  A frame node 1 sent to node 3 before it turned and that reaches node 3 after node 3 turned goes
    back to node 1 (IN_PORT): without that rule OpenFlow drops it (never out of its in-port), which lost 19 of
    6,468 frames at 4 hosts in bench/cutover_hosts.py."""
    before, after = items([(0, 99, "s3")]), items([(0, 99, "s1")], applied={1: 31})
    n3_new = compile_(3, after, 31, compile_(3, before, 10).memory).config
    fab = fabric({1: compile_(1, after, 30, compile_(1, before, 10).memory).config, 2: compile_(2, after, 31).config,
                  3: n3_new})
    straggler = fab.inject(3, tport(3, 1), codec.mac_to_int(mac(1, CLIENT)), codec.encode(SID, 5).value, 0x88B5)
    assert straggler == [at(1)]
    assert send(fab, 1, 5) == [at(1)] and send(fab, 2, 5) == [at(1)]


def test_memory_handles_a_split_onto_another_node():
    before = items([(0, 199, "s3")])
    after = items([(0, 99, "s3"), (100, 199, "s2")])
    m1 = compile_(1, before, 10).memory
    held = compile_(1, after, 20, m1)
    assert held.waiting == {"n2": 20}
    fab = fabric({1: held.config, 2: compile_(2, after, 20).config, 3: compile_(3, after, 20, compile_(3, before,
                                                                                                    10).memory).config})
    assert send(fab, 1, 150) == [at(3)]   # not yet: node 2 has not applied the split
    assert send(fab, 1, 50) == [at(3)]
    done = compile_(1, items([(0, 99, "s3"), (100, 199, "s2")], applied={2: 20}), 21, held.memory)
    assert done.waiting == {}
    fab = fabric({1: done.config, 2: compile_(2, after, 20).config, 3: compile_(3, after, 21).config})
    assert send(fab, 1, 150) == [at(2)] and send(fab, 1, 50) == [at(3)]


def test_an_unregistered_node_is_an_error_and_a_missing_tunnel_drops():
    out = compile_node(items(BEFORE), "n9", 5)
    assert out.config is None and "n9" in out.error and "node join" in out.error
    cfg = compile_node(items(BEFORE), "n1", 5, tunnel_ports={}).config
    remote = [f for f in cfg.flows.values() if split_cookie(f.cookie)[0] == Kind.REMOTE]
    assert remote and all(f.actions == () and f.table == TABLE_ROUTE for f in remote)


def test_the_route_agents_round_commits_its_own_switch_only_and_finds_tunnels_by_name():
    from vfab.controller.nodeplan import plan_node_round
    from vfab.fabric import tunnels

    its = items(BEFORE)
    ports = {tunnels.port_name(f"172.16.45.{j}"): tport(1, j) for j in (2, 3)}
    installed = {1: ({}, {}), 2: ({}, {})}     # another switch connected by mistake: left alone
    rnd, nc = plan_node_round(its, 10, installed, "n1", Memory(), switch_ports=ports)
    assert rnd.error is None and [c.dpid for c in rnd.commits] == [1]
    assert [r.dpid for r in rnd.reports] == [1] and rnd.reports[0].flows == len(nc.config.flows)
    outs = {a[1] for f in nc.config.flows.values() if split_cookie(f.cookie)[0] == Kind.REMOTE for a in f.actions
            if a[0] == "output"}
    assert outs == {tport(1, 2), tport(1, 3)}
    # once committed and reported: nothing to do, nothing to report
    again, _ = plan_node_round(its, 10, {1: (nc.config.flows, nc.config.groups)}, "n1", nc.memory,
                               switch_ports=ports, reported={1: 10})
    assert again.commits == [] and again.reports == []
    # not connected yet: no step, no report (planned once its tables are read)
    later, _ = plan_node_round(its, 11, {}, "n1", nc.memory, switch_ports=ports)
    assert later.steps == [] and later.reports == []
