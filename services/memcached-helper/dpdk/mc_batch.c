/*
 * mc_batch.c - order-preserving key dedup for coalesced commands.
 *
 * See mc_batch.h for the model (positions, waiters, refs, limits).  Keys are
 * found through a small open-addressing table (FNV-1a, linear probing, at
 * most half full) whose slot points at the first position of a key; further
 * positions of the same key are chained in increasing order (next_same).
 * Adding a request is a dry run (how many new positions, how many bytes)
 * followed by the commit, so a refused request leaves the batch untouched.
 */
#include "mc_batch.h"

#include <string.h>

#define MCH_SLOT_MASK (MCH_BATCH_HASH_SLOTS - 1u)

static uint32_t bkey_hash(const uint8_t *p, uint32_t n)
{
	uint32_t h = 2166136261u;

	while (n--) {
		h ^= *p++;
		h *= 16777619u;
	}
	return h;
}

static int pos_has_key(const struct mch_batch *b, uint32_t pos, const uint8_t *key,
		       uint32_t len)
{
	return b->pos[pos].klen == len && memcmp(b->keys + b->pos[pos].koff, key, len) == 0;
}

/* The slot holding this key's chain, or the empty slot where it would go. */
static uint32_t slot_of(const struct mch_batch *b, const uint8_t *key, uint32_t len)
{
	uint32_t i = bkey_hash(key, len) & MCH_SLOT_MASK;

	while (b->slot[i] != 0 && !pos_has_key(b, b->slot[i] - 1u, key, len))
		i = (i + 1u) & MCH_SLOT_MASK;
	return i;
}

void mch_batch_reset(struct mch_batch *b, uint32_t soft_keys, uint32_t soft_cost,
		     uint32_t cost_fixed, uint32_t cost_per_key)
{
	b->soft_keys = soft_keys < MCH_BATCH_MAX_KEYS ? soft_keys : MCH_BATCH_MAX_KEYS;
	b->soft_cost = soft_cost;
	b->cost_fixed = cost_fixed;
	b->cost_per_key = cost_per_key;
	b->cost = cost_fixed;
	b->keybytes = 0;
	b->npos = b->nrefs = b->nwaiters = 0;
	b->flags_or = 0;
	b->cmd = b->shape = 0;
	memset(b->slot, 0, sizeof(b->slot));
}

uint32_t mch_batch_find(const struct mch_batch *b, uint32_t from, const uint8_t *key,
			uint32_t len)
{
	uint32_t s = slot_of(b, key, len);
	uint32_t p;

	if (b->slot[s] == 0)
		return MCH_NONE;
	for (p = b->slot[s] - 1u; p != MCH_NONE; p = b->pos[p].next_same)
		if (p >= from)
			return p;
	return MCH_NONE;
}

/* Append a new position for key (limits already checked). */
static uint32_t new_pos(struct mch_batch *b, const uint8_t *key, uint32_t len)
{
	uint32_t p = b->npos++;
	uint32_t s = slot_of(b, key, len);
	struct mch_bpos *bp = &b->pos[p];

	bp->koff = b->keybytes;
	bp->klen = (uint16_t)len;
	bp->next_same = MCH_NONE;
	bp->first_ref = bp->last_ref = MCH_NONE;
	memcpy(b->keys + b->keybytes, key, len);
	b->keybytes += len;
	b->cost += len + b->cost_per_key;
	if (b->slot[s] == 0) {
		b->slot[s] = (uint16_t)(p + 1u);
	} else {
		uint32_t t = b->slot[s] - 1u;

		while (b->pos[t].next_same != MCH_NONE)
			t = b->pos[t].next_same;
		b->pos[t].next_same = (uint16_t)p;
	}
	return p;
}

static void link_ref(struct mch_batch *b, uint32_t pos, uint32_t waiter)
{
	uint32_t r = b->nrefs++;
	struct mch_bpos *bp = &b->pos[pos];

	b->ref[r].waiter = (uint16_t)waiter;
	b->ref[r].next = MCH_NONE;
	if (bp->last_ref == MCH_NONE)
		bp->first_ref = (uint16_t)r;
	else
		b->ref[bp->last_ref].next = (uint16_t)r;
	bp->last_ref = (uint16_t)r;
}

/*
 * Dry run: index of the first key that needs a new position (every later key
 * then needs one too, since new positions go after all existing ones).
 */
static uint32_t first_new_key(const struct mch_batch *b, const struct mch_bkey *keys,
			      uint32_t n)
{
	uint32_t from = 0, i;

	for (i = 0; i < n; i++) {
		uint32_t p = mch_batch_find(b, from, keys[i].p, keys[i].len);

		if (p == MCH_NONE)
			return i;
		from = p + 1u;
	}
	return n;
}

static int check_limits(const struct mch_batch *b, const struct mch_bkey *keys, uint32_t n,
			uint32_t first_new)
{
	uint32_t new_cnt = n - first_new, new_bytes = 0, i;
	int empty = b->nwaiters == 0;

	for (i = first_new; i < n; i++)
		new_bytes += keys[i].len;
	if (b->npos + new_cnt > MCH_BATCH_MAX_KEYS ||
	    b->keybytes + new_bytes > MCH_BATCH_MAX_KEYBYTES ||
	    b->nrefs + n > MCH_BATCH_MAX_REFS || b->nwaiters + 1u > MCH_BATCH_MAX_WAITERS)
		return empty ? MCH_BADD_TOO_BIG : MCH_BADD_FULL;
	if (!empty && (b->npos + new_cnt > b->soft_keys ||
		       b->cost + new_bytes + new_cnt * b->cost_per_key > b->soft_cost))
		return MCH_BADD_FULL;
	return MCH_BADD_OK;
}

int mch_batch_add(struct mch_batch *b, uint32_t client, uint16_t rid, uint8_t flags,
		  const struct mch_bkey *keys, uint32_t n)
{
	uint32_t first_new, from = 0, w, i;
	struct mch_bwaiter *bw;
	int rc;

	if (n > MCH_BATCH_MAX_KEYS)
		return MCH_BADD_TOO_BIG;
	for (i = 0; i < n; i++)
		if (keys[i].len == 0 || keys[i].len > 0xFFFFu)
			return MCH_BADD_TOO_BIG;
	first_new = first_new_key(b, keys, n);
	rc = check_limits(b, keys, n, first_new);
	if (rc != MCH_BADD_OK)
		return rc;

	w = b->nwaiters++;
	bw = &b->w[w];
	bw->client = client;
	bw->rid = rid;
	bw->nkeys = (uint16_t)n;
	bw->flags = flags;
	bw->state = MCH_WS_PENDING;
	for (i = 0; i < n; i++) {
		uint32_t p = i < first_new ? mch_batch_find(b, from, keys[i].p, keys[i].len)
					   : new_pos(b, keys[i].p, keys[i].len);

		link_ref(b, p, w);
		from = p + 1u;
	}
	bw->last_pos = n ? (uint16_t)(from - 1u) : MCH_NONE;
	b->flags_or |= flags;
	return MCH_BADD_OK;
}
