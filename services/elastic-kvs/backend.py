"""elastic-KVS as a backend of the stateful-endpoint loop (``vfab.vid.state``): its store and its protocol.

The loop hands it batches of requests for keys this endpoint owns; a batch is
one SQLite transaction (one fsync).  Every acknowledged write returns its
state record, and so does a recognised retry (the key's current record), so
the loop can put it on every mirror before the reply leaves.
"""

from __future__ import annotations

import collections
import os

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.services.elastic_kvs.store import Store
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
        if all(r.payload[:1] == GET_OP for r in requests):  # reads only: no write lock, no commit
            return [self._one(r, records) for r in requests], records
        self.store.begin()
        try:
            for r in requests:
                replies.append(self._one(r, records))
            self.store.commit()
        except BaseException:
            self.store.rollback()
            raise
        return replies, records

    def _one(self, r: Request, records: list) -> bytes:
        try:
            req = proto.parse_request(r.payload)
        except KvsError as exc:
            self.counters["bad_requests"] += 1
            return self.error_reply(r.payload, Refusal.BAD_REQUEST, str(exc))
        self.counters[req.op.name.lower()] += 1
        if req.op is Op.GET:
            row = self.store.row(req.key)
            if row is None or row[0] is None:
                return proto.Reply(Status.NOT_FOUND, req.reqid, row[1] if row else 0, client=req.client).serialize()
            return proto.Reply(Status.OK, req.reqid, row[1], row[0], req.client).serialize()
        existed = self.store.row(req.key)
        version, applied, record = self.store.write(req.key, req.value if req.op is Op.PUT else None,
                                                    req.client, req.reqid, row=existed)
        if not applied:
            # A retry of a write we already applied: its first reply may never have left (a mirror failed),
            # so the key's record goes to the mirrors again before this reply does.
            self.counters["retries_recognised"] += 1
            record = self.store.record(req.key)
        if record:
            records.append((r.key, record))
        status = Status.OK
        if req.op is Op.DEL and applied and (existed is None or existed[0] is None):
            status = Status.NOT_FOUND
        return proto.Reply(status, req.reqid, version, client=req.client).serialize()

    # -- state transfer (the rest is the store's own: StoreBackend) --------------------------------
    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        try:
            return self.store.apply(blobs, durable, gen)
        except KvsError as exc:
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"malformed state records: {exc}") from None
