"""sdhcp's per-request path in one shard: CPU per DISCOVER and REQUEST, batched, alone, and alone with gaps;
the Python loop's path and the native lane's, side by side.

What a shard's loop does with the requests one pass of it reads from its port, run in this process: the real
``SdhcpLoop`` of shard ``a`` (on testbed host vfh1, its endpoint announced in etcd, the whole key space
assigned to it, its real SQLite store with group commit) handles front-door-shaped frames (Ethernet/IPv4/UDP
DHCP to the shard's port MAC, as the dhcp4 door delivers them): wrap, classify by key, serve
(``handle_batch``: parse, the store's reads and writes, one transaction per batch), the group fsync a batch
holding a REQUEST waits for, and each reply built and sent on the shard's real port.  Not in it: the poll and
the receive system calls before a pass (``bench/sdhcp_lease.py`` measures the shards whole, on the fabric,
with the clients' traffic through OVS).  That makes this the steady, low-noise measure of the Python path
itself, where ``sdhcp_lease``'s CPU per lease swings with the machine.

N distinct clients (random MACs, so their keys spread over the pool) send a DISCOVER each, then a REQUEST for
the address offered (SELECTING, with the server identifier), three ways, side by side:

* ``b16``: batches of 16, back to back (a loaded shard: one transaction and one fsync per 16 requests);
* ``b1``: one request per batch, back to back (every REQUEST waits for its own fsync, as a lone client's);
* ``b1-gap``: one request per batch with ``--gap`` (4 ms) of sleep between them, as requests arrive at a
  quiet shard (245 udhcpc clients starting over ~1.3 s, or perfdhcp at 250/s): the very same work, but
  between two requests the core runs something else or idles, and the next one finds its caches cold.
  (N/4 clients, to keep the sleeps short.)

The same three ways through the shard's **native lane** (``lane-b16``, ``lane-b1``, ``lane-b1-gap``;
``services/sdhcp/lane.py``): each batch is one pass of the lane over the frames (``NativeLane.serve``: parse,
the store's reads and writes in one transaction, the reply frames), then, for REQUESTs, the fdatasync of the
WAL its thread makes before ACKs leave, and each reply sent on the port.  Not in it either: the lane thread's
poll and receive.

Each way gets a fresh store and fresh clients; the order alternates between rounds.  CPU seconds are this
process's (``time.process_time``: the loop's work plus what the kernel does for its sends and fsyncs, not
the sleeps); wall seconds around the same work, sleeps included.

Run: ``/opt/vfab-venv/bin/python bench/sdhcp_path.py [--clients 2000] [--rounds 3] [--smoke]`` (root).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import time
from ipaddress import IPv4Address

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import not_root, parser, write  # noqa: E402

# name: (requests per batch, gaps, native lane)
WAYS = {"b16": (16, False, False), "b1": (1, False, False), "b1-gap": (1, True, False),
        "lane-b16": (16, False, True), "lane-b1": (1, False, True), "lane-b1-gap": (1, True, True)}
OPTS = {"pool": "10.77.0.10-10.77.63.250", "mask": "18", "server": "10.77.0.1", "router": "10.77.0.2",
        "dns": "10.77.0.3", "lease": "600", "t1": "300", "t2": "525"}
PRL = bytes([1, 3, 6, 15, 51, 54])   # what udhcpc asks for


def run_once(tb, n: int, batch: int, gap: float, tag: str, native: bool = False) -> dict:
    """One fresh shard and store, ``n`` clients through DISCOVER then REQUEST in batches of ``batch``, ``gap``
    seconds of sleep after each batch; ``native``: through the shard's native lane."""
    from vfab.services.sdhcp import ipudp, wire
    from vfab.services.sdhcp.config import parse_opts
    from vfab.services.sdhcp.server import open_server
    from vfab.services.sdhcp.wire import Message, MessageType, Opt
    from vfab.vid.ranges import FULL
    from vfab.vid.state.view import read_view

    reg, svc = tb.registry, f"dhpath{tag}"
    data = os.path.join(tb.workdir, f"data-{svc}")
    reg.create_service(svc, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    loop = open_server(reg, svc, "a", tb.hosts["vfh1"]["iface"], data, parse_opts(OPTS), netns=tb.netns("vfh1"),
                       native=native)
    try:
        reg.assign(svc, FULL, "a")
        loop._set_view(read_view(reg, svc))
        loop.lease.start()                       # what serve() starts: the shard serves while its lease lives
        if native:
            if loop.lane is None:
                raise RuntimeError("the shard has no native lane (see its warning): make -C services/sdhcp/native")
            loop._lane_sync()                    # what serve() grants it: every key
        sent: list[bytes] = []
        real_send = loop.port.send

        def send(frame: bytes) -> bool:
            sent.append(frame)
            return real_send(frame)
        loop.port.send = send
        zero, bcast, server = IPv4Address("0.0.0.0"), IPv4Address("255.255.255.255"), IPv4Address(OPTS["server"])

        def frame(mac: bytes, msg: Message) -> bytes:
            return ipudp.Datagram(loop.port.mac, mac, zero, bcast, 68, 67, msg.serialize()).serialize()

        macs = [bytes([0x02, 0x5D]) + random.getrandbits(32).to_bytes(4, "big") for _ in range(n)]
        discovers = [frame(m, Message(op=1, xid=i, chaddr=m, options={
            Opt.MSG_TYPE: bytes([MessageType.DISCOVER]), Opt.PARAM_REQUEST_LIST: PRL})) for i, m in enumerate(macs)]

        def serve(frames: list[bytes], durable: bool) -> tuple[float, float]:
            """What one pass of the loop (EndpointLoop.serve/_batch), or of the lane's thread (lane_run), does
            with each batch it read."""
            t, c = time.perf_counter(), time.process_time()
            for i in range(0, len(frames), batch):
                if native:
                    replies = loop.lane.serve(frames[i:i + batch], int(time.time() * 1000))
                    if durable:
                        loop.backend.store.sync()   # the lane's fdatasync of the WAL before its ACKs leave
                    for r in replies:
                        if r is None:
                            raise RuntimeError(f"the lane left a request to the loop: {loop.lane.counters()}")
                        send(r)
                else:
                    loop._handle([(f, 0) for f in frames[i:i + batch]])
                    if loop.unsynced_since:      # the port is drained: the group fsync, then the ACKs leave
                        loop._sync_now()
                if gap:
                    time.sleep(gap)
            return time.perf_counter() - t, time.process_time() - c

        d_wall, d_cpu = serve(discovers, False)
        offers = [wire.parse(ipudp.parse(f).payload) for f in sent]
        sent.clear()
        requests = [frame(o.chaddr, Message(op=1, xid=o.xid, chaddr=o.chaddr, options={
            Opt.MSG_TYPE: bytes([MessageType.REQUEST]), Opt.SERVER_ID: server.packed,
            Opt.REQUESTED_IP: o.yiaddr.packed, Opt.PARAM_REQUEST_LIST: PRL})) for o in offers]
        r_wall, r_cpu = serve(requests, True)
        acks = [wire.parse(ipudp.parse(f).payload) for f in sent]
        ok = len(offers) == n and len(acks) == n and all(a.msg_type is MessageType.ACK for a in acks)
        if not ok:
            raise RuntimeError(f"batch {batch}: {len(offers)} OFFERs and {len(acks)} replies to the REQUESTs for "
                               f"{n} clients (counters {dict(loop.backend.counters)}, loop {dict(loop.counters)})")
        return {"discover_cpu_us": d_cpu / n * 1e6, "discover_wall_us": d_wall / n * 1e6,
                "request_cpu_us": r_cpu / n * 1e6, "request_wall_us": r_wall / n * 1e6,
                "lease_cpu_ms": (d_cpu + r_cpu) / n * 1e3,
                "fsyncs": loop.counters["group_syncs"] if not native else -(-n // batch)}
    finally:
        loop.close()
        loop.backend.store.close()
        reg.delete_service(svc)
        shutil.rmtree(data, ignore_errors=True)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=None, help="clients per run (default 2000; smoke 200)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, each way once per round (default 3; smoke 1)")
    ap.add_argument("--gap", type=float, default=0.004, help="s of sleep between requests in b1-gap (default 0.004)")
    args = ap.parse_args()
    if not_root("sdhcp_path", "a testbed host's namespace and raw socket"):
        return 1
    n = args.clients or (200 if args.smoke else 2000)
    rounds = args.rounds or (1 if args.smoke else 3)
    from vfab.testbed.fabric import Testbed

    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    with Testbed("line,1,1", poll=1.0) as tb:
        for r in range(rounds):
            for way in (list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]):
                batch, gaps, native = WAYS[way]
                got = run_once(tb, max(16, n // 4) if gaps else n, batch, args.gap if gaps else 0.0,
                               f"{r}{way.replace('-', '')}", native)
                runs[way].append(got)
                print(f"  round {r + 1}, {way:11s}: DISCOVER {got['discover_cpu_us']:6.1f} us CPU, "
                      f"REQUEST {got['request_cpu_us']:6.1f} us CPU ({got['fsyncs']} fsyncs), "
                      f"{got['lease_cpu_ms']:.3f} CPU-ms per lease", flush=True)
    med = {w: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for w, rs in runs.items()}
    print(f"\nsdhcp shard's path, {n} clients ({max(16, n // 4)} with gaps of {args.gap * 1e3:g} ms), {rounds} "
          "round(s), medians:")
    print(f"  {'way':11s} {'DISCOVER us':>12s} {'REQUEST us':>11s} {'CPU-ms/lease':>13s}")
    for w in WAYS:
        print(f"  {w:11s} {med[w]['discover_cpu_us']:12.1f} {med[w]['request_cpu_us']:11.1f} "
              f"{med[w]['lease_cpu_ms']:13.3f}")
    ratios = {"b16_over_b1": round(med["b16"]["lease_cpu_ms"] / med["b1"]["lease_cpu_ms"], 3),
              "gap_over_b1": round(med["b1-gap"]["lease_cpu_ms"] / med["b1"]["lease_cpu_ms"], 3),
              **{f"lane_over_python_{w}": round(med[f"lane-{w}"]["lease_cpu_ms"] / med[w]["lease_cpu_ms"], 3)
                 for w in ("b16", "b1", "b1-gap")}}
    print(f"  CPU per lease, batches of 16 over one at a time: {ratios['b16_over_b1']}; one at a time with "
          f"{args.gap * 1e3:g} ms gaps over back to back: {ratios['gap_over_b1']}")
    print("  the native lane's CPU per lease over the Python loop's: " +
          ", ".join(f"{w} {ratios['lane_over_python_' + w]}" for w in ("b16", "b1", "b1-gap")))
    write("sdhcp_path", {"clients": n, "gap_clients": max(16, n // 4), "rounds": rounds, "gap_s": args.gap,
                         "ways": {w: {"batch": b, "gaps": g, "native": nat} for w, (b, g, nat) in WAYS.items()}, "smoke": args.smoke,
                         "pool": OPTS["pool"]},
          {"median": med, "ratios": ratios, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
