"""The state operations as a pure state machine: decisions only, no sockets, no etcd, no clock.

An operation (split, move, mirror; merge is a split run by the owner) is a
generator: it yields *actions* and is sent back each action's *result* with
the time it came (``Result(now, value)``); :mod:`vfab.vid.state.runner`
performs the actions.  So every decision — what to verify, when to give up,
what an ambiguous etcd answer means, what is reported — is tested here
without zmq or etcd (tests/unit/test_state_machine.py).

Per range (the paper's Algorithm 1, DESIGN.md §5)::

    read the range map     the range must be ours, in one record (epoch E)
    BEGIN  → peer          the peer buffers requests for the range, drops stale copies
    target                 from now on every write in the range is replicated to the peer
    copy                   snapshot chunks stream to the peer (pipelined)
    SYNC   → peer          the peer makes everything durable
    read the range map     still ours at epoch E? (else: abort, nothing moved)
    pause                  (split/move) at a batch boundary: requests for the range are held
    SYNC   → peer          writes replicated since the first SYNC are durable too
    assign                 one etcd transaction, compared on epoch E: the peer owns it (E+1)
    ---------------------- committed: from here nothing fails the operation ----------------
    release → peer         held requests are forwarded to the new owner
    COMMIT → peer          it serves (it also finds out alone, from etcd, if this is lost)
    drop                   the old copy goes, in the background (a failure is logged and retried)

A mirror op assigns the same owner with the peer added to ``mirrors``; there
is no pause.  Any failure before the commit aborts: the hold is released to
this endpoint, the peer is told to ABORT (it also aborts alone when we fall
silent) — the range never stopped having exactly one owner.

An etcd answer lost in transit (etcd restarted mid-transaction) is ambiguous:
the machine re-reads the range map and decides from the epoch whether its
transaction committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator

from vfab.vid.errors import StateError
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

OP_KINDS = schema.OP_KINDS
ASSIGN_TRIES = 3


# -- validation (once, where the operation starts) --------------------------------------------
def validate(kind: str, source: str, peer: str, rng: Range | None, ranges, endpoints: dict,
             busy: str = "") -> list[Range]:
    """The ranges an operation moves; StateError says why it cannot start and what to do."""
    if kind not in OP_KINDS:
        raise StateError(f"unknown operation {kind!r}: one of {', '.join(OP_KINDS)}")
    schema.check_name("peer endpoint", peer)
    if peer == source:
        raise StateError(f"{kind} to {peer}: the peer is this endpoint itself; name another endpoint")
    if busy:
        raise StateError(f"{source} is already running {busy}: wait for it or cancel it ('vfab cancel')")
    ep = endpoints.get(peer)
    if ep is None or not ep.ctl:
        live = ", ".join(sorted(n for n, e in endpoints.items() if e.ctl and n != source)) or "none"
        raise StateError(f"peer {peer!r} is not a live stateful endpoint (live: {live}): start it first")
    owned = [r for r in ranges if r.owner == source and r.state == "active"]
    if kind == "split":
        if rng is None:
            raise StateError("split needs a range LO-HI")
        if not any(r.lo <= rng.lo and rng.hi <= r.hi for r in owned):
            mine = ", ".join(str(r.range) for r in owned) or "none"
            raise StateError(f"{source} does not own all of {rng} (it owns: {mine}): split only a range inside one "
                             "of the owner's ranges; 'vfab ranges' shows the map")
        return [rng]
    if not owned:
        raise StateError(f"{source} owns no range: nothing to {kind}")
    if kind == "mirror" and all(peer in r.mirrors for r in owned):
        raise StateError(f"{peer} already mirrors every range of {source}")
    return [r.range for r in owned if not (kind == "mirror" and peer in r.mirrors)]


# -- actions and results ----------------------------------------------------------------------
@dataclass
class Ask:
    """Send a control message to the peer and wait for its OK (result: the body, or a Failure)."""
    type: str
    body: dict = field(default_factory=dict)


@dataclass
class Copy:
    """Stream the range's snapshot to the peer (result: records sent, or a Failure)."""
    rng: Range


@dataclass
class LoopCmd:
    """Ask the endpoint's loop to act at a batch boundary (result: None, or a Failure).

    ``target``/``untarget`` (replicate writes in rng to the peer), ``pause`` (hold requests for rng;
    fails if a replication to the peer failed), ``release`` (stop holding: forward what was held to
    ``to``, or serve it here when ``to`` is empty; ``rec`` patches the loop's view).
    """
    cmd: str
    rng: Range
    to: str = ""
    rec: Any = None
    revision: int = 0


@dataclass
class ReadRanges:
    """The service's range map (result: [RangeRec], or a Failure once etcd stayed down)."""


@dataclass
class Assign:
    """One epoch-checked etcd transaction (result: revision, or Failure("conflict"|"etcd", why))."""
    rng: Range
    owner: str
    expect_epoch: int
    mirrors: list
    helpers: list


@dataclass
class Publish:
    """Update the operation's record in etcd (best effort: no result)."""
    fields: dict


@dataclass
class Drop:
    """Forget the old copy of a range, now or in the background (result: None, or a Failure)."""
    rng: Range


@dataclass
class Now:
    """Only the time (result: None)."""


@dataclass
class Coalesce:
    """Join neighbouring ranges of one owner (best effort)."""


@dataclass
class Failure:
    kind: str      # "peer", "etcd", "conflict", "cancelled", "disk", "replication"
    why: str


@dataclass
class Result:
    now: float
    value: Any = None


@dataclass
class Outcome:
    phase: str                       # done | failed | cancelled
    error: str = ""
    notes: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


class _Abort(Exception):
    def __init__(self, phase: str, why: str):
        super().__init__(why)
        self.phase, self.why = phase, why


Gen = Generator[Any, Result, Outcome]


def _need(res: Result, what: str) -> Any:
    if isinstance(res.value, Failure):
        phase = "cancelled" if res.value.kind == "cancelled" else "failed"
        why = res.value.why if phase == "failed" else "cancelled by the operator before the flip; nothing changed"
        raise _Abort(phase, f"{what}: {why}" if phase == "failed" else why)
    return res.value


def _covering(recs: list, rng: Range) -> list:
    return [r for r in recs if r.range.overlaps(rng)]


def _check_ours(recs: list, rng: Range, source: str, epoch: int | None, what: str) -> schema.RangeRec:
    hit = _covering(recs, rng)
    if len(hit) != 1 or not (hit[0].lo <= rng.lo and rng.hi <= hit[0].hi):
        shown = ", ".join(f"{r.range}={r.owner or '-'}@{r.epoch}" for r in hit) or "no range"
        raise _Abort("failed", f"{what}: {rng} is no longer inside one range of {source} ({shown}): nothing moved; "
                               "retry")
    rec = hit[0]
    if rec.owner != source:
        raise _Abort("failed", f"{what}: {rng} is now owned by {rec.owner or 'nobody'}, not {source}: nothing moved")
    if epoch is not None and rec.epoch != epoch:
        raise _Abort("failed", f"{what}: {rng} changed while it was copied (epoch {epoch} → {rec.epoch}): nothing "
                               "moved; retry")
    return rec


def operation(kind: str, source: str, peer: str, ranges: list[Range], now: float) -> Gen:
    """The whole operation over ``ranges``; returns its Outcome."""
    out = Outcome("done")
    t0 = now
    try:
        for rng in ranges:
            yield from _one_range(kind, source, peer, rng, out)
    except _Abort as exc:
        out.phase, out.error = exc.phase, exc.why
    res = yield Now()
    out.timings["total_s"] = round(res.now - t0, 4)
    return out


def _add(out: Outcome, name: str, seconds: float) -> None:
    out.timings[name] = round(out.timings.get(name, 0.0) + seconds, 4)


def _one_range(kind: str, source: str, peer: str, rng: Range, out: Outcome) -> Gen:
    t_start = (yield Now()).now
    recs = _need((yield ReadRanges()), "reading the range map")
    parent = _check_ours(recs, rng, source, None, "before starting")
    epoch = parent.epoch
    mode = "mirror" if kind == "mirror" else "split"
    _need((yield Ask("BEGIN", {"lo": rng.lo, "hi": rng.hi, "mode": mode})), f"peer {peer} refused BEGIN")
    committed = False
    paused = False
    try:
        _need((yield LoopCmd("target", rng, to=peer)), "replicating to the peer")
        yield Publish({"phase": "copy"})
        t_copy = (yield Now()).now
        _add(out, "begin_s", t_copy - t_start)      # the map read, BEGIN, replication to the peer on
        _need((yield Copy(rng)), f"copying to {peer}")
        t_sync = (yield Now()).now
        _need((yield Ask("SYNC", {"lo": rng.lo})), f"peer {peer} could not make the copy durable")
        t_copied = (yield Publish({"phase": "flip"})).now
        _add(out, "sync_s", t_copied - t_sync)      # the peer clears what earlier copies left, fsyncs
        _add(out, "copy_s", t_copied - t_copy)      # the snapshot streamed, and that SYNC
        # Checked before the pause, so an etcd outage here is ridden out without holding requests; the
        # flip's transaction compares the epoch again.
        recs = _need((yield ReadRanges()), "reading the range map before the flip")
        parent = _check_ours(recs, rng, source, epoch, "before the flip")
        t_pause = (yield Now()).now
        if kind != "mirror":
            _need((yield LoopCmd("pause", rng)), "pausing the range")
            paused = True
            # "paused": the peer, if it mirrors the range, drops the mirrored copies it buffered so far (we
            # served or hold every one of them) instead of serving them again at COMMIT
            _need((yield Ask("SYNC", {"lo": rng.lo, "paused": True})),
                  f"peer {peer} could not make the last writes durable")
        if kind == "mirror":
            owner, mirrors = source, sorted(set(parent.mirrors) | {peer})
        else:
            owner, mirrors = peer, [m for m in parent.mirrors if m != peer]
        t_assign = (yield Now()).now
        rev, res = yield from _assign(Assign(rng, owner, epoch, mirrors, list(parent.helpers)))
        committed = True
        new = schema.RangeRec(lo=rng.lo, hi=rng.hi, owner=owner, mirrors=mirrors, helpers=list(parent.helpers),
                              epoch=epoch + 1)
        if kind == "mirror":
            yield LoopCmd("untarget", rng, to=peer, rec=new, revision=rev)   # replicated as a mirror from now on
        else:
            yield LoopCmd("release", rng, to=peer, rec=new, revision=rev)    # held requests go to the new owner
            paused = False
        got = yield Ask("COMMIT", {"lo": rng.lo, "rec": new.to_json(), "revision": rev})
        if isinstance(got.value, Failure):
            out.notes.append(f"{peer} did not confirm the commit of {rng} ({got.value.why}); etcd names it "
                             f"{'a mirror' if kind == 'mirror' else 'the owner'} and it finds out by itself")
        # flip: pause -> last SYNC -> etcd transaction -> held requests forwarded -> the peer serves
        _add(out, "flip_s", got.now - t_pause)
        _add(out, "etcd_s", res.now - t_assign)
        yield Publish({"revision": rev})
        if kind != "mirror":
            dropped = yield Drop(rng)
            if isinstance(dropped.value, Failure):
                out.notes.append(f"the old copy of {rng} could not be dropped here ({dropped.value.why}); "
                                 "it is retried in the background and at the next start")
            done = yield Coalesce()
            _add(out, "after_s", done.now - got.now)  # the record, the old copy's drop queued, ranges joined
    except _Abort:
        if not committed:
            yield LoopCmd("release" if paused else "untarget", rng, to="", rec=None)
            yield Ask("ABORT", {"lo": rng.lo})   # a lost ABORT is fine: the peer aborts alone when we fall silent
        raise


def _assign(action: Assign) -> Generator[Any, Result, tuple[int, Result]]:
    """Run the flip's transaction; an ambiguous answer is settled by reading the map back."""
    for _ in range(ASSIGN_TRIES):
        res = yield action
        if not isinstance(res.value, Failure):
            return res.value, res
        if res.value.kind not in ("etcd", "conflict"):
            _need(res, "the flip")
        recs = _need((yield ReadRanges()), f"the flip's transaction was not answered ({res.value.why}) and etcd "
                                           "stayed unreachable")
        hit = _covering(recs, action.rng)
        if len(hit) == 1 and hit[0].range == action.rng and hit[0].owner == action.owner \
                and hit[0].epoch == action.expect_epoch + 1 and sorted(hit[0].mirrors) == sorted(action.mirrors):
            return 0, res  # it did commit
        if res.value.kind == "conflict" or any(r.epoch != action.expect_epoch for r in hit):
            raise _Abort("failed", f"the flip lost a race ({res.value.why}): nothing moved; retry")
    raise _Abort("failed", f"etcd did not take the flip's transaction after {ASSIGN_TRIES} tries: nothing moved")
