/*
 * mch_order.c - hold a client's request until its earlier ones arrive (see mch_order.h).
 */
#include "mch_order.h"

#include <string.h>

/* the id after r as clients count: 0 is skipped on wrap by some (ours), taken by others */
static int is_next(uint16_t next, uint16_t rid)
{
	return rid == next || (next == 0 && rid == 1);
}

static uint32_t slot_of(uint64_t key)
{
	uint64_t h = key * 0x9e3779b97f4a7c15ull;

	return (uint32_t)(h >> 52) & (MCH_ORDER_CLIENTS - 1u);
}

void mch_order_init(struct mch_order *o, uint64_t hold_ticks)
{
	memset(o, 0, sizeof(*o));
	o->hold = hold_ticks;
}

enum mch_order_verdict mch_order_arrive(struct mch_order *o, uint64_t key, uint16_t rid, void *item,
					uint64_t now)
{
	uint32_t s = slot_of(key + 1u), i;
	uint16_t ahead;

	if (o->cl[s].key != key + 1u) { /* new here (or it took another client's slot) */
		o->cl[s].key = key + 1u;
		o->cl[s].next = (uint16_t)(rid + 1u);
		return MCH_ORDER_GO;
	}
	if (is_next(o->cl[s].next, rid)) {
		o->cl[s].next = (uint16_t)(rid + 1u);
		return MCH_ORDER_GO;
	}
	ahead = (uint16_t)(rid - o->cl[s].next);
	if (ahead >= 0x10000u - MCH_ORDER_BEHIND) { /* just behind: one overtaken and already given up on */
		o->c.late++;
		return MCH_ORDER_GO;
	}
	if (ahead > MCH_ORDER_GAP || o->hold == 0) { /* a jump, or far back (a counter that wrapped): a new count */
		o->cl[s].next = (uint16_t)(rid + 1u);
		return MCH_ORDER_GO;
	}
	if (o->nheld == MCH_ORDER_HELD) {
		o->c.full++;
		o->cl[s].next = (uint16_t)(rid + 1u);
		return MCH_ORDER_GO;
	}
	for (i = 0; o->h[i].item != NULL; i++)
		;
	o->h[i].item = item;
	o->h[i].key = key;
	o->h[i].rid = rid;
	o->h[i].until = now + o->hold;
	o->nheld++;
	o->c.held++;
	return MCH_ORDER_HOLD;
}

static void *take(struct mch_order *o, uint32_t i, uint32_t s)
{
	void *item = o->h[i].item;

	o->cl[s].next = (uint16_t)(o->h[i].rid + 1u);
	o->h[i].item = NULL;
	o->nheld--;
	return item;
}

void *mch_order_next(struct mch_order *o, uint64_t key)
{
	uint32_t s = slot_of(key + 1u), i;

	if (o->nheld == 0 || o->cl[s].key != key + 1u)
		return NULL;
	for (i = 0; i < MCH_ORDER_HELD; i++)
		if (o->h[i].item != NULL && o->h[i].key == key && is_next(o->cl[s].next, o->h[i].rid)) {
			o->c.filled++;
			return take(o, i, s);
		}
	return NULL;
}

void *mch_order_expired(struct mch_order *o, uint64_t now, uint64_t *key)
{
	uint32_t i, best = MCH_ORDER_HELD, s;
	uint16_t ahead, best_ahead = 0xFFFFu;

	if (o->nheld == 0)
		return NULL;
	for (i = 0; i < MCH_ORDER_HELD; i++)
		if (o->h[i].item != NULL && (int64_t)(now - o->h[i].until) >= 0)
			break;
	if (i == MCH_ORDER_HELD)
		return NULL;
	*key = o->h[i].key;
	s = slot_of(*key + 1u);
	if (o->cl[s].key != *key + 1u) { /* its slot was taken meanwhile: it is back, counted from here */
		o->cl[s].key = *key + 1u;
		o->cl[s].next = o->h[i].rid;
	}
	/* of that client's held requests, the earliest-numbered goes first */
	for (i = 0; i < MCH_ORDER_HELD; i++) {
		if (o->h[i].item == NULL || o->h[i].key != *key)
			continue;
		ahead = (uint16_t)(o->h[i].rid - o->cl[s].next);
		if (best == MCH_ORDER_HELD || ahead < best_ahead) {
			best = i;
			best_ahead = ahead;
		}
	}
	o->c.expired++;
	return take(o, best, s);
}

uint64_t mch_order_due_in(const struct mch_order *o, uint64_t now)
{
	uint64_t d = UINT64_MAX;
	uint32_t i;

	if (o->nheld == 0)
		return UINT64_MAX;
	for (i = 0; i < MCH_ORDER_HELD; i++) {
		if (o->h[i].item == NULL)
			continue;
		if ((int64_t)(o->h[i].until - now) <= 0)
			return 0;
		if (o->h[i].until - now < d)
			d = o->h[i].until - now;
	}
	return d;
}
