"""Replication and forwarding for the endpoint's loop (a mixin): REPL to mirrors and copies, FWD to owners.

A served batch whose writes must reach mirrors (durably) or running copies
(under the copy's generation) becomes an :class:`Inflight`: REPL messages go
out on per-peer DEALER sockets and the batch's replies wait for every ack
while the loop keeps serving control messages.  A peer that fails is fenced
off (a mirror is removed from the range in etcd) or fails its copy; when even
that is impossible, or a range the batch wrote to is no longer this endpoint's
in etcd (taken over while it was stopped), the writes are answered UNAVAILABLE.
A mirror's REPL names the epochs of its ranges: a peer that has since taken one
over refuses it (peer.py).  A FWD names the epoch it was routed by: an owner at
a later epoch refuses it (a request the old owner held across the change).

Pipelined (a backend without group commit): while batches wait for their acks
the loop serves up to ``pipeline`` of them, and every batch served meanwhile
(with writes to replicate or none) queues behind them: replies leave in the
order the batches were served, so a reply never tells a client what an earlier
batch wrote before that batch's peers have it.  A batch whose peers could not
be made safe turns every later one in the queue UNAVAILABLE too (they may have
read its writes).  Calls from the operation's thread run only with the queue
empty (no new batch is served while one waits).

Everything here runs on the loop's thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import FrameError, RegistryError
from vfab.vid.frame import parse
from vfab.vid.registry import schema
from vfab.vid.state.backend import BadRequest, Refusal

log = logging.getLogger("vfab.state.loop")

ACK_TIMEOUT = 3.0        # s for a mirror or copy target to acknowledge replicated writes
FWD_HOPS = 4


def _owned(ranges: list | None, vk: int) -> bool:
    return ranges is None or any(vk in r for r in ranges)


@dataclass
class Inflight:
    """A served batch whose writes are on their way to mirrors and copies; its replies wait."""

    replies: list                  # (frame, vk, payload, wrote)
    waiting: dict                  # REPL id -> peer
    deadline: float
    failed: dict = field(default_factory=dict)   # peer -> why
    sent: float = field(default_factory=time.monotonic)
    done: bool = False             # every peer answered (or the deadline passed): may leave once it is first
    seq: int = 0                   # the order it was served in
    tainted: bool = False          # an earlier batch's writes could not be made safe: answer UNAVAILABLE



class Replication:
    """Sending writes and requests to other endpoints; mixed into EndpointLoop."""

    def _replicate(self, out: list, records: list, unsynced: bool = False) -> None:
        # (peer, lo of the copy or None for a mirror) -> blobs; a mirror applies durably, a copy target
        # under its copy's generation (made durable by the SYNC before the flip)
        need: dict[tuple[str, int | None], list] = {}
        epochs: dict[str, dict[str, int]] = {}   # mirror -> {lo: epoch} of the ranges its blobs are of
        for vk, blob in records:
            rec = self.view.find(vk)
            if rec is not None and rec.owner == self.name:
                for m in rec.mirrors:
                    need.setdefault((m, None), []).append(blob)
                    epochs.setdefault(m, {})[str(rec.lo)] = rec.epoch
            for peer, rngs in self.targets.items():
                for r in rngs:
                    if vk in r:
                        need.setdefault((peer, r.lo), []).append(blob)
        for key in [k for k in need if k[0] == self.name]:
            del need[key]
        if not need:
            if unsynced or (self.disk_wait and self.ordered_replies):   # group commit: wait for the disk, in order
                self._wait_disk(out, unsynced)
                return
            if self.inflights:   # earlier batches wait for their peers: these replies leave after theirs
                self.inflights.append(Inflight(out, {}, time.monotonic() + ACK_TIMEOUT, done=True, seq=self._id()))
                return
            for frame, vk, payload, _ in out:
                self._reply(frame, vk, payload)
            return
        if unsynced or self.disk_wait:
            # Replicated writes go out durable here first, as without group commit (and what waited leaves)
            error = self._sync_now()
            if error:
                self._unsynced_replies(out, error)
                return
        fl = Inflight(out, {}, time.monotonic() + ACK_TIMEOUT, seq=self._id())
        self.inflights.append(fl)
        for (peer, lo), blobs in need.items():
            sock = self._dealer(peer)
            if sock is None:
                fl.failed[peer] = "has no control address (not a live endpoint)"
                continue
            rid = self._id()
            # a mirror's: the ranges' epochs as this owner knows them (a mirror that has since taken one over
            # refuses them: PeerSide._receive)
            body = {"durable": True, "epochs": epochs.get(peer, {})} if lo is None else {"durable": False, "lo": lo}
            sock.send_multipart(Envelope("REPL", self.name, id=rid, body=body, blobs=blobs).frames())
            fl.waiting[rid] = peer
            self.counters["repl_sent"] += 1
        if not fl.waiting:
            fl.done = True
            self._release()

    def _dealer_in(self, sock: zmq.Socket) -> None:
        while True:
            try:
                env = decode(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except EnvelopeError:
                continue
            fl = next((f for f in self.inflights if env.id in f.waiting), None)
            if fl is None:
                continue
            peer = fl.waiting.pop(env.id)
            if env.type != "OK":
                fl.failed[peer] = env.body.get("error", "refused the write")
            if not fl.waiting:
                fl.done = True
                self._release()   # may fence the peer off and close this very socket (_peer_failed)
            if sock.closed:
                return

    def _release(self) -> None:
        """Send the replies of the batches at the head of the queue whose peers all answered (or timed out)."""
        while self.inflights and self.inflights[0].done:
            self._finish(self.inflights.popleft())

    def _finish(self, fl: Inflight) -> None:
        self._count_wait("repl_wait", time.monotonic() - fl.sent)
        for peer in set(fl.waiting.values()):
            fl.failed.setdefault(peer, f"did not acknowledge within {ACK_TIMEOUT:.0f} s")
        safe = True
        for peer, why in fl.failed.items():
            # once per failure: the batches already queued when a peer failed fail with it, not again each
            verdict, upto, owned = self._verdicts.get(peer, (True, -1, None))
            if fl.seq > upto:
                verdict, owned = self._peer_failed(peer, why)
                self._verdicts[peer] = (verdict, self.inflights[-1].seq if self.inflights else fl.seq, owned)
            # The fence covers every range this batch acknowledges writes for, not only those still ours: one
            # taken over meanwhile (this endpoint was stopped past its lease) has a new owner that may never
            # have got these writes, so they are not acknowledged here.
            lost = sorted({vk for _, vk, _, wrote in fl.replies if wrote and not _owned(owned, vk)})
            if lost and verdict:
                log.warning("%s: mirror %s %s, and %d key(s) written in that batch are in ranges this endpoint no "
                            "longer owns (e.g. %#08x): those writes are answered 'unavailable' (their clients "
                            "retry at the owner)", self.name, peer, why, len(lost), lost[0])
            safe = verdict and not lost and safe
        if not safe:
            for later in self.inflights:
                later.tainted = True
        for frame, vk, payload, wrote in fl.replies:
            if (wrote and not safe) or fl.tainted:
                payload = self.backend.error_reply(frame.payload, Refusal.UNAVAILABLE,
                                                   "a mirror could not be reached or fenced off: retry")
            self._reply(frame, vk, payload)

    def _peer_failed(self, peer: str, why: str) -> tuple[bool, list | None]:
        """A replication target failed: fail its copy, or fence it off as a mirror.  (still safe, the ranges this
        endpoint owns in etcd now, or None when etcd was not asked: a copy target failed, nothing changed hands)."""
        self._drop_dealer(peer)
        op = self.op
        if op is not None and op.peer == peer and self.targets.get(peer):
            op.failed = f"replication to {peer} failed ({why})"
            self.targets.pop(peer, None)
            log.warning("%s: copy to %s failed (%s): the operation aborts", self.name, peer, why)
            if not any(peer in r.mirrors for r in self.view.owned_by(self.name)):
                return True, None
        log.warning("%s: mirror %s %s: removing it from the mirrors before acknowledging", self.name, peer, why)
        owned = []
        try:
            for rec, _ in self.registry.ranges(self.service.name):
                if rec.owner != self.name:
                    continue
                owned.append(rec.range)
                if peer in rec.mirrors:
                    mirrors = [m for m in rec.mirrors if m != peer]
                    rev = self.registry.assign(self.service.name, rec.range, self.name, expect_epoch=rec.epoch,
                                               mirrors=mirrors, helpers=rec.helpers)
                    self._patch(schema.RangeRec(lo=rec.lo, hi=rec.hi, owner=self.name, mirrors=mirrors,
                                                helpers=rec.helpers, epoch=rec.epoch + 1), rev)
            return True, owned
        except RegistryError as exc:
            log.error("%s: cannot fence off mirror %s (%s): writes stay unacknowledged", self.name, peer, exc)
            return False, owned

    def _forward(self, raw: bytes, vk: int, hops: int) -> bool:
        """Send a request to the range's owner over ZeroMQ (it answers the client itself), stamped with the
        epoch of the range record it was routed by."""
        rec = self.view.find(vk)
        owner = rec.owner if rec is not None else ""
        if not owner or owner == self.name or hops >= FWD_HOPS:
            return False
        sock = self._dealer(owner)
        if sock is None:
            return False
        sock.send_multipart(Envelope("FWD", self.name, body={"hops": hops + 1, "epoch": rec.epoch},
                                     blobs=[raw]).frames())
        self.counters["forwarded"] += 1
        return True

    def _fwd_in(self, env: Envelope) -> None:
        """FWD: requests another endpoint forwards to us.  One routed by an older epoch of a range we own than
        ours is refused (dropped, counted): it was received before the range changed hands, e.g. held by an
        owner that was stopped while we took the range over, and its client has retried here since.  Its
        retry is answered here (from its completion record, if it wrote), never this copy."""
        hops = int(env.body.get("hops", 1))
        epoch = env.body.get("epoch")
        for raw in env.blobs:
            if epoch is not None and self._stale_forward(raw, int(epoch)):
                self.counters["stale_forwards_refused"] += 1
                if self.counters["stale_forwards_refused"] in (1, 10, 100, 1000):
                    log.warning("%s: refused a request %s forwarded under epoch %d of a range now ours at a later "
                                "epoch (%d such so far): its client retries here", self.name, env.sender, int(epoch),
                                self.counters["stale_forwards_refused"])
                continue
            self.pending.append((raw, hops))

    def _stale_forward(self, raw: bytes, epoch: int) -> bool:
        try:
            vk = self.backend.key_of(parse(raw).payload)
        except (FrameError, BadRequest):
            return False   # classified (and answered) as any other request
        rec = self.view.find(vk)
        return rec is not None and rec.owner == self.name and rec.epoch > epoch

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _dealer(self, peer: str) -> zmq.Socket | None:
        sock = self.dealers.get(peer)
        if sock is None:
            ep = self.view.endpoints.get(peer)
            if ep is None or not ep.ctl:
                return None
            sock = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep.ctl)
            self.dealers[peer] = sock
            for p in self._pollers:
                p.register(sock, zmq.POLLIN)
        return sock

    def _drop_dealer(self, peer: str) -> None:
        sock = self.dealers.pop(peer, None)
        if sock is not None:
            for p in self._pollers:
                p.unregister(sock)
            sock.close(0)
