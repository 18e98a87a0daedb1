"""elastic-KVS client library: get/put/delete with timeouts, retries and request ids.

Each operation gets a random 64-bit request id (with the client's random
64-bit id it names the operation); a retry re-sends the very same request, so a PUT or DELETE
whose reply was lost is applied once — the server recognises the pair even
after the key moved to another server.  Clients never reconnect and never
learn who owns a key: they send to the key's VID and the fabric delivers.

A reply is accepted only if it comes from the VID the request went to (the
switch lets only the key's owner send from it), echoes this client's id and
names a request in flight: forged or stray replies are counted and dropped.

``submit``/``poll`` run many operations at once on one port (the load
generator's N logical clients); ``get``/``put``/``delete`` are the blocking
forms.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass, field

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.vid import api
from vfab.vid.registry import Registry

RETRY_STATUSES = (Status.WRONG_OWNER, Status.UNAVAILABLE)
IDS = struct.Struct("!512Q")  # request ids drawn from the OS at a time


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
        self.inflight: dict[int, Pending] = {}
        self._ids: list[int] = []
        self.counters = {"sent": 0, "retries": 0, "timeouts": 0, "stray_replies": 0, "retry_status": 0,
                         "forged_replies": 0}

    # -- asynchronous form ------------------------------------------------------------
    def submit(self, op: Op, key: bytes, value: bytes = b"", tag: object = None) -> Pending:
        proto.check_key(key)
        if op is Op.PUT:
            proto.check_value(value)
        elif value:
            raise KvsError(f"{Op(op).name} carries no value")
        reqid = self._reqid()
        while reqid in self.inflight:
            reqid = self._reqid()
        p = Pending(op, bytes(key), bytes(value), reqid, proto.vkey(key), time.monotonic(), tag=tag)
        self.inflight[p.reqid] = p
        self._send(p)
        return p

    def _reqid(self) -> int:
        """An unguessable non-zero 64-bit request id from the OS's CSPRNG, read 512 ids at a time (one
        getrandom call per id cost a 1-client load ~5 % of its time here)."""
        if not self._ids:
            self._ids = list(IDS.unpack(os.urandom(IDS.size)))
        return self._ids.pop() or 1

    def _send(self, p: Pending) -> None:
        # submit checked the key and the value
        self.api.send_request(p.vk, proto.pack_request(p.op, self.client_id, p.reqid, p.key, p.value))
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
        if p.reply.status in (Status.BAD_REQUEST, Status.WRONG_OWNER, Status.UNAVAILABLE):
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
