"""The peer side of a state operation: receiving a copy of a range (a mixin of the endpoint's loop).

BEGIN opens an :class:`Incoming` (requests for the range are held) under a new
copy generation; CHUNKs and replicated writes are applied unsynced under it;
the first SYNC arrives once the copy is in: rows of earlier generations that
the copy did not overwrite are then dropped in steps between batches, and the
SYNC is answered (after an fsync) once they are gone; COMMIT serves the held
requests, ABORT forwards them to the owner and drops the partial copy in the
background.  A source that falls silent is looked up in etcd by the housekeeper's
thread (an etcd that hangs must not stall the loop), and the answer acted on here.

Everything here runs on the loop's thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vfab.vid.envelope import Envelope
from vfab.vid.errors import StateError
from vfab.vid.ranges import Range
from vfab.vid.registry import schema
from vfab.vid.state.backend import BackendError

log = logging.getLogger("vfab.state.loop")

INCOMING_IDLE = 6.0      # s a peer waits on a silent source before asking etcd how it ended
DROP_STEP = 200          # records an old copy loses per step between batches (~10 ms on the loop's thread)
# s an old copy is kept after the operation that moved its range away.  Dropped at once, its first steps (and
# the SQLite checkpoint they trigger, fsyncs included) met the new owner's first commits on the same disk: both
# loops stalled together for 20-50 ms right after the flip (the loops' stall log, bench/kvs_ops.py).
DROP_DELAY = 0.25


@dataclass
class Incoming:
    """A range being copied to us (we are the peer)."""

    range: Range
    source: str
    mode: str                      # "split" or "mirror"
    seen: float
    buffered: list = field(default_factory=list)   # (raw frame, hops: 0 = from the switch, 1+ = forwarded)
    gen: int | None = None         # the copy's generation (None: we mirror the range, our copy stays)
    clearing: bool = False         # rows of earlier generations are still being dropped
    sync_waiters: list = field(default_factory=list)   # (ident, SYNC envelope) answered once clear
    asking: bool = False           # the source fell silent: the housekeeper is asking etcd how it ended



class PeerSide:
    """Receiving copies; mixed into EndpointLoop (uses its backend, router, view, incoming, pending)."""

    def _receive(self, env: Envelope, ident: bytes) -> Envelope | None:
        """REPL (replicated writes), CHUNK (a copy's snapshot) and SYNC (make it durable)."""
        t, b = env.type, env.body
        if t in ("REPL", "CHUNK"):
            gen = None
            if t == "CHUNK" or "lo" in b:  # part of a copy to us
                inc = self.incoming.get(int(b.get("lo", -1)))
                if inc is None or inc.source != env.sender:
                    if t == "CHUNK":
                        raise StateError(f"{self.name} is receiving no copy of {int(b.get('lo', -1)):#08x} from "
                                         f"{env.sender} (aborted?)")
                    return env.reply("OK", self.name, applied=0)  # the copy ended: nothing to keep
                inc.seen = time.monotonic()
                gen = inc.gen
            elif t == "REPL":
                stale = self._stale_replication(env)
                if stale:
                    self.counters["stale_repl_refused"] += 1
                    return env.reply("ERR", self.name, error=stale)
            durable = t == "REPL" and bool(b.get("durable", True))
            try:
                n = self.backend.apply(env.blobs, durable=durable, gen=gen)
            except BackendError as exc:
                return env.reply("ERR", self.name, error=str(exc))
            self.counters["repl_applied" if t == "REPL" else "chunks_applied"] += 1
            return env.reply("OK", self.name, applied=n)
        if t == "SYNC":
            lo = int(b.get("lo", -1))
            inc = self.incoming.get(lo)
            if inc is None or inc.source != env.sender:
                # Only a copy in progress is made durable: one this endpoint gave up (or never began) must not
                # be reported durable, or the source's flip would hand over a range whose keys are gone.
                return env.reply("ERR", self.name, error=f"{self.name} holds no copy of {lo:#08x} from "
                                                         f"{env.sender} (it gave the copy up, or never began one)")
            inc.seen = time.monotonic()
            if b.get("paused") and inc.gen is None:
                self._drop_mirrored_copies(inc)
            if inc.clearing:  # answered once the rows of earlier copies are gone
                inc.sync_waiters.append((ident, env))
                self.housekeeper.wake()
                return None
            try:
                self.backend.sync()
            except BackendError as exc:
                return env.reply("ERR", self.name, error=str(exc))
            return env.reply("OK", self.name)

    def _stale_replication(self, env: Envelope) -> str:
        """Why a mirror's REPL must be refused ('' if not): it replicates a range that has another owner here at a
        later epoch than the sender knew (we took it over while the sender was stopped; applied now, its writes
        would land behind the new owner's and be acknowledged by the sender: lost)."""
        for lo, epoch in (env.body.get("epochs") or {}).items():
            rec = self.view.find(int(lo))
            if rec is not None and rec.owner != env.sender and rec.epoch > int(epoch):
                return (f"{self.name} refuses writes {env.sender} replicated under epoch {epoch} of {rec.range}: "
                        f"it is {rec.owner or 'nobody'}'s at epoch {rec.epoch} now")
        return ""

    def source_alive(self, source: str, los: list[int]) -> None:
        """ALIVE: ``source`` lives and waits for etcd; its copies to us (by their ranges' lo) are not silent."""
        for lo in los:
            inc = self.incoming.get(lo)
            if inc is not None and inc.source == source:
                inc.seen = time.monotonic()

    def _drop_mirrored_copies(self, inc: Incoming) -> None:
        """The source paused the range we mirror and is about to hand it to us.

        Until now every request for it reached us through the switch's mirrored delivery (hops 0) as
        well as the source, which served it or holds it (and forwards what it holds, hops 1).  This SYNC is
        answered before the source's etcd transaction, and the switch can route the range to us alone only
        after that, so every hops-0 frame buffered so far is such a copy: serving it again at COMMIT would
        only replay a burst of duplicates (~800 per 100k-key move under the bench's load, all at once).
        """
        kept = [(raw, hops) for raw, hops in inc.buffered if hops > 0]
        self.counters["mirror_copies_dropped"] += len(inc.buffered) - len(kept)
        inc.buffered = kept

    def _begin(self, env: Envelope) -> Envelope:
        b = env.body
        rng = Range(int(b["lo"]), int(b["hi"]))
        mode = b.get("mode", "split")
        if any(i.range.overlaps(rng) for i in self.incoming.values()):
            raise StateError(f"{self.name} is already receiving a range overlapping {rng}")
        if self.op is not None and any(r.overlaps(rng) for r in self.op.ranges):
            # Its own operation may still be dropping its old copy of these keys: a new copy must wait.
            raise StateError(f"{self.name} is still finishing {self.op.id} on {rng}: retry in a moment")
        rec = self.view.find(rng.lo)
        if rec is not None and rec.owner == self.name:
            raise StateError(f"{self.name} already owns {rng}")
        # A fresh copy: nothing stale may survive, unless we mirror the range (then our copy is current
        # and must stay whatever happens to this operation; version-gated records keep it right).  The
        # copy gets a new generation: its records win over older rows whatever their versions, and what
        # it did not overwrite is dropped in steps after it (at its first SYNC, answered once that is done).
        mirror = rec is not None and self.name in rec.mirrors
        try:
            gen = None if mirror else self.backend.begin_copy()
        except BackendError as exc:
            raise StateError(f"{self.name} cannot start a copy of {rng}: {exc}") from None
        self.incoming[rng.lo] = Incoming(rng, env.sender, mode, time.monotonic(), gen=gen, clearing=gen is not None)
        self._refilter()
        self.housekeeper.wake()
        log.info("%s: receiving %s from %s (%s, %s)", self.name, rng, env.sender, mode,
                 "keeping our mirror copy" if mirror else f"generation {gen}")
        return env.reply("OK", self.name)

    def _finish_incoming(self, lo: int, commit: bool, rec: schema.RangeRec | None = None,
                         revision: int = 0, why: str = "the copy ended") -> None:
        inc = self.incoming.pop(lo, None)
        if inc is None:
            return
        for ident, env in inc.sync_waiters:
            self.router.send_multipart([ident, *env.reply("ERR", self.name, error=why).frames()])
        if commit:
            if inc.clearing:  # (only if the source vanished before our SYNC): nothing stale may be served
                self.backend.drop(inc.range, below_gen=inc.gen)
            if rec is not None:
                self._patch(rec, revision)
            log.info("%s: %s from %s committed (%s): serving %d held requests", self.name, inc.range, inc.source,
                     inc.mode, len(inc.buffered))
        else:
            rec_now = self.view.find(inc.range.lo)
            if not (rec_now is not None and self.name in rec_now.mirrors):
                self.forget(inc.range)  # the partial copy goes in the background
            log.info("%s: %s from %s aborted: the copy is dropped, %d held requests go to the owner", self.name,
                     inc.range, inc.source, len(inc.buffered))
        self._refilter()
        self.pending.extend((raw, 0) for raw, _ in inc.buffered)   # classified afresh here

    def _silent_source(self, inc: Incoming) -> None:
        """The source said nothing for INCOMING_IDLE s: the housekeeper asks etcd (off this thread, which an
        etcd that hangs would stall for the whole HTTP timeout) and hands the answer to :meth:`_silent_answer`."""
        if not inc.asking:
            inc.asking = True
            self.housekeeper.ask_silent(inc)

    def _silent_answer(self, inc: Incoming, view, mine: bool, error: str) -> None:
        """etcd's answer about a silent source: the map (``mine``: it gives us the range, the operation
        committed) or why there is none.  Not ``mine`` means the housekeeper fenced the range first (its
        epoch went up), so the source's flip can no longer commit: abort.  Nothing if the copy ended or
        the source spoke meanwhile."""
        if self.incoming.get(inc.range.lo) is not inc:
            return
        inc.asking = False
        if time.monotonic() - inc.seen <= INCOMING_IDLE:
            return
        if view is None:
            log.warning("%s: source %s of %s silent and etcd unreachable (%s): still waiting", self.name,
                        inc.source, inc.range, error)
            inc.seen = time.monotonic() - INCOMING_IDLE / 2
            return
        rec = view.find(inc.range.lo)
        owner = rec.owner if rec else "-"
        log.warning("%s: source %s of %s silent for %.0f s; etcd says %s: %s", self.name, inc.source, inc.range,
                    INCOMING_IDLE, owner, "committing" if mine else "aborting (range fenced)")
        self._set_view(view)
        self._finish_incoming(inc.range.lo, commit=mine, why=(
            f"{self.name} gave up the copy of {inc.range}: no word from {inc.source} for {INCOMING_IDLE:.0f} s and "
            f"etcd names {owner} the owner"))

    def forget(self, rng: Range) -> None:
        """(loop thread) Drop our old copy of ``rng`` in the background, a step at a time, from ``DROP_DELAY``
        s on."""
        self.pending_drops.append(rng)
        self.drops_due = time.monotonic() + DROP_DELAY
        self.housekeeper.wake()

    def drops_pending(self) -> bool:
        return bool(self.pending_drops) or any(i.clearing and i.sync_waiters for i in self.incoming.values())

    def drop_step(self) -> tuple[bool, str, float]:
        """(loop thread) One step of dropping: rows of earlier generations under an incoming copy first,
        then old copies of ranges that moved away.  Returns (anything left, error or "", seconds to wait
        before the next step: an old copy's drop is not due yet).

        Run between batches, so no copy of an overlapping range can begin halfway through a step.
        """
        for inc in self.incoming.values():
            if not inc.clearing or not inc.sync_waiters:
                continue  # cleared once the copy is in (its first SYNC): before, it would race the copy
            inc.seen = time.monotonic()  # clearing is progress: the source is waiting for our SYNC
            try:
                n = self.backend.drop(inc.range, DROP_STEP, below_gen=inc.gen)
                self.counters["dropped"] += n
                if n >= DROP_STEP:
                    return True, "", 0.0
                inc.clearing = False
                self.backend.sync()
            except BackendError as exc:
                return True, str(exc), 0.0
            for ident, env in inc.sync_waiters:
                self.router.send_multipart([ident, *env.reply("OK", self.name).frames()])
            inc.sync_waiters.clear()
            return self.drops_pending(), "", 0.0
        wait = self.drops_due - time.monotonic()
        if self.pending_drops and wait > 0:
            return True, "", wait
        held = [r.range for r in self.view.held_by(self.name)] + [i.range for i in self.incoming.values()]
        while self.pending_drops:
            rng = self.pending_drops[0]
            if any(rng.overlaps(h) for h in held):
                self.pending_drops.pop(0)  # ours again (or being copied to us): nothing to drop
                continue
            try:
                n = self.backend.drop(rng, DROP_STEP)
            except BackendError as exc:
                return True, str(exc), 0.0
            self.counters["dropped"] += n
            if n < DROP_STEP:
                self.pending_drops.pop(0)
                log.info("%s: old copy of %s dropped", self.name, rng)
            return self.drops_pending(), "", 0.0
        return False, "", 0.0
