"""The plan of a node's drain (vfab.controller.drain.plan): which endpoint's ranges go where, or why not."""

from __future__ import annotations

import pytest

from vfab.controller.drain import DrainError, plan
from vfab.vid.registry import schema


def node(name: str, machine: str) -> schema.Node:
    return schema.Node(name=name, tunnel_ip=f"10.0.0.{len(name)}", dpid=1, bridge="br", agent=f"42@{machine}")


def ep(name: str, machine: str, ctl: str = "", mac: str = "02:00:00:00:00:01") -> schema.Endpoint:
    return schema.Endpoint(service="kv", name=name, mac=mac, host=machine, ctl=ctl)


def rng(lo: int, hi: int, owner: str) -> schema.RangeRec:
    return schema.RangeRec(lo=lo, hi=hi, owner=owner)


def test_stateless_ranges_go_to_the_least_loaded_endpoint_elsewhere():
    eps = {"kv": [ep("a", "m1"), ep("b", "m2"), ep("c", "m2"), ep("d", "m3")]}
    ranges = {"kv": [rng(0, 9, "a"), rng(10, 19, "a"), rng(20, 29, "b"), rng(30, 39, "d"), rng(40, 49, "d")]}
    steps = plan(node("n1", "m1"), [node("n2", "m2"), node("n3", "m3")], eps, ranges)
    assert [(s.source, s.peer, [str(r) for r in s.ranges], s.stateful) for s in steps] == \
        [("a", "c", [str(ranges["kv"][0].range), str(ranges["kv"][1].range)], False)]


def test_stateful_endpoints_go_to_stateful_ones_only():
    eps = {"kv": [ep("a", "m1", ctl="tcp://10.0.0.1:5000"), ep("b", "m2"), ep("c", "m3", ctl="tcp://10.0.0.3:5000")]}
    steps = plan(node("n1", "m1"), [node("n2", "m2"), node("n3", "m3")], eps, {"kv": [rng(0, 9, "a")]})
    assert [(s.source, s.peer, s.stateful) for s in steps] == [("a", "c", True)]


def test_nothing_owned_nothing_to_do():
    eps = {"kv": [ep("a", "m1"), ep("b", "m2")]}
    assert plan(node("n1", "m1"), [node("n2", "m2")], eps, {"kv": [rng(0, 9, "b")]}) == []


def test_refused_when_no_other_node_runs_the_service():
    eps = {"kv": [ep("a", "m1"), ep("b", "m1")]}
    with pytest.raises(DrainError, match=r"kv/a owns 1 range\(s\) and no endpoint of kv runs on another node"):
        plan(node("n1", "m1"), [node("n2", "m2")], eps, {"kv": [rng(0, 9, "a"), rng(10, 19, "b")]})
    eps = {"kv": [ep("a", "m1", ctl="tcp://x:1"), ep("b", "m2")]}
    with pytest.raises(DrainError, match="no stateful endpoint of kv"):
        plan(node("n1", "m1"), [node("n2", "m2")], eps, {"kv": [rng(0, 9, "a")]})


def test_refused_when_two_nodes_share_a_host_name():
    with pytest.raises(DrainError, match="shares its host name 'm1' with node\\(s\\) n2"):
        plan(node("n1", "m1"), [node("n2", "m1")], {}, {})
