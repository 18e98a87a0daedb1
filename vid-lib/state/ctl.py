"""Operator side of the state layer: ask endpoints to split, merge, move, mirror or cancel.

Each call sends one command over ZeroMQ to the endpoint that must act (the
owner of the range, found in etcd); the endpoint validates it, starts the
operation and answers with its **op id**.  :func:`wait` follows that
operation's record (``/vfab/v1/ops/<service>/<op id>``) with an etcd watch
until it ends, calling ``progress(op)`` on every change — no polling, no
matching by wall-clock time.

* ``split(reg, svc, range, peer)``: the range's owner gives ``range`` to ``peer``.
* ``merge(reg, svc, range, into)``: ``into`` takes ``range`` back from its owner
  (a split run by the owner); neighbouring ranges of one owner are joined.
* ``move(reg, svc, source, peer)``: every range of ``source`` goes to ``peer``.
* ``mirror(reg, svc, source, peer)``: ``peer`` becomes a mirror of every range of ``source``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import zmq

from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import NotFound, RegistryError, StateError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema


@dataclass
class Started:
    """An operation an endpoint accepted."""

    service: str
    source: str
    op: str            # its id
    ranges: list


def command(reg: Registry, service: str, endpoint: str, type: str, body: dict, timeout: float = 5.0) -> Envelope:
    """Send one command to ``endpoint``'s control socket; the OK reply, or StateError with its reason."""
    eps = {e.name: e for e in reg.endpoints(service)}
    ep = eps.get(endpoint)
    if ep is None or not ep.ctl:
        live = ", ".join(n for n, e in eps.items() if e.ctl) or "none"
        raise StateError(f"endpoint {endpoint!r} of {service!r} is not a live stateful endpoint (live: {live})")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(ep.ctl)
        sock.send_multipart(Envelope(type, "operator", id=1, body=body).frames())
        if not sock.poll(timeout * 1000, zmq.POLLIN):
            raise StateError(f"{endpoint} did not answer {type} within {timeout:.0f} s: is it overloaded or hung?")
        try:
            reply = decode(sock.recv_multipart())
        except EnvelopeError as exc:
            raise StateError(f"{endpoint} answered {type} with garbage: {exc}") from None
    finally:
        sock.close(0)
    if reply.type != "OK":
        raise StateError(f"{endpoint} refused {type}: {reply.body.get('error', '?')}")
    return reply


def owner_of_range(reg: Registry, service: str, rng: Range) -> str:
    hits = [r for r, _ in reg.ranges(service) if r.range.overlaps(rng)]
    owners = {r.owner for r in hits}
    if len(owners) != 1 or not hits[0].owner:
        shown = ", ".join(f"{r.range}={r.owner or '-'}" for r in hits)
        raise StateError(f"{rng} of {service!r} is not inside one owner's ranges ({shown}): pick a range that one "
                         "endpoint owns ('vfab ranges')")
    return hits[0].owner


def _start(reg: Registry, service: str, source: str, type: str, body: dict) -> Started:
    reply = command(reg, service, source, type, body)
    return Started(service, source, str(reply.body.get("op", "")), reply.body.get("ranges", []))


def split(reg: Registry, service: str, rng: Range, peer: str, throttle: float = 0.0) -> Started:
    return _split(reg, service, rng, peer, throttle, "split")


def merge(reg: Registry, service: str, rng: Range, into: str, throttle: float = 0.0) -> Started:
    """A split to ``into`` whose record says "merge" (an endpoint older than the flag ignores it: "split")."""
    return _split(reg, service, rng, into, throttle, "merge")


def _split(reg: Registry, service: str, rng: Range, peer: str, throttle: float, what: str) -> Started:
    owner = owner_of_range(reg, service, rng)
    if owner == peer:
        raise StateError(f"{peer} already owns {rng}: nothing to {what}")
    body = {"peer": peer, "lo": rng.lo, "hi": rng.hi, "throttle": throttle}
    return _start(reg, service, owner, "SPLIT", {**body, "merge": True} if what == "merge" else body)


def move(reg: Registry, service: str, source: str, peer: str, throttle: float = 0.0) -> Started:
    return _start(reg, service, source, "MOVE", {"peer": peer, "throttle": throttle})


def mirror(reg: Registry, service: str, source: str, peer: str, throttle: float = 0.0) -> Started:
    return _start(reg, service, source, "MIRROR", {"peer": peer, "throttle": throttle})


VANISHED_GRACE = 15.0   # s a vanished op record's source may stay unreachable before it is taken for dead


class _Reread(Exception):
    """(wait) the record was deleted: read it again."""


def _vanished(reg: Registry, service: str, op_id: str, source: str, since: float) -> str:
    """Why ``op_id``'s record will not come back, or "" while it may (its source still runs the op, or has
    been unreachable for less than VANISHED_GRACE)."""
    try:
        reply = command(reg, service, source, "PING", {}, timeout=1.0)
    except (StateError, RegistryError) as exc:
        away = time.monotonic() - since
        if away < VANISHED_GRACE:
            return ""
        return f"{source} died or is stopped (its lease expired; unreachable for {away:.0f} s: {exc})"
    if op_id in reply.body.get("ops", []):
        return ""
    return f"{source} answers but no longer runs it (it restarted)"


def _still_gone(reg: Registry, service: str, op_id: str) -> bool:
    try:
        return reg.op(service, op_id)[0] is None
    except RegistryError:
        return False   # etcd away: look again at the next pass


def cancel(reg: Registry, service: str, source: str) -> str:
    """Cancel ``source``'s running operation; returns its op id."""
    return str(command(reg, service, source, "CANCEL", {}).body.get("op", ""))


def running(reg: Registry, service: str, source: str) -> schema.OpRec | None:
    """``source``'s unfinished operation, if any."""
    live = [o for o in reg.ops(service) if o.source == source and not o.finished]
    return live[-1] if live else None


def wait(reg: Registry, service: str, op_id: str, timeout: float = 600.0,
         progress: Callable[[schema.OpRec], None] | None = None,
         notice: Callable[[str], None] | None = None) -> schema.OpRec:
    """Follow operation ``op_id`` (from the command's reply) with an etcd watch until it ends.

    The record lives under its source's lease until the end, so it vanishes when that lease expires (the
    source stopped, or etcd hung, past the TTL); a live source puts it back under its new lease.  So a
    vanished record is waited for while the source says (PING) it still runs the op; NotFound once the
    source answers that it does not (it restarted) or stays unreachable for VANISHED_GRACE.  ``notice(text)``
    is told when the record vanishes and when it is back (an operator's wait then pauses for a reason)."""
    deadline = time.monotonic() + timeout
    key = schema.op_key(service, op_id)
    last: list[schema.OpRec] = []   # the newest record seen
    gone_since: float | None = None

    def seen(rec: schema.OpRec | None) -> bool:
        """Take one state of the record (None: deleted); True once the operation ended."""
        if rec is None:
            return False
        if progress is not None and (not last or (rec.phase, rec.done) != (last[0].phase, last[0].done)):
            progress(rec)
        last[:] = [rec]
        return rec.finished

    def back() -> None:
        """The record is there (again)."""
        nonlocal gone_since
        if gone_since is not None and notice is not None:
            notice(f"{last[0].source} wrote the record of {op_id} again after {time.monotonic() - gone_since:.1f} s")
        gone_since = None

    while True:
        try:
            rec, rev = reg.op(service, op_id)
        except RegistryError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # etcd restarting: ride it out
            continue
        if rec is not None:
            back()
        if seen(rec):
            return last[0]
        if rec is None and last:
            if gone_since is None and notice is not None:
                notice(f"the record of {op_id} vanished: {last[0].source}'s etcd lease expired (etcd or "
                       f"{last[0].source} was stopped or cut off past its TTL); waiting for {last[0].source} to "
                       f"write it again (up to {VANISHED_GRACE:.0f} s while it does not answer)")
            gone_since = gone_since or time.monotonic()
            lost = _vanished(reg, service, op_id, last[0].source, gone_since)
            if lost and _still_gone(reg, service, op_id):   # (its final record may have landed meanwhile)
                raise NotFound(f"the record of {op_id} vanished: {lost}; see 'vfab ranges' for who owns what now")
        left = deadline - time.monotonic()
        if left <= 0:
            raise StateError(f"operation {op_id} did not end within {timeout:.0f} s; cancel it with "
                             f"'vfab cancel {service} {op_id.rsplit('.', 1)[0]}'")
        try:
            batches, stop = reg.watch_batches(key, rev + 1, idle=min(left, 1.0))
        except RegistryError:
            time.sleep(0.2)
            continue
        try:
            for batch in batches:
                for ev in batch:
                    if ev.value is None:
                        raise _Reread   # deleted: see above what that means
                    back()
                    if seen(schema.OpRec.from_json(ev.value, key)):
                        return last[0]
        except (RegistryError, _Reread):
            pass  # the watch broke (etcd restarted), or the record was deleted: re-read and watch again
        finally:
            stop()
