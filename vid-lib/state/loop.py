"""The loop of a stateful endpoint: one thread owns the data port, the control socket and every table.

A service gives it a :class:`~vfab.vid.state.backend.Backend`; the loop does
the rest (DESIGN.md §5; twemproxy's protocol-agnostic core and DPDK l2fwd's
loop are the models)::

    poll(data port, control ROUTER, peer DEALERs, wake-up fd)
      control message  → apply/buffer/commit/abort/forward/start an operation
      REPL acks        → when a batch's writes are on every mirror and copy: send its replies
      at a batch boundary (no batch waiting for acks):
        calls          → what other threads asked (pause, release, a new view, ...)
        batch          → up to BATCH frames: classify by VID key, serve / hold / forward / ignore,
                         handle_batch (one durable step), replicate, reply

Nothing else touches these tables: the operation thread (:mod:`.runner`), the
view watcher, the lease keeper and the housekeeper talk to the loop through
:meth:`EndpointLoop.call`, which runs a function here between batches — so a
pause is quiescent by construction, and a released request is served at once
(no poll timeout to wait out).

Replies leave from the VID that was asked (port security lets only the
range's owner source it), so a client can tell a real reply from a forged one.
An owner serves only while its lease is known to be alive
(:mod:`.lease`): stopped past its TTL it holds requests until it has
registered again and re-read the range map, then serves those of ranges still
its own and drops the others, never forwarding them as if fresh (their clients
have retried at the new owner: issue 42).  A forward carries the epoch it was
routed by, and an owner refuses one older than its own (replication.py).
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import secrets
import socket
import sys
import threading
import time

import zmq

from vfab.vid import codec
from vfab.vid.api import service_blocks
from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import FrameError, StateError, VfabError
from vfab.vid.frame import Frame, FrameType, pack, parse
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema
from vfab.vid.state import machine
from vfab.vid.state.backend import Backend, BackendError, BadRequest, Refusal, Request
from vfab.vid.state.faillog import FailureLog
from vfab.vid.state.housekeeper import Housekeeper
from vfab.vid.state.lease import EndpointLease
from vfab.vid.state.sched import RunDelay
from vfab.vid.state.peer import INCOMING_IDLE, Incoming, PeerSide
from vfab.vid.state.replication import Inflight, Replication
from vfab.vid.state.runner import OpRunner
from vfab.vid.state.view import View, ViewWatcher, read_view
from vfab.vid.transport import RawPort

log = logging.getLogger("vfab.state.loop")

BATCH = 64
TICK = 0.05              # s between timer checks while something is timed (fenced requests, incoming copies)
CLOSE_WAIT = 10.0        # s close() waits for the loop's thread to leave serve()
IDLE_WAIT = 1.0          # s an idle loop with nothing timed sleeps (frames, control and calls wake it at once)
# The loop gives up the GIL at every socket or SQLite call and must win it back each time; while an
# operation's thread is busy packing a snapshot, Python's default 5 ms switch interval made every such
# handover wait up to 5 ms (several per batch).  The process serves requests: hand over sooner.
SWITCH_INTERVAL = 0.0005
STALL = 0.02             # s: a pass of the loop that ran longer held every request behind it that long
REPLAY_KEPT = 4096       # mirrored requests kept for a takeover replay (backends that ask for it)
GROUP_HOLD = 0.002       # s: group commit fsyncs once the port is drained, or once a reply has waited this long
# batches served while earlier ones wait for their peers' acks (replies leave in order): a request that comes
# during one wait no longer waits for it and then for its own (a 100k-key copy's client latency, issue 7)
PIPELINE = 4


class _Call:
    def __init__(self, fn):
        self.fn = fn
        self.done = threading.Event()
        self.result = None
        self.exc: BaseException | None = None


class EndpointLoop(PeerSide, Replication):
    def __init__(self, registry: Registry, service: str, name: str, iface: str, backend: Backend,
                 rx: str = "ovs", netns: str | None = None, ttl: int = 3, batch: int = BATCH,
                 bind: str = "tcp://127.0.0.1:*"):
        schema.check_name("endpoint", name)
        self.registry = registry
        self.etcd = registry.endpoint
        self.service = registry.service(service)
        self.layout = codec.Layout.parse(self.service.layout)
        self.name = name
        self.backend = backend
        self.batch_max = batch
        self.zctx = zmq.Context.instance()
        self.router = self.zctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(bind)
        self.ctl = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.lease = EndpointLease(self.etcd, ttl, name)
        self.port = RawPort(iface, rx, netns=netns)
        self.endpoint = schema.Endpoint(service=service, name=name, mac=self.port.mac_str, rx=rx,
                                        host=socket.gethostname(), ctl=self.ctl)
        try:
            self.registry.announce(self.endpoint, ttl, lease=self.lease.grant())
        except BaseException:
            self.port.close()
            self.router.close(0)
            raise
        self.view: View = read_view(registry, service)
        self.view_generation = self.lease.generation
        self.min_revision = 0
        self.pending: collections.deque = collections.deque()   # (raw, hops) to (re)classify
        self.paused: dict[int, tuple[Range, list]] = {}
        self.incoming: dict[int, Incoming] = {}
        self.fenced: list = []   # (raw, hops, vk, epoch of its range when it came): held while not authoritative
        # The view before a map that came while this endpoint had no authority (its lease lapsed, or was just
        # granted anew), until the port has been read empty once: what waits in it came meanwhile, routed by
        # that view (_came_while_away)
        self.away: View | None = None
        self.targets: dict[str, list[Range]] = {}
        self.op: OpRunner | None = None
        self.ending: set[str] = set()   # (loop thread) ops ended whose final record is still being written
        # Batches whose replies wait for their peers' acks, in the order they were served (replication.py);
        # with group commit one at a time (its disk wait keeps the order), else up to PIPELINE.
        self.inflights: collections.deque[Inflight] = collections.deque()
        self._verdicts: dict[str, tuple[bool, int]] = {}   # peer -> (still safe, the last batch queued when it failed)
        self.dealers: dict[str, zmq.Socket] = {}
        self.calls: collections.deque = collections.deque()
        self.chunks: collections.deque = collections.deque()    # (ident, CHUNK envelope) not yet applied
        self.pending_drops: list[Range] = []
        self.drops_due = 0.0   # monotonic time before which no old copy is dropped (peer.forget)
        self.rates: dict[int, int] = {}
        self.counters: collections.Counter = collections.Counter()
        self.batch_failures = FailureLog(log, "a batch")
        # A backend whose requests may be served twice (DHCP: an ACK again is an ACK) asks for a takeover
        # replay: as a mirror, the requests it ignored for the owner in the last REPLAY window are served again
        # when it takes the range over from a dead owner (which may never have answered them).
        self.replay_window = ttl + 2.0 if getattr(backend, "replay_on_takeover", False) else 0.0
        self.mirrored: collections.deque = collections.deque(maxlen=REPLAY_KEPT)  # (monotonic, vk, raw)
        # Group commit (a backend that asks for it): a batch commits without waiting for the disk and its
        # replies wait here, in order, while the loop goes on reading and committing whatever the port holds;
        # once the port is drained (or a reply has waited GROUP_HOLD) one fsync makes them all durable and
        # they go.  (batch number, needs the disk, [(frame, vk, payload, wrote)]).
        self.group_commit = bool(getattr(backend, "group_commit", False))
        if self.group_commit:
            backend.defer_sync = True
        # A backend whose replies that needed no disk promise nothing a crash could take back (sdhcp's OFFERs)
        # sets ``ordered_replies = False``: those leave at once instead of queueing behind earlier batches' fsync.
        self.ordered_replies = bool(getattr(backend, "ordered_replies", True))
        self.pipeline = 1 if self.group_commit else PIPELINE
        self.disk_wait: collections.deque = collections.deque()
        self.batch_seq = 0       # batches that went through group commit, numbered
        self.synced_upto = 0     # the newest of them an fsync covered
        self.unsynced_since = 0.0  # when the oldest batch still waiting for the disk committed (0: none waits)
        self.sync_failures = FailureLog(log, "fsync of the store (its writes are not acknowledged; answered "
                                             "'unavailable' where the protocol has such an answer)")
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._wakefd = os.eventfd(0, os.EFD_NONBLOCK)
        self._stopping = threading.Event()
        self._served = threading.Event()   # serve() has returned: its sockets may be closed
        self._gave_up = False              # leave_serve() waited in vain
        self._last_timers = 0.0
        self._last_stall_log = 0.0
        self._run_delay: RunDelay | None = None   # the serving thread's wait for a core (serve opens it)
        self.watcher = ViewWatcher(self.etcd, service, self._on_view)
        self.housekeeper = Housekeeper(self)
        self.lease.on_renewed.append(self._renewed)
        self._refilter()
        dropped = self.backend.keep_only([r.range for r in self.view.held_by(name)])
        if dropped:
            log.warning("%s: dropped %d records of ranges this endpoint no longer holds (left by a crash)", name,
                        dropped)

    # -- other threads' door ----------------------------------------------------------------------
    def call(self, fn, wait: bool = True, timeout: float = 10.0):
        """Run ``fn()`` on the loop's thread at the next batch boundary; its result (or exception)."""
        if threading.current_thread() is self._thread or self._thread is None:
            return fn()
        if self._stopping.is_set():
            return machine.Failure("loop", f"endpoint {self.name} is shutting down")
        box = _Call(fn)
        self.calls.append(box)
        try:
            os.eventfd_write(self._wakefd, 1)
        except OSError:  # closed under us: shutting down
            return machine.Failure("loop", f"endpoint {self.name} is shutting down")
        if not wait:
            return None
        if not box.done.wait(timeout):
            return machine.Failure("loop", f"the endpoint's loop did not answer within {timeout:.0f} s")
        if box.exc is not None:
            raise box.exc
        return box.result

    def _on_view(self, view: View) -> None:
        self.call(lambda: self._set_view(view), wait=False)

    def _set_view(self, view: View, generation: int | None = None) -> None:
        if view.revision < self.min_revision:
            # Older than our own last write (a late watch event).  If it is the map a renewed lease read, we
            # committed something after that read: read it again, or we would never serve again (seen with
            # etcd SIGSTOPped during a split: the peer registered again, then its COMMIT came in).
            if generation is not None:
                self.housekeeper.reread(generation)
            return
        old = self.view
        self.view = view
        if self.away is None and (not self._authoritative() or generation not in (None, self.view_generation)):
            self.away = old   # a map that comes while (or as) authority is regained: see _came_while_away
        if generation is not None:
            self.view_generation = generation
        if [r.range for r in old.held_by(self.name)] != [r.range for r in view.held_by(self.name)]:
            self._refilter()
        self.housekeeper.wake()

    def _patch(self, rec: schema.RangeRec, revision: int) -> None:
        self.view = self.view.patched(rec)
        self.min_revision = max(self.min_revision, revision)
        self._refilter()

    def took_over(self, rec: schema.RangeRec, revision: int) -> None:
        """(loop thread) This mirror now owns ``rec`` (its owner died): serve, in order, the requests of its
        range that the owner got in the replay window and may never have answered (replay backends only)."""
        self._patch(rec, revision)
        if not self.replay_window:
            return
        cutoff = time.monotonic() - self.replay_window
        again = [(raw, 0) for t, vk, raw in self.mirrored if t >= cutoff and vk in rec.range]
        self.mirrored = collections.deque(((t, vk, raw) for t, vk, raw in self.mirrored
                                           if t >= cutoff and vk not in rec.range), maxlen=REPLAY_KEPT)
        if again:
            self.pending.extend(again)
            self.counters["replayed"] += len(again)
            log.warning("%s: serving again %d request(s) of %s that its dead owner got in the last %.0f s",
                        self.name, len(again), rec.range, self.replay_window)

    def _renewed(self, lease_id: int) -> None:
        """(lease thread) The lease expired while we were away: put our records back, re-read the map."""
        reg = self.lease.reg
        reg.announce(self.endpoint, self.lease.ttl, allow_shared=True, lease=lease_id)
        op = self.op
        if op is not None:
            op._publish()
        view = read_view(reg, self.service.name)
        gen = self.lease.generation
        self.call(lambda: self._set_view(view, generation=gen), wait=False)

    def _refilter(self) -> None:
        """rx=bpf/promisc: receive the VIDs of every range we own or mirror (rx=ovs needs nothing)."""
        mine = [r.range for r in self.view.held_by(self.name)] + [i.range for i in self.incoming.values()]
        self.port.set_blocks([b for r in mine for b in service_blocks(self.service, r)])

    # -- the loop -------------------------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Serve on this thread until ``stop`` is set or ``close`` (from any thread) asks it to end."""
        self._thread = threading.current_thread()
        try:
            self._serve(stop)
        finally:
            self._served.set()

    def _serve(self, stop: threading.Event) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL)
        # What start-up made (modules, the registry client, tables) lives as long as the process: out of the
        # collector's scans, so a full collection (~17 ms over them here, more on a busy machine, every
        # thread stopped) never lands in the middle of serving.
        gc.collect()
        gc.freeze()
        self.lease.start()
        self.watcher.start()
        self.housekeeper.start()
        idle = zmq.Poller()
        busy = zmq.Poller()
        for p in (idle, busy):
            p.register(self.router, zmq.POLLIN)
            p.register(self._wakefd, zmq.POLLIN)
        idle.register(self.port.fileno(), zmq.POLLIN)
        self._pollers = (idle, busy)
        self._run_delay = RunDelay()   # this thread's: where a long pass's time went
        log.info("%s: serving %s on %s (ctl %s, lease %x)", self.name, self.service.name, self.port.iface, self.ctl,
                 self.lease.id)
        q_end = self._queued()
        while not stop.is_set() and not self._stopping.is_set():
            waiting, serving = bool(self.inflights), self._may_batch()
            if (self.pending and serving) or (self.calls and not waiting):
                timeout = 0.0
            elif self.fenced or self.incoming:
                timeout = TICK
            else:
                timeout = IDLE_WAIT  # waking 20 times a second cost an idle shard 3.5 ms of CPU per second (0.5 at 1 s)
            if waiting:
                timeout = min(timeout, max(0.0, self.inflights[0].deadline - time.monotonic()))
            if self.chunks:
                timeout = 0.0
            events = dict((idle if serving else busy).poll(timeout * 1000))
            if self._wakefd in events:
                try:
                    os.eventfd_read(self._wakefd)
                except BlockingIOError:
                    pass
            t0, c0, q0, d0 = time.perf_counter(), time.thread_time(), self._queued(), self._disk()
            if q0 - q_end > STALL and events:
                self._woke_late(q0 - q_end)
            if self.router in events:
                self._serve_ctl()
            for sock in [s for s in self.dealers.values() if s in events]:
                self._dealer_in(sock)
            t1 = time.perf_counter()
            if self.chunks:
                self._control_reply(*self.chunks.popleft())
            t2 = time.perf_counter()
            if self.inflights and time.monotonic() >= self.inflights[0].deadline:
                self.inflights[0].done = True   # its silent peers are failed as it leaves
                self._release()
            self._run_calls()
            self._timers()
            t3 = time.perf_counter()
            if self._may_batch():
                self._batch()
            t4 = time.perf_counter()
            q_end = self._queued()
            if t4 - t0 > STALL:
                self._stalled(t4 - t0, {"control": t1 - t0, "chunk": t2 - t1, "calls": t3 - t2, "batch": t4 - t3},
                              time.thread_time() - c0, q_end - q0, self._disk() - d0)
        if self.disk_wait:
            self._sync_now()   # stopping: what committed and waits for the disk is answered, not dropped

    def _queued(self) -> float:
        """s this thread has waited for a CPU (runnable, not running) since it started; 0 if unknown."""
        return self._run_delay() if self._run_delay is not None else 0.0

    def _disk(self) -> float:
        fn = getattr(self.backend, "disk_seconds", None)
        return fn() if fn is not None else 0.0

    def _woke_late(self, late: float) -> None:
        """The loop's thread waited ``late`` s for a CPU after what woke it arrived (``stall_wakeup``): the
        requests it then served waited as long, though no pass of the loop was long."""
        self.counters["stall_wakeup"] += 1
        longest = round(late * 1e3) > self.counters["stall_wakeup_max_ms"]
        self.counters["stall_wakeup_max_ms"] = max(self.counters["stall_wakeup_max_ms"], round(late * 1e3))
        now = time.monotonic()
        if longest or now - self._last_stall_log >= 1.0:
            self._last_stall_log = now
            log.info("%s: the loop got a CPU %.0f ms after its requests woke it (the machine's cores were busy)%s; "
                     "they waited as long", self.name, late * 1e3, ", the longest yet" if longest else "")

    def _stalled(self, took: float, parts: dict[str, float], cpu: float = 0.0, queued: float = 0.0,
                 disk: float = 0.0) -> None:
        """Count a long pass by what took longest (``stall_<part>`` in STATS) and by where its time went
        (``stall_on_cpu``: running; ``stall_no_cpu``: runnable, waiting for a CPU; ``stall_disk``: blocked
        while the store committed or synced; ``stall_blocked``: blocked otherwise, on the GIL or a lock),
        logged at most once a second, and always when it is the longest yet."""
        part = max(parts, key=parts.get)
        self.counters[f"stall_{part}"] += 1
        longest = round(took * 1e3) > self.counters["stall_max_ms"]
        self.counters["stall_max_ms"] = max(self.counters["stall_max_ms"], round(took * 1e3))
        blocked = max(0.0, took - cpu - queued)
        on_disk = min(blocked, disk)   # a commit's own running and waiting for a CPU are counted above
        where = {"on_cpu": cpu, "no_cpu": queued, "disk": on_disk, "blocked": blocked - on_disk}
        self.counters[f"stall_{max(where, key=where.get)}"] += 1
        now = time.monotonic()
        if longest or now - self._last_stall_log >= 1.0:
            self._last_stall_log = now
            log.info("%s: one pass of the loop took %.0f ms (%s; running %.0f ms, waiting for a CPU %.0f ms, "
                     "blocked %.0f ms in commits and syncs (the disk) and %.0f ms otherwise (the GIL, a lock))%s; "
                     "requests behind it waited as long", self.name, took * 1e3,
                     ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts.items() if v >= 0.001),
                     cpu * 1e3, queued * 1e3, on_disk * 1e3, where["blocked"] * 1e3,
                     ", the longest yet" if longest else "")

    def _count_wait(self, what: str, took: float) -> None:
        """A wait that held replies without holding the loop: the group fsync (``sync``), a batch's wait for
        its peers' acks of its replicated writes and for the batches before it (``repl_wait``; later batches
        are served meanwhile, up to ``pipeline``, their replies queued behind).  Counted in STATS as the longest
        (``<what>_max_ms``) and how many took over STALL (``<what>_slow``); no long pass shows them."""
        ms = round(took * 1e3)
        if ms > self.counters[f"{what}_max_ms"]:
            self.counters[f"{what}_max_ms"] = ms
        if took > STALL:
            self.counters[f"{what}_slow"] += 1

    def _may_batch(self) -> bool:
        """Serve a batch now: always when none waits for its peers; while some do, up to ``pipeline`` of
        them, unless a call waits (it runs between batches, none in flight: no new one is served first)."""
        return not self.inflights or len(self.inflights) < self.pipeline and not self.calls

    def _run_calls(self) -> None:
        while self.calls and not self.inflights:
            box = self.calls.popleft()
            try:
                box.result = box.fn()
            except BaseException as exc:  # handed to the caller
                box.exc = exc
            box.done.set()

    def _timers(self) -> None:
        now = time.monotonic()
        if now - self._last_timers < TICK:
            return
        self._last_timers = now
        if self.fenced and self._authoritative():
            self._unfence()
        for inc in [i for i in self.incoming.values() if now - i.seen > INCOMING_IDLE]:
            self._silent_source(inc)

    def _authoritative(self) -> bool:
        return self.lease.valid and self.view_generation == self.lease.generation

    def _unfence(self) -> None:
        """Authority is back: serve what was held while it lapsed, for ranges still ours; drop the rest.

        A request held here while this endpoint was stopped or cut off came under an epoch that is over
        once its range was taken over (or moved) meanwhile: its client has retried to the new owner since,
        and may have its answer and gone on.  Forwarded now it would arrive as if fresh (issue 42), so it is
        dropped here (and a new owner refuses a forward stamped with an older epoch than its own: _fwd_in).
        """
        stale: dict[tuple[int, int, str], int] = {}
        for raw, hops, vk, epoch in self.fenced:
            rec = self.view.find(vk)
            if rec is not None and rec.owner == self.name:
                self.pending.append((raw, hops))
            else:
                k = (epoch, rec.epoch if rec else 0, rec.owner if rec and rec.owner else "nobody")
                stale[k] = stale.get(k, 0) + 1
        self.fenced = []
        for (was, now, owner), n in stale.items():
            self.counters["fenced_dropped"] += n
            log.warning("%s: dropped %d request(s) held while this endpoint had no authority: their range moved on "
                        "(epoch %d, now %d owned by %s); their clients retry there", self.name, n, was, now, owner)

    # -- data ---------------------------------------------------------------------------------------
    def _batch(self) -> None:
        frames = []
        while self.pending and len(frames) < self.batch_max:
            frames.append(self.pending.popleft())
        drained = False
        while len(frames) < self.batch_max:
            got = self.port.recv_raw(0)
            if got is None:
                drained = True
                break
            frames.append((got[0], 0))
        if frames:
            self._handle(frames)
        if drained:
            self.away = None
        if self.unsynced_since and (drained or time.monotonic() - self.unsynced_since >= GROUP_HOLD):
            self._sync_now()

    def _role(self, vk: int, hops: int) -> str:
        for inc in self.incoming.values():
            if inc.mode == "split" and vk in inc.range:
                return "incoming"
        rec = self.view.find(vk)
        if rec is not None and rec.owner == self.name:
            if any(vk in rng for rng, _ in self.paused.values()):
                return "paused"
            return "serve" if self._authoritative() else "fenced"
        if rec is not None and self.name in rec.mirrors and hops == 0:
            return "ignore"  # the owner got it too (mirrored delivery)
        return "forward"

    def _came_while_away(self, vk: int) -> bool:
        """A request from the port, read before it was read empty after the lease came back: routed here by
        the view before (this endpoint owned its range) while this endpoint was stopped or cut off, and its
        range has moved on since.  Dropped, like the requests held while fenced (_unfence): the lease
        keeper can register again and the map can change before the loop reads the port."""
        old, new = self.away.find(vk), self.view.find(vk)
        return old is not None and old.owner == self.name and (new is None or new.owner != self.name)

    def _handle(self, frames: list) -> None:
        reqs: list[Request] = []
        meta: list[Frame] = []
        direct: list = []
        away = 0
        for raw, hops in frames:
            try:
                frame = parse(raw)
            except FrameError:
                self.counters["bad_frames"] += 1
                continue
            if frame.type is not FrameType.REQUEST:
                self.counters["not_requests"] += 1
                continue
            if hops == 0 and self.port.rx != "ovs" and not self.port.accepts(frame.dst):
                continue
            try:
                vk = self.backend.key_of(frame.payload)
            except BadRequest as exc:
                self.counters["bad_requests"] += 1
                direct.append((frame, None, self.backend.error_reply(frame.payload, Refusal.BAD_REQUEST, str(exc))))
                continue
            if self.away is not None and hops == 0 and self._came_while_away(vk):
                away += 1
                continue
            role = self._role(vk, hops)
            if role == "serve":
                reqs.append(Request(frame.payload, vk, frame.src))
                meta.append(frame)
            elif role == "incoming":
                next(i for i in self.incoming.values() if vk in i.range).buffered.append((raw, hops))
                self.counters["held"] += 1
            elif role == "paused":
                next(h for rng, h in self.paused.values() if vk in rng).append((raw, 0))
                self.counters["held"] += 1
            elif role == "fenced":
                self.fenced.append((raw, hops, vk, self.view.find(vk).epoch))
                self.counters["fenced"] += 1
            elif role == "ignore":
                self.counters["mirror_ignored"] += 1
                if self.replay_window:
                    self.mirrored.append((time.monotonic(), vk, raw))
            elif not self._forward(raw, vk, hops):
                self.counters["unroutable"] += 1
                direct.append((frame, vk, self.backend.error_reply(
                    frame.payload, Refusal.WRONG_OWNER,
                    f"{self.name} does not own key {vk:#08x} and cannot reach its owner")))
        if away:
            self.counters["fenced_dropped"] += away
            log.warning("%s: dropped %d request(s) that reached this endpoint while it had no authority, for ranges "
                        "that moved on meanwhile; their clients retry at the new owner", self.name, away)
        for frame, vk, payload in direct:
            self._reply(frame, vk, payload)
        if not reqs:
            return
        try:
            replies, records = self.backend.handle_batch(reqs)
        except BackendError as exc:
            self.batch_failures.failed(self.name, f"{exc} ({len(reqs)} request(s) not served, answered 'unavailable' "
                                                  "where the protocol has such an answer: the clients retry)")
            self.counters["batch_failed"] += 1
            replies = [self.backend.error_reply(r.payload, Refusal.UNAVAILABLE, f"{self.name}: {exc}") for r in reqs]
            records = []
        else:
            if self.batch_failures.failing:
                self.batch_failures.succeeded(self.name)
        for r in reqs:
            rec = self.view.find(r.key)
            if rec is not None:
                self.rates[rec.lo] = self.rates.get(rec.lo, 0) + 1
        written = {vk for vk, _ in records}
        out = [(f, r.key, rep, r.key in written) for f, r, rep in zip(meta, reqs, replies) if rep is not None]
        unsynced = self.group_commit and bool(getattr(self.backend, "batch_unsynced", False))
        self._replicate(out, records, unsynced)

    # -- group commit --------------------------------------------------------------------------------
    def _wait_disk(self, out: list, unsynced: bool) -> None:
        """Keep a batch's replies until the disk holds it (``unsynced``) and every earlier batch's left."""
        self.batch_seq += 1
        self.disk_wait.append((self.batch_seq, unsynced, out))
        if unsynced:
            self.counters["disk_waits"] += 1
            if not self.unsynced_since:
                self.unsynced_since = time.monotonic()
        self._release_synced()

    def _unsynced_replies(self, out: list, error: str) -> None:
        """Answer a batch whose fsync failed: UNAVAILABLE (the client retries), whatever it asked."""
        for frame, vk, _, _ in out:
            self._reply(frame, vk, self.backend.error_reply(
                frame.payload, Refusal.UNAVAILABLE, f"{self.name}: the store could not be synced: {error}"))

    def _release_synced(self, upto: int = 0) -> None:
        self.synced_upto = done = max(upto, self.synced_upto)
        while self.disk_wait and (self.disk_wait[0][0] <= done or not self.disk_wait[0][1]):
            _, _, out = self.disk_wait.popleft()
            for frame, vk, payload, _ in out:
                self._reply(frame, vk, payload)

    def _sync_now(self) -> str:
        """Make every committed batch durable here and now, and send what waited for it; '' or the error
        (then what waited for the disk is answered UNAVAILABLE: the clients retry)."""
        upto, self.unsynced_since = self.batch_seq, 0.0
        self.counters["group_syncs"] += 1
        t0 = time.monotonic()
        try:
            self.backend.sync()
        except BackendError as exc:
            self.sync_failures.failed(self.name, exc)
            self.counters["sync_failed"] += 1
            while self.disk_wait and self.disk_wait[0][0] <= upto:
                self._unsynced_replies(self.disk_wait.popleft()[2], str(exc))
            return str(exc)
        self._count_wait("sync", time.monotonic() - t0)
        if self.sync_failures.failing:
            self.sync_failures.succeeded(self.name)
        self._release_synced(upto)
        return ""

    def _reply(self, frame: Frame, vk: int | None, payload: bytes | None) -> None:
        if payload is None:
            return
        src = codec.packed(self.service.id, vk, self.layout) if vk is not None else self.port.mac
        self.port.send(pack(frame.src, src, FrameType.REPLY, payload, frame.channel, frame.seq, frame.priority))

    # -- control messages -------------------------------------------------------------------------------
    def _serve_ctl(self) -> None:
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
            if env.type == "CHUNK":
                # A copy's chunk (~250 records, 4-20 ms to apply) waits its turn, one per loop pass, so the
                # replicated writes queued behind it (a client is waiting on each) go first.  Safe in any
                # order: a record wins by version and copy generation, never by arrival; the source sends
                # SYNC only once every chunk is acknowledged.
                self.chunks.append((ident, env))
                continue
            self._control_reply(ident, env)

    def _control_reply(self, ident: bytes, env: Envelope) -> None:
        try:
            reply = self._control(env, ident)
        except (VfabError, ValueError, KeyError, TypeError) as exc:
            reply = env.reply("ERR", self.name, error=str(exc))
        except Exception as exc:  # a handler bug must not kill the endpoint
            log.exception("%s: control message %s failed", self.name, env.type)
            reply = env.reply("ERR", self.name, error=f"internal error: {exc!r}")
        if reply is not None:
            self.router.send_multipart([ident, *reply.frames()])

    def _control(self, env: Envelope, ident: bytes = b"") -> Envelope | None:
        t, b = env.type, env.body
        if t in ("REPL", "CHUNK", "SYNC"):
            return self._receive(env, ident)
        if t == "ALIVE":   # a source waiting for etcd: its copies to us are not abandoned (no answer)
            self.source_alive(env.sender, [int(lo) for lo in b.get("los", [])])
            return None
        if t == "FWD":
            self._fwd_in(env)
            return None
        if t == "BEGIN":
            return self._begin(env)
        if t in ("COMMIT", "ABORT"):
            lo = int(b["lo"])
            rec = schema.RangeRec.from_json(b["rec"], "COMMIT") if t == "COMMIT" and b.get("rec") else None
            self._finish_incoming(lo, commit=t == "COMMIT", rec=rec, revision=int(b.get("revision", 0)))
            return env.reply("OK", self.name)
        if t in ("SPLIT", "MOVE", "MIRROR"):
            rng = Range(int(b["lo"]), int(b["hi"])) if "lo" in b else None
            op = self.start_op(t.lower(), str(b.get("peer", "")), rng, float(b.get("throttle", 0)),
                               name="merge" if t == "SPLIT" and b.get("merge") is True else "")
            return env.reply("OK", self.name, op=op.id, ranges=[[r.lo, r.hi] for r in op.ranges])
        if t == "CANCEL":
            op = self.op
            if op is None:
                raise StateError(f"{self.name} runs no operation: nothing to cancel")
            op.cancel.set()
            return env.reply("OK", self.name, op=op.id)
        if t == "PING":   # with the ops whose record is ours to write (an operator's wait asks when it vanished)
            return env.reply("OK", self.name, ops=([self.op.id] if self.op else []) + sorted(self.ending))
        if t == "STATS":
            return env.reply("OK", self.name, counters=dict(self.counters), port=dict(self.port.counters))
        raise StateError(f"unknown control message type {t!r}")

    def take_rates(self) -> dict[int, int]:
        """(loop thread) Requests served per range since the last call."""
        rates, self.rates = self.rates, {}
        return rates

    # -- operations (this endpoint is the source) ------------------------------------------------------------
    def start_op(self, kind: str, peer: str, rng: Range | None, throttle: float = 0.0, name: str = "") -> OpRunner:
        """Start operation ``kind`` (its record says ``name`` if given: a "merge" is a split)."""
        busy = f"a {self.op.rec.op} to {self.op.peer} ({self.op.id})" if self.op is not None else ""
        view = self.view
        if peer not in view.endpoints:
            view = read_view(self.registry, self.service.name)  # the peer may have just started
            self._set_view(view)
        ranges = machine.validate(kind, self.name, peer, rng, self.view.ranges, self.view.endpoints, busy)
        op = OpRunner(self, kind, peer, ranges, throttle, f"{self.name}.{secrets.token_hex(4)}", name)
        self.op = op
        op.start()
        return op

    def op_command(self, op: OpRunner, cmd: str, rng: Range, to: str, rec, revision: int = 0):
        """(loop thread) What an operation asks at a batch boundary; None or a machine.Failure."""
        if cmd == "target":
            self.targets.setdefault(to, []).append(rng)
            return None
        if cmd == "pause":
            if op.failed:
                return machine.Failure("replication", op.failed)
            self.paused[rng.lo] = (rng, [])
            return None
        self._untarget(op.peer, rng)
        if rec is not None:
            self._patch(rec, revision)
        if cmd == "release":
            _, held = self.paused.pop(rng.lo, (rng, []))
            if to:
                for raw, _ in held:
                    if not self._forward(raw, rng.lo, 0):
                        self.pending.append((raw, 0))
            else:
                self.pending.extend(held)
        return None

    def op_ended(self, op: OpRunner) -> None:
        """(loop thread) ``op`` ended; its final record is being written until :meth:`op_recorded`."""
        if self.op is op:
            self.op = None
        self.ending.add(op.id)
        for rng in op.ranges:
            self._untarget(op.peer, rng)

    def op_recorded(self, op_id: str) -> None:
        self.ending.discard(op_id)

    def _untarget(self, peer: str, rng: Range) -> None:
        rngs = self.targets.get(peer, [])
        if rng in rngs:
            rngs.remove(rng)
        if not rngs:
            self.targets.pop(peer, None)

    # -- the end --------------------------------------------------------------------------------------------------
    def leave_serve(self, timeout: float = CLOSE_WAIT) -> bool:
        """(any thread) Make ``serve`` return and wait for it; False if it is still running after ``timeout`` s
        (a pass stuck in a backend).  Closing the loop's sockets from another thread while its own polls them
        is what ZeroMQ does not allow (an assertion aborts the process)."""
        self._stopping.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread() or self._served.is_set():
            return True
        if self._gave_up:
            return False   # waited once already (a subclass's close, then this class's)
        try:
            os.eventfd_write(self._wakefd, 1)
        except OSError:
            pass
        self._gave_up = not self._served.wait(timeout)
        return not self._gave_up

    def close(self) -> None:
        served = self.leave_serve()
        if self.op is not None:
            self.op.cancel.set()
        self.watcher.stop()
        self.housekeeper.stop()
        self.lease.revoke()
        if not served:
            log.warning("%s: the loop's thread did not leave its pass within %.0f s: its sockets are left to the "
                        "process's exit", self.name, CLOSE_WAIT)
            return
        for peer in list(self.dealers):
            self._drop_dealer(peer) if hasattr(self, "_pollers") else self.dealers.pop(peer).close(0)
        self.router.close(0)
        self.port.close()
        os.close(self._wakefd)
        if self._run_delay is not None:
            self._run_delay.close()
        log.info("%s: closed; counters %s, port %s", self.name, dict(self.counters), self.port.counters)
