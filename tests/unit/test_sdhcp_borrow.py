"""Two real shards (the sdhcp server loop on veths, real etcd) with their block agents (services/sdhcp/agent.py):
a shard whose share of the pool runs dry borrows addresses from the other through etcd, within one DHCP retry,
while its clients keep coming; no address is handed out twice; ``vfab sdhcp status`` shows the blocks.

The pool has exactly as many addresses as there are clients (40), and every client's key is in s1's half (so
s1's home slice, 20 addresses, is half of what it needs).  Without the agents (the home-key rule: the code
before issue 44's blocks) 20 clients stay without a lease: ``test_without_blocks_half_the_clients_get_nothing``
keeps that fact, and the borrowing test fails on such code.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from vfab.services.sdhcp.blocks import Blocks
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.server import open_server
from vfab.vid.registry import Registry, schema
from tests.unit.test_sdhcp_status import HIGH, LOW, macs, sim_for, status

SVC = "dst"
N = 40
OPTS = {"pool": "10.76.0.10-10.76.0.49", "mask": "24", "server": "10.76.0.1", "lease": "600"}


def _shards(ns, registry, tmp_path, agents: bool):
    c, d = f"{ns.name}c", f"{ns.name}d"
    ns.sh("ip", "link", "add", c, "type", "veth", "peer", "name", d)
    for dev in (c, d):
        ns.sh("ip", "link", "set", dev, "up")
    path = f"/var/run/netns/{ns.name}"
    registry.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    config = parse_opts(OPTS)
    stop = threading.Event()
    loops, threads = {}, []
    for name, iface, rng in (("s1", ns.b, LOW), ("s2", d, HIGH)):
        loop = open_server(registry, SVC, name, iface, str(tmp_path / "data"), config, netns=path)
        loops[name] = loop
        registry.assign(SVC, rng, name)
        if agents:
            loop.start_blocks(Registry(registry.endpoint))
        th = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.monotonic() + 10
    while not all(lp.view.owned_by(n) for n, lp in loops.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(lp.view.owned_by(n) for n, lp in loops.items()), "the shards never saw their ranges"

    def close():
        stop.set()
        for th in threads:
            th.join(5)
        for lp in loops.values():
            lp.close()
            lp.backend.store.close()
    return {"loops": loops, "path": path, "client_iface": {"s1": ns.a, "s2": c}}, close


@pytest.fixture
def with_agents(ns, registry, tmp_path):
    got, close = _shards(ns, registry, tmp_path, True)
    try:
        yield got
    finally:
        close()


@pytest.fixture
def without_agents(ns, registry, tmp_path):
    got, close = _shards(ns, registry, tmp_path, False)
    try:
        yield got
    finally:
        close()


def test_a_dry_shard_borrows_and_every_address_is_used_once(with_agents, registry):
    clients = sim_for(with_agents, "s1", macs(LOW, N, 3))
    try:
        t0 = time.monotonic()
        got = clients.lease(timeout=10, retry=2.0)   # udhcpc's and dhclient's first retransmission: ~2 s
        took = time.monotonic() - t0
    finally:
        clients.close()
    assert len(got) == N and len(set(got.values())) == N, (len(got), len(set(got.values())))
    assert took < 2.5, took          # the borrowed addresses came within the clients' first retry
    ag = with_agents["loops"]["s1"].agent.counters
    assert ag["borrows"] >= 1 and ag["borrow_ms_max"] < 2000, ag   # from its want to the lend: within a retry
    print(f"{N} clients on one shard's half, a pool of {N}: all leased in {took:.2f} s; {ag['borrows']} lend(s) to "
          f"s1, {ag['borrow_ms_max']} ms at most from its want to the lend")
    raw, _ = registry.get(schema.sdhcp_blocks_key(SVC))
    s1 = with_agents["loops"]["s1"]
    table = Blocks.from_json(raw, s1.backend.pool, s1.backend.store.fp)
    lent = sum(b - a + 1 for a, b, k in table.blocks if k in LOW)
    assert lent >= N // 2 - 0 and all(k in LOW for _, _, k in table.blocks), table.blocks
    js = status(registry, "--json", "--interval", "0")
    assert js.exit_code == 0, js.output
    rows = {s["shard"]: s for s in json.loads(js.output)}
    assert rows["s1"]["blocks"] >= 1 and rows["s1"]["borrowed"] == lent, rows["s1"]
    assert rows["s1"]["slice"] + rows["s2"]["slice"] == N
    text = status(registry, "--interval", "0")
    row = next(ln for ln in text.output.splitlines() if "│ s1" in ln)
    assert f"({rows['s1']['blocks']} +{lent})" in row and "blocks)" in text.output, text.output


def test_without_blocks_half_the_clients_get_nothing(without_agents):
    clients = sim_for(without_agents, "s1", macs(LOW, N, 3))
    try:
        got = clients.lease(timeout=3, retry=1.0)
    finally:
        clients.close()
    assert len(got) == N // 2
