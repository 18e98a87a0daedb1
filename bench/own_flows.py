"""Datapath flows that vfab's own traffic caches in the switch (issue 11: how busy does vfab itself make it?).

The cut-over benchmark (``reroute_busy.py``) loads the switch with a foreign
sender; this one measures what vfab's own traffic puts there, so its table can
be read for the loads vfab really creates.  One fabric (``line,2,3``), flows
counted from the switch (``ovs-appctl upcall/show``, both bridges share the one
userspace datapath) every 0.25 s during each phase; the phases, in one run:

- ``idle``: the fabric with its controller and nothing sending.
- ``kvs``: the elastic-KVS demo's load: two servers (``a`` on vfh1 owning the
  lower half of the key space, ``b`` on vfh4 the upper half, across the trunk)
  and two load processes (vfh3 and vfh5, 4 clients each, 256 keys, put:get 1:1).
- ``frontdoor``: a UDP front door (``udp, ip=10.0.0.100, port=11211,
  key=ip_src``, the memcached helpers' door) in front of two owners (vfh1
  lower half, vfh4 upper half); vfh2 and vfh5 send datagrams from ``--sources``
  distinct IPv4 source addresses (each one client of a memcached front door:
  the door keys on the source address, so each is its own megaflow), cycling
  through them at ``--rate`` datagrams/s per host.  The two senders stand
  for many client machines, so their host records are registered without
  addresses for the phase (not source-guarded, as DHCP clients are; a guarded
  host's datagrams from other addresses are dropped at its port).

Printed and written per phase: the largest and the last flow count, and the
count above idle.  The cut-over latency at such a count can be read from the
``reroute_busy`` table (first packet vs cached flows).

Run: ``/opt/vfab-venv/bin/python bench/own_flows.py [--smoke] [--sources N]`` (root).
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import struct
import sys
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import not_root, parser, write  # noqa: E402
from vfab.testbed import kvs  # noqa: E402
from vfab.testbed.busy import datapath_flows  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.netns import netns  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402

HALF = codec.KEY_MAX // 2
DOOR_IP = "10.0.0.100"
DOOR_PORT = 11211
DOOR_HOSTS = ("vfh2", "vfh5")
SAMPLE = 0.25


def _csum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_frame(src_mac: bytes, src_ip: int, dst_ip: int, port: int, payload: bytes) -> bytes:
    """Ethernet / IPv4 / UDP (checksum 0: none) to ``dst_ip:port`` from ``src_ip``."""
    udp = struct.pack("!HHHH", 40000 + (src_ip & 0x3FF), port, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     src_ip.to_bytes(4, "big"), dst_ip.to_bytes(4, "big"))
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return b"\x02\x00\x00\x00\x00\x64" + src_mac + b"\x08\x00" + ip + udp


def sample_flows(stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        out.append(datapath_flows())
        stop.wait(SAMPLE)


def phase(name: str, seconds: float, idle: int | None, run=None) -> dict:
    """Sample the flow count for ``seconds`` while ``run(stop)`` (if any) makes traffic."""
    counts: list[int] = []
    stop = threading.Event()
    threads = [threading.Thread(target=sample_flows, args=(stop, counts), daemon=True)]
    if run is not None:
        threads.append(threading.Thread(target=run, args=(stop,), daemon=True))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    row = {"phase": name, "seconds": seconds, "samples": len(counts), "max": max(counts, default=0),
           "last": counts[-1] if counts else 0}
    row["above_idle"] = row["max"] - (idle if idle is not None else row["max"])
    print(f"  {name:>10}: max {row['max']} flows, last {row['last']}, above idle {row['above_idle']}", flush=True)
    return row


def kvs_phase(tb: Testbed, seconds: float, idle: int) -> dict:
    svc = "ownkv"
    tb.registry.create_service(svc)
    procs = [kvs.start_server(tb, "vfh1", "a", svc, f"0-{HALF:#x}"),
             kvs.start_server(tb, "vfh4", "b", svc, f"{HALF + 1:#x}-{codec.KEY_MAX:#x}")]
    loads = []
    try:
        tb.wait_revision(tb.registry.state_revision())
        for host in ("vfh3", "vfh5"):
            loads.append(kvs.start_load(tb, host, f"ownload-{host}", svc, duration=seconds + 1.5, clients=4,
                                        keys=256, prefix=f"L{host}", mix="1:1:0", value_size=64))
        time.sleep(1.0)   # the load processes start
        row = phase("kvs", seconds, idle)
        docs = [kvs.finish_load(tb, p, out, wait=seconds + 60) for p, out in loads]
        row["requests"] = sum(d["summary"]["ops"] for d in docs)
        row["failed"] = sum(1 for d in docs for h in d["history"] if h[6] not in ("OK", "NOT_FOUND"))
        return row
    finally:
        for p in procs:
            tb.sup.stop(p)


def door_phase(tb: Testbed, seconds: float, idle: int, sources: int, rate: float) -> dict:
    reg = tb.registry
    svc = "owndoor"
    made = reg.create_service(svc)
    reg.put(schema.service_key(svc), schema.Service(
        name=svc, id=made.id, frontdoors=[{"kind": "udp", "ip": DOOR_IP, "port": DOOR_PORT, "key": "ip_src"}]).to_json())
    for name, host in (("a", "vfh1"), ("b", "vfh4")):
        ep = schema.Endpoint(service=svc, name=name, mac=tb.hosts[host]["mac"], rx="ovs", host=host)
        reg.put(schema.endpoint_key(svc, name), ep.to_json())
    for h in DOOR_HOSTS:   # many clients behind each sender: not source-guarded (module docstring)
        reg.put_host(tb.host_record(h, ips=[]))
    reg.assign(svc, Range(0, HALF), "a")
    rev = reg.assign(svc, Range(HALF + 1, codec.KEY_MAX), "b")
    tb.wait_revision(rev)
    rnd = random.Random(7)
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    addrs = rnd.sample(range(1, 1 << 24), sources)   # keys spread over both halves
    sent = {h: 0 for h in DOOR_HOSTS}
    dst = int(ipaddress.IPv4Address(DOOR_IP))

    def sender(host: str, stop: threading.Event) -> None:
        info = tb.hosts[host]
        mac = bytes.fromhex(info["mac"].replace(":", ""))
        with netns(tb.netns(host)):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        s.bind((info["iface"], 0))
        frames = [udp_frame(mac, (base & 0xFF000000) | a, dst, DOOR_PORT, b"\0\1\0\0\0\1\0\0get k\r\n")
                  for a in addrs]
        gap, nxt, i = 1.0 / rate, time.monotonic(), 0
        try:
            while not stop.is_set():
                s.send(frames[i % len(frames)])
                i += 1
                nxt += gap
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        finally:
            sent[host] = i
            s.close()

    def run(stop: threading.Event) -> None:
        ts = [threading.Thread(target=sender, args=(h, stop), daemon=True) for h in DOOR_HOSTS]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    try:
        row = phase("frontdoor", seconds, idle, run)
    finally:
        for h in DOOR_HOSTS:
            reg.put_host(tb.host_record(h))
    row.update(sources=sources, rate_per_host=rate, sent=dict(sent))
    return row


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--sources", type=int, default=None, help="source addresses at the front door (default 1000, "
                    "smoke 200)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per phase (default 8, smoke 3)")
    ap.add_argument("--rate", type=float, default=2000.0, help="datagrams/s per front-door host (default 2000)")
    args = ap.parse_args()
    if not_root("own_flows", "network namespaces, Open vSwitch"):
        return 2
    sources = args.sources or (200 if args.smoke else 1000)
    seconds = args.seconds or (3.0 if args.smoke else 8.0)
    if not 1 <= sources <= 1 << 20:
        print(f"own_flows: --sources {sources} is out of range 1..{1 << 20}", file=sys.stderr)
        return 2
    rows = []
    with Testbed("line,2,3") as tb:
        time.sleep(2.0)
        rows.append(phase("idle", min(seconds, 2.0), None))
        idle = rows[0]["max"]
        rows.append(kvs_phase(tb, seconds, idle))
        rows.append(door_phase(tb, seconds, idle, sources, args.rate))
    print("\ndatapath flows cached by vfab's own traffic (ovs-appctl upcall/show, both switches)")
    print(f"{'phase':>10} {'max':>7} {'last':>7} {'above idle':>10}")
    for r in rows:
        print(f"{r['phase']:>10} {r['max']:>7} {r['last']:>7} {r['above_idle']:>10}")
    bad = rows[1].get("failed", 0)
    if bad:
        print(f"WARNING: {bad} KVS requests failed during the load")
    write("own_flows", {"smoke": args.smoke, "sources": sources, "seconds": seconds, "rate": args.rate,
                        "topo": "line,2,3"}, {"phases": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
