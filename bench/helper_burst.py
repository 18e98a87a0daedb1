"""Goodput under bursts that saturate memcached: direct vs 1 and 2 PostMan helpers vs twemproxy, side by side (issue 43).

The Python clients of helper_batching.py cannot offer more than ~60-75 K gets/s here, about where direct
memcached starts losing requests; this bench offers more, with ``dpdk/mch_blast`` (raw single-key ``get``
frames as a Linux memcached client sends them, 256 source ports, 1,000 keys of 64-byte values, at a fixed
rate through AF_PACKET).  Rig: services/memcached-helper/topo.py (one client namespace on the Linux bridge,
memcached ``-t 1`` and the generator on CPU 0, the helpers on lcore 1 with the fabric's options: 1 connection,
T <= 1 ms).  The frames come from a MAC that is not the generator's (a static bridge entry sends replies to
its port; memcached's neighbour entry for the client points there too), so every reply — memcached's or a
helper's — is counted on the generator's interface (rx frames) and dropped by its kernel before IP.

Per load and path: goodput = reply frames / request frames over a window inside the run (each get of a stored
key is answered by exactly one datagram); memcached's CPU per answered get; the helpers' CPU per answered get;
whole-machine CPU per answered get (/proc/stat).  Paths: direct (frames to memcached's MAC), 1 helper (to the
helper's MAC), 2 helpers (two generators at half the rate each, one per helper).  The summary gives each
helper path's goodput over direct's at the same load (issue 43's goal: >= 1 at every load, >= 2 where direct
memcached is saturated).

Overload is shed, not queued without bound: each helper row gives what the helpers dropped and why (their
stats files: ``drop_busy`` a connection's 64 batches in flight or 1 MB of output full, ``drop_peers`` no
waiting-client slot, ``tx_drop``/``tx_nombuf`` replies not sent, ``port_imissed`` frames the kernel ring lost)
and the helpers' CPU share (a helper that spins would show ~1 core with few answers).

twemproxy (Debian's ``nutcracker``, TCP only; on the helpers' core, after the helper rows): the same gets at the
same rate from ``dpdk/mch_tcpblast`` (open loop, pipelined over 64 connections; a connection with 2,000 gets
unanswered skips its next ones, as a client past its timeout would; skipped gets count against goodput).

``--memcached-share S`` caps memcached at S of a CPU (a cgroup, for every path alike): a memcached so small
that even the helpers' multi-gets saturate it, to see the helpers past their own saturation — they must keep
answering what memcached can take and shed the rest explicitly (counted), not wedge or spin.

Run: ``/opt/vfab-venv/bin/python bench/helper_burst.py [--smoke] [--rates 50000,100000,300000] [--duration 3]``
(root).  Results: bench/results/helper_burst[-smoke].json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import not_root, parser, write  # noqa: E402
from bench.helper_batching import machine_busy_s  # noqa: E402
from bench.helper_common import FABRIC_HELPER_OPTS, CpuCap, helper_pkg, quiet_machine  # noqa: E402

PREFIX = "burst-"
KEYS = 1000
VALUE = 64
FAKE_MAC = "02:00:00:00:be:01"   # the generator's frames' source: not its interface's MAC
WARMUP, TAIL = 0.5, 0.3
PATHS = (("direct", 0), ("1helper", 1), ("2helpers", 2))
SHED = ("drop_busy", "drop_peers", "drop_noconn", "tx_drop", "tx_nombuf", "port_imissed", "refused_big", "stalls",
        "relay_noconn", "relay_busy", "relay_fail", "relay_expired", "w_abort_miss")
TCP_CONNS, TCP_BACKLOG = 64, 2000


def blasts(t, blast: str, macs: list[str], rate: int, duration: float) -> list[subprocess.Popen]:
    return [subprocess.Popen(["ip", "netns", "exec", t.ns_c[0], "taskset", "-c", "0", blast, "--iface", t.if_c[0],
                              "--dst-mac", mac, "--src-mac", FAKE_MAC, "--src-ip", t.client_ips[0], "--dst",
                              t.server(), "--keys", str(KEYS), "--prefix", PREFIX, "--duration", str(duration),
                              "--rate", str(rate // len(macs))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mac in macs]


def measure(t, topo, blast: str, path: str, n: int, rate: int, window: float) -> dict:
    macs = [t.mac_mc] if n == 0 else t.mac_hs[:n]
    pids = [p.pid for p in t.helpers[:n] if p is not None]
    gens = blasts(t, blast, macs, rate, WARMUP + window + TAIL)
    time.sleep(WARMUP)

    def snap() -> tuple:
        return (time.monotonic(), t.link(t.ns_c[0], t.if_c[0]), topo.proc_cpu_s(t.memcached.pid),
                sum(topo.proc_cpu_s(p) for p in pids), machine_busy_s())
    st0 = [t.stats(i) for i in range(n)]
    a = snap()
    time.sleep(window)
    b = snap()
    st1 = [t.stats(i) for i in range(n)]
    for g in gens:
        _, err = g.communicate(timeout=WARMUP + window + TAIL + 30)
        if g.returncode != 0:
            raise RuntimeError(f"mch_blast failed ({g.returncode}): {err.strip()}")
    el = b[0] - a[0]
    sent, back = b[1]["tx_packets"] - a[1]["tx_packets"], b[1]["rx_packets"] - a[1]["rx_packets"]
    answered = max(back, 1)
    row = {"path": path, "helpers": n, "offered_per_s": rate, "sent_per_s": round(sent / el),
           "answered_per_s": round(back / el), "goodput": round(min(back / max(sent, 1), 1.0), 4),
           "memcached_cpu_us_per_get": round((b[2] - a[2]) / answered * 1e6, 3),
           "memcached_cpu_share": round((b[2] - a[2]) / el, 3),
           "helpers_cpu_us_per_get": round((b[3] - a[3]) / answered * 1e6, 3) if pids else None,
           "machine_cpu_us_per_get": round((b[4] - a[4]) / answered * 1e6, 3),
           "helpers_cpu_share": round((b[3] - a[3]) / el, 3) if pids else None,
           "shed": {k: sum(y.get(k, 0) - x.get(k, 0) for x, y in zip(st0, st1)) for k in SHED} if n else None,
           # what reached the helpers and what they sent back, to place a loss the helpers do not count
           "helpers_rx_per_s": round(sum(y.get("rx_dgrams", 0) - x.get("rx_dgrams", 0) for x, y in zip(st0, st1))
                                     / el) if n else None,
           "helpers_replies_per_s": round(sum(y.get("reply_dgrams", 0) - x.get("reply_dgrams", 0)
                                              for x, y in zip(st0, st1)) / el) if n else None}
    print(f"{rate:>7}/s {path:>9}: sent {row['sent_per_s']}/s, answered {row['answered_per_s']}/s, goodput "
          f"{row['goodput']:.3f}; memcached {row['memcached_cpu_us_per_get']} us/get ({row['memcached_cpu_share']} "
          f"core), helpers {row['helpers_cpu_us_per_get']} us/get, machine {row['machine_cpu_us_per_get']} us/get"
          + (f"; helpers received {row['helpers_rx_per_s']}/s, replied {row['helpers_replies_per_s']}/s; shed "
             f"{ {k: v for k, v in row['shed'].items() if v} }" if n else ""), flush=True)
    return row


def measure_twemproxy(t, topo, tcpblast: str, rate: int, window: float) -> dict:
    """The same gets through twemproxy over TCP (mch_tcpblast in the client namespace, on CPU 0)."""
    gen = subprocess.Popen(["ip", "netns", "exec", t.ns_c[0], "taskset", "-c", "0", tcpblast, "--dst", t.proxy(),
                            "--conns", str(TCP_CONNS), "--backlog", str(TCP_BACKLOG), "--keys", str(KEYS),
                            "--prefix", PREFIX, "--rate", str(rate), "--duration", str(WARMUP + window + TAIL),
                            "--from", str(WARMUP), "--to", str(WARMUP + window)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(WARMUP)
    pid = t.twemproxy.pid

    def snap() -> tuple:
        return time.monotonic(), topo.proc_cpu_s(t.memcached.pid), topo.proc_cpu_s(pid), machine_busy_s()
    a = snap()
    time.sleep(window)
    b = snap()
    out, err = gen.communicate(timeout=WARMUP + window + TAIL + 30)
    if gen.returncode != 0:
        raise RuntimeError(f"mch_tcpblast failed ({gen.returncode}): {err.strip()}")
    g = json.loads(out.strip().splitlines()[-1])
    el = b[0] - a[0]
    offered = g["window_sent"] + g["window_skipped"]
    back = g["window_answered"]
    answered = max(back, 1)
    row = {"path": "twemproxy", "helpers": 0, "offered_per_s": rate, "sent_per_s": round(g["window_sent"] / window),
           "answered_per_s": round(back / window), "goodput": round(min(back / max(offered, 1), 1.0), 4),
           "memcached_cpu_us_per_get": round((b[1] - a[1]) / answered * 1e6, 3),
           "memcached_cpu_share": round((b[1] - a[1]) / el, 3),
           "helpers_cpu_us_per_get": round((b[2] - a[2]) / answered * 1e6, 3),
           "machine_cpu_us_per_get": round((b[3] - a[3]) / answered * 1e6, 3),
           "helpers_cpu_share": round((b[2] - a[2]) / el, 3),
           "shed": {"skipped_by_clients": g["window_skipped"], "errors": g["errors"]}}
    print(f"{rate:>7}/s twemproxy: sent {row['sent_per_s']}/s, answered {row['answered_per_s']}/s, goodput "
          f"{row['goodput']:.3f}; memcached {row['memcached_cpu_us_per_get']} us/get ({row['memcached_cpu_share']} "
          f"core), twemproxy {row['helpers_cpu_us_per_get']} us/get, machine {row['machine_cpu_us_per_get']} us/get; "
          f"clients skipped {g['window_skipped']}", flush=True)
    return row


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rates", default=None, help="offered gets/s, comma-separated (default 50000,100000,300000)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per run (default 3; smoke 1)")
    ap.add_argument("--memcached-share", type=float, default=1.0,
                    help="cap memcached at this share of one CPU for every path (default 1: no cap)")
    args = ap.parse_args()
    if not_root("helper_burst", "network namespaces, DPDK af_packet"):
        return 1
    rates = [int(r) for r in (args.rates or ("60000" if args.smoke else "50000,100000,300000")).split(",")]
    window = args.duration or (1.0 if args.smoke else 3.0)
    helper_pkg()
    from vfab.services.memcached_helper import topo
    work = tempfile.mkdtemp(prefix="vfab-bench-burst-")
    binary = topo.build_helper(os.path.join(work, "build"))
    blast = topo.build_blast(os.path.join(work, "build"))
    tcpblast = os.path.join(work, "build", "mch_tcpblast")   # built with it (make blast)
    t = topo.HelperTopo(os.path.join(work, "run"), clients=1, pin="0", helpers=2)
    rows: list[dict] = []
    rc = 0
    cap = None
    load_before = open("/proc/loadavg").read().split()[:3]   # how loaded the shared machine was (others' work)
    with quiet_machine("helper_burst"):
        t.create()
        try:
            t.start_memcached()
            t.preload(KEYS, prefix=PREFIX, value_size=VALUE)
            if args.memcached_share < 1.0:
                cap = CpuCap(t.tag + "mc", args.memcached_share)
                cap.add(t.memcached.pid)
            port = f"vfm{t.tag}p0"   # the generator's port on the bridge (topo.HelperTopo.create)
            t.ns(t.ns_sw, "bridge", "fdb", "replace", FAKE_MAC, "dev", port, "master", "static")
            t.ns(t.ns_mc, "ip", "neigh", "replace", t.client_ips[0], "lladdr", FAKE_MAC, "dev", t.if_mc, "nud",
                 "permanent")
            for i in range(2):
                t.start_helper(binary, "1", FABRIC_HELPER_OPTS, index=i)
            for rate in rates:
                for path, n in PATHS:
                    rows.append(measure(t, topo, blast, path, n, rate, window))
            for i in range(2):
                rc |= t.stop_helper(index=i) or 0
            t.start_twemproxy(cpus="1")
            for rate in rates:
                rows.append(measure_twemproxy(t, topo, tcpblast, rate, window))
            t.stop_twemproxy()
        finally:
            if cap is not None:
                cap.remove()
            t.destroy()
    summary = {}
    for rate in rates:
        at = {r["path"]: r for r in rows if r["offered_per_s"] == rate}
        d = at["direct"]
        tw = at["twemproxy"]
        for path in ("1helper", "2helpers", "twemproxy"):
            r = at[path]
            summary[f"{rate}/{path}"] = {
                "goodput": r["goodput"], "goodput_direct": d["goodput"],
                "goodput_ratio": round(r["goodput"] / max(d["goodput"], 1e-9), 2),
                "answered_ratio": round(r["answered_per_s"] / max(d["answered_per_s"], 1), 2),
                "direct_saturated": d["goodput"] < 0.95,
                "goodput_vs_twemproxy": round(r["goodput"] / max(tw["goodput"], 1e-9), 2),
                "memcached_cpu_ratio": round(d["memcached_cpu_us_per_get"] / max(r["memcached_cpu_us_per_get"],
                                                                                  1e-9), 2)}
            s = summary[f"{rate}/{path}"]
            print(f"{rate}/s {path}: goodput {s['goodput']:.3f} vs direct {s['goodput_direct']:.3f} "
                  f"(x{s['goodput_ratio']}; direct saturated: {s['direct_saturated']}), x{s['goodput_vs_twemproxy']} "
                  f"twemproxy's; memcached CPU per get {s['memcached_cpu_ratio']}x less than direct", flush=True)
    write("helper_burst", {"smoke": args.smoke, "rates": rates, "window_s": window, "keys": KEYS,
                           "value_bytes": VALUE, "helper_options": " ".join(FABRIC_HELPER_OPTS),
                           "memcached_share": args.memcached_share,
                           "loadavg_before": load_before, "loadavg_after": open("/proc/loadavg").read().split()[:3],
                           "generator": "mch_blast on CPU 0 with memcached; helpers on lcore 1; twemproxy on CPU 1 "
                                        f"fed by mch_tcpblast ({TCP_CONNS} connections, backlog {TCP_BACKLOG})",
                           "helper_exit": rc}, {"rows": rows, "summary": summary}, args.out)
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if rc != 0 or json.dumps(rows).count('"sent_per_s": 0') else 0


if __name__ == "__main__":
    sys.exit(main())
