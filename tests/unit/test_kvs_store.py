"""services/elastic-kvs/store.py: the SQLite store of one elastic-KVS server (on a tmp_path file)."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from vfab.services.elastic_kvs import session
from vfab.services.elastic_kvs import store as store_mod
from vfab.services.elastic_kvs.proto import KvsError, vkey
from vfab.services.elastic_kvs.store import REC, Store, pack_record, unpack_records
from vfab.vid.ranges import Range

FULL = Range(0, (1 << 24) - 1)
C1, C2 = 0xAAAA, 0xBBBB


DEADLINE = int(time.time()) + 60   # a fixed deadline for tables compared byte for byte (tab)


def deadline() -> int:
    """A request's deadline a minute from now (taken per write: one fixed at import passed, with the expiry's 30 s,
    while a long unit run reached this file, and the store dropped the first client's records)."""
    return int(time.time()) + 60


def tab(client: int, seq: int, version: int = 1) -> bytes:
    """A completion table with one record (the store keeps it as it is given: session.py reads it)."""
    return session.serialize({client: session.Entry(0, DEADLINE, {seq: version})})


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Run a test with the native part (native/kvs_native.c, built by bootstrap) and with the Python one."""
    if request.param == "python":
        monkeypatch.setattr(store_mod, "native_lib", lambda: None)
    else:
        assert store_mod.native_lib() is not None, f"{store_mod.NATIVE_PATH} is not built: run 'make bootstrap'"
    return request.param


@pytest.fixture
def st(tmp_path):
    s = Store(str(tmp_path / "kv.db"))
    yield s
    s.rollback()
    s.close()


def write(s: Store, k: bytes, v: bytes | None, client: int, reqid: int) -> tuple[int, bool, bytes]:
    """What the backend does with a write, in the open transaction: (version, applied, record); a request
    its completion record names is not applied again (the backend's own tests cover the rest)."""
    row = s.row(k)
    done = row[2] if row else b""
    seen, result = session.lookup(done, client, reqid)
    if seen != session.NEW:
        return session.split_result(result)[0], False, b""
    version = (row[1] if row else 0) + 1
    done = session.add(done, client, reqid, 0, deadline(), session.result_of(version, False), time.time())
    return version, True, s.write(k, v, version, done, row)


def put(s: Store, k: bytes, v: bytes | None, client: int = C1, reqid: int = 1):
    s.begin()
    try:
        out = write(s, k, v, client, reqid)
    except BaseException:
        s.rollback()
        raise
    s.commit()
    return out


def fill(s: Store, n: int, prefix: str = "key", start_reqid: int = 1) -> list[bytes]:
    keys = [f"{prefix}-{i}".encode() for i in range(n)]
    s.begin()
    for i, k in enumerate(keys):
        write(s, k, b"val-" + k, C1, start_reqid + i)
    s.commit()
    return keys


def table(s: Store) -> dict[bytes, tuple]:
    return {k: (v, ver, rec) for k, v, ver, rec in s.db.execute("SELECT k, value, version, done FROM kv")}


def all_records(s: Store, rng: Range = FULL, chunk_bytes: int = 256 * 1024) -> list[tuple]:
    return [r for blob, _n in s.snapshot(rng, chunk_bytes) for r in unpack_records(blob)]


# -- the data path ------------------------------------------------------------------


def test_write_and_row_in_a_transaction(st):
    assert st.row(b"k") is None
    st.begin()
    record = st.write(b"k", b"v1", 1, tab(C1, 1))
    # visible to the same connection before the commit
    assert st.row(b"k") == (b"v1", 1, tab(C1, 1))
    st.commit()
    assert st.row(b"k") == (b"v1", 1, tab(C1, 1))
    assert list(unpack_records(record)) == [(b"k", vkey(b"k"), b"v1", 1, tab(C1, 1))]


def test_rollback_discards_the_write(st):
    st.begin()
    st.write(b"k", b"v", 1, tab(C1, 1))
    st.rollback()
    assert st.row(b"k") is None
    st.rollback()  # no transaction open: a no-op, not an error


def test_uncommitted_write_is_invisible_to_another_thread(st):
    st.begin()
    st.write(b"k", b"v", 1, tab(C1, 1))
    seen = []
    t = threading.Thread(target=lambda: (seen.append(st.row(b"k")), st.close()))
    t.start()
    t.join(5)
    st.commit()
    assert seen == [None]
    assert st.row(b"k")[0] == b"v"


def test_versions_grow_by_one(st):
    assert [put(st, b"k", f"v{i}".encode(), C1, i)[0] for i in (1, 2, 3)] == [1, 2, 3]
    assert st.row(b"k")[:2] == (b"v3", 3)
    # versions are per key
    assert put(st, b"other", b"x", C1, 4)[0] == 1


def test_empty_value_is_a_value_not_a_tombstone(st):
    put(st, b"k", b"", C1, 1)
    assert st.row(b"k")[:2] == (b"", 1)
    assert st.count(FULL) == 1


def test_delete_leaves_a_tombstone_and_put_continues_the_version(st):
    put(st, b"k", b"v1", C1, 1)
    put(st, b"k", b"v2", C1, 2)
    version, applied, record = put(st, b"k", None, C1, 3)
    assert (version, applied) == (3, True)
    value, ver, _recent = st.row(b"k")
    assert (value, ver) == (None, 3)
    assert list(unpack_records(record))[0][2:4] == (None, 3)
    assert st.count(FULL) == 0
    version, applied, _ = put(st, b"k", b"v4", C1, 4)
    assert (version, applied) == (4, True)
    assert st.row(b"k")[:2] == (b"v4", 4)


def test_completion_records_are_in_the_row_and_its_state_record(st):
    """The store keeps a key's completion table in the row, written in the write's transaction, and ships it
    in the key's state record (what session.py decides from it is tested there and in the backend)."""
    assert put(st, b"k", b"first", C1, 7)[:2] == (1, True)
    assert put(st, b"k", b"first", C1, 7) == (1, False, b"")
    assert put(st, b"k", b"c2", C2, 7)[:2] == (2, True)   # the same id from another client is another operation
    done = st.row(b"k")[2]
    assert session.lookup(done, C1, 7) == (session.DONE, 1) and session.lookup(done, C2, 7) == (session.DONE, 2)
    assert list(unpack_records(st.record(b"k")))[0][4] == done


def test_data_survives_close_and_reopen(tmp_path):
    path = str(tmp_path / "sub" / "dir" / "kv.db")  # parent directories are created
    s = Store(path)
    keys = fill(s, 50)
    put(s, keys[0], b"updated", C2, 1)
    put(s, keys[1], None, C2, 2)
    before = table(s)
    s.close()
    s2 = Store(path)
    try:
        assert table(s2) == before
        assert s2.row(keys[0])[:2] == (b"updated", 2)
        assert s2.row(keys[1])[:2] == (None, 2)
        assert s2.count(FULL) == 49
        # the completion records survive the restart too
        assert put(s2, keys[0], b"updated", C2, 1) == (2, False, b"")
        assert put(s2, keys[0], b"after restart", C2, 3)[:2] == (3, True)
    finally:
        s2.close()


def test_open_failure_is_a_kvs_error(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(KvsError, match=r"cannot open the store .*adir"):
        Store(str(tmp_path / "adir"))


# -- snapshot / count / drop -----------------------------------------------------------


def test_snapshot_yields_exactly_the_range_with_tombstones(st, impl):
    keys = fill(st, 400)
    for k in keys[::10]:
        put(st, k, None, C2, 1)
    rng = Range(0x400000, 0xBFFFFF)
    want = {k for k in keys if vkey(k) in rng}
    assert 0 < len(want) < len(keys)
    recs = all_records(st, rng)
    got = {r[0] for r in recs}
    assert got == want
    assert len(recs) == len(want)  # no duplicates
    for k, vk, value, version, recent in recs:
        assert vk == vkey(k)
        assert (value, version, recent) == st.row(k)
    tombs = {k for k in want if k in keys[::10]}
    assert tombs and {r[0] for r in recs if r[2] is None} == tombs
    # a snapshot of the whole space has every key; of a single empty slot, nothing
    assert len(all_records(st)) == 400
    free = next(v for v in range(1 << 24) if v not in {vkey(k) for k in keys})
    assert list(st.snapshot(Range(free, free))) == []


def test_snapshot_range_bounds_are_inclusive(st, impl):
    keys = fill(st, 50)
    vk = vkey(keys[7])
    assert [r[0] for r in all_records(st, Range(vk, vk))] == [keys[7]]
    got = {r[0] for r in all_records(st, Range(0, vk))} | {r[0] for r in all_records(st, Range(vk, FULL.hi))}
    assert got == set(keys)


def test_snapshot_is_chunked_by_chunk_bytes(st, impl):
    keys = fill(st, 300)
    chunk = 2000
    chunks = list(st.snapshot(FULL, chunk_bytes=chunk))
    assert len(chunks) > 5
    total = 0
    for i, (blob, n) in enumerate(chunks):
        recs = list(unpack_records(blob))
        assert len(recs) == n > 0
        total += n
        sizes = [len(pack_record(*r)) for r in recs]
        assert sum(sizes) == len(blob)
        if i < len(chunks) - 1:
            # a chunk is cut as soon as it reaches chunk_bytes: at least chunk_bytes, less without its last record
            assert len(blob) >= chunk
            assert len(blob) - sizes[-1] < chunk
        else:
            assert len(blob) < chunk + sizes[-1]
    assert total == len(keys)
    # the default chunk size holds them all in one
    assert [n for _b, n in st.snapshot(FULL)] == [300]


def test_snapshot_leaves_no_transaction_open(st, impl):
    fill(st, 20)
    list(st.snapshot(FULL, 100))
    assert not st.db.in_transaction
    gen = st.snapshot(FULL, 100)
    next(gen)
    gen.close()  # abandoned half way
    assert not st.db.in_transaction
    # no reader is left pinning the log either (the native part reads on a connection of its own)
    assert st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    put(st, b"after", b"x", C2, 1)
    assert st.row(b"after")[0] == b"x"


def test_count_counts_live_keys_in_the_range(st):
    keys = fill(st, 200)
    for k in keys[:30]:
        put(st, k, None, C2, 1)
    live = keys[30:]
    assert st.count(FULL) == 170
    rng = Range(0, 0x7FFFFF)
    assert st.count(rng) == sum(1 for k in live if vkey(k) in rng)
    assert st.count(Range(0x800000, FULL.hi)) == sum(1 for k in live if vkey(k) >= 0x800000)


def test_drop_removes_only_that_range(st):
    keys = fill(st, 200)
    put(st, keys[0], None, C2, 1)  # a tombstone is dropped too when in range
    rng = Range(0x200000, 0x9FFFFF)
    inside = {k for k in keys if vkey(k) in rng}
    before = table(st)
    assert st.drop(rng) == len(inside)
    after = table(st)
    assert set(after) == set(keys) - inside
    assert all(after[k] == before[k] for k in after)
    assert st.count(rng) == 0
    assert all_records(st, rng) == []
    assert st.drop(rng) == 0
    assert not st.db.in_transaction


# -- apply -------------------------------------------------------------------------------


def test_apply_into_an_empty_store_reproduces_rows_exactly(st, tmp_path, impl):
    keys = fill(st, 120)
    for i, k in enumerate(keys[:40]):
        put(st, k, b"second", C2, i + 1)
    for k in keys[40:50]:
        put(st, k, None, C2, 999)
    put(st, b"empty", b"", C2, 5000)
    blobs = [b for b, _n in st.snapshot(FULL, chunk_bytes=1500)]
    assert len(blobs) > 1
    dst = Store(str(tmp_path / "dst.db"))
    try:
        assert dst.apply(blobs) == 121
        assert table(dst) == table(st)
        assert dst.row(b"empty")[:2] == (b"", 1)
        assert session.lookup(dst.row(b"empty")[2], C2, 5000) == (session.DONE, 1)
        assert dst.count(FULL) == st.count(FULL) == 111
        # vkey is stored too: range queries on the copy agree with the source
        rng = Range(0, 0x5FFFFF)
        assert dst.count(rng) == st.count(rng)
        assert {r[0] for r in all_records(dst, rng)} == {r[0] for r in all_records(st, rng)}
        # the completion records moved with the keys
        assert put(dst, keys[0], b"second", C2, 1) == (2, False, b"")
        assert put(dst, keys[45], None, C2, 999) == (2, False, b"")
        # applying the same snapshot again changes nothing
        assert dst.apply(blobs) == 0
        assert table(dst) == table(st)
    finally:
        dst.close()


def test_apply_is_version_gated(st, impl):
    k = b"key"
    vk = vkey(k)
    r1 = pack_record(k, vk, b"one", 1, tab(C1, 1))
    r2 = pack_record(k, vk, b"two", 2, tab(C1, 1) + tab(C1, 2))
    r3 = pack_record(k, vk, None, 3, tab(C1, 3))
    assert st.apply([r2]) == 1
    assert st.row(k) == (b"two", 2, tab(C1, 1) + tab(C1, 2))
    assert st.apply([r1]) == 0  # older: ignored
    assert st.row(k)[:2] == (b"two", 2)
    assert st.apply([r2]) == 0  # equal: ignored
    assert st.apply([r3]) == 1  # newer tombstone wins
    assert st.row(k) == (None, 3, tab(C1, 3))
    assert st.apply([r1, r2]) == 0  # an older value cannot resurrect a deleted key
    assert st.row(k)[:2] == (None, 3)


def test_apply_older_record_never_overwrites_newer_in_any_order(st, tmp_path, impl):
    import itertools

    k = b"key"
    recs = [pack_record(k, vkey(k), (None if v == 3 else b"v%d" % v), v, tab(C1, v)) for v in (1, 2, 3, 4)]
    for n, order in enumerate(itertools.permutations(recs)):
        dst = Store(str(tmp_path / f"perm{n}.db"))
        try:
            # one record per apply() (separate transactions) and all in one blob
            for r in order:
                dst.apply([r])
            assert dst.row(k) == (b"v4", 4, tab(C1, 4)), order
            dst.drop(FULL)
            dst.apply([b"".join(order)])
            assert dst.row(k) == (b"v4", 4, tab(C1, 4)), order
        finally:
            dst.close()


def test_apply_local_write_newer_than_the_copy_wins(st, impl):
    put(st, b"k", b"a", C1, 1)
    put(st, b"k", b"b", C1, 2)
    stale = pack_record(b"k", vkey(b"k"), b"stale", 1, tab(C2, 1))
    assert st.apply([stale]) == 0
    assert st.row(b"k")[:2] == (b"b", 2)
    # a write after an applied record continues from the applied version
    newer = pack_record(b"k", vkey(b"k"), b"remote", 9, tab(C2, 9))
    assert st.apply([newer]) == 1
    assert put(st, b"k", b"local", C1, 3)[:2] == (10, True)


def test_shuffled_snapshots_converge(st, tmp_path, impl):
    keys = fill(st, 150)
    snap1 = [b for b, _n in st.snapshot(FULL, chunk_bytes=700)]
    rnd = random.Random(1234)
    for i, k in enumerate(rnd.sample(keys, 80)):
        put(st, k, None if i % 4 == 0 else b"new-%d" % i, C2, i + 1)
    for i in range(20):
        put(st, b"fresh-%d" % i, b"f", C2, 1000 + i)
    snap2 = [b for b, _n in st.snapshot(FULL, chunk_bytes=700)]
    want = table(st)
    # split every blob into single records, so the shuffle interleaves records of both snapshots freely
    singles = [pack_record(*r) for blob in snap1 + snap2 for r in unpack_records(blob)]
    results = []
    for trial in range(4):
        order = singles[:]
        random.Random(trial).shuffle(order)
        dst = Store(str(tmp_path / f"conv{trial}.db"))
        try:
            if trial % 2:
                dst.apply(order)
            else:
                for i in range(0, len(order), 37):
                    dst.apply(order[i:i + 37])
            results.append(table(dst))
        finally:
            dst.close()
    assert all(r == want for r in results)


def test_apply_truncated_blob_raises_and_applies_nothing(st, impl):
    good = pack_record(b"a", vkey(b"a"), b"x", 1, b"")
    bad = pack_record(b"b", vkey(b"b"), b"yyyy", 1, tab(C1, 1))[:-3]
    with pytest.raises(KvsError, match="truncated"):
        st.apply([good, bad])
    with pytest.raises(KvsError, match="truncated"):
        st.apply([good + bad])   # one blob: the native apply when built
    with pytest.raises(KvsError, match="truncated state record at byte 0"):
        st.apply([b"\x00" * (REC.size - 1)])
    assert st.row(b"a") is None
    assert not st.db.in_transaction
    assert st.apply([good]) == 1   # the store is usable after


# -- the record format -------------------------------------------------------------------


def test_pack_record_layout():
    rec = pack_record(b"ab", 0x123456, b"xyz", 7, tab(1, 2))
    done = tab(1, 2)
    assert REC.size == 19 and len(done) == 38
    assert rec[:19] == bytes([0, 2, 0, 0x12, 0x34, 0x56]) + (7).to_bytes(8, "big") + bytes([0, 3, 0, 0, 38])
    assert rec[19:] == b"ab" + b"xyz" + done
    tomb = pack_record(b"ab", 1, None, 2, b"")
    assert tomb[14:19] == bytes([0, 0, store_mod.TOMBSTONE, 0, 0])
    assert list(unpack_records(tomb)) == [(b"ab", 1, None, 2, b"")]


def test_unpack_records_round_trip_several():
    recs = [(b"k1", 1, b"v", 1, b""), (b"k2", 2, None, 5, tab(3, 4)), (b"k" * 128, 0xFFFFFF, b"", 9, b"")]
    blob = b"".join(pack_record(*r) for r in recs)
    assert list(unpack_records(blob)) == recs
    assert list(unpack_records(b"")) == []


@pytest.mark.parametrize("cut", [1, 5, 18])
def test_unpack_records_truncated_header(cut):
    blob = pack_record(b"k1", 1, b"v", 1, b"") + pack_record(b"k2", 2, b"w", 1, b"")[:cut]
    it = unpack_records(blob)
    assert next(it)[0] == b"k1"
    with pytest.raises(KvsError, match=r"truncated state record at byte 22"):
        next(it)


@pytest.mark.parametrize("cut", [1, 2, 5, 10, 16])
def test_unpack_records_truncated_body(cut):
    full = pack_record(b"key", 1, b"value", 1, tab(1, 1))  # 19 + 3 + 5 + 38 = 65 B
    assert len(full) == 65
    with pytest.raises(KvsError, match=r"truncated state record: lengths run past the blob"):
        list(unpack_records(full[:-cut]))


# -- concurrency ---------------------------------------------------------------------------


def test_snapshot_while_another_thread_writes_is_consistent(st, impl):
    keys = [b"c-%d" % i for i in range(60)]
    st.begin()
    for k in keys:
        write(st, k, b"gen-0", C1, 1)
    st.commit()
    stop = threading.Event()
    errors: list[BaseException] = []
    gens = [0]

    def writer():
        try:
            g = 0
            while not stop.is_set() and g < 2000:
                g += 1
                # every transaction moves all keys to the next generation together
                st.begin()
                for k in keys:
                    write(st, k, b"gen-%d" % g, C1, g + 1)
                st.commit()
                gens[0] = g
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            st.rollback()
        finally:
            st.close()

    t = threading.Thread(target=writer)
    t.start()
    seen = set()
    snapshots = 0
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline and (snapshots < 25 or len(seen) < 3):
            snapshots += 1
            recs = []
            for blob, _n in st.snapshot(FULL, chunk_bytes=400):
                recs.extend(unpack_records(blob))
                time.sleep(0.001)  # widen the window for a commit to land mid-snapshot
            assert sorted(r[0] for r in recs) == sorted(keys)
            values = {r[2] for r in recs}
            versions = {r[3] for r in recs}
            assert len(values) == 1 and len(versions) == 1, f"torn snapshot: {values} {versions}"
            (value,), (version,) = values, versions
            assert value == b"gen-%d" % (version - 1)
            for k, vk, _v, ver, done in recs:
                assert vk == vkey(k)
                assert session.lookup(done, C1, ver) == (session.DONE, ver)
            seen.add(version)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert errors == []
    assert gens[0] > 0
    assert len(seen) > 1 or gens[0] >= 2000, "the snapshots never overlapped a write"


def test_a_store_of_the_previous_layout_is_converted_with_its_data(tmp_path):
    import sqlite3

    path = str(tmp_path / "old.sqlite")
    with sqlite3.connect(path) as conn:
        conn.executescript("""
            CREATE TABLE kv (k BLOB PRIMARY KEY, vkey INTEGER NOT NULL, value BLOB,
                             version INTEGER NOT NULL, recent BLOB NOT NULL) WITHOUT ROWID;
            CREATE INDEX kv_vkey ON kv (vkey);""")
        conn.execute("INSERT INTO kv VALUES (?,?,?,?,?)", (b"k", vkey(b"k"), b"v", 3, b""))
        conn.execute("INSERT INTO kv VALUES (?,?,?,?,?)", (b"gone", vkey(b"gone"), None, 2, b""))
    s = Store(path)
    try:
        assert s.row(b"k") == (b"v", 3, b"") and s.row(b"gone") == (None, 2, b"")   # (completion records: none)
        assert "WITHOUT ROWID" not in s.db.execute("SELECT sql FROM sqlite_master WHERE name='kv'").fetchone()[0]
        assert s.count(Range(0, 0xFFFFFF)) == 1
    finally:
        s.close()


def test_a_store_keyed_on_k_alone_is_converted_with_its_data_and_generations(tmp_path):
    """The layout before the table was clustered by VID key (k UNIQUE on its own, ids in arrival order):
    converted on open, rows, tombstones and copy generations kept, ids clustered, and a copy's conflict
    target is (vkey, k) afterwards."""
    import sqlite3

    path = str(tmp_path / "old.sqlite")
    with sqlite3.connect(path) as conn:
        conn.executescript("""
            CREATE TABLE kv (id INTEGER PRIMARY KEY, k BLOB NOT NULL UNIQUE, vkey INTEGER NOT NULL, value BLOB,
                             version INTEGER NOT NULL, recent BLOB NOT NULL, gen INTEGER NOT NULL DEFAULT 0);
            CREATE INDEX kv_vkey_gen ON kv (vkey, gen);
            CREATE INDEX kv_live ON kv (vkey) WHERE value IS NOT NULL;""")
        conn.execute("INSERT INTO kv (k, vkey, value, version, recent, gen) VALUES (?,?,?,?,?,?)",
                     (b"k", vkey(b"k"), b"v", 3, b"", 2))
        conn.execute("INSERT INTO kv (k, vkey, value, version, recent, gen) VALUES (?,?,?,?,?,?)",
                     (b"gone", vkey(b"gone"), None, 2, b"", 0))
    s = Store(path)
    try:
        sql = s.db.execute("SELECT sql FROM sqlite_master WHERE name='kv'").fetchone()[0]
        assert "UNIQUE (vkey, k)" in sql and "k BLOB NOT NULL UNIQUE" not in sql
        assert s.row(b"k") == (b"v", 3, b"") and s.row(b"gone") == (None, 2, b"")
        assert s.db.execute("SELECT gen FROM kv WHERE k=?", (b"k",)).fetchone() == (2,)
        assert s.db.execute("SELECT count(*) FROM kv WHERE id >> 20 != vkey").fetchone() == (0,)
        assert s.count(Range(0, 0xFFFFFF)) == 1
        assert s.apply([pack_record(b"k", vkey(b"k"), b"v4", 4, b"")]) == 1
        assert s.row(b"k") == (b"v4", 4, b"")
    finally:
        s.close()


def test_rows_are_clustered_by_vid_key_and_a_full_block_still_takes_new_keys(tmp_path):
    """A row's id is (vkey << 20) + n, whether written here or arriving in a copy, so a range's rows lie
    together; a vkey whose block of ids is full (never in practice: 2^20 keys with one 24-bit hash) still
    takes new keys, under ordinary rowids."""
    s = Store(str(tmp_path / "c.sqlite"))
    t = Store(str(tmp_path / "t.sqlite"))
    try:
        keys = [f"key-{i}".encode() for i in range(300)]
        s.begin()
        for k in keys:
            write(s, k, b"v", 1, 1)
        s.commit()
        t.apply([blob for blob, _ in s.snapshot(Range(0, 0xFFFFFF))], gen=t.begin_copy())
        for store in (s, t):
            ids = store.db.execute("SELECT id, vkey FROM kv").fetchall()
            assert len(ids) == len(keys)
            assert all(i >> 20 == vk for i, vk in ids)
        # a key whose vkey's block is full (its last id taken by a row of another key)
        k = b"late"
        top = (vkey(k) << 20) + (1 << 20) - 1
        s.db.execute("INSERT INTO kv (id, k, vkey, value, version, done) VALUES (?,?,?,?,?,?)",
                     (top, b"squatter", vkey(k), b"x", 1, b""))
        s.begin()
        write(s, k, b"still stored", 1, 2)
        s.commit()
        assert s.row(k) == (b"still stored", 1, s.row(k)[2])
        assert s.db.execute("SELECT id FROM kv WHERE k=?", (k,)).fetchone()[0] > top
        assert t.apply([pack_record(k, vkey(k), b"copied", 1, b"")]) == 1 and t.row(k)[0] == b"copied"
    finally:
        s.close()
        t.close()


def test_a_copy_generation_wins_over_stale_rows_whatever_their_versions(tmp_path, impl):
    """A stale copy can hold a version that was never acknowledged (an owner died before replicating it)
    and collides with the acknowledged one: a new copy must replace it, and drop what it did not replace."""
    s = Store(str(tmp_path / "g.sqlite"))
    try:
        s.begin()
        write(s, b"k", b"unacked", 1, 1)
        write(s, b"k", b"unacked-2", 1, 2)          # version 2, stale
        write(s, b"gone", b"x", 1, 3)                # a key the new owner never had
        s.commit()
        theirs = pack_record(b"k", vkey(b"k"), b"acked", 2, b"")
        assert s.apply([theirs]) == 0               # version-gated alone, the stale row would stay
        gen = s.begin_copy()
        assert s.begin_copy() == gen + 1            # generations grow
        assert s.apply([theirs], durable=False, gen=gen) == 1
        assert s.row(b"k")[0] == b"acked"
        everything = Range(0, 0xFFFFFF)
        assert s.drop(everything, below_gen=gen) == 1   # "gone" only: "k" came with the copy
        assert s.row(b"gone") is None and s.row(b"k")[0] == b"acked"
    finally:
        s.close()


def test_sync_keeps_the_locks_so_another_process_never_deletes_the_live_wal(tmp_path):
    """Closing any descriptor of the database file drops this process's POSIX locks on it; another process
    closing its connection then thinks it is the last one and deletes the WAL this store still writes to."""
    import os
    import subprocess
    import sys

    path = str(tmp_path / "w.sqlite")
    s = Store(path)
    try:
        s.begin()
        write(s, b"k", b"v", 1, 1)
        s.commit()
        s.sync()
        reader = "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('SELECT count(*) FROM kv'); c.close()"
        subprocess.run([sys.executable, "-c", reader, path], check=True)
        assert os.path.exists(path + "-wal"), "another process deleted the live write-ahead log"
        s.begin()
        write(s, b"k2", b"v2", 1, 2)
        s.commit()
    finally:
        s.close()
    again = Store(path)
    try:
        assert again.row(b"k2") == (b"v2", 1, again.row(b"k2")[2])
    finally:
        again.close()



def test_sync_fdatasyncs_the_write_ahead_log_and_names_it_when_that_fails(tmp_path, monkeypatch):
    """The group commit's sync (a commit made without waiting for the disk becomes durable) writes the WAL's
    data with fdatasync, as SQLite syncs it itself; a failure names the file and is the store's error."""
    import os

    path = str(tmp_path / "d.sqlite")
    s = Store(path)
    synced = []

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", spy)
    try:
        s.begin(durable=False)
        write(s, b"k", b"v", 1, 1)
        s.commit()
        assert synced == []                     # durable=False: the commit did not sync through us
        s.sync()
        assert synced == [path + "-wal"]

        def broken(fd):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(os, "fdatasync", broken)
        with pytest.raises(store_mod.StoreError, match=r"fdatasync of .*d\.sqlite-wal failed: Input/output error"):
            s.sync()
    finally:
        s.close()


def test_the_time_a_thread_spends_committing_is_counted_for_that_thread(st):
    """disk_seconds: the loop's stall log tells a slow disk from other waits by it."""
    before = st.disk_seconds()
    st.begin()
    write(st, b"k", b"v" * 1000, C1, 1)
    st.commit()
    assert st.disk_seconds() > before
    other = []
    t = threading.Thread(target=lambda: other.append(st.disk_seconds()))
    t.start()
    t.join()
    assert other == [0.0]


def test_the_time_an_apply_spends_committing_is_counted_too(st, impl):
    before = st.disk_seconds()
    st.apply([pack_record(b"k", vkey(b"k"), b"v" * 1000, 1, b"")])
    assert st.disk_seconds() > before


def test_the_native_apply_keeps_its_own_connection_per_thread_and_closes_it(tmp_path):
    s = Store(str(tmp_path / "n.db"))
    assert store_mod.native_lib() is not None, f"{store_mod.NATIVE_PATH} is not built: run 'make bootstrap'"
    s.apply([pack_record(b"a", vkey(b"a"), b"1", 1, b"")])
    mine = s._local.native
    assert mine is not None and mine.h
    seen = []

    def other():
        s.apply([pack_record(b"b", vkey(b"b"), b"2", 1, b"")])
        seen.append(s._local.native)
        s.close()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen and seen[0] is not mine and seen[0].h is None   # closed by that thread's close()
    assert s.row(b"b") == (b"2", 1, b"")
    s.close()
    assert mine.h is None


def test_the_native_and_the_python_snapshot_ship_the_same_bytes(st, monkeypatch):
    assert store_mod.native_lib() is not None, f"{store_mod.NATIVE_PATH} is not built: run 'make bootstrap'"
    keys = fill(st, 250)
    for k in keys[::7]:
        put(st, k, None, C2, 1)                  # tombstones
    for i, k in enumerate(keys[1::9]):
        put(st, k, b"", C2, 100 + i)             # empty values, two clients' completion records
    put(st, b"", b"empty key", C2, 7)
    st.apply([pack_record(b"no-records", vkey(b"no-records"), b"v", 3, b"")])
    for chunk in (1, 700, 256 * 1024):
        native = list(st.snapshot(FULL, chunk))
        with monkeypatch.context() as m:
            m.setattr(store_mod, "native_lib", lambda: None)
            python = list(st.snapshot(FULL, chunk))
        assert native == python
        assert sum(n for _b, n in native) == 252


def test_threads_that_end_leave_no_native_connections_behind(tmp_path):
    """Operations' threads read their snapshots natively and end: their connections close with them (SQLite keeps
    a few closed descriptors for reuse while the store is open elsewhere in the process: bounded, not one per
    thread)."""
    import os

    s = Store(str(tmp_path / "fd.db"))
    fill(s, 10)
    assert store_mod.native_lib() is not None

    def op():
        assert sum(n for _b, n in s.snapshot(FULL)) == 10

    def threads(n: int) -> int:
        for _ in range(n):
            t = threading.Thread(target=op)
            t.start()
            t.join()
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    warm = threads(50)
    # 300 connections leaked would be 600 descriptors; SQLite's pool of closed ones for reuse grew by up to 60
    # in the whole unit suite (a few dozen alone)
    assert threads(300) - warm < 150
    s.close()


def test_damaged_blobs_are_refused_whole_or_applied_never_crash(st, impl):
    """Blobs from a peer are parsed in C: truncated, cut and bit-flipped ones either raise KvsError with nothing
    applied or are records the layout allows; the store stays usable."""
    rnd = random.Random(77)
    good = b"".join(pack_record(b"k%d" % i, vkey(b"k%d" % i), b"v" * rnd.randrange(0, 300), i + 1,
                                tab(C1, i)) for i in range(40))
    refused = 0
    for trial in range(400):
        blob = bytearray(good[:rnd.randrange(0, len(good) + 1)])
        for _ in range(rnd.randrange(0, 6)):
            if blob:
                blob[rnd.randrange(len(blob))] = rnd.randrange(256)
        before = st.db.execute("SELECT count(*) FROM kv").fetchone()[0]
        try:
            st.apply([bytes(blob)], gen=None)
        except KvsError as exc:
            assert "truncated" in str(exc)
            assert st.db.execute("SELECT count(*) FROM kv").fetchone()[0] == before   # nothing of it applied
            refused += 1
    assert refused > 50
    st.drop(FULL)
    assert st.apply([good]) == 40
