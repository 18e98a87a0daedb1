/*
 * mc_batch.h - who waits for which key: the bookkeeping behind coalescing.
 *
 * A batch is one command on a helper's TCP connection to memcached plus the
 * client requests that wait for its answer.  For a coalesced multi-get it
 * holds the command's key *positions* (the order the keys will be written)
 * and, per waiting client request (a *waiter*), which positions it asked for.
 *
 * Dedup rule.  A key asked by several waiters gets one position, provided
 * every waiter's own keys stay an increasing sequence of positions: a waiter
 * asking "k2 k1" after another asked "k1 k2" gets a second position for k1
 * after k2 (memcached answers a repeated key twice, in order).  Keeping each
 * waiter's keys in increasing position order lets the answer be streamed to
 * every waiter in its own key order without holding any value back.
 *
 *   positions   0:k1  1:k2  2:k1
 *   waiter A    k1 k2        -> refs to 0, 1    last_pos 1
 *   waiter B    k2 k1        -> refs to 1, 2    last_pos 2
 *   waiter C    k1           -> ref  to 0       last_pos 0
 *
 * Limits: hard ones (array sizes below) and soft ones per batch (keys, and a
 * byte "cost" = fixed + sum(key length + per-key cost) that the protocol
 * module sets to the command line length).  A non-empty batch refuses a
 * request that would cross a soft or hard limit (MCH_BADD_FULL: close the
 * batch and add to a new one); an empty batch admits any request that fits
 * the hard limits, so a valid request always fits somewhere.
 *
 * This module knows nothing of memcached's syntax (mc_proto.c does); it only
 * copies key bytes into the batch's own arena, so the client datagrams can be
 * freed as soon as they are added.  No globals: all state is in the batch.
 */
#ifndef MCH_BATCH_H
#define MCH_BATCH_H

#include <stddef.h>
#include <stdint.h>

#define MCH_BATCH_MAX_KEYS     256u    /* key positions in one command */
#define MCH_BATCH_MAX_REFS     1024u   /* (waiter, position) pairs */
#define MCH_BATCH_MAX_WAITERS  512u    /* client requests per command */
#define MCH_BATCH_MAX_KEYBYTES 65536u  /* sum of distinct-position key bytes */
#define MCH_BATCH_HASH_SLOTS   512u    /* power of two, >= 2 * MAX_KEYS */
#define MCH_NONE               0xFFFFu

enum mch_badd {
	MCH_BADD_OK = 0,
	MCH_BADD_FULL = 1,    /* does not fit this batch: close it, retry */
	MCH_BADD_TOO_BIG = 2, /* cannot fit even an empty batch */
};

/* waiter flags (set by the caller of mch_batch_add) */
#define MCH_WF_CAS    0x01u /* wants the cas column (asked gets / gats) */
#define MCH_WF_SILENT 0x02u /* noreply: the answer is parsed, not sent */

/* waiter states, advanced by the response splitter */
enum mch_wstate {
	MCH_WS_PENDING = 0,  /* nothing or only complete messages sent */
	MCH_WS_INFLIGHT = 1, /* part of a multi-datagram message sent */
	MCH_WS_DONE = 2,     /* its reply is complete */
};

struct mch_bkey {
	const uint8_t *p;
	uint32_t len;
};

struct mch_bpos {
	uint32_t koff;      /* key bytes at keys[koff] */
	uint16_t klen;
	uint16_t next_same; /* next (larger) position with the same key */
	uint16_t first_ref; /* waiters at this position, in arrival order */
	uint16_t last_ref;
};

struct mch_bref {
	uint16_t waiter;
	uint16_t next; /* next ref at the same position */
};

struct mch_bwaiter {
	uint32_t client;   /* caller's opaque client handle */
	uint16_t rid;      /* the client's request id */
	uint16_t nkeys;
	uint16_t last_pos; /* its largest position, MCH_NONE if no keys */
	uint8_t flags;     /* MCH_WF_* */
	uint8_t state;     /* enum mch_wstate */
};

struct mch_batch {
	uint32_t soft_keys, soft_cost; /* limits of this batch */
	uint32_t cost_fixed, cost_per_key;
	uint32_t cost;     /* cost_fixed + sum(klen + cost_per_key) */
	uint32_t keybytes; /* bytes used in keys[] */
	uint16_t npos, nrefs, nwaiters;
	uint8_t flags_or; /* OR of all waiters' flags */
	uint8_t cmd;      /* tags owned by mc_proto: command and reply shape */
	uint8_t shape;
	uint32_t user;    /* free for the caller (e.g. a batch id) */
	uint16_t slot[MCH_BATCH_HASH_SLOTS]; /* 0 empty, else head position + 1 */
	struct mch_bpos pos[MCH_BATCH_MAX_KEYS];
	struct mch_bref ref[MCH_BATCH_MAX_REFS];
	struct mch_bwaiter w[MCH_BATCH_MAX_WAITERS];
	uint8_t keys[MCH_BATCH_MAX_KEYBYTES];
};

/* Empty the batch and set its limits (soft limits are clamped to the hard). */
void mch_batch_reset(struct mch_batch *b, uint32_t soft_keys, uint32_t soft_cost,
		     uint32_t cost_fixed, uint32_t cost_per_key);

/*
 * Add one waiter asking keys[0..n) in that order (n may be 0: a waiter with no
 * keys, e.g. a pass-through command).  All or nothing.  Returns enum mch_badd.
 */
int mch_batch_add(struct mch_batch *b, uint32_t client, uint16_t rid, uint8_t flags,
		  const struct mch_bkey *keys, uint32_t n);

/* First position >= from holding this key, or MCH_NONE. */
uint32_t mch_batch_find(const struct mch_batch *b, uint32_t from, const uint8_t *key,
			uint32_t len);

static inline const uint8_t *mch_batch_key(const struct mch_batch *b, uint32_t pos,
					   uint32_t *len)
{
	*len = b->pos[pos].klen;
	return b->keys + b->pos[pos].koff;
}

#endif /* MCH_BATCH_H */
