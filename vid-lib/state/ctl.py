"""Operator side of the state manager: ask endpoints to split, merge, move, mirror or cancel.

Each call sends one command over ZeroMQ to the endpoint that must act (the
owner of the range, found in etcd) and returns at once; :func:`wait` follows
the operation's record in etcd (``/vfab/v1/ops/...``) until it ends, calling
``progress(op)`` on every change.

* ``split(reg, svc, range, peer)``: the range's owner gives ``range`` to ``peer``.
* ``merge(reg, svc, range, into)``: ``into`` takes ``range`` back from its owner
  (a split run by the owner); neighbouring ranges of one owner are joined.
* ``move(reg, svc, source, peer)``: every range of ``source`` goes to ``peer``.
* ``mirror(reg, svc, source, peer)``: ``peer`` becomes a mirror of every range of ``source``.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from vfab.vid.registry import schema
from vfab.vid.envelope import Envelope, EnvelopeError, decode
from vfab.vid.errors import NotFound
from vfab.vid.ranges import Range
from vfab.vid.errors import StateError
from vfab.vid.registry import Registry


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


def split(reg: Registry, service: str, rng: Range, peer: str, throttle: float = 0.0) -> str:
    """Start the split; returns the source endpoint's name (to :func:`wait` on)."""
    owner = owner_of_range(reg, service, rng)
    if owner == peer:
        raise StateError(f"{peer} already owns {rng}: nothing to split")
    command(reg, service, owner, "SPLIT", {"peer": peer, "lo": rng.lo, "hi": rng.hi, "throttle": throttle})
    return owner


def merge(reg: Registry, service: str, rng: Range, into: str, throttle: float = 0.0) -> str:
    return split(reg, service, rng, into, throttle)


def move(reg: Registry, service: str, source: str, peer: str, throttle: float = 0.0) -> str:
    command(reg, service, source, "MOVE", {"peer": peer, "throttle": throttle})
    return source


def mirror(reg: Registry, service: str, source: str, peer: str, throttle: float = 0.0) -> str:
    command(reg, service, source, "MIRROR", {"peer": peer, "throttle": throttle})
    return source


def cancel(reg: Registry, service: str, source: str) -> None:
    command(reg, service, source, "CANCEL", {})


def current(reg: Registry, service: str, source: str) -> schema.OpRec | None:
    got = reg.get(schema.op_key(service, source))
    return schema.OpRec.from_json(got[0], schema.op_key(service, source)) if got else None


def wait(reg: Registry, service: str, source: str, since: float, timeout: float = 600.0,
         progress: Callable[[schema.OpRec], None] | None = None, poll: float = 0.05) -> schema.OpRec:
    """Follow ``source``'s operation started after ``since`` (time.time()) until it ends."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        rec = current(reg, service, source)
        if rec is None:
            if last is not None:
                raise NotFound(f"the record of {source}'s {last.op} vanished: {source} died (its lease expired); "
                               "see 'vfab ranges' for who owns what now")
        elif rec.started >= since - 1.0:
            if progress is not None and (last is None or (rec.phase, rec.done) != (last.phase, last.done)):
                progress(rec)
            last = rec
            if rec.finished:
                return rec
        time.sleep(poll)
    raise StateError(f"{source}'s operation did not end within {timeout:.0f} s; cancel it with "
                     f"'vfab cancel {service} {source}'")
