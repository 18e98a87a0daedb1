/*
 * mch_adapt_test.c - vector driver for the adaptive batching (mch_adapt.c).
 *
 * Commands on stdin, one per line; each is answered by one line:
 *
 *   init <s_init> <s_min> <s_max> <t_init> <t_min> <t_max>   S <S> T <T>
 *   update <s> <t>                                           S <S> T <T>
 *   due <size> <waited>                                      DUE 0|1
 *   bucket <keys>                                            B <bucket> <lo>
 *
 * Used by tests/unit/test_mch_adapt.py.  No DPDK: ticks are plain numbers.
 */
#include <stdio.h>
#include <string.h>

#include "mch_adapt.h"

int main(void)
{
	struct mch_adapt a;
	char line[256];
	unsigned long long v[6];

	mch_adapt_init(&a, MCH_ADAPT_S_MIN, MCH_ADAPT_S_MIN, 65536, 10, 10, 1000);
	while (fgets(line, sizeof(line), stdin)) {
		if (sscanf(line, "init %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
			   &v[4], &v[5]) == 6) {
			mch_adapt_init(&a, v[0], v[1], v[2], v[3], v[4], v[5]);
		} else if (sscanf(line, "update %llu %llu", &v[0], &v[1]) == 2) {
			mch_adapt_update(&a, v[0], v[1]);
		} else if (sscanf(line, "due %llu %llu", &v[0], &v[1]) == 2) {
			printf("DUE %d\n", mch_adapt_due(&a, v[0], v[1]));
			fflush(stdout);
			continue;
		} else if (sscanf(line, "bucket %llu", &v[0]) == 1) {
			uint32_t b = mch_hist_bucket((uint32_t)v[0]);

			printf("B %u %u\n", b, mch_hist_lo(b));
			fflush(stdout);
			continue;
		} else {
			puts("BADCMD");
			fflush(stdout);
			continue;
		}
		printf("S %llu T %llu\n", (unsigned long long)a.S, (unsigned long long)a.T);
		fflush(stdout);
	}
	return 0;
}
