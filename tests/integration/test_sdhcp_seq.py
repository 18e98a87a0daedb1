"""Issue 44: 1,000 perfdhcp clients numbered in sequence, 4 shards of a ``mac-hash`` service (``line,2,3``).

Shards s1 (vfh1), s2 (vfh4), s3 (vfh5), s4 (vfh6) own a quarter of the key space each.  ISC perfdhcp runs as 4
relays behind vfh2 (each relay's MAC keyed into its own quarter, so its frames enter at that shard), 250
clients each, chaddrs in one sequence from 00:0c:01:00:00:00 as perfdhcp numbers them.  Under the old key
(the MAC's low 24 bits) every one of them is in the first quarter: one shard serves all and its slice runs
dry (the issue: 715 of 1,000 at 500/s).  Here, at 500/s and then as an avalanche: every client leased, no
address twice (from the ACKs on the wire), each shard's ACKs within 2x of the mean, and the forwarded
requests (3 in 4: a relay's clients belong to every shard) served by the shards' native lanes.
"""

from __future__ import annotations

import os

import pytest

from vfab.testbed import dhcpclients as dc
from vfab.testbed.procs import wait_for
from vfab.vid import mackey
from vfab.vid.state import ctl as statectl

SVC = "dhseq"
PER = 250
RELAYS = [f"10.78.15.{251 + q}" for q in range(4)]
# 4,081 addresses for the 2,000 clients of both runs: each shard's slice (a quarter) holds its share with room.
# A pool as large as the clients is not enough yet: hashed keys give each shard a random sample's share
# (with a /21, 2,033 addresses, 7 clients of the second run sent 7-10 DISCOVERs each and got no OFFER while
# s4 had ACKed 507 leases, its slice holding ~508: most likely that slice ran dry; no shard lends addresses to
# another, issue 44's address blocks are not built).
OPTS = {"pool": "10.78.0.10-10.78.15.250", "mask": "20", "server": "10.78.0.1", "lease": "600",
        "relays": ",".join(RELAYS)}
Q = 0x400000
SHARDS = {"s1": ("vfh1", 0), "s2": ("vfh4", 1), "s3": ("vfh5", 2), "s4": ("vfh6", 3)}


@pytest.fixture(scope="module")
def seq(testbed, tmp_path_factory):
    reg = testbed.registry
    workdir = str(tmp_path_factory.mktemp("sdhcp-seq"))
    reg.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4", "key": mackey.HASH}])
    opts = [a for k, v in OPTS.items() for a in ("--opt", f"{k}={v}")]
    procs = {}
    for name, (host, q) in SHARDS.items():
        out = os.path.join(workdir, f"{name}.out")
        args = ["-m", "vfab.services.sdhcp", "server", "--etcd", testbed.etcd_endpoint, "--service", SVC,
                "--name", name, "--iface", testbed.hosts[host]["iface"], "--data", os.path.join(workdir, "data"),
                "--listen", f"{q * Q:#x}-{(q + 1) * Q - 1:#x}", *opts]
        procs[name] = testbed.run_on(host, f"sdhcp-{name}", args, stdout=open(out, "wb"))
        wait_for(lambda: b"ready" in open(out, "rb").read() or not procs[name].alive(), 20, f"shard {name}")
        assert procs[name].alive(), procs[name].tail()
    relays = dc.ClientFarm(testbed, "vfh2", "q", [dc.relay_mac(q, mackey.HASH) for q in range(4)], workdir)
    cap = None
    try:
        relays.create()
        for q in range(4):
            relays.sh(q, "ip", "addr", "add", f"{RELAYS[q]}/20", "dev", relays.names[q])
        testbed.wait_revision(reg.state_revision(), timeout=60)
        cap = dc.Capture(testbed, "vfh2")
        yield {"relays": relays, "cap": cap, "procs": procs}
    finally:
        if cap is not None:
            cap.stop()
        relays.remove()
        for name, p in procs.items():
            assert p.alive(), f"shard {name} died:\n{p.tail(40)}"
            testbed.sup.stop(p)
        reg.delete_service(SVC)


def shard_counters(testbed) -> dict[str, dict]:
    out = {}
    for name in SHARDS:
        body = statectl.command(testbed.registry, SVC, name, "STATS", {}).body
        out[name] = {"acks": body["sdhcp"]["counters"].get("acks", 0),
                     "pool_exhausted": body["sdhcp"]["counters"].get("pool_exhausted", 0),
                     "native_acks": body["sdhcp"].get("native", {}).get("acks", 0),
                     "forwarded_native": body["counters"].get("forwarded_native", 0)}
    return out


@pytest.mark.parametrize("run,rate", [(1, 500), (2, None)], ids=["500/s", "avalanche"])
def test_sequential_macs_spread_and_every_client_is_leased(testbed, seq, run, rate):
    relays, cap = seq["relays"], seq["cap"]
    bases = [0x000C01000000 + (run << 16) + q * dc.perfdhcp_stride(PER) for q in range(4)]
    before = shard_counters(testbed)
    mark = cap.mark()
    runs = [dc.perfdhcp(relays, q, PER, bases[q].to_bytes(6, "big"), None if rate is None else rate // 4,
                        avalanche=rate is None) for q in range(4)]
    reps = [dc.finish_perfdhcp(relays, r, timeout=PER / (rate or PER) * 4 + 60) for r in runs]
    chaddrs = {(b + i).to_bytes(6, "big") for b in bases for i in range(PER)}
    try:
        wait_for(lambda: dc.dora(cap.messages(mark), chaddrs)["leased"] == 4 * PER, 5, "the last ACKs on the wire")
    except TimeoutError:
        pass   # said below, with what is known of the clients left
    res = dc.dora(cap.messages(mark), chaddrs)
    assert res["leased"] == 4 * PER, (f"{res['leased']} leased", shard_counters(testbed), res["unleased"], reps)
    assert res["distinct_addresses"] == 4 * PER and not res["held_twice"], res["held_twice"]
    after = shard_counters(testbed)
    acks = {n: after[n]["acks"] - before[n]["acks"] for n in SHARDS}
    mean = sum(acks.values()) / 4
    assert mean >= PER and max(acks.values()) <= 2 * mean and min(acks.values()) >= mean / 2, acks
    # a relay's clients belong to every shard: 3 in 4 are forwarded, and the lanes serve those too
    native = sum(after[n]["forwarded_native"] - before[n]["forwarded_native"] for n in SHARDS)
    assert native >= PER, (native, after)
