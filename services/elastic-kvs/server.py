"""elastic-KVS server: one endpoint of the service, its durable store and its state manager.

The data loop reads a batch of request frames off the raw port, and for each
asks the state manager what to do with its VID key (the hash of the KVS key):
*serve* it (the range is ours), *hold* it (the range is being flipped to or
from us), *ignore* it (we only mirror the range: the owner got it too) or
*forward* it to the owner over ZeroMQ (a stale route).  The batch's writes go
in one SQLite transaction (one fsync), are replicated to every mirror and
running copy, and only then are the replies sent: nothing is acknowledged
before it is durable everywhere it must be.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import threading

import zmq

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.services.elastic_kvs.store import Store
from vfab.vid import api
from vfab.vid.errors import FrameError
from vfab.vid.frame import Frame, FrameType, parse
from vfab.vid.state.manager import StateManager
from vfab.vid.registry import Registry
from vfab.vid.transport import RX_MODES

log = logging.getLogger("vfab.kvs.server")
BATCH = 64


class KvsServer:
    def __init__(self, registry: Registry, service: str, name: str, iface: str, datadir: str, rx: str = "ovs",
                 netns: str | None = None, ttl: int = 3):
        self.store = Store(os.path.join(datadir, f"{name}.sqlite"))
        self.svc = registry.service(service)
        self.name = name
        self.registry = registry
        # The control socket exists before the endpoint is announced: peers find it in the endpoint record.
        self.sm = StateManager(registry, self.svc, name, self.store)
        try:
            self.server = api.announce(registry, service, name, iface, rx=rx, ttl=ttl, netns=netns, ctl=self.sm.ctl)
        except BaseException:
            self.sm.close()
            raise
        self.sm.lease = self.server.lease
        self.sm.refresh()
        self.sm.on_forwarded = self._queue
        self.sm.on_view_change = self._refilter
        self._refilter()
        self.pending: collections.deque[tuple[bytes, int]] = collections.deque()
        self.counters = collections.Counter()

    def _refilter(self) -> None:
        """rx=bpf/promisc: receive the VIDs of every range we own or mirror (rx=ovs needs nothing)."""
        with self.sm.lock:
            mine = [r.range for r in self.sm.view.ranges if r.owner == self.name or self.name in r.mirrors]
        self.server.port.set_blocks([b for r in mine for b in api.service_blocks(self.svc, r)])

    def _queue(self, frame: bytes, hops: int) -> None:
        self.pending.append((frame, hops))

    # -- the loop ------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        self.sm.start()
        poller = zmq.Poller()
        poller.register(self.server.port.fileno(), zmq.POLLIN)
        poller.register(self.sm.router, zmq.POLLIN)
        log.info("%s: serving %s on %s (ctl %s)", self.name, self.svc.name, self.server.port.iface, self.sm.ctl)
        while not stop.is_set():
            events = dict(poller.poll(5 if self.pending else 200))
            if self.sm.router in events:
                self.sm.serve_ctl()
            batch: list[tuple[Frame, bytes, int]] = []
            while self.pending and len(batch) < BATCH:
                raw, hops = self.pending.popleft()
                try:
                    batch.append((parse(raw), raw, hops))
                except FrameError:
                    self.counters["bad_frames"] += 1
            while len(batch) < BATCH:
                got = self.server.port.recv_raw(0)
                if got is None:
                    break
                raw = got[0]
                try:
                    frame = parse(raw)
                except FrameError:
                    self.counters["bad_frames"] += 1
                    continue
                if frame.type is FrameType.REQUEST and (self.server.port.rx == "ovs" or
                                                        self.server.port.accepts(frame.dst)):
                    batch.append((frame, raw, 0))
            if batch:
                self.handle(batch)

    def handle(self, batch: list[tuple[Frame, bytes, int]]) -> None:
        self.sm.in_batch = True  # a state op pausing a range waits for the end of this batch
        try:
            self._handle(batch)
        finally:
            self.sm.in_batch = False
            self.sm.batch_no += 1

    def _handle(self, batch: list[tuple[Frame, bytes, int]]) -> None:
        replies: list[tuple[Frame, bytes]] = []
        vks: list[int] = []
        records: list[bytes] = []
        self.store.begin()
        try:
            for frame, raw, hops in batch:
                out = self._one(frame, raw, hops, vks, records)
                if out is not None:
                    replies.append((frame, out))
            self.store.commit()
        except Exception as exc:
            self.store.rollback()
            log.error("%s: batch of %d failed (%s): answering UNAVAILABLE", self.name, len(batch), exc)
            self._send_all([(f, proto.error_reply(0, Status.UNAVAILABLE, f"store failed: {exc}"))
                            for f, _, _ in batch])
            return
        if records and not self.sm.replicate(vks, records):
            replies = [(f, proto.error_reply(proto.parse_reply(r).reqid, Status.UNAVAILABLE,
                                             "a mirror could not be reached or fenced off: retry"))
                       for f, r in replies]
        self._send_all(replies)

    def _send_all(self, replies: list[tuple[Frame, bytes]]) -> None:
        for frame, body in replies:
            self.server.send(frame.src, body, channel=frame.channel, seq=frame.seq, type=FrameType.REPLY,
                             priority=frame.priority)

    def _one(self, frame: Frame, raw: bytes, hops: int, vks: list[int], records: list[bytes]) -> bytes | None:
        try:
            req = proto.parse_request(frame.payload)
        except proto.KvsError as exc:
            self.counters["bad_requests"] += 1
            reqid = int.from_bytes(frame.payload[12:20], "big") if len(frame.payload) >= 20 else 0
            return proto.error_reply(reqid, Status.BAD_REQUEST, str(exc))
        vk = proto.vkey(req.key)
        role, rec = self.sm.role(vk)
        if role in ("incoming", "paused"):
            self.sm.buffer(vk, raw)
            self.counters["held"] += 1
            return None
        if role == "mirror" and hops == 0:
            self.sm.counters["mirror_ignored"] += 1
            return None
        if role != "owner":
            if not self.sm.forward(raw, vk, hops):
                self.counters["unroutable"] += 1
                return proto.error_reply(req.reqid, Status.WRONG_OWNER,
                                         f"{self.name} does not own key hash {vk:#08x} and cannot reach its owner")
            return None
        self.sm.count_request(rec)
        self.counters[req.op.name.lower()] += 1
        if req.op is Op.GET:
            row = self.store.row(req.key)
            if row is None or row[0] is None:
                return proto.Reply(Status.NOT_FOUND, req.reqid, row[1] if row else 0).serialize()
            return proto.Reply(Status.OK, req.reqid, row[1], row[0]).serialize()
        existed = self.store.row(req.key)
        version, applied, record = self.store.write(req.key, req.value if req.op is Op.PUT else None,
                                                    req.client, req.reqid)
        if not applied:
            self.counters["retries_recognised"] += 1
        if record:
            vks.append(vk)
            records.append(record)
        status = Status.OK
        if req.op is Op.DEL and applied and (existed is None or existed[0] is None):
            status = Status.NOT_FOUND
        return proto.Reply(status, req.reqid, version).serialize()

    def close(self) -> None:
        self.sm.close()
        self.server.close()
        self.store.close()
        log.info("%s: closed; counters %s, state manager %s, port %s", self.name, dict(self.counters),
                 self.sm.counters, self.server.port.counters)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   help="etcd HOST:PORT (default: $VFAB_ETCD, else 127.0.0.1:2379)")
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


def run(args: argparse.Namespace) -> int:
    from vfab.vid.ranges import Range

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    registry = Registry(args.etcd)
    srv = None
    try:
        srv = KvsServer(registry, args.service, args.name, args.iface, args.data, rx=args.rx, netns=args.netns,
                        ttl=args.ttl)
        for text in args.listen:
            rng = Range.parse(text)
            srv.server.listen(rng.lo, rng.hi)
        srv.sm.refresh()
        owned = [str(r.range) for r in srv.sm.view.ranges if r.owner == args.name]
        print(f"ready {srv.sm.ctl}", flush=True)
        log.info("%s: ready; owns %s", args.name, ", ".join(owned) or "nothing yet")
        srv.serve(stop)
    finally:
        if srv is not None:
            srv.close()
        registry.close()
    return 0
