"""The registry's etcd client against the stdlib's one-connection-per-call HTTP client, on one local member.

vfab talks to etcd through its v3 JSON gateway (``vfab.vid.registry``: ``http.client``, one keep-alive
connection per thread).  This starts a private etcd member (``vfab.testbed.etcd.LocalEtcd``, the same
flags as every testbed's) and times the same calls through

- ``registry``  ``Registry.get`` / ``put`` / ``txn`` (2 puts), and
- ``urllib``    the same JSON bodies posted with ``urllib.request`` (a new connection per call), and
- ``requests``  a ``requests.Session`` (what etcd3gw used until 2026-11-28), if the package is installed,

round after round, each client in turn (order reversed every other round), so drift hits all alike.
It also times importing ``vfab.vid.registry`` in a fresh interpreter (what every ``vfab`` command pays).

Run: ``/opt/vfab-venv/bin/python bench/etcd_client.py [--calls 1000] [--rounds 3] [--smoke]``.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed.etcd import LocalEtcd, free_port  # noqa: E402
from vfab.vid.registry import Registry  # noqa: E402

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


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=None, help="calls per operation per client per round "
                                                              "(default 1000, smoke 50)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, smoke 1)")
    args = ap.parse_args()
    calls = args.calls or (50 if args.smoke else 1000)
    rounds = args.rounds or (1 if args.smoke else 3)
    makers = {"registry": registry_client, "urllib": urllib_client}
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
    print(f"importing vfab.vid.registry: median {results['import_registry']['median_ms']:.0f} ms")
    write("etcd_client", {"calls": calls, "rounds": rounds, "smoke": args.smoke}, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
