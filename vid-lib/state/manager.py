"""The state manager (DESIGN.md §5, the virtual-servers paper's Table I and Algorithm 1).

A stateful server embeds one :class:`StateManager`.  It owns the server's
ZeroMQ control socket (a ROUTER on ``ctl``), a cached view of the service's
range map, and runs the state operations:

``split(peer, range)`` / ``move(peer)``
    prepare: the peer is told (BEGIN) and starts *buffering* requests for the
    range; it forgets any stale copy.  copy: the range's records stream to it
    (CHUNK, each applied durably before its ack) while every write the owner
    acknowledges in the range is first replicated to it (REPL), so the copy
    never falls behind.  flip: the owner pauses the range (its requests are
    buffered), one epoch-checked etcd transaction gives the range to the peer
    (the controller turns that into one bundle per switch), COMMIT tells the
    peer to serve, and the buffered requests and any that still reach the old
    owner are forwarded to the new one (FWD).  The old copy is dropped last.
``merge(peer, range)``
    the caller takes ``range`` from its owner: a split run by the owner
    towards the caller; neighbouring ranges of one owner are then joined.
``mirror(peer)``
    the same copy, then the peer joins the ranges' ``mirrors`` (epoch-checked);
    from then on every write is on the mirror before it is acknowledged, and
    when the owner's lease expires the first live mirror takes its ranges.

Failures: before the flip, any failure (peer dead or silent, etcd conflict,
cancel) aborts: the peer drops what it got, the owner keeps the range and
never stopped serving.  A peer whose source falls silent asks etcd who owns
the range: itself (the flip committed) → it serves; otherwise it aborts.
So a range has exactly one owner at every etcd revision, and every
acknowledged write is durable on the owner (and on every mirror).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import zmq

from vfab.vid.registry import schema
from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import Conflict, RegistryError, StateError, VfabError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry

log = logging.getLogger("vfab.statemgr")

ACK_TIMEOUT = 3.0       # s for a peer to acknowledge a control message
INCOMING_IDLE = 6.0     # s a peer waits on a silent source before asking etcd
VIEW_PERIOD = 0.25      # s between refreshes of the cached range map
LOAD_PERIOD = 1.0       # s between load reports
FWD_HOPS = 4


class Backend(Protocol):
    """What a service gives the state manager: its records per range of VID keys."""

    def count(self, rng: Range) -> int: ...
    def snapshot(self, rng: Range) -> Iterator[tuple[bytes, int]]: ...
    def apply(self, blobs: list[bytes]) -> int: ...
    def drop(self, rng: Range) -> int: ...


@dataclass
class Incoming:
    """A range being copied to us (we are the peer)."""

    range: Range
    source: str
    mode: str                      # "split" or "mirror"
    seen: float
    buffered: list[bytes] = field(default_factory=list)


class View:
    """The service's range map and endpoints as last read from etcd."""

    def __init__(self) -> None:
        self.ranges: list[schema.RangeRec] = []
        self.endpoints: dict[str, schema.Endpoint] = {}

    def find(self, vk: int) -> schema.RangeRec | None:
        for rec in self.ranges:
            if rec.lo <= vk <= rec.hi:
                return rec
        return None


class Op:
    """One running operation (the source side), driven by its own thread."""

    def __init__(self, kind: str, ranges: list[Range], peer: str, throttle: float):
        self.kind, self.ranges, self.peer, self.throttle = kind, ranges, peer, throttle
        self.cancel = threading.Event()
        self.failed: str = ""          # set by the data path when replication to the peer failed
        self.rec: schema.OpRec | None = None


class StateManager:
    def __init__(self, registry: Registry, service: schema.Service, name: str, backend: Backend,
                 lease: int = 0, bind: str = "tcp://127.0.0.1:*"):
        self.registry = registry
        self.etcd = registry.endpoint
        self.service = service
        self.name = name
        self.backend = backend
        self.lease = lease
        self.zctx = zmq.Context.instance()
        self.router = self.zctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(bind)
        self.ctl = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.lock = threading.RLock()
        self.view = View()
        self.paused: list[Range] = []
        self.incoming: dict[int, Incoming] = {}
        self.targets: dict[str, list[Range]] = {}      # copy targets of running ops
        self.op: Op | None = None
        self.dealers: dict[str, zmq.Socket] = {}       # main thread's sockets to peers
        self.next_id = 1
        self.rates: dict[int, int] = {}                 # range lo -> requests since the last report
        self.counters = {"forwarded": 0, "repl_sent": 0, "repl_applied": 0, "mirror_ignored": 0}
        # Called with (frame, hops) for requests to re-classify (forwarded to us, or released after an
        # op); may be called from the op thread: the server must queue them thread-safely.
        self.on_forwarded: Callable[[bytes, int], None] = lambda frame, hops: None
        self._paused_frames: list[bytes] = []
        self.on_view_change: Callable[[], None] = lambda: None  # e.g. re-filter the receive port
        self.in_batch = False   # the data path is inside a batch (set/cleared by the server's loop)
        self.batch_no = 0       # batches finished so far
        self._stop = threading.Event()
        self.refresh()

    # -- the cached view --------------------------------------------------------
    def refresh(self, registry: Registry | None = None) -> None:
        reg = registry or self.registry
        recs = [r for r, _ in reg.ranges(self.service.name)]
        eps = {e.name: e for e in reg.endpoints(self.service.name)}
        with self.lock:
            changed = recs != self.view.ranges
            self.view.ranges, self.view.endpoints = recs, eps
        if changed:
            self.on_view_change()

    def start(self) -> None:
        threading.Thread(target=self._housekeeping, name="statemgr-view", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self.op is not None:
            self.op.cancel.set()

    def close(self) -> None:
        self.stop()
        for s in self.dealers.values():
            s.close(0)
        self.router.close(0)

    def role(self, vk: int) -> tuple[str, schema.RangeRec | None]:
        """What this endpoint does with a request for ``vk``: serve, buffer, ignore or forward."""
        with self.lock:
            for inc in self.incoming.values():
                if vk in inc.range and inc.mode == "split":
                    return "incoming", None
            rec = self.view.find(vk)
            if rec is not None and rec.owner == self.name:
                if any(vk in r for r in self.paused):
                    return "paused", rec
                return "owner", rec
            if rec is not None and self.name in rec.mirrors:
                return "mirror", rec
            return "other", rec

    def buffer(self, vk: int, frame: bytes) -> None:
        with self.lock:
            for inc in self.incoming.values():
                if vk in inc.range:
                    inc.buffered.append(frame)
                    return
            self._paused_frames.append(frame)

    # -- the data path's replication ---------------------------------------------
    def targets_for(self, vks: list[int]) -> dict[str, list[int]]:
        """Peers that must hold a write to each of ``vks`` before it is acknowledged: mirrors, copies."""
        out: dict[str, list[int]] = {}
        with self.lock:
            for i, vk in enumerate(vks):
                rec = self.view.find(vk)
                names = list(rec.mirrors) if rec is not None and rec.owner == self.name else []
                names += [p for p, rngs in self.targets.items() if any(vk in r for r in rngs)]
                for n in names:
                    if n != self.name:
                        out.setdefault(n, []).append(i)
        return out

    def replicate(self, vks: list[int], records: list[bytes]) -> bool:
        """Send the records to every peer that must hold them and wait for all acks.

        False when a write could not be made safe (a mirror failed and could not be
        fenced off in etcd): the caller must not acknowledge it.
        """
        need = self.targets_for(vks)
        if not need:
            return True
        waiting: dict[int, str] = {}
        for peer, idx in need.items():
            sock = self._dealer(peer)
            if sock is None:
                if not self._peer_failed(peer, "has no control address"):
                    return False
                continue
            rid = self._id()
            sock.send_multipart(Envelope("REPL", self.name, id=rid, blobs=[records[i] for i in idx]).frames())
            waiting[rid] = peer
            self.counters["repl_sent"] += 1
        failed: dict[str, str] = {}
        deadline = time.monotonic() + ACK_TIMEOUT
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        socks = {self.dealers[p] for p in waiting.values()}
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ in poller.poll(left * 1000):
                if sock is self.router:
                    self.serve_ctl()  # never deadlock on a peer that replicates to us meanwhile
                    continue
                env = self._recv_env(sock)
                if env is not None and env.id in waiting:
                    peer = waiting.pop(env.id)
                    if env.type != "OK":
                        failed[peer] = env.body.get("error", "refused the write")
        for peer in set(waiting.values()):
            failed.setdefault(peer, f"did not acknowledge within {ACK_TIMEOUT} s")
        ok = True
        for peer, why in failed.items():
            ok &= self._peer_failed(peer, why)
        return ok

    def _peer_failed(self, peer: str, why: str) -> bool:
        """A replication target failed: abort its copy, or fence it off as a mirror. True if safe."""
        self._drop_dealer(peer)
        with self.lock:
            if self.op is not None and self.op.peer == peer and peer in self.targets:
                self.op.failed = f"peer {peer} {why}"
                self.targets.pop(peer, None)
                log.warning("%s: copy to %s failed (%s): the operation aborts", self.name, peer, why)
                return True
        log.warning("%s: mirror %s %s: removing it from the mirrors before acknowledging", self.name, peer, why)
        try:
            for rec, _ in self.registry.ranges(self.service.name):
                if rec.owner == self.name and peer in rec.mirrors:
                    self.registry.assign(self.service.name, rec.range, self.name, expect_epoch=rec.epoch,
                                         mirrors=[m for m in rec.mirrors if m != peer], helpers=rec.helpers)
            self.refresh()
            return True
        except RegistryError as exc:
            log.error("%s: cannot fence off mirror %s (%s): writes stay unacknowledged", self.name, peer, exc)
            return False

    def forward(self, frame: bytes, vk: int, hops: int = 0) -> bool:
        """Send a request that reached us to the range's owner (it answers the client itself)."""
        with self.lock:
            rec = self.view.find(vk)
            owner = rec.owner if rec is not None else ""
        if not owner or owner == self.name or hops >= FWD_HOPS:
            return False
        sock = self._dealer(owner)
        if sock is None:
            return False
        sock.send_multipart(Envelope("FWD", self.name, body={"hops": hops + 1}, blobs=[frame]).frames())
        self.counters["forwarded"] += 1
        return True

    # -- sockets ------------------------------------------------------------------
    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _dealer(self, peer: str) -> zmq.Socket | None:
        sock = self.dealers.get(peer)
        if sock is None:
            with self.lock:
                ep = self.view.endpoints.get(peer)
            if ep is None or not ep.ctl:
                return None
            sock = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep.ctl)
            self.dealers[peer] = sock
        return sock

    def _drop_dealer(self, peer: str) -> None:
        sock = self.dealers.pop(peer, None)
        if sock is not None:
            sock.close(0)

    @staticmethod
    def _recv_env(sock: zmq.Socket) -> Envelope | None:
        try:
            return decode(sock.recv_multipart(zmq.NOBLOCK))
        except (zmq.Again, EnvelopeError):
            return None

    # -- the control socket (main thread) --------------------------------------------
    def serve_ctl(self) -> None:
        """Handle every control message waiting on the ROUTER."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            try:
                env = decode(rest)
            except EnvelopeError as exc:
                self.router.send_multipart([ident, *Envelope("ERR", self.name, body={"error": str(exc)}).frames()])
                continue
            try:
                reply = self._handle(env)
            except (VfabError, ValueError) as exc:
                reply = env.reply("ERR", self.name, error=str(exc))
            except Exception as exc:  # a handler bug must not kill the server
                log.exception("%s: control message %s failed", self.name, env.type)
                reply = env.reply("ERR", self.name, error=f"internal error: {exc!r}")
            if reply is not None:
                self.router.send_multipart([ident, *reply.frames()])

    def _handle(self, env: Envelope) -> Envelope | None:
        t, b = env.type, env.body
        if t == "REPL" or t == "CHUNK":
            n = self.backend.apply(env.blobs)
            self.counters["repl_applied"] += n
            with self.lock:
                for inc in self.incoming.values():
                    if inc.source == env.sender:
                        inc.seen = time.monotonic()
            return env.reply("OK", self.name, applied=n)
        if t == "FWD":
            for frame in env.blobs:
                self.on_forwarded(frame, int(b.get("hops", 1)))
            return None
        if t == "BEGIN":
            rng = Range(int(b["lo"]), int(b["hi"]))
            with self.lock:
                if any(i.range.overlaps(rng) for i in self.incoming.values()):
                    raise StateError(f"{self.name} is already receiving a range overlapping {rng}")
                rec = self.view.find(rng.lo)
            if rec is not None and rec.owner == self.name:
                raise StateError(f"{self.name} already owns {rng}")
            # A fresh copy: nothing stale may survive, unless we mirror the range (then our copy is current
            # and must stay whatever happens to this operation; version-gated records keep it right).
            dropped = 0 if rec is not None and self.name in rec.mirrors else self.backend.drop(rng)
            with self.lock:
                self.incoming[rng.lo] = Incoming(rng, env.sender, b.get("mode", "split"), time.monotonic())
            log.info("%s: receiving %s from %s (%s); dropped %d stale keys", self.name, rng, env.sender,
                     b.get("mode"), dropped)
            return env.reply("OK", self.name)
        if t == "COMMIT":
            self._finish_incoming(int(b["lo"]), commit=True)
            return env.reply("OK", self.name)
        if t == "ABORT":
            self._finish_incoming(int(b["lo"]), commit=False)
            return env.reply("OK", self.name)
        if t in ("SPLIT", "MOVE", "MIRROR"):
            op = self.start_op(t.lower(), b.get("peer", ""), Range(int(b["lo"]), int(b["hi"])) if "lo" in b else None,
                               float(b.get("throttle", 0)))
            return env.reply("OK", self.name, ranges=[[r.lo, r.hi] for r in op.ranges])
        if t == "CANCEL":
            op = self.op
            if op is None:
                raise StateError(f"{self.name} runs no operation: nothing to cancel")
            op.cancel.set()
            return env.reply("OK", self.name, op=op.kind)
        if t == "PING":
            return env.reply("OK", self.name)
        raise StateError(f"unknown control message type {t!r}")

    def _finish_incoming(self, lo: int, commit: bool) -> None:
        with self.lock:
            inc = self.incoming.pop(lo, None)
        if inc is None:
            return
        if commit:
            self.refresh()
            log.info("%s: %s from %s committed (%s): serving %d buffered requests", self.name, inc.range,
                     inc.source, inc.mode, len(inc.buffered))
            for frame in inc.buffered:
                self.on_forwarded(frame, 0)
        else:
            rec = self.view.find(inc.range.lo)
            if not (rec is not None and self.name in rec.mirrors):
                self.backend.drop(inc.range)
            log.info("%s: %s from %s aborted: copy dropped, %d buffered requests forwarded to the owner",
                     self.name, inc.range, inc.source, len(inc.buffered))
            self.refresh()
            for frame in inc.buffered:
                self.on_forwarded(frame, 0)

    # -- housekeeping thread: view, silent sources, takeover, load reports -----------
    def _housekeeping(self) -> None:
        reg = Registry(self.etcd)
        last_load = 0.0
        while not self._stop.wait(VIEW_PERIOD):
            try:
                self.refresh(reg)
                self._check_incoming(reg)
                self._takeover(reg)
                if time.monotonic() - last_load >= LOAD_PERIOD:
                    last_load = time.monotonic()
                    self._report_load(reg)
            except VfabError as exc:
                log.warning("%s: housekeeping: %s", self.name, exc)

    def _check_incoming(self, reg: Registry) -> None:
        with self.lock:
            silent = [i for i in self.incoming.values() if time.monotonic() - i.seen > INCOMING_IDLE]
        for inc in silent:
            rec = self.view.find(inc.range.lo)
            mine = rec is not None and (rec.owner == self.name if inc.mode == "split" else self.name in rec.mirrors)
            log.warning("%s: source %s of %s silent for %.0f s; etcd says %s: %s", self.name, inc.source,
                        inc.range, INCOMING_IDLE, rec.owner if rec else "-", "committing" if mine else "aborting")
            self._finish_incoming(inc.range.lo, commit=mine)

    def _takeover(self, reg: Registry) -> None:
        with self.lock:
            recs, eps = list(self.view.ranges), dict(self.view.endpoints)
        for rec in recs:
            if self.name not in rec.mirrors or not rec.owner or rec.owner in eps:
                continue
            live = sorted(m for m in rec.mirrors if m in eps)
            if not live or live[0] != self.name:
                continue
            try:
                reg.assign(self.service.name, rec.range, self.name, expect_epoch=rec.epoch,
                           mirrors=live[1:], helpers=rec.helpers)
                log.warning("%s: owner %s of %s is gone (lease expired): took the range over as its first "
                            "mirror", self.name, rec.owner, rec.range)
            except RegistryError as exc:
                log.info("%s: takeover of %s lost: %s", self.name, rec.range, exc)
            self.refresh(reg)

    def _report_load(self, reg: Registry) -> None:
        with self.lock:
            mine = [r for r in self.view.ranges if r.owner == self.name or self.name in r.mirrors]
            rates, self.rates = self.rates, {}
        rows = [[r.lo, r.hi, self.backend.count(r.range), rates.get(r.lo, 0) / LOAD_PERIOD] for r in mine]
        role = {f"{r.lo:06x}": "owner" if r.owner == self.name else "mirror" for r in mine}
        reg.put(schema.load_key(self.service.name, self.name),
                schema.Load(at=time.time(), ranges=rows, role=role).to_json(), lease=self.lease or None)

    def count_request(self, rec: schema.RangeRec) -> None:
        self.rates[rec.lo] = self.rates.get(rec.lo, 0) + 1

    # -- operations (source side) ---------------------------------------------------------
    def start_op(self, kind: str, peer: str, rng: Range | None, throttle: float = 0.0) -> Op:
        schema.check_name("peer endpoint", peer)
        if peer == self.name:
            raise StateError(f"{kind} to {peer}: the peer is this endpoint itself; name another endpoint")
        if peer not in self.view.endpoints:
            self.refresh()  # the peer may have started since the last refresh
        with self.lock:
            if self.op is not None:
                raise StateError(f"{self.name} is already running a {self.op.kind} to {self.op.peer}: wait for it "
                                 "or cancel it ('vfab cancel')")
            ep = self.view.endpoints.get(peer)
            if ep is None or not ep.ctl:
                live = ", ".join(n for n, e in self.view.endpoints.items() if e.ctl and n != self.name) or "none"
                raise StateError(f"peer {peer!r} is not a live stateful endpoint of {self.service.name!r} "
                                 f"(live: {live}): start it first")
            owned = [r for r in self.view.ranges if r.owner == self.name and r.state == "active"]
            if kind == "split":
                if rng is None:
                    raise StateError("split needs a range LO-HI")
                if not any(r.lo <= rng.lo and rng.hi <= r.hi for r in owned):
                    mine = ", ".join(str(r.range) for r in owned) or "none"
                    raise StateError(f"{self.name} does not own all of {rng} (it owns: {mine}): split only a "
                                     "range inside one of the owner's ranges; 'vfab ranges' shows the map")
                ranges = [rng]
            else:
                ranges = [r.range for r in owned]
                if not ranges:
                    raise StateError(f"{self.name} owns no range: nothing to {kind}")
                if kind == "mirror" and all(peer in r.mirrors for r in owned):
                    raise StateError(f"{peer} already mirrors every range of {self.name}")
            op = Op(kind, ranges, peer, throttle)
            self.op = op
        threading.Thread(target=self._run_op, args=(op,), name=f"op-{kind}", daemon=True).start()
        return op

    def _run_op(self, op: Op) -> None:
        reg = Registry(self.etcd)
        dealer = self.zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        with self.lock:
            dealer.connect(self.view.endpoints[op.peer].ctl)
        total = sum(self.backend.count(r) for r in op.ranges)
        op.rec = schema.OpRec(op=op.kind, source=self.name, peer=op.peer, ranges=[[r.lo, r.hi] for r in op.ranges],
                              total=total, started=time.time(), updated=time.time())
        self._publish(reg, op)
        t0 = time.monotonic()
        try:
            for rng in op.ranges:
                self._one_range(reg, dealer, op, rng)
            op.rec.phase = "done"
        except _Cancelled:
            op.rec.phase, op.rec.error = "cancelled", "cancelled by the operator before the flip; nothing changed"
        except (VfabError, zmq.ZMQError, KeyError) as exc:
            op.rec.phase, op.rec.error = "failed", str(exc)
            log.error("%s: %s to %s failed: %s", self.name, op.kind, op.peer, exc)
        except Exception as exc:  # a bug: still end the op visibly
            op.rec.phase, op.rec.error = "failed", f"internal error: {exc!r}"
            log.exception("%s: %s to %s failed", self.name, op.kind, op.peer)
        finally:
            op.rec.timings["total_s"] = round(time.monotonic() - t0, 4)
            with self.lock:
                self.targets.pop(op.peer, None)
                self.op = None
            try:
                self._publish(reg, op)
            except RegistryError as exc:
                log.warning("%s: cannot publish the op's end: %s", self.name, exc)
            dealer.close(0)
            reg.close()
        log.info("%s: %s of %s to %s: %s in %.3f s %s", self.name, op.kind, op.rec.ranges, op.peer, op.rec.phase,
                 op.rec.timings["total_s"], op.rec.error)

    def _publish(self, reg: Registry, op: Op) -> None:
        op.rec.updated = time.time()
        op.rec.total = max(op.rec.total, op.rec.done)  # tombstones travel too; total counted live keys
        reg.put_op(self.service.name, op.rec, lease=self.lease or None)

    def _ask(self, dealer: zmq.Socket, env: Envelope, timeout: float = ACK_TIMEOUT) -> Envelope:
        peer = self.op.peer if self.op is not None else "?"
        env.id = self._id()
        env.sender = self.name
        dealer.send_multipart(env.frames())
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if dealer.poll(left * 1000, zmq.POLLIN):
                got = self._recv_env(dealer)
                if got is not None and got.id == env.id:
                    if got.type != "OK":
                        raise StateError(f"peer {peer} refused {env.type}: {got.body.get('error', '?')}")
                    return got
        raise StateError(f"peer {peer} did not answer {env.type} within {timeout:.0f} s (dead or overloaded?)")

    def _check(self, op: Op) -> None:
        if op.cancel.is_set():
            raise _Cancelled()
        if op.failed:
            raise StateError(op.failed)

    def _one_range(self, reg: Registry, dealer: zmq.Socket, op: Op, rng: Range) -> None:
        body = {"lo": rng.lo, "hi": rng.hi, "mode": "mirror" if op.kind == "mirror" else "split"}
        t0 = time.monotonic()
        start_epoch = max(r.epoch for r, _ in reg.ranges(self.service.name) if r.range.overlaps(rng))
        self._ask(dealer, Envelope("BEGIN", body=body))
        try:
            with self.lock:
                self.targets.setdefault(op.peer, []).append(rng)  # from now on writes in rng reach the peer
            op.rec.phase = "copy"
            sent_at = time.monotonic()
            last_pub = 0.0
            chunk = 256 * 1024 if op.throttle <= 0 else max(4096, int(op.throttle * 100))  # ~0.1 s per chunk
            for blob, n in self.backend.snapshot(rng, chunk):
                self._check(op)
                self._ask(dealer, Envelope("CHUNK", body={"lo": rng.lo}, blobs=[blob]))
                op.rec.done += n
                if op.throttle > 0:  # records per second, so serving is not starved
                    op.cancel.wait(max(0.0, sent_at + n / op.throttle - time.monotonic()))
                    sent_at = time.monotonic()
                if time.monotonic() - last_pub > 0.2:
                    last_pub = time.monotonic()
                    self._publish(reg, op)
            self._check(op)
            op.rec.timings.setdefault("copy_s", 0.0)
            op.rec.timings["copy_s"] += round(time.monotonic() - t0, 4)
            op.rec.phase = "flip"
            self._publish(reg, op)
            self._flip(reg, dealer, op, rng, start_epoch)
        except BaseException:
            with self.lock:
                if rng in self.paused:
                    self.paused.remove(rng)
                self._untarget(op.peer, rng)
            try:
                self._ask(dealer, Envelope("ABORT", body=body))
            except StateError as exc:
                log.warning("%s: ABORT to %s unanswered (%s): it aborts by itself when we fall silent",
                            self.name, op.peer, exc)
            raise

    def _flip(self, reg: Registry, dealer: zmq.Socket, op: Op, rng: Range, start_epoch: int) -> None:
        t0 = time.monotonic()
        recs = [r for r, _ in reg.ranges(self.service.name) if r.range.overlaps(rng)]
        parent = recs[0]
        if len(recs) != 1 or parent.epoch != start_epoch and op.kind != "mirror":
            raise StateError(f"range {rng} changed while it was copied (epoch {start_epoch} → "
                             f"{max(r.epoch for r in recs)}): nothing moved; retry")
        if op.kind == "mirror":
            mirrors = sorted(set(parent.mirrors) | {op.peer})
            rev = reg.assign(self.service.name, rng, self.name, expect_epoch=parent.epoch, mirrors=mirrors,
                             helpers=parent.helpers)
            self._ask(dealer, Envelope("COMMIT", body={"lo": rng.lo}))
            with self.lock:  # the peer is in the view's mirrors before it stops being a copy target
                self.refresh(reg)
                self._untarget(op.peer, rng)
        else:
            with self.lock:
                self.paused.append(rng)
            self._quiesce()  # after the batch in progress (if any), no write to rng is in flight
            self._check(op)  # ...and every write before it reached the peer, or the op fails here
            try:
                rev = reg.assign(self.service.name, rng, op.peer, expect_epoch=start_epoch,
                                 mirrors=[m for m in parent.mirrors if m != op.peer], helpers=parent.helpers)
            except Conflict as exc:
                raise StateError(f"the flip lost a race: {exc}") from None
            op.rec.timings["etcd_flip_s"] = round(time.monotonic() - t0, 4)
            self.refresh(reg)
            with self.lock:
                self.paused.remove(rng)
                self._untarget(op.peer, rng)
                held = list(self._paused_frames)
                self._paused_frames.clear()
            try:
                self._ask(dealer, Envelope("COMMIT", body={"lo": rng.lo}))
            except StateError as exc:
                # etcd already names the peer: it commits by itself (it asks etcd when we fall silent).
                log.warning("%s: COMMIT of %s to %s unanswered (%s); etcd names it the owner", self.name, rng,
                            op.peer, exc)
            self._forward_held(held)
            dropped = self.backend.drop(rng)
            log.info("%s: %s now owned by %s (revision %d); %d keys dropped here, %d held requests forwarded",
                     self.name, rng, op.peer, rev, dropped, len(held))
            try:
                reg.coalesce(self.service.name)
            except RegistryError as exc:
                log.info("%s: joining ranges skipped: %s", self.name, exc)
        op.rec.timings["flip_s"] = round(op.rec.timings.get("flip_s", 0.0) + time.monotonic() - t0, 4)
        try:
            op.rec.timings["switches_s"] = round(reg.wait_applied(reg.state_revision(), timeout=5.0), 4)
        except RegistryError as exc:
            log.warning("%s: switches slow to apply the flip: %s", self.name, exc)

    def _untarget(self, peer: str, rng: Range) -> None:
        rngs = self.targets.get(peer, [])
        if rng in rngs:
            rngs.remove(rng)

    def _quiesce(self, timeout: float = 2 * ACK_TIMEOUT) -> None:
        seen, deadline = self.batch_no, time.monotonic() + timeout
        while self.in_batch and self.batch_no == seen:
            if time.monotonic() > deadline:
                raise StateError(f"the data path stayed inside one batch for {timeout:.0f} s: nothing moved; retry")
            time.sleep(0.0005)

    def _forward_held(self, frames: list[bytes]) -> None:
        # The main thread owns the sockets: hand the frames to it through on_forwarded (it re-classifies them).
        for frame in frames:
            self.on_forwarded(frame, 0)


class _Cancelled(Exception):
    pass
