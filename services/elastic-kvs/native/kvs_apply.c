/*
 * elastic-KVS: applying a blob of state records to the store, in C.
 *
 * The same work as Store.apply (services/elastic-kvs/store.py) without a Python object per record: a copy of
 * 100,000 records of 1 KB is ~800 blobs, each parsed here in place and bound to one prepared upsert with
 * SQLITE_STATIC (no copy of keys and values before SQLite's own).  Loaded with ctypes, which releases the GIL
 * for the call: the endpoint's other threads run meanwhile.
 *
 * The record layout, the upsert and its id rule are store.py's (REC, NEW_ID, apply); the tests run both
 * paths on the same blobs and compare the tables.  A blob is checked whole before anything is written: a
 * truncated one changes nothing.
 *
 * Returns: >= 0 the number of records that won; -1 a malformed blob; -2 an SQLite error; in both cases
 * `err` says what.  `commit_s` receives the seconds the COMMIT took (with the checkpoint it may run).
 */
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define REC_SIZE 18   /* "!HIQHBB": klen, vkey, version, vlen, flags, nrec */
#define PAIR_SIZE 16  /* one (client, request id) pair of `recent` */
#define TOMBSTONE 1

struct kvs_apply {
    sqlite3 *db;
    sqlite3_stmt *upsert;
    int synchronous;  /* 2 FULL, 1 NORMAL, as last set */
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

static void say(char *err, int errlen, const char *what)
{
    if (err && errlen > 0)
        snprintf(err, errlen, "%s", what);
}

/* `upsert`: the statement store.py builds (parameters ?1 vkey, ?2 key, ?3 value or NULL, ?4 version, ?5 recent,
 * ?6 gen, ?7 whether the record also wins over rows of earlier copy generations). */
struct kvs_apply *kvs_apply_open(const char *path, const char *upsert, int checkpoint_pages, char *err, int errlen)
{
    struct kvs_apply *h = calloc(1, sizeof *h);
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
    if (sqlite3_prepare_v3(h->db, upsert, -1, SQLITE_PREPARE_PERSISTENT, &h->upsert, NULL) != SQLITE_OK)
        goto fail;
    return h;
fail:
    say(err, errlen, h->db ? sqlite3_errmsg(h->db) : "cannot open the database");
    sqlite3_close_v2(h->db);
    free(h);
    return NULL;
}

void kvs_apply_close(struct kvs_apply *h)
{
    if (!h)
        return;
    sqlite3_finalize(h->upsert);
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
        len = REC_SIZE + (long long)be16(b + off) + be16(b + off + 14) + (long long)b[off + 17] * PAIR_SIZE;
        if (len > n - off) {
            say(err, errlen, "truncated state record: lengths run past the blob");
            return -1;
        }
        off += len;
        recs++;
    }
    return recs;
}

long long kvs_apply(struct kvs_apply *h, const unsigned char *b, long long n, int durable, long long gen,
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
        uint32_t klen = be16(p), vlen = be16(p + 14), nrec = p[17];
        const unsigned char *value = key + klen, *recent = value + vlen;
        int rc;

        sqlite3_bind_int64(h->upsert, 1, be32(p + 2));
        sqlite3_bind_blob(h->upsert, 2, key, (int)klen, SQLITE_STATIC);
        if (p[16] & TOMBSTONE)
            sqlite3_bind_null(h->upsert, 3);
        else
            sqlite3_bind_blob(h->upsert, 3, value, (int)vlen, SQLITE_STATIC);
        sqlite3_bind_int64(h->upsert, 4, (sqlite3_int64)be64(p + 6));
        sqlite3_bind_blob(h->upsert, 5, recent, (int)(nrec * PAIR_SIZE), SQLITE_STATIC);
        sqlite3_bind_int64(h->upsert, 6, gen);
        sqlite3_bind_int(h->upsert, 7, gen != 0);
        rc = sqlite3_step(h->upsert);
        sqlite3_reset(h->upsert);
        if (rc != SQLITE_DONE)
            goto rollback;
        off += REC_SIZE + klen + vlen + nrec * PAIR_SIZE;
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
