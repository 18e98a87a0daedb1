"""echo client: requests to random keys, losses never retried, every reply recorded.

Output (``--out``): a JSON list, one object per request::

    {"seq": i, "key": k, "sent": t_wall, "reply_from": name|null, "replied": t_wall|null,
     "dup_count": n, "lost": bool, "late": bool}

``lost``: no reply within ``--timeout`` (the request is not retried).  ``late``: a
reply came after the timeout anyway (then ``reply_from``/``replied`` are filled).
``dup_count``: replies beyond the first.  After the last request the client keeps
collecting for ``--grace`` seconds so late and duplicate replies are counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import sys
import time

from vfab.vid import api
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry
from vfab.vid.transport import RX_MODES
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.echo.client")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...] (default: $VFAB_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--service", required=True)
    p.add_argument("--netns", default=None, metavar="PATH",
                   help="network namespace of --iface (e.g. /proc/PID/ns/net of a testbed host); etcd is reached from ours")
    p.add_argument("--iface", required=True)
    p.add_argument("--rx", choices=RX_MODES, default="ovs",
                   help="receive backend for replies (default ovs: replies are sent to our MAC)")
    p.add_argument("--count", type=int, default=100, help="requests to send (0 = until --duration)")
    p.add_argument("--keys", type=Range.parse, default=Range(0, KEY_MAX), metavar="LO-HI",
                   help="pick keys uniformly from this range (default all)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests per s, open loop; 0 = ping-pong, next request after the reply")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many s")
    p.add_argument("--timeout", type=float, default=1.0, help="per-request timeout in s (default 1)")
    p.add_argument("--grace", type=float, default=None,
                   help="s to keep collecting late/duplicate replies at the end (default: --timeout)")
    p.add_argument("--seed", type=int, default=None, help="random seed for the keys")
    p.add_argument("--wait-start", metavar="FILE", default=None, help="wait until FILE exists, then start")
    p.add_argument("--out", required=True, metavar="FILE.json")


def check_args(args: argparse.Namespace) -> None:
    if args.count < 0 or args.count == 0 and args.duration is None:
        sys.exit("error: --count must be > 0, or 0 together with --duration")
    if args.rate < 0 or args.timeout <= 0:
        sys.exit("error: --rate must be >= 0 and --timeout > 0")


class Recorder:
    """Request records and the matching of replies to them."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.by_seq: dict[int, int] = {}  # frame seq -> record index
        self.pending: collections.OrderedDict[int, float] = collections.OrderedDict()  # seq -> deadline
        self.unknown = 0

    def sent(self, frame_seq: int, key: int, at: float, deadline: float) -> None:
        self.by_seq[frame_seq] = len(self.records)
        self.records.append({"seq": len(self.records), "key": key, "sent": at, "reply_from": None,
                             "replied": None, "dup_count": 0, "lost": False, "late": False})
        self.pending[frame_seq] = deadline

    def expire(self, now: float) -> None:
        while self.pending:
            seq, deadline = next(iter(self.pending.items()))
            if deadline > now:
                break
            del self.pending[seq]
            self.records[self.by_seq[seq]]["lost"] = True

    def next_deadline(self) -> float | None:
        return next(iter(self.pending.values())) if self.pending else None

    def replied(self, reply: api.Reply) -> None:
        idx = self.by_seq.get(reply.seq)
        if idx is None:
            self.unknown += 1
            return
        rec = self.records[idx]
        if rec["reply_from"] is not None:
            rec["dup_count"] += 1
            return
        try:
            body = json.loads(reply.payload)
            rec["reply_from"] = str(body.get("server")) if isinstance(body, dict) else "?"
        except (ValueError, UnicodeDecodeError):
            rec["reply_from"] = "?"
        rec["replied"] = reply.received
        rec["late"] = reply.seq not in self.pending
        self.pending.pop(reply.seq, None)

    def summary(self) -> str:
        recs = self.records
        ok = [r for r in recs if r["replied"] is not None and not r["late"]]
        rtt = sorted((r["replied"] - r["sent"]) * 1000 for r in ok)

        def pct(q: float) -> float:
            return rtt[min(len(rtt) - 1, int(q * len(rtt)))] if rtt else float("nan")

        return (f"echo client: sent {len(recs)} replied {len(ok)} lost {sum(r['lost'] for r in recs)} "
                f"late {sum(r['late'] for r in recs)} dups {sum(r['dup_count'] for r in recs)} "
                f"unknown {self.unknown} rtt_ms p50 {pct(0.5):.3f} p99 {pct(0.99):.3f} "
                f"max {rtt[-1] if rtt else float('nan'):.3f}")


def wait_for(path: str) -> None:
    log.info("waiting for %s", path)
    while not os.path.exists(path):
        time.sleep(0.0005)


def drive(client: api.Client, args: argparse.Namespace, rec: Recorder) -> None:
    rng = random.Random(args.seed)
    start = time.monotonic()
    next_send = start
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    while True:
        now = time.monotonic()
        rec.expire(now)
        more = (args.count == 0 or len(rec.records) < args.count) and (
            args.duration is None or now - start < args.duration)
        if not more and not rec.pending:
            return
        if more and (not rec.pending if interval == 0 else now >= next_send):
            key = rng.randint(args.keys.lo, args.keys.hi)
            t = time.time()
            body = json.dumps({"key": key, "seq": len(rec.records), "t": t}, separators=(",", ":"))
            seq = client.send_request(key, body.encode())
            rec.sent(seq, key, t, time.monotonic() + args.timeout)
            if interval:
                next_send = max(next_send + interval, now - 1.0)  # no unbounded catch-up burst
            continue
        wake = [d for d in (rec.next_deadline(), next_send if more and interval else None) if d is not None]
        reply = client.recv_reply(max(min(wake) - now, 0.0) if wake else args.timeout)
        if reply is not None:
            rec.replied(reply)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    registry = Registry(args.etcd)
    try:
        client = api.Client(registry, args.service, args.iface, rx=args.rx, netns=args.netns)
    finally:
        registry.close()
    rec = Recorder()
    try:
        if args.wait_start:
            wait_for(args.wait_start)
        drive(client, args, rec)
        grace_end = time.monotonic() + (args.timeout if args.grace is None else args.grace)
        while (left := grace_end - time.monotonic()) > 0:
            reply = client.recv_reply(left)
            if reply is not None:
                rec.replied(reply)
    finally:
        client.close()
        tmp = f"{args.out}.tmp.{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(rec.records, fh)
        os.replace(tmp, args.out)
    print(rec.summary(), flush=True)
    log.info("client counters: port %s, client %s", client.port.counters, client.counters)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.echo client")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
