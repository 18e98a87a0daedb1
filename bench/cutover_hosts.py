"""Cut-over across hosts vs on one host, side by side in one run, and the route agent's failover time.

Per host count N (default 2, 3, 4; ``HostsTestbed(N)``: a namespace + Open vSwitch per host, Geneve tunnels
built by the node agents, one route agent per host, ``python -m vfab.controller --node HOST``), a client on
host1 streams native vfab frames (one per ``--interval-ms``) to a range; the range is moved, alternately:

- **on one host**: between two endpoints on host1 (only host1's switch changes);
- **across hosts**: between an endpoint on host2 and one on host N (host1 for N = 2): the new owner's host
  applies first, the others point at it once its report is in etcd (docs/architecture.md, "Cut-over order
  across hosts").

Each cut-over is timed from ``time.time()`` just before ``Registry.assign`` to the kernel's receive stamp of
the first frame at the new owner (bench/reroute.py's Receiver/Sender: SO_TIMESTAMPNS, one clock); frames
are numbered, and any number that reached neither owner is lost.

**Failover**: a standby route agent of host1 (a second process, its election lost) runs beside the active one;
the active one is killed -9 and a range change that host1 must apply is written at once; the time until host1's
applied report reaches that revision is the failover (lease TTL ``--election-ttl`` + campaign + re-read +
commit).

Run: ``/opt/vfab-venv/bin/python bench/cutover_hosts.py [--smoke] [--hosts 2,3,4] [--cutovers N]`` (root).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import not_root, parser, summary, write  # noqa: E402
from reroute import Receiver, Sender, wait_switched  # noqa: E402

from vfab.testbed.hosts import HostsTestbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402
from vfab.vid import codec, frame  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.transport import RawPort  # noqa: E402

SERVICE = "xc"
RANGE = Range(0, (codec.KEY_MAX + 1) // 4 - 1)
GOAL_MEDIAN_MS, GOAL_P99_MS, GOAL_FAILOVER_S = 10.0, 25.0, 1.0
STANDBY_PORT = 6654


def run_hosts(n: int, cutovers: int, failovers: int, interval: float, ttl: int) -> dict:
    tb = HostsTestbed(n, ttl=2)
    ports: list[RawPort] = []
    threads: list = []
    out: dict = {"hosts": n}
    try:
        t0 = time.monotonic()
        tb.start()
        reg = tb.registry
        client = tb.add_port("host1")
        local_a, local_b = tb.add_port("host1"), tb.add_port("host1")
        far_a = tb.add_port("host2")
        reg.create_service(SERVICE)
        owners = {"la": ("host1", local_a), "lb": ("host1", local_b), "fa": ("host2", far_a)}
        if n > 2:
            owners["fb"] = (f"host{n}", tb.add_port(f"host{n}"))
        for h in tb.hosts.values():
            for name, info in h.ports.items():
                reg.put_host(schema.Host(mac=info["mac"], dpid=h.dpid, port=info["ofport"], name=name))
        for ep, (host, port) in owners.items():
            reg.announce(schema.Endpoint(service=SERVICE, name=ep, mac=tb.hosts[host].ports[port]["mac"]), ttl=600)
        tb.start_route_agents("--election-ttl", str(ttl))
        dpids = [h.dpid for h in tb.hosts.values()]
        reg.wait_applied(reg.assign(SERVICE, RANGE, "la"), timeout=30, dpids=dpids)
        print(f"{n} hosts up in {time.monotonic() - t0:.1f} s", flush=True)

        def raw(port: str) -> RawPort:
            p = RawPort("eth0", rx="ovs", netns=tb.port_ns(port))
            ports.append(p)
            return p

        rx = {ep: Receiver(ep, raw(port)) for ep, (_, port) in owners.items()}
        src = bytes.fromhex(tb.hosts["host1"].ports[client]["mac"].replace(":", ""))
        data = bytearray(frame.pack(codec.encode(reg.service(SERVICE).id, 7).packed, src, frame.FrameType.REQUEST,
                                    b"xc"))
        tx = Sender([raw(client)], [data], interval, 1e5)
        for t in [*rx.values(), tx]:
            t.start()
            threads.append(t)
        tx.active = 1
        wait_for(lambda: rx["la"].count > 10, 10, "frames at the first owner")
        times: dict[str, list[float]] = {"one_host": [], "across": []}
        slow: dict[str, int] = {"one_host": 0, "across": 0}
        at = "la"
        # one cycle: two moves inside host1, then host1 -> host2 [-> host N] -> host1 (one-host and across moves
        # interleaved, so drift hits both alike); a move is "across" when its two owners sit on different hosts
        cycle = ["lb", "la", "fa", "fb", "la"] if "fb" in owners else ["lb", "la", "fa", "la"]
        starts: list[float] = []
        for to in cycle * cutovers:
            if owners[to] == owners[at]:
                continue
            kind = "one_host" if owners[to][0] == owners[at][0] else "across"
            rx[to].arm()
            t_start = time.time()
            starts.append(t_start)
            rev = reg.assign(SERVICE, RANGE, to)
            if wait_switched(rx[to], [src]):
                times[kind].append(rx[to].first[src] - t_start)
            else:
                slow[kind] += 1
            reg.wait_applied(rev, timeout=10, dpids=dpids)
            at = to
            time.sleep(0.05)
        tx.stopping = True
        time.sleep(0.5)
        got: list[int] = []
        for r in rx.values():
            got += r.seqs.get(src, [])
        sent = tx.sent[0]
        lost = sorted(set(range(sent)) - set(got))
        out["cutover"] = {k: summary(v) for k, v in times.items()}
        out["not_switched_in_2s"] = slow
        out["frames"] = {"sent": sent, "lost": len(lost), "lost_near_a_cutover": near(tx, lost, starts)}
        out["failover"] = failover(tb, reg, dpids, failovers, ttl, "la" if owners[at][0] != "host1" else at)
    finally:
        for t in threads:
            t.stopping = True
        for p in ports:
            p.close()
        tb.stop()
    return out


def near(tx: Sender, lost: list[int], starts: list[float], window: float = 0.1) -> int:
    """How many of the ``lost`` frames were sent within ``window`` s after a cut-over's start (the rest were lost
    away from any cut-over: the datapath or a receiver starved of CPU, not a route)."""
    n = 0
    for seq in lost:
        t = tx.sent_time(0, seq)
        if t is not None and any(0 <= t - s <= window for s in starts):
            n += 1
    return n


def failover(tb: HostsTestbed, reg, dpids: list[int], n: int, ttl: int, at: str) -> dict:
    """Kill -9 host1's active agent with a standby beside it; time until host1 applies the next change."""
    took: list[float] = []
    dpid = tb.hosts["host1"].dpid
    active_port = 6653
    for i in range(n):
        standby_port = STANDBY_PORT if active_port == 6653 else 6653
        standby = tb.start_route_agent("host1", standby_port, "--election-ttl", str(ttl))
        wait_for(lambda: "standby" in open(standby.logpath).read(), 20, "the standby agent standing by")
        to = "lb" if at == "la" else "la"
        tb.kill_route_agent("host1", active_port)
        t0 = time.monotonic()
        rev = reg.assign(SERVICE, RANGE, to)
        reg.wait_applied(rev, timeout=20, dpids=[dpid])
        took.append(time.monotonic() - t0)
        at, active_port = to, standby_port
        reg.wait_applied(rev, timeout=10, dpids=dpids)
    return summary(took)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--hosts", default=None, help="host counts, comma separated (default 2,3,4; smoke 2,3)")
    ap.add_argument("--cutovers", type=int, default=None, help="cut-overs of each kind per host count "
                                                                 "(default 20, smoke 3)")
    ap.add_argument("--failovers", type=int, default=None, help="agent kills per host count (default 3, smoke 1)")
    ap.add_argument("--interval-ms", type=float, default=1.0, help="the client's send interval")
    ap.add_argument("--election-ttl", type=int, default=1, help="the route agents' election lease (s)")
    args = ap.parse_args()
    if not_root("cutover_hosts", "network namespaces, Open vSwitch"):
        return 2
    counts = [int(x) for x in (args.hosts or ("2,3" if args.smoke else "2,3,4")).split(",")]
    cutovers = args.cutovers or (3 if args.smoke else 20)
    failovers = args.failovers or (1 if args.smoke else 3)
    sys.setswitchinterval(0.0005)   # receivers must not wait 5 ms for the GIL behind the sender
    results = {"runs": [run_hosts(n, cutovers, failovers, args.interval_ms / 1e3, args.election_ttl)
                        for n in counts]}
    across = [r["cutover"]["across"] for r in results["runs"] if r["cutover"]["across"].get("n")]
    results["goals"] = {
        "across_median_ms": GOAL_MEDIAN_MS, "across_p99_ms": GOAL_P99_MS, "failover_s": GOAL_FAILOVER_S,
        "across_median_met": all(a["median_ms"] <= GOAL_MEDIAN_MS for a in across),
        "across_p99_met": all(a["p99_ms"] <= GOAL_P99_MS for a in across),
        "zero_lost": all(r["frames"]["lost"] == 0 for r in results["runs"]),
        "failover_met": all(r["failover"].get("max_ms", 1e9) <= GOAL_FAILOVER_S * 1e3 for r in results["runs"]),
    }
    write("cutover_hosts", {"smoke": args.smoke, "hosts": counts, "cutovers": cutovers, "failovers": failovers,
                            "interval_ms": args.interval_ms, "election_ttl": args.election_ttl}, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
