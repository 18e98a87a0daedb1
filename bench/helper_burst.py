"""Goodput under bursts that saturate memcached: direct vs 1 and 2 PostMan helpers, side by side (issue 43).

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

Run: ``/opt/vfab-venv/bin/python bench/helper_burst.py [--smoke] [--rates 50000,100000,200000] [--duration 3]``
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
from bench.helper_common import FABRIC_HELPER_OPTS, helper_pkg, quiet_machine  # noqa: E402

PREFIX = "burst-"
KEYS = 1000
VALUE = 64
FAKE_MAC = "02:00:00:00:be:01"   # the generator's frames' source: not its interface's MAC
WARMUP, TAIL = 0.5, 0.3
PATHS = (("direct", 0), ("1helper", 1), ("2helpers", 2))


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
    a = snap()
    time.sleep(window)
    b = snap()
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
           "machine_cpu_us_per_get": round((b[4] - a[4]) / answered * 1e6, 3)}
    print(f"{rate:>7}/s {path:>9}: sent {row['sent_per_s']}/s, answered {row['answered_per_s']}/s, goodput "
          f"{row['goodput']:.3f}; memcached {row['memcached_cpu_us_per_get']} us/get ({row['memcached_cpu_share']} "
          f"core), helpers {row['helpers_cpu_us_per_get']} us/get, machine {row['machine_cpu_us_per_get']} us/get",
          flush=True)
    return row


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rates", default=None, help="offered gets/s, comma-separated (default 50000,100000,200000)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per run (default 3; smoke 1)")
    args = ap.parse_args()
    if not_root("helper_burst", "network namespaces, DPDK af_packet"):
        return 1
    rates = [int(r) for r in (args.rates or ("60000" if args.smoke else "50000,100000,200000")).split(",")]
    window = args.duration or (1.0 if args.smoke else 3.0)
    helper_pkg()
    from vfab.services.memcached_helper import topo
    work = tempfile.mkdtemp(prefix="vfab-bench-burst-")
    binary = topo.build_helper(os.path.join(work, "build"))
    blast = topo.build_blast(os.path.join(work, "build"))
    t = topo.HelperTopo(os.path.join(work, "run"), clients=1, pin="0", helpers=2)
    rows: list[dict] = []
    rc = 0
    with quiet_machine("helper_burst"):
        t.create()
        try:
            t.start_memcached()
            t.preload(KEYS, prefix=PREFIX, value_size=VALUE)
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
        finally:
            t.destroy()
    summary = {}
    for rate in rates:
        at = {r["path"]: r for r in rows if r["offered_per_s"] == rate}
        d = at["direct"]
        for path in ("1helper", "2helpers"):
            r = at[path]
            summary[f"{rate}/{path}"] = {
                "goodput": r["goodput"], "goodput_direct": d["goodput"],
                "goodput_ratio": round(r["goodput"] / max(d["goodput"], 1e-9), 2),
                "answered_ratio": round(r["answered_per_s"] / max(d["answered_per_s"], 1), 2),
                "direct_saturated": d["goodput"] < 0.95,
                "memcached_cpu_ratio": round(d["memcached_cpu_us_per_get"] / max(r["memcached_cpu_us_per_get"],
                                                                                  1e-9), 2)}
            s = summary[f"{rate}/{path}"]
            print(f"{rate}/s {path}: goodput {s['goodput']:.3f} vs direct {s['goodput_direct']:.3f} "
                  f"(x{s['goodput_ratio']}; direct saturated: {s['direct_saturated']}); memcached CPU per get "
                  f"{s['memcached_cpu_ratio']}x less", flush=True)
    write("helper_burst", {"smoke": args.smoke, "rates": rates, "window_s": window, "keys": KEYS,
                           "value_bytes": VALUE, "helper_options": " ".join(FABRIC_HELPER_OPTS),
                           "generator": "mch_blast on CPU 0 with memcached; helpers on lcore 1",
                           "helper_exit": rc}, {"rows": rows, "summary": summary}, args.out)
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if rc != 0 or json.dumps(rows).count('"sent_per_s": 0') else 0


if __name__ == "__main__":
    sys.exit(main())
