/*
 * mch_adapt.h - adaptive batching (PostMan, Algorithm 1) and the batch-size
 * histogram.  Pure arithmetic: no DPDK, no I/O, no memcached syntax, so the
 * unit tests drive it directly (mch_adapt_test.c).
 *
 * A connection's open get batch is sent when
 *     (1) T has passed since the connection's previous batch was sent, or
 *     (2) the batch's command line has reached S bytes.
 * After each send the batch's size s (bytes of the coalesced command) and
 * its interval t (ticks since the previous send: idle time included, as in
 * the paper) update S and T:
 *
 *     if (s < 0.75 S or s > 1.25 S) and s >= S_min:  S <- min(s, S_max)
 *     if (t < 0.5 T  or t > 1.5 T)  and t >= T_min:  T <- min(t, T_max)
 *
 * S_min = 1500 bytes and T_min = 10 us are the paper's bounds (DESIGN.md §6);
 * the upper bounds are ours: without T_max one idle second would make every
 * later batch wait a second.  A burst larger than S (one rx burst brings many
 * requests, all of which join the open batch) is what lets S grow; a calm
 * period lets T grow, a busy one makes it shrink.
 */
#ifndef MCH_ADAPT_H
#define MCH_ADAPT_H

#include <stdint.h>

#define MCH_ADAPT_S_MIN 1500u /* bytes: the paper's lower bound (one MTU) */

struct mch_adapt {
	uint64_t S, T;          /* current size (bytes) and interval (ticks) */
	uint64_t s_min, s_max;  /* bounds of S */
	uint64_t t_min, t_max;  /* bounds of T */
	uint64_t s_moves, t_moves; /* how often S and T changed */
};

/* Bounds are put in order (min <= max) and the initial values clamped. */
void mch_adapt_init(struct mch_adapt *a, uint64_t s_init, uint64_t s_min, uint64_t s_max,
		    uint64_t t_init, uint64_t t_min, uint64_t t_max);

/* Algorithm 1 with the last batch's size s and interval t. */
void mch_adapt_update(struct mch_adapt *a, uint64_t s, uint64_t t);

/* Should a batch of `size` bytes, `waited` ticks after the last send, go now? */
static inline int mch_adapt_due(const struct mch_adapt *a, uint64_t size, uint64_t waited)
{
	return size >= a->S || waited >= a->T;
}

/*
 * Histogram of keys per coalesced command: bucket 0 holds 1 key, bucket i
 * (i >= 1) holds 2^i .. 2^(i+1)-1 keys; the last one holds 256 (the hard
 * limit, MCH_BATCH_MAX_KEYS).
 */
#define MCH_HIST_BUCKETS 9u

struct mch_hist {
	uint64_t n[MCH_HIST_BUCKETS];
};

static inline uint32_t mch_hist_bucket(uint32_t keys)
{
	uint32_t b = 0;

	while (keys > 1u && b < MCH_HIST_BUCKETS - 1u) {
		keys >>= 1;
		b++;
	}
	return b;
}

static inline void mch_hist_add(struct mch_hist *h, uint32_t keys)
{
	h->n[mch_hist_bucket(keys)]++;
}

/* Smallest key count of bucket b (1, 2, 4, ... 256). */
static inline uint32_t mch_hist_lo(uint32_t b)
{
	return 1u << b;
}

#endif /* MCH_ADAPT_H */
