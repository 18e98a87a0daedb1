"""compile_node's incremental path (``changed``): after random sequences of changes it gives what a full
recompile gives (flows, groups up to their ids, routes, memory, waits), on the fake flow table too; and the
check fails when the incremental path leaves out a service it should have compiled again."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bench import scale_model as model
from bench.scale import endpoint_mac, records
from vfab.fabric import nodecompile
from vfab.fabric.nodecompile import compile_node
from vfab.fabric.compiler import block_matcher
from vfab.fabric.flows import TABLE_ROUTE
from vfab.testbed.fakeoftable import FakeFabric
from vfab.vid.codec import KEY_BITS
from vfab.vid.registry import schema

NODES = 4
EXTRA_PORT = 50     # each service's extra endpoint "x" sits on n1 (port 50 + sid): mirrors and helpers make groups


def workload_items() -> tuple[model.Workload, dict[str, bytes]]:
    w = model.Workload(6, 6, NODES, per_service=3)
    out = records(w)
    for sid in w.owned:
        mac = endpoint_mac(sid, 9)
        out[schema.endpoint_key(f"s{sid}", "x")] = schema.Endpoint(service=f"s{sid}", name="x", mac=mac,
                                                                   host="n1").to_json()
        out[schema.host_key(mac)] = schema.Host(mac=mac, dpid=1, port=EXTRA_PORT + sid).to_json()
    return w, {k: v.encode() for k, v in out.items()}


def ranges_of(items: dict[str, bytes]) -> list[tuple[str, schema.RangeRec]]:
    prefix = schema.folder("ranges")
    return sorted((k, schema.RangeRec.from_json(v, k)) for k, v in items.items() if k.startswith(prefix))


def change(rnd: random.Random, items: dict[str, bytes], revision: int) -> set[str]:
    """One random change of the mirror, as a watch response would bring it: the keys it wrote or deleted."""
    key, rec = rnd.choice(ranges_of(items))
    svc = key.split("/")[-2]
    names = ["e0", "e1", "e2", "x"]
    op = rnd.choice(["owner", "owner", "owner", "split", "delete", "mirror", "helpers", "unassign", "applied",
                     "endpoint"])
    if op == "owner":
        new = {key: replace(rec, owner=rnd.choice(names), epoch=rec.epoch + 1)}
    elif op == "split" and rec.hi > rec.lo:
        mid = rnd.randint(rec.lo, rec.hi - 1)
        new = {key: replace(rec, hi=mid, epoch=rec.epoch + 1),
               schema.range_key(svc, mid + 1): replace(rec, lo=mid + 1, owner=rnd.choice(names), epoch=1)}
    elif op == "delete":
        new = {key: None}
    elif op == "mirror":
        new = {key: replace(rec, mirrors=[] if rec.mirrors else ["x"], epoch=rec.epoch + 1)}
    elif op == "helpers":
        new = {key: replace(rec, helpers=[] if rec.helpers else ["x", rnd.choice(names[:3])], epoch=rec.epoch + 1)}
    elif op == "unassign":
        new = {key: replace(rec, state="active" if rec.state == "unassigned" else "unassigned")}
    elif op == "applied":   # a node reports a revision applied (releases the moves held for it)
        dpid = rnd.randint(1, NODES)
        new = {schema.applied_key(dpid): schema.Applied(dpid=dpid, revision=rnd.randint(revision - 3, revision),
                                                        flows=0)}
    else:                   # not a range: the whole switch is compiled again
        ek = schema.endpoint_key(svc, rnd.choice(names[:3]))
        ep = schema.Endpoint.from_json(items[ek], ek)
        mac = endpoint_mac(rnd.randint(1, 6), rnd.randint(0, 2))
        new = {ek: replace(ep, mac=mac)}
    for k, v in new.items():
        if v is None:
            items.pop(k, None)
        else:
            items[k] = v.to_json().encode()
    return set(new)


def canonical_actions(cfg, actions) -> tuple:
    """``actions`` with each group action replaced by the group itself (ids are the compile's order)."""
    return tuple(("group", cfg.groups[a[1]].type, cfg.groups[a[1]].buckets) if a[0] == "group" else a
                 for a in actions)


def canonical(cfg) -> tuple[dict, list]:
    flows = {k: replace(f, actions=canonical_actions(cfg, f.actions)) for k, f in cfg.flows.items()}
    return flows, sorted(repr((g.type, g.buckets)) for g in cfg.groups.values())


def check_sequence(seed: int, steps: int = 60, me: str = "n1") -> int:
    """Random changes compiled incrementally and fully side by side; returns how many were incremental."""
    rnd = random.Random(seed)
    _, items = workload_items()
    ports = model.tunnel_ports(NODES, me)
    inc = full = compile_node(items, me, 1, tunnel_ports=ports)
    assert inc.memory.base is not None
    incremental = 0
    for revision in range(2, steps + 2):
        changed = change(rnd, items, revision)
        incremental += nodecompile._touched(inc.memory, changed) is not None
        inc = compile_node(items, me, revision, inc.memory, tunnel_ports=ports, changed=changed)
        full = compile_node(items, me, revision, full.memory, tunnel_ports=ports)
        assert inc.error == full.error == ""
        assert canonical(inc.config) == canonical(full.config), (seed, revision, changed)
        assert inc.waiting == full.waiting, (seed, revision)
        assert inc.memory.routes == full.memory.routes and inc.memory.seen == full.memory.seen
        assert inc.memory.waits == full.memory.waits
    # the fake flow table (strict: two flows of one priority matching one frame fail): each range's first and
    # last key meet the same route flow, and its group (or output) alike, in the incremental and the full table
    dpid = int(me[1:])
    tables = [FakeFabric({dpid: c.config}, []) for c in (inc, full)]
    for key, rec in ranges_of(items):
        svc = schema.Service.from_json(items[schema.service_key(key.split("/")[-2])], "")
        block = block_matcher(svc.id, svc.layout)
        for k in (rec.lo, rec.hi):
            dst = block(k, (1 << KEY_BITS) - 1)[0]
            got = [t.lookup(dpid, TABLE_ROUTE, {"in_port": 1, "eth_dst": dst}) for t in tables]
            assert (got[0] is None) == (got[1] is None)
            if got[0] is not None:
                assert got[0].key == got[1].key and canonical_actions(inc.config, got[0].actions) == \
                    canonical_actions(full.config, got[1].actions)
    return incremental


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_a_full_recompile(seed):
    for me in ("n1", "n2"):
        assert check_sequence(seed, me=me) > 20   # most changes took the incremental path


def test_a_change_of_ranges_compiles_only_its_service(monkeypatch):
    _, items = workload_items()
    ports = model.tunnel_ports(NODES, "n1")
    first = compile_node(items, "n1", 1, tunnel_ports=ports)
    key, rec = ranges_of(items)[0]
    items[key] = replace(rec, owner="e2", epoch=rec.epoch + 1).to_json().encode()
    compiled = []
    real = nodecompile._decide_service
    monkeypatch.setattr(nodecompile, "_decide_service", lambda st, s, *a: compiled.append(s) or real(st, s, *a))
    again = compile_node(items, "n1", 2, first.memory, tunnel_ports=ports, changed={key})
    assert compiled == [key.split("/")[-2]]
    assert again.memory.base.st is not first.memory.base.st


@pytest.mark.parametrize("drop", ["changed", "held"])
def test_the_check_fails_when_a_service_is_skipped(monkeypatch, drop):
    real = nodecompile._touched

    def skipping(memory, changed):
        got = real(memory, changed)
        if got is None:
            return None
        if drop == "held":
            return got - set(memory.waits)
        ranged = sorted(k.split("/")[-2] for k in changed if k.startswith(schema.folder("ranges")))
        return got - set(ranged[:1])
    monkeypatch.setattr(nodecompile, "_touched", skipping)
    with pytest.raises(AssertionError):
        for seed in range(6):
            for me in ("n1", "n2"):
                check_sequence(seed, me=me)
