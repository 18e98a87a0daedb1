"""The stores' write-ahead log grown ahead (``SqliteStore.grow_wal``): full size from the start, nothing read
from the zeros after a crash, SQLite's write lock respected, a full disk tolerated."""

from __future__ import annotations

import os
import sqlite3
import threading

from vfab.services.elastic_kvs.store import CHECKPOINT_PAGES, Store
from vfab.vid.ranges import Range
from vfab.vid.state import sqlstore

FULL = Range(0, (1 << 24) - 1)
WANT = sqlstore.WAL_HEADER + (CHECKPOINT_PAGES + sqlstore.WAL_SLACK) * (sqlstore.WAL_FRAME + 4096)


def put_each(s: Store, keys: list[bytes], reqid: int = 1) -> None:
    """One durable commit per key."""
    for i, k in enumerate(keys):
        s.begin()
        s.write(k, b"v-" + k, 1, b"")
        s.commit()


def test_the_wal_has_its_full_size_at_once_and_keeps_it(tmp_path):
    s = Store(str(tmp_path / "kv.db"))
    try:
        wal = s.path + "-wal"
        assert os.path.getsize(wal) == WANT
        put_each(s, [f"k{i}".encode() for i in range(3 * CHECKPOINT_PAGES)])   # several checkpoints' worth
        assert os.path.getsize(wal) == WANT       # rewritten from its start after each checkpoint, never grown
        assert s.count(FULL) == 3 * CHECKPOINT_PAGES
    finally:
        s.close()


def test_after_a_crash_every_commit_is_read_back_and_no_zero_is_taken_for_a_frame(tmp_path):
    path = str(tmp_path / "kv.db")
    pid = os.fork()
    if pid == 0:   # the child commits and dies without closing (kill -9 alike): its WAL stays, zeros and all
        try:
            s = Store(path)
            put_each(s, [f"k{i}".encode() for i in range(CHECKPOINT_PAGES + 50)])
            s.begin()
            s.write(b"uncommitted", b"x", 1, b"")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.getsize(path + "-wal") == WANT
    s = Store(path)
    try:
        assert s.count(FULL) == CHECKPOINT_PAGES + 50
        assert s.row(b"uncommitted") is None
        assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        s.close()


def test_growing_waits_for_a_writer_that_holds_the_lock(tmp_path):
    """The zeros go past the WAL's end only while no other connection can append a frame there."""
    path = str(tmp_path / "kv.db")
    Store(path).close()                     # the schema; the last close removes the WAL
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("PRAGMA journal_mode=WAL")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO kv (vkey, k, value, version, done) VALUES (1, x'01', x'02', 1, x'')")
    size = os.path.getsize(path + "-wal")
    opened: list[Store] = []
    t = threading.Thread(target=lambda: opened.append(Store(path)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and os.path.getsize(path + "-wal") == size   # waiting for the lock, nothing written
    other.execute("COMMIT")
    t.join(30)
    assert opened and os.path.getsize(path + "-wal") == WANT
    try:
        assert opened[0].db.execute("SELECT count(*) FROM kv").fetchone()[0] == 1   # the other's commit
    finally:
        opened[0].close()
        other.close()


def test_a_disk_too_small_for_it_leaves_the_wal_as_it_was(small_disk, caplog):
    caplog.set_level("INFO", logger="vfab.state.store")
    s = Store(str(small_disk / "kv.db"))      # 1 MiB: less than WANT
    try:
        wal = s.path + "-wal"
        assert 0 < os.path.getsize(wal) < WANT
        assert "the WAL was not grown to" in caplog.text and "it grows as written" in caplog.text
        put_each(s, [b"a", b"b"])
        assert s.count(FULL) == 2
    finally:
        s.close()
