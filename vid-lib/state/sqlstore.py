"""What the SQLite stores of stateful services share: one database file in WAL mode, a connection per thread,
commits fsync'd unless asked otherwise, errors that name their cause, and the state layer's housekeeping.

A service's store (elastic-KVS's ``store.py``, sdhcp's ``store.py``) subclasses :class:`SqliteStore`, sets
``Error`` (its StoreError) and ``WHAT`` (how the error messages call it), and adds its tables and the
backend's ``count/snapshot/apply/drop``; ``keep_only`` is built on its ``drop``.

Durability: ``synchronous=FULL`` by default, so a commit returns once the write-ahead log is on disk.
``begin(durable=False)`` and ``_txn(fn, durable=False)`` commit without waiting for the disk (atomic; a power
loss can lose them, and only them); the next durable commit, or :meth:`sync`, makes them durable too.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time

from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import Range

log = logging.getLogger("vfab.state.store")
WAL_HEADER, WAL_FRAME = 32, 24    # bytes of SQLite's WAL header, and of each frame's header before its page
SQLITE_CHECKPOINT_PAGES = 1000     # SQLite's default wal_autocheckpoint
WAL_SLACK = 64                     # frames beyond the checkpoint threshold: the commit that crosses it


def why(exc: sqlite3.Error, path: str) -> str:
    """SQLite's error in words an operator can act on."""
    text = str(exc)
    if "full" in text:
        return f"{text} ({path}): free space on that file system"
    if "readonly" in text or "read-only" in text:
        return f"{text} ({path}): the store is read-only; check permissions and mounts"
    return f"{text} ({path})"


class SqliteStore:
    """One SQLite database; each thread gets its own connection (``db``)."""

    Error: type[Exception] = RuntimeError   # the service's StoreError
    WHAT = "store"                          # "cannot open the <WHAT> <path>"
    CHECKPOINT_PAGES: int | None = None     # PRAGMA wal_autocheckpoint (None: SQLite's 1,000 pages)

    def __init__(self, path: str):
        self.path = path
        # Another writer of the same database in this process (sdhcp's native lane) takes this lock for each of
        # its transactions; so does every write transaction here (acquire/release, blocking).  None: no other.
        self.writer_lock = None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._local = threading.local()

    @property
    def db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                if self.CHECKPOINT_PAGES is not None:
                    conn.execute(f"PRAGMA wal_autocheckpoint={self.CHECKPOINT_PAGES}")
            except sqlite3.Error as exc:
                raise self.Error(f"cannot open the {self.WHAT} {self.path}: {exc}; check the --data directory") \
                    from None
            self._local.conn = conn
        return conn

    def data_version(self) -> int:
        """SQLite's ``data_version`` on this thread's connection: it changes when another connection (another
        thread's, sdhcp's native lane's, another process's) committed since this thread last asked, never for
        this connection's own commits.  A thread that only reads may keep what it counted while it stays."""
        return self._exec("PRAGMA data_version").fetchone()[0]

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            return self.db.execute(sql, args)
        except sqlite3.Error as exc:
            raise self.Error(why(exc, self.path)) from None

    def _exec_script(self, sql: str) -> None:
        try:
            self.db.executescript(sql)
        except sqlite3.Error as exc:
            raise self.Error(why(exc, self.path)) from None

    def _synchronous(self, durable: bool) -> None:
        """Set the connection's commit durability; the PRAGMA cannot change inside a transaction."""
        relaxed = getattr(self._local, "relaxed", False)
        if relaxed == durable:
            self.db.execute("PRAGMA synchronous=" + ("FULL" if durable else "NORMAL"))
            self._local.relaxed = not durable

    # -- the data path: one transaction per batch ------------------------------------------
    def _lock(self) -> None:
        lock = self.writer_lock
        if lock is not None and getattr(self._local, "held", None) is None:
            lock.acquire()
            self._local.held = lock   # released as taken, even if the store lets go of it meanwhile (a closing lane)

    def _unlock(self) -> None:
        lock = getattr(self._local, "held", None)
        if lock is not None:
            self._local.held = None
            lock.release()

    def begin(self, durable: bool = True) -> None:
        """Open the batch's transaction.  ``durable`` (the default): its commit fsyncs the write-ahead log.
        ``durable=False``: its commit does not wait for the disk (see the module's docstring)."""
        self._lock()
        try:
            try:
                self._synchronous(durable)
            except sqlite3.Error as exc:
                raise self.Error(why(exc, self.path)) from None
            self._exec("BEGIN IMMEDIATE")
        except BaseException:
            self._unlock()
            raise

    def commit(self) -> None:
        """Commit the batch: after a durable ``begin`` the write-ahead log is fsync'd before this returns."""
        try:
            self._commit(self.db)
        except sqlite3.Error as exc:
            raise self.Error(why(exc, self.path)) from None   # the caller rolls back (and so unlocks)
        self._unlock()

    def _commit(self, db: sqlite3.Connection) -> None:
        t0 = time.perf_counter()
        try:
            db.execute("COMMIT")
        finally:
            self._disk(t0)

    def _disk(self, t0: float) -> None:
        self._account_disk(time.perf_counter() - t0)

    def _account_disk(self, seconds: float) -> None:
        """Add ``seconds`` of committing or syncing to the calling thread's :meth:`disk_seconds`."""
        self._local.disk_s = getattr(self._local, "disk_s", 0.0) + seconds

    def disk_seconds(self) -> float:
        """Wall seconds the calling thread has spent committing (with the checkpoints a commit runs: writes and
        fsyncs) and syncing: what a slow disk costs that thread."""
        return getattr(self._local, "disk_s", 0.0)

    def rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already (it does on a full disk)."""
        try:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.warning("rollback of %s failed: %s", self.path, exc)
        finally:
            self._unlock()

    def _txn(self, fn, durable: bool = True):
        """Run ``fn(db)`` in one write transaction; the error names the cause, never the rollback's."""
        db = self.db
        self._lock()
        try:
            self._synchronous(durable)
            db.execute("BEGIN IMMEDIATE")
            out = fn(db)
            self._commit(db)
            return out
        except sqlite3.Error as exc:
            self.rollback()
            raise self.Error(why(exc, self.path)) from None
        except BaseException:
            self.rollback()
            raise
        finally:
            self._unlock()

    def grow_wal(self) -> None:
        """Give the write-ahead log now the size it reaches anyway, as written blocks (zeros past its end).

        Once written, the WAL is rewritten from its start after each checkpoint and never shrinks, so the
        fdatasync before a reply writes data only.  While it still grows (a new or restarted store: SQLite
        deletes the WAL when its last connection closes) every sync also commits the file system's journal
        for the new blocks: a fresh store's first durable commits took 0.69x the time and 0.73x the
        machine's CPU with the WAL grown (bench/store_sync.py); PostgreSQL zero-fills its WAL segments for
        the same reason.
        SQLite reads frames only up to the first whose salt or checksum does not match, so zeros past the
        last frame are never taken for one, and SQLite's write lock is held meanwhile, so no other
        connection appends one under the zeros.  Each store's ``__init__`` calls it after its schema (the
        WAL exists after a first write).  A full disk leaves the WAL as it was, growing as it goes.
        """
        wal = self.path + "-wal"
        if not os.path.exists(wal):
            return   # no WAL yet: SQLite makes it with the first write
        try:
            page = self.db.execute("PRAGMA page_size").fetchone()[0]
            self.db.execute("BEGIN IMMEDIATE")   # SQLite's write lock: no frame is appended meanwhile
        except sqlite3.Error as exc:
            log.info("%s: the WAL was not grown ahead (%s): it grows as written", self.path, exc)
            return
        try:
            fd = os.open(wal, os.O_WRONLY)
            try:
                size = os.fstat(fd).st_size
                want = WAL_HEADER + ((self.CHECKPOINT_PAGES or SQLITE_CHECKPOINT_PAGES) + WAL_SLACK) * (WAL_FRAME + page)
                if size < want:
                    try:
                        at = size
                        while at < want:   # a short write (the disk filled up) is followed by one that fails
                            wrote = os.pwrite(fd, bytes(min(want - at, 1 << 20)), at)
                            if wrote <= 0:
                                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                            at += wrote
                        os.fdatasync(fd)
                    except OSError as exc:
                        os.ftruncate(fd, size)
                        log.info("%s: the WAL was not grown to %d bytes ahead (%s): it grows as written", self.path,
                                 want, exc.strerror)
            finally:
                os.close(fd)
        except OSError as exc:
            log.info("%s: the WAL was not grown ahead (%s): it grows as written", self.path, exc.strerror)
        finally:
            self.db.execute("ROLLBACK")

    def sync(self) -> None:
        """Make every earlier commit durable: fdatasync the write-ahead log, as SQLite syncs it itself.

        fdatasync writes the file's data and whatever metadata reading it back needs (its size when it
        grew), not its times: the WAL is rewritten from its start after each checkpoint, so in the steady
        state its size stays put and no inode write joins each sync (fsync wrote one every time).

        Only the WAL: what a checkpoint moved into the database file was fsync'd by that checkpoint
        (synchronous=NORMAL does that).  Never open and close the database file itself here: closing
        any descriptor of it drops every POSIX lock this process holds on it, and another process that
        then closes its own connection believes it is the last one and deletes the live WAL.
        """
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return  # no WAL: everything is in the database file, synced by the checkpoint that emptied it
        t0 = time.perf_counter()
        try:
            os.fdatasync(fd)
        except OSError as exc:
            raise self.Error(f"fdatasync of {self.path}-wal failed: {exc.strerror}") from None
        finally:
            os.close(fd)
            self._disk(t0)

    # -- copies --------------------------------------------------------------------------------
    def begin_copy(self) -> int:
        """A new copy generation, kept in the store's ``meta (name PRIMARY KEY, value)`` table (every
        store built on this one has it): records applied with it win over every row an earlier copy or
        this endpoint left in the range, whatever their versions (a stale copy can hold a version that
        was never acknowledged and collides with a newer one); ``drop(..., below_gen=G)`` then removes
        what the copy did not overwrite."""
        def run(db: sqlite3.Connection) -> int:
            row = db.execute("SELECT value FROM meta WHERE name='gen'").fetchone()
            gen = (row[0] if row else 0) + 1
            db.execute("INSERT INTO meta (name, value) VALUES ('gen', ?) "
                       "ON CONFLICT(name) DO UPDATE SET value=excluded.value", (gen,))
            return gen

        return self._txn(run)

    # -- housekeeping ------------------------------------------------------------------------
    def drop(self, rng: Range, limit: int | None = None, below_gen: int | None = None) -> int:
        raise NotImplementedError

    def keep_only(self, ranges: list[Range]) -> int:
        """Forget every row outside ``ranges`` (what a crash left behind); returns how many."""
        total, lo = 0, 0
        for r in sorted(ranges, key=lambda r: r.lo):
            if r.lo > lo:
                total += self.drop(Range(lo, r.lo - 1))
            lo = max(lo, r.hi + 1)
        if lo <= KEY_MAX:
            total += self.drop(Range(lo, KEY_MAX))
        return total

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
