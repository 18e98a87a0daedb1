"""elastic-KVS vs the standard select()-loop KVS: throughput and latency of closed-loop clients (paper Fig. 13).

One fabric (``single,3``: vfh1..vfh3 on one OVS switch).  Both servers sit in vfh1:
the elastic-KVS server ``e1`` owning the whole key space of service ``kvsb`` and the
standard KVS (one file per key, one ``select()`` thread, TCP) listening on vfh1's IP.
The load runs in vfh2: for elastic-KVS the ``load`` process (closed-loop logical
clients on one port), for the standard KVS ``standard.load`` in a process inside
vfh2 (one TCP connection per client).  Workload as in the paper: put/get/delete
uniformly (mix 1:1:1) on 256 keys, 64 B values.  For each client count the two
servers are measured back to back (elastic first), so drift hits both alike.

Run: ``/opt/vfab-venv/bin/python bench/kvs_throughput.py [--smoke]`` (root).
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, write  # noqa: E402
from vfab.services.elastic_kvs.standard import latency_by_op  # noqa: E402
from vfab.testbed import kvs  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402

SERVICE = "kvsb"
KEYS = 256
VALUE = 64
MIX = "1:1:1"
STD_PORT = 7000

# Runs inside vfh2: standard.load against the standard server, its dict printed as JSON.
STD_LOAD = """
import json, sys
from vfab.services.elastic_kvs import standard
host, port, clients, duration, keys, value, seed = sys.argv[1:8]
res = standard.load(host, int(port), int(clients), float(duration), [f"k{i}".encode() for i in range(int(keys))],
                    b"v" * int(value), mix=(1, 1, 1), seed=int(seed))
print(json.dumps(res), flush=True)
"""


def start_standard(tb: Testbed, ip: str) -> object:
    out = os.path.join(tb.workdir, "standard.out")
    open(out, "wb").close()
    cmd = [sys.executable, "-m", "vfab.services.elastic_kvs", "standard-server",
           "--dir", os.path.join(tb.workdir, "standard-data"), "--host", ip, "--port", str(STD_PORT),
           "--netns", tb.netns("vfh1")]
    proc = tb.sup.start("standard-server", cmd, stdout=open(out, "ab"))
    wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 20, "standard server ready")
    if not proc.alive():
        raise RuntimeError(f"standard server died at start:\n{proc.tail()}")
    return proc


def run_elastic(tb: Testbed, clients: int, duration: float, idx: int) -> dict:
    proc, out = kvs.start_load(tb, "vfh2", f"eload-{clients}-{idx}", SERVICE, duration=duration, clients=clients,
                               keys=KEYS, mix=MIX, value_size=VALUE)
    doc = kvs.finish_load(tb, proc, out, wait=duration + 60)
    s = doc["summary"]
    by_op: dict[str, list[float]] = {}
    for h in doc["history"]:   # [client, op, key, value, invoke, respond, status, version]
        by_op.setdefault(h[1], []).append((h[5] - h[4]) * 1e3)
    return {"req_per_s": s["req_per_s"], "median_ms": s["lat_ms"]["median"], "p99_ms": s["lat_ms"]["p99"],
            "ops": s["ops"], "failed": s["failed"], "by_op": latency_by_op(by_op)}


def run_standard(tb: Testbed, ip: str, clients: int, duration: float, idx: int) -> dict:
    out = os.path.join(tb.workdir, f"sload-{clients}-{idx}.json")
    cmd = [sys.executable, "-c", STD_LOAD, ip, str(STD_PORT), str(clients), str(duration), str(KEYS), str(VALUE),
           str(idx)]
    proc = tb.sup.start(f"sload-{clients}-{idx}", cmd, host=tb.host("vfh2"), stdout=open(out, "wb"))
    proc.popen.wait(duration + 60)
    rc = proc.popen.returncode
    tb.sup.stop(proc)
    if rc != 0:
        raise RuntimeError(f"standard load ({clients} clients) exited {rc}:\n{proc.tail()}")
    with open(out) as fh:
        r = json.loads(fh.read().strip().splitlines()[-1])
    return {"req_per_s": round(r["req_per_s"], 1), "median_ms": round(r["lat_ms"]["median"] or 0.0, 3),
            "p99_ms": round(r["lat_ms"]["p99"] or 0.0, 3), "ops": r["ops"], "failed": r["errors"],
            "by_op": r["lat_ms_by_op"]}


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--clients", default=None, help="client counts, comma separated (default 1,4,16,64; smoke 1,4)")
    ap.add_argument("--duration", type=float, default=None, help="s per point and server (default 8; smoke 2)")
    args = ap.parse_args()
    counts = [int(x) for x in (args.clients or ("1,4" if args.smoke else "1,4,16,64")).split(",")]
    duration = args.duration or (2.0 if args.smoke else 8.0)
    params = {"smoke": args.smoke, "clients": counts, "duration_s": duration, "keys": KEYS, "value_size": VALUE,
              "mix": MIX, "topo": "single,3", "servers": "vfh1", "load": "vfh2"}
    rows = []
    with Testbed("single,3") as tb:
        tb.registry.create_service(SERVICE)
        elastic = kvs.start_server(tb, "vfh1", "e1", SERVICE, "0-0xffffff")
        tb.wait_revision(tb.registry.state_revision())
        ip = tb.host("vfh1").IP()
        std = start_standard(tb, ip)
        for i, n in enumerate(counts):
            e = run_elastic(tb, n, duration, i)
            s = run_standard(tb, ip, n, duration, i)
            ratio = round(e["req_per_s"] / s["req_per_s"], 3) if s["req_per_s"] else None
            rows.append({"clients": n, "elastic": e, "standard": s, "ratio_req_per_s": ratio})
            print(f"  clients={n}: elastic {e['req_per_s']:.0f} req/s (failed {e['failed']}), "
                  f"standard {s['req_per_s']:.0f} req/s (failed {s['failed']}), ratio {ratio}", flush=True)
        for proc in (elastic, std):
            tb.sup.stop(proc)
        for proc in (elastic, std):
            if "Traceback" in open(proc.logpath).read():
                print(f"WARNING: {proc.name} raised:\n{proc.tail(20)}")

    print(f"\nelastic-KVS vs standard KVS, mix {MIX}, {KEYS} keys, {VALUE} B values, {duration:g} s per point")
    print(f"{'clients':>7} | {'elastic req/s':>13} {'median':>7} {'p99':>7} {'failed':>6} | "
          f"{'standard req/s':>14} {'median':>7} {'p99':>7} {'failed':>6} | {'ratio':>6}")
    for r in rows:
        e, s = r["elastic"], r["standard"]
        print(f"{r['clients']:>7} | {e['req_per_s']:>13.1f} {e['median_ms']:>7.3f} {e['p99_ms']:>7.3f} "
              f"{e['failed']:>6} | {s['req_per_s']:>14.1f} {s['median_ms']:>7.3f} {s['p99_ms']:>7.3f} "
              f"{s['failed']:>6} | {r['ratio_req_per_s'] or float('nan'):>6.3f}")
    print("(latencies in ms; ratio = elastic req/s / standard req/s)")
    print("median latency by operation, elastic / standard (ms): where a gap at few clients comes from")
    for r in rows:
        e, s = r["elastic"]["by_op"], r["standard"]["by_op"]
        parts = [f"{op} {e[op]['median']:.3f} / {s[op]['median']:.3f}" for op in ("PUT", "GET", "DEL")
                 if op in e and op in s]
        print(f"{r['clients']:>7} | " + ", ".join(parts))
    write("kvs_throughput", params, {"points": rows}, args.out)
    failed = sum(r["elastic"]["failed"] + r["standard"]["failed"] for r in rows)
    if failed:
        print(f"WARNING: {failed} client requests failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
