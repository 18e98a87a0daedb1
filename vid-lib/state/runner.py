"""Runs one state operation: performs the actions of :mod:`vfab.vid.state.machine` in its own thread.

The runner owns the operation's I/O: a ZeroMQ DEALER to the peer, its own etcd
connection, the operation's record in etcd (``/vfab/v1/ops/<service>/<op id>``)
and the snapshot stream.  It talks to the endpoint's loop only through
``loop.call`` (executed by the loop at a batch boundary), never by touching the
loop's state.

etcd blips are ridden out: reading the range map is retried for up to
``RIDE_OUT`` s; progress records are best effort, written by a thread of their
own (:class:`ProgressWriter`) so no etcd round trip of theirs delays the
operation; the final record is retried until etcd takes it, so an operation
never stays "running" in etcd after it ended.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import zmq

from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import Conflict, RegistryError
from vfab.vid.registry import Registry, schema
from vfab.vid.state import machine as m

if TYPE_CHECKING:
    from vfab.vid.state.hosting import OperationHost

log = logging.getLogger("vfab.state.runner")

ACK_TIMEOUT = 3.0        # s for the peer to answer a control message
SYNC_TIMEOUT = 60.0      # s for the peer to finish a copy (drop what an earlier copy left, fsync)
RIDE_OUT = 10.0          # s an operation waits for etcd to come back before giving up
ETCD_TIMEOUT = 2.0       # s per etcd request of an operation: several tries fit in RIDE_OUT (5 s fitted two)
WINDOW = 4               # snapshot chunks in flight
CHUNK_BYTES = 128 * 1024  # the peer's loop applies one chunk per pass (~1 ms): replicated writes wait no longer
FINAL_RETRY = 120.0      # s the final record of an operation is retried
KEEP_OPS = 3             # finished op records kept per endpoint


class OpRunner:
    def __init__(self, loop: "OperationHost", kind: str, peer: str, ranges: list, throttle: float, op_id: str,
                 name: str = ""):
        self.loop = loop
        self.kind, self.peer, self.ranges, self.throttle = kind, peer, ranges, throttle
        self.id = op_id
        self.cancel = threading.Event()
        self.failed = ""          # set by the loop when a replication to the peer failed
        self.rec = schema.OpRec(op=name or kind, source=loop.name, peer=peer, ranges=[[r.lo, r.hi] for r in ranges],
                                id=op_id, started=time.time(), updated=time.time())
        self.key = schema.op_key(loop.service.name, op_id)   # where the record lives in etcd
        self._next_id = 0
        self.reg: Registry | None = None
        self.dealer: zmq.Socket | None = None
        self.progress: ProgressWriter | None = None
        self.phase_since = time.monotonic()   # when rec.phase last changed (vfab_state_op_phase_age_seconds)

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._run, name=f"op-{self.id}", daemon=True).start()

    def _run(self) -> None:
        self.reg = Registry(self.loop.etcd, timeout=ETCD_TIMEOUT)
        self.dealer = self.loop.zctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.loop.view.endpoints[self.peer].ctl)
        self.progress = ProgressWriter(self.loop.etcd, self.key, lambda: self.loop.lease.id or None)
        try:
            self.rec.total = sum(self.loop.backend.count(r) for r in self.ranges)
            self._publish()   # the record exists before anything moves (the balancer and 'vfab' read it)
            gen = m.operation(self.kind, self.loop.name, self.peer, self.ranges, time.monotonic())
            outcome = self._drive(gen)
        except Exception as exc:  # a bug: still end the op visibly
            log.exception("%s: %s %s crashed", self.loop.name, self.kind, self.id)
            outcome = m.Outcome("failed", f"internal error: {exc!r}")
        self.rec.phase, self.rec.error = outcome.phase, outcome.error
        self.rec.notes = list(outcome.notes)
        self.rec.timings.update(outcome.timings)
        self.rec.total = max(self.rec.total, self.rec.done)
        self.loop.call(lambda: self.loop.op_ended(self))  # before anyone can see it ended (a BEGIN may follow)
        self.progress.close()   # no progress write may land after the final record
        self._publish_final()
        hooks = getattr(self.loop, "metrics", None)
        if hooks is not None:
            hooks.op_ended(self.rec)
        self.loop.call(lambda: self.loop.op_recorded(self.id))
        self._prune_old_records()
        log.info("%s: %s %s of %s to %s: %s in %.3f s %s %s", self.loop.name, self.kind, self.id, self.rec.ranges,
                 self.peer, self.rec.phase, self.rec.timings.get("total_s", 0), self.rec.error,
                 "; ".join(self.rec.notes))
        self.dealer.close(0)
        self.reg.close()

    def _drive(self, gen: m.Gen) -> m.Outcome:
        action = gen.send(None)
        while True:
            value = self._perform(action)
            try:
                action = gen.send(m.Result(time.monotonic(), value))
            except StopIteration as stop:
                return stop.value

    def _perform(self, a):
        if isinstance(a, m.Now):
            return None
        if isinstance(a, m.Publish):
            if "phase" in a.fields:
                if a.fields["phase"] != self.rec.phase:
                    self.phase_since = time.monotonic()
                self.rec.phase = a.fields["phase"]
            self._progress()
            return None
        if isinstance(a, m.ReadRanges):
            return self._read_ranges()
        if isinstance(a, m.Ask):
            return self._ask(a.type, a.body)
        if isinstance(a, m.Copy):
            return self._copy(a.rng)
        if isinstance(a, m.LoopCmd):
            return self.loop.call(lambda: self.loop.op_command(self, a.cmd, a.rng, a.to, a.rec, a.revision))
        if isinstance(a, m.Assign):
            return self._assign(a)
        if isinstance(a, m.Drop):
            return self.loop.call(lambda: self.loop.forget(a.rng))  # dropped in the background, in steps
        if isinstance(a, m.Coalesce):
            try:
                self.reg.coalesce(self.loop.service.name)
            except RegistryError as exc:
                log.info("%s: joining ranges skipped: %s", self.loop.name, exc)
            return None
        raise TypeError(f"unknown action {a!r}")

    # -- etcd -----------------------------------------------------------------------------------
    def _read_ranges(self):
        t0 = time.monotonic()
        down = False
        while True:
            try:
                recs = [r for r, _ in self.reg.ranges(self.loop.service.name)]
                if down:
                    log.warning("%s: %s: etcd is back after %.1f s; going on", self.loop.name, self.id,
                                time.monotonic() - t0)
                return recs
            except RegistryError as exc:
                if time.monotonic() - t0 > RIDE_OUT:
                    return m.Failure("etcd", f"{exc} (for {RIDE_OUT:.0f} s)")
                if not down:
                    log.warning("%s: %s: %s; waiting up to %.0f s for it", self.loop.name, self.id, exc, RIDE_OUT)
                    down = True
                # the peer gives a silent source up after INCOMING_IDLE s: tell it we live and wait for etcd
                self._send("ALIVE", {"los": [r.lo for r in self.ranges]})
                if self.cancel.wait(0.25):
                    return m.Failure("cancelled", "cancelled")

    def _assign(self, a: m.Assign):
        try:
            return self.reg.assign(self.loop.service.name, a.rng, a.owner, expect_epoch=a.expect_epoch,
                                   mirrors=a.mirrors, helpers=a.helpers)
        except Conflict as exc:
            return m.Failure("conflict", str(exc))
        except RegistryError as exc:
            return m.Failure("etcd", str(exc))

    def _progress(self) -> None:
        """Publish the record as it is now, off the operation's path (best effort, newest wins)."""
        self.rec.updated = time.time()
        self.progress.post(self.rec.to_json())

    def _publish(self) -> None:
        """Create the record (at the start, and again under a new lease when the old one expired and took the
        record with it); create-only, so were etcd to apply it late (sent while etcd hung) it cannot
        overwrite a later one."""
        self.rec.updated = time.time()
        try:
            ok, rev = self.reg.txn([self.reg.cmp_mod(self.key, 0)], {self.key: self.rec.to_json()},
                                   lease=self.loop.lease.id or None)
            if ok:
                self.progress.written(rev)
        except RegistryError as exc:
            log.debug("%s: progress of %s not published: %s", self.loop.name, self.id, exc)

    def _publish_final(self) -> None:
        deadline = time.monotonic() + FINAL_RETRY
        delay = 0.1
        while True:
            self.rec.updated = time.time()
            try:
                # Unconditional, so it wins over any progress write etcd applies late (those compare the
                # revision they last saw), and under no lease: the outcome stays when the endpoint's lease
                # expired meanwhile (etcd hung past it), until the source's next operations prune it.
                self.reg.put(self.key, self.rec.to_json())
                return
            except RegistryError as exc:
                if time.monotonic() > deadline:
                    log.error("%s: the end of %s (%s) could not be written to etcd for %.0f s: %s", self.loop.name,
                              self.id, self.rec.phase, FINAL_RETRY, exc)
                    return
                log.warning("%s: writing the end of %s: %s; retrying", self.loop.name, self.id, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _prune_old_records(self) -> None:
        try:
            mine = [o for o in self.reg.ops(self.loop.service.name) if o.source == self.loop.name and o.finished]
            for old in sorted(mine, key=lambda o: o.started)[:-KEEP_OPS or None]:
                self.reg.delete(schema.op_key(self.loop.service.name, old.id))
        except RegistryError as exc:
            log.debug("%s: old op records kept: %s", self.loop.name, exc)

    # -- the peer -------------------------------------------------------------------------------
    def _send(self, type: str, body: dict, blobs: list[bytes] = ()) -> int:
        self._next_id += 1
        env = Envelope(type, self.loop.name, id=self._next_id, body=body, blobs=list(blobs))
        self.dealer.send_multipart(env.frames())
        return self._next_id

    def _recv(self, timeout: float) -> Envelope | None:
        if not self.dealer.poll(timeout * 1000, zmq.POLLIN):
            return None
        try:
            return decode(self.dealer.recv_multipart())
        except EnvelopeError:
            return None

    def _ask(self, type: str, body: dict):
        rid = self._send(type, body)
        timeout = SYNC_TIMEOUT if type == "SYNC" else ACK_TIMEOUT
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self._recv(left)
            if got is not None and got.id == rid:
                if got.type != "OK":
                    return m.Failure("peer", f"{self.peer} refused {type}: {got.body.get('error', '?')}")
                return got.body
        return m.Failure("peer", f"{self.peer} did not answer {type} within {timeout:.0f} s (dead or overloaded?)")

    def _copy(self, rng):
        """Stream the snapshot with up to WINDOW chunks in flight; returns records sent or a Failure."""
        chunk = CHUNK_BYTES if self.throttle <= 0 else max(4096, int(self.throttle * 100))
        waiting: dict[int, int] = {}
        sent_at = time.monotonic()
        last_pub = time.monotonic()
        total = 0

        def drain(block: bool):
            while waiting:
                got = self._recv(ACK_TIMEOUT if block else 0)
                if got is None:
                    if block:
                        return m.Failure("peer", f"{self.peer} did not acknowledge a chunk within {ACK_TIMEOUT:.0f} s")
                    return None
                n = waiting.pop(got.id, None)
                if n is None:
                    continue
                if got.type != "OK":
                    return m.Failure("peer", f"{self.peer} could not store the copy: {got.body.get('error', '?')}")
                self.rec.done += n
                if not block:
                    continue
                if len(waiting) < WINDOW:
                    return None
            return None

        for blob, n in self.loop.backend.snapshot(rng, chunk):
            if self.cancel.is_set():
                return m.Failure("cancelled", "cancelled")
            if self.failed:
                return m.Failure("replication", self.failed)
            waiting[self._send("CHUNK", {"lo": rng.lo}, [blob])] = n
            total += n
            bad = drain(block=len(waiting) >= WINDOW)
            if bad is not None:
                return bad
            if self.throttle > 0:  # records per second, so serving is not starved
                if self.cancel.wait(max(0.0, sent_at + n / self.throttle - time.monotonic())):
                    return m.Failure("cancelled", "cancelled")
                sent_at = time.monotonic()
            if time.monotonic() - last_pub > 0.2:
                last_pub = time.monotonic()
                self._progress()
        while waiting:
            bad = drain(block=True)
            if bad is not None:
                return bad
        if self.failed:
            return m.Failure("replication", self.failed)
        return total


class ProgressWriter:
    """Writes an operation's progress records to etcd on a thread of its own, newest first.

    Each write is an etcd round trip (2-4 ms, as much again with etcd busy): three of them per range sat
    on the operation's path, between the copy and the flip among others (``bench/kvs_ops.py``).  Only
    the newest record waiting is written.  A write may land after the final record (one under way at
    :meth:`close`, or one etcd answered too late for the client and applied later): each write therefore
    compares the record's mod-revision with the one it last saw (a transaction), a revision learnt before
    the final record was sent, so once the final record is in, such a write changes nothing.  Hence
    :meth:`close` need not wait for the write under way (an etcd round trip off every operation's end).
    """

    def __init__(self, endpoint: str, key: str, lease_id):
        self.key = key
        self.lease_id = lease_id              # () -> the endpoint's lease now (it may be granted anew)
        self._reg = Registry(endpoint)
        self._cv = threading.Condition()
        self._waiting: str | None = None
        self._closed = False
        self._rev: int | None = None          # the record's mod-revision as last written; None: read it first
        self._thread = threading.Thread(target=self._run, name="op-progress", daemon=True)
        self._thread.start()

    def written(self, rev: int) -> None:
        """The record was (first) written at ``rev`` by someone else (the runner)."""
        with self._cv:
            self._rev = rev

    def post(self, record: str) -> None:
        with self._cv:
            if not self._closed:
                self._waiting = record
                self._cv.notify()

    def close(self) -> None:
        """No write starts after this returns (one under way may still land: see the class)."""
        with self._cv:
            self._closed = True
            self._waiting = None
            self._cv.notify()

    def _run(self) -> None:
        try:
            self._write_newest()
        finally:
            self._reg.close()

    def _write_newest(self) -> None:
        while True:
            with self._cv:
                while self._waiting is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                record, self._waiting = self._waiting, None
                rev = self._rev
            try:
                if rev is None:
                    got = self._reg.get(self.key)
                    rev = got[1] if got else 0
                    with self._cv:
                        if self._closed:   # the final record may be in already, and this its revision
                            return
                ok, new = self._reg.txn([self._reg.cmp_mod(self.key, rev)], {self.key: record},
                                        lease=self.lease_id())
                rev = new if ok else None   # not ok: somebody wrote it (a late write of ours): read it again
            except RegistryError as exc:
                rev = None                  # the write may still land: read the revision before the next
                log.debug("progress of %s not published: %s", self.key, exc)
            with self._cv:
                self._rev = rev
