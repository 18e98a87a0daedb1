/*
 * mch_corebench.c - the helper's own work per get, without the kernel: CPU
 * nanoseconds per single-key get through the protocol core (parse, coalesce,
 * encode, split memcached's answer) and the frame work around it (the
 * request's checksums checked, the reply copied with its checksum summed).
 *
 * The load is bench/helper_throughput.py's: single-key `get` of KEYS keys
 * (key i*7919 % KEYS of request i, as mch_blast sends them), 64-byte values,
 * from 256 clients; batches close at --batch keys (the throughput bench's
 * fabric setting sees ~195).  memcached's answer to each multi-get is
 * written once, as memcached would, and fed to the splitter in --chunk-byte
 * reads.  Deterministic: the same work every run, so two builds compare
 * within a few per cent where the throughput bench's rounds spread 0.65-1.06.
 *
 *   mch_corebench [--gets N] [--batch K] [--keys N] [--chunk BYTES] [--rounds R]
 *
 * Prints one line per round and the best: "ns_per_get <x>".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mc_batch.h"
#include "mc_proto.h"
#include "mch_csum.h"

#define VALUE_LEN 64u
#define NCLIENTS  256u
#define FRAME_HDR 42u /* Ethernet + IPv4 + UDP */

struct sink_state {
	uint8_t frame[2048];
	uint64_t sum, frames;
};

static void on_dgram(void *arg, uint32_t client, const uint8_t *dg, uint32_t len)
{
	struct sink_state *s = arg;

	/* what mch_net_reply does with the datagram: copy it behind the headers, summing it */
	s->sum += mch_csum_copy(s->frame + FRAME_HDR, dg, len) + client;
	s->frames++;
}

static void on_done(void *arg, struct mch_batch *b)
{
	(void)arg;
	(void)b;
}

static double now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
	return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static uint32_t arg_u32(int argc, char **argv, const char *name, uint32_t def)
{
	int i;

	for (i = 1; i + 1 < argc; i++)
		if (!strcmp(argv[i], name))
			return (uint32_t)strtoul(argv[i + 1], NULL, 10);
	return def;
}

int main(int argc, char **argv)
{
	uint32_t gets = arg_u32(argc, argv, "--gets", 2000000), kmax = arg_u32(argc, argv, "--batch", 195);
	uint32_t keys = arg_u32(argc, argv, "--keys", 1000), chunk = arg_u32(argc, argv, "--chunk", 65536);
	uint32_t rounds = arg_u32(argc, argv, "--rounds", 5), r, i, j;
	uint8_t (*req)[64] = calloc(NCLIENTS * 4u, 64);
	uint32_t *reqlen = calloc(NCLIENTS * 4u, sizeof(uint32_t));
	uint8_t *ans = malloc(1u << 20), *line = malloc(MCH_GET_LINE_MAX);
	struct mch_batch *b = malloc(sizeof(*b));
	struct mch_split *sp = malloc(sizeof(*sp));
	struct mch_counters c;
	struct sink_state st;
	struct mch_sink sink = {on_dgram, on_done, &st};
	double best = 0;

	if (!req || !reqlen || !ans || !line || !b || !sp || kmax == 0 || kmax > MCH_BATCH_MAX_KEYS ||
	    keys == 0 || chunk == 0) {
		fprintf(stderr, "mch_corebench: bad arguments or no memory\n");
		return 2;
	}
	memset(&c, 0, sizeof(c));
	memset(&st, 0, sizeof(st));
	/* a UDP datagram per request, as mch_blast builds them (a cycle of NCLIENTS * 4) */
	for (i = 0; i < NCLIENTS * 4u; i++) {
		uint16_t rid = (uint16_t)(i + 1u);
		int n = snprintf((char *)req[i] + 16, 48, "get k%u\r\n", (i * 7919u) % keys);

		memset(req[i], 0, 16);
		req[i][8] = (uint8_t)(rid >> 8);
		req[i][9] = (uint8_t)rid;
		req[i][13] = 1;
		reqlen[i] = 8u + 8u + (uint32_t)n; /* UDP header + memcached frame header + line */
	}
	for (r = 0; r < rounds; r++) {
		double t0 = now_ns(), ns, ta, skip = 0;
		uint32_t done = 0;

		mch_split_init(sp, &sink, &c);
		while (done < gets) {
			size_t n, o = 0;
			struct mch_req q;

			mch_get_open(b, kmax, MCH_GET_LINE_MAX);
			/* requests until the batch is full */
			for (; done < gets; done++) {
				uint32_t k = done % (NCLIENTS * 4u);

				/* the request's UDP checksum checked as mch_net_parse does */
				st.sum += mch_csum(req[k], reqlen[k]);
				if (mch_req_parse(&q, req[k] + 8, reqlen[k] - 8u, &c) != MCH_REJ_OK)
					return 3;
				if (mch_get_add(b, &q, k % NCLIENTS, &c) != MCH_BADD_OK)
					break;
			}
			n = mch_get_encode(b, line, MCH_GET_LINE_MAX, &c);
			if (n == 0 || mch_split_push(sp, b) != 0)
				return 4;
			/* memcached's answer (its building not timed): every asked key has a value */
			ta = now_ns();
			for (j = 0; j < b->npos; j++) {
				uint32_t klen;
				const uint8_t *kp = mch_batch_key(b, j, &klen);

				o += (size_t)sprintf((char *)ans + o, "VALUE %.*s 0 %u\r\n", (int)klen,
						     (const char *)kp, VALUE_LEN);
				memset(ans + o, 'v', VALUE_LEN);
				o += VALUE_LEN;
				memcpy(ans + o, "\r\n", 2);
				o += 2;
			}
			memcpy(ans + o, "END\r\n", 5);
			o += 5;
			skip += now_ns() - ta;
			for (j = 0; j < o; j += chunk)
				if (mch_split_feed(sp, ans + j, o - j < chunk ? o - j : chunk) != MCH_ERR_NONE)
					return 5;
		}
		ns = (now_ns() - t0 - skip) / gets;
		printf("round %u: ns_per_get %.1f (%lu replies, %.1f keys per multi-get)\n", r + 1, ns,
		       (unsigned long)st.frames, (double)c.b_keys / (double)c.b_cmds);
		if (r == 0 || ns < best)
			best = ns;
	}
	/* the sums printed keep the compiler from dropping the checksum work */
	printf("checksum sum %016llx\nns_per_get %.1f\n", (unsigned long long)st.sum, best);
	free(req);
	free(reqlen);
	free(ans);
	free(line);
	free(b);
	free(sp);
	return 0;
}
