"""Load generator: N closed-loop logical clients on one port, recording a history.

Each logical client sends its next operation only after the last one finished
(the paper's Fig. 13 workload: put, get or delete on a random key of a small
pool).  Every PUT writes a unique value (``c<client>-<n>``) so a history
checker can tell which write a read saw.  Output (``--out``)::

    {"history": [[client, op, key, value|null, invoke, respond, status, version], ...],
     "counters": {...}, "summary": {...}}

``invoke``/``respond`` are CLOCK_MONOTONIC seconds (system-wide on Linux, so
histories of several processes can be checked together); ``status`` is the
reply status name or ``"TIMEOUT"`` when every retry was spent.

``"client_wait_ms"`` (one per history entry, in the same order): how long this
process was runnable but not running between the operation's invoke and
respond (the scheduler's run-queue delay, ``/proc/thread-self/schedstat``): on a
busy machine a reply may sit in the socket while the client waits for a core,
and that wait is the client's, not the service's.  0 where the kernel does not
say (no schedstat).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import time

from vfab.services.elastic_kvs.client import KvsClient
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.vid.registry import Registry
from vfab.vid.state.sched import RunDelay
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.kvs.load")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"), type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...]")
    p.add_argument("--service", required=True)
    p.add_argument("--iface", required=True)
    p.add_argument("--netns", default=None, metavar="PATH", help="network namespace of --iface")
    p.add_argument("--clients", type=int, default=4, help="closed-loop logical clients (default 4)")
    p.add_argument("--duration", type=float, default=5.0, help="s of load (default 5)")
    p.add_argument("--keys", type=int, default=256, help="size of the key pool (default 256, as in the paper)")
    p.add_argument("--prefix", default="k", help="key names are PREFIX<n> (default k)")
    p.add_argument("--mix", default="1:1:0", help="put:get:del weights (default 1:1:0)")
    p.add_argument("--value-size", type=int, default=64, help="bytes per value (default 64)")
    p.add_argument("--timeout", type=float, default=0.5, help="per-attempt timeout in s (default 0.5)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--wait-start", metavar="FILE", default=None, help="start when FILE exists")
    p.add_argument("--out", required=True, metavar="FILE.json")


def drive(client: KvsClient, n: int, duration: float, keys: list[bytes], mix: tuple[int, int, int],
          value_size: int, seed: int | None = None, waits: list | None = None) -> list[tuple]:
    """Run the load; the history, and into ``waits`` each entry's client-side run-queue delay (ms).

    The loop between a reply and the next request is this process's share of every operation's latency, so
    it does only what it must: the run-queue delay is read once per batch of replies (the same reading ends
    those operations and starts the ones issued after them, within microseconds) and a history entry is
    the finished operation's fields as they are (no Reply kept), turned into plain values after the run."""
    rng = random.Random(seed)
    delay = RunDelay()
    ops = [Op.PUT] * mix[0] + [Op.GET] * mix[1] + [Op.DEL] * mix[2]
    done_ops: list[tuple] = []
    PUT, GET, OK = Op.PUT, Op.GET, Status.OK
    counts = [0] * n
    pad = b"." * value_size
    submit, choice, monotonic = client.submit, rng.choice, time.monotonic

    def issue(c: int, at_delay: float) -> None:
        op = choice(ops)
        value = b""
        if op is Op.PUT:
            counts[c] += 1
            tag = f"c{client.client_id % 100000}_{c}_{counts[c]}".encode()
            value = (tag + pad)[:max(value_size, len(tag))]
        submit(op, choice(keys), value, tag=(c, at_delay))

    end = monotonic() + duration
    # Finished operations are kept as they are until the run ends: the collector would otherwise scan the
    # growing list over and over (the tuples the history is made of once were untracked for that reason).
    collecting = gc.isenabled()
    gc.disable()
    try:
        now_delay = delay()
        for c in range(n):
            issue(c, now_delay)
        while client.inflight:
            done = client.poll(0.05)
            if not done:
                continue
            now_delay = delay()
            more = monotonic() < end
            for p in done:
                c, at = p.tag
                r, op = p.reply, p.op
                if r is None:
                    done_ops.append((c, now_delay - at, op, p.key, p.value if op is PUT else None, p.submitted,
                                     p.finished, None, 0))
                else:
                    done_ops.append((c, now_delay - at, op, p.key, p.value if op is PUT else (
                        r.body if op is GET and r.status is OK else None), p.submitted, p.finished, r.status,
                        r.version))
                if more:
                    issue(c, now_delay)
    finally:
        if collecting:
            gc.enable()
        delay.close()
    # Entry by entry into plain values, in place (a long run's history is held once, not twice): a tuple of
    # these the collector stops tracking, so 100,000s of entries never make this process pause for it.
    for i, (c, waited, op, key, shown, invoked, responded, status, version) in enumerate(done_ops):
        if waits is not None:
            waits.append(round(waited * 1e3, 2))
        done_ops[i] = (c, op.name, key.decode(), shown.split(b".")[0].decode() if shown else None, invoked,
                       responded, status.name if status is not None else "TIMEOUT", version)
    return done_ops


def summarize(history: list[list], duration: float) -> dict:
    lat = sorted((h[5] - h[4]) * 1e3 for h in history)
    failed = sum(1 for h in history if h[6] not in ("OK", "NOT_FOUND"))

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else float("nan")

    return {"ops": len(history), "failed": failed, "req_per_s": round(len(history) / duration, 1),
            "lat_ms": {"median": pct(0.5), "p99": pct(0.99), "max": round(lat[-1], 3) if lat else None}}


def run(args: argparse.Namespace) -> int:
    mix = tuple(int(x) for x in args.mix.split(":"))
    if len(mix) != 3 or sum(mix) <= 0 or min(mix) < 0:
        raise SystemExit(f"error: --mix {args.mix!r} must be three weights put:get:del, e.g. 1:1:0")
    registry = Registry(args.etcd)
    client = KvsClient(registry, args.service, args.iface, netns=args.netns, timeout=args.timeout)
    registry.close()
    keys = [f"{args.prefix}{i}".encode() for i in range(args.keys)]
    try:
        if args.wait_start:
            while not os.path.exists(args.wait_start):
                time.sleep(0.001)
        t0 = time.monotonic()
        waits: list[float] = []
        history = drive(client, args.clients, args.duration, keys, mix, args.value_size, args.seed, waits)
        took = time.monotonic() - t0
    finally:
        client.close()
    doc = {"history": history, "client_wait_ms": waits, "counters": client.counters,
           "summary": summarize(history, took)}
    tmp = f"{args.out}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, args.out)
    print(json.dumps(doc["summary"]), flush=True)
    log.info("load: counters %s", client.counters)
    return 0
