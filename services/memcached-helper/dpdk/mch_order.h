/*
 * mch_order.h - a client's requests served in the order it numbered them
 * (issue 43: per-client order for mixed sizes).
 *
 * The network may hand the helper a client's datagrams out of order: Open
 * vSwitch's userspace datapath executes a receive batch flow by flow (each
 * datapath flow's packets together, in the order of each flow's first packet,
 * and a packet that misses the flow cache ahead of the batch), and a request
 * in IP fragments is another flow than the same client's small one.  So a
 * pipelined `get k` then a 3 KB `set k` can arrive set first; memcached then
 * runs them in that order and the get sees the new value.
 *
 * memcached's UDP clients number their requests (the 16-bit request id of the
 * frame header); common clients count it up by one per request (ours;
 * libmemcached in its low 10 bits, under bits of its own).  The helper remembers the next id it expects of each client
 * (address, port) and holds a request whose id is a little ahead (1..GAP
 * early: the ones between are on their way) until those arrive or the hold
 * time passes, then serves it.  Anything else (the expected id, an id behind,
 * a jump either way, a client not seen before, a table slot taken by another
 * client) is served at once.  A client whose ids are random is held only when one lands
 * 1..GAP ahead by chance (GAP/65536 of its requests, each at most the hold).
 *
 * Pure bookkeeping over opaque items (the worker's mbufs): no DPDK, no I/O,
 * tested by mch_order_test.c.  Time is in the caller's ticks.
 */
#ifndef MCH_ORDER_H
#define MCH_ORDER_H

#include <stdint.h>

#define MCH_ORDER_CLIENTS 4096u /* direct-mapped table of clients (a collision forgets one: served at once) */
#define MCH_ORDER_HELD    32u   /* requests held at once per worker (past it: served at once, counted) */
#define MCH_ORDER_GAP     8u    /* an id at most this far ahead of the expected one is held */
#define MCH_ORDER_BEHIND  64u   /* an id at most this far behind is a straggler (served, counted late);
				 * farther back is a new count (libmemcached wraps its low 10 bits) */

enum mch_order_verdict { MCH_ORDER_GO = 0, MCH_ORDER_HOLD = 1 };

struct mch_order_ctr {
	uint64_t held;     /* requests held for an earlier one */
	uint64_t filled;   /* held requests served once the earlier ones came */
	uint64_t expired;  /* held requests served when the hold time passed (an earlier one lost) */
	uint64_t late;     /* requests behind the expected id (served at once, out of order) */
	uint64_t full;     /* would have been held, but MCH_ORDER_HELD were (served at once) */
};

struct mch_order {
	uint64_t hold;     /* ticks; 0: never hold */
	struct {
		uint64_t key;  /* client (ip << 16 | port) + 1; 0: free */
		uint16_t next; /* the id expected next */
	} cl[MCH_ORDER_CLIENTS];
	struct {
		void *item;    /* NULL: free */
		uint64_t key, until;
		uint16_t rid;
	} h[MCH_ORDER_HELD];
	uint32_t nheld;
	struct mch_order_ctr c;
};

void mch_order_init(struct mch_order *o, uint64_t hold_ticks);

/* A request of client `key` with id `rid` arrives: GO (serve it now, then drain mch_order_next) or HOLD (kept). */
enum mch_order_verdict mch_order_arrive(struct mch_order *o, uint64_t key, uint16_t rid, void *item,
					uint64_t now);

/* After serving a request of `key`: a held request of it that is now next (serve it, and ask again), or NULL. */
void *mch_order_next(struct mch_order *o, uint64_t key);

/*
 * A held request whose hold time has passed (the earliest-numbered of its
 * client), or NULL; *key is set to its client (serve it, then drain
 * mch_order_next for that client).
 */
void *mch_order_expired(struct mch_order *o, uint64_t now, uint64_t *key);

/* Ticks until the first held request's hold ends (UINT64_MAX: none held; 0: now). */
uint64_t mch_order_due_in(const struct mch_order *o, uint64_t now);

#endif /* MCH_ORDER_H */
