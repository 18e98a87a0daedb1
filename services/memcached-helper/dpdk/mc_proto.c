/*
 * mc_proto.c - the one C file of the helper that knows memcached's syntax.
 *
 * Sections: lexical helpers; the request parser (UDP frame header, command
 * line, per-command argument checks, storage data framing); the encoders
 * (coalesced multi-get, canonical pass-through command); the response
 * splitter (a streaming state machine over the TCP answer that writes each
 * waiter's UDP reply); names.  The API, the datagram layout and the error
 * policy are described in mc_proto.h; the key bookkeeping is mc_batch.c.
 *
 * Strictness.  A request is forwarded onto a connection shared by many
 * clients only when memcached is bound to read it exactly as we did:
 * CRLF-terminated line, known command, exact argument count, decimal numbers
 * in range, key <= 250 bytes without NUL/CR/LF, and for storage commands
 * a data block of exactly <bytes> bytes followed by CRLF and nothing after.
 * (memcached's UDP parser state is shared by all clients of a worker: one
 * short "set" would swallow other clients' requests.)  Forwarded commands are
 * re-written canonically (single spaces, "noreply" removed, so each command
 * gets exactly one answer and answers never go out of step).  Several
 * commands in one datagram are rejected (MCH_REJ_MULTI_CMD): no common UDP
 * client sends them, and each would need its own answer under one request id.
 * Bare-LF lines, which memcached tolerates, are rejected too.
 *
 * The file is longer than our usual ~500 lines because the rule "one file
 * knows memcached" wins over "split past 500"; everything syntax-free lives in
 * mc_batch.c.
 */
#include "mc_proto.h"

#include <string.h>

enum { ST_LINE = 0, ST_DATA = 1 };

static const uint8_t END_CRLF[5] = {'E', 'N', 'D', '\r', '\n'};

/* ------------------------------------------------------------------ lexical */

static int bytes_eq(const uint8_t *p, uint32_t n, const char *lit)
{
	size_t m = strlen(lit);

	return n == m && memcmp(p, lit, m) == 0;
}

static int has_prefix(const uint8_t *p, uint32_t n, const char *lit)
{
	size_t m = strlen(lit);

	return n >= m && memcmp(p, lit, m) == 0;
}

static int all_digits(const uint8_t *p, uint32_t n)
{
	uint32_t i;

	if (n == 0)
		return 0;
	for (i = 0; i < n; i++)
		if (p[i] < '0' || p[i] > '9')
			return 0;
	return 1;
}

/* Decimal digits only, value <= max. */
static int parse_uint(const uint8_t *p, uint32_t n, uint64_t max, uint64_t *out)
{
	uint64_t v = 0;
	uint32_t i;

	if (!all_digits(p, n) || n > 20)
		return 0;
	for (i = 0; i < n; i++) {
		uint64_t d = (uint64_t)(p[i] - '0');

		if (v > (max - d) / 10u)
			return 0;
		v = v * 10u + d;
	}
	*out = v;
	return 1;
}

/* Optional '-', then digits: a value that fits int32 (exptime, delay). */
static int parse_i32(const uint8_t *p, uint32_t n)
{
	uint64_t v;

	if (n > 0 && p[0] == '-')
		return parse_uint(p + 1, n - 1u, 2147483648u, &v);
	return parse_uint(p, n, 2147483647u, &v);
}

/*
 * A byte memcached's tokenizer keeps inside a token: it splits on spaces only
 * and a NUL ends its line.  CR and LF are refused too (line ends).  Other
 * control bytes are fine: memaslap puts eight 0x10 bytes in front of every
 * key, and memcached stores and returns them as sent.
 */
static int is_key_byte(uint8_t c)
{
	return c != ' ' && c != '\0' && c != '\r' && c != '\n';
}

static int printable(const uint8_t *p, uint32_t n)
{
	uint32_t i;

	for (i = 0; i < n; i++)
		if (p[i] < 0x20 || p[i] > 0x7e)
			return 0;
	return 1;
}

static void udp_hdr_put(uint8_t *h, uint16_t rid, uint16_t seq, uint16_t total)
{
	h[0] = (uint8_t)(rid >> 8);
	h[1] = (uint8_t)rid;
	h[2] = (uint8_t)(seq >> 8);
	h[3] = (uint8_t)seq;
	h[4] = (uint8_t)(total >> 8);
	h[5] = (uint8_t)total;
	h[6] = 0;
	h[7] = 0;
}

static uint16_t be16(const uint8_t *p)
{
	return (uint16_t)((p[0] << 8) | p[1]);
}

static int is_storage(uint8_t cmd)
{
	return cmd >= MCH_CMD_SET && cmd <= MCH_CMD_CAS;
}

/* ----------------------------------------------------------- request parser */

static const uint8_t *tok_ptr(const struct mch_req *r, uint32_t t)
{
	return r->dg + r->tok[t].off;
}

static int tok_is(const struct mch_req *r, uint32_t t, const char *lit)
{
	return bytes_eq(tok_ptr(r, t), r->tok[t].len, lit);
}

static int tok_u64(const struct mch_req *r, uint32_t t, uint64_t max)
{
	uint64_t v;

	return parse_uint(tok_ptr(r, t), r->tok[t].len, max, &v);
}

static int tok_i32(const struct mch_req *r, uint32_t t)
{
	return parse_i32(tok_ptr(r, t), r->tok[t].len);
}

/* Keys t0..t0+n-1 (tokens never hold spaces, NUL, CR or LF). */
static enum mch_rej set_keys(struct mch_req *r, uint32_t t0, uint32_t n)
{
	uint32_t i;

	if (n > MCH_REQ_MAX_KEYS)
		return MCH_REJ_TOO_MANY_KEYS;
	for (i = 0; i < n; i++)
		if (r->tok[t0 + i].len > MCH_KEY_MAX)
			return MCH_REJ_BAD_KEY;
	r->key0 = (uint16_t)t0;
	r->nkeys = (uint16_t)n;
	return MCH_REJ_OK;
}

/* Non-storage commands: nothing may follow the line. */
static enum mch_rej no_rest(const struct mch_req *r, uint32_t rest)
{
	return rest == r->len ? MCH_REJ_OK : MCH_REJ_MULTI_CMD;
}

static enum mch_rej check_get(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_VALUES;
	if (r->ntok < 2)
		return MCH_REJ_BAD_FORMAT;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	return set_keys(r, 1, r->ntok - 1u);
}

static enum mch_rej check_gat(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_VALUES;
	if (r->ntok < 3 || !tok_i32(r, 1))
		return MCH_REJ_BAD_FORMAT;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	return set_keys(r, 2, r->ntok - 2u);
}

/* "<cmd> <key> <flags> <exptime> <bytes> [<cas>]" then <bytes> + CRLF, exactly. */
static enum mch_rej check_store(struct mch_req *r, uint32_t rest)
{
	uint32_t want = r->cmd == MCH_CMD_CAS ? 6u : 5u;
	uint64_t nbytes;
	const uint8_t *d;

	r->shape = MCH_SHAPE_LINE;
	if (r->ntok != want || !tok_u64(r, 2, UINT32_MAX) || !tok_i32(r, 3) ||
	    !all_digits(tok_ptr(r, 4), r->tok[4].len))
		return MCH_REJ_BAD_FORMAT;
	if (want == 6u && !tok_u64(r, 5, UINT64_MAX))
		return MCH_REJ_BAD_FORMAT;
	if (!parse_uint(tok_ptr(r, 4), r->tok[4].len, UINT64_MAX, &nbytes) ||
	    nbytes > MCH_ITEM_MAX)
		return MCH_REJ_TOO_LARGE;
	if (set_keys(r, 1, 1))
		return MCH_REJ_BAD_KEY;
	if ((uint64_t)(r->len - rest) < nbytes + 2u)
		return MCH_REJ_BAD_DATA;
	d = r->dg + rest + nbytes;
	if (d[0] != '\r' || d[1] != '\n')
		return MCH_REJ_BAD_DATA;
	if ((uint64_t)(r->len - rest) > nbytes + 2u)
		return MCH_REJ_MULTI_CMD;
	r->data.off = (uint16_t)rest;
	r->data.len = (uint16_t)nbytes;
	return MCH_REJ_OK;
}

static enum mch_rej check_delete(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok == 3 && tok_is(r, 2, "0"))
		r->ntok = 2; /* legacy "delete <key> 0" means "delete <key>" */
	if (r->ntok != 2)
		return MCH_REJ_BAD_FORMAT;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	return set_keys(r, 1, 1);
}

static enum mch_rej check_arith(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok != 3 || !tok_u64(r, 2, UINT64_MAX))
		return MCH_REJ_BAD_FORMAT;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	return set_keys(r, 1, 1);
}

static enum mch_rej check_touch(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok != 3 || !tok_i32(r, 2))
		return MCH_REJ_BAD_FORMAT;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	return set_keys(r, 1, 1);
}

static enum mch_rej check_version(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok != 1)
		return MCH_REJ_BAD_FORMAT;
	return no_rest(r, rest);
}

/* "stats" and the END-terminated groups; "stats reset" answers one line. */
static enum mch_rej check_stats(struct mch_req *r, uint32_t rest)
{
	static const char *const groups[] = {"settings", "items", "slabs", "sizes", "conns"};
	uint32_t i;

	r->shape = MCH_SHAPE_STATS;
	if (no_rest(r, rest))
		return MCH_REJ_MULTI_CMD;
	if (r->ntok == 1)
		return MCH_REJ_OK;
	if (r->ntok == 2 && tok_is(r, 1, "reset")) {
		r->shape = MCH_SHAPE_LINE;
		return MCH_REJ_OK;
	}
	for (i = 0; r->ntok == 2 && i < sizeof(groups) / sizeof(groups[0]); i++)
		if (tok_is(r, 1, groups[i]))
			return MCH_REJ_OK;
	return MCH_REJ_UNSUPPORTED;
}

static enum mch_rej check_flush(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok > 2 || (r->ntok == 2 && !tok_u64(r, 1, 2147483647u)))
		return MCH_REJ_BAD_FORMAT;
	return no_rest(r, rest);
}

static enum mch_rej check_verbosity(struct mch_req *r, uint32_t rest)
{
	r->shape = MCH_SHAPE_LINE;
	if (r->ntok != 2 || !tok_u64(r, 1, UINT32_MAX))
		return MCH_REJ_BAD_FORMAT;
	return no_rest(r, rest);
}

typedef enum mch_rej (*mch_check_fn)(struct mch_req *r, uint32_t rest);

struct mch_cmd_def {
	const char *name;
	uint8_t cmd;
	uint8_t noreply_ok;
	uint8_t retrieval; /* line limited by key count, not MCH_CMD_LINE_MAX */
	mch_check_fn check;
};

static const struct mch_cmd_def mch_cmds[] = {
	{"get", MCH_CMD_GET, 0, 1, check_get},
	{"gets", MCH_CMD_GETS, 0, 1, check_get},
	{"set", MCH_CMD_SET, 1, 0, check_store},
	{"add", MCH_CMD_ADD, 1, 0, check_store},
	{"replace", MCH_CMD_REPLACE, 1, 0, check_store},
	{"append", MCH_CMD_APPEND, 1, 0, check_store},
	{"prepend", MCH_CMD_PREPEND, 1, 0, check_store},
	{"cas", MCH_CMD_CAS, 1, 0, check_store},
	{"delete", MCH_CMD_DELETE, 1, 0, check_delete},
	{"incr", MCH_CMD_INCR, 1, 0, check_arith},
	{"decr", MCH_CMD_DECR, 1, 0, check_arith},
	{"touch", MCH_CMD_TOUCH, 1, 0, check_touch},
	{"gat", MCH_CMD_GAT, 0, 1, check_gat},
	{"gats", MCH_CMD_GATS, 0, 1, check_gat},
	{"version", MCH_CMD_VERSION, 0, 0, check_version},
	{"stats", MCH_CMD_STATS, 0, 0, check_stats},
	{"flush_all", MCH_CMD_FLUSH_ALL, 1, 0, check_flush},
	{"verbosity", MCH_CMD_VERBOSITY, 1, 0, check_verbosity},
};

/* memcached commands that helpers deliberately do not forward */
static const char *const mch_unsupported[] = {
	"quit", "shutdown", "watch", "mg", "ms", "md", "ma", "mn", "me",
	"lru_crawler", "lru", "slabs", "cache_memlimit", "extstore", "misbehave",
	"debugtime",
};

static const struct mch_cmd_def *cmd_lookup(const uint8_t *p, uint32_t n)
{
	uint32_t i;

	for (i = 0; i < sizeof(mch_cmds) / sizeof(mch_cmds[0]); i++)
		if (bytes_eq(p, n, mch_cmds[i].name))
			return &mch_cmds[i];
	return NULL;
}

static int cmd_unsupported(const uint8_t *p, uint32_t n)
{
	uint32_t i;

	for (i = 0; i < sizeof(mch_unsupported) / sizeof(mch_unsupported[0]); i++)
		if (bytes_eq(p, n, mch_unsupported[i]))
			return 1;
	return 0;
}

/* First word of the payload, leading spaces skipped (for the line limit). */
static const struct mch_cmd_def *first_word_cmd(const uint8_t *p, uint32_t n)
{
	uint32_t i = 0, j;

	while (i < n && p[i] == ' ')
		i++;
	for (j = i; j < n && j - i < 16u && p[j] != ' ' && p[j] != '\r' && p[j] != '\n'; j++)
		;
	return cmd_lookup(p + i, j - i);
}

/*
 * Split dg[off, off+n) into space-separated tokens (runs of spaces count as
 * one, as memcached's tokenizer does).  Returns MCH_REJ_BAD_CHAR for NUL/CR/LF
 * bytes, MCH_REJ_TOO_MANY_KEYS when tokens overflow.
 */
static enum mch_rej tokenize(struct mch_req *r, uint32_t off, uint32_t n)
{
	uint32_t i = off, end = off + n, start;

	r->ntok = 0;
	while (i < end) {
		if (r->dg[i] == ' ') {
			i++;
			continue;
		}
		start = i;
		while (i < end && r->dg[i] != ' ') {
			if (!is_key_byte(r->dg[i]))
				return MCH_REJ_BAD_CHAR;
			i++;
		}
		if (r->ntok == MCH_REQ_MAX_TOKENS)
			return MCH_REJ_TOO_MANY_KEYS;
		r->tok[r->ntok].off = (uint16_t)start;
		r->tok[r->ntok].len = (uint16_t)(i - start);
		r->ntok++;
	}
	return MCH_REJ_OK;
}

/* Frame header and first-byte checks. */
static enum mch_rej parse_frame(struct mch_req *r, const uint8_t *dg, size_t len)
{
	if (len < MCH_UDP_HDR)
		return MCH_REJ_SHORT;
	if (len > MCH_DGRAM_MAX)
		return MCH_REJ_OVERSIZE;
	if (be16(dg + 4) != 1)
		return MCH_REJ_MULTI_DGRAM;
	if (len == MCH_UDP_HDR)
		return MCH_REJ_EMPTY;
	if (dg[MCH_UDP_HDR] == 0x80)
		return MCH_REJ_BINARY;
	memset(r, 0, offsetof(struct mch_req, tok));
	r->dg = dg;
	r->len = (uint32_t)len;
	r->rid = be16(dg);
	return MCH_REJ_OK;
}

/* Find the command line; *line_len excludes the CRLF. */
static enum mch_rej find_line(const struct mch_req *r, uint32_t *line_len)
{
	const uint8_t *pl = r->dg + MCH_UDP_HDR;
	uint32_t plen = r->len - MCH_UDP_HDR;
	const struct mch_cmd_def *def = first_word_cmd(pl, plen);
	uint32_t limit = def && def->retrieval ? MCH_DGRAM_MAX : MCH_CMD_LINE_MAX;
	const uint8_t *nl = memchr(pl, '\n', plen);
	uint32_t i;

	if (!nl)
		return plen > limit ? MCH_REJ_LINE_TOO_LONG : MCH_REJ_NO_CRLF;
	i = (uint32_t)(nl - pl);
	if (i + 1u > limit)
		return MCH_REJ_LINE_TOO_LONG;
	if (i == 0 || pl[i - 1] != '\r')
		return MCH_REJ_NO_CRLF;
	*line_len = i - 1u;
	return MCH_REJ_OK;
}

static enum mch_rej parse_command(struct mch_req *r)
{
	const struct mch_cmd_def *def;
	uint32_t line_len = 0;
	enum mch_rej rc = find_line(r, &line_len);

	if (rc)
		return rc;
	rc = tokenize(r, MCH_UDP_HDR, line_len);
	if (rc == MCH_REJ_BAD_CHAR)
		return rc;
	if (r->ntok == 0)
		return MCH_REJ_UNKNOWN_CMD;
	def = cmd_lookup(tok_ptr(r, 0), r->tok[0].len);
	if (!def)
		return cmd_unsupported(tok_ptr(r, 0), r->tok[0].len) ? MCH_REJ_UNSUPPORTED
								      : MCH_REJ_UNKNOWN_CMD;
	if (rc)
		return def->retrieval ? MCH_REJ_TOO_MANY_KEYS : MCH_REJ_BAD_FORMAT;
	r->cmd = def->cmd;
	if (def->noreply_ok && r->ntok >= 2 && tok_is(r, r->ntok - 1u, "noreply")) {
		r->noreply = 1;
		r->ntok--;
	}
	return def->check(r, MCH_UDP_HDR + line_len + 2u);
}

static void count_req(const struct mch_req *r, enum mch_rej rc, struct mch_counters *c)
{
	c->rx++;
	if (rc != MCH_REJ_OK)
		c->rej[rc]++;
	else if (r->cmd == MCH_CMD_GET)
		c->rx_get++;
	else if (r->cmd == MCH_CMD_GETS)
		c->rx_gets++;
	else
		c->rx_pass++;
	if (rc == MCH_REJ_OK && mch_req_is_get(r))
		c->rx_keys += r->nkeys;
}

enum mch_rej mch_req_parse(struct mch_req *r, const uint8_t *dg, size_t len,
			   struct mch_counters *c)
{
	enum mch_rej rc = parse_frame(r, dg, len);

	if (rc == MCH_REJ_OK)
		rc = parse_command(r);
	count_req(r, rc, c);
	return rc;
}

/* ----------------------------------------------------------------- encoders */

void mch_get_open(struct mch_batch *b, uint32_t max_keys, uint32_t max_line)
{
	if (max_line > MCH_GET_LINE_MAX)
		max_line = MCH_GET_LINE_MAX;
	/* line = "gets" + sum(" " + key) + "\r\n" */
	mch_batch_reset(b, max_keys, max_line, 6u, 1u);
	b->cmd = MCH_CMD_GET;
	b->shape = MCH_SHAPE_VALUES;
}

static uint32_t req_keys(const struct mch_req *r, struct mch_bkey *k)
{
	uint32_t i;

	for (i = 0; i < r->nkeys; i++)
		k[i].p = mch_req_key(r, i, &k[i].len);
	return r->nkeys;
}

int mch_get_add(struct mch_batch *b, const struct mch_req *r, uint32_t client,
		struct mch_counters *c)
{
	struct mch_bkey k[MCH_REQ_MAX_KEYS];
	uint32_t n;
	int rc;

	if (!mch_req_is_get(r) || (b->cmd != MCH_CMD_GET && b->cmd != MCH_CMD_GETS))
		return MCH_BADD_TOO_BIG;
	n = req_keys(r, k);
	rc = mch_batch_add(b, client, r->rid, r->cmd == MCH_CMD_GETS ? MCH_WF_CAS : 0, k, n);
	if (rc == MCH_BADD_FULL)
		c->b_full++;
	return rc;
}

size_t mch_get_encode(struct mch_batch *b, uint8_t *out, size_t cap, struct mch_counters *c)
{
	const char *name = (b->flags_or & MCH_WF_CAS) ? "gets" : "get";
	size_t len = strlen(name) + 2u, o;
	uint32_t i, klen;

	if (b->nwaiters == 0)
		return 0;
	for (i = 0; i < b->npos; i++)
		len += 1u + b->pos[i].klen;
	if (len > cap)
		return 0;
	b->cmd = (b->flags_or & MCH_WF_CAS) ? MCH_CMD_GETS : MCH_CMD_GET;
	o = strlen(name);
	memcpy(out, name, o);
	for (i = 0; i < b->npos; i++) {
		const uint8_t *k = mch_batch_key(b, i, &klen);

		out[o++] = ' ';
		memcpy(out + o, k, klen);
		o += klen;
	}
	out[o++] = '\r';
	out[o++] = '\n';
	c->b_cmds++;
	c->b_keys += b->npos;
	c->b_refs += b->nrefs;
	c->b_waiters += b->nwaiters;
	return o;
}

static size_t pass_len(const struct mch_req *r)
{
	size_t len = 2u + (r->ntok - 1u);
	uint32_t t;

	for (t = 0; t < r->ntok; t++)
		len += r->tok[t].len;
	if (is_storage(r->cmd))
		len += r->data.len + 2u;
	return len;
}

static size_t pass_write(const struct mch_req *r, uint8_t *out)
{
	size_t o = 0;
	uint32_t t;

	for (t = 0; t < r->ntok; t++) {
		if (t)
			out[o++] = ' ';
		memcpy(out + o, tok_ptr(r, t), r->tok[t].len);
		o += r->tok[t].len;
	}
	out[o++] = '\r';
	out[o++] = '\n';
	if (is_storage(r->cmd)) {
		memcpy(out + o, r->dg + r->data.off, r->data.len);
		o += r->data.len;
		out[o++] = '\r';
		out[o++] = '\n';
	}
	return o;
}

size_t mch_pass_encode(struct mch_batch *b, const struct mch_req *r, uint32_t client,
		       uint8_t *out, size_t cap, struct mch_counters *c)
{
	struct mch_bkey k[MCH_REQ_MAX_KEYS];
	uint32_t n = 0;
	uint8_t flags = 0;

	if (mch_req_is_get(r) || r->cmd == MCH_CMD_NONE || pass_len(r) > cap)
		return 0;
	mch_batch_reset(b, MCH_BATCH_MAX_KEYS, UINT32_MAX, 0, 0);
	b->cmd = r->cmd;
	b->shape = r->shape;
	if (r->shape == MCH_SHAPE_VALUES)
		n = req_keys(r, k); /* gat/gats: keys to check the answer against */
	if (r->cmd == MCH_CMD_GATS)
		flags |= MCH_WF_CAS;
	if (r->noreply)
		flags |= MCH_WF_SILENT;
	if (mch_batch_add(b, client, r->rid, flags, k, n) != MCH_BADD_OK)
		return 0;
	c->b_pass++;
	return pass_write(r, out);
}

/* ------------------------------------------------------- response splitter */

static struct mch_batch *head(const struct mch_split *s)
{
	return s->q[s->qhead];
}

static void fail(struct mch_split *s, int e)
{
	if (s->err == MCH_ERR_NONE) {
		s->err = (uint8_t)e;
		s->ctr->s_err[e]++;
	}
}

static void send_dgram(struct mch_split *s, const struct mch_bwaiter *w, uint8_t *buf,
		       uint32_t len, uint32_t seq, uint32_t total)
{
	udp_hdr_put(buf, w->rid, (uint16_t)seq, (uint16_t)total);
	s->ctr->tx_dgrams++; /* counted first: a sink may take back what it does not send (mch_conn.c) */
	s->ctr->tx_bytes += MCH_UDP_HDR + len;
	s->sink.dgram(s->sink.arg, w->client, buf, MCH_UDP_HDR + len);
}

/* One whole message (known length) to one waiter. */
static void send_message(struct mch_split *s, const struct mch_bwaiter *w, const uint8_t *msg,
			 uint32_t n)
{
	uint32_t total = (n + MCH_UDP_DATA - 1u) / MCH_UDP_DATA, seq;
	uint8_t *buf = s->st[0].buf;

	for (seq = 0; seq < total; seq++) {
		uint32_t k = n - seq * MCH_UDP_DATA;

		if (k > MCH_UDP_DATA)
			k = MCH_UDP_DATA;
		memcpy(buf + MCH_UDP_HDR, msg + seq * MCH_UDP_DATA, k);
		send_dgram(s, w, buf, k, seq, total);
	}
}

static void finish(struct mch_split *s, struct mch_bwaiter *w)
{
	w->state = MCH_WS_DONE;
	s->ctr->w_done++;
}

static void batch_complete(struct mch_split *s)
{
	struct mch_batch *b = head(s);

	s->qhead = (s->qhead + 1u) % MCH_SPLIT_QUEUE;
	s->qlen--;
	s->next_pos = s->hits = s->rlen = 0;
	s->sink.done(s->sink.arg, b);
}

/* Line variant 1 (cas removed) for get-waiters of a gets command. */
static uint32_t group_of(const struct mch_batch *b, const struct mch_bwaiter *w)
{
	return b->cmd == MCH_CMD_GETS && !(w->flags & MCH_WF_CAS) ? 1u : 0u;
}

static uint8_t groups_at(const struct mch_batch *b, uint32_t pos)
{
	uint8_t g = 0;
	uint32_t r;

	for (r = b->pos[pos].first_ref; r != MCH_NONE; r = b->ref[r].next)
		g |= (uint8_t)(1u << group_of(b, &b->w[b->ref[r].waiter]));
	return g;
}

static uint16_t div_up(uint32_t n)
{
	return (uint16_t)((n + MCH_UDP_DATA - 1u) / MCH_UDP_DATA);
}

/* Send the full datagram of group g to every waiter at the current value. */
static void stage_flush(struct mch_split *s, struct mch_batch *b, uint32_t g)
{
	struct mch_stage *st = &s->st[g];
	uint32_t r;

	for (r = b->pos[s->hit].first_ref; r != MCH_NONE; r = b->ref[r].next) {
		struct mch_bwaiter *w = &b->w[b->ref[r].waiter];

		if (group_of(b, w) != g)
			continue;
		send_dgram(s, w, st->buf, st->fill, st->seq,
			   w->last_pos == s->hit ? s->tot_end[g] : s->tot_noend[g]);
		w->state = MCH_WS_INFLIGHT;
	}
	st->seq++;
	st->fill = 0;
}

static void stage_put(struct mch_split *s, struct mch_batch *b, uint32_t g, const uint8_t *p,
		      size_t n)
{
	struct mch_stage *st = &s->st[g];

	while (n > 0) {
		size_t k = MCH_UDP_DATA - st->fill;

		if (k > n)
			k = n;
		memcpy(st->buf + MCH_UDP_HDR + st->fill, p, k);
		st->fill += (uint32_t)k;
		p += k;
		n -= k;
		if (st->fill == MCH_UDP_DATA)
			stage_flush(s, b, g);
	}
}

/*
 * Start group g's message: the VALUE line's first len bytes (all of it, or
 * up to the cas column) and CRLF; the datagram count follows from <bytes>.
 */
static void stage_start(struct mch_split *s, uint32_t g, uint32_t len, uint32_t nbytes)
{
	struct mch_stage *st = &s->st[g];
	uint32_t total = len + 2u + nbytes + 2u;

	memcpy(st->buf + MCH_UDP_HDR, s->line, len);
	st->buf[MCH_UDP_HDR + len] = '\r';
	st->buf[MCH_UDP_HDR + len + 1u] = '\n';
	st->fill = len + 2u;
	st->seq = 0;
	s->tot_noend[g] = div_up(total);
	s->tot_end[g] = div_up(total + sizeof(END_CRLF));
}

/* Last datagram(s) of group g: as is, or with END appended for last keys. */
static void value_tail(struct mch_split *s, struct mch_batch *b, uint32_t g)
{
	struct mch_stage *st = &s->st[g];
	uint32_t fill = st->fill, c = MCH_UDP_DATA - fill, r;
	int any_end = 0;

	if (c > sizeof(END_CRLF))
		c = sizeof(END_CRLF);
	for (r = b->pos[s->hit].first_ref; r != MCH_NONE; r = b->ref[r].next) {
		struct mch_bwaiter *w = &b->w[b->ref[r].waiter];

		if (group_of(b, w) != g)
			continue;
		if (w->last_pos == s->hit) {
			any_end = 1;
			continue;
		}
		if (fill)
			send_dgram(s, w, st->buf, fill, st->seq, s->tot_noend[g]);
		w->state = MCH_WS_PENDING;
	}
	if (!any_end)
		return;
	memcpy(st->buf + MCH_UDP_HDR + fill, END_CRLF, c);
	for (r = b->pos[s->hit].first_ref; r != MCH_NONE; r = b->ref[r].next) {
		struct mch_bwaiter *w = &b->w[b->ref[r].waiter];

		if (group_of(b, w) == g && w->last_pos == s->hit)
			send_dgram(s, w, st->buf, fill + c, st->seq, s->tot_end[g]);
	}
	if (c < sizeof(END_CRLF))
		memcpy(st->buf + MCH_UDP_HDR, END_CRLF + c, sizeof(END_CRLF) - c);
	for (r = b->pos[s->hit].first_ref; r != MCH_NONE; r = b->ref[r].next) {
		struct mch_bwaiter *w = &b->w[b->ref[r].waiter];

		if (group_of(b, w) != g || w->last_pos != s->hit)
			continue;
		if (c < sizeof(END_CRLF))
			send_dgram(s, w, st->buf, (uint32_t)sizeof(END_CRLF) - c, st->seq + 1u,
				   s->tot_end[g]);
		finish(s, w);
	}
}

struct mch_vhdr {
	uint32_t koff, klen; /* key within the line */
	uint32_t cas_sp;     /* offset of " <cas>", 0 if none */
	uint32_t nbytes;
};

static uint32_t word_end(const uint8_t *l, uint32_t i, uint32_t n)
{
	while (i < n && l[i] != ' ')
		i++;
	return i;
}

/* "VALUE <key> <flags> <bytes>[ <cas>]" (CRLF excluded), single spaces. */
static int parse_value_line(const uint8_t *l, uint32_t n, int want_cas, struct mch_vhdr *v)
{
	uint32_t i = 6, e, k;
	uint64_t x;

	v->koff = i;
	e = word_end(l, i, n);
	v->klen = e - i;
	if (v->klen == 0 || v->klen > MCH_KEY_MAX || e == n)
		return MCH_ERR_BAD_VALUE_LINE;
	for (k = i; k < e; k++)
		if (!is_key_byte(l[k]))
			return MCH_ERR_BAD_VALUE_LINE;
	i = e + 1u;
	e = word_end(l, i, n);
	if (!parse_uint(l + i, e - i, UINT32_MAX, &x) || e == n)
		return MCH_ERR_BAD_VALUE_LINE;
	i = e + 1u;
	e = word_end(l, i, n);
	if (!parse_uint(l + i, e - i, UINT64_MAX, &x))
		return MCH_ERR_BAD_VALUE_LINE;
	if (x > MCH_ITEM_MAX)
		return MCH_ERR_TOO_BIG;
	v->nbytes = (uint32_t)x;
	v->cas_sp = want_cas ? e : 0;
	if (!want_cas)
		return e == n ? MCH_ERR_NONE : MCH_ERR_BAD_VALUE_LINE;
	if (e == n)
		return MCH_ERR_BAD_VALUE_LINE;
	i = e + 1u;
	e = word_end(l, i, n);
	return e == n && parse_uint(l + i, e - i, UINT64_MAX, &x) ? MCH_ERR_NONE
								  : MCH_ERR_BAD_VALUE_LINE;
}

static int error_kind(const uint8_t *l, uint32_t n)
{
	if (bytes_eq(l, n, "ERROR"))
		return MCH_ERR_ERROR;
	if (has_prefix(l, n, "CLIENT_ERROR "))
		return MCH_ERR_CLIENT_ERROR;
	if (has_prefix(l, n, "SERVER_ERROR "))
		return MCH_ERR_SERVER_ERROR;
	return MCH_ERR_NONE;
}

static void value_begin(struct mch_split *s, struct mch_batch *b, uint32_t n)
{
	struct mch_vhdr v;
	uint32_t p;
	int e = parse_value_line(s->line, n, b->cmd == MCH_CMD_GETS || b->cmd == MCH_CMD_GATS, &v);

	if (e != MCH_ERR_NONE) {
		fail(s, e);
		return;
	}
	/*
	 * memcached answers in the order asked, skipping misses: the value is most often the
	 * next position's, which is then also the first position >= next_pos with this key
	 */
	p = s->next_pos;
	if (p >= b->npos || b->pos[p].klen != v.klen ||
	    memcmp(b->keys + b->pos[p].koff, s->line + v.koff, v.klen) != 0)
		p = mch_batch_find(b, s->next_pos, s->line + v.koff, v.klen);
	if (p == MCH_NONE) {
		fail(s, MCH_ERR_KEY_ORDER);
		return;
	}
	s->ctr->s_misses += p - s->next_pos;
	s->ctr->s_values++;
	s->ctr->s_value_bytes += v.nbytes;
	s->hit = p;
	s->groups = groups_at(b, p);
	if (s->groups & 1u)
		stage_start(s, 0, n, v.nbytes);
	if (s->groups & 2u)
		stage_start(s, 1, v.cas_sp, v.nbytes);
	s->data_left = v.nbytes + 2u;
	s->state = ST_DATA;
}

/* "END": waiters not finished by a value of theirs get END alone. */
static void values_end(struct mch_split *s, struct mch_batch *b)
{
	uint32_t i;

	s->ctr->s_misses += b->npos - s->next_pos;
	for (i = 0; i < b->nwaiters; i++) {
		struct mch_bwaiter *w = &b->w[i];

		if (w->state == MCH_WS_DONE)
			continue;
		send_message(s, w, END_CRLF, sizeof(END_CRLF));
		finish(s, w);
	}
	batch_complete(s);
}

/* Send the buffered answer of a pass-through command. */
static void pass_finish(struct mch_split *s, struct mch_batch *b)
{
	struct mch_bwaiter *w = &b->w[0];

	if (w->flags & MCH_WF_SILENT) {
		w->state = MCH_WS_DONE;
		s->ctr->w_silent++;
	} else {
		send_message(s, w, s->rbuf, s->rlen);
		finish(s, w);
	}
	batch_complete(s);
}

static int reply_append(struct mch_split *s)
{
	if (s->rlen + s->llen > MCH_PASS_REPLY_MAX) {
		fail(s, MCH_ERR_REPLY_TOO_BIG);
		return 0;
	}
	memcpy(s->rbuf + s->rlen, s->line, s->llen);
	s->rlen += s->llen;
	return 1;
}

static void values_line(struct mch_split *s, struct mch_batch *b, uint32_t n)
{
	int ek;

	if (bytes_eq(s->line, n, "END")) {
		values_end(s, b);
		return;
	}
	if (has_prefix(s->line, n, "VALUE ")) {
		value_begin(s, b, n);
		return;
	}
	ek = error_kind(s->line, n);
	/* a gat/gats refused as a whole is answered with memcached's error line */
	if (ek && (b->cmd == MCH_CMD_GAT || b->cmd == MCH_CMD_GATS) && s->hits == 0 &&
	    printable(s->line, n) && reply_append(s)) {
		pass_finish(s, b);
		return;
	}
	fail(s, ek ? ek : MCH_ERR_BAD_LINE);
}

/* Is l[0..n) a success answer memcached gives to this command? */
static int line_fits(uint8_t cmd, const uint8_t *l, uint32_t n)
{
	switch (cmd) {
	case MCH_CMD_SET: case MCH_CMD_ADD: case MCH_CMD_REPLACE:
	case MCH_CMD_APPEND: case MCH_CMD_PREPEND: case MCH_CMD_CAS:
		return bytes_eq(l, n, "STORED") || bytes_eq(l, n, "NOT_STORED") ||
		       bytes_eq(l, n, "EXISTS") || bytes_eq(l, n, "NOT_FOUND");
	case MCH_CMD_DELETE:
		return bytes_eq(l, n, "DELETED") || bytes_eq(l, n, "NOT_FOUND");
	case MCH_CMD_INCR: case MCH_CMD_DECR:
		return (all_digits(l, n) && n <= 20u) || bytes_eq(l, n, "NOT_FOUND");
	case MCH_CMD_TOUCH:
		return bytes_eq(l, n, "TOUCHED") || bytes_eq(l, n, "NOT_FOUND");
	case MCH_CMD_VERSION:
		return has_prefix(l, n, "VERSION ") && n > 8u;
	case MCH_CMD_FLUSH_ALL: case MCH_CMD_VERBOSITY:
		return bytes_eq(l, n, "OK");
	case MCH_CMD_STATS:
		return bytes_eq(l, n, "RESET");
	default:
		return 0;
	}
}

static void single_line(struct mch_split *s, struct mch_batch *b, uint32_t n)
{
	if (!printable(s->line, n) ||
	    (!error_kind(s->line, n) && !line_fits(b->cmd, s->line, n))) {
		fail(s, MCH_ERR_BAD_REPLY);
		return;
	}
	if (reply_append(s))
		pass_finish(s, b);
}

static void stats_line(struct mch_split *s, struct mch_batch *b, uint32_t n)
{
	int whole = s->rlen == 0 && error_kind(s->line, n);
	int end = bytes_eq(s->line, n, "END");

	if (!printable(s->line, n) || (!whole && !end && !has_prefix(s->line, n, "STAT "))) {
		fail(s, MCH_ERR_BAD_REPLY);
		return;
	}
	if (reply_append(s) && (whole || end))
		pass_finish(s, b);
}

static void on_line(struct mch_split *s)
{
	struct mch_batch *b = head(s);
	uint32_t n = s->llen - 2u;

	if (s->llen < 2u || s->line[n] != '\r') {
		fail(s, MCH_ERR_BAD_LINE);
		return;
	}
	s->ctr->s_lines++;
	if (b->shape == MCH_SHAPE_VALUES)
		values_line(s, b, n);
	else if (b->shape == MCH_SHAPE_LINE)
		single_line(s, b, n);
	else
		stats_line(s, b, n);
}

static size_t split_line(struct mch_split *s, const uint8_t *p, size_t n)
{
	const uint8_t *nl;
	size_t k;

	if (s->qlen == 0) {
		fail(s, MCH_ERR_UNSOLICITED);
		return n;
	}
	nl = memchr(p, '\n', n);
	k = nl ? (size_t)(nl - p) + 1u : n;
	if (s->llen + k > MCH_REPLY_LINE_MAX) {
		fail(s, MCH_ERR_LINE_TOO_LONG);
		return n;
	}
	memcpy(s->line + s->llen, p, k);
	s->llen += (uint32_t)k;
	if (nl) {
		on_line(s);
		s->llen = 0;
	}
	return k;
}

static size_t split_data(struct mch_split *s, const uint8_t *p, size_t n)
{
	struct mch_batch *b = head(s);
	size_t k = n < s->data_left ? n : s->data_left;
	size_t i = s->data_left > 2u ? s->data_left - 2u : 0;
	uint32_t g;

	for (; i < k; i++) {
		if (p[i] != (s->data_left - i == 2u ? '\r' : '\n')) {
			fail(s, MCH_ERR_BAD_DATA);
			return n;
		}
	}
	for (g = 0; g < 2; g++)
		if (s->groups & (1u << g))
			stage_put(s, b, g, p, k);
	s->data_left -= (uint32_t)k;
	if (s->data_left == 0) {
		for (g = 0; g < 2; g++)
			if (s->groups & (1u << g))
				value_tail(s, b, g);
		s->next_pos = s->hit + 1u;
		s->hits++;
		s->state = ST_LINE;
	}
	return k;
}

void mch_split_init(struct mch_split *s, const struct mch_sink *sink, struct mch_counters *c)
{
	memset(s, 0, sizeof(*s));
	s->sink = *sink;
	s->ctr = c;
}

int mch_split_push(struct mch_split *s, struct mch_batch *b)
{
	if (s->qlen == MCH_SPLIT_QUEUE || b->nwaiters == 0)
		return -1;
	s->q[(s->qhead + s->qlen) % MCH_SPLIT_QUEUE] = b;
	s->qlen++;
	return 0;
}

int mch_split_feed(struct mch_split *s, const uint8_t *p, size_t n)
{
	while (n > 0 && s->err == MCH_ERR_NONE) {
		size_t k = s->state == ST_DATA ? split_data(s, p, n) : split_line(s, p, n);

		p += k;
		n -= k;
	}
	return s->err;
}

void mch_split_abort(struct mch_split *s)
{
	uint32_t i;

	while (s->qlen > 0) {
		struct mch_batch *b = head(s);
		int coalesced = b->cmd == MCH_CMD_GET || b->cmd == MCH_CMD_GETS;

		for (i = 0; i < b->nwaiters; i++) {
			struct mch_bwaiter *w = &b->w[i];

			if (w->state == MCH_WS_DONE)
				continue;
			if (coalesced && w->state == MCH_WS_PENDING) {
				send_message(s, w, END_CRLF, sizeof(END_CRLF));
				s->ctr->w_abort_miss++;
			} else {
				s->ctr->w_abort_drop++;
			}
			w->state = MCH_WS_DONE;
		}
		batch_complete(s);
	}
	s->err = MCH_ERR_NONE;
	s->state = ST_LINE;
	s->llen = s->data_left = 0;
	s->groups = 0;
}

/* -------------------------------------------------------------------- names */

const char *mch_rej_name(int rej)
{
	static const char *const n[MCH_REJ__COUNT] = {
		"ok", "short", "multi_dgram", "oversize", "empty", "binary", "no_crlf",
		"line_too_long", "bad_char", "unknown_cmd", "unsupported", "bad_format",
		"bad_key", "too_many_keys", "too_large", "bad_data", "multi_cmd",
	};

	return rej >= 0 && rej < MCH_REJ__COUNT ? n[rej] : "?";
}

const char *mch_err_name(int err)
{
	static const char *const n[MCH_ERR__COUNT] = {
		"none", "unsolicited", "line_too_long", "bad_line", "bad_value_line",
		"too_big", "key_order", "bad_data", "error", "client_error", "server_error",
		"bad_reply", "reply_too_big",
	};

	return err >= 0 && err < MCH_ERR__COUNT ? n[err] : "?";
}

const char *mch_cmd_name(int cmd)
{
	uint32_t i;

	for (i = 0; i < sizeof(mch_cmds) / sizeof(mch_cmds[0]); i++)
		if (mch_cmds[i].cmd == cmd)
			return mch_cmds[i].name;
	return "none";
}

/* ------------------------------------------------------------ relay safety */

/*
 * If p[0, n) starts like a storage command ("set", "add", "replace", "append",
 * "prepend", "cas") with a length token (the 5th), the length memcached would
 * read it as (strtol-like: sign and leading digits; a value it would refuse
 * counts anyway, to err on the safe side, except a negative one, refused before
 * any data is read); -1 otherwise.
 */
static int64_t storage_len(const uint8_t *p, uint32_t n)
{
	static const char *const cmds[] = {"set", "add", "replace", "append", "prepend", "cas"};
	uint32_t i = 0, t = 0, s, k;
	int64_t v = -1;

	while (i < n && t <= 4u) {
		while (i < n && p[i] == ' ')
			i++;
		s = i;
		while (i < n && p[i] != ' ' && p[i] != '\r')
			i++;
		if (i == s)
			break;
		if (t == 0) {
			for (k = 0; k < sizeof(cmds) / sizeof(cmds[0]); k++)
				if (bytes_eq(p + s, i - s, cmds[k]))
					break;
			if (k == sizeof(cmds) / sizeof(cmds[0]))
				return -1;
		} else if (t == 4u) {
			int neg = 0;

			while (s < i && (p[s] == '+' || p[s] == '\t' || p[s] == '\v' || p[s] == '\f'))
				s++;
			if (s < i && p[s] == '-') {
				neg = 1;
				s++;
			}
			for (v = 0; s < i && p[s] >= '0' && p[s] <= '9' && v <= (int64_t)MCH_ITEM_MAX * 4; s++)
				v = v * 10 + (p[s] - '0');
			if (neg) /* memcached refuses a negative length before reading any data */
				return v > 0 ? -1 : 0;
			return s < i && p[s] >= '0' && p[s] <= '9' ? (int64_t)MCH_ITEM_MAX * 4 : v;
		}
		t++;
	}
	return -1;
}

int mch_req_relay_safe(const uint8_t *dg, size_t len)
{
	const uint8_t *p, *end, *nl;

	if (len <= MCH_UDP_HDR || len > MCH_DGRAM_MAX || be16(dg + 4) != 1 || dg[MCH_UDP_HDR] == 0x80)
		return 0;
	p = dg + MCH_UDP_HDR;
	end = dg + len;
	while (p < end) {
		int64_t need;

		const uint8_t *w = p;
		uint32_t wl = 0;

		nl = memchr(p, '\n', (size_t)(end - p));
		while (w < (nl ? nl : end) && *w == ' ')
			w++;
		while (w + wl < (nl ? nl : end) && w[wl] != ' ' && w[wl] != '\r')
			wl++;
		/* commands helpers do not forward: a meta set's data block, a watch or lru_crawler
		 * turning the shared UDP connection into a stream, shutdown: never relayed either */
		if (cmd_unsupported(w, wl))
			return 0;
		need = storage_len(p, (uint32_t)((nl ? nl : end) - p));
		if (need >= 0 && (need + 2 > (int64_t)MCH_ITEM_MAX || nl == NULL ||
				  (int64_t)(end - nl - 1) < need + 2))
			return 0;
		if (nl == NULL)
			break;
		p = nl + 1;
	}
	return 1;
}
