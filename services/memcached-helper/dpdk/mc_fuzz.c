/*
 * mc_fuzz.c - deterministic fuzz loop over the memcached protocol core.
 *
 *   mc_fuzz [-n ITERATIONS] [-t SECONDS] [-s SEED] [-c CORPUS_DIR] [-m MODE]
 *
 * Built with -fsanitize=address,undefined (make SANITIZE=1) so any
 * out-of-bounds access or undefined behaviour aborts the run.  Each iteration
 * picks one of four modes, all driven by one seeded PRNG (same seed, same
 * inputs):
 *
 *   parse      a seed request (built-in corpus plus files from -c) mutated
 *              1-4 times (bit flips, magic bytes and tokens, inserts, deletes,
 *              splices, truncation, header fields) then parsed.  Invariants:
 *              slices inside the datagram, keys 1..250 bytes without NUL/CR/LF
 *              bytes or spaces, storage data exactly <bytes> + CRLF to the end;
 *              every accepted request round-trips: a get through a one-waiter
 *              batch, a pass-through command through mch_pass_encode, and
 *              parses again to the same command, keys, tokens and data.
 *   roundtrip  a random key/value model (sizes across the 1392-byte datagram
 *              boundaries, binary values holding "\r\nEND\r\n"), 1-60 clients
 *              with get/gets of 1-20 keys (repeats, misses, conflicting
 *              orders), coalesced under random limits; every command line
 *              re-parses to its positions and respects the limits; the answer
 *              memcached would give is fed in random chunks (sometimes byte
 *              by byte) and every client's datagrams must equal, byte for
 *              byte, memcached's own layout computed independently here.
 *   garbage    the same with the answer mutated (flips, cut lines, lying
 *              lengths, error lines, junk, truncation): never a crash; every
 *              datagram <= 1400 bytes with a coherent header; a client's
 *              messages numbered 0..total-1; nothing after a reply's END;
 *              after abort every batch is done once and the splitter is clean.
 *   pass       pass-through commands (incl. noreply and over-long stats
 *              answers) interleaved with get batches on one connection: each
 *              client gets exactly the answer line(s), silent ones nothing,
 *              and an oversized answer is the error expected.
 *
 * Prints "iterations N seconds S" on success; exits 1 with the iteration and
 * seed on the first violated invariant.  All state in struct fz, no globals.
 */
#include <dirent.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mc_proto.h"

#define MAXC   64u   /* clients per iteration */
#define MAXK   20u   /* keys per client request */
#define MAXU   40u   /* key universe */
#define NBATCH 80u
#define MAXSEED 256u

struct gbuf {
	uint8_t *p;
	size_t n, cap;
};

struct item {
	uint8_t key[MCH_KEY_MAX];
	uint32_t klen;
	int present;
	uint32_t flags;
	uint64_t cas;
	size_t voff; /* value bytes in fz.vals */
	uint32_t vlen;
};

struct creq {
	uint16_t rid;
	int gets;
	uint32_t nk;
	uint32_t keys[MAXK]; /* item index */
};

struct fz {
	uint64_t rng, seed, iter;
	const char *mode;
	struct mch_counters ctr;
	struct mch_split sp;
	struct mch_batch *pool[NBATCH];
	uint32_t npool;       /* batches pushed this iteration */
	uint32_t done_order[NBATCH];
	uint32_t ndone;
	struct gbuf out[MAXC]; /* captured datagrams, 2-byte length prefix */
	uint32_t ncl;
	struct item it[MAXU];
	uint32_t nu;
	struct gbuf vals, ans, tmp, exp;
	struct creq cr[MAXC];
	uint8_t dg[MCH_DGRAM_MAX + 16];
	uint8_t enc[MCH_DGRAM_MAX + MCH_GET_LINE_MAX];
	struct gbuf seeds[MAXSEED];
	uint32_t nseeds;
};

static void die(struct fz *f, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "mc_fuzz: iteration %llu (seed %llu, mode %s): ",
		(unsigned long long)f->iter, (unsigned long long)f->seed, f->mode);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

#define CHECK(f, cond, ...) do { if (!(cond)) die((f), __VA_ARGS__); } while (0)

/* ------------------------------------------------------------ utilities */

static uint64_t rnd(struct fz *f)
{
	uint64_t z = (f->rng += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint32_t below(struct fz *f, uint32_t n)
{
	return n ? (uint32_t)(rnd(f) % n) : 0;
}

static void gput(struct gbuf *g, const void *p, size_t n)
{
	if (g->n + n > g->cap) {
		size_t cap = g->cap ? g->cap : 4096;

		while (cap < g->n + n)
			cap *= 2;
		g->p = realloc(g->p, cap);
		if (!g->p) {
			fputs("mc_fuzz: out of memory\n", stderr);
			exit(2);
		}
		g->cap = cap;
	}
	if (n && p)
		memcpy(g->p + g->n, p, n);
	g->n += n;
}

static int gbuf_eq(const struct gbuf *a, const struct gbuf *b)
{
	return a->n == b->n && (a->n == 0 || !memcmp(a->p, b->p, a->n));
}

static void gputs(struct gbuf *g, const char *s)
{
	gput(g, s, strlen(s));
}

static void gput_u64(struct gbuf *g, uint64_t v)
{
	char t[24];

	snprintf(t, sizeof(t), "%llu", (unsigned long long)v);
	gputs(g, t);
}

static size_t put_hdr(uint8_t *h, uint16_t rid, uint16_t seq, uint16_t total)
{
	h[0] = (uint8_t)(rid >> 8);
	h[1] = (uint8_t)rid;
	h[2] = (uint8_t)(seq >> 8);
	h[3] = (uint8_t)seq;
	h[4] = (uint8_t)(total >> 8);
	h[5] = (uint8_t)total;
	h[6] = h[7] = 0;
	return 8;
}

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)(p[0] << 8 | p[1]);
}

/* ------------------------------------------------------------ the sink */

static void on_dgram(void *arg, uint32_t client, const uint8_t *dg, uint32_t len)
{
	struct fz *f = arg;
	uint8_t l[2] = {(uint8_t)(len >> 8), (uint8_t)len};

	CHECK(f, client < f->ncl, "datagram for unknown client %u", client);
	CHECK(f, len >= MCH_UDP_HDR && len <= MCH_UDP_MAX, "datagram of %u bytes", len);
	gput(&f->out[client], l, 2);
	gput(&f->out[client], dg, len);
}

static void on_done(void *arg, struct mch_batch *b)
{
	struct fz *f = arg;
	uint32_t i;

	CHECK(f, b->user < f->npool, "done for a batch never pushed");
	for (i = 0; i < f->ndone; i++)
		CHECK(f, f->done_order[i] != b->user, "batch %u done twice", b->user);
	CHECK(f, f->ndone == b->user, "batch %u done out of order", b->user);
	for (i = 0; i < b->nwaiters; i++)
		CHECK(f, b->w[i].state == MCH_WS_DONE, "batch done with a waiter not done");
	f->done_order[f->ndone++] = b->user;
}

static void reset_iteration(struct fz *f, uint32_t ncl)
{
	uint32_t i;

	f->ncl = ncl;
	for (i = 0; i < MAXC; i++)
		f->out[i].n = 0;
	f->npool = f->ndone = 0;
	f->vals.n = f->ans.n = f->exp.n = 0;
}

static struct mch_batch *next_batch(struct fz *f)
{
	struct mch_batch *b;

	CHECK(f, f->npool < NBATCH, "too many batches");
	b = f->pool[f->npool];
	b->user = f->npool++;
	return b;
}

/* ------------------------------------------------------------ parse mode */

static const char *const seed_text[] = {
	"get a\r\n", "get foo bar baz\r\n", "gets k1 k2 k1\r\n", "get  a  b \r\n",
	"set k 0 0 3\r\nabc\r\n", "add k 5 100 0\r\n\r\n", "replace k 1 -1 2 noreply\r\nhi\r\n",
	"append k 0 0 1\r\nx\r\n", "prepend k 0 0 4\r\n\r\n\r\n\r\n",
	"cas k 0 0 1 12345\r\nz\r\n", "delete k\r\n", "delete k 0 noreply\r\n", "incr n 1\r\n",
	"decr n 18446744073709551615\r\n", "touch k 10\r\n", "gat 0 a b\r\n", "gats -1 a\r\n",
	"version\r\n", "stats\r\n", "stats items\r\n", "stats reset\r\n", "flush_all\r\n",
	"flush_all 10 noreply\r\n", "verbosity 1\r\n", "quit\r\n", "mg foo v\r\n",
	"set k 0 0 1048577\r\n", "get \xc3\xa9t\xc3\xa9 \xff\r\n", "bogus\r\n", "\r\n",
	"set k 4294967295 2147483647 5\r\nEND\r\n\r\n", "get a\nget b\r\n",
};

static const char *const magic_tok[] = {
	" ", "  ", "\r\n", "\n", "\r", "noreply", "0", "-1", "4294967296",
	"18446744073709551616", "1048576", "1048577", "get ", "gets ", "set k 0 0 ", "\x80",
	"\x7f", "\xff", "VALUE ", "END\r\n", "99999999999999999999999",
};

static void add_seed(struct fz *f, const void *p, size_t n)
{
	if (f->nseeds == MAXSEED)
		return;
	f->seeds[f->nseeds].n = 0;
	gput(&f->seeds[f->nseeds], p, n);
	f->nseeds++;
}

static void load_corpus(struct fz *f, const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	char path[4096];
	uint8_t buf[MCH_DGRAM_MAX];

	if (!d) {
		fprintf(stderr, "mc_fuzz: cannot open corpus %s\n", dir);
		exit(2);
	}
	while ((e = readdir(d)) != NULL) {
		FILE *fp;
		size_t n;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		fp = fopen(path, "rb");
		if (!fp)
			continue;
		n = fread(buf, 1, sizeof(buf), fp);
		fclose(fp);
		add_seed(f, buf, n);
	}
	closedir(d);
}

/* One mutation of t (a payload, header excluded). */
static void mutate(struct fz *f, struct gbuf *t)
{
	uint32_t at = below(f, (uint32_t)t->n + 1u), k, n;
	const char *m;
	struct gbuf *o;

	switch (below(f, 8)) {
	case 0: /* bit flip */
		if (t->n)
			t->p[below(f, (uint32_t)t->n)] ^= (uint8_t)(1u << below(f, 8));
		break;
	case 1: /* random byte */
		if (t->n)
			t->p[below(f, (uint32_t)t->n)] = (uint8_t)rnd(f);
		break;
	case 2: /* insert a magic token */
	case 3:
		m = magic_tok[below(f, sizeof(magic_tok) / sizeof(magic_tok[0]))];
		n = (uint32_t)strlen(m);
		gput(t, m, n);
		memmove(t->p + at + n, t->p + at, t->n - n - at);
		memcpy(t->p + at, m, n);
		break;
	case 4: /* delete a range */
		n = below(f, (uint32_t)(t->n - (at < t->n ? at : t->n)) + 1u);
		memmove(t->p + at, t->p + at + n, t->n - at - n);
		t->n -= n;
		break;
	case 5: /* truncate */
		t->n = at < t->n ? at : t->n;
		break;
	case 6: /* splice another seed's tail */
		o = &f->seeds[below(f, f->nseeds)];
		k = below(f, (uint32_t)o->n + 1u);
		t->n = at < t->n ? at : t->n;
		f->tmp.n = 0;
		gput(&f->tmp, o->p + k, o->n - k);
		gput(t, f->tmp.p, f->tmp.n);
		break;
	default: /* a long key */
		n = 240u + below(f, 20);
		f->tmp.n = 0;
		for (k = 0; k < n; k++)
			gput(&f->tmp, "k", 1);
		gput(t, f->tmp.p, n);
		memmove(t->p + at + n, t->p + at, t->n - n - at);
		memcpy(t->p + at, f->tmp.p, n);
		break;
	}
}

static void check_accepted(struct fz *f, const struct mch_req *r)
{
	uint32_t i, len, b;

	CHECK(f, r->cmd > MCH_CMD_NONE && r->cmd < MCH_CMD__COUNT, "bad cmd %u", r->cmd);
	CHECK(f, r->shape <= MCH_SHAPE_STATS, "bad shape");
	CHECK(f, r->nkeys <= MCH_REQ_MAX_KEYS && r->ntok >= 1, "bad counts");
	for (i = 0; i < r->ntok; i++)
		CHECK(f, r->tok[i].len > 0 && r->tok[i].off >= MCH_UDP_HDR &&
			 (uint32_t)r->tok[i].off + r->tok[i].len <= r->len, "token out of bounds");
	for (i = 0; i < r->nkeys; i++) {
		const uint8_t *k = mch_req_key(r, i, &len);

		CHECK(f, len >= 1 && len <= MCH_KEY_MAX, "key length %u", len);
		for (b = 0; b < len; b++)
			CHECK(f, k[b] != ' ' && k[b] != 0 && k[b] != '\r' && k[b] != '\n',
			      "bad key byte");
	}
	if (r->cmd >= MCH_CMD_SET && r->cmd <= MCH_CMD_CAS) {
		CHECK(f, (uint32_t)r->data.off + r->data.len + 2u == r->len, "data not to the end");
		CHECK(f, r->dg[r->data.off + r->data.len] == '\r' &&
			 r->dg[r->data.off + r->data.len + 1u] == '\n', "data without CRLF");
		CHECK(f, r->data.len <= MCH_ITEM_MAX, "data over the item limit");
	}
}

static int same_slices(const struct mch_req *a, const struct mch_req *b)
{
	uint32_t i;

	if (a->ntok != b->ntok || a->nkeys != b->nkeys || a->key0 != b->key0)
		return 0;
	for (i = 0; i < a->ntok; i++)
		if (a->tok[i].len != b->tok[i].len ||
		    memcmp(a->dg + a->tok[i].off, b->dg + b->tok[i].off, a->tok[i].len))
			return 0;
	return a->data.len == b->data.len &&
	       !memcmp(a->dg + a->data.off, b->dg + b->data.off, a->data.len);
}

/* Encode r again (one-waiter batch or pass-through) and parse the result. */
static void check_roundtrip(struct fz *f, const struct mch_req *r)
{
	struct mch_batch *b = f->pool[0];
	struct mch_req r2;
	uint8_t *d2 = f->enc;
	size_t n;

	if (mch_req_is_get(r)) {
		mch_get_open(b, below(f, 300), below(f, 70000));
		CHECK(f, mch_get_add(b, r, 0, &f->ctr) == MCH_BADD_OK, "valid get refused");
		n = mch_get_encode(b, d2 + 8, MCH_GET_LINE_MAX, &f->ctr);
		CHECK(f, n > 0 && n <= MCH_GET_LINE_MAX, "get encode %zu", n);
	} else {
		n = mch_pass_encode(b, r, 0, d2 + 8, sizeof(f->enc) - 8, &f->ctr);
		CHECK(f, n > 0, "pass encode failed");
	}
	put_hdr(d2, r->rid, 0, 1);
	CHECK(f, mch_req_parse(&r2, d2, n + 8, &f->ctr) == MCH_REJ_OK, "encoded form rejected");
	CHECK(f, r2.cmd == r->cmd && r2.noreply == 0 && r2.rid == r->rid, "encoded form differs");
	CHECK(f, same_slices(r, &r2), "tokens/keys/data differ after encoding");
}

static void mode_parse(struct fz *f)
{
	struct gbuf *s = &f->seeds[below(f, f->nseeds)];
	struct gbuf t = {0, 0, 0};
	struct mch_req r;
	uint32_t i, nm = 1u + below(f, 4);
	size_t len;
	enum mch_rej rc;

	f->mode = "parse";
	gput(&t, s->p, s->n);
	for (i = 0; i < nm && below(f, 8); i++)
		mutate(f, &t);
	len = t.n < MCH_DGRAM_MAX - 8u ? t.n : MCH_DGRAM_MAX - 8u;
	put_hdr(f->dg, (uint16_t)rnd(f), 0, below(f, 16) ? 1 : (uint16_t)below(f, 3));
	if (!below(f, 16))
		f->dg[6] = (uint8_t)rnd(f);
	memcpy(f->dg + 8, t.p, len);
	len += 8;
	if (!below(f, 64))
		len = below(f, 9);
	free(t.p);
	rc = mch_req_parse(&r, f->dg, len, &f->ctr);
	CHECK(f, rc < MCH_REJ__COUNT, "reason %d out of range", rc);
	/* the relay check reads any datagram (under the sanitizers here) */
	CHECK(f, (unsigned)mch_req_relay_safe(f->dg, len) <= 1u, "relay check out of range");
	if (rc == MCH_REJ_OK) {
		check_accepted(f, &r);
		check_roundtrip(f, &r);
	}
}

/* ------------------------------------------------------------ the model */

static uint32_t value_size(struct fz *f)
{
	uint32_t k = below(f, 1000);

	if (k < 650)
		return below(f, 100);
	if (k < 850)
		return 100u + below(f, 3000);
	if (k < 980) /* around the 1392-byte datagram boundaries */
		return 1300u + below(f, 200) + (below(f, 2) ? 1392u : 0);
	if (k < 999)
		return 3000u + below(f, 20000);
	return 100000u + below(f, 50000);
}

static void make_model(struct fz *f)
{
	uint32_t i, j;

	f->nu = 4u + below(f, MAXU - 3u);
	for (i = 0; i < f->nu; i++) {
		struct item *it = &f->it[i];
		uint32_t len = below(f, 8) ? 1u + below(f, 20) : 1u + below(f, MCH_KEY_MAX);

		for (j = 0; j < len; j++) {
			uint8_t c = (uint8_t)(0x21u + below(f, 0x5e));

			if (!below(f, 16))
				c = (uint8_t)(0x80u + below(f, 0x80));
			it->key[j] = c;
		}
		/* make keys distinct: a unique last byte pair */
		if (len < 3)
			len = 3;
		it->key[len - 2] = (uint8_t)('A' + i / 26);
		it->key[len - 1] = (uint8_t)('a' + i % 26);
		it->klen = len;
		it->present = below(f, 10) < 7;
		it->flags = below(f, 2) ? 0 : (uint32_t)rnd(f);
		it->cas = below(f, 4) ? 1u + below(f, 1000000) : rnd(f);
		it->vlen = value_size(f);
		it->voff = f->vals.n;
		gput(&f->vals, NULL, it->vlen);
		for (j = 0; j < it->vlen; j += 8) {
			uint64_t r = rnd(f);

			memcpy(f->vals.p + it->voff + j, &r, it->vlen - j < 8 ? it->vlen - j : 8);
		}
		if (it->vlen >= 7 && below(f, 3) == 0)
			memcpy(f->vals.p + it->voff + below(f, it->vlen - 6), "\r\nEND\r\n", 7);
	}
}

static struct item *item_of(struct fz *f, const uint8_t *k, uint32_t len)
{
	uint32_t i;

	for (i = 0; i < f->nu; i++)
		if (f->it[i].klen == len && !memcmp(f->it[i].key, k, len))
			return &f->it[i];
	die(f, "answer for a key outside the model");
	return NULL;
}

/* "VALUE <key> <flags> <bytes>[ <cas>]\r\n<data>\r\n" */
static void put_value(struct fz *f, struct gbuf *g, const struct item *it, int cas)
{
	gputs(g, "VALUE ");
	gput(g, it->key, it->klen);
	gputs(g, " ");
	gput_u64(g, it->flags);
	gputs(g, " ");
	gput_u64(g, it->vlen);
	if (cas) {
		gputs(g, " ");
		gput_u64(g, it->cas);
	}
	gputs(g, "\r\n");
	gput(g, f->vals.p + it->voff, it->vlen);
	gputs(g, "\r\n");
}

/* What memcached answers on TCP to a coalesced command. */
static void put_answer(struct fz *f, const struct mch_batch *b)
{
	uint32_t p, len;

	for (p = 0; p < b->npos; p++) {
		const uint8_t *k = mch_batch_key(b, p, &len);
		const struct item *it = item_of(f, k, len);

		if (it->present)
			put_value(f, &f->ans, it, b->cmd == MCH_CMD_GETS);
	}
	gputs(&f->ans, "END\r\n");
}

/* Expected datagrams of one message, in the capture format. */
static void expect_message(struct gbuf *exp, uint16_t rid, const uint8_t *m, size_t n)
{
	uint32_t total = (uint32_t)((n + MCH_UDP_DATA - 1u) / MCH_UDP_DATA), seq;
	uint8_t h[10];

	for (seq = 0; seq < total; seq++) {
		size_t k = n - (size_t)seq * MCH_UDP_DATA;

		if (k > MCH_UDP_DATA)
			k = MCH_UDP_DATA;
		h[0] = (uint8_t)((k + 8u) >> 8);
		h[1] = (uint8_t)(k + 8u);
		put_hdr(h + 2, rid, (uint16_t)seq, (uint16_t)total);
		gput(exp, h, 10);
		gput(exp, m + (size_t)seq * MCH_UDP_DATA, k);
	}
}

/* memcached 1.6's own UDP reply to one client: a message per hit key. */
static void expect_reply(struct fz *f, const struct creq *c)
{
	struct gbuf m = {0, 0, 0};
	uint32_t i;
	int end_sent = 0;

	f->exp.n = 0;
	for (i = 0; i < c->nk; i++) {
		const struct item *it = &f->it[c->keys[i]];

		if (!it->present)
			continue;
		m.n = 0;
		put_value(f, &m, it, c->gets);
		if (i + 1u == c->nk) {
			gputs(&m, "END\r\n");
			end_sent = 1;
		}
		expect_message(&f->exp, c->rid, m.p, m.n);
	}
	if (!end_sent)
		expect_message(&f->exp, c->rid, (const uint8_t *)"END\r\n", 5);
	free(m.p);
}

/* ------------------------------------------------------ roundtrip mode */

static size_t make_get_dgram(struct fz *f, struct creq *c)
{
	struct gbuf t = {0, 0, 0};
	uint32_t i, sp;
	size_t n;

	gputs(&t, c->gets ? "gets" : "get");
	for (i = 0; i < c->nk; i++) {
		for (sp = 1u + (below(f, 8) ? 0 : below(f, 3)); sp; sp--)
			gputs(&t, " ");
		gput(&t, f->it[c->keys[i]].key, f->it[c->keys[i]].klen);
	}
	if (!below(f, 8))
		gputs(&t, "  ");
	gputs(&t, "\r\n");
	put_hdr(f->dg, c->rid, 0, 1);
	memcpy(f->dg + 8, t.p, t.n);
	n = t.n + 8;
	free(t.p);
	return n;
}

static void random_clients(struct fz *f, uint32_t ncl)
{
	uint32_t i, k;

	for (i = 0; i < ncl; i++) {
		struct creq *c = &f->cr[i];

		c->rid = (uint16_t)rnd(f);
		c->gets = below(f, 4) == 0;
		c->nk = below(f, 6) ? 1u + below(f, 6) : 1u + below(f, MAXK);
		if (below(f, 3) == 0)
			c->nk = 1;
		for (k = 0; k < c->nk; k++)
			c->keys[k] = below(f, f->nu);
	}
}

/* Command line of a pushed batch: parses back to its positions, in bounds. */
static void check_command(struct fz *f, const struct mch_batch *b, size_t n,
			  uint32_t max_keys, uint32_t max_line)
{
	struct mch_req r;
	uint32_t i, l1, l2;

	CHECK(f, n <= MCH_GET_LINE_MAX, "command line %zu bytes", n);
	if (b->nwaiters > 1)
		CHECK(f, b->npos <= max_keys && n <= (max_line < 7 ? 7 : max_line),
		      "batch over its limits (%u keys, %zu bytes)", b->npos, n);
	memmove(f->enc + 8, f->enc, n);
	put_hdr(f->enc, 1, 0, 1);
	CHECK(f, mch_req_parse(&r, f->enc, n + 8, &f->ctr) == MCH_REJ_OK, "command rejected");
	CHECK(f, r.nkeys == b->npos && r.cmd == b->cmd, "command keys differ");
	for (i = 0; i < r.nkeys; i++) {
		const uint8_t *k1 = mch_req_key(&r, i, &l1), *k2 = mch_batch_key(b, i, &l2);

		CHECK(f, l1 == l2 && !memcmp(k1, k2, l1), "command key %u differs", i);
	}
}

static void close_batch(struct fz *f, struct mch_batch *b, uint32_t mk, uint32_t ml)
{
	size_t n = mch_get_encode(b, f->enc, sizeof(f->enc), &f->ctr);

	CHECK(f, n > 0, "encode of a non-empty batch failed");
	check_command(f, b, n, mk, ml);
	put_answer(f, b);
	CHECK(f, mch_split_push(&f->sp, b) == 0, "push refused");
}

/* Parse every client's datagram and coalesce them into batches. */
static void coalesce(struct fz *f)
{
	uint32_t mk = 1u + below(f, 64), ml = 16u + below(f, 4000), i;
	struct mch_batch *b = next_batch(f);
	struct mch_req r;

	if (below(f, 4) == 0) {
		mk = MCH_BATCH_MAX_KEYS;
		ml = MCH_GET_LINE_MAX;
	}
	mch_get_open(b, mk, ml);
	for (i = 0; i < f->ncl; i++) {
		size_t n = make_get_dgram(f, &f->cr[i]);
		int rc;

		CHECK(f, mch_req_parse(&r, f->dg, n, &f->ctr) == MCH_REJ_OK, "valid get rejected");
		rc = mch_get_add(b, &r, i, &f->ctr);
		if (rc == MCH_BADD_FULL) {
			close_batch(f, b, mk, ml);
			b = next_batch(f);
			mch_get_open(b, mk, ml);
			rc = mch_get_add(b, &r, i, &f->ctr);
		}
		CHECK(f, rc == MCH_BADD_OK, "add to an empty batch refused (%d)", rc);
	}
	close_batch(f, b, mk, ml);
}

/* Feed f->ans in random chunks; returns the splitter's error. */
static int feed_answer(struct fz *f)
{
	size_t off = 0, n = f->ans.n, maxc;
	uint32_t how = below(f, 4);
	int err = MCH_ERR_NONE;

	maxc = how == 0 ? n : how == 1 && n < 6000 ? 1 : 1u + below(f, 3000);
	while (off < n && err == MCH_ERR_NONE) {
		size_t k = how >= 2 ? 1u + below(f, (uint32_t)maxc) : maxc;

		if (k > n - off)
			k = n - off;
		err = mch_split_feed(&f->sp, f->ans.p + off, k);
		off += k;
	}
	return err;
}

static void mode_roundtrip(struct fz *f)
{
	uint32_t i;
	int err;

	f->mode = "roundtrip";
	reset_iteration(f, 1u + (below(f, 4) ? below(f, 12) : below(f, 60)));
	make_model(f);
	random_clients(f, f->ncl);
	coalesce(f);
	err = feed_answer(f);
	CHECK(f, err == MCH_ERR_NONE, "valid answer refused: %s", mch_err_name(err));
	CHECK(f, mch_split_pending(&f->sp) == 0 && f->ndone == f->npool, "batches not done");
	for (i = 0; i < f->ncl; i++) {
		expect_reply(f, &f->cr[i]);
		CHECK(f, gbuf_eq(&f->out[i], &f->exp),
		      "client %u: reply differs from memcached's (%zu vs %zu bytes)", i,
		      f->out[i].n, f->exp.n);
	}
}

/* ------------------------------------------------------- garbage mode */

static void mutate_answer(struct fz *f)
{
	static const char *const junk[] = {
		"SERVER_ERROR out of memory\r\n", "CLIENT_ERROR bad\r\n", "ERROR\r\n", "END\r\n",
		"VALUE zz 0 5\r\n", "VALUE a 0 99999999\r\n", "\r\n", "\n", "STORED\r\n", "VALUE ",
	};
	struct gbuf *a = &f->ans;
	uint32_t at = below(f, (uint32_t)a->n + 1u), n;
	const char *j;

	switch (below(f, 5)) {
	case 0:
		if (a->n)
			a->p[below(f, (uint32_t)a->n)] ^= (uint8_t)(1u << below(f, 8));
		break;
	case 1: /* a length digit lies */
		if (a->n)
			a->p[below(f, (uint32_t)a->n)] = (uint8_t)('0' + below(f, 10));
		break;
	case 2:
		j = junk[below(f, sizeof(junk) / sizeof(junk[0]))];
		n = (uint32_t)strlen(j);
		gput(a, j, n);
		memmove(a->p + at + n, a->p + at, a->n - n - at);
		memcpy(a->p + at, j, n);
		break;
	case 3:
		n = below(f, (uint32_t)(a->n - (at < a->n ? at : a->n)) + 1u);
		memmove(a->p + at, a->p + at + n, a->n - at - n);
		a->n -= n;
		break;
	default:
		a->n = at < a->n ? at : a->n;
		break;
	}
}

/* Does a complete message end a reply?  Dies if it is not well formed. */
static int message_ends_reply(struct fz *f, uint32_t c, const uint8_t *m, size_t n)
{
	const uint8_t *nl, *t;
	unsigned long long nbytes;
	size_t line;
	int i;

	if (n == 5 && !memcmp(m, "END\r\n", 5))
		return 1;
	CHECK(f, n > 6 && !memcmp(m, "VALUE ", 6), "client %u: message is not VALUE/END", c);
	nl = memchr(m, '\n', n);
	CHECK(f, nl != NULL, "client %u: VALUE line without LF", c);
	line = (size_t)(nl - m) + 1u;
	for (t = m, i = 0; i < 3; i++) { /* the <bytes> token is the 4th */
		t = memchr(t, ' ', line - (size_t)(t - m));
		CHECK(f, t != NULL, "client %u: VALUE line tokens", c);
		t++;
	}
	nbytes = strtoull((const char *)t, NULL, 10);
	if (n == line + nbytes + 2u)
		return 0;
	CHECK(f, n == line + nbytes + 7u && !memcmp(m + n - 5, "END\r\n", 5),
	      "client %u: message of %zu bytes for a %llu-byte value", c, n, nbytes);
	return 1;
}

/*
 * A client's datagrams: coherent headers, messages numbered 0..total-1 with
 * only the last datagram short, well-formed messages, nothing after the END.
 * The last message may be incomplete (dropped on abort).
 */
static void check_client_stream(struct fz *f, uint32_t c, uint16_t rid)
{
	const struct gbuf *o = &f->out[c];
	size_t off = 0;
	uint32_t seq = 0, total = 0;
	int ended = 0;

	f->tmp.n = 0;
	while (off < o->n) {
		uint32_t len = rd16(o->p + off);
		const uint8_t *d = o->p + off + 2;

		CHECK(f, !ended, "client %u: datagram after its END", c);
		CHECK(f, rd16(d) == rid && rd16(d + 6) == 0, "client %u: header", c);
		if (seq == 0)
			total = rd16(d + 4);
		CHECK(f, rd16(d + 4) == total && total >= 1, "client %u: total changed", c);
		CHECK(f, rd16(d + 2) == seq, "client %u: seq %u not %u", c, rd16(d + 2), seq);
		gput(&f->tmp, d + 8, len - 8u);
		seq++;
		if (seq < total) {
			CHECK(f, len == MCH_UDP_MAX, "client %u: short datagram inside a message", c);
		} else {
			ended = message_ends_reply(f, c, f->tmp.p, f->tmp.n);
			seq = 0;
			f->tmp.n = 0;
		}
		off += 2u + len;
	}
}

static void mode_garbage(struct fz *f)
{
	uint32_t i, nm = 1u + below(f, 3);
	int err;

	f->mode = "garbage";
	reset_iteration(f, 1u + below(f, 12));
	make_model(f);
	random_clients(f, f->ncl);
	coalesce(f);
	if (below(f, 8) == 0) { /* an answer of pure noise */
		f->ans.n = 0;
		for (i = below(f, 200); i; i--) {
			uint8_t c = (uint8_t)rnd(f);

			gput(&f->ans, &c, 1);
		}
	}
	for (i = 0; i < nm; i++)
		mutate_answer(f);
	err = feed_answer(f);
	CHECK(f, err < MCH_ERR__COUNT, "error code out of range");
	if (err != MCH_ERR_NONE || mch_split_pending(&f->sp) > 0)
		mch_split_abort(&f->sp);
	CHECK(f, mch_split_pending(&f->sp) == 0 && f->ndone == f->npool, "batches not done");
	CHECK(f, mch_split_feed(&f->sp, (const uint8_t *)"", 0) == MCH_ERR_NONE,
	      "splitter not clean after abort");
	for (i = 0; i < f->ncl; i++)
		check_client_stream(f, i, f->cr[i].rid);
}

/* --------------------------------------------------------- pass mode */

struct pass_case {
	const char *req;    /* request payload */
	const char *answer; /* memcached's answer */
	int silent;
};

static const struct pass_case pass_cases[] = {
	{"set k 0 0 3\r\nabc\r\n", "STORED\r\n", 0},
	{"set k 0 0 3 noreply\r\nabc\r\n", "STORED\r\n", 1},
	{"add k 0 0 0\r\n\r\n", "NOT_STORED\r\n", 0},
	{"cas k 0 0 1 7\r\nx\r\n", "EXISTS\r\n", 0},
	{"append k 0 0 1\r\nx\r\n", "SERVER_ERROR out of memory storing object\r\n", 0},
	{"delete k\r\n", "DELETED\r\n", 0},
	{"delete k noreply\r\n", "NOT_FOUND\r\n", 1},
	{"incr n 5\r\n", "18446744073709551615\r\n", 0},
	{"decr n 5\r\n", "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n", 0},
	{"touch k 1\r\n", "TOUCHED\r\n", 0},
	{"version\r\n", "VERSION 1.6.18\r\n", 0},
	{"flush_all\r\n", "OK\r\n", 0},
	{"verbosity 1 noreply\r\n", "OK\r\n", 1},
	{"stats reset\r\n", "RESET\r\n", 0},
	{"gat 0 k\r\n", "VALUE k 0 2\r\nhi\r\nEND\r\n", 0},
	{"gats 0 k j\r\n", "VALUE j 1 1 99\r\nx\r\nEND\r\n", 0},
	{"gat 0 k\r\n", "CLIENT_ERROR bad command line format\r\n", 0},
	{"stats\r\n", NULL, 0}, /* STAT lines generated */
};

static void stats_answer(struct fz *f, struct gbuf *g)
{
	uint32_t i, n = below(f, 8) ? below(f, 100) : 1400u + below(f, 600);

	for (i = 0; i < n; i++) {
		gputs(g, "STAT counter_");
		gput_u64(g, i);
		gputs(g, " ");
		gput_u64(g, rnd(f));
		gputs(g, "\r\n");
	}
	gputs(g, "END\r\n");
}

static void mode_pass(struct fz *f)
{
	uint32_t ncl = 1u + below(f, 24), i;
	struct gbuf want[MAXC];
	int too_big = 0, err;

	f->mode = "pass";
	reset_iteration(f, ncl);
	memset(want, 0, sizeof(want));
	for (i = 0; i < ncl && !too_big; i++) {
		const struct pass_case *pc = &pass_cases[below(f, sizeof(pass_cases) / sizeof(pass_cases[0]))];
		struct mch_batch *b = next_batch(f);
		struct mch_req r;
		size_t n = strlen(pc->req), a0 = f->ans.n;

		put_hdr(f->dg, (uint16_t)i, 0, 1);
		memcpy(f->dg + 8, pc->req, n);
		CHECK(f, mch_req_parse(&r, f->dg, n + 8, &f->ctr) == MCH_REJ_OK, "pass case rejected");
		CHECK(f, mch_pass_encode(b, &r, i, f->enc, sizeof(f->enc), &f->ctr) > 0, "encode");
		CHECK(f, mch_split_push(&f->sp, b) == 0, "push");
		if (pc->answer)
			gputs(&f->ans, pc->answer);
		else
			stats_answer(f, &f->ans);
		too_big = f->ans.n - a0 > MCH_PASS_REPLY_MAX;
		if (!pc->silent)
			expect_message(&want[i], (uint16_t)i, f->ans.p + a0, f->ans.n - a0);
	}
	f->ncl = i;
	err = feed_answer(f);
	CHECK(f, err == (too_big ? MCH_ERR_REPLY_TOO_BIG : MCH_ERR_NONE), "pass answer: %s",
	      mch_err_name(err));
	if (err)
		mch_split_abort(&f->sp);
	CHECK(f, mch_split_pending(&f->sp) == 0 && f->ndone == f->npool, "batches not done");
	for (i = 0; i < f->ncl; i++) {
		if (too_big && i + 1u == f->ncl)
			CHECK(f, f->out[i].n == 0, "oversized answer partly sent");
		else
			CHECK(f, gbuf_eq(&f->out[i], &want[i]),
			      "pass client %u: reply differs", i);
		free(want[i].p);
	}
}

/* ------------------------------------------------------------ main */

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void setup(struct fz *f)
{
	struct mch_sink sink = {on_dgram, on_done, f};
	uint32_t i;

	for (i = 0; i < sizeof(seed_text) / sizeof(seed_text[0]); i++)
		add_seed(f, seed_text[i], strlen(seed_text[i]));
	for (i = 0; i < NBATCH; i++) {
		f->pool[i] = malloc(sizeof(struct mch_batch));
		if (!f->pool[i])
			exit(2);
	}
	mch_split_init(&f->sp, &sink, &f->ctr);
}

static void teardown(struct fz *f)
{
	uint32_t i;

	for (i = 0; i < NBATCH; i++)
		free(f->pool[i]);
	for (i = 0; i < MAXC; i++)
		free(f->out[i].p);
	for (i = 0; i < f->nseeds; i++)
		free(f->seeds[i].p);
	free(f->vals.p);
	free(f->ans.p);
	free(f->tmp.p);
	free(f->exp.p);
	free(f);
}

int main(int argc, char **argv)
{
	struct fz *f = calloc(1, sizeof(*f));
	unsigned long long n = 200000, seed = 1;
	double limit = 0, t0 = now();
	const char *corpus = NULL, *only = NULL;
	int i;

	if (!f)
		return 2;
	for (i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "-n"))
			n = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "-s"))
			seed = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "-t"))
			limit = strtod(argv[i + 1], NULL);
		else if (!strcmp(argv[i], "-c"))
			corpus = argv[i + 1];
		else if (!strcmp(argv[i], "-m"))
			only = argv[i + 1];
	}
	f->seed = seed;
	f->rng = seed * 0x2545f4914f6cdd1dull + 1u;
	setup(f);
	if (corpus)
		load_corpus(f, corpus);
	for (f->iter = 0; f->iter < n; f->iter++) {
		uint32_t m = below(f, 100);

		if (only) /* one mode only: parse, roundtrip, garbage or pass */
			m = !strcmp(only, "parse") ? 0 : !strcmp(only, "roundtrip") ? 60
			  : !strcmp(only, "garbage") ? 85 : 95;
		if (m < 60)
			mode_parse(f);
		else if (m < 85)
			mode_roundtrip(f);
		else if (m < 95)
			mode_garbage(f);
		else
			mode_pass(f);
		if (limit > 0 && (f->iter & 255u) == 0 && now() - t0 > limit) {
			f->iter++;
			break;
		}
	}
	printf("iterations %llu seconds %.1f seed %llu rx %llu rejects %llu values %llu "
	       "datagrams %llu aborted_waiters %llu\n",
	       (unsigned long long)f->iter, now() - t0, seed, (unsigned long long)f->ctr.rx,
	       (unsigned long long)(f->ctr.rx - f->ctr.rx_get - f->ctr.rx_gets - f->ctr.rx_pass),
	       (unsigned long long)f->ctr.s_values, (unsigned long long)f->ctr.tx_dgrams,
	       (unsigned long long)(f->ctr.w_abort_miss + f->ctr.w_abort_drop));
	teardown(f);
	return 0;
}
