"""A burst of simulated DHCP clients on one raw socket (DORA, 1 s retransmission, 4 tries), for tests that
need many leases fast (tests/integration/test_balancer.py).  Moved here from an earlier bench/sdhcp_lease.py.
"""

from __future__ import annotations

import select
import socket
import time
from ipaddress import IPv4Address

from vfab.services.sdhcp import ipudp, wire
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.wire import FLAG_BROADCAST, Message, MessageType, Opt
from vfab.testbed.fabric import Testbed
from vfab.vid.netns import netns


def summary(values: list[float]) -> dict:
    xs = sorted(v * 1e3 for v in values)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median_ms": round(xs[len(xs) // 2], 3), "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)}
SERVER = IPv4Address("10.77.0.1")
OPTS = {"pool": "10.77.0.10-10.77.7.250", "mask": "21", "server": str(SERVER), "lease": "3600"}
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


