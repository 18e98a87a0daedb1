"""sdhcp on a full disk, as outside testers do it: nothing acknowledged is lost, the cause is named, and the
shard serves again once there is space.

Shard ``d`` (vfh1, every key) keeps its leases on a small tmpfs.  16 simulated clients on vfh3 hold leases;
the write-ahead log is truncated (as a checkpoint at a restart would: its space is given back), the file
system filled to the last byte, and then 16 more clients ask for addresses while the first 16 renew.  A
commit now needs space the disk lacks: no ACK may leave for a lease the shard could not keep.  Then the
shard is killed (SIGKILL: no clean close), the space freed, the shard started again on the same data, and
every client that was ever ACKed renews: each must get its address back, none held by two clients.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from ipaddress import IPv4Address

from tests.integration.conftest import start_sdhcp_shard, stop_sdhcp_shard
from tests.integration.test_kvs_faults import fill, tmpfs  # noqa: F401 - tmpfs is a fixture
from vfab.testbed import dhcpsim
from vfab.testbed.procs import wait_for
from vfab.vid import codec
from vfab.vid.state import ctl as statectl

SVC = "dhd"
SERVER = IPv4Address("192.168.78.1")
OPTS = {"pool": "192.168.78.10-192.168.78.250", "mask": "24", "server": str(SERVER), "lease": "60", "t1": "30",
        "t2": "50"}
HOST, SIM_HOST = "vfh1", "vfh3"


def macs(seed: int, n: int) -> list[bytes]:
    return [bytes([0x02, 0x60, seed]) + k.to_bytes(3, "big") for k in random.Random(seed).sample(range(1, 1 << 24), n)]


def start_shard(testbed, data: str, out: str, nth: int = 1):
    return start_sdhcp_shard(testbed, HOST, SVC, "d", data, out, OPTS, nth)


def test_a_full_disk_acknowledges_nothing_it_cannot_keep(testbed, tmpfs, tmp_path):  # noqa: F811
    reg = testbed.registry
    disk = tmpfs("8m")
    data = os.path.join(disk, "data")
    reg.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    old, new = macs(1, 16), macs(2, 16)
    dhcpsim.register(testbed, SIM_HOST, old + new)
    sid = reg.service(SVC).id
    server_mac = lambda ip, mac: codec.encode(sid, int.from_bytes(mac, "big") & codec.KEY_MAX).packed  # noqa: E731
    out = str(tmp_path / "d.out")
    proc = start_shard(testbed, data, out)
    testbed.wait_revision(reg.state_revision())
    sims = [dhcpsim.SimClients(testbed, SIM_HOST, m, server_mac=server_mac) for m in (old, new)]
    try:
        first = sims[0].lease(timeout=20)
        assert len(first) == 16, f"only {len(first)} of 16 clients leased before the disk filled"
        db = os.path.join(data, "d.sqlite")
        with sqlite3.connect(db, timeout=10) as conn:   # the log's space goes back to the file system
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        filler = fill(disk, 0)
        t_full = time.monotonic()
        during = sims[1].lease(timeout=4, retry=0.5)                    # new clients, disk full
        sims[0].renew(duration=3.0, period=0.5, retry=0.25, t2=60)       # old clients renew, disk full
        acked_full = {c.mac: c.acks[-1][2] for s in sims for c in s.clients if c.acks and c.acks[-1][1] > t_full}
        log = open(proc.logpath).read()
        assert "disk is full" in log, "the shard must name the cause of its failing commits:\n" + log[-3000:]
        # the native lane serves this unmirrored shard: its failed commits are said too (they went to the loop)
        assert "native lane:" in log and "store failed" in log, log[-3000:]
        assert proc.alive(), "the shard died of a full disk:\n" + proc.tail(40)
        st = statectl.command(reg, SVC, "d", "STATS", {}).body
        print(f"\ndisk full: {len(during)} of 16 new clients and {len(acked_full) - len(during)} of 16 renewals "
              f"ACKed; loop counters {({k: v for k, v in st.get('counters', {}).items() if 'fail' in k})}")

        # Crash with the disk still full, give the space back, start again on the same data.
        testbed.sup.kill9(proc)
        os.remove(filler)
        wait_for(lambda: "d" not in {e.name for e in reg.endpoints(SVC)}, 10, "d's endpoint lease to expire")
        proc = start_shard(testbed, data, out, nth=2)
        testbed.wait_revision(reg.state_revision())
        ever, lost, moved = dhcpsim.renew_acked(sims)
        assert not lost, f"{len(lost)} of {len(ever)} ACKed clients got no answer after the restart: {lost}"
        assert not moved, f"clients ACKed before the crash got another address after it: {moved}"
        naks = [c.mac.hex() for s in sims for c in s.clients if c.naks]
        assert not naks, f"NAKed: {naks}"
        # the clients the full disk turned away lease now; no address is held by two clients
        sims[1].lease(timeout=20)
        none, twice = dhcpsim.holders(sims)
        assert not none, f"{none} have no address once the disk has space"
        assert not twice, twice
    finally:
        stop_sdhcp_shard(testbed, SVC, proc, sims)
