"""The registry's etcd client against the stdlib's one-connection-per-call HTTP client, on one local member.

vfab talks to etcd through its v3 JSON gateway (``vfab.vid.registry``: its own HTTP/1.1 code, one keep-alive
connection per thread).  This starts a private etcd member (``vfab.testbed.etcd.LocalEtcd``, the same
flags as every testbed's) and times the same calls through

- ``registry``  ``Registry.get`` / ``put`` / ``txn`` (2 puts),
- ``httpclient`` the same JSON bodies over one ``http.client`` keep-alive connection (what the registry
  used until 2026-11-29, when its own ``_Http`` replaced it),
- ``urllib``    the same JSON bodies posted with ``urllib.request`` (a new connection per call), and
- ``requests``  a ``requests.Session`` (what etcd3gw used until 2026-11-28), if the package is installed,

round after round, each client in turn (order reversed every other round), so drift hits all alike.
It also times importing ``vfab.vid.registry`` in a fresh interpreter (what every ``vfab`` command pays).

**Keepalives on beats.**  ``--keepalivers`` (default 4: sdhcp_lease's 4 shards) threads each keep a lease
of their own with ``Registry.keepalive_once`` every 1/3 s (a 1-s lease, as an sdhcp shard's), over
``--beat-seconds`` s per way, in rounds:

- ``spread``  each thread at its own phase of the period (i/K of it), as independent processes were;
- ``beats``   each on the wall clock's multiples of the period (``until_beat``, what every lease does now);
- ``idle``    no keepalive: etcd's own ticking.

etcd's CPU per second (``/proc``) for each, and what the keepalives add to idle, spread and on beats.

**The client's CPU per keepalive.**  A keepalive thread wakes 3 times a second and finds its code cold, so
a call costs it far more than back to back.  ``--spaced`` (default 30, smoke 6) keepalives per client and
round, 1/3 s apart, through ``registry`` and ``httpclient``: the calling thread's CPU (``thread_time``)
per call.

Run: ``/opt/vfab-venv/bin/python bench/etcd_client.py [--calls 1000] [--rounds 3] [--keepalivers 4]
[--beat-seconds 10] [--spaced 30] [--smoke]``.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed.etcd import LocalEtcd, free_port  # noqa: E402
from vfab.vid.registry import Registry  # noqa: E402
from vfab.vid.registry.etcd import until_beat  # noqa: E402
from vfab.vid.state.sched import proc_stat  # noqa: E402

OPS = ("get", "put", "txn")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def bodies(i: int) -> dict[str, tuple[str, dict]]:
    k = f"/bench/k{i % 16}"
    return {"get": ("/v3/kv/range", {"key": b64(k)}),
            "put": ("/v3/kv/put", {"key": b64(k), "value": b64("v" * 100)}),
            "txn": ("/v3/kv/txn", {"compare": [], "failure": [], "success": [
                {"request_put": {"key": b64(k + "a"), "value": b64("v" * 100)}},
                {"request_put": {"key": b64(k + "b"), "value": b64("v" * 100)}}]})}


def registry_client(endpoint: str):
    reg = Registry(endpoint)

    def call(op: str, i: int) -> None:
        k = f"/bench/k{i % 16}"
        if op == "get":
            reg.get(k)
        elif op == "put":
            reg.put(k, "v" * 100)
        else:
            reg.txn([], {k + "a": "v" * 100, k + "b": "v" * 100})
    return call, reg.close


def httpclient_client(endpoint: str):
    host, _, port = endpoint.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(path: str, body: dict) -> dict:
        conn.request("POST", path, json.dumps(body, separators=(",", ":")), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"etcd answered {resp.status}: {data[:200]!r}")
        return json.loads(data)

    def call(op: str, i: int) -> None:
        post(*bodies(i)[op])
    call.post = post
    return call, conn.close


def urllib_client(endpoint: str):
    def call(op: str, i: int) -> None:
        path, body = bodies(i)[op]
        req = urllib.request.Request(f"http://{endpoint}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            json.loads(resp.read())
    return call, lambda: None


def requests_client(endpoint: str):
    import requests  # only where installed (vfab itself no longer needs it)

    session = requests.Session()

    def call(op: str, i: int) -> None:
        path, body = bodies(i)[op]
        resp = session.post(f"http://{endpoint}{path}", json=body, timeout=5)
        resp.raise_for_status()
        resp.json()
    return call, session.close


def import_seconds(runs: int) -> list[float]:
    """Seconds to import vfab.vid.registry in a fresh interpreter, less the interpreter's own start."""
    def run(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0
    out = []
    for _ in range(runs):
        bare = run("pass")
        out.append(max(0.0, run("import vfab.vid.registry") - bare))
    return out


KEEPALIVE_PERIOD = 1 / 3   # s: a 1-s lease's keepalives (vfab.vid.state.lease)


def keepalive_cpu(etcd: LocalEtcd, way: str, keepalivers: int, seconds: float) -> float:
    """etcd's CPU-s per second while ``keepalivers`` threads keep their leases alive the ``way`` given."""
    stop = threading.Event()
    regs = [Registry(etcd.endpoint) for _ in range(keepalivers)] if way != "idle" else []
    leases = [reg.lease(60) for reg in regs]

    def run(i: int) -> None:
        while True:
            if way == "beats":
                wait = until_beat(KEEPALIVE_PERIOD)
            else:   # spread: thread i at i/K of the period
                wait = (i / keepalivers * KEEPALIVE_PERIOD - time.time()) % KEEPALIVE_PERIOD or KEEPALIVE_PERIOD
            if stop.wait(wait):
                return
            regs[i].keepalive_once(leases[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(regs))]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)   # every thread in its step
        c0, t0 = proc_stat(etcd.pid).cpu_s, time.monotonic()
        time.sleep(seconds)
        return (proc_stat(etcd.pid).cpu_s - c0) / (time.monotonic() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for reg, lease in zip(regs, leases):
            reg.revoke(lease)
            reg.close()


def spaced_keepalive_ms(endpoint: str, client: str, n: int) -> list[float]:
    """The calling thread's CPU in ms for each of ``n`` keepalives of one lease, 1/3 s apart."""
    reg = Registry(endpoint)
    lease = reg.lease(60)
    if client == "registry":
        def once() -> None:
            reg.keepalive_once(lease)
        close = reg.close
    else:
        call, close = httpclient_client(endpoint)

        def once() -> None:
            call.post("/v3/lease/keepalive", {"ID": str(lease)})
    out = []
    try:
        once()   # connected before the clock runs
        for _ in range(n):
            time.sleep(until_beat(KEEPALIVE_PERIOD))
            t0 = time.thread_time()
            once()
            out.append((time.thread_time() - t0) * 1e3)
    finally:
        close()
        reg.revoke(lease)
        reg.close()
    return out


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=None, help="calls per operation per client per round "
                                                              "(default 1000, smoke 50)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, smoke 1)")
    ap.add_argument("--keepalivers", type=int, default=4, help="leases kept alive at once (default 4)")
    ap.add_argument("--beat-seconds", type=float, default=None, help="s per keepalive way and round "
                                                                       "(default 10, smoke 2)")
    ap.add_argument("--spaced", type=int, default=None, help="keepalives 1/3 s apart per client and round "
                                                               "(default 30, smoke 6)")
    args = ap.parse_args()
    beat_s = args.beat_seconds or (2.0 if args.smoke else 10.0)
    calls = args.calls or (50 if args.smoke else 1000)
    rounds = args.rounds or (1 if args.smoke else 3)
    spaced = args.spaced or (6 if args.smoke else 30)
    makers = {"registry": registry_client, "httpclient": httpclient_client, "urllib": urllib_client}
    try:
        import requests  # noqa: F401
        makers["requests"] = requests_client
    except ImportError:
        print("requests is not installed: compared with urllib only")
    samples: dict[str, dict[str, list[float]]] = {c: {op: [] for op in OPS} for c in makers}
    with tempfile.TemporaryDirectory(prefix="vfab-bench-etcd-") as tmp:
        etcd = LocalEtcd(Path(tmp) / "etcd", free_port(), free_port())
        etcd.start(timeout=20)
        try:
            for rnd in range(rounds):
                order = list(makers) if rnd % 2 == 0 else list(reversed(makers))
                for name in order:
                    call, close = makers[name](etcd.endpoint)
                    try:
                        call("get", 0)   # the connection is open before the clock runs
                        for op in OPS:
                            for i in range(calls):
                                t0 = time.perf_counter()
                                call(op, i)
                                samples[name][op].append(time.perf_counter() - t0)
                    finally:
                        close()
                print(f"  round {rnd + 1}/{rounds} done")
            cold: dict[str, list[float]] = {"registry": [], "httpclient": []}
            for rnd in range(rounds):
                for client in (list(cold) if rnd % 2 == 0 else list(reversed(cold))):
                    cold[client] += spaced_keepalive_ms(etcd.endpoint, client, spaced)
                print(f"  spaced keepalives round {rnd + 1}/{rounds} done", flush=True)
            ka: dict[str, list[float]] = {"idle": [], "spread": [], "beats": []}
            for rnd in range(rounds):
                for way in (list(ka) if rnd % 2 == 0 else list(reversed(ka))):
                    ka[way].append(keepalive_cpu(etcd, way, args.keepalivers, beat_s))
                print(f"  keepalives round {rnd + 1}/{rounds}: etcd CPU-s/s " +
                      ", ".join(f"{w} {v[-1]:.4f}" for w, v in ka.items()), flush=True)
        finally:
            etcd.stop()
    imports = import_seconds(3 if args.smoke else 10)
    results = {name: {op: summary(v) for op, v in ops.items()} for name, ops in samples.items()}
    results["import_registry"] = summary(imports)
    print(f"\netcd calls through each client, median / p99 ms over {calls * rounds} calls each (one local member)")
    print(f"{'client':<10} " + " ".join(f"{op + ' med':>9} {op + ' p99':>9}" for op in OPS))
    for name in makers:
        print(f"{name:<10} " + " ".join(f"{results[name][op]['median_ms']:>9.3f} {results[name][op]['p99_ms']:>9.3f}"
                                         for op in OPS))
    for name in makers:
        if name != "registry":
            ratios = {op: round(results[name][op]["median_ms"] / results["registry"][op]["median_ms"], 2)
                      for op in OPS}
            results[f"{name}_over_registry"] = ratios
            print(f"{name} / registry (median): " + ", ".join(f"{op} {r:.2f}x" for op, r in ratios.items()))
    cold_med = {c: statistics.median(v) for c, v in cold.items()}
    results["spaced_keepalive_client_cpu_ms"] = {
        **{c: summary([x / 1e3 for x in v]) for c, v in cold.items()},
        "registry_over_httpclient": round(cold_med["registry"] / cold_med["httpclient"], 2)
        if cold_med["httpclient"] else None}
    print(f"keepalives 1/3 s apart, the calling thread's CPU per call (median of {len(cold['registry'])}): "
          f"registry {cold_med['registry']:.3f} ms, http.client {cold_med['httpclient']:.3f} ms "
          f"({results['spaced_keepalive_client_cpu_ms']['registry_over_httpclient']}x)")
    print(f"importing vfab.vid.registry: median {results['import_registry']['median_ms']:.0f} ms")
    med = {w: statistics.median(v) for w, v in ka.items()}
    added = {w: med[w] - med["idle"] for w in ("spread", "beats")}
    results["keepalives"] = {
        "keepalivers": args.keepalivers, "per_s_each": round(1 / KEEPALIVE_PERIOD, 2), "seconds": beat_s,
        "etcd_cpu_s_per_s": {w: round(m, 4) for w, m in med.items()},
        "added_by_keepalives": {w: round(a, 4) for w, a in added.items()},
        "beats_over_spread": round(added["beats"] / added["spread"], 2) if added["spread"] > 0 else None}
    print(f"{args.keepalivers} leases kept alive 3x/s each, etcd CPU-s per s (median of {rounds} rounds): "
          f"idle {med['idle']:.4f}, spread {med['spread']:.4f}, on beats {med['beats']:.4f}; the keepalives add "
          f"{added['spread']:.4f} spread, {added['beats']:.4f} on beats "
          f"({results['keepalives']['beats_over_spread']}x)")
    write("etcd_client", {"calls": calls, "rounds": rounds, "keepalivers": args.keepalivers, "beat_seconds": beat_s,
                          "spaced": spaced, "smoke": args.smoke}, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
