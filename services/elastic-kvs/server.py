"""elastic-KVS server: one endpoint of the service = the stateful-endpoint loop + the KVS backend.

The loop (``vfab.vid.state.loop``) owns the data port, the control socket,
batching, replication and the state operations; this module only wires the
durable store and the KVS protocol (``backend``) into it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from vfab.services.elastic_kvs.backend import open_backend
from vfab.vid.ranges import Range
from vfab.vid import metrics
from vfab.vid.registry import Registry
from vfab.vid.state.loop import EndpointLoop
from vfab.vid.state.view import read_view
from vfab.vid.transport import RX_MODES
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.kvs.server")


def open_server(registry: Registry, service: str, name: str, iface: str, datadir: str, rx: str = "ovs",
                netns: str | None = None, ttl: int = 3) -> EndpointLoop:
    """An announced elastic-KVS endpoint, ready to ``serve``."""
    backend = open_backend(datadir, name)
    try:
        return EndpointLoop(registry, service, name, iface, backend, rx=rx, netns=netns, ttl=ttl)
    except BaseException:
        backend.store.close()
        raise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...] (default: $VFAB_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--service", required=True, help="service name (create it with 'vfab service add')")
    p.add_argument("--name", required=True, help="this endpoint's name (stable across restarts: the data's name)")
    p.add_argument("--iface", required=True, help="data interface")
    p.add_argument("--netns", default=None, metavar="PATH", help="network namespace of --iface (/proc/PID/ns/net)")
    p.add_argument("--rx", choices=RX_MODES, default="ovs", help="receive backend (default ovs)")
    p.add_argument("--data", required=True, metavar="DIR", help="directory of the durable store (NAME.sqlite)")
    p.add_argument("--listen", action="append", default=[], metavar="LO-HI",
                   help="take this key-hash range at start (repeatable; only for a fresh service)")
    p.add_argument("--ttl", type=int, default=3, help="endpoint lease TTL in s: a mirror takes over this long "
                                                      "after a crash (default 3)")
    metrics.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    metrics.configure(args)   # before the loop: --no-metrics leaves its hooks out
    registry = Registry(args.etcd)
    loop = exporter = None
    try:
        loop = open_server(registry, args.service, args.name, args.iface, args.data, rx=args.rx, netns=args.netns,
                           ttl=args.ttl)
        for text in args.listen:
            rng = Range.parse(text)
            registry.assign(args.service, rng, args.name)
        if args.listen:
            loop._set_view(read_view(registry, args.service))
        owned = [str(r.range) for r in loop.view.owned_by(args.name)]
        exporter = metrics.start(args, "endpoint", args.name, etcd=args.etcd, service=args.service)
        print(f"ready {loop.ctl}" + (f" metrics={exporter.addr}" if exporter else ""), flush=True)
        log.info("%s: ready; owns %s", args.name, ", ".join(owned) or "nothing yet")
        loop.serve(stop)
    finally:
        if exporter is not None:
            exporter.close()
        if loop is not None:
            loop.close()
            loop.backend.store.close()
        registry.close()
    return 0
