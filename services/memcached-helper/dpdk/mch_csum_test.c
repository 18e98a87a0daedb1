/*
 * mch_csum_test.c - vector driver for mch_csum.h.
 *
 * One command per line on stdin, one answer line each:
 *
 *   sum <offset> <hex bytes>    SUM <sum> COPY <sum> ok|bad-copy
 *
 * The bytes sit <offset> (0-7) bytes into the source buffer and are copied
 * as far into the destination (unaligned loads and stores); <sum> is the
 * folded 16-bit sum as a big-endian number (4 hex digits), from mch_csum and
 * from mch_csum_copy; "ok" when the copy holds the bytes and left every byte
 * around them alone.  Used by tests/unit/test_mch_csum.py, which checks the
 * sums against RFC 1071 computed in Python.  No DPDK.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#include "mch_csum.h"

#define MAXB   4096u
#define GUARD  16u
#define CANARY 0xa5u

static int hexval(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

int main(void)
{
	static char line[2u * MAXB + 64u];
	static uint8_t src[MAXB + GUARD], dst[MAXB + 3u * GUARD];
	unsigned off;
	int at;

	while (fgets(line, sizeof(line), stdin)) {
		const char *h;
		uint32_t n = 0, i, a, b;
		uint8_t *d;
		int ok;

		if (sscanf(line, "sum %u %n", &off, &at) != 1 || off > 7u) {
			puts("ERR");
			fflush(stdout);
			continue;
		}
		for (h = line + at; n < MAXB && hexval(h[0]) >= 0 && hexval(h[1]) >= 0; h += 2)
			src[off + n++] = (uint8_t)(hexval(h[0]) << 4 | hexval(h[1]));
		memset(dst, CANARY, sizeof(dst));
		d = dst + GUARD + off;
		a = mch_csum(src + off, n);
		b = mch_csum_copy(d, src + off, n);
		ok = memcmp(d, src + off, n) == 0;
		for (i = 0; i < sizeof(dst); i++)
			if ((dst + i < d || dst + i >= d + n) && dst[i] != CANARY)
				ok = 0;
		printf("SUM %04x COPY %04x %s\n", ntohs((uint16_t)a), ntohs((uint16_t)b),
		       ok ? "ok" : "bad-copy");
		fflush(stdout);
	}
	return 0;
}
