"""sdhcp server: one shard of the service = the stateful-endpoint loop + the DHCP backend.

The loop (``vfab.vid.state.loop``) owns batching, holding, forwarding,
replication and the state operations; :class:`SdhcpLoop` adapts it to DHCP
without changing it:

* its data port is a :class:`~vfab.services.sdhcp.port.DhcpPort` (DHCP to
  port 67 and ARP requests instead of vfab frames);
* each DHCP frame is wrapped into a vfab REQUEST (``frames.wrap``) before the
  loop classifies it, so a request for a key this shard does not serve is
  held or forwarded like any other; replies are the backend's complete
  Ethernet frames, sent as they are, from the VID of the client's key;
* ARP requests for the virtual server address are answered by the shard that
  owns the asking MAC's key, with that key's VID (port security lets only the
  owner source it; a unicast renewal to it meets the front door anyway);
* the backend hands out addresses only in ranges the shard owns and is not
  pausing for an operation (``allocatable``);
* ``STATS`` also carries the backend's counters and pool use (``vfab sdhcp status``);
* the leases of hosts registered as DHCP hosts are published as bindings for the
  source guard (``bindings.py``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import threading
import time

from vfab.services.sdhcp import frames
from vfab.services.sdhcp.agent import PARK_S, BlockAgent
from vfab.services.sdhcp.backend import SdhcpBackend, open_backend
from vfab.services.sdhcp.bindings import Binder
from vfab.services.sdhcp.config import OPTIONS, Config, parse_opts, shard_config
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.lane import LaneError, LanePort, NativeLane, SHARED, enabled as lane_enabled, vid_base
from vfab.services.sdhcp.pool import subtract
from vfab.services.sdhcp.port import DhcpPort
from vfab.vid import codec, mackey
from vfab.vid.envelope import Envelope
from vfab.vid.errors import VfabError
from vfab.vid.frame import parse as parse_frame
from vfab.vid.frame import ETH_TYPE
from vfab.vid.ranges import Range
from vfab.vid import metrics
from vfab.vid.registry import Registry
from vfab.vid.state.loop import EndpointLoop
from vfab.vid.state.view import read_view
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.sdhcp.server")

VFAB = ETH_TYPE.to_bytes(2, "big")
LANE_LOG_S = 10.0     # s between two warnings of the native lane's faults
UNPARK_S = 0.25       # s between two retries of parked DISCOVERs without a table change
LANE_FAULTS = ("store_failed", "sync_failed", "to_loop_dropped", "tx_dropped", "events_dropped")
IPV4 = b"\x08\x00"
ARP = frames.ETH_P_ARP.to_bytes(2, "big")


class SdhcpLoop(EndpointLoop):
    backend: SdhcpBackend
    binder: Binder | None = None   # publishes the DHCP hosts' leases (set by ``run``)
    lane: NativeLane | None = None  # serves the common requests in C (lane.py); None: all in Python
    agent: BlockAgent | None = None  # the block table, wants and lends (agent.py; ``start_blocks``); None: home keys

    def __init__(self, registry: Registry, service: str, name: str, iface: str, backend: SdhcpBackend,
                 netns: str | None = None, ttl: int = 3, native: bool = True):
        super().__init__(registry, service, name, iface, backend, rx="ovs", netns=netns, ttl=ttl)
        try:
            vfab_port, self.port = self.port, DhcpPort(iface, "ovs", netns=netns)
            vfab_port.close()
        except BaseException:
            self.close()
            raise
        self._lane_key: tuple | None = None
        self._lane_seen: dict[str, int] = {}
        self._lane_logged = -LANE_LOG_S
        if native and lane_enabled():
            try:
                self.lane = NativeLane(backend, self.port.fileno(), vid_base(self.service.id, self.layout))
            except LaneError as exc:
                log.warning("%s: no native lane (%s): every request is served in Python, at several times the "
                            "CPU per lease", name, exc)
        if self.lane is not None:
            backend.store.lane = backend.store.writer_lock = self.lane
            self.port = LanePort(self.port, self.lane)
            self.lease.on_extend.append(self.lane.extend)
            self.lane.on_events = lambda events: self.backend.on_bindings(events)
        self.server_ip = backend.config.server.packed
        # DISCOVERs that found no address, (first parked monotonic s, frame), served again when the block
        # table changes or an address may have been freed, for up to PARK_S
        self.parked: collections.deque = collections.deque()
        self._park_t: dict[bytes, float] = {}
        self._exhausted: list[bytes] = []
        self._unpark_at = 0.0
        backend.on_exhausted = self._exhausted.extend
        backend.allocatable = self.allocatable
        backend.vid_mac = self.vid_mac
        if not any(d.get("kind") == "dhcp4" for d in self.service.frontdoors):
            log.warning("%s: service %s has no dhcp4 front door, so no DHCP will reach it: create it with "
                        "'vfab service add %s --kind sdhcp --opt ...'", name, service, service)

    def vid_mac(self, key: int) -> bytes:
        return codec.packed(self.service.id, key, self.layout)   # remembered: asked once per reply

    def bound_leases(self) -> list[tuple[int, int, int]]:
        """(any thread: its own connection) The bound leases in the ranges this shard owns now (the binder)."""
        return self.backend.store.bound([r.range for r in self.view.owned_by(self.name)],
                                        int(self.backend.clock() * 1000))

    def allocatable(self) -> list[Range]:
        """(loop thread) Ranges whose addresses this shard may hand out now: owned, not paused, and (with a block
        agent) the block table read for them (``BlockAgent.allowed``)."""
        own = [r.range for r in self.view.owned_by(self.name)]
        if self.agent is not None:
            own = self.agent.allowed(own)
        return subtract(own, [rng for rng, _ in self.paused.values()])

    # -- blocks (agent.py) -------------------------------------------------------------------------
    def start_blocks(self, registry: Registry) -> BlockAgent:
        """Follow the service's block table, ask for addresses and lend them (before ``serve``)."""
        self.agent = BlockAgent(self, registry)
        self.agent.start()
        return self.agent

    def blocks_changed(self) -> None:
        """(loop thread) The store's block table changed: the lane gets its new intervals, parked DISCOVERs
        are served again."""
        self._lane_key = None
        self._lane_sync()
        self._unpark()

    def parked_count(self) -> int:
        return len(self.parked)

    def _park(self, frames_in: list) -> None:
        want = set(self._exhausted)
        self._exhausted.clear()
        now = time.monotonic()
        for raw, _ in frames_in:
            try:
                payload = parse_frame(raw).payload
            except VfabError:
                continue
            if payload in want:
                t = self._park_t.get(raw, now)
                if now - t < PARK_S:
                    self._park_t[raw] = t
                    self.parked.append((t, raw))
                    self.counters["parked"] += 1
        if self.agent is not None and self.parked:
            self.agent.nudge()

    def _unpark(self) -> None:
        if not self.parked:
            return
        self._unpark_at = time.monotonic()
        again = list(self.parked)
        self.parked.clear()
        self._park_t = {raw: t for t, raw in again}
        self.pending.extend((raw, 0) for _, raw in again)

    # -- the native lane ---------------------------------------------------------------------------
    def _lane_ranges(self) -> list[tuple[int, int]]:
        """(loop thread) What the lane may serve now: owned ranges, authoritative, without mirrors, not paused
        and not copied to a peer (their writes must reach peers: the loop's work); nothing while requests wait
        in the loop's own queue."""
        if not self._authoritative() or self.pending:
            return []   # requests released from a hold or fenced go first: a client's are answered in order
        holes = [rng for rng, _ in self.paused.values()] + [r for rngs in self.targets.values() for r in rngs]
        own = [r for r in self.view.owned_by(self.name) if not r.mirrors and not any(r.range.overlaps(h) for h in holes)]
        agent = getattr(self, "agent", None)
        if agent is not None:
            ok = agent.allowed([r.range for r in own])
            own = [r for r in own if r.range in ok]
        return [(r.lo, r.hi) for r in own]

    def _lane_sync(self) -> None:
        if self.lane is None:
            return
        ranges = self._lane_ranges()
        key = (tuple(ranges), self.lease.generation, id(self.backend.store.blocks))
        if key != self._lane_key:
            self._lane_key = key
            self.lane.grant(ranges, self.lease.valid_until, self.lease.generation)

    def _lane_revoke(self) -> None:
        if self.lane is not None:
            self._lane_key = None
            self.lane.grant([], 0.0, 0)

    def serve(self, stop: threading.Event) -> None:
        if self.lane is not None:
            self._lane_sync()
            self.lane.start()
        super().serve(stop)

    def _timers(self) -> None:
        super()._timers()
        self._lane_sync()
        self._lane_faults()
        if self.parked:
            now = time.monotonic()
            while self.parked and now - self.parked[0][0] >= PARK_S:
                self._park_t.pop(self.parked.popleft()[1], None)
                self.counters["parked_expired"] += 1
            if now - self._unpark_at >= UNPARK_S:
                self._unpark()   # an address of its own may have been freed meanwhile

    def _lane_faults(self) -> None:
        """Say in the log what the lane could not do since the last look (at most every LANE_LOG_S): requests
        it failed to commit or sync (the loop answers them, or the client asks again), frames it had to drop."""
        now = time.monotonic()
        if self.lane is None or now - self._lane_logged < LANE_LOG_S:
            return
        c = self.lane.counters()
        faults = {k: c[k] for k in LANE_FAULTS if c[k]}
        if faults != self._lane_seen:
            news = {k: v - self._lane_seen.get(k, 0) for k, v in faults.items() if v > self._lane_seen.get(k, 0)}
            self._lane_seen, self._lane_logged = faults, now
            if news:
                log.warning("%s: native lane: %s since the last look (%s); requests it could not keep went to "
                            "the loop or get no answer, and their clients ask again", self.name,
                            ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in news.items()),
                            self.lane.error() or "no error text")

    def _set_view(self, view, generation: int | None = None) -> None:
        super()._set_view(view, generation)
        if self.lane is not None:
            self._lane_sync()

    def _patch(self, rec, revision: int) -> None:
        super()._patch(rec, revision)
        self._lane_sync()

    def op_command(self, op, cmd: str, rng: Range, to: str, rec, revision: int = 0):
        """Revoke the lane's grant first (a pause or a copy must see every write before it), then grant again
        what is left to it."""
        self._lane_revoke()
        try:
            return super().op_command(op, cmd, rng, to, rec, revision)
        finally:
            self._lane_sync()

    def _serve_ctl(self) -> None:
        """The loop's control socket, then: requests other shards forwarded here (a relay's clients enter at the
        shard owning the relay's key, and most belong to another's) go to the native lane first, in order, if
        nothing else waited before them; what it leaves stays for the loop.  In Python each cost ~0.4 ms of
        CPU, and their queue kept the lane's grant revoked (``_lane_ranges``): with sequential MACs behind 4
        relays nearly every request of 4 shards went through Python (bench/sdhcp_lease.py, 2026-12-07)."""
        before = len(self.pending)
        super()._serve_ctl()
        if self.lane is not None and before == 0 and self.pending:
            self._lane_forwarded()

    def _lane_forwarded(self) -> None:
        items = list(self.pending)
        try:
            replies = self.lane.serve_forwarded([raw for raw, _ in items], int(self.backend.clock() * 1000))
        except LaneError:
            return   # the store or the disk failed (the lane's faults log says so): the loop serves them
        served = 0
        for reply in replies:
            if reply is None:
                break
            self.port.send(reply)
            served += 1
        for _ in range(served):
            self.pending.popleft()
        self.counters["forwarded_native"] += served

    def take_rates(self) -> dict[int, int]:
        rates = super().take_rates()
        if self.lane is not None:
            for lo, n in self.lane.take_rates().items():
                rates[lo] = rates.get(lo, 0) + n
        return rates

    def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        self.leave_serve()   # the loop's thread out of its pass before the lane it reads goes
        lane = self.lane
        if lane is not None:
            self.backend.store.writer_lock = self.backend.store.lane = None
            lane.acquire()     # a write transaction under way ends first
            lane.release()
            lane.close()
        super().close()

    # -- the data path, adapted ----------------------------------------------------------------
    def _handle(self, frames_in: list) -> None:
        try:
            self._handle_dhcp(frames_in)
        finally:
            if self.lane is not None:
                self.port.finished()

    def _handle_dhcp(self, frames_in: list) -> None:
        out = []
        for raw, hops in frames_in:
            kind = raw[12:14]
            if kind == VFAB:
                out.append((raw, hops))          # a request held or forwarded earlier: already wrapped
            elif kind == IPV4:
                try:
                    out.append((frames.wrap(raw, self.port.mac), hops))
                except DhcpError:
                    self.backend.counters["bad_frames"] += 1
            elif kind == ARP:
                self._arp(raw)
            else:
                self.backend.counters["bad_frames"] += 1
        if out:
            super()._handle(out)
            if self._exhausted:
                self._park(out)

    def _reply(self, frame, vk, payload) -> None:
        if payload is not None:
            self.port.send(payload)              # a complete Ethernet frame built by the backend

    def _arp(self, raw: bytes) -> None:
        req = frames.parse_arp_request(raw)
        if req is None or req[2] != self.server_ip:
            return
        sha, spa, _ = req
        key = self.backend.store.key(sha)
        rec = self.view.find(key)
        if rec is None or rec.owner != self.name or not self._authoritative() \
                or any(key in rng for rng, _ in self.paused.values()):
            return                               # its owner answers
        self.port.send(frames.arp_reply(self.vid_mac(key), self.server_ip, sha, spa))
        self.backend.counters["arp_replies"] += 1

    def _control(self, env: Envelope, ident: bytes = b""):
        if env.type == "STATS":
            stats = self.backend.stats([r.range for r in self.view.owned_by(self.name)])
            mirrored = [r.range for r in self.view.ranges if self.name in r.mirrors]
            stats["mirrored"] = self.backend.store.usage(mirrored, int(self.backend.clock() * 1000))
            if self.binder is not None:
                stats["bindings"] = dict(self.binder.counters)
            if self.agent is not None:
                stats["agent"] = dict(self.agent.counters)
            stats["parked"] = len(self.parked)
            if self.lane is not None:
                native = self.lane.counters()
                stats["native"] = {**native, "granted": [f"{lo:#x}-{hi:#x}" for lo, hi in self.lane.granted],
                                   "failed": self.lane.failed}
                for name in SHARED:
                    stats["counters"][name] = stats["counters"].get(name, 0) + native[name]
            return env.reply("OK", self.name, counters=dict(self.counters), port=dict(self.port.counters),
                             sdhcp=stats)
        return super()._control(env, ident)


def parse_opt_list(texts: list[str]) -> dict[str, str]:
    out = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise DhcpError(f"--opt {text!r} is not NAME=VALUE (e.g. --opt pool=192.168.77.10-192.168.77.250)")
        out[name] = value
    return out


def migrate_keys(store, held: list[Range], name: str, service: str) -> int:
    """Store the leases under the service's key function (``Store.rekey``) if they are under another; how many
    rows moved.  Only a shard that holds every key of the service (owns or mirrors it: ``held``), or none, may:
    else the rows whose new key another shard owns would be dropped as not held.  DhcpError says what to do."""
    if store.key_fn == store.stored_key_fn:
        return 0
    if held and sum(r.hi - r.lo + 1 for r in held) != codec.KEY_MAX + 1:
        raise DhcpError(
            f"{name}: the leases in {store.path} are keyed by {store.stored_key_fn}, but service {service}'s front "
            f"door keys clients by {store.key_fn} now, and this shard holds only {', '.join(map(str, held))}: a "
            f"lease whose new key another shard owns would be lost.  Merge every range of {service} onto one shard "
            f"first ('vfab merge'; 'vfab sdhcp rekey' checks this), then restart that shard and its mirrors")
    old = store.stored_key_fn
    n = store.rekey()
    log.warning("%s: %d leases re-keyed from %s to %s (service %s's front door): clients keep their addresses",
                name, n, old, store.key_fn, service)
    return n


def open_server(registry: Registry, service: str, name: str, iface: str, datadir: str,
                config: Config | None = None, netns: str | None = None, ttl: int = 3,
                native: bool = True) -> SdhcpLoop:
    """An announced sdhcp shard, ready to ``serve``; ``native``: with its native lane (lane.py).  Its leases are
    keyed by the service's front door's key function (``migrate_keys`` moves them there if need be)."""
    key_fn = mackey.of_service(registry.service(service))
    backend = open_backend(datadir, name, config, key_fn)
    try:
        migrate_keys(backend.store, [r.range for r in read_view(registry, service).held_by(name)], name, service)
        return SdhcpLoop(registry, service, name, iface, backend, netns=netns, ttl=ttl, native=native)
    except BaseException:
        backend.store.close()
        raise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = """\
Serve DHCPv4 (RFC 2131) for the key ranges this shard owns.

Clients are unmodified (udhcpc, dhclient, dhcpcd, ...).  They reach the service
through its dhcp4 front door: the switch steers each DHCP frame by the client
MAC's key (a hash of it, or its low 24 bits for a service created before: the
front door's key function) to the shard owning that key.  Shards split, merge, move
and mirror like any stateful endpoint ('vfab split|merge|move|mirror'), their
leases and their slice of the pool with them.  Leases are on disk (fsync) and on
every mirror before the ACK leaves.

Every shard of one service hands out one pool: give its options once, to
'vfab service add NAME --kind sdhcp --opt ...', and each shard reads them from
the service record at start.  A shard's own --opt goes over the record's: it
may change what that shard hands out (lease, t1, t2, router, dns, relays),
never the pool, mask or server.  A shard whose service record has no options
and that is given none uses those its store was created with."""
    p.epilog = "pool options (--opt NAME=VALUE):\n" + "\n".join(f"  {k:<7} {v}" for k, v in OPTIONS.items()) + """

example (shard s1 on testbed host vfh1, owning every key):
  vfab service add dhcp --kind sdhcp --opt pool=192.168.77.10-192.168.77.250 \\
      --opt mask=24 --opt server=192.168.77.1
  python -m vfab.services.sdhcp server --service dhcp --name s1 \\
      --iface vfh1-eth0 --netns "$(vfab netns vfh1)" --data /var/lib/vfab/sdhcp \\
      --listen 0-0xffffff"""
    p.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"),
                   type=etcd_members.arg,
                   help="etcd members HOST:PORT[,HOST:PORT...] (default: $VFAB_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--service", required=True, help="service name (create it with 'vfab service add NAME "
                                                     "--kind sdhcp')")
    p.add_argument("--name", required=True, help="this shard's name (stable across restarts: its leases' name)")
    p.add_argument("--iface", required=True, help="data interface (the host port the front door delivers to)")
    p.add_argument("--netns", default=None, metavar="PATH", help="network namespace of --iface (/proc/PID/ns/net)")
    p.add_argument("--data", required=True, metavar="DIR", help="directory of the lease store (NAME.sqlite)")
    p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="pool option (repeatable; see below), over the service record's; with neither, those of "
                        "the store in --data")
    p.add_argument("--listen", action="append", default=[], metavar="LO-HI",
                   help="take this key range at start (repeatable; only for a fresh service)")
    p.add_argument("--no-native", action="store_true",
                   help="serve every request in Python, without the native lane (it serves DISCOVERs, REQUESTs for held "
                        "addresses and ARP for the server address in C; also VFAB_SDHCP_NATIVE=0)")
    p.add_argument("--ttl", type=int, default=1, help="endpoint lease TTL in s: a mirror serves a crashed shard's "
                                                      "clients about this long after the crash, plus up to 0.5 s "
                                                      "(default 1: etcd's minimum TTL must allow it, see "
                                                      "vfab.vid.state.lease)")
    metrics.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    opts = parse_opt_list(args.opt)
    if {"pool", "mask", "server"} <= opts.keys():
        parse_opts(opts)   # a whole pool of its own: bad input is said before etcd is asked
    metrics.configure(args)   # before the loop: --no-metrics leaves its hooks out
    registry = Registry(args.etcd)
    loop = exporter = None
    try:
        config = shard_config(opts, registry.service(args.service).opts, args.service)
        loop = open_server(registry, args.service, args.name, args.iface, args.data, config, netns=args.netns,
                           ttl=args.ttl, native=not args.no_native)
        loop.binder = Binder(args.etcd, args.service, args.name, leases=loop.bound_leases)
        if loop.lane is not None:
            loop.binder.on_hosts = loop.lane.watch
        loop.binder.start()
        loop.backend.on_bindings = loop.binder.offer
        loop.start_blocks(Registry(args.etcd))
        for text in args.listen:
            registry.assign(args.service, Range.parse(text), args.name)
        if args.listen:
            loop._set_view(read_view(registry, args.service))
        owned = [str(r.range) for r in loop.view.owned_by(args.name)]
        exporter = metrics.start(args, "endpoint", args.name, etcd=args.etcd, service=args.service)
        print(f"ready {loop.ctl}" + (f" metrics={exporter.addr}" if exporter else ""), flush=True)
        log.info("%s: ready; %s; owns %s", args.name, loop.backend.config.describe(), ", ".join(owned) or "nothing yet")
        loop.serve(stop)
    finally:
        if exporter is not None:
            exporter.close()
        if loop is not None:
            if loop.binder is not None:
                loop.binder.stop()
            loop.close()
            loop.backend.store.close()
        registry.close()
    return 0
