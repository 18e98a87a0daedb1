/*
 * mch_order_test.c - vector driver for mch_order.c.
 *
 * One command per line on stdin, one answer line each (items are numbered by
 * the driver; time is in abstract ticks, the hold given at start):
 *
 *   init <hold>                     OK
 *   arrive <client> <rid> <now>     GO <item> | HOLD <item>
 *   next <client>                   ITEM <item> | NONE
 *   expired <now>                   ITEM <item> <client> | NONE
 *   due <now>                       DUE <ticks> | NEVER
 *   ctr                             CTR held filled expired late full nheld
 *
 * Used by tests/unit/test_mch_order.py.  No DPDK.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "mch_order.h"

int main(void)
{
	static struct mch_order o;
	static char line[256];
	unsigned long long a, b, c;
	uintptr_t items = 0;
	uint64_t key;
	void *it;

	mch_order_init(&o, 0);
	while (fgets(line, sizeof(line), stdin)) {
		if (sscanf(line, "init %llu", &a) == 1) {
			mch_order_init(&o, a);
			puts("OK");
		} else if (sscanf(line, "arrive %llu %llu %llu", &a, &b, &c) == 3) {
			uintptr_t n = ++items;
			enum mch_order_verdict v = mch_order_arrive(&o, a, (uint16_t)b, (void *)n, c);

			printf("%s %llu\n", v == MCH_ORDER_HOLD ? "HOLD" : "GO", (unsigned long long)n);
		} else if (sscanf(line, "next %llu", &a) == 1) {
			it = mch_order_next(&o, a);
			if (it)
				printf("ITEM %llu\n", (unsigned long long)(uintptr_t)it);
			else
				puts("NONE");
		} else if (sscanf(line, "expired %llu", &a) == 1) {
			it = mch_order_expired(&o, a, &key);
			if (it)
				printf("ITEM %llu %llu\n", (unsigned long long)(uintptr_t)it, (unsigned long long)key);
			else
				puts("NONE");
		} else if (sscanf(line, "due %llu", &a) == 1) {
			uint64_t d = mch_order_due_in(&o, a);

			if (d == UINT64_MAX)
				puts("NEVER");
			else
				printf("DUE %llu\n", (unsigned long long)d);
		} else if (line[0] == 'c') {
			printf("CTR %llu %llu %llu %llu %llu %u\n", (unsigned long long)o.c.held,
			       (unsigned long long)o.c.filled, (unsigned long long)o.c.expired,
			       (unsigned long long)o.c.late, (unsigned long long)o.c.full, o.nheld);
		} else {
			puts("ERR");
		}
		fflush(stdout);
	}
	return 0;
}
