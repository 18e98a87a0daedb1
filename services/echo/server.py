"""echo server: announce, optionally listen, answer every request until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import json
import logging
import signal
import sys
import threading

from vfab.vid import api
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry
from vfab.vid.transport import RX_MODES
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.echo.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...] (default: $VFAB_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--service", required=True, help="service name")
    p.add_argument("--name", required=True, help="this endpoint's name")
    p.add_argument("--netns", default=None, metavar="PATH",
                   help="network namespace of --iface (e.g. /proc/PID/ns/net of a testbed host); etcd is reached from ours")
    p.add_argument("--iface", required=True, help="interface to serve on")
    p.add_argument("--rx", choices=RX_MODES, default="ovs", help="receive backend (default ovs)")
    p.add_argument("--listen", action="append", default=[], type=Range.parse, metavar="LO-HI",
                   help="take this key range (repeatable)")
    p.add_argument("--ttl", type=int, default=3, help="endpoint lease TTL in s (default 3)")
    p.add_argument("--create", action="store_true",
                   help="create the service if it does not exist (with --layout)")
    p.add_argument("--layout", choices=("prefix", "suffix"), default="prefix",
                   help="VID layout when --create creates the service")


def answer(req: api.Request, name: str) -> bytes:
    try:
        body = json.loads(req.payload)
        key = body.get("key") if isinstance(body, dict) else None
    except (ValueError, UnicodeDecodeError):
        key = None
    return json.dumps({"server": name, "key": key, "seq": req.seq}, separators=(",", ":")).encode()


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    registry = Registry(args.etcd)
    server = None
    try:
        if args.create:
            registry.create_service(args.service, layout=args.layout)
        server = api.announce(registry, args.service, args.name, args.iface, rx=args.rx, ttl=args.ttl,
                                netns=args.netns)
        for rng in args.listen:
            server.listen(rng.lo, rng.hi)
        print("ready", flush=True)
        log.info("echo server %s/%s on %s (%s, rx=%s): ready, ranges %s", args.service, args.name,
                 args.iface, server.port.mac_str, args.rx, [str(r) for r in server.ranges])
        while not stop.is_set():
            req = server.accept(timeout=0.2)
            if req is not None:
                req.reply(answer(req, args.name))
    finally:
        if server is not None:
            log.info("echo server %s: exiting; port %s, server %s", args.name, server.port.counters,
                     server.counters)
            server.close()
        registry.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.echo server")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
