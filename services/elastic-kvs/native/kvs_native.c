/*
 * elastic-KVS's native part: applying a blob of state records to the store, and reading a range's snapshot
 * into such blobs, in C.
 *
 * The same work as Store.apply and Store.snapshot (services/elastic-kvs/store.py) without a Python object per
 * record: a copy of 100,000 records of 1 KB is ~800 blobs, each parsed here in place and bound to one prepared
 * upsert with SQLITE_STATIC (no copy of keys and values before SQLite's own), or packed here straight from
 * SQLite's rows.  Loaded with ctypes, which releases the GIL for each call: the endpoint's loop serves while an
 * operation's thread reads its snapshot, and its other threads run while the loop applies.
 *
 * The record layout, the SQL and its id rule are store.py's (REC, UPSERT, SNAPSHOT); the tests run both paths
 * on the same data and compare.  A blob is checked whole before anything is written: a truncated one changes
 * nothing.
 *
 * kvs_apply returns >= 0 the number of records that won, -1 a malformed blob, -2 an SQLite error; in both
 * cases `err` says what.  `commit_s` receives the seconds the COMMIT took (with the checkpoint it may run).
 * kvs_snapshot_next returns the bytes it packed into `buf` (0: the snapshot is over), -1 a row the record
 * layout cannot hold, -2 an SQLite error.
 */
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REC_SIZE 19   /* "!HIQHBH": klen, vkey, version, vlen, flags, dlen (the completion table's bytes) */
#define TOMBSTONE 1

struct kvs_native {
    sqlite3 *db;
    sqlite3_stmt *upsert;
    sqlite3_stmt *snapshot;
    int synchronous;  /* 2 FULL, 1 NORMAL, as last set */
    int pending;      /* the snapshot's last sqlite3_step: SQLITE_ROW while a row waits to be packed */
};

static uint32_t be16(const unsigned char *p) { return ((uint32_t)p[0] << 8) | p[1]; }
static uint32_t be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static uint64_t be64(const unsigned char *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void put16(unsigned char *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }
static void put32(unsigned char *p, uint32_t v) { put16(p, v >> 16); put16(p + 2, v); }
static void put64(unsigned char *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }

static void say(char *err, int errlen, const char *what)
{
    if (err && errlen > 0)
        snprintf(err, errlen, "%s", what);
}

void kvs_native_close(struct kvs_native *h);

/* `upsert`: the statement store.py builds (parameters ?1 vkey, ?2 key, ?3 value or NULL, ?4 version, ?5 done,
 * ?6 gen, ?7 whether the record also wins over rows of earlier copy generations); `snapshot`: its range query
 * (?1 lo, ?2 hi; columns k, vkey, value, version, done). */
struct kvs_native *kvs_native_open(const char *path, const char *upsert, const char *snapshot, int checkpoint_pages,
                                 char *err, int errlen)
{
    struct kvs_native *h = calloc(1, sizeof *h);
    char sql[96];

    if (!h) {
        say(err, errlen, "out of memory");
        return NULL;
    }
    if (sqlite3_open_v2(path, &h->db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK)
        goto fail;
    sqlite3_busy_timeout(h->db, 30000);
    snprintf(sql, sizeof sql, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA wal_autocheckpoint=%d",
             checkpoint_pages > 0 ? checkpoint_pages : 1000);
    if (sqlite3_exec(h->db, sql, NULL, NULL, NULL) != SQLITE_OK)
        goto fail;
    h->synchronous = 2;
    if (sqlite3_prepare_v3(h->db, upsert, -1, SQLITE_PREPARE_PERSISTENT, &h->upsert, NULL) != SQLITE_OK ||
        sqlite3_prepare_v3(h->db, snapshot, -1, SQLITE_PREPARE_PERSISTENT, &h->snapshot, NULL) != SQLITE_OK)
        goto fail;
    return h;
fail:
    say(err, errlen, h->db ? sqlite3_errmsg(h->db) : "cannot open the database");
    kvs_native_close(h);
    return NULL;
}

void kvs_native_close(struct kvs_native *h)
{
    if (!h)
        return;
    sqlite3_finalize(h->upsert);
    sqlite3_finalize(h->snapshot);
    sqlite3_close_v2(h->db);
    free(h);
}

/* The number of records in the blob, or -1 if one is truncated (err says where). */
static long long check(const unsigned char *b, long long n, char *err, int errlen)
{
    long long off = 0, recs = 0;

    while (off < n) {
        long long len;
        if (n - off < REC_SIZE) {
            if (err && errlen > 0)
                snprintf(err, errlen, "truncated state record at byte %lld", off);
            return -1;
        }
        len = REC_SIZE + (long long)be16(b + off) + be16(b + off + 14) + be16(b + off + 17);
        if (len > n - off) {
            say(err, errlen, "truncated state record: lengths run past the blob");
            return -1;
        }
        off += len;
        recs++;
    }
    return recs;
}

long long kvs_apply(struct kvs_native *h, const unsigned char *b, long long n, int durable, long long gen,
                    double *commit_s, char *err, int errlen)
{
    sqlite3_int64 before;
    long long off = 0, won;
    double t0;
    int want = durable ? 2 : 1;

    *commit_s = 0;
    if (check(b, n, err, errlen) < 0)
        return -1;
    if (h->synchronous != want) {  /* the PRAGMA cannot change inside a transaction */
        if (sqlite3_exec(h->db, durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL", NULL, NULL,
                         NULL) != SQLITE_OK)
            goto error;
        h->synchronous = want;
    }
    if (sqlite3_exec(h->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        goto error;
    before = sqlite3_total_changes64(h->db);
    while (off < n) {
        const unsigned char *p = b + off, *key = p + REC_SIZE;
        uint32_t klen = be16(p), vlen = be16(p + 14), dlen = be16(p + 17);
        const unsigned char *value = key + klen, *done = value + vlen;
        int rc;

        sqlite3_bind_int64(h->upsert, 1, be32(p + 2));
        sqlite3_bind_blob(h->upsert, 2, key, (int)klen, SQLITE_STATIC);
        if (p[16] & TOMBSTONE)
            sqlite3_bind_null(h->upsert, 3);
        else
            sqlite3_bind_blob(h->upsert, 3, value, (int)vlen, SQLITE_STATIC);
        sqlite3_bind_int64(h->upsert, 4, (sqlite3_int64)be64(p + 6));
        sqlite3_bind_blob(h->upsert, 5, done, (int)dlen, SQLITE_STATIC);
        sqlite3_bind_int64(h->upsert, 6, gen);
        sqlite3_bind_int(h->upsert, 7, gen != 0);
        rc = sqlite3_step(h->upsert);
        sqlite3_reset(h->upsert);
        if (rc != SQLITE_DONE)
            goto rollback;
        off += REC_SIZE + klen + vlen + dlen;
    }
    sqlite3_clear_bindings(h->upsert);  /* no pointer into the caller's blob outlives the call */
    won = sqlite3_total_changes64(h->db) - before;
    t0 = now();
    if (sqlite3_exec(h->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        *commit_s = now() - t0;
        goto rollback;
    }
    *commit_s = now() - t0;
    return won;
rollback:
    say(err, errlen, sqlite3_errmsg(h->db));
    sqlite3_clear_bindings(h->upsert);
    if (!sqlite3_get_autocommit(h->db))  /* SQLite may have rolled back already (a full disk) */
        sqlite3_exec(h->db, "ROLLBACK", NULL, NULL, NULL);
    return -2;
error:
    say(err, errlen, sqlite3_errmsg(h->db));
    return -2;
}

/* Open the snapshot of [lo, hi]: one read transaction, so it is consistent while the loop keeps writing. */
int kvs_snapshot_begin(struct kvs_native *h, long long lo, long long hi, char *err, int errlen)
{
    if (sqlite3_exec(h->db, "BEGIN", NULL, NULL, NULL) != SQLITE_OK) {
        say(err, errlen, sqlite3_errmsg(h->db));
        return -2;
    }
    sqlite3_bind_int64(h->snapshot, 1, lo);
    sqlite3_bind_int64(h->snapshot, 2, hi);
    h->pending = sqlite3_step(h->snapshot);
    if (h->pending != SQLITE_ROW && h->pending != SQLITE_DONE) {
        say(err, errlen, sqlite3_errmsg(h->db));
        sqlite3_reset(h->snapshot);
        sqlite3_exec(h->db, "COMMIT", NULL, NULL, NULL);
        return -2;
    }
    return 0;
}

/* Pack the next rows into `buf` (room for `cap` bytes) until `chunk_bytes` are in or the range is done. */
long long kvs_snapshot_next(struct kvs_native *h, unsigned char *buf, long long cap, long long chunk_bytes,
                            long long *nrec, char *err, int errlen)
{
    long long n = 0;

    *nrec = 0;
    while (h->pending == SQLITE_ROW && n < chunk_bytes) {
        sqlite3_stmt *s = h->snapshot;
        const unsigned char *key = sqlite3_column_blob(s, 0), *value, *done;
        long long klen = sqlite3_column_bytes(s, 0), vlen, rlen, len;
        int tomb = sqlite3_column_type(s, 2) == SQLITE_NULL;
        unsigned char *p = buf + n;

        value = tomb ? NULL : sqlite3_column_blob(s, 2);
        vlen = tomb ? 0 : sqlite3_column_bytes(s, 2);
        done = sqlite3_column_blob(s, 4);
        rlen = sqlite3_column_bytes(s, 4);
        if (klen > 0xFFFF || vlen > 0xFFFF || rlen > 0xFFFF) {
            if (err && errlen > 0)
                snprintf(err, errlen, "a row the state record cannot hold (key %lld B, value %lld B, done %lld B)",
                         klen, vlen, rlen);
            return -1;
        }
        len = REC_SIZE + klen + vlen + rlen;
        if (len > cap - n) {
            if (n)
                break;  /* the next call starts with this row */
            say(err, errlen, "the snapshot buffer cannot hold one record");
            return -1;
        }
        put16(p, (uint32_t)klen);
        put32(p + 2, (uint32_t)sqlite3_column_int64(s, 1));
        put64(p + 6, (uint64_t)sqlite3_column_int64(s, 3));
        put16(p + 14, (uint32_t)vlen);
        p[16] = tomb ? TOMBSTONE : 0;
        put16(p + 17, (uint32_t)rlen);
        memcpy(p + REC_SIZE, key, klen);
        if (vlen)
            memcpy(p + REC_SIZE + klen, value, vlen);
        if (rlen)
            memcpy(p + REC_SIZE + klen + vlen, done, rlen);
        n += len;
        (*nrec)++;
        h->pending = sqlite3_step(s);
    }
    if (h->pending != SQLITE_ROW && h->pending != SQLITE_DONE) {
        say(err, errlen, sqlite3_errmsg(h->db));
        return -2;
    }
    return n;
}

/* End the snapshot's read transaction (also after an error or an early stop). */
void kvs_snapshot_end(struct kvs_native *h)
{
    sqlite3_reset(h->snapshot);
    sqlite3_clear_bindings(h->snapshot);
    h->pending = SQLITE_DONE;
    if (!sqlite3_get_autocommit(h->db))
        sqlite3_exec(h->db, "COMMIT", NULL, NULL, NULL);
}
