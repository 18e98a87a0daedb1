"""kill -9 of a PostMan helper under load: time until the clients' throughput is back, on the real fabric.

One ``line,2,3`` fabric (OVS userspace, os-ken, etcd, Mininet): memcached on vfh1 (service ``mc``), helpers h1
(vfh2) and h2 (vfh5) on DPDK, both switched in (``vfab helpers on``); clients on vfh3, vfh4, vfh6 (4 addresses
each) send open-loop gets at ``--rate`` per host and never reconnect.  Under that load h1 is killed, two ways
side by side:

* ``helper``: ``kill -9`` of h1's mc-helper only.  Its agent sees the child die (polled every 20 ms) and
  revokes the endpoint's lease at once; the controller drops h1's bucket.
* ``host``: ``kill -9`` of h1's agent *and* mc-helper (a helper host lost whole): nobody revokes the lease, so
  the bucket leaves when the lease expires (TTL 2 s).

Measured from the clients' side (``mcudp.py load --timeline 0.01``: answers per 10 ms): the **time to restore
throughput** is from the kill to the start of the first 50 ms window whose mean answered rate is back to
>= 90 % of the rate over the second before the kill (and stays there for the next 50 ms); also the longest
pause of any client, the requests lost (sent to h1 before its bucket went: UDP, not retransmitted), and when
h1's endpoint left etcd.  After each round h1 is started again and the helpers switched back on.

PostMan (paper 000): 0.4 s to restore throughput after a helper failure (1,000 connections reconnecting).

Run: ``/opt/vfab-venv/bin/python bench/helper_failover.py [--smoke] [--repeat 3] [--rate 1500]`` (root).
Results: bench/results/helper_failover[-smoke].json.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import not_root, parser, write  # noqa: E402
from bench.helper_common import (FABRIC_CLIENTS, FABRIC_HELPER_OPTS, FABRIC_HELPERS, FABRIC_KEYS,  # noqa: E402
                                 helper_fabric)

CLIENTS, HELPERS, KEYS, HELPER_OPTS = FABRIC_CLIENTS, FABRIC_HELPERS, FABRIC_KEYS, FABRIC_HELPER_OPTS
BIN_S = 0.01


def restore_time(res: list, t_kill: float) -> tuple[float | None, float]:
    """(s from the kill until throughput is back to 90 % of the second before it, that baseline per s)."""
    total: dict[int, int] = {}
    for r in res:   # the clients' bins on one wall-clock grid
        base = int(round(r["t0_wall"] / BIN_S))
        for i, n in enumerate(r["bins"]):
            total[base + i] = total.get(base + i, 0) + n
    k = int(t_kill / BIN_S)
    before = [total.get(i, 0) for i in range(k - int(1.0 / BIN_S), k)]
    baseline = statistics.fmean(before) if before else 0.0
    win = int(0.05 / BIN_S)
    last = max(total)
    for i in range(k, last - 2 * win):
        if all(statistics.fmean(total.get(j, 0) for j in range(s, s + win)) >= 0.9 * baseline
               for s in (i, i + win)):
            return i * BIN_S - t_kill, baseline / BIN_S
    return None, baseline / BIN_S


def one(mc, tb, bind, args, mode: str) -> dict:
    from vfab.services.memcached_helper import topo
    if "h1" not in mc.helpers:
        mc.start_helper("h1", HELPERS["h1"], extra=HELPER_OPTS)
    tb.wait_revision(tb.registry.state_revision())
    mc.helpers_on(sorted(HELPERS))
    seconds = args.seconds
    procs = [mc.client(h, "load", "--clients", "16", "--rate", str(args.rate), "--duration", str(seconds), "--keys",
                       str(KEYS), "--drain", "1.0", "--bind", bind[h], "--timeline", str(BIN_S), "--gap-min", "0.03")
             for h in CLIENTS]
    time.sleep(seconds / 2)
    run = mc.helpers["h1"]
    t_kill = time.time()
    if mode == "host":
        os.kill(run.agent.pid, signal.SIGKILL)
    os.kill(run.pid, signal.SIGKILL)
    t_gone = mc.endpoint_gone("h1", 10.0)
    res = [topo.finish(p, seconds + 60) for p in procs]
    run.agent.popen.wait(10)
    tb.untrack(run.pid)
    mc.stop(run)
    restore, baseline = restore_time(res, t_kill)
    pause = max((g[2] for r in res for g in r["gaps"] if g[1] <= t_kill + 0.05 and g[1] + g[2] >= t_kill),
                default=0.0)
    row = {"mode": mode, "restore_s": round(restore, 3) if restore is not None else None,
           "endpoint_gone_s": round(t_gone - t_kill, 3), "longest_pause_s": round(pause, 3),
           "baseline_per_s": round(baseline), "sent": sum(r["sent"] for r in res),
           "lost": sum(r["lost"] for r in res), "wrong": sum(r["wrong"] for r in res),
           "sources": sorted({s for r in res for s in r["sources"]})}
    print(f"  kill -9 {'agent + mc-helper' if mode == 'host' else 'mc-helper'}: throughput back after "
          f"{row['restore_s']} s (endpoint gone {row['endpoint_gone_s']} s, longest pause {row['longest_pause_s']} s), "
          f"lost {row['lost']}/{row['sent']}, wrong {row['wrong']}", flush=True)
    mc.helpers_off()
    return row


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="kills per mode (default 3; --smoke: 1)")
    ap.add_argument("--rate", type=int, default=1500, help="gets/s per client host (3 hosts; default 1500)")
    ap.add_argument("--seconds", type=float, default=None, help="load per round (default 6; --smoke 5)")
    ap.add_argument("--binary", default=None, help="mc-helper (default: the one 'make helper' built, else built now)")
    args = ap.parse_args()
    if not_root("helper_failover", "network namespaces, Open vSwitch, DPDK af_packet"):
        return 1
    repeat = 1 if args.smoke else args.repeat
    args.seconds = args.seconds or (5.0 if args.smoke else 6.0)
    with helper_fabric(args.binary) as (tb, mc, bind):
        rows: list[dict] = []
        for i in range(repeat):
            print(f"round {i + 1}/{repeat}", flush=True)
            for mode in ("helper", "host"):
                rows.append(one(mc, tb, bind, args, mode))

    def med(mode: str, key: str):
        vals = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None
    summary = {m: {"restore_s_median": med(m, "restore_s"),
                   "restore_s_max": max((r["restore_s"] for r in rows if r["mode"] == m and r["restore_s"] is not None),
                                        default=None),
                   "endpoint_gone_s_median": med(m, "endpoint_gone_s"), "longest_pause_s_median":
                   med(m, "longest_pause_s"), "lost": sum(r["lost"] for r in rows if r["mode"] == m),
                   "sent": sum(r["sent"] for r in rows if r["mode"] == m)} for m in ("helper", "host")}
    summary["postman_restore_s"] = 0.4
    h, lost_host = summary["helper"]["restore_s_median"], summary["host"]["restore_s_median"]
    if h:
        summary["postman_over_helper_kill"] = round(0.4 / h, 1)
    if h and lost_host:
        summary["host_lost_over_helper_kill"] = round(lost_host / h, 1)
    print(f"throughput restored after kill -9 of mc-helper: median {h} s; of the whole helper host (lease expiry): "
          f"{lost_host} s; PostMan: 0.4 s")
    params = {"smoke": args.smoke, "repeat": repeat, "rate_per_host": args.rate, "hosts": len(CLIENTS),
              "seconds": args.seconds, "bin_s": BIN_S, "helper_opts": " ".join(HELPER_OPTS), "lease_ttl_s": 2,
              "clients": "3 hosts x 4 addresses x 16 sockets, open loop, single-key gets"}
    write("helper_failover", params, {"rounds": rows, "summary": summary}, args.out)
    bad = [r for r in rows if r["wrong"] or r["restore_s"] is None or r["sources"] != [mc.addr]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
