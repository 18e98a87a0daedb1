"""Time to lease N DHCP clients from sdhcp with 1 and 2 shards (issue 9; Kea and dnsmasq come later).

One fabric (``line,2,3``).  Per configuration a fresh sdhcp service (dhcp4
front door) with its shards: 1 shard (``a`` on vfh1, every key) or 2 shards
(``a`` on vfh1 the lower half of the key space, ``b`` on vfh4 the upper half,
across the trunk).  N simulated clients on vfh3: N MACs with random low 24 bits
(so the keys spread over both halves), each registered on vfh3's port (port
security lets a port speak for its registered MACs only).  All N DISCOVERs
leave at once from one raw socket (broadcast flag set, so the OFFERs and ACKs
come back broadcast); each client REQUESTs its offer and is done at its ACK;
a client without an answer retransmits after 1 s (4 tries in all).  The pool
(2,033 addresses) is larger than the clients: each shard hands out only its
slice (about half the pool with 2 shards), and random keys do not split the
clients exactly in half.

Reported per configuration: time from the first DISCOVER to the last ACK,
clients leased, leases/s, DORA latency per client (median, p99), retransmissions,
distinct addresses (must equal the clients leased), and the shards' counters.
Durability: every batch is one SQLite transaction with ``synchronous=FULL``
(the write-ahead log is fsync'd before any reply of the batch leaves); no mirrors.
The load generator is Python on the same 2 cores as the shards: these times
include it.

Run: ``/opt/vfab-venv/bin/python bench/sdhcp_lease.py [--smoke] [--clients N]`` (root).
"""

from __future__ import annotations

import os
import random
import select
import socket
import sys
import time
from ipaddress import IPv4Address

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.services.sdhcp import ipudp, wire  # noqa: E402
from vfab.services.sdhcp.errors import DhcpError  # noqa: E402
from vfab.services.sdhcp.wire import FLAG_BROADCAST, Message, MessageType, Opt  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.netns import netns  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.state import ctl as statectl  # noqa: E402

SERVER = IPv4Address("10.77.0.1")
OPTS = {"pool": "10.77.0.10-10.77.7.250", "mask": "21", "server": str(SERVER), "lease": "3600"}
CONFIGS = {1: [("a", "vfh1", "0-0xffffff")], 2: [("a", "vfh1", "0-0x7fffff"), ("b", "vfh4", "0x800000-0xffffff")]}
CLIENT_HOST = "vfh3"
RETRY, TRIES = 1.0, 4
BCAST_MAC, BCAST_IP = b"\xff" * 6, IPv4Address("255.255.255.255")
PACKET_OUTGOING = 4


def message(mac: bytes, xid: int, mtype: MessageType, opts: dict | None = None) -> bytes:
    options = {Opt.MSG_TYPE: bytes([mtype]), **(opts or {})}
    msg = Message(op=1, xid=xid, chaddr=mac, flags=FLAG_BROADCAST, options=options).serialize()
    return ipudp.Datagram(BCAST_MAC, mac, IPv4Address(0), BCAST_IP, 68, 67, msg).serialize()


def lease_all(tb: Testbed, macs: list[bytes], timeout: float) -> dict:
    """DORA for every MAC at once from CLIENT_HOST; per-client times, addresses, retransmissions."""
    iface = tb.hosts[CLIENT_HOST]["iface"]
    with netns(tb.netns(CLIENT_HOST)):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ipudp.ETH_P_IP))
    sock.bind((iface, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setblocking(False)
    xids = {0x5D000000 + i: i for i in range(len(macs))}
    state = ["discover"] * len(macs)        # -> request -> done
    sent_at = [0.0] * len(macs)
    tries = [0] * len(macs)
    pending_req: dict[int, bytes] = {}
    start = [0.0] * len(macs)
    done_at = [0.0] * len(macs)
    addr: dict[int, IPv4Address] = {}
    retrans = 0
    t0 = time.monotonic()
    for i, mac in enumerate(macs):
        sock.send(message(mac, 0x5D000000 + i, MessageType.DISCOVER))
        start[i] = sent_at[i] = time.monotonic()
        tries[i] = 1
    deadline = t0 + timeout
    left = len(macs)
    while left and time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            while True:
                try:
                    frame, meta = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if meta[2] == PACKET_OUTGOING:
                    continue
                try:
                    dg = ipudp.parse(frame)
                    if dg.dst_port != 68:
                        continue
                    msg = wire.parse(dg.payload)
                except DhcpError:
                    continue
                i = xids.get(msg.xid)
                if i is None or msg.chaddr != macs[i]:
                    continue
                if msg.msg_type is MessageType.OFFER and state[i] == "discover":
                    req = message(macs[i], msg.xid, MessageType.REQUEST,
                                  {Opt.SERVER_ID: SERVER.packed, Opt.REQUESTED_IP: msg.yiaddr.packed})
                    state[i], pending_req[i], sent_at[i] = "request", req, time.monotonic()
                    sock.send(req)
                elif msg.msg_type is MessageType.ACK and state[i] == "request":
                    state[i], done_at[i], addr[i] = "done", time.monotonic(), msg.yiaddr
                    left -= 1
                elif msg.msg_type is MessageType.NAK and state[i] == "request":
                    state[i] = "discover"
                    sent_at[i] = 0.0
        now = time.monotonic()
        if all(st == "done" or (tries[i] >= TRIES and now - sent_at[i] > RETRY) for i, st in enumerate(state)):
            break  # the rest gave up (e.g. their shard's slice of the pool is used up)
        for i, st in enumerate(state):
            if st != "done" and now - sent_at[i] > RETRY and tries[i] < TRIES:
                tries[i] += 1
                retrans += 1
                sent_at[i] = now
                sock.send(pending_req[i] if st == "request" else message(macs[i], 0x5D000000 + i,
                                                                           MessageType.DISCOVER))
    sock.close()
    finished = [d for d in done_at if d]
    took = (max(finished) - t0) if finished else None
    return {"clients": len(macs), "leased": len(finished), "time_to_lease_s": round(took, 3) if took else None,
            "leases_per_s": round(len(finished) / took, 1) if took else 0,
            "dora": summary([done_at[i] - start[i] for i in range(len(macs)) if done_at[i]]),
            "retransmissions": retrans, "distinct_addresses": len(set(addr.values()))}


def configuration(tb: Testbed, shards: int, macs: list[bytes], timeout: float) -> dict:
    reg = tb.registry
    svc = f"dhbench{shards}"
    reg.create_service(svc, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    opts = [a for k, v in OPTS.items() for a in ("--opt", f"{k}={v}")]
    procs = []
    try:
        for name, host, listen in CONFIGS[shards]:
            out = os.path.join(tb.workdir, f"{svc}-{name}.out")
            args = ["-m", "vfab.services.sdhcp", "server", "--etcd", tb.etcd_endpoint, "--service", svc,
                    "--name", name, "--iface", tb.hosts[host]["iface"],
                    "--data", os.path.join(tb.workdir, f"data-{svc}"), "--listen", listen, *opts]
            proc = tb.run_on(host, f"{svc}-{name}", args, stdout=open(out, "wb"))
            procs.append(proc)
            wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 30, f"shard {name}")
            if not proc.alive():
                raise RuntimeError(f"shard {name} died at start:\n{proc.tail()}")
        tb.wait_revision(reg.state_revision())
        res = lease_all(tb, macs, timeout)
        res["shards"] = {name: statectl.command(reg, svc, name, "STATS", {}).body["sdhcp"]["counters"]
                         for name, _, _ in CONFIGS[shards]}
        return res
    finally:
        for p in procs:
            tb.sup.stop(p)
        reg.delete_service(svc)
        tb.wait_revision(reg.state_revision())


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=None, help="simulated clients (default 245, smoke 40)")
    args = ap.parse_args()
    n = args.clients or (40 if args.smoke else 245)
    rnd = random.Random(9)
    keys = rnd.sample(range(1, codec.KEY_MAX), n)
    macs = [bytes([0x02, 0x5B, 0x00]) + k.to_bytes(3, "big") for k in keys]
    results = {}
    with Testbed("line,2,3", poll=1.0) as tb:
        info = tb.hosts[CLIENT_HOST]
        for mac in macs:
            tb.registry.put_host(schema.Host(mac=codec.int_to_mac(int.from_bytes(mac, "big")), dpid=info["dpid"],
                                             port=info["port"], name=CLIENT_HOST))
        tb.wait_revision(tb.registry.state_revision(), timeout=60)
        for shards in CONFIGS:
            r = configuration(tb, shards, macs, timeout=30 if args.smoke else 120)
            results[f"{shards}_shard{'s' if shards > 1 else ''}"] = r
            print(f"{shards} shard(s): {r['leased']}/{n} leased in {r['time_to_lease_s']} s "
                  f"({r['leases_per_s']}/s), DORA median {r['dora'].get('median_ms')} ms, "
                  f"p99 {r['dora'].get('p99_ms')} ms, {r['retransmissions']} retransmissions", flush=True)
    write("sdhcp_lease", {"clients": n, "smoke": args.smoke, "pool": OPTS["pool"], "durability": "fsync per batch",
                          "generator": "python raw socket, one host, all DISCOVERs at once"}, results, args.out)
    bad = [k for k, r in results.items() if r["leased"] != n or r["distinct_addresses"] != n]
    if bad:
        print(f"not every client leased a distinct address in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
