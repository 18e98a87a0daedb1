"""The contract between the stateful-endpoint loop and a service: its backend.

The loop (:mod:`vfab.vid.state.loop`) owns the data port, the control socket,
batching, pausing and replication; a service plugs in by giving it a
:class:`Backend`: how to find a request's VID key, how to serve a batch, and
its records per range of keys for the state operations.  elastic-KVS's
backend is ``vfab.services.elastic_kvs.backend``, sdhcp's
``vfab.services.sdhcp.backend``; both keep their records in a
:class:`~vfab.vid.state.sqlstore.SqliteStore` and take the state-transfer
calls from :class:`StoreBackend`.

Rules a backend keeps (the loop's safety rests on them):

* ``handle_batch`` applies the batch durably (or raises :class:`BackendError`
  with nothing applied) and returns one reply per request plus the records of
  every write whose reply acknowledges it.  A retried write that the backend
  recognises (already applied) still returns the key's current record: the
  loop re-sends it to the mirrors before the retry is acknowledged, so an
  acknowledged write is never missing from a mirror.
* Records are self-describing blobs that ``apply`` accepts in any order and
  any number of times (e.g. version-gated); they travel between endpoints
  unchanged.
* ``error_reply`` builds the service's own error reply to a request payload
  (with the request's own id): the loop never parses payloads.
* A backend whose requests may safely be served twice (sdhcp: a DHCP server
  answers a retransmission anyway) sets ``replay_on_takeover = True``: a
  mirror that takes a range over from a dead owner then serves again the
  requests of that range it got (and ignored) in the last few seconds, so a
  request the owner took to its grave is still answered.  Never for writes
  that are not idempotent (elastic-KVS: a replayed PUT could undo a later one).
* A backend may ask for group commit (``group_commit = True``, sdhcp does):
  the loop sets its ``defer_sync`` to True, after which ``handle_batch``
  commits without waiting for the disk and sets ``batch_unsynced`` when the
  batch wrote something that must be durable before its replies leave; the
  loop keeps those replies, reads and commits whatever else the port holds,
  and once the port is drained (or a reply has waited 2 ms) calls ``sync``
  once for all of them before they leave.
  Replies leave in the order their batches were served unless the backend
  sets ``ordered_replies = False``: then a batch that needed no disk answers
  at once, ahead of earlier batches still waiting for theirs; only for
  replies that promise nothing a crash could take back (sdhcp's OFFERs:
  the client must still REQUEST, and that ACK waits for the disk).
* ``disk_seconds()`` (optional): wall seconds the calling thread has spent
  committing and syncing; the loop's stall log says how much of a long pass
  went to the disk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

from vfab.vid.errors import VfabError
from vfab.vid.ranges import Range

if TYPE_CHECKING:
    from vfab.vid.state.sqlstore import SqliteStore


class BackendError(VfabError):
    """The backend could not apply a batch or a state transfer; the message names the cause."""


class BadRequest(VfabError):
    """A request payload the backend cannot read; the message says what is wrong."""


class Refusal(enum.Enum):
    BAD_REQUEST = "bad_request"    # malformed or over a limit
    WRONG_OWNER = "wrong_owner"    # not ours and its owner is unreachable: retry
    UNAVAILABLE = "unavailable"    # could not be made durable (everywhere it must be): retry later


@dataclass
class Request:
    """One request the loop hands to ``handle_batch``."""

    payload: bytes
    key: int          # VID key (from ``key_of``)
    src: bytes        # the client's MAC (replies go there)


class Backend(Protocol):
    def key_of(self, payload: bytes) -> int:
        """The 24-bit VID key of a request; raises BadRequest."""

    def handle_batch(self, requests: list[Request]) -> tuple[list[bytes | None], list[tuple[int, bytes]]]:
        """Serve a batch in one durable step: (replies parallel to requests, [(key, record)] written)."""

    def error_reply(self, payload: bytes, refusal: Refusal, message: str) -> bytes | None:
        """The service's error reply to a request payload (None: send nothing)."""

    def count(self, rng: Range) -> int:
        """Live records in ``rng`` (for progress and load reports)."""

    def snapshot(self, rng: Range, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
        """(blob, records) chunks of every record in ``rng``, from one consistent read."""

    def begin_copy(self) -> int:
        """A new copy generation (durable, growing): see ``apply`` and ``drop``."""

    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        """Apply record blobs; ``durable=False`` may leave them unsynced until ``sync``.

        With ``gen`` (a copy's generation) a record also wins over any record of an earlier generation,
        whatever its version: a stale copy may hold versions that were never acknowledged.
        """

    def sync(self) -> None:
        """Make every earlier ``apply`` durable."""

    def drop(self, rng: Range, limit: int | None = None, below_gen: int | None = None) -> int:
        """Forget the records in ``rng`` (at most about ``limit`` of them when given; with ``below_gen``
        only those of earlier copy generations); returns how many.

        Fewer than ``limit`` dropped means none are left.  The loop drops old copies in such steps
        between batches, so a large drop never stalls the data path for long.
        """

    def keep_only(self, ranges: list[Range]) -> int:
        """Forget every record outside ``ranges`` (garbage left by a crash); returns how many."""


class StoreBackend:
    """The state-transfer half of :class:`Backend` for a service whose records live in a store
    (``self.store``: a :class:`vfab.vid.state.sqlstore.SqliteStore`): each call is the store's own.  A
    backend that must turn its store's errors into :class:`BackendError` overrides the call."""

    store: SqliteStore

    def count(self, rng: Range) -> int:
        return self.store.count(rng)

    def count_version(self) -> int:
        """Changes whenever a count may have (the store's ``data_version`` on the calling thread, which must
        not write); a backend without it is counted every time."""
        return self.store.data_version()

    def snapshot(self, rng: Range, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
        return self.store.snapshot(rng, chunk_bytes)

    def begin_copy(self) -> int:
        return self.store.begin_copy()

    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        return self.store.apply(blobs, durable, gen)

    def sync(self) -> None:
        self.store.sync()

    def disk_seconds(self) -> float:
        return self.store.disk_seconds()

    def drop(self, rng: Range, limit: int | None = None, below_gen: int | None = None) -> int:
        return self.store.drop(rng, limit, below_gen)

    def keep_only(self, ranges: list[Range]) -> int:
        return self.store.keep_only(ranges)
