"""Time of elastic-KVS state operations (split, merge, mirror, move) under load (paper Table IV analog).

One fabric (``line,2,3``: vfh1-3 on vfbs1, vfh4-6 on vfbs2).  Per key count N and
placement, a fresh service: server ``a`` on vfh1 owning 0-0xffffff and peer ``b``
on vfh2 ("local", same switch) or vfh4 ("remote", across the trunk); N keys of
1 KB preloaded from vfh3.  A ``load`` process on vfh3 (4 clients, put:get 1:1 on
its own 256 keys ``L0..L255``, 64 B values) runs throughout.  The operations, in
order, each on all N keys:

- split  the whole range 0-0xffffff a -> b
- merge  it back (b -> a)
- mirror a -> b (b becomes a mirror of a's range)
- move   a -> b (b, a mirror, becomes the owner)

Per operation: the OpRec's own timings (copy; flip = from the pause to the peer serving;
etcd = the flip's transaction; total), the wall time from the statectl call to
``statectl.wait`` returning (it follows the op's record with an etcd watch), keys
moved (OpRec.done) and the load's latency for requests invoked in that window or in the GAP s after it
(the old copy is dropped in the background after the op has ended, in steps on the loop's thread: its
stalls count as the operation's).  Failed client requests (status not OK/NOT_FOUND) are counted over
the whole load run.  Per operation (and the GAP after it) the servers' own counts of waits over 20 ms
(STATS: long passes of the loop, group fsyncs, a peer's acknowledgement of replicated writes) say which
side held the slow requests.  Then, in the same run, Redis Cluster resharding of the same
N keys (``redis_reshard.measure``, share 1.0, 4 clients) beside elastic's split.

Run: ``/opt/vfab-venv/bin/python bench/kvs_ops.py [--smoke]`` (root).
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import redis_reshard  # noqa: E402
from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed import kvs  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid.state import ctl as statectl  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402

FULL = Range(0, 0xFFFFFF)
PEERS = {"local": "vfh2", "remote": "vfh4"}
OPS = ["split", "merge", "mirror", "move"]
SOURCE = {"split": "a", "merge": "b", "mirror": "a", "move": "a"}   # the endpoint that runs each operation
# Paper Table IV (s): local, remote
PAPER = {"mirror": (1.078, 3.336), "split": (1.289, 3.782), "merge": (1.304, 2.544), "move": (None, 3.871)}
GAP = 0.5          # s of plain load between operations
WARMUP = 1.0       # s of load before the first operation
# the servers' counters of waits over the loop's STALL (20 ms) and their longest (STATS; vid-lib/state/loop.py)
WAITS = ("stall_batch", "stall_chunk", "stall_control", "stall_calls", "stall_wakeup", "sync_slow", "repl_wait_slow",
         "stall_max_ms", "stall_wakeup_max_ms", "sync_max_ms", "repl_wait_max_ms")


def run_op(tb: Testbed, svc: str, name: str) -> dict:
    reg = tb.registry
    start = {
        "split": lambda: statectl.split(reg, svc, FULL, "b"),
        "merge": lambda: statectl.merge(reg, svc, FULL, "a"),
        "mirror": lambda: statectl.mirror(reg, svc, "a", "b"),
        "move": lambda: statectl.move(reg, svc, "a", "b"),
    }[name]
    source = SOURCE[name]
    m0 = time.monotonic()
    started = start()
    m_started = time.monotonic()
    if started.source != source:
        raise RuntimeError(f"{svc} {name}: run by an unexpected endpoint")
    rec = statectl.wait(reg, svc, started.op, timeout=300)
    m1 = time.monotonic()
    return {"op": name, "source": source, "phase": rec.phase, "error": rec.error, "keys": rec.done,
            "total": rec.total, "timings": {k: round(v, 4) for k, v in rec.timings.items()},
            "wall_s": round(m1 - m0, 4), "start_s": round(m_started - m0, 4), "t0": m0, "t1": m1}


def server_waits(tb: Testbed, svc: str) -> dict[str, dict[str, int]]:
    """Each server's counts of waits over the loop's STALL (long passes ``stall_*``, group fsyncs ``sync_slow``,
    a peer's acknowledgement of replicated writes ``repl_wait_slow``) and the longest of each (``*_max_ms``)."""
    out = {}
    for name in ("a", "b"):
        c = statectl.command(tb.registry, svc, name, "STATS", {}).body["counters"]
        out[name] = {k: c.get(k, 0) for k in WAITS}
    return out


def configuration(tb: Testbed, n: int, placement: str, rep: int, load_s: float) -> dict:
    svc = f"kvsops-{placement}-{n}-{rep}"
    tb.registry.create_service(svc)
    procs = [kvs.start_server(tb, "vfh1", "a", svc, "0-0xffffff"),
             kvs.start_server(tb, PEERS[placement], "b", svc)]
    tb.wait_revision(tb.registry.state_revision())
    try:
        t = time.monotonic()
        acked = kvs.preload(tb, "vfh3", svc, n, value_size=1024)
        preload_s = time.monotonic() - t
        if acked != n:
            raise RuntimeError(f"{svc}: preload acknowledged {acked} of {n} keys")
        load, out = kvs.start_load(tb, "vfh3", f"load-{svc}", svc, duration=load_s, clients=4, keys=256,
                                   prefix="L", mix="1:1:0", value_size=64)
        time.sleep(WARMUP + 0.5)  # the load process needs ~0.5 s to start
        ops, ops_start = [], time.monotonic()
        for name in OPS:
            before = server_waits(tb, svc)
            ops.append(run_op(tb, svc, name))
            time.sleep(GAP)
            after = server_waits(tb, svc)
            ops[-1]["waits"] = {who: {k: after[who][k] - before[who][k] for k in WAITS
                                      if not k.endswith("_ms") and after[who][k] > before[who][k]} for who in after}
        run_max = server_waits(tb, svc)
        ops_end = time.monotonic()
        doc = kvs.finish_load(tb, load, out, wait=load_s + 300)
    finally:
        for p in procs:
            tb.sup.stop(p)
    hist = doc["history"]
    waits = doc.get("client_wait_ms") or [0.0] * len(hist)   # the load process's own wait for a core (ms)
    load_end = max((h[5] for h in hist), default=0.0)
    for op in ops:
        # the op and the GAP after it: its background drop of the old copy runs there
        rows = [(h, w) for h, w in zip(hist, waits) if op["t0"] <= h[4] <= op["t1"] + GAP]
        s = summary([h[5] - h[4] for h, _ in rows])
        op["load"] = {"ops": len(rows), "median_ms": s.get("median_ms"), "p99_ms": s.get("p99_ms"),
                      "max_ms": s.get("max_ms"),
                      # the worst latency less the time the client itself then waited for a core
                      "max_less_client_wait_ms": round(max(((h[5] - h[4]) * 1e3 - w for h, w in rows),
                                                           default=0.0), 1),
                      "failed": sum(1 for h, _ in rows if h[6] not in ("OK", "NOT_FOUND"))}
        # Where the slowest requests of the window fall (ms from the op's start), to tell the copy, the flip
        # and the drop of the old copy apart (copy_s and flip_s are in the op's timings), with the time the
        # client waited for a core meanwhile (ms).
        op["load"]["slowest"] = [[round((h[4] - op["t0"]) * 1e3, 1), round((h[5] - h[4]) * 1e3, 1), h[1], w]
                                 for h, w in sorted(rows, key=lambda r: r[0][4] - r[0][5])[:5]]
        op["load_covered"] = load_end >= op["t1"] + GAP
        del op["t0"], op["t1"]
    failed = [h for h in hist if h[6] not in ("OK", "NOT_FOUND")]
    for p in procs:
        if "Traceback" in open(p.logpath).read():
            print(f"WARNING: {p.name} raised:\n{p.tail(20)}", flush=True)
    return {"keys": n, "placement": placement, "rep": rep, "service": svc, "peer_host": PEERS[placement],
            "preload_s": round(preload_s, 3), "load_s": load_s, "ops_s": round(ops_end - ops_start, 3),
            "load_summary": doc["summary"], "load_counters": doc.get("counters", {}), "failed_requests": len(failed),
            "failed_samples": failed[:5], "ops": ops,
            "waits_max_ms": {who: {k: v for k, v in c.items() if k.endswith("_ms")} for who, c in run_max.items()}}


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--keys", default=None, help="key counts, comma separated (default 1000,10000; smoke 200)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions per configuration (default 1)")
    ap.add_argument("--placement", choices=["both", *PEERS], default="both", help="peer placement(s) to run")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis comparison (while iterating; the "
                    "published numbers come from full runs)")
    args = ap.parse_args()
    sizes = [int(x) for x in (args.keys or ("200" if args.smoke else "1000,10000")).split(",")]
    reps = 1 if args.smoke else args.reps
    params = {"smoke": args.smoke, "keys": sizes, "reps": reps, "value_size": 1024, "topo": "line,2,3",
              "source": "vfh1", "peers": PEERS, "load": {"host": "vfh3", "clients": 4, "keys": 256, "prefix": "L",
                                                         "mix": "1:1:0", "value_size": 64}}
    configs = []
    per_key = 0.0001  # s per key per operation, a guess refined by what we see (sizes the load's duration)
    with Testbed("line,2,3") as tb:
        for n in sizes:
            for placement in [p for p in PEERS if args.placement in ('both', p)]:
                for rep in range(reps):
                    load_s = round(WARMUP + 4 * (GAP + 1.0 + 1.5 * per_key * n) + 2.0, 1)
                    c = configuration(tb, n, placement, rep, load_s)
                    configs.append(c)
                    per_key = max(per_key, max(op["wall_s"] for op in c["ops"]) / n)
                    print(f"  N={n} {placement} rep {rep}: " + ", ".join(
                        f"{op['op']} {op['wall_s']:.3f} s ({op['keys']} keys, {op['phase']})" for op in c["ops"])
                        + f"; load failed {c['failed_requests']}", flush=True)
    redis_rows = []
    for n in ([] if args.no_redis else sizes):
        r = redis_reshard.measure(keys=n, value_size=1024, share=1.0, clients=4)
        redis_rows.append(r)
        print(f"  redis N={n}: moved {r['keys_moved']} in {r['move_s']:.3f} s, redirects {r['redirects']}, "
              f"errors {r['errors']}", flush=True)

    def best(n: int, placement: str, op: str) -> dict:
        rows = [o for c in configs if c["keys"] == n and c["placement"] == placement for o in c["ops"]
                if o["op"] == op]
        return min(rows, key=lambda o: o["wall_s"])

    print("\nelastic-KVS state operations under load (4 clients on vfh3), 1 KB values; times in s, latency in ms")
    print(f"{'keys':>6} {'place':>6} {'op':>6} {'moved':>6} {'wall':>7} {'total':>7} {'copy':>7} {'flip':>7} "
          f"{'etcd':>7} {'ld ops':>6} {'ld p50':>7} {'ld p99':>7} {'ld max':>7} {'-cl.wt':>7} {'paper':>6} "
          f"{'x faster':>8}")
    for c in configs:
        for o in c["ops"]:
            t = o["timings"]
            paper = PAPER[o["op"]][0 if c["placement"] == "local" else 1]
            o["paper_s"] = paper
            o["speedup_vs_paper"] = round(paper / o["wall_s"], 2) if paper else None
            ld = o["load"]
            print(f"{c['keys']:>6} {c['placement']:>6} {o['op']:>6} {o['keys']:>6} {o['wall_s']:>7.3f} "
                  f"{t.get('total_s', float('nan')):>7.3f} {t.get('copy_s', float('nan')):>7.3f} "
                  f"{t.get('flip_s', float('nan')):>7.3f} {t.get('etcd_s', float('nan')):>7.3f} "
                  f"{ld['ops']:>6} {ld['median_ms'] or float('nan'):>7.3f} {ld['p99_ms'] or float('nan'):>7.3f} "
                  f"{ld['max_ms'] or float('nan'):>7.1f} {ld['max_less_client_wait_ms']:>7.1f} "
                  f"{paper if paper else '-':>6} "
                  f"{o['speedup_vs_paper'] if o['speedup_vs_paper'] else '-':>8}")
    print("\nwaits over 20 ms in the servers during each operation and the GAP after it (a = vfh1; b = the peer): "
          "passes of the loop (stall_*), group fsyncs (sync_slow), acknowledgements of replicated writes by the "
          "peer and for the batches before it (repl_wait_slow); the longest of each over the whole run after")
    for c in configs:
        for o in c["ops"]:
            print(f"  N={c['keys']} {c['placement']} {o['op']:>6}: " + "; ".join(
                f"{who} " + (", ".join(f"{k} {v}" for k, v in w.items()) or "none") for who, w in o["waits"].items()))
        print(f"  N={c['keys']} {c['placement']} longest (ms): " + "; ".join(
            f"{who} " + ", ".join(f"{k[:-7]} {v}" for k, v in w.items()) for who, w in c["waits_max_ms"].items()))
    for c in configs:
        print(f"  N={c['keys']} {c['placement']}: failed client requests over the whole load run: "
              f"{c['failed_requests']} of {c['load_summary']['ops']}"
              + ("" if all(o["load_covered"] for o in c["ops"]) else " (load ended before the last op!)"))
    print("\npaper Table IV (s, local/remote): mirror 1.078/3.336, split 1.289/3.782, merge 1.304/2.544, "
          "move -/3.871; 'x faster' = paper / our wall time; '-cl.wt' = the worst latency less the time the "
          "load process itself waited for a core meanwhile (its run-queue delay)")

    print("\nRedis Cluster resharding vs elastic-KVS split of the same keys (share 1.0, 4 clients)")
    print(f"{'keys':>6} {'redis s':>8} {'MOVED':>6} {'ASK':>6} {'TRYAG':>6} {'r.err':>5} {'r.p99':>7} | "
          f"{'split local':>11} {'ratio':>6} | {'split remote':>12} {'ratio':>6}")
    compare = []
    for r in redis_rows:
        n = r["keys"]
        loc, rem = best(n, "local", "split"), best(n, "remote", "split")
        row = {"keys": n, "redis_move_s": r["move_s"], "redis_redirects": r["redirects"],
               "redis_errors": r["errors"], "redis_client_p99_ms": r["client_p99_ms"],
               "elastic_split_local_s": loc["wall_s"], "elastic_split_remote_s": rem["wall_s"],
               "ratio_redis_local": round(r["move_s"] / loc["wall_s"], 3),
               "ratio_redis_remote": round(r["move_s"] / rem["wall_s"], 3)}
        compare.append(row)
        d = r["redirects"]
        print(f"{n:>6} {r['move_s']:>8.3f} {d['moved']:>6} {d['ask']:>6} {d['tryagain']:>6} {r['errors']:>5} "
              f"{r['client_p99_ms']:>7.3f} | {loc['wall_s']:>11.3f} {row['ratio_redis_local']:>6.2f} | "
              f"{rem['wall_s']:>12.3f} {row['ratio_redis_remote']:>6.2f}")
    print("(ratio = redis move_s / elastic split wall time)")
    for c in configs:
        print(f"  elastic load client counters N={c['keys']} {c['placement']}: {c['load_counters']}")
    write("kvs_ops", params, {"configs": configs, "redis": redis_rows, "redis_vs_elastic": compare,
                              "paper_table_iv_s": PAPER}, args.out)
    failed = sum(c["failed_requests"] for c in configs)
    bad = [f"{c['service']} {o['op']}: {o['phase']} {o['error']}" for c in configs for o in c["ops"]
           if o["phase"] != "done"]
    if failed or bad:
        print(f"WARNING: {failed} failed client requests; operations not done: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
