"""Durable storage of one elastic-KVS server: SQLite in WAL mode, fsync'd before every ack.

Why SQLite: it ships with Python (nothing to install), ``synchronous=FULL``
makes every commit durable (the WAL is fsync'd), one commit can carry a whole
batch of writes (group commit: one fsync for many requests), and an index on
the VID key streams exactly one range's keys for a split — where the paper's
one-file-per-key layout needs a directory scan.  The select()-loop baseline
keeps the paper's one file per key (``standard.py``).

Table ``kv``: key (unique), vkey (24-bit VID key, indexed), value (NULL =
deleted: a tombstone keeps the version so a later copy cannot resurrect an
older value), version, done (the key's completion records, ``session.py``:
a retried or late write is recognised wherever the key lives, and they are
written in the transaction of the write they record).

State record (what a split, mirror or replication ships; this module owns it)::

    +-------+-------+---------------+-------+-------+-------+-----+-------+------+
    | klen  | vkey  |    version    |  vlen | flags |  dlen | key | value | done |
    | 2 B   | 4 B   |     8 B       |  2 B  |  1 B  |  2 B  |     |       |      |
    flags bit 0: tombstone (no value); done: the completion table (dlen B)

Applying a record is version-gated: it wins only over an older version, so
snapshot chunks and live replication may arrive in any order.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sqlite3
import struct
import threading
from typing import Iterator

from vfab.services.elastic_kvs.proto import KvsError, vkey
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BackendError
from vfab.vid.state.sqlstore import SqliteStore, why

log = logging.getLogger("vfab.kvs.store")
REC = struct.Struct("!HIQHBH")
TOMBSTONE = 1
# A commit that takes the WAL past this many pages copies them into the database file before it returns (the
# loop's thread waits): 256 pages (1 MB) instead of SQLite's 1,000 cut the longest chunk of a 100k-key copy
# from ~10-14 ms to ~6 ms, for the same total work.
CHECKPOINT_PAGES = 256
DROP_CHUNK = 4000  # records deleted per transaction (a drop never holds the write lock for long)


class StoreError(KvsError, BackendError):
    """The store could not read or write; the message names the cause (e.g. the disk is full)."""


# A rowid table clustered by VID key: a row's id is (vkey << ID_BITS) + n, the next free n of its vkey, so
# a range's rows lie together in the table in vkey order.  A copy arrives in vkey order: a fresh one appends
# at the table's right edge, one over an older copy (a merge back) rewrites each page once, a drop deletes
# whole pages.  (With ids in arrival order, a merge's upserts hit table pages at random: 3-4x slower.  Rows of
# ~1 KB in a WITHOUT ROWID table spill into overflow pages: also 3-4x slower.)  Every index leads with the
# VID key too; a key is looked up as (vkey, k), vkey being a hash of k.  Should 2^ID_BITS keys ever share one
# vkey, further ones take ordinary rowids (correct, only not clustered).  kv_live counts live keys per range
# from the index alone (load reports, op totals).  ``gen``: the copy generation a row arrived with (0 =
# written here); see begin_copy.  kv_vkey_gen finds a range's rows of earlier generations from the index
# alone: clearing after a copy that overwrote every row reads no table row.
ID_BITS = 20
LAYOUT = 3            # PRAGMA user_version of this layout; older stores are converted on open
SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (id INTEGER PRIMARY KEY, k BLOB NOT NULL, vkey INTEGER NOT NULL, value BLOB,
                               version INTEGER NOT NULL, done BLOB NOT NULL, gen INTEGER NOT NULL DEFAULT 0,
                               UNIQUE (vkey, k));
CREATE INDEX IF NOT EXISTS kv_vkey_gen ON kv (vkey, gen);
CREATE INDEX IF NOT EXISTS kv_live ON kv (vkey) WHERE value IS NOT NULL;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# The id a new row of vkey ?1 gets: the next free one of its block (NULL, an ordinary rowid, if it is full).
NEW_ID = f"""(SELECT CASE WHEN max(id) IS NULL THEN ?1 << {ID_BITS} WHEN max(id) < (?1 << {ID_BITS}) + {(1 << ID_BITS) - 1}
              THEN max(id) + 1 END FROM kv WHERE id BETWEEN ?1 << {ID_BITS} AND (?1 << {ID_BITS}) + {(1 << ID_BITS) - 1})"""
# Applying a record (replication, copies): ?1 vkey, ?2 key, ?3 value (NULL: a tombstone), ?4 version, ?5 done,
# ?6 the copy's generation (0: none), ?7 whether it also wins over rows of earlier generations (see apply).
# Run by Store.apply and by the native part (native/kvs_native.c), which binds the same parameters.
UPSERT = (f"INSERT INTO kv (id, k, vkey, value, version, done, gen) VALUES ({NEW_ID},?2,?1,?3,?4,?5,?6) "
          "ON CONFLICT(vkey, k) DO UPDATE SET value=excluded.value, version=excluded.version, "
          "done=excluded.done, gen=excluded.gen WHERE excluded.version > kv.version OR (?7 AND kv.gen < excluded.gen)")
# A range's rows in the order a snapshot ships them (?1 lo, ?2 hi): Store.snapshot and the native part.
SNAPSHOT = "SELECT k, vkey, value, version, done FROM kv WHERE vkey BETWEEN ?1 AND ?2 ORDER BY vkey"
# Earlier layouts (a WITHOUT ROWID table keyed on k; rowid tables with k UNIQUE and ids in arrival order; the
# 16 request ids per key of layouts 1-2, which are not completion records and are left behind), converted on
# open in one transaction.  The old table's indexes follow it through the rename: drop them so
# SCHEMA makes new ones.
MIGRATE = """
ALTER TABLE kv RENAME TO kv_old;
DROP INDEX IF EXISTS kv_vkey;
DROP INDEX IF EXISTS kv_vkey_gen;
DROP INDEX IF EXISTS kv_live;
""" + SCHEMA + f"""
INSERT INTO kv (id, k, vkey, value, version, done, gen)
    SELECT CASE WHEN n < {1 << ID_BITS} THEN (vkey << {ID_BITS}) + n END, k, vkey, value, version, x'', {{gen}}
    FROM (SELECT *, row_number() OVER (PARTITION BY vkey ORDER BY k) - 1 AS n FROM kv_old) ORDER BY vkey;
DROP TABLE kv_old;
PRAGMA user_version = {LAYOUT};
"""


def pack_record(k: bytes, vk: int, value: bytes | None, version: int, done: bytes) -> bytes:
    flags = TOMBSTONE if value is None else 0
    value = value or b""
    return REC.pack(len(k), vk, version, len(value), flags, len(done)) + k + value + done


def unpack_records(blob: bytes) -> Iterator[tuple[bytes, int, bytes | None, int, bytes]]:
    off, end = 0, len(blob)
    while off < end:
        if off + REC.size > end:
            raise KvsError(f"truncated state record at byte {off}")
        klen, vk, version, vlen, flags, dlen = REC.unpack_from(blob, off)
        off += REC.size
        k = blob[off:off + klen]
        off += klen
        value = None if flags & TOMBSTONE else blob[off:off + vlen]
        off += vlen
        done = blob[off:off + dlen]
        off += dlen
        if off > end:
            raise KvsError("truncated state record: lengths run past the blob")
        yield bytes(k), vk, (bytes(value) if value is not None else None), version, bytes(done)


class Store(SqliteStore):
    """One SQLite database per server; each thread gets its own connection (``SqliteStore``)."""

    Error = StoreError
    WHAT = "store"
    CHECKPOINT_PAGES = CHECKPOINT_PAGES

    def __init__(self, path: str):
        super().__init__(path)
        old = self.db.execute("SELECT sql FROM sqlite_master WHERE name='kv'").fetchone()
        if old is None:
            self.db.executescript(SCHEMA + f"PRAGMA user_version = {LAYOUT};")
        elif self.db.execute("PRAGMA user_version").fetchone()[0] < LAYOUT:
            log.warning("%s: converting the store to the current layout (one transaction)", path)
            gen = "gen" if "gen INTEGER" in old[0] else "0"
            self.db.executescript("BEGIN IMMEDIATE;" + MIGRATE.format(gen=gen) + "COMMIT;")
        self.grow_wal()

    def row(self, k: bytes) -> tuple[bytes | None, int, bytes] | None:
        """(value or None if deleted, version, completion table) of a key, or None if never written."""
        return self._exec("SELECT value, version, done FROM kv WHERE vkey=? AND k=?", (vkey(k), k)).fetchone()

    def record(self, k: bytes) -> bytes:
        """The state record of a key as it is now (b"" if never written)."""
        row = self.row(k)
        return pack_record(k, vkey(k), row[0], row[1], row[2]) if row else b""

    def write(self, k: bytes, value: bytes | None, version: int, done: bytes,
              row: tuple | None | bool = False) -> bytes:
        """Put (value) or delete (None) inside the open transaction, as ``version`` with the completion table
        ``done`` (``session.add``: the write's own record in it); returns the key's state record.
        ``row``: the key's row as the caller just read it (saves reading it again).
        """
        if row is False:
            row = self.row(k)
        vk = vkey(k)
        if row is None:
            self._exec(f"INSERT INTO kv (id, k, vkey, value, version, done) VALUES ({NEW_ID},?2,?1,?3,?4,?5)",
                       (vk, k, value, version, done))
        else:  # in place: the row keeps its id, its index entries stay unless it turns live or dead
            self._exec("UPDATE kv SET value=?, version=?, done=? WHERE vkey=? AND k=?",
                       (value, version, done, vk, k))
        return pack_record(k, vk, value, version, done)

    # -- state transfer --------------------------------------------------------
    def count(self, rng: Range) -> int:
        return self._exec("SELECT count(*) FROM kv WHERE vkey BETWEEN ? AND ? AND value IS NOT NULL",
                               (rng.lo, rng.hi)).fetchone()[0]

    def snapshot(self, rng: Range, chunk_bytes: int = 256 * 1024) -> Iterator[tuple[bytes, int]]:
        """(blob of records, number of records) chunks of every key (tombstones too) in ``rng``.

        Reads inside one transaction: a consistent snapshot while the data path keeps writing.  Packed by
        the native part when it is built (the GIL released meanwhile).
        """
        native = self._native()
        if native is not None:
            yield from native.snapshot(rng, chunk_bytes)
            return
        db = self.db
        db.execute("BEGIN")
        try:
            blob, n = [], 0
            size = 0
            for k, vk, value, version, done in db.execute(SNAPSHOT, (rng.lo, rng.hi)):
                rec = pack_record(k, vk, value, version, done)
                blob.append(rec)
                size += len(rec)
                n += 1
                if size >= chunk_bytes:
                    yield b"".join(blob), n
                    blob, n, size = [], 0, 0
            if n:
                yield b"".join(blob), n
        finally:
            db.execute("COMMIT")

    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        """Apply record blobs in one transaction (fsync'd unless ``durable=False``); how many records won.

        Without ``gen`` a record wins over an older version only (replication and copies may arrive in
        any order).  With ``gen`` (a copy's generation) it also wins over any row of an earlier
        generation.  ``durable=False`` (a bulk copy) leaves the commit unsynced until :meth:`sync`.
        A single blob goes through the native part when it is built (a copy's chunk, a replicated batch).
        """
        native = self._native() if len(blobs) == 1 else None
        if native is not None:
            blob = blobs[0]
            return native.apply(blob if isinstance(blob, bytes) else bytes(blob), durable, gen or 0)
        rows = [rec for blob in blobs for rec in unpack_records(blob)]
        g, over = gen or 0, 1 if gen else 0

        def run(db: sqlite3.Connection) -> int:
            before = db.total_changes
            db.executemany(UPSERT, [(vk, k, value, version, done, g, over) for k, vk, value, version, done in rows])
            return db.total_changes - before

        return self._txn(run, durable)

    def _native(self) -> "Native | None":
        """This thread's native part (its own connection to the store), or None: not built, switched off
        (VFAB_KVS_NATIVE=0), or a transaction of this thread's connection is open (the native connection
        would wait for its lock)."""
        lib = native_lib()
        if lib is None or self.db.in_transaction:
            return None
        h = getattr(self._local, "native", None)
        if h is None:
            h = self._local.native = Native(lib, self)
        return h

    def close(self) -> None:
        h = getattr(self._local, "native", None)
        if h is not None:
            h.close()
            self._local.native = None
        super().close()

    def drop(self, rng: Range, limit: int | None = None, below_gen: int | None = None) -> int:
        """Forget the keys of ``rng`` (about ``limit`` of them if given: fewer means none are left);
        with ``below_gen`` only rows of earlier copy generations (what a new copy did not overwrite).

        In slices of about DROP_CHUNK records (one transaction each, found through the vkey index), so
        the data path never waits long for the write lock.  Unsynced: a drop lost to a crash is redone
        at the next start (``keep_only``).
        """
        extra, args = ("", ()) if below_gen is None else (" AND gen < ?", (below_gen,))
        total, lo = 0, rng.lo
        while lo <= rng.hi and (limit is None or total < limit):
            step = DROP_CHUNK if limit is None else min(DROP_CHUNK, limit - total)
            row = self._exec(f"SELECT vkey FROM kv WHERE vkey BETWEEN ? AND ?{extra} ORDER BY vkey LIMIT 1 OFFSET ?",
                             (lo, rng.hi, *args, step)).fetchone()
            cut = rng.hi if row is None else (row[0] if row[0] == lo else row[0] - 1)
            total += self._txn(lambda db, lo=lo, cut=cut: db.execute(
                f"DELETE FROM kv WHERE vkey BETWEEN ? AND ?{extra}", (lo, cut, *args)).rowcount, durable=False)
            lo = cut + 1
        return total


# -- the native part (native/kvs_native.c) -------------------------------------------------------------------
NATIVE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "build", "libvfab_kvs.so")
MAX_RECORD = REC.size + 3 * 0xFFFF   # the largest record the layout can hold
_lib: ctypes.CDLL | None = None
_lib_tried = False
_lib_lock = threading.Lock()


def native_lib() -> ctypes.CDLL | None:
    """The native part's library (built by bootstrap: ``make -C services/elastic-kvs/native``), or None with
    one warning saying why (the store then does the same work in Python, slower)."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    with _lib_lock:
        if _lib_tried:
            return _lib
        if os.environ.get("VFAB_KVS_NATIVE", "1") == "0":
            log.info("native part switched off (VFAB_KVS_NATIVE=0): records are applied and packed in Python")
        elif not os.path.exists(NATIVE_PATH):
            log.warning("native part not built (%s missing; run 'make -C %s'): records are applied and packed in "
                        "Python, copies run slower", NATIVE_PATH, os.path.dirname(os.path.dirname(NATIVE_PATH)))
        else:
            try:
                _lib = _declare(ctypes.CDLL(NATIVE_PATH))
            except (OSError, AttributeError) as exc:
                log.warning("native part unusable (%s): records are applied and packed in Python", exc)
        _lib_tried = True
        return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    err = [c.c_char_p, c.c_int]
    lib.kvs_native_open.restype = c.c_void_p
    lib.kvs_native_open.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p, c.c_int, *err]
    lib.kvs_apply.restype = c.c_longlong
    lib.kvs_apply.argtypes = [c.c_void_p, c.c_char_p, c.c_longlong, c.c_int, c.c_longlong, c.POINTER(c.c_double),
                              *err]
    lib.kvs_native_close.restype = None
    lib.kvs_native_close.argtypes = [c.c_void_p]
    lib.kvs_snapshot_begin.restype = c.c_int
    lib.kvs_snapshot_begin.argtypes = [c.c_void_p, c.c_longlong, c.c_longlong, *err]
    lib.kvs_snapshot_next.restype = c.c_longlong
    lib.kvs_snapshot_next.argtypes = [c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong, c.POINTER(c.c_longlong),
                                      *err]
    lib.kvs_snapshot_end.restype = None
    lib.kvs_snapshot_end.argtypes = [c.c_void_p]
    return lib


class Native:
    """A connection of the native part, for one thread (like SqliteStore's connections)."""

    ERR = 512

    def __init__(self, lib: ctypes.CDLL, store: Store):
        self.lib, self.store = lib, store
        self.err = ctypes.create_string_buffer(self.ERR)
        self.commit_s = ctypes.c_double()
        self.h = lib.kvs_native_open(store.path.encode(), UPSERT.encode(), SNAPSHOT.encode(), CHECKPOINT_PAGES,
                                    self.err, self.ERR)
        if not self.h:
            raise StoreError(f"cannot open the store {store.path}: {self._error()}; check the --data directory")

    def _error(self) -> str:
        return self.err.value.decode(errors="replace")

    def _store_error(self) -> StoreError:
        return StoreError(why(sqlite3.OperationalError(self._error()), self.store.path))

    def apply(self, blob: bytes, durable: bool, gen: int) -> int:
        n = self.lib.kvs_apply(self.h, blob, len(blob), int(durable), gen, ctypes.byref(self.commit_s), self.err,
                               self.ERR)
        self.store._account_disk(self.commit_s.value)
        if n == -1:
            raise KvsError(self._error())
        if n < 0:
            raise self._store_error()
        return n

    def snapshot(self, rng: Range, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
        cap = chunk_bytes + MAX_RECORD
        buf = ctypes.create_string_buffer(cap)
        nrec = ctypes.c_longlong()
        if self.lib.kvs_snapshot_begin(self.h, rng.lo, rng.hi, self.err, self.ERR) < 0:
            raise self._store_error()
        try:
            while True:
                n = self.lib.kvs_snapshot_next(self.h, buf, cap, chunk_bytes, ctypes.byref(nrec), self.err, self.ERR)
                if n == -1:
                    raise KvsError(self._error())
                if n < 0:
                    raise self._store_error()
                if n == 0:
                    return
                yield ctypes.string_at(buf, n), nrec.value
        finally:
            self.lib.kvs_snapshot_end(self.h)

    def close(self) -> None:
        if self.h:
            self.lib.kvs_native_close(self.h)
            self.h = None

    def __del__(self) -> None:
        # a thread that ends (an operation's) drops its thread-local Native: its connection must not leak
        self.close()
