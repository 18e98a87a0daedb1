"""Completion records of client sessions: a key's writes are applied exactly once, with no window to outgrow.

The only module that knows the completion table's format.  Each key's row carries the table (store.py's
``done`` column, inside the key's state record), so the records are written in the same transaction as
the write they describe and travel with the key to every mirror and through every split, merge, mirror
and move: a retried or forwarded request meets its record wherever the key is (RIFL, SOSP'15; Raft's
client sessions).

Completion table of one key: an entry per client session that wrote it, each with its records::

    +-------------------------------+-------------------------------+---------------+-------+
    |        client id (8 B)        |          floor (8 B)          |  until (4 B)  | n (2B)|
    +-------------------------------+-------------------------------+---------------+-------+
    then n records:
    +-------------------------------+---------------------------------------------------------+
    |   request id = sequence (8 B) | result (8 B): the version the write made; top bit set:   |
    |                               | a DELETE that found nothing (the reply was NOT_FOUND)    |
    +-------------------------------+---------------------------------------------------------+

A request carries (client, seq, acked, deadline) (proto.py).  For a write of key K:

* ``deadline`` (the client's clock, UNIX seconds) has passed on the server's clock: refused (EXPIRED),
  whatever K holds; the client stopped waiting for it then.
* the client's entry in K has a record for ``seq``: answered from it (nothing applied again).
* ``seq`` is below the entry's ``floor``: stale; the client already has this request's final outcome
  (the floor comes from the client's own ``acked``): nothing is applied and nothing is answered.
* otherwise it is new: applied, and its record added.  The entry's floor rises to ``acked`` (records
  below it are dropped: the client has those answers) and ``until`` to ``deadline``.

When K is next written, entries whose ``until`` is more than ``SKEW`` s past drop out: every request they
could answer or refuse carries a deadline at most ``until``, so any server whose clock is within ``SKEW``
s of this one refuses such a request as EXPIRED instead.  The record therefore outlives every copy of its
request that could still be applied, whether it waited in a stopped server's socket, a forward or a
client's retry loop, and no count of later writes can push it out.  (The 16-entry memory of request ids
this replaces could; issue 42.)  Assumed: the servers' wall clocks agree within ``SKEW`` s.  A client's
clock only sets its own deadlines (a slow one finds its requests EXPIRED; ``MAX_AHEAD`` caps a fast one).

Reads (GET) need no record: answering one twice is harmless.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

ENTRY = struct.Struct("!QQIH")
RECORD = struct.Struct("!QQ")
NOT_FOUND = 1 << 63          # result bit: a DELETE that found nothing
SKEW = 30                    # s the servers' clocks may disagree; an entry outlives its last deadline by this
MAX_AHEAD = 300              # s a request's deadline may lie ahead of the server's clock (a client's budget)
MAX_BYTES = 0xFFFF           # a key's table (it rides in the state record's 2-byte length)
MAX_RECORDS = 1024           # records one client may hold on one key (its unacknowledged writes of that key)

NEW, DONE, STALE = "new", "done", "stale"


class SessionFull(Exception):
    """The key's table cannot take another record now; the message says why and when it frees up."""


@dataclass
class Entry:
    floor: int
    until: int
    records: dict[int, int] = field(default_factory=dict)   # seq -> result


def parse(blob: bytes) -> dict[int, Entry]:
    """The table as {client: Entry}; ValueError if ``blob`` is not one."""
    table: dict[int, Entry] = {}
    off, end = 0, len(blob)
    while off < end:
        if off + ENTRY.size > end:
            raise ValueError(f"truncated completion table at byte {off}")
        client, floor, until, n = ENTRY.unpack_from(blob, off)
        off += ENTRY.size
        if off + n * RECORD.size > end:
            raise ValueError("truncated completion table: its records run past the blob")
        recs = dict(RECORD.iter_unpack(blob[off:off + n * RECORD.size])) if n else {}
        off += n * RECORD.size
        table[client] = Entry(floor, until, recs)
    return table


def serialize(table: dict[int, Entry]) -> bytes:
    out = []
    for client, e in table.items():
        out.append(ENTRY.pack(client, e.floor, e.until, len(e.records)))
        out.extend(RECORD.pack(seq, result) for seq, result in e.records.items())
    return b"".join(out)


def lookup(blob: bytes, client: int, seq: int) -> tuple[str, int]:
    """(NEW, 0), (DONE, result) or (STALE, floor) for request ``seq`` of ``client`` on the key holding ``blob``.

    Reads only the client's own entry (a key's table is scanned, never parsed whole, on this path)."""
    off, end = 0, len(blob)
    while off + ENTRY.size <= end:
        c, floor, _until, n = ENTRY.unpack_from(blob, off)
        off += ENTRY.size
        if c == client:
            for i in range(off, off + n * RECORD.size, RECORD.size):
                s, result = RECORD.unpack_from(blob, i)
                if s == seq:
                    return DONE, result
            return (STALE, floor) if seq < floor else (NEW, 0)
        off += n * RECORD.size
    return NEW, 0


def add(blob: bytes, client: int, seq: int, acked: int, deadline: int, result: int, now: float) -> bytes:
    """The table after request ``seq`` of ``client`` (acknowledging all below ``acked``, valid until
    ``deadline``) was applied with ``result``; entries expired at ``now`` drop out.  SessionFull if it would
    not fit (nothing is applied then: the client retries)."""
    table = parse(blob)
    cutoff = now - SKEW
    for c in [c for c, e in table.items() if e.until < cutoff and c != client]:
        del table[c]
    e = table.get(client)
    if e is None:
        e = table[client] = Entry(acked, deadline)
    elif acked > e.floor:
        e.floor = acked
        e.records = {s: r for s, r in e.records.items() if s >= acked}
    e.until = max(e.until, deadline)
    if len(e.records) >= MAX_RECORDS:
        raise SessionFull(f"client {client:#x} has {len(e.records)} unacknowledged writes of this key (the limit "
                          f"is {MAX_RECORDS}): retry once it has their answers")
    e.records[seq] = result
    out = serialize(table)
    if len(out) > MAX_BYTES:
        raise SessionFull(f"the key's completion records would take {len(out)} B (the limit is {MAX_BYTES} B: "
                          f"{len(table)} client sessions wrote it in the last {SKEW} s and more): retry; they expire "
                          f"{SKEW} s after their requests' deadlines")
    return out


def result_of(version: int, not_found: bool) -> int:
    return version | (NOT_FOUND if not_found else 0)


def split_result(result: int) -> tuple[int, bool]:
    """(version, the DELETE found nothing) of a record's result."""
    return result & (NOT_FOUND - 1), bool(result & NOT_FOUND)
