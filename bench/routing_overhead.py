"""Routing overhead: RTT through VID routes vs plain MAC paths (the paper's Tables II/III).

One process, one fabric ``line,2,3`` (vfh1-3 on vfbs1, vfh4-6 on vfbs2), so
every frame crosses the trunk and is looked up on both switches.
Ping-pong: a client RawPort in one host's namespace sends a 62-byte vfab
REQUEST (14 B Ethernet + 16 B vfab header + 32 B payload), an echo thread with
a RawPort in the server host's namespace answers to the client's MAC, the
client waits for that reply before the next request.  All in this process.

Paths, measured in the same run on the same bridges:

``vid-prefix-random`` / ``vid-suffix-random``
    vfh1 → VID of a *random key per message* of a prefix-/suffix-layout
    service whose whole key space is owned by endpoint ``srv`` on vfh4
    (rx=ovs: vfbs2 rewrites the VID to vfh4's MAC).  The key space is cut
    into K ranges, as K-1 random halvings would leave it (what repeated
    ``split`` operations do): each range is one aligned block, so each service
    has exactly K masked ``eth_dst`` flows in table 1 of each switch, with
    mixed mask lengths.  Random keys are the paper's "random MAC addresses";
    the K pre-populated ranges its pre-populated table.
``vid-prefix-fixed`` / ``vid-suffix-fixed``
    the same route, but one key for every message (separates the cost of the
    VID route from the cost of never hitting the datapath's caches).
``mac-host-route``
    vfh1 → vfh4's MAC: the compiler's priority-500 host route on each switch.
    The baseline of every ratio.
``mac-host-route-alt``
    vfh3 → vfh6's MAC, also by host routes: a control for how much two
    different host pairs differ by themselves on this machine.
``mac-normal``
    vfh2 → vfh5's MAC through ``NORMAL`` MAC learning (the paper's learning
    scheme).  To get it on the same bridges, this benchmark deletes the
    registry's host records of vfh2 and vfh5 (``/vfab/v1/hosts/<mac>``) for
    the run: the compiler then has no host route and no port-security flows
    for them, both directions fall to table 1's priority-0 NORMAL, and OVS
    learns both MACs after the first exchange (``fdb/show`` is recorded).
    The other hosts stay registered, so the other paths are untouched; the
    records are restored at the end.  Compare it with ``mac-host-route-alt``
    as well as with the baseline: it necessarily uses another host pair.

Replies of every path except ``mac-normal`` take vfh1's host route, so the
paths differ only in how the request is routed.  Paths are interleaved in
shuffled rounds, so the machine's noise hits all alike.  Per path it reports
RTT median/p99 (ms), the ratio to ``mac-host-route``, and the userspace
datapath's cache misses (upcalls) per message from ``ovs-appctl dpif/show``
(datapath-wide: anything else running on this OVS adds to it).

The controller's counter poll (a full flow dump of each switch) is set to
once per 600 s so that dumping tens of thousands of flows does not run
during the measurement.

Run: ``/opt/vfab-venv/bin/python bench/routing_overhead.py [--smoke]`` (root).
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.frame import Frame, FrameType  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.transport import RawPort  # noqa: E402

log = logging.getLogger("bench.routing_overhead")
TOPO = "line,2,3"
CLIENT, N_CLIENT, A_CLIENT, SERVER, N_SERVER, A_SERVER = (f"vfh{i}" for i in range(1, 7))
SERVICES = {"ro-prefix": "prefix", "ro-suffix": "suffix"}
OWNER = "srv"
PAYLOAD = bytes(32)
TXN_OPS = 100          # etcd's default --max-txn-ops is 128
BASE = "mac-host-route"
PATHS = ["vid-prefix-random", "vid-suffix-random", "vid-prefix-fixed", "vid-suffix-fixed",
         "mac-host-route", "mac-host-route-alt", "mac-normal"]


# -- range map --------------------------------------------------------------------------
def random_partition(k: int, rnd: random.Random) -> list[Range]:
    """K aligned blocks covering the key space, from K-1 halvings of random blocks."""
    if not 1 <= k <= codec.KEY_MAX + 1:
        raise ValueError(f"K={k} ranges do not fit in {codec.KEY_BITS}-bit keys")
    blocks = [(0, codec.KEY_BITS)]  # (lo, log2 size)
    while len(blocks) < k:
        i = rnd.randrange(len(blocks))
        lo, bits = blocks[i]
        if bits == 0:
            continue
        blocks[i] = (lo, bits - 1)
        blocks.append((lo + (1 << (bits - 1)), bits - 1))
    return sorted(Range(lo, lo + (1 << bits) - 1) for lo, bits in blocks)


def write_ranges(reg, service: str, ranges: list[Range], owner: str) -> int:
    """Replace the service's range map with ``ranges`` owned by ``owner`` (batched puts)."""
    reg.delete_prefix(schema.range_prefix(service))
    rev = 0
    items = [(schema.range_key(service, r.lo), schema.RangeRec(lo=r.lo, hi=r.hi, owner=owner, epoch=1).to_json())
             for r in ranges]
    for i in range(0, len(items), TXN_OPS):
        _, rev = reg.txn([], dict(items[i:i + TXN_OPS]))
    return rev


# -- OVS introspection --------------------------------------------------------------------
def ofctl_count(switch: str, table: int) -> int:
    out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-aggregate", switch, f"table={table}"],
                         capture_output=True, text=True).stdout
    m = re.search(r"flow_count=(\d+)", out)
    return int(m.group(1)) if m else -1


def dp_stats() -> tuple[int, int]:
    """(hit, missed) of the userspace datapath (all netdev bridges of this ovs-vswitchd)."""
    out = subprocess.run(["ovs-appctl", "dpif/show"], capture_output=True, text=True).stdout
    hit = missed = 0
    for m in re.finditer(r"netdev@\S+: hit:(\d+) missed:(\d+)", out):
        hit += int(m.group(1))
        missed += int(m.group(2))
    return hit, missed


def fdb(switch: str) -> list[str]:
    out = subprocess.run(["ovs-appctl", "fdb/show", switch], capture_output=True, text=True).stdout
    return [ln.split()[2] for ln in out.splitlines()[1:] if len(ln.split()) >= 3]


# -- ping-pong --------------------------------------------------------------------------
class Echo(threading.Thread):
    """Answers every REQUEST on ``port`` to its sender, same seq and payload."""

    def __init__(self, port: RawPort):
        super().__init__(name=f"echo-{port.iface}", daemon=True)
        self.port = port
        self.stopping = False
        self.served = 0

    def run(self) -> None:
        port = self.port
        while not self.stopping:
            f = port.recv(0.1)
            if f is None or f.type is not FrameType.REQUEST:
                continue
            port.send(Frame(dst=f.src, src=port.mac, type=FrameType.REPLY, payload=f.payload,
                            channel=f.channel, seq=f.seq))
            self.served += 1


class Pinger:
    def __init__(self, port: RawPort, timeout: float = 1.0):
        self.port = port
        self.timeout = timeout
        self.seq = 0
        self.lost = 0

    def rtt(self, dst: bytes) -> float | None:
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        seq = self.seq
        data = Frame(dst=dst, src=self.port.mac, type=FrameType.REQUEST, payload=PAYLOAD, seq=seq).serialize()
        t0 = time.perf_counter()
        self.port.send(data)
        deadline = t0 + self.timeout
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                self.lost += 1
                return None
            f = self.port.recv(left)
            if f is not None and f.type is FrameType.REPLY and f.seq == seq:
                return time.perf_counter() - t0


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--ks", default=None, help="comma-separated range counts K (default 1,1000,10000; smoke 1,100)")
    ap.add_argument("--count", type=int, default=None, help="messages per path per K (default 10000; smoke 200)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per K (default 20; smoke 4)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ks = [int(x) for x in (args.ks or ("1,100" if args.smoke else "1,1000,10000")).split(",")]
    count = args.count or (200 if args.smoke else 10000)
    rounds = args.rounds or (4 if args.smoke else 20)
    per_round = max(1, count // rounds)
    warmup = 30 if args.smoke else 200
    rnd = random.Random(args.seed)
    params = {"smoke": args.smoke, "topo": TOPO, "ks": ks, "messages_per_path": per_round * rounds,
              "rounds": rounds, "frame_bytes": 14 + 16 + len(PAYLOAD), "seed": args.seed,
              "client": CLIENT, "server": SERVER, "normal_pair": [N_CLIENT, N_SERVER], "alt_pair": [A_CLIENT, A_SERVER], "ctl_poll_s": 600}

    tb = Testbed(TOPO, poll=600)
    ports: list[RawPort] = []
    echoes: list[Echo] = []
    removed: list[schema.Host] = []
    results: dict = {"per_k": {}}
    try:
        t_start = time.monotonic()
        tb.start()
        print(f"testbed {TOPO} up in {time.monotonic() - t_start:.1f} s (includes waiting for the testbed lock)",
              flush=True)
        reg = tb.registry
        h = tb.hosts
        svcs = {name: reg.create_service(name, layout=layout) for name, layout in SERVICES.items()}
        for name in svcs:
            reg.announce(schema.Endpoint(service=name, name=OWNER, mac=h[SERVER]["mac"], rx="ovs", host=SERVER),
                         ttl=10, allow_shared=True)  # one echo thread answers both services
        # The NORMAL pair: no host records, so no host routes and no port security for them.
        for name in (N_CLIENT, N_SERVER):
            info = h[name]
            removed.append(tb.host_record(name))
            reg.delete(schema.host_key(info["mac"]))

        def port(host: str) -> RawPort:
            p = RawPort(h[host]["iface"], rx="ovs", netns=tb.netns(host))
            ports.append(p)
            return p

        srv, nsrv, asrv = port(SERVER), port(N_SERVER), port(A_SERVER)
        cli, ncli, acli = Pinger(port(CLIENT)), Pinger(port(N_CLIENT)), Pinger(port(A_CLIENT))
        for p in (srv, nsrv, asrv):
            e = Echo(p)
            e.start()
            echoes.append(e)
        server_mac = codec.mac_to_int(h[SERVER]["mac"]).to_bytes(6, "big")
        nserver_mac = codec.mac_to_int(h[N_SERVER]["mac"]).to_bytes(6, "big")
        aserver_mac = codec.mac_to_int(h[A_SERVER]["mac"]).to_bytes(6, "big")
        layouts = {"prefix": svcs["ro-prefix"], "suffix": svcs["ro-suffix"]}
        fixed_key = {lay: rnd.randrange(codec.KEY_MAX + 1) for lay in layouts}

        def destination(path: str):
            """(pinger, dst-bytes factory) of a path."""
            if path == "mac-host-route":
                return cli, lambda: server_mac
            if path == "mac-host-route-alt":
                return acli, lambda: aserver_mac
            if path == "mac-normal":
                return ncli, lambda: nserver_mac
            _, lay, how = path.split("-")
            svc = layouts[lay]
            if how == "fixed":
                vid = codec.encode(svc.id, fixed_key[lay], layout=lay).packed
                return cli, lambda: vid
            return cli, lambda: codec.encode(svc.id, rnd.randrange(codec.KEY_MAX + 1), layout=lay).packed

        for k in ks:
            t0 = time.monotonic()
            parts = {name: random_partition(k, rnd) for name in svcs}
            for name, rs in parts.items():
                write_ranges(reg, name, rs, OWNER)
            rev = reg.state_revision()
            reg.wait_applied(rev, timeout=300)
            install_s = time.monotonic() - t0
            flows = {sw: {"table0": ofctl_count(sw, 0), "table1": ofctl_count(sw, 1)} for sw in tb.switches}
            masks = len({r.size for rs in parts.values() for r in rs})
            print(f"K={k}: ranges written and applied in {install_s:.1f} s; flows {flows}; "
                  f"{masks} distinct block sizes", flush=True)

            samples: dict[str, list[float]] = {p: [] for p in PATHS}
            misses: dict[str, list[int]] = {p: [0, 0] for p in PATHS}   # [datapath misses, messages]
            lost0 = {p: 0 for p in PATHS}
            for path in PATHS:  # warm up: NORMAL learns, caches fill, first upcalls done
                pinger, dst = destination(path)
                for _ in range(warmup):
                    pinger.rtt(dst())
            for _ in range(rounds):
                order = PATHS[:]
                rnd.shuffle(order)
                for path in order:
                    pinger, dst = destination(path)
                    lost_before = pinger.lost
                    _, m0 = dp_stats()
                    got = samples[path]
                    for _ in range(per_round):
                        r = pinger.rtt(dst())
                        if r is not None:
                            got.append(r)
                    _, m1 = dp_stats()
                    misses[path][0] += m1 - m0
                    misses[path][1] += per_round
                    lost0[path] += pinger.lost - lost_before
            stats = {p: summary(samples[p]) for p in PATHS}
            base = stats[BASE]
            for p in PATHS:
                s = stats[p]
                s["lost"] = lost0[p]
                s["dp_misses_per_msg"] = round(misses[p][0] / max(misses[p][1], 1), 3)
                if s.get("n") and base.get("n"):
                    s["ratio_median_vs_mac"] = round(s["median_ms"] / base["median_ms"], 3)
                    s["ratio_p99_vs_mac"] = round(s["p99_ms"] / base["p99_ms"], 3)
            results["per_k"][str(k)] = {"install_s": round(install_s, 2), "flows": flows,
                                        "distinct_block_sizes": masks, "paths": stats}
            print(f"K={k}:")
            print(f"  {'path':<20} {'median ms':>10} {'p99 ms':>9} {'x mac med':>10} {'x mac p99':>10} "
                  f"{'dp miss/msg':>12} {'lost':>5}")
            for p in PATHS:
                s = stats[p]
                print(f"  {p:<20} {s.get('median_ms', float('nan')):>10.3f} {s.get('p99_ms', float('nan')):>9.3f} "
                      f"{s.get('ratio_median_vs_mac', float('nan')):>10.2f} {s.get('ratio_p99_vs_mac', float('nan')):>10.2f} "
                      f"{s['dp_misses_per_msg']:>12.3f} {s['lost']:>5}", flush=True)
        results["normal_learned"] = {sw: sorted(m for m in fdb(sw) if m in (h[N_CLIENT]["mac"], h[N_SERVER]["mac"]))
                                     for sw in tb.switches}
        results["echo_served"] = {e.port.iface: e.served for e in echoes}
        results["wall_s"] = round(time.monotonic() - t_start, 1)
        for hst in removed:
            reg.put_host(hst)
        removed.clear()
    finally:
        for e in echoes:
            e.stopping = True
        for e in echoes:
            e.join(timeout=1)
        for p in ports:
            p.close()
        tb.stop()
    write("routing_overhead", params, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
