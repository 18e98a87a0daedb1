"""sdhcp address blocks on the real fabric (issue 44): kill -9 of the lending shard in the middle of a lend.

Service ``dhb`` (kind sdhcp, dhcp4 front door keyed by ``mac-low24``), a pool of exactly as many addresses as
clients (``N``). Shard ``a`` (vfh1) owns the lower half of the key space, ``b`` (vfh4) the upper half; each
has a home slice of half the pool. ISC perfdhcp, as one relay behind vfh2, brings ``N`` clients with
sequential MACs whose low 24 bits (their keys) are all in a's half, as an avalanche (every client at once,
each retransmitting until leased): a runs dry at N/2 and asks; b lends. Both shards run with
``VFAB_SDHCP_LEND_PAUSE`` (``agent.py``'s test hook), so b sleeps inside its lend, either after fencing the
addresses and before its etcd transaction (``before``) or right after it (``after``), and is killed with
SIGKILL there, then started again on the same store.

Asserted: every one of the N clients is leased (perfdhcp's ACKs seen on the wire), no address is ACKed to two
clients, so every address of the pool is used once; the block table in etcd anchors only addresses b never
wrote a row for, all at keys a owns; b's store has no row of any of them; and the two shards' shares (home
slice minus what was lent, plus blocks) are disjoint and cover the pool. Before blocks (the home-key rule) half
the clients could never be leased; with the lend's transaction not fenced by the table's revision two lenders
could hand the same address out.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from vfab.services.sdhcp.blocks import Blocks
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.pool import Pool
from vfab.services.sdhcp.store import Store
from vfab.testbed import dhcpclients as dc
from vfab.testbed.procs import wait_for
from vfab.vid import mackey
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

SVC = "dhb"
N = 200
RELAY = "10.79.0.251"
OPTS = {"pool": "10.79.0.10-10.79.0.209", "mask": "24", "server": "10.79.0.1", "lease": "600", "relays": RELAY}
LOW, HIGH = Range(0, 0x7FFFFF), Range(0x800000, 0xFFFFFF)
SHARDS = {"a": ("vfh1", LOW), "b": ("vfh4", HIGH)}
BASE = bytes([0x02, 0x5C, 0x00, 0x10, 0x00, 0x00])   # chaddrs from here: keys 0x100000.. (a's half)
PAUSE = 4.0


def _start(testbed, workdir: str, name: str, pause: str | None, listen: bool):
    host, rng = SHARDS[name]
    out = os.path.join(workdir, f"{name}-{time.monotonic_ns()}.out")
    args = ["-m", "vfab.services.sdhcp", "server", "--etcd", testbed.etcd_endpoint, "--service", SVC, "--name", name,
            "--iface", testbed.hosts[host]["iface"], "--data", os.path.join(workdir, "data"),
            *[a for k, v in OPTS.items() for a in ("--opt", f"{k}={v}")],
            *(["--listen", f"{rng.lo:#x}-{rng.hi:#x}"] if listen else []), "--netns", testbed.netns(host)]
    env = {"VFAB_SDHCP_LEND_PAUSE": pause} if pause else {}
    log = os.path.join(testbed.sup.logdir, f"sdhcp-{name}.log")
    start = os.path.getsize(log) if os.path.exists(log) else 0   # the log is appended to: this run's part only
    proc = testbed.sup.start(f"sdhcp-{name}", [sys.executable, *args], env=env, stdout=open(out, "wb"))
    proc.log_from = start
    wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 30, f"shard {name}")
    assert proc.alive(), proc.tail(40)
    return proc


def _log(proc) -> str:
    with open(proc.logpath) as fh:
        fh.seek(proc.log_from)
        return fh.read()


@pytest.mark.parametrize("where", ["before", "after"])
def test_kill_9_of_the_lender_mid_lend_loses_no_block_and_duplicates_none(testbed, tmp_path, where):
    reg = testbed.registry
    workdir = str(tmp_path)
    reg.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4", "key": mackey.LOW24}])
    procs = {name: _start(testbed, workdir, name, f"{where}:{PAUSE}", True) for name in SHARDS}
    relays = dc.ClientFarm(testbed, "vfh2", "k", [dc.relay_mac(0, mackey.LOW24, parts=2)], workdir)
    cap = dc.Capture(testbed, "vfh2")
    try:
        relays.create()
        relays.sh(0, "ip", "addr", "add", f"{RELAY}/24", "dev", relays.names[0])
        testbed.wait_revision(reg.state_revision(), timeout=60)
        mark = cap.mark()
        run = dc.perfdhcp(relays, 0, N, BASE, None, avalanche=True)
        # b fences addresses for a and sleeps in its lend: kill it there
        wait_for(lambda: "lend paused" in _log(procs["b"]), 30, "b to pause in a lend")
        table_before = reg.get(schema.sdhcp_blocks_key(SVC))
        testbed.sup.kill9(procs["b"])
        if where == "before":
            assert table_before is None or table_before == reg.get(schema.sdhcp_blocks_key(SVC))
        else:
            assert table_before is not None, "b paused after its transaction, yet etcd has no table"
        wait_for(lambda: reg.get(schema.endpoint_key(SVC, "b")) is None, 10, "b's endpoint lease to expire")
        procs["b"] = _start(testbed, workdir, "b", None, False)     # same name, same store, no pause
        rep = dc.finish_perfdhcp(relays, run, timeout=60)
        time.sleep(0.3)
        chaddrs = {(int.from_bytes(BASE, "big") + i).to_bytes(6, "big") for i in range(N)}
        res = dc.dora(cap.messages(mark), chaddrs)
    finally:
        cap.stop()
        relays.remove()
    acks = rep.get("REQUEST-ACK", {}).get("received packets")
    assert res["leased"] == N, f"{N - res['leased']} clients never leased (perfdhcp ACKs {acks})"
    assert not res["held_twice"] and res["distinct_addresses"] == N, res["held_twice"][:10]

    raw, rev = reg.get(schema.sdhcp_blocks_key(SVC))
    store_b = Store(os.path.join(workdir, "data", "b.sqlite"))
    try:
        pool = Pool(int(parse_opts(OPTS).first), N)
        table = Blocks.from_json(raw, pool, store_b.fp, rev)
        lent = [pool.first + i for a, b, k in table.blocks for i in range(a, b + 1)]
        assert lent and all(k in LOW for _, _, k in table.blocks), table.blocks
        rows_b = {ip for ip, in store_b.db.execute("SELECT ip FROM addr")}
        assert not rows_b & set(lent), sorted(rows_b & set(lent))[:10]
        share_a = {pool.first + i for x, y, _ in table.owned([LOW]) for i in range(x, y + 1)}
        share_b = {pool.first + i for x, y, _ in table.owned([HIGH]) for i in range(x, y + 1)}
        assert not share_a & share_b and len(share_a | share_b) == N
    finally:
        store_b.close()
    for name, p in procs.items():
        assert p.alive(), f"shard {name} died:\n{p.tail(40)}"
        assert "Traceback" not in _log(p), _log(p)[-3000:]
    for p in procs.values():
        testbed.sup.stop(p)
    reg.delete_service(SVC)
    print(f"kill -9 of the lender {where} its transaction: {N}/{N} leased in {res['time_s']} s, "
          f"{len(lent)} addresses lent in {len(table.blocks)} blocks")
