"""elastic-KVS client library: get/put/delete with timeouts, retries and request ids.

A client is a session: a random 64-bit client id, and requests numbered 1, 2, ... in it (with the client
id the number names the operation); a retry re-sends the very same operation, so a PUT or DELETE whose
reply was lost is applied once — its completion record answers it wherever the key has moved since
(``session.py``).  Every request also says which operations the client has finished (``acked``: all below
the oldest one still in flight) and until when it may arrive (``deadline``: when the client will have given
up on it, plus a margin), so servers know when they may forget a record.  Clients never reconnect and
never learn who owns a key: they send to the key's VID and the fabric delivers.

A reply is accepted only if it comes from the VID the request went to (the
switch lets only the key's owner send from it), echoes this client's id and
names a request in flight: forged or stray replies are counted and dropped.

``submit``/``poll`` run many operations at once on one port (the load
generator's N logical clients); ``get``/``put``/``delete`` are the blocking
forms.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.vid import api
from vfab.vid.registry import Registry

RETRY_STATUSES = (Status.WRONG_OWNER, Status.UNAVAILABLE)
DEADLINE_SLACK = 2.0   # s beyond the client's own give-up time that a request stays valid (clock steps, queues)


class KvsTimeout(KvsError):
    """No reply after every retry."""


@dataclass
class Pending:
    op: Op
    key: bytes
    value: bytes
    reqid: int
    vk: int
    submitted: float
    expires: int = 0     # the request's deadline (UNIX s)
    deadline: float = 0.0
    attempts: int = 0
    tag: object = None
    reply: proto.Reply | None = None
    error: str = ""
    finished: float = 0.0
    retried: list = field(default_factory=list)  # why each retry happened


class KvsClient:
    def __init__(self, registry: Registry, service: str, iface: str, netns: str | None = None, rx: str = "ovs",
                 timeout: float = 0.5, retries: int = 8, client_id: int | None = None):
        self.api = api.Client(registry, service, iface, rx=rx, netns=netns)
        self.timeout = timeout
        self.retries = retries
        self.client_id = client_id if client_id is not None else secrets.randbits(63) | 1
        self.inflight: dict[int, Pending] = {}   # by request id, in the order sent (ids grow)
        self._seq = 0
        self.counters = {"sent": 0, "retries": 0, "timeouts": 0, "stray_replies": 0, "retry_status": 0,
                         "forged_replies": 0}

    # -- asynchronous form ------------------------------------------------------------
    def submit(self, op: Op, key: bytes, value: bytes = b"", tag: object = None) -> Pending:
        proto.check_key(key)
        if op is Op.PUT:
            proto.check_value(value)
        elif value:
            raise KvsError(f"{Op(op).name} carries no value")
        self._seq += 1
        p = Pending(op, bytes(key), bytes(value), self._seq, proto.vkey(key), time.monotonic(), tag=tag,
                    expires=math.ceil(time.time() + self.budget() + DEADLINE_SLACK))
        self.inflight[p.reqid] = p
        self._send(p)
        return p

    def budget(self) -> float:
        """s from an operation's first attempt until this client gives up on it (every attempt's timeout)."""
        return sum(self.timeout * min(2 ** a, 4) for a in range(self.retries + 1)) + 0.02 * self.retries ** 2

    def acked(self) -> int:
        """The oldest operation still in flight (every one before it is finished), or the next one."""
        for reqid in self.inflight:
            return reqid
        return self._seq + 1

    def _send(self, p: Pending) -> None:
        # submit checked the key and the value; a retry carries what the client has finished by now
        self.api.send_request(p.vk, proto.pack_request(p.op, self.client_id, p.reqid, p.key, p.value,
                                                       self.acked(), p.expires))
        p.attempts += 1
        p.deadline = time.monotonic() + self.timeout * min(2 ** (p.attempts - 1), 4)
        self.counters["sent"] += 1

    def poll(self, timeout: float) -> list[Pending]:
        """Operations finished within ``timeout`` s (a reply, or every retry spent)."""
        done: list[Pending] = []
        end = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            for p in [p for p in self.inflight.values() if p.deadline <= now]:
                if p.attempts > self.retries:
                    p.error = f"no reply after {p.attempts} attempts ({self.timeout} s timeout, backing off)"
                    p.finished = now
                    self.counters["timeouts"] += 1
                    del self.inflight[p.reqid]
                    done.append(p)
                else:
                    p.retried.append("timeout")
                    self.counters["retries"] += 1
                    self._send(p)
            if done or now >= end or not self.inflight:
                return done
            nearest = min(p.deadline for p in self.inflight.values())
            rep = self.api.recv_reply(max(0.0, min(end, nearest) - time.monotonic()))
            if rep is None:
                continue
            try:
                reply = proto.parse_reply(rep.payload)
            except KvsError:
                self.counters["stray_replies"] += 1
                continue
            p = self.inflight.get(reply.reqid)
            if p is None or reply.client != self.client_id:
                self.counters["stray_replies"] += 1  # a late duplicate of an answered request, or not ours
                continue
            if rep.src != self.api.vid(p.vk):
                self.counters["forged_replies"] += 1  # not from the key's VID: not its owner
                continue
            if reply.status in RETRY_STATUSES and p.attempts <= self.retries:
                self.counters["retry_status"] += 1
                p.retried.append(reply.status.name)
                p.deadline = time.monotonic() + 0.02 * p.attempts  # brief back-off, then the poll loop re-sends
                continue
            p.reply, p.finished = reply, time.monotonic()
            del self.inflight[p.reqid]
            done.append(p)
            # keep draining whatever else already arrived, without waiting
            end = time.monotonic()

    # -- blocking form ------------------------------------------------------------------
    def _wait(self, p: Pending) -> proto.Reply:
        while p.reply is None and not p.error:
            self.poll(self.timeout)
        if p.error:
            raise KvsTimeout(f"{p.op.name} {p.key[:40]!r}: {p.error}; is a server up for this key "
                             "('vfab ranges', 'vfab status')?")
        if p.reply.status in (Status.BAD_REQUEST, Status.WRONG_OWNER, Status.UNAVAILABLE, Status.EXPIRED):
            raise KvsError(f"{p.op.name} {p.key[:40]!r} refused ({p.reply.status.name}): {p.reply.message}")
        return p.reply

    def get(self, key: bytes) -> bytes | None:
        reply = self._wait(self.submit(Op.GET, key))
        return reply.body if reply.status is Status.OK else None

    def put(self, key: bytes, value: bytes) -> int:
        """Store ``value``; returns the key's new version once it is durable (and on every mirror)."""
        return self._wait(self.submit(Op.PUT, key, value)).version

    def delete(self, key: bytes) -> bool:
        """Delete; True if the key existed."""
        return self._wait(self.submit(Op.DEL, key)).status is Status.OK

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> "KvsClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
