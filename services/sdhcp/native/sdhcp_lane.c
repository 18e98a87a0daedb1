/*
 * sdhcp's native lane: the common DHCP requests of a shard served without waking the interpreter.
 *
 * A shard's Python loop (server.py) pays tens of microseconds of interpreter per request, and more on this kind
 * of machine, where every wake-up finds the CPU's caches cold.  The lane is a thread of the shard that owns the
 * data socket: it receives every frame first and serves, itself, the requests that need nothing but the lease
 * store, on the ranges the loop granted it; everything else it hands to the loop, in order, through a queue
 * (the loop's port reads that queue instead of the socket).
 *
 * What the lane serves (anything else, or any doubt, goes to the loop unchanged):
 *   - DISCOVER of a client with no address and no requested address: the first free address of its probe
 *     order (blocks.py's segments: the address intervals the loop granted with the ranges, each with the key
 *     its rows live under), held for OFFER_HOLD, answered with an OFFER; of a
 *     known client that still holds its address here: that address again (a bound lease stays bound);
 *   - REQUEST (selecting with our server id, init-reboot, renewing, rebinding) for the address the client's
 *     lease row names, whose address row this shard owns and holds for that client: the lease is bound and an
 *     ACK leaves once the write-ahead log is fdatasync'd;
 *   - an ARP request for the server address from a client whose key it serves (clients resolve it before a
 *     unicast renewal): answered from that key's VID, as server.py's _arp does.
 * Frames must be well formed by every rule of ipudp.parse, frames.wrap and wire.parse (option lengths by
 * wire.py's own table, handed over at open), not relayed unless by a trusted relay, and chaddr must be the
 * frame's source otherwise.  A reply that would need option overload goes to the loop.
 *
 * The SQL, the option bytes, the option length rules, the pool and the VID of a key are the Python side's
 * (store.py, backend.py, wire.py), given at lane_open; the tests run both paths on the same requests and
 * compare replies and rows.
 *
 * Who may write the store: one mutex (lane_lock) taken by the lane for a pass and by the Python store for each
 * of its write transactions, so the two never interleave.  What the lane may serve: the ranges of the last
 * lane_set, while CLOCK_MONOTONIC is before its deadline (the endpoint lease's; lane_extend moves it), and
 * while nothing it handed to the loop is still unfinished (per-client order).  The loop revokes (lane_set with
 * no ranges, which waits for a pass under way) before any state operation pauses or copies a range.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_packet.h>
#include <poll.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define KEY_MAX 0xFFFFFFu
#define MAX_RANGES 64
#define MAX_SEGS 16384        /* address intervals of a grant (blocks.py's Blocks.owned); more: nothing served */
#define ANCHOR_HOME 0xFFFFFFFFu   /* an interval whose rows live under each address's home key */
#define MAX_RELAYS 16
#define FRAME_MAX 2048
#define REPLY_MAX 1536
#define BURST 32
#define SLOW_CAP 1024
#define EVENTS_CAP 4096
#define HINTS 64
#define HINT_MS 1000          /* store.py HINT_MS */
#define ETH 14
#define IPH 20
#define UDPH 8
#define BOOTP 236             /* the BOOTP header */
#define MIN_DHCP 240          /* header + magic cookie */
#define PAD_TO 300            /* wire.BOOTP_MIN_LEN */
#define DHCP_MAX 1024         /* larger requests go to the loop (frames.wrap's limit is above this) */

enum { LEASE_NONE, LEASE_OFFERED, LEASE_BOUND, LEASE_RELEASED };
enum { ADDR_FREE, ADDR_HELD, ADDR_DECLINED };
enum { DISCOVER = 1, OFFER = 2, REQUEST = 3, ACK = 5 };

/* counters, in the order of lane.py's COUNTERS */
enum { C_RX, C_OFFERS, C_ACKS, C_SELECTING, C_INIT_REBOOT, C_RENEWING, C_REBINDING, C_TO_LOOP, C_TO_LOOP_DROPPED,
       C_TX, C_TX_DROPPED, C_SYNCS, C_SYNC_FAILED, C_STORE_FAILED, C_EVENTS_DROPPED, C_PASSES, C_ARP_REPLIES, C_N };

struct range { uint32_t lo, hi; };
struct seg { uint32_t a, b, anchor; };
struct hint { uint32_t lo, hi, ip; uint64_t since; int used; };
struct slow { uint32_t len; uint8_t pkttype; uint8_t data[FRAME_MAX]; };
struct event { uint64_t chaddr; uint32_t ip; uint64_t until; };
struct rate { uint32_t lo; uint64_t n; };

struct lane {
    sqlite3 *db;
    sqlite3_stmt *get_lease, *get_addr, *taken_at, *first_gap, *put_lease, *put_addr, *begin, *commit, *rollback;
    char wal[4096];
    int sock, stop_fd, slow_fd, event_fd;

    /* configuration (lane_open) */
    uint32_t first, size, server, net, netmask, lease_s, offer_hold_ms;
    int key_hash;         /* the key function (vfab.vid.mackey): 1 mac-hash, 0 mac-low24 */
    uint64_t vid_base;
    uint8_t server_be[4];
    uint8_t opts[512];
    int opts_len;
    uint32_t relays[MAX_RELAYS];
    int nrelays;
    int16_t exact[256], step[256], least[256];   /* wire.py's length rule per known code; step 0: unknown */

    /* what may be served: under mu */
    pthread_mutex_t mu;
    struct range ranges[MAX_RANGES];
    int nranges;
    struct seg *slots;    /* MAX_SEGS: the granted address intervals, sorted (Blocks.owned) */
    int nslots;
    struct seg *probe;    /* MAX_SEGS + 1: one request's probe order (serve, under mu) */
    double valid_until;
    int64_t gen;
    struct rate rates[2 * MAX_RANGES];
    int nrates;
    struct hint hints[HINTS];
    unsigned long forgot, hints_at;   /* lane_forget count, and the count the hints were made at */
    uint64_t counters[C_N];

    /* to the loop: under qmu */
    pthread_mutex_t qmu;
    struct slow *q;
    int qhead, qlen;
    long unfinished;   /* frames handed to the loop that it has not finished with */

    /* binding events for the shard's Binder: under emu */
    pthread_mutex_t emu;
    struct event *ev;
    int evhead, evlen;
    uint64_t *watch;   /* sorted MACs events are wanted for (watch_all: every MAC) */
    int nwatch, watch_all;

    char err[4608];   /* room for the path */
};

/* -- bytes ------------------------------------------------------------------------------------------------ */
static uint32_t be16(const uint8_t *p) { return ((uint32_t)p[0] << 8) | p[1]; }
static uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static void put16(uint8_t *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }
static void put32(uint8_t *p, uint32_t v) { put16(p, v >> 16); put16(p + 2, v); }

static uint32_t sum16(const uint8_t *p, size_t n, uint32_t s)
{
    for (; n > 1; n -= 2, p += 2)
        s += be16(p);
    if (n)
        s += (uint32_t)p[0] << 8;
    return s;
}
static uint16_t fold(uint32_t s)
{
    while (s >> 16)
        s = (s & 0xFFFF) + (s >> 16);
    return (uint16_t)~s;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* -- the pool (pool.py) ----------------------------------------------------------------------------------- */
static uint32_t slot_of(const struct lane *l, uint32_t key) { return (uint32_t)(((uint64_t)key * l->size) >> 24); }
static uint32_t home_of(const struct lane *l, uint32_t ip)
{
    uint64_t i = ip - l->first;
    return (uint32_t)(((i << 24) + l->size - 1) / l->size);
}
/* -- the key of a MAC (vfab/vid/mackey.py): what the front door's flow computes in the switch ------------- */
static uint32_t rot32(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }

/* lookup3's hash of the 6 MAC bytes, words read little-endian (OVS jhash_bytes, the multipath hash) */
static uint32_t mac_jhash(const uint8_t *m, uint32_t basis)
{
    uint32_t a, b, c;
    a = b = c = 0xDEADBEEFu + 6 + basis;
    a += (uint32_t)m[0] | (uint32_t)m[1] << 8 | (uint32_t)m[2] << 16 | (uint32_t)m[3] << 24;
    b += (uint32_t)m[4] | (uint32_t)m[5] << 8;
    c ^= b; c -= rot32(b, 14);
    a ^= c; a -= rot32(c, 11);
    b ^= a; b -= rot32(a, 25);
    c ^= b; c -= rot32(b, 16);
    a ^= c; a -= rot32(c, 4);
    b ^= a; b -= rot32(a, 14);
    c ^= b; c -= rot32(b, 24);
    return c;
}

static uint32_t mac_key(const struct lane *l, const uint8_t *m)
{
    if (l->key_hash)   /* multipath(eth_src, basis 0, modulo_n, 65536) -> bits 8..23, the low byte -> bits 0..7 */
        return (mac_jhash(m, 0) & 0xFFFFu) << 8 | m[5];
    return ((uint32_t)m[3] << 16 | (uint32_t)m[4] << 8 | m[5]) & KEY_MAX;
}

static uint32_t chaddr_key(const struct lane *l, uint64_t chaddr)
{
    uint8_t m[6];
    for (int k = 0; k < 6; k++)
        m[k] = (uint8_t)(chaddr >> (40 - 8 * k));
    return mac_key(l, m);
}

static int in_ranges(const struct lane *l, uint32_t key, uint32_t *lo)
{
    for (int i = 0; i < l->nranges; i++)
        if (l->ranges[i].lo <= key && key <= l->ranges[i].hi) {
            if (lo)
                *lo = l->ranges[i].lo;
            return 1;
        }
    return 0;
}
/* The granted interval holding pool index i, or NULL (Blocks.may: this shard may hand the address out) */
static const struct seg *seg_of(const struct lane *l, uint32_t i)
{
    int lo = 0, hi = l->nslots - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (l->slots[mid].b < i)
            lo = mid + 1;
        else if (l->slots[mid].a > i)
            hi = mid - 1;
        else
            return &l->slots[mid];
    }
    return NULL;
}
static const struct seg *seg_of_ip(const struct lane *l, uint32_t ip)
{
    return ip < l->first || ip - l->first >= l->size ? NULL : seg_of(l, ip - l->first);
}
/* the key an address's row lives under (Blocks.rowkey) */
static uint32_t rowkey(const struct lane *l, const struct seg *g, uint32_t ip)
{
    return g->anchor == ANCHOR_HOME ? home_of(l, ip) : g->anchor;
}
/* Blocks.segments: the granted intervals in probe order for key, from slot(key) upward, then wrapping */
static int segments(const struct lane *l, uint32_t key, struct seg *out)
{
    int n = 0;
    uint32_t s = slot_of(l, key);
    for (int i = 0; i < l->nslots; i++) {       /* from slot(key) upward */
        uint32_t a = l->slots[i].a, b = l->slots[i].b;
        if (b >= s)
            out[n++] = (struct seg){a < s ? s : a, b, l->slots[i].anchor};
    }
    for (int i = 0; i < l->nslots && l->slots[i].a < s; i++) {   /* then wrapping */
        uint32_t a = l->slots[i].a, b = l->slots[i].b;
        out[n++] = (struct seg){a, b < s ? b : s - 1, l->slots[i].anchor};
    }
    return n;
}

/* -- the store (store.py's SQL) ----------------------------------------------------------------------------- */
struct lease_row { int found; uint32_t ip; int state; uint64_t expires; int64_t version; };
struct addr_row { int found; uint64_t holder; int state; uint64_t until; int64_t version; };

static int fail(struct lane *l, const char *what)
{
    snprintf(l->err, sizeof l->err, "%s: %s (%s)", what, sqlite3_errmsg(l->db), sqlite3_db_filename(l->db, "main"));
    l->counters[C_STORE_FAILED]++;
    return -1;
}

static int read_lease(struct lane *l, uint64_t chaddr, struct lease_row *r)
{
    sqlite3_stmt *s = l->get_lease;
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, (sqlite3_int64)chaddr);
    int rc = sqlite3_step(s);
    r->found = rc == SQLITE_ROW;
    if (r->found) {   /* ip, state, expires, client_id, version */
        r->ip = (uint32_t)sqlite3_column_int64(s, 0);
        r->state = sqlite3_column_int(s, 1);
        r->expires = (uint64_t)sqlite3_column_int64(s, 2);
        r->version = sqlite3_column_int64(s, 4);
    }
    sqlite3_reset(s);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : fail(l, "reading a lease");
}

static int read_addr(struct lane *l, uint32_t ip, struct addr_row *r)
{
    sqlite3_stmt *s = l->get_addr;
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, ip);
    int rc = sqlite3_step(s);
    r->found = rc == SQLITE_ROW;
    if (r->found) {   /* holder, state, until, version */
        r->holder = (uint64_t)sqlite3_column_int64(s, 0);
        r->state = sqlite3_column_int(s, 1);
        r->until = (uint64_t)sqlite3_column_int64(s, 2);
        r->version = sqlite3_column_int64(s, 3);
    }
    sqlite3_reset(s);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : fail(l, "reading an address");
}

/* Store._first_free: 1 and *ip, 0 none, -1 error */
static int first_free_raw(struct lane *l, uint32_t lo, uint32_t hi, uint64_t chaddr, uint64_t now, uint32_t *ip)
{
    sqlite3_stmt *s = l->taken_at;
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, lo);
    sqlite3_bind_int64(s, 2, (sqlite3_int64)chaddr);
    sqlite3_bind_int64(s, 3, (sqlite3_int64)now);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc == SQLITE_DONE) {
        *ip = lo;
        return 1;
    }
    if (rc != SQLITE_ROW)
        return fail(l, "searching a free address");
    s = l->first_gap;
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, lo);
    sqlite3_bind_int64(s, 2, hi);
    sqlite3_bind_int64(s, 3, (sqlite3_int64)chaddr);
    sqlite3_bind_int64(s, 4, (sqlite3_int64)now);
    sqlite3_bind_int64(s, 5, (sqlite3_int64)chaddr);
    sqlite3_bind_int64(s, 6, (sqlite3_int64)now);
    rc = sqlite3_step(s);
    int found = rc == SQLITE_ROW;
    if (found)
        *ip = (uint32_t)sqlite3_column_int64(s, 0);
    sqlite3_reset(s);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        return fail(l, "searching a free address");
    return found;
}

/* Store.first_free, with its search hints (same rule: a hint only says where to start looking) */
static int first_free(struct lane *l, uint32_t lo, uint32_t hi, uint64_t chaddr, uint64_t now, uint32_t *ip)
{
    if (l->hints_at != __atomic_load_n(&l->forgot, __ATOMIC_ACQUIRE)) {
        memset(l->hints, 0, sizeof l->hints);
        l->hints_at = __atomic_load_n(&l->forgot, __ATOMIC_ACQUIRE);
    }
    struct hint *h = NULL, *spare = NULL;
    for (int i = 0; i < HINTS; i++) {
        if (l->hints[i].used && l->hints[i].lo == lo && l->hints[i].hi == hi)
            h = &l->hints[i];
        else if (!l->hints[i].used && !spare)
            spare = &l->hints[i];
    }
    uint64_t since = now;
    int rc;
    if (h && lo < h->ip && h->ip <= hi && now >= h->since && now - h->since < HINT_MS) {
        rc = first_free_raw(l, h->ip, hi, chaddr, now, ip);
        since = h->since;
        if (rc == 0) {
            rc = first_free_raw(l, lo, hi, chaddr, now, ip);
            since = now;
        }
    } else {
        rc = first_free_raw(l, lo, hi, chaddr, now, ip);
    }
    if (rc == 1) {
        if (!h && !spare) {   /* store.py forgets every hint past HINTS_MAX; here past HINTS */
            memset(l->hints, 0, sizeof l->hints);
            spare = &l->hints[0];
        }
        if (!h)
            h = spare;
        *h = (struct hint){lo, hi, *ip, since, 1};
    }
    return rc;
}

static int put_lease(struct lane *l, uint64_t chaddr, uint32_t ip, int state, uint64_t expires, const uint8_t *cid,
                     int cidlen, int64_t version)
{
    sqlite3_stmt *s = l->put_lease;   /* chaddr, vkey, ip, state, expires, client_id, version */
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, (sqlite3_int64)chaddr);
    sqlite3_bind_int64(s, 2, chaddr_key(l, chaddr));
    sqlite3_bind_int64(s, 3, ip);
    sqlite3_bind_int(s, 4, state);
    sqlite3_bind_int64(s, 5, (sqlite3_int64)expires);
    sqlite3_bind_blob(s, 6, cid ? (const void *)cid : "", cidlen, SQLITE_STATIC);
    sqlite3_bind_int64(s, 7, version);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    return rc == SQLITE_DONE ? 0 : fail(l, "writing a lease");
}

static int put_addr(struct lane *l, uint32_t ip, uint32_t vkey, uint64_t holder, int state, uint64_t until,
                    int64_t version)
{
    sqlite3_stmt *s = l->put_addr;   /* ip, vkey (the row key), holder, state, until, version */
    sqlite3_reset(s);
    sqlite3_bind_int64(s, 1, ip);
    sqlite3_bind_int64(s, 2, vkey);
    sqlite3_bind_int64(s, 3, (sqlite3_int64)holder);
    sqlite3_bind_int(s, 4, state);
    sqlite3_bind_int64(s, 5, (sqlite3_int64)until);
    sqlite3_bind_int64(s, 6, version);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    return rc == SQLITE_DONE ? 0 : fail(l, "writing an address");
}

static int run(struct lane *l, sqlite3_stmt *s, const char *what)
{
    sqlite3_reset(s);
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    return rc == SQLITE_DONE ? 0 : fail(l, what);
}

/* -- a request ------------------------------------------------------------------------------------------------ */
struct req {
    const uint8_t *src, *dhcp;   /* the Ethernet source (the relay's for a relayed request), the DHCP message */
    uint32_t dlen;
    int ip_broadcast, type;
    uint64_t chaddr;
    uint32_t key, ciaddr, giaddr, flags;
    int has50, has54, has57;
    uint32_t o50, o54, o57;
    const uint8_t *cid;
    int cidlen;   /* -1: no option 61 */
};

static int parse_dhcp(const struct lane *l, const uint8_t *src, int ip_broadcast, const uint8_t *d, uint32_t dlen,
                      struct req *r);

/* A request another shard forwarded (vfab/vid/frame.py + frames.wrap): Ethernet, the vfab header (version 1,
 * REQUEST, no reserved flag), its payload: version 1 | Ethernet source | flags (bit 0: IP broadcast) | DHCP. */
#define VFAB_HDR 16
#define REQ_HDR 8
static int parse_wrapped(const struct lane *l, const uint8_t *f, uint32_t n, struct req *r)
{
    if (n < ETH + VFAB_HDR + REQ_HDR + MIN_DHCP)
        return 0;
    const uint8_t *h = f + ETH, *p = h + VFAB_HDR;
    uint32_t len = be16(h + 6);
    if (h[0] != 1 || h[1] != 1 || (h[2] & 0xF0) || ETH + VFAB_HDR + len > n || len < REQ_HDR + MIN_DHCP || p[0] != 1)
        return 0;
    uint32_t dlen = len - REQ_HDR;
    if (dlen > DHCP_MAX)
        return 0;
    return parse_dhcp(l, p + 1, p[7] & 1, p + REQ_HDR, dlen, r);
}

/* 1: a clean DISCOVER or REQUEST the lane may look at; 0: the loop's (anything else, or any doubt) */
static int parse(const struct lane *l, const uint8_t *f, uint32_t n, struct req *r)
{
    if (n >= ETH && be16(f + 12) == 0x88B5)
        return parse_wrapped(l, f, n, r);
    if (n < ETH + IPH + UDPH + MIN_DHCP || be16(f + 12) != 0x0800)
        return 0;
    const uint8_t *ip = f + ETH;
    uint32_t total = be16(ip + 2);
    if (ip[0] != 0x45 || total < IPH + UDPH || ETH + total > n || (be16(ip + 6) & 0x3FFF) || ip[9] != 17)
        return 0;
    if (fold(sum16(ip, IPH, 0)) != 0)
        return 0;
    const uint8_t *udp = ip + IPH;
    uint32_t ulen = be16(udp + 4);
    if (ulen < UDPH || IPH + ulen > total || be16(udp + 2) != 67 || (be16(udp) != 68 && be16(udp) != 67))
        return 0;
    if (be16(udp + 6)) {   /* pseudo-header + the datagram */
        uint32_t s = sum16(ip + 12, 8, 17 + ulen);
        if (fold(sum16(udp, ulen, s)) != 0)
            return 0;
    }
    return parse_dhcp(l, f + 6, be32(ip + 16) == 0xFFFFFFFFu, udp + UDPH, ulen - UDPH, r);
}

static int parse_dhcp(const struct lane *l, const uint8_t *src, int ip_broadcast, const uint8_t *d, uint32_t dlen,
                      struct req *r)
{
    if (dlen < MIN_DHCP || dlen > DHCP_MAX || be32(d + BOOTP) != 0x63825363 || d[0] != 1 || d[1] != 1 || d[2] != 6)
        return 0;
    memset(r, 0, sizeof *r);
    r->src = src;
    r->dhcp = d;
    r->dlen = dlen;
    r->ip_broadcast = ip_broadcast;
    r->flags = be16(d + 10);
    r->ciaddr = be32(d + 12);
    r->giaddr = be32(d + 24);
    r->chaddr = ((uint64_t)be16(d + 28) << 32) | be32(d + 30);
    r->key = mac_key(l, d + 28);
    r->cidlen = -1;
    uint8_t seen[32] = {0};
    uint32_t i = MIN_DHCP;
    int end = 0;
    while (i < dlen) {
        uint8_t code = d[i];
        if (code == 0) {
            i++;
            continue;
        }
        if (code == 255) {
            end = 1;
            break;
        }
        if (i + 1 >= dlen)
            return 0;
        uint32_t len = d[i + 1];
        if (i + 2 + len > dlen)
            return 0;
        if (seen[code >> 3] & (1 << (code & 7)))
            return 0;   /* a repeated option is concatenated (RFC 3396): the loop's */
        seen[code >> 3] |= 1 << (code & 7);
        if (l->step[code]) {   /* a known option: wire.py's length rule */
            if ((l->exact[code] >= 0 && (int)len != l->exact[code]) || (int)len < l->least[code] ||
                len % l->step[code])
                return 0;
        }
        const uint8_t *v = d + i + 2;
        if ((code == 53 && len != 1) || ((code == 50 || code == 54) && len != 4) || (code == 57 && len != 2))
            return 0;   /* wire.py's rules say so too; checked here so no read depends on them */
        switch (code) {
        case 52:
            return 0;   /* overload: the loop's */
        case 53:
            r->type = v[0];
            break;
        case 50:
            r->has50 = 1;
            r->o50 = be32(v);
            break;
        case 54:
            r->has54 = 1;
            r->o54 = be32(v);
            break;
        case 57:
            r->has57 = 1;
            r->o57 = be16(v);
            break;
        case 61:
            r->cid = v;
            r->cidlen = (int)len;
            break;
        }
        i += 2 + len;
    }
    if (!end || (r->type != DISCOVER && r->type != REQUEST))
        return 0;
    if (r->giaddr) {
        int trusted = 0;
        for (int k = 0; k < l->nrelays; k++)
            trusted |= l->relays[k] == r->giaddr;
        if (!trusted)
            return 0;
    } else if (memcmp(d + 28, src, 6) != 0) {
        return 0;   /* spoofed: counted by the loop */
    }
    return 1;
}

/* The reply frame (OFFER or ACK) to r: backend._one + reply.reply + reply.destination + ipudp.udp_frame.
 * 0 if it would need option overload (the loop's). */
static uint32_t build(const struct lane *l, const struct req *r, int type, uint32_t yiaddr, uint8_t *out)
{
    uint32_t limit = r->has57 && r->o57 > 576 ? r->o57 : 576;
    limit = (limit < 1500 ? limit : 1500) - 28;
    uint32_t body = 3 + 6 + l->opts_len + (r->cidlen >= 0 ? 2 + r->cidlen : 0) + 1;
    if (MIN_DHCP + body > limit)
        return 0;
    uint8_t *ip = out + ETH, *udp = ip + IPH, *d = udp + UDPH;
    memset(d, 0, MIN_DHCP);
    d[0] = 2;
    d[1] = 1;
    d[2] = 6;
    memcpy(d + 4, r->dhcp + 4, 4);    /* xid */
    put16(d + 10, r->flags);
    if (type == ACK)
        put32(d + 12, r->ciaddr);
    put32(d + 16, yiaddr);
    put32(d + 24, r->giaddr);
    memcpy(d + 28, r->dhcp + 28, 6);  /* chaddr */
    put32(d + BOOTP, 0x63825363);
    uint8_t *o = d + MIN_DHCP;
    *o++ = 53, *o++ = 1, *o++ = (uint8_t)type;
    *o++ = 54, *o++ = 4;
    memcpy(o, l->server_be, 4);
    o += 4;
    memcpy(o, l->opts, l->opts_len);
    o += l->opts_len;
    if (r->cidlen >= 0) {
        *o++ = 61, *o++ = (uint8_t)r->cidlen;
        memcpy(o, r->cid, r->cidlen);
        o += r->cidlen;
    }
    *o++ = 255;
    uint32_t dlen = (uint32_t)(o - d);
    if (dlen < PAD_TO) {
        memset(o, 0, PAD_TO - dlen);
        dlen = PAD_TO;
    }
    /* where it goes (reply.destination) */
    const uint8_t bcast_mac[6] = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF};
    uint32_t dst;
    uint16_t port = 68;
    const uint8_t *mac;
    if (r->giaddr) {
        dst = r->giaddr, mac = r->src, port = 67;
    } else if (r->ciaddr) {
        dst = r->ciaddr, mac = r->dhcp + 28;
    } else if (r->flags & 0x8000) {
        dst = 0xFFFFFFFFu, mac = bcast_mac;
    } else {
        dst = yiaddr, mac = r->dhcp + 28;
    }
    memcpy(out, mac, 6);
    uint64_t vid = l->vid_base | r->key;
    for (int k = 0; k < 6; k++)
        out[6 + k] = (uint8_t)(vid >> (40 - 8 * k));
    put16(out + 12, 0x0800);
    uint32_t ulen = UDPH + dlen;
    memset(ip, 0, IPH);
    ip[0] = 0x45;
    put16(ip + 2, IPH + ulen);
    ip[8] = 64;
    ip[9] = 17;
    memcpy(ip + 12, l->server_be, 4);
    put32(ip + 16, dst);
    put16(ip + 10, fold(sum16(ip, IPH, 0)));
    put16(udp, 67);
    put16(udp + 2, port);
    put16(udp + 4, ulen);
    put16(udp + 6, 0);
    uint16_t cs = fold(sum16(udp, ulen, sum16(ip + 12, 8, 17 + ulen)));
    put16(udp + 6, cs);   /* a computed 0 goes out as 0, "none" (ipudp.udp_frame says why) */
    return ETH + IPH + ulen;
}

struct served { uint32_t len; int durable; uint8_t *reply; };

/* One request in the pass's open transaction: 1 served (reply built), 0 the loop's, -1 a store error. */
static int serve(struct lane *l, const struct req *r, uint64_t now, uint8_t *reply, uint32_t *rlen, int *durable,
                 struct event *ev, int *has_ev)
{
    uint32_t lo;
    if (!in_ranges(l, r->key, &lo))
        return 0;
    struct lease_row lease;
    struct addr_row a;
    const uint8_t *cid = r->cidlen > 0 ? r->cid : NULL;
    int cidlen = r->cidlen > 0 ? r->cidlen : 0;
    *has_ev = 0;
    if (r->type == DISCOVER) {
        if (read_lease(l, r->chaddr, &lease))
            return -1;
        if (lease.found && lease.ip) {
            /* a known client starting over gets its address again if it still holds it here (backend's
             * _discover: its current or last address first); a bound one keeps its lease meanwhile */
            uint32_t ip = lease.ip;
            if (!seg_of_ip(l, ip))
                return 0;
            if (read_addr(l, ip, &a))
                return -1;
            if (!a.found || a.holder != r->chaddr || a.state != ADDR_HELD)
                return 0;
            *rlen = build(l, r, OFFER, ip, reply);
            if (!*rlen)
                return 0;
            int bound = lease.state == LEASE_BOUND && lease.expires > now;
            if (put_lease(l, r->chaddr, ip, bound ? LEASE_BOUND : LEASE_OFFERED,
                          bound ? lease.expires : now + l->offer_hold_ms, cid, cidlen, lease.version + 1))
                return -1;
        } else {
            if (r->has50)
                return 0;   /* a requested address: the loop's */
            struct seg *segs = l->probe;
            int n = segments(l, r->key, segs), rc = 0, at = 0;
            uint32_t ip = 0;
            for (; at < n && rc == 0; at++)
                rc = first_free(l, l->first + segs[at].a, l->first + segs[at].b, r->chaddr, now, &ip);
            if (rc <= 0)
                return rc;   /* none free: reclaiming and saying so are the loop's */
            uint32_t vkey = rowkey(l, &segs[at - 1], ip);
            *rlen = build(l, r, OFFER, ip, reply);
            if (!*rlen)
                return 0;
            if (read_addr(l, ip, &a))
                return -1;
            if (!a.found || a.holder != r->chaddr || a.state != ADDR_HELD)
                if (put_addr(l, ip, vkey, r->chaddr, ADDR_HELD, 0, (a.found ? a.version : 0) + 1))
                    return -1;
            if (put_lease(l, r->chaddr, ip, LEASE_OFFERED, now + l->offer_hold_ms, cid, cidlen,
                          (lease.found ? lease.version : 0) + 1))
                return -1;
        }
        *durable = 0;
        l->counters[C_OFFERS]++;
    } else {
        uint32_t target;
        int kind;
        if (r->has54) {
            if (r->o54 != l->server || !r->has50)
                return 0;
            target = r->o50, kind = C_SELECTING;
        } else if (!r->ciaddr) {
            if (!r->has50)
                return 0;
            target = r->o50, kind = C_INIT_REBOOT;
        } else {
            target = r->ciaddr, kind = r->ip_broadcast ? C_REBINDING : C_RENEWING;
        }
        if ((target & l->netmask) != l->net || target < l->first || target - l->first >= l->size)
            return 0;
        if (!seg_of_ip(l, target))
            return 0;
        if (read_lease(l, r->chaddr, &lease))
            return -1;
        if (!lease.found || lease.ip != target)
            return 0;
        if (read_addr(l, target, &a))
            return -1;
        if (!a.found || a.holder != r->chaddr || a.state != ADDR_HELD)
            return 0;
        *rlen = build(l, r, ACK, target, reply);
        if (!*rlen)
            return 0;
        uint64_t expires = now + (uint64_t)l->lease_s * 1000;
        if (put_lease(l, r->chaddr, target, LEASE_BOUND, expires, cid, cidlen, lease.version + 1))
            return -1;
        if (!r->giaddr) {
            *ev = (struct event){r->chaddr, target, expires};
            *has_ev = 1;
        }
        *durable = 1;
        l->counters[kind]++;
        l->counters[C_ACKS]++;
    }
    int k = 0;
    while (k < l->nrates && l->rates[k].lo != lo)
        k++;
    if (k == l->nrates && l->nrates < 2 * MAX_RANGES)
        l->rates[l->nrates++] = (struct rate){lo, 0};
    if (k < l->nrates)
        l->rates[k].n++;
    return 1;
}

/* -- to the loop ----------------------------------------------------------------------------------------- */
static void signal_fd(int fd)
{
    uint64_t one = 1;
    ssize_t w = write(fd, &one, sizeof one);
    (void)w;
}

static int loop_busy(struct lane *l)
{
    pthread_mutex_lock(&l->qmu);
    int busy = l->qlen > 0 || l->unfinished > 0;
    pthread_mutex_unlock(&l->qmu);
    return busy;
}

static void to_loop(struct lane *l, const uint8_t *f, uint32_t n, uint8_t pkttype)
{
    pthread_mutex_lock(&l->qmu);
    if (l->qlen == SLOW_CAP || n > FRAME_MAX) {
        l->counters[C_TO_LOOP_DROPPED]++;
    } else {
        struct slow *s = &l->q[(l->qhead + l->qlen) % SLOW_CAP];
        s->len = n;
        s->pkttype = pkttype;
        memcpy(s->data, f, n);
        l->qlen++;
        l->counters[C_TO_LOOP]++;
        signal_fd(l->slow_fd);
    }
    pthread_mutex_unlock(&l->qmu);
}

static int watched(const struct lane *l, uint64_t mac)
{
    if (l->watch_all)
        return 1;
    int lo = 0, hi = l->nwatch - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (l->watch[mid] == mac)
            return 1;
        if (l->watch[mid] < mac)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return 0;
}

static void add_events(struct lane *l, const struct event *ev, int n)
{
    int any = 0;
    pthread_mutex_lock(&l->emu);
    for (int i = 0; i < n; i++) {
        if (!watched(l, ev[i].chaddr))
            continue;
        if (l->evlen == EVENTS_CAP) {   /* the oldest goes: the Binder's reconcile publishes it later */
            l->evhead = (l->evhead + 1) % EVENTS_CAP;
            l->evlen--;
            l->counters[C_EVENTS_DROPPED]++;
        }
        l->ev[(l->evhead + l->evlen) % EVENTS_CAP] = ev[i];
        l->evlen++;
        any = 1;
    }
    pthread_mutex_unlock(&l->emu);
    if (any)
        signal_fd(l->event_fd);
}

/* -- a pass ----------------------------------------------------------------------------------------------- */
static int sync_wal(struct lane *l)
{
    int fd = open(l->wal, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;   /* no WAL: everything is in the database file */
    int rc = fdatasync(fd);
    close(fd);
    l->counters[C_SYNCS]++;
    return rc;
}

/* An ARP request for the server address from a client whose key is granted: the reply (server.py's _arp and
 * frames.arp_reply), 60 B; 0 for anything else (the loop's). */
static uint32_t arp(struct lane *l, const uint8_t *f, uint32_t n, uint8_t *out)
{
    if (n < ETH + 28 || be16(f + 12) != 0x0806)
        return 0;
    const uint8_t *a = f + ETH;
    if (be16(a) != 1 || be16(a + 2) != 0x0800 || a[4] != 6 || a[5] != 4 || be16(a + 6) != 1 ||
        memcmp(a + 8, f + 6, 6) != 0 || memcmp(a + 24, l->server_be, 4) != 0)
        return 0;   /* not Ethernet/IPv4, not a request, a sender speaking for another MAC, not for us */
    uint32_t key = mac_key(l, a + 8);
    if (!in_ranges(l, key, NULL))
        return 0;
    uint8_t vid[6];
    for (int k = 0; k < 6; k++)
        vid[k] = (uint8_t)((l->vid_base | key) >> (40 - 8 * k));
    memset(out, 0, 60);
    memcpy(out, a + 8, 6);
    memcpy(out + 6, vid, 6);
    put16(out + 12, 0x0806);
    uint8_t *r = out + ETH;
    put16(r, 1);
    put16(r + 2, 0x0800);
    r[4] = 6, r[5] = 4;
    put16(r + 6, 2);
    memcpy(r + 8, vid, 6);
    memcpy(r + 14, l->server_be, 4);
    memcpy(r + 18, a + 8, 6);    /* to the asker, at its address */
    memcpy(r + 24, a + 14, 4);
    l->counters[C_ARP_REPLIES]++;
    return 60;
}

/*
 * Serve frames[0..n) as one pass: verdict[i] 1 served (reply in replies + i * REPLY_MAX, rlen[i]), 0 the
 * loop's.  queue: hand the loop's frames to the loop (the thread) rather than only saying so (the tests).
 * Returns whether any served reply waits for the disk, -1 if the store failed (then nothing of the pass is
 * kept and every frame is the loop's, which says what failed).  The caller holds the store's mutex.
 */
static int pass(struct lane *l, uint8_t *const *frames, const uint32_t *lens, const uint8_t *pkttypes, int n,
                uint64_t now, uint8_t *replies, uint32_t *rlen, int *verdict, int *durable, int queue,
                struct event *evs, int *nev)
{
    int open = 0, any_durable = 0, i;
    int may = l->nranges > 0 && mono() < l->valid_until;
    *nev = 0;
    for (i = 0; i < n; i++) {
        verdict[i] = 0;
        durable[i] = 0;
        struct req r;
        int rc = 0, has_ev = 0;
        if (may && (rlen[i] = arp(l, frames[i], lens[i], replies + (size_t)i * REPLY_MAX))) {
            verdict[i] = 1;   /* no store, no order: answered whatever else waits */
            continue;
        }
        if (may && !(queue && loop_busy(l)) && parse(l, frames[i], lens[i], &r)) {
            if (!open) {
                if (run(l, l->begin, "beginning a transaction"))
                    goto failed;
                open = 1;
            }
            rc = serve(l, &r, now, replies + (size_t)i * REPLY_MAX, &rlen[i], &durable[i], &evs[*nev], &has_ev);
            if (rc < 0)
                goto failed;
        }
        if (rc == 1) {
            verdict[i] = 1;
            any_durable |= durable[i];
            *nev += has_ev;
        } else if (queue) {
            to_loop(l, frames[i], lens[i], pkttypes ? pkttypes[i] : 0);
        }
    }
    if (!open || run(l, l->commit, "committing") == 0)
        return any_durable;
failed:
    if (open && !sqlite3_get_autocommit(l->db))   /* SQLite rolled back itself on a full disk */
        run(l, l->rollback, "rolling back");
    l->hints_at = ~0UL;   /* a hint may name an address the rollback freed */
    *nev = 0;
    for (int j = 0; j < n; j++) {
        /* served before the failure, or not looked at yet: the loop's now, in order (the frames handed over
         * earlier in the pass were finished by the loop before any of these was served) */
        if (verdict[j] == 1 || j >= i) {
            verdict[j] = 0;
            if (queue)
                to_loop(l, frames[j], lens[j], pkttypes ? pkttypes[j] : 0);
        }
    }
    return -1;
}

/* -- the thread ------------------------------------------------------------------------------------------- */
static void send_frame(struct lane *l, const uint8_t *f, uint32_t n)
{
    if (send(l->sock, f, n, MSG_DONTWAIT) == (ssize_t)n)
        l->counters[C_TX]++;
    else
        l->counters[C_TX_DROPPED]++;   /* a full queue, as RawPort.send counts it: the client retransmits */
}

static int serve_loop(struct lane *l, uint8_t (*buf)[FRAME_MAX], uint8_t *replies);

/* Receive and serve until lane_stop; returns 0, or -1 with lane_error set (the socket failed). */
int lane_run(struct lane *l)
{
    uint8_t (*buf)[FRAME_MAX] = malloc(BURST * FRAME_MAX), *replies = malloc(BURST * REPLY_MAX);
    int rc = buf && replies ? serve_loop(l, buf, replies) : -1;
    if (!buf || !replies)
        snprintf(l->err, sizeof l->err, "out of memory");
    free(buf);
    free(replies);
    return rc;
}

static int serve_loop(struct lane *l, uint8_t (*buf)[FRAME_MAX], uint8_t *replies)
{
    uint8_t *frames[BURST], pkttypes[BURST];
    uint32_t lens[BURST], rlen[BURST];
    int verdict[BURST], durable[BURST];
    struct event evs[BURST];
    for (int i = 0; i < BURST; i++)
        frames[i] = buf[i];
    struct pollfd pfd[2] = {{l->sock, POLLIN, 0}, {l->stop_fd, POLLIN, 0}};
    for (;;) {
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            snprintf(l->err, sizeof l->err, "poll: %s", strerror(errno));
            return -1;
        }
        if (pfd[1].revents)
            return 0;
        int n = 0;
        while (n < BURST) {
            struct sockaddr_ll from;
            socklen_t fl = sizeof from;
            ssize_t got = recvfrom(l->sock, buf[n], FRAME_MAX, MSG_DONTWAIT, (struct sockaddr *)&from, &fl);
            if (got < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                    break;
                snprintf(l->err, sizeof l->err, "receive: %s", strerror(errno));
                return -1;
            }
            if (from.sll_pkttype == PACKET_OUTGOING)
                continue;
            lens[n] = (uint32_t)got;
            pkttypes[n] = from.sll_pkttype;
            n++;
        }
        if (!n)
            continue;
        pthread_mutex_lock(&l->mu);
        l->counters[C_RX] += n;
        l->counters[C_PASSES]++;
        int nev = 0;
        int wait = pass(l, frames, lens, pkttypes, n, now_ms(), replies, rlen, verdict, durable, 1, evs, &nev);
        pthread_mutex_unlock(&l->mu);
        for (int i = 0; i < n; i++)   /* OFFERs promise nothing: they leave at once */
            if (verdict[i] && !durable[i])
                send_frame(l, replies + (size_t)i * REPLY_MAX, rlen[i]);
        if (wait > 0) {
            if (sync_wal(l) != 0) {   /* not on disk: no ACK (the client asks again), as the loop does */
                __atomic_fetch_add(&l->counters[C_SYNC_FAILED], 1, __ATOMIC_RELAXED);
                snprintf(l->err, sizeof l->err, "fdatasync of %s: %s", l->wal, strerror(errno));
                continue;
            }
            for (int i = 0; i < n; i++)
                if (verdict[i] && durable[i])
                    send_frame(l, replies + (size_t)i * REPLY_MAX, rlen[i]);
        }
        if (nev)
            add_events(l, evs, nev);
    }
}

/* -- the API (lane.py) --------------------------------------------------------------------------------------- */
static int prepare(struct lane *l, sqlite3_stmt **s, const char *sql)
{
    if (sqlite3_prepare_v3(l->db, sql, -1, SQLITE_PREPARE_PERSISTENT, s, NULL) != SQLITE_OK) {
        snprintf(l->err, sizeof l->err, "preparing %.60s: %s", sql, sqlite3_errmsg(l->db));
        return -1;
    }
    return 0;
}

void lane_close(struct lane *l);

/*
 * path: the store; sql: six statements, NUL-separated (lease, addr, taken_at, first_gap, put_lease, put_addr);
 * cfg: first, size, server, net, netmask, lease_s, offer_hold_ms, key function (1 mac-hash, 0 mac-low24); opts: the reply options after 53 and 54;
 * rules: 256 x (exact, step, least) (step 0: a code wire.py does not know).
 */
struct lane *lane_open(const char *path, const char *sql, const uint32_t *cfg, uint64_t vid_base, int sock,
                       const uint8_t *opts, int opts_len, const uint32_t *relays, int nrelays, const int16_t *rules,
                       char *err, int errlen)
{
    struct lane *l = calloc(1, sizeof *l);
    if (!l || opts_len < 0 || opts_len > (int)sizeof l->opts || nrelays < 0 || nrelays > MAX_RELAYS) {
        snprintf(err, errlen, "%s", l ? "options or relays beyond the lane's limits" : "out of memory");
        free(l);
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_mutex_init(&l->qmu, NULL);
    pthread_mutex_init(&l->emu, NULL);
    l->sock = sock;
    l->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    l->slow_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    l->event_fd = eventfd(0, EFD_CLOEXEC);
    l->q = calloc(SLOW_CAP, sizeof *l->q);
    l->slots = calloc(MAX_SEGS, sizeof *l->slots);
    l->probe = calloc(MAX_SEGS + 1, sizeof *l->probe);
    l->ev = calloc(EVENTS_CAP, sizeof *l->ev);
    l->watch_all = 1;
    l->first = cfg[0], l->size = cfg[1], l->server = cfg[2], l->net = cfg[3], l->netmask = cfg[4];
    l->lease_s = cfg[5], l->offer_hold_ms = cfg[6], l->key_hash = cfg[7] != 0;
    put32(l->server_be, l->server);
    l->vid_base = vid_base;
    memcpy(l->opts, opts, opts_len);
    l->opts_len = opts_len;
    memcpy(l->relays, relays, nrelays * sizeof *relays);
    l->nrelays = nrelays;
    for (int c = 0; c < 256; c++)
        l->exact[c] = rules[3 * c], l->step[c] = rules[3 * c + 1], l->least[c] = rules[3 * c + 2];
    snprintf(l->wal, sizeof l->wal, "%s-wal", path);
    if (l->stop_fd < 0 || l->slow_fd < 0 || l->event_fd < 0 || !l->q || !l->ev || !l->slots || !l->probe) {
        snprintf(err, errlen, "cannot make the lane's eventfds or queues: %s", strerror(errno));
        lane_close(l);
        return NULL;
    }
    if (sqlite3_open_v2(path, &l->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "cannot open the lease store %s: %s", path, l->db ? sqlite3_errmsg(l->db) : "?");
        lane_close(l);
        return NULL;
    }
    sqlite3_busy_timeout(l->db, 30000);
    const char *p = sql;
    sqlite3_stmt **stmts[6] = {&l->get_lease, &l->get_addr, &l->taken_at, &l->first_gap, &l->put_lease, &l->put_addr};
    int bad = sqlite3_exec(l->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL", NULL, NULL, NULL) != SQLITE_OK;
    if (bad)
        snprintf(l->err, sizeof l->err, "setting WAL mode: %s", sqlite3_errmsg(l->db));
    for (int k = 0; k < 6 && !bad; k++) {
        bad = prepare(l, stmts[k], p);
        p += strlen(p) + 1;
    }
    bad = bad || prepare(l, &l->begin, "BEGIN IMMEDIATE") || prepare(l, &l->commit, "COMMIT") ||
          prepare(l, &l->rollback, "ROLLBACK");
    if (bad) {
        snprintf(err, errlen, "%s", l->err);
        lane_close(l);
        return NULL;
    }
    return l;
}

void lane_stop(struct lane *l) { signal_fd(l->stop_fd); }

void lane_close(struct lane *l)
{
    if (!l)
        return;
    sqlite3_stmt *all[] = {l->get_lease, l->get_addr, l->taken_at, l->first_gap, l->put_lease, l->put_addr,
                           l->begin, l->commit, l->rollback};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        sqlite3_finalize(all[i]);
    if (l->db)
        sqlite3_close(l->db);
    int fds[] = {l->stop_fd, l->slow_fd, l->event_fd};
    for (int i = 0; i < 3; i++)
        if (fds[i] > 0)
            close(fds[i]);
    free(l->q);
    free(l->slots);
    free(l->probe);
    free(l->ev);
    free(l->watch);
    free(l);
}

/* the store's writers: the lane's passes and every write transaction of the Python store */
void lane_lock(struct lane *l) { pthread_mutex_lock(&l->mu); }
void lane_unlock(struct lane *l) { pthread_mutex_unlock(&l->mu); }

/* An address may have become free (Store._may_free): the lane's search hints are forgotten. */
void lane_forget(struct lane *l) { __atomic_fetch_add(&l->forgot, 1, __ATOMIC_RELEASE); }

/* What the lane may serve: keys los/his sorted by lo, and the addresses of the nseg intervals segs (a, b,
 * anchor: sorted, disjoint pool indexes; anchor ANCHOR_HOME or the key their rows live under: Blocks.owned of
 * the same ranges), until CLOCK_MONOTONIC valid_until, for lease generation gen.  n 0 revokes; returns once no
 * pass is under way.  -1 if beyond the lane's limits (then nothing is served). */
int lane_set(struct lane *l, const uint32_t *los, const uint32_t *his, int n, const uint32_t *segs, int nseg,
             double valid_until, int64_t gen)
{
    pthread_mutex_lock(&l->mu);
    int ok = n >= 0 && n <= MAX_RANGES && nseg >= 0 && nseg <= MAX_SEGS;
    for (int i = 0; ok && i < nseg; i++)
        ok = segs[3 * i] <= segs[3 * i + 1] && segs[3 * i + 1] < l->size && (i == 0 || segs[3 * i - 2] < segs[3 * i]);
    l->nranges = ok ? n : 0;
    for (int i = 0; i < l->nranges; i++)
        l->ranges[i] = (struct range){los[i], his[i]};
    l->nslots = ok ? nseg : 0;
    for (int i = 0; i < l->nslots; i++)
        l->slots[i] = (struct seg){segs[3 * i], segs[3 * i + 1], segs[3 * i + 2]};
    l->valid_until = valid_until;
    l->gen = gen;
    l->hints_at = ~0UL;
    pthread_mutex_unlock(&l->mu);
    return ok ? 0 : -1;
}

/* The endpoint lease was kept alive: serve on until valid_until, if the grant is of that lease generation. */
void lane_extend(struct lane *l, double valid_until, int64_t gen)
{
    pthread_mutex_lock(&l->mu);
    if (l->nranges && l->gen == gen && valid_until > l->valid_until)
        l->valid_until = valid_until;
    pthread_mutex_unlock(&l->mu);
}

/* The next frame for the loop into buf: its length (0: none; the eventfd is then cleared), pkttype set. */
int lane_pop(struct lane *l, uint8_t *buf, int cap, int *pkttype)
{
    int n = 0;
    pthread_mutex_lock(&l->qmu);
    if (l->qlen) {
        struct slow *s = &l->q[l->qhead];
        n = (int)s->len < cap ? (int)s->len : cap;
        memcpy(buf, s->data, n);
        *pkttype = s->pkttype;
        l->qhead = (l->qhead + 1) % SLOW_CAP;
        l->qlen--;
        l->unfinished++;
    } else {
        uint64_t v;
        ssize_t r = read(l->slow_fd, &v, sizeof v);
        (void)r;
    }
    pthread_mutex_unlock(&l->qmu);
    return n;
}

/* The loop finished with n frames it popped (served, held, forwarded or dropped them). */
void lane_finish(struct lane *l, int n)
{
    pthread_mutex_lock(&l->qmu);
    l->unfinished = l->unfinished > n ? l->unfinished - n : 0;
    pthread_mutex_unlock(&l->qmu);
}

int lane_slow_fd(struct lane *l) { return l->slow_fd; }
int lane_event_fd(struct lane *l) { return l->event_fd; }

/* Events are wanted for these MACs only (sorted), or for every MAC (all). */
int lane_watch(struct lane *l, const uint64_t *macs, int n, int all)
{
    uint64_t *copy = n > 0 ? malloc(n * sizeof *copy) : NULL;
    if (n > 0 && !copy)
        return -1;
    if (n > 0)
        memcpy(copy, macs, n * sizeof *copy);
    pthread_mutex_lock(&l->emu);
    free(l->watch);
    l->watch = copy;
    l->nwatch = n > 0 ? n : 0;
    l->watch_all = all;
    pthread_mutex_unlock(&l->emu);
    return 0;
}

/* Up to max binding events (chaddr, ip, until ms), oldest first. */
int lane_take_events(struct lane *l, uint64_t *out, int max)
{
    int n = 0;
    pthread_mutex_lock(&l->emu);
    while (n < max && l->evlen) {
        struct event *e = &l->ev[l->evhead];
        out[3 * n] = e->chaddr, out[3 * n + 1] = e->ip, out[3 * n + 2] = e->until;
        l->evhead = (l->evhead + 1) % EVENTS_CAP;
        l->evlen--;
        n++;
    }
    pthread_mutex_unlock(&l->emu);
    return n;
}

/* Requests served per range (lo) since the last call. */
int lane_take_rates(struct lane *l, uint32_t *los, uint64_t *counts, int max)
{
    pthread_mutex_lock(&l->mu);
    int n = l->nrates < max ? l->nrates : max;
    for (int i = 0; i < n; i++)
        los[i] = l->rates[i].lo, counts[i] = l->rates[i].n;
    l->nrates = 0;
    pthread_mutex_unlock(&l->mu);
    return n;
}

int lane_counters(struct lane *l, uint64_t *out, int max)
{
    int n = max < C_N ? max : C_N;
    for (int i = 0; i < n; i++)
        out[i] = __atomic_load_n(&l->counters[i], __ATOMIC_RELAXED);
    return n;
}

void lane_error(struct lane *l, char *buf, int len) { snprintf(buf, len, "%s", l->err); }

/*
 * The tests' and benchmarks' door: serve frames (concatenated, lens[i] each) as one pass at now_ms, without the
 * socket, the queue or the disk: verdicts[i] 1 served (its reply at out + i * REPLY_MAX, outlens[i]), 0 the
 * loop's.  Returns how many were served, -1 if the store failed (lane_error says why).
 */
int lane_serve(struct lane *l, const uint8_t *data, const uint32_t *lens, int n, uint64_t now, uint8_t *out,
               uint32_t *outlens, int *verdicts)
{
    uint8_t *frames[BURST];
    int durable[BURST];
    struct event evs[BURST];
    if (n < 0 || n > BURST)
        return -1;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        frames[i] = (uint8_t *)data + off;
        off += lens[i];
    }
    pthread_mutex_lock(&l->mu);
    int nev = 0, rc = pass(l, frames, lens, NULL, n, now, out, outlens, verdicts, durable, 0, evs, &nev);
    pthread_mutex_unlock(&l->mu);
    if (rc < 0)
        return -1;
    if (nev)
        add_events(l, evs, nev);
    int served = 0;
    for (int i = 0; i < n; i++)
        served += verdicts[i];
    return served;
}

/*
 * Requests other shards forwarded to this one (vfab REQUEST frames, frames.wrap), served on the loop's thread
 * between its batches: frames in order until the first the lane leaves to the loop (verdicts[i] 0 from there
 * on, so a client's requests stay in order), each ACK only after an fdatasync of the WAL that covers it (one
 * for the call), replies at out + i * REPLY_MAX.  The caller passes them only when nothing waited in its own
 * queue before them.  Unlike the socket's frames, these are served while frames the lane handed to the loop
 * are unfinished: those came straight from the socket, and a client's frames come one way (straight if its
 * relay's key or its own is ours, else forwarded), so none of them is an earlier request of the same client;
 * the lane hands the loop every frame of a key it does not own (3 in 4 with 4 shards), and waiting for them
 * left most forwarded requests to Python.  Returns how many were served, -1 if the store or the disk failed
 * (lane_error says why: none of the replies may leave then).
 */
int lane_serve_forwarded(struct lane *l, const uint8_t *data, const uint32_t *lens, int n, uint64_t now,
                         uint8_t *out, uint32_t *outlens, int *verdicts)
{
    struct event evs[BURST];
    int served = 0, any_durable = 0, nev = 0;
    if (n < 0 || n > BURST)
        return -1;
    for (int i = 0; i < n; i++)
        verdicts[i] = 0;
    size_t off = 0;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < n; i++) {
        uint8_t *f = (uint8_t *)data + off;
        int durable = 0, got = 0;
        off += lens[i];
        int rc = pass(l, &f, &lens[i], NULL, 1, now, out + (size_t)i * REPLY_MAX, &outlens[i], &verdicts[i],
                      &durable, 0, &evs[nev], &got);
        if (rc < 0 || !verdicts[i])
            break;
        __atomic_fetch_add(&l->counters[C_RX], 1, __ATOMIC_RELAXED);
        any_durable |= durable;
        nev += got;
        served++;
    }
    pthread_mutex_unlock(&l->mu);
    if (any_durable && sync_wal(l) != 0) {
        __atomic_fetch_add(&l->counters[C_SYNC_FAILED], 1, __ATOMIC_RELAXED);
        snprintf(l->err, sizeof l->err, "fdatasync of %s: %s", l->wal, strerror(errno));
        return -1;
    }
    if (nev)
        add_events(l, evs, nev);
    return served;
}

int lane_reply_max(void) { return REPLY_MAX; }
int lane_burst(void) { return BURST; }
