"""sdhcp's native lane under the faults outside testers use: SIGSTOP past the endpoint lease, kill -9 in a burst.

Shard ``s`` (vfh1) owns every key with no mirror, so its native lane serves every common request.
Simulated clients on vfh3 (``testbed/dhcpsim.py``) lease and renew through the dhcp4 front door.

1. The shard is SIGSTOPped for 2.5 s, past its 1-s endpoint lease, then continued while 20 new clients ask.
   The lane must answer nothing itself until the loop is authoritative again (the requests go to the loop,
   which holds them until then), and every client must lease.
2. The shard is killed with SIGKILL in the middle of 40 clients' burst and started again on the same data.
   Every client that ever had an ACK must renew its very address, and no address may be held by two clients.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from ipaddress import IPv4Address

from tests.integration.conftest import start_sdhcp_shard, stop_sdhcp_shard
from vfab.testbed import dhcpsim
from vfab.testbed.procs import wait_for
from vfab.vid import codec
from vfab.vid.state import ctl as statectl

SVC = "dhl"
SERVER = IPv4Address("192.168.79.1")
OPTS = {"pool": "192.168.79.10-192.168.79.250", "mask": "24", "server": str(SERVER), "lease": "60", "t1": "30",
        "t2": "50"}


def macs(seed: int, n: int) -> list[bytes]:
    return [bytes([0x02, 0x61, seed]) + k.to_bytes(3, "big") for k in random.Random(seed).sample(range(1, 1 << 24), n)]


def start_shard(testbed, data: str, out: str, nth: int):
    return start_sdhcp_shard(testbed, "vfh1", SVC, "s", data, out, OPTS, nth)


def test_the_lane_waits_out_a_lapsed_lease_and_a_kill_loses_no_acknowledged_lease(testbed, tmp_path):
    reg = testbed.registry
    reg.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    groups = [macs(1, 20), macs(2, 20), macs(3, 40)]
    dhcpsim.register(testbed, "vfh3", [m for g in groups for m in g])
    sid = reg.service(SVC).id
    server_mac = lambda ip, mac: codec.encode(sid, int.from_bytes(mac, "big") & codec.KEY_MAX).packed  # noqa: E731
    data, out = str(tmp_path / "data"), str(tmp_path / "s.out")
    proc = start_shard(testbed, data, out, 1)
    testbed.wait_revision(reg.state_revision())
    sims = [dhcpsim.SimClients(testbed, "vfh3", g, server_mac=server_mac) for g in groups]

    def native() -> dict:
        return statectl.command(reg, SVC, "s", "STATS", {}).body["sdhcp"]["native"]
    try:
        assert len(sims[0].lease(timeout=20)) == 20
        before = native()
        assert before["offers"] >= 20 and before["acks"] >= 20, before    # the lane served them

        # 1. stopped past its lease, 20 DISCOVERs waiting in its socket: on SIGCONT the lane's first pass finds
        # its deadline gone and hands them all to the loop, which holds them until it is authoritative again
        box: dict = {}
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)
            asking = threading.Thread(target=lambda: box.update(got=sims[1].lease(timeout=20, retry=5)), daemon=True)
            asking.start()
            time.sleep(1.0)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        asking.join(25)
        assert len(box.get("got", {})) == 20, box
        after = native()
        # (a lane that ignored its deadline answered all 20 DISCOVERs itself the moment the shard continued)
        assert after["offers"] - before["offers"] < 10 and after["to_loop"] - before["to_loop"] >= 20, (before, after)
        wait_for(lambda: native()["granted"] == ["0x0-0xffffff"], 10, "the lane granted every key again")

        # 2. kill -9 in the middle of a burst, started again on the same data
        burst = threading.Thread(target=lambda: sims[2].lease(timeout=3, retry=0.3), daemon=True)
        burst.start()
        time.sleep(0.15)
        testbed.sup.kill9(proc)
        burst.join(10)
        wait_for(lambda: "s" not in {e.name for e in reg.endpoints(SVC)}, 10, "s's endpoint lease to expire")
        proc = start_shard(testbed, data, out, 2)
        testbed.wait_revision(reg.state_revision())
        ever, lost, moved = dhcpsim.renew_acked(sims)
        assert len(ever) >= 40, len(ever)
        assert not lost, f"{len(lost)} of {len(ever)} ACKed clients got no answer after the restart: {lost}"
        assert not moved, f"clients ACKed before the kill got another address after it: {moved}"
        sims[2].lease(timeout=20)
        none, twice = dhcpsim.holders(sims)
        assert not none and not twice, (none, twice)
        assert native()["acks"] >= len(ever), native()                     # the restarted lane renewed them
        assert "Traceback" not in open(proc.logpath).read()
    finally:
        stop_sdhcp_shard(testbed, SVC, proc, sims)
