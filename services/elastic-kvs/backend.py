"""elastic-KVS as a backend of the stateful-endpoint loop (``vfab.vid.state``): its store and its protocol.

The loop hands it batches of requests for keys this endpoint owns; a batch is
one SQLite transaction (one fsync).  Every acknowledged write returns its
state record, and so does a recognised retry (the key's current record), so
the loop can put it on every mirror before the reply leaves.

Exactly once: a write is looked up in its key's completion records first (``session.py``): one already
applied is answered from its record, a stale one (the client has its answer) is dropped unanswered, one
past its deadline is refused (EXPIRED); only a new one is applied, its record written into the key's row in
the same transaction.  The records live in the row, so they reach the mirrors and every new owner with the
data.  Why here and not in the state loop: the loop never reads payloads, and only the backend can put a
record into the transaction (and the row) of the write it records.  sdhcp needs none: a DHCP server
answers a retransmitted DISCOVER or REQUEST anew, and the same client is given the same lease.
"""

from __future__ import annotations

import collections
import os
import time

from vfab.services.elastic_kvs import proto, session
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.services.elastic_kvs.store import Store, pack_record
from vfab.vid.state.backend import BackendError, BadRequest, Refusal, Request, StoreBackend

def open_backend(datadir: str, name: str) -> "KvsBackend":
    """The backend of endpoint ``name``, its store at DATADIR/NAME.sqlite."""
    return KvsBackend(Store(os.path.join(datadir, f"{name}.sqlite")))


GET_OP = bytes([Op.GET])
STATUS = {Refusal.BAD_REQUEST: Status.BAD_REQUEST, Refusal.WRONG_OWNER: Status.WRONG_OWNER,
          Refusal.UNAVAILABLE: Status.UNAVAILABLE}


class KvsBackend(StoreBackend):
    def __init__(self, store: Store):
        self.store = store
        self.counters: collections.Counter = collections.Counter()
        self._changed = False   # the batch being served changed data (not only completion records)

    # -- the data path --------------------------------------------------------------------------
    def key_of(self, payload: bytes) -> int:
        try:
            return proto.key_of(payload)
        except KvsError as exc:
            raise BadRequest(str(exc)) from None

    def error_reply(self, payload: bytes, refusal: Refusal, message: str) -> bytes:
        client, reqid, _key = proto.peek(payload)
        return proto.error_reply(reqid, STATUS[refusal], message, client)

    def handle_batch(self, requests: list[Request]) -> tuple[list[bytes | None], list[tuple[int, bytes]]]:
        replies: list[bytes | None] = []
        records: list[tuple[int, bytes]] = []
        now = time.time()
        if all(r.payload[:1] == GET_OP for r in requests):  # reads only: no write lock, no commit
            return [self._one(r, records, now) for r in requests], records
        # Committed without waiting for the disk, then the write-ahead log is synced once if the batch changed
        # any data (as durable as a synchronous commit: the sync covers every frame of the log).  A batch whose
        # only writes are completion records of DELETEs that found nothing skips the sync: see _one.
        self._changed = False
        self.store.begin(durable=False)
        try:
            for r in requests:
                replies.append(self._one(r, records, now))
            self.store.commit()
        except BaseException:
            self.store.rollback()
            raise
        if self._changed:
            self.store.sync()
        return replies, records

    def _one(self, r: Request, records: list, now: float) -> bytes | None:
        try:
            req = proto.parse_request(r.payload)
        except KvsError as exc:
            self.counters["bad_requests"] += 1
            return self.error_reply(r.payload, Refusal.BAD_REQUEST, str(exc))
        if req.deadline < now:
            self.counters["expired"] += 1
            return proto.error_reply(req.reqid, Status.EXPIRED, f"the request's deadline {req.deadline} passed "
                                     f"{now - req.deadline:.0f} s ago on this server's clock: not applied", req.client)
        if req.deadline > now + session.MAX_AHEAD:
            self.counters["bad_requests"] += 1
            return self.error_reply(r.payload, Refusal.BAD_REQUEST, (
                f"the request's deadline is {req.deadline - now:.0f} s ahead of this server's clock (the limit is "
                f"{session.MAX_AHEAD} s): check the client's clock"))
        self.counters[req.op.name.lower()] += 1
        row = self.store.row(req.key)
        if req.op is Op.GET:
            if row is None or row[0] is None:
                return proto.Reply(Status.NOT_FOUND, req.reqid, row[1] if row else 0, client=req.client).serialize()
            return proto.Reply(Status.OK, req.reqid, row[1], row[0], req.client).serialize()
        done = row[2] if row else b""
        seen, result = session.lookup(done, req.client, req.reqid)
        if seen is session.STALE:
            # The client has this request's outcome already (its acked is past it): a copy that waited
            # somewhere (a stopped server's socket, a forward).  Applying it could undo later writes.
            self.counters["stale_dropped"] += 1
            return None
        if seen is session.DONE:
            # Applied before (here or wherever the key was then): answered from its record, and the key's
            # record goes to the mirrors again before this reply does (the first reply may never have left).
            self.counters["answered_from_record"] += 1
            records.append((r.key, pack_record(req.key, r.key, *row)))
            version, not_found = session.split_result(result)
            return proto.Reply(Status.NOT_FOUND if not_found else Status.OK, req.reqid, version,
                               client=req.client).serialize()
        value = req.value if req.op is Op.PUT else None
        not_found = req.op is Op.DEL and (row is None or row[0] is None)
        # A DELETE that found nothing changes no data, only its key's completion records: they are committed
        # without a sync of their own (before this, such a delete wrote nothing; with a sync each, the median
        # delete of a 1-client put:get:del load took 0.385 ms against main's 0.314, bench/ab.py).  They survive a crash of the process, reach the mirrors (which apply
        # them durably) before the reply, and the next sync of this store, any later write's, covers them.
        # Only a power loss before that could lose one: a late copy of that DELETE would then find no record.
        self._changed = self._changed or not not_found
        version = (row[1] if row else 0) + 1
        try:
            done = session.add(done, req.client, req.reqid, req.acked, req.deadline,
                               session.result_of(version, not_found), now)
        except session.SessionFull as exc:
            self.counters["sessions_full"] += 1
            return self.error_reply(r.payload, Refusal.UNAVAILABLE, f"key {req.key[:40]!r}: {exc}")
        records.append((r.key, self.store.write(req.key, value, version, done, row=row)))
        return proto.Reply(Status.NOT_FOUND if not_found else Status.OK, req.reqid, version,
                           client=req.client).serialize()

    # -- state transfer (the rest is the store's own: StoreBackend) --------------------------------
    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        try:
            return self.store.apply(blobs, durable, gen)
        except KvsError as exc:
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"malformed state records: {exc}") from None
