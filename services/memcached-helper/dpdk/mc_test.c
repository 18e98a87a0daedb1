/*
 * mc_test.c - vector driver for the memcached protocol core.
 *
 * Reads commands on stdin, one per line, binary arguments in hex, and answers
 * each with result lines followed by a line ".".  The vectors live in the
 * tests (tests/unit/test_mc_proto.py), which also drive a real memcached
 * through it.  Commands:
 *
 *   parse <dg>              OK <cmd> <rid> <noreply> <shape> <keys|-> [ENC <cmd>]
 *                           or REJ <reason>
 *   open <max_keys> <max_line>          start a coalesced get batch: OPEN <id>
 *   add <client> <dg>       get/gets: ADDED <id> | FULL | TOOBIG | REJ <reason>;
 *                           other commands: PASS <id> <encoded command> (queued)
 *   close                   CMD <id> <coalesced command> (queued) | EMPTY
 *   feed <chunk> <bytes>    feed the connection's answer, <chunk> bytes at a
 *                           time (0: all at once, -k: random 1..k, seeded):
 *                           DG <client> <datagram> / DONE <id> lines, then
 *                           FED or ERR <error>
 *   abort                   DG / DONE lines, then ABORTED
 *   counters                C <name> <value> lines
 *   relay <dg>              SAFE or UNSAFE (mch_req_relay_safe)
 *
 * Everything lives in one context passed around; no globals.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mc_proto.h"

#define POOL 96u

struct drv {
	struct mch_counters ctr;
	struct mch_split sp;
	struct mch_batch *pool[POOL];
	uint8_t busy[POOL];
	struct mch_batch *cur;
	uint64_t rng;
	uint8_t *buf; /* decoded arguments */
	uint8_t *enc; /* encoded commands */
	size_t cap;
};

static void put_hex(const uint8_t *p, size_t n)
{
	static const char hx[] = "0123456789abcdef";
	size_t i;

	for (i = 0; i < n; i++) {
		putchar(hx[p[i] >> 4]);
		putchar(hx[p[i] & 15]);
	}
}

static int hexval(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Decode hex text into d->buf; returns the length or -1. */
static long unhex(struct drv *d, const char *s)
{
	size_t n = strlen(s), i;

	if (n % 2 || n / 2 > d->cap)
		return -1;
	for (i = 0; i < n / 2; i++) {
		int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);

		if (hi < 0 || lo < 0)
			return -1;
		d->buf[i] = (uint8_t)(hi << 4 | lo);
	}
	return (long)(n / 2);
}

static void on_dgram(void *arg, uint32_t client, const uint8_t *dg, uint32_t len)
{
	(void)arg;
	printf("DG %u ", client);
	put_hex(dg, len);
	putchar('\n');
}

static void on_done(void *arg, struct mch_batch *b)
{
	struct drv *d = arg;

	d->busy[b->user] = 0;
	printf("DONE %u\n", b->user);
}

static struct mch_batch *take_batch(struct drv *d)
{
	uint32_t i;

	for (i = 0; i < POOL; i++) {
		if (d->busy[i])
			continue;
		if (!d->pool[i])
			d->pool[i] = malloc(sizeof(struct mch_batch));
		if (!d->pool[i])
			return NULL;
		d->busy[i] = 1;
		d->pool[i]->user = i;
		return d->pool[i];
	}
	return NULL;
}

static void print_keys(const struct mch_req *r)
{
	uint32_t i, len;

	if (r->nkeys == 0)
		fputs("-", stdout);
	for (i = 0; i < r->nkeys; i++) {
		const uint8_t *k = mch_req_key(r, i, &len);

		if (i)
			putchar(',');
		put_hex(k, len);
	}
}

static void cmd_parse(struct drv *d, const char *arg)
{
	struct mch_req r;
	struct mch_batch *b;
	long n = unhex(d, arg);
	enum mch_rej rc;
	size_t m;

	if (n < 0) {
		puts("BADARG");
		return;
	}
	rc = mch_req_parse(&r, d->buf, (size_t)n, &d->ctr);
	if (rc != MCH_REJ_OK) {
		printf("REJ %s\n", mch_rej_name(rc));
		return;
	}
	printf("OK %s %u %u %u ", mch_cmd_name(r.cmd), r.rid, r.noreply, r.shape);
	print_keys(&r);
	putchar('\n');
	if (mch_req_is_get(&r) || !(b = take_batch(d)))
		return;
	m = mch_pass_encode(b, &r, 0, d->enc, d->cap, &d->ctr);
	fputs("ENC ", stdout);
	put_hex(d->enc, m);
	putchar('\n');
	d->busy[b->user] = 0;
}

static void cmd_open(struct drv *d, const char *arg)
{
	unsigned max_keys = 0, max_line = 0;

	if (d->cur)
		d->busy[d->cur->user] = 0;
	d->cur = NULL;
	if (sscanf(arg, "%u %u", &max_keys, &max_line) != 2 || !(d->cur = take_batch(d))) {
		puts("BADARG");
		return;
	}
	mch_get_open(d->cur, max_keys, max_line);
	printf("OPEN %u\n", d->cur->user);
}

static void add_pass(struct drv *d, const struct mch_req *r, uint32_t client)
{
	struct mch_batch *b = take_batch(d);
	size_t m = b ? mch_pass_encode(b, r, client, d->enc, d->cap, &d->ctr) : 0;

	if (m == 0 || mch_split_push(&d->sp, b) != 0) {
		if (b)
			d->busy[b->user] = 0;
		puts("NOROOM");
		return;
	}
	printf("PASS %u ", b->user);
	put_hex(d->enc, m);
	putchar('\n');
}

static void cmd_add(struct drv *d, const char *arg)
{
	static const char *const res[] = {"ADDED", "FULL", "TOOBIG"};
	unsigned client = 0;
	const char *sp = strchr(arg, ' ');
	struct mch_req r;
	enum mch_rej rc;
	long n;
	int a;

	if (!sp || sscanf(arg, "%u", &client) != 1 || (n = unhex(d, sp + 1)) < 0) {
		puts("BADARG");
		return;
	}
	rc = mch_req_parse(&r, d->buf, (size_t)n, &d->ctr);
	if (rc != MCH_REJ_OK) {
		printf("REJ %s\n", mch_rej_name(rc));
		return;
	}
	if (!mch_req_is_get(&r)) {
		add_pass(d, &r, client);
		return;
	}
	if (!d->cur) {
		puts("NOBATCH");
		return;
	}
	a = mch_get_add(d->cur, &r, client, &d->ctr);
	if (a == MCH_BADD_OK)
		printf("ADDED %u\n", d->cur->user);
	else
		puts(res[a]);
}

static void cmd_close(struct drv *d)
{
	size_t m = d->cur ? mch_get_encode(d->cur, d->enc, d->cap, &d->ctr) : 0;

	if (m == 0 || mch_split_push(&d->sp, d->cur) != 0) {
		if (d->cur)
			d->busy[d->cur->user] = 0;
		d->cur = NULL;
		puts("EMPTY");
		return;
	}
	printf("CMD %u ", d->cur->user);
	put_hex(d->enc, m);
	putchar('\n');
	d->cur = NULL;
}

static uint64_t rnd(struct drv *d)
{
	d->rng ^= d->rng << 13;
	d->rng ^= d->rng >> 7;
	d->rng ^= d->rng << 17;
	return d->rng;
}

static void cmd_feed(struct drv *d, const char *arg)
{
	const char *sp = strchr(arg, ' ');
	long chunk = strtol(arg, NULL, 10), n = sp ? unhex(d, sp + 1) : -1, off = 0;
	int err = MCH_ERR_NONE;

	if (n < 0) {
		puts("BADARG");
		return;
	}
	while (off < n && err == MCH_ERR_NONE) {
		long k = n - off;

		long r = chunk < 0 ? 1 + (long)(rnd(d) % (uint64_t)(-chunk)) : chunk;

		if (r > 0 && k > r)
			k = r;
		err = mch_split_feed(&d->sp, d->buf + off, (size_t)k);
		off += k;
	}
	if (err)
		printf("ERR %s\n", mch_err_name(err));
	else
		puts("FED");
}

static void cmd_counters(const struct drv *d)
{
	const struct mch_counters *c = &d->ctr;
	int i;

#define C(f) printf("C %s %llu\n", #f, (unsigned long long)c->f)
	C(rx); C(rx_get); C(rx_gets); C(rx_keys); C(rx_pass); C(b_full); C(b_cmds);
	C(b_keys); C(b_refs); C(b_waiters); C(b_pass); C(s_values); C(s_value_bytes);
	C(s_misses); C(s_lines); C(tx_dgrams); C(tx_bytes); C(w_done); C(w_silent);
	C(w_abort_miss); C(w_abort_drop);
#undef C
	for (i = 1; i < MCH_REJ__COUNT; i++)
		printf("C rej_%s %llu\n", mch_rej_name(i), (unsigned long long)c->rej[i]);
	for (i = 1; i < MCH_ERR__COUNT; i++)
		printf("C err_%s %llu\n", mch_err_name(i), (unsigned long long)c->s_err[i]);
}

static void dispatch(struct drv *d, char *line)
{
	char *arg = strchr(line, ' ');

	if (arg)
		*arg++ = '\0';
	else
		arg = line + strlen(line);
	if (!strcmp(line, "parse"))
		cmd_parse(d, arg);
	else if (!strcmp(line, "open"))
		cmd_open(d, arg);
	else if (!strcmp(line, "add"))
		cmd_add(d, arg);
	else if (!strcmp(line, "close"))
		cmd_close(d);
	else if (!strcmp(line, "feed"))
		cmd_feed(d, arg);
	else if (!strcmp(line, "abort")) {
		mch_split_abort(&d->sp);
		puts("ABORTED");
	} else if (!strcmp(line, "counters")) {
		cmd_counters(d);
	} else if (!strcmp(line, "relay")) {
		long n = unhex(d, arg);

		puts(n >= 0 && mch_req_relay_safe(d->buf, (size_t)n) ? "SAFE" : "UNSAFE");
	}
	else
		puts("BADCMD");
}

int main(void)
{
	struct drv *d = calloc(1, sizeof(*d));
	struct mch_sink sink = {on_dgram, on_done, NULL};
	char *line = NULL;
	size_t lcap = 0;
	ssize_t n;
	uint32_t i;

	if (!d)
		return 1;
	d->cap = 8u << 20;
	d->buf = malloc(d->cap);
	d->enc = malloc(d->cap);
	d->rng = 0x9e3779b97f4a7c15ull;
	if (!d->buf || !d->enc)
		return 1;
	sink.arg = d;
	mch_split_init(&d->sp, &sink, &d->ctr);
	while ((n = getline(&line, &lcap, stdin)) >= 0) {
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			line[--n] = '\0';
		dispatch(d, line);
		puts(".");
		fflush(stdout);
	}
	free(line);
	for (i = 0; i < POOL; i++)
		free(d->pool[i]);
	free(d->buf);
	free(d->enc);
	free(d);
	return 0;
}
