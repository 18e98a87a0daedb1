"""elastic-KVS on a Testbed: start servers and load clients in fabric hosts, read everything back.

Shared by the integration tests, the demo and the benchmarks.
"""

from __future__ import annotations

import json
import os

from vfab.services.elastic_kvs.client import KvsClient
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import Proc, wait_for

KVS = ["-m", "vfab.services.elastic_kvs"]


def start_server(tb: Testbed, host: str, name: str, service: str, listen: str | None = None,
                 rx: str = "ovs", ttl: int = 3, data: str | None = None, extra: list[str] = ()) -> Proc:
    out = os.path.join(tb.workdir, f"{service}-{name}.out")
    with open(out, "wb"):
        pass
    args = [*KVS, "server", "--etcd", tb.etcd_endpoint, "--service", service, "--name", name,
            "--iface", tb.hosts[host]["iface"], "--rx", rx, "--ttl", str(ttl),
            "--data", data or os.path.join(tb.workdir, f"data-{service}")]
    if listen:
        args += ["--listen", listen]
    args += list(extra)   # e.g. --no-metrics
    proc = tb.run_on(host, f"{service}-{name}", args, stdout=open(out, "ab"))
    wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 20, f"kvs server {name} ready")
    if not proc.alive():
        raise RuntimeError(f"kvs server {name} died at start:\n{proc.tail()}")
    return proc


def start_load(tb: Testbed, host: str, name: str, service: str, duration: float, clients: int = 4,
               keys: int = 256, prefix: str = "k", mix: str = "1:1:0", value_size: int = 64,
               timeout: float = 0.5) -> tuple[Proc, str]:
    out = os.path.join(tb.workdir, f"{name}.json")
    args = [*KVS, "load", "--etcd", tb.etcd_endpoint, "--service", service, "--iface", tb.hosts[host]["iface"],
            "--clients", str(clients), "--duration", str(duration), "--keys", str(keys), "--prefix", prefix,
            "--mix", mix, "--value-size", str(value_size), "--timeout", str(timeout), "--out", out]
    return tb.run_on(host, name, args), out


def finish_load(tb: Testbed, proc: Proc, out: str, wait: float = 120) -> dict:
    proc.popen.wait(wait)
    if proc.popen.returncode != 0:
        raise RuntimeError(f"load {proc.name} failed:\n{proc.tail()}")
    tb.sup.stop(proc)
    with open(out) as fh:
        return json.load(fh)


def client(tb: Testbed, host: str, service: str, timeout: float = 0.5) -> KvsClient:
    return KvsClient(tb.registry, service, tb.hosts[host]["iface"], netns=tb.netns(host), timeout=timeout)


def pipeline(cli: KvsClient, ops: list[tuple[Op, bytes, bytes]], window: int = 64) -> list:
    """Run many operations with up to ``window`` in flight; returns the finished Pendings in order."""
    done, queue = [], list(ops)
    while queue or cli.inflight:
        while queue and len(cli.inflight) < window:
            op, key, value = queue.pop(0)
            cli.submit(op, key, value)
        done.extend(cli.poll(0.05))
    return sorted(done, key=lambda p: p.reqid)


def preload(tb: Testbed, host: str, service: str, n: int, prefix: str = "k", value_size: int = 1024) -> int:
    """Put keys PREFIX0..PREFIXn-1 with values of ``value_size`` B; returns how many were acknowledged."""
    with client(tb, host, service) as cli:
        ops = [(Op.PUT, f"{prefix}{i}".encode(), (f"{prefix}{i}." * value_size).encode()[:value_size])
               for i in range(n)]
        return sum(1 for p in pipeline(cli, ops) if p.reply is not None and p.reply.status is Status.OK)


def read_back(tb: Testbed, host: str, service: str, keys: list[str]) -> dict[str, str | None]:
    """Each key's current tag (the value up to its first '.'), None when absent; raises on any failure."""
    with client(tb, host, service) as cli:
        done = pipeline(cli, [(Op.GET, k.encode(), b"") for k in keys])
    out = {}
    for p in done:
        if p.reply is None or p.reply.status not in (Status.OK, Status.NOT_FOUND):
            raise RuntimeError(f"read-back of {p.key!r} failed: {p.error or p.reply.status.name}")
        out[p.key.decode()] = p.reply.body.split(b".")[0].decode() if p.reply.status is Status.OK else None
    return out
