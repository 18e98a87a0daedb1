/*
 * mch_conn.c - the TCP leg to memcached (see mch_conn.h).
 *
 * Batches come from a fixed pool per connection: MCH_SPLIT_QUEUE in flight
 * plus the open one, so the splitter's queue can never overflow.  A batch is
 * encoded into the output buffer when it is closed, and pushed on the
 * splitter at once, so the order of pushes is the order of bytes on the wire.
 */
#include "mch_conn.h"

#include <errno.h>
#include <netinet/in.h>
#include <linux/sockios.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "mch_worker.h"

#define MCH_CONNECT_TIMEOUT_MS 1000u
#define MCH_READS_PER_POLL     4u

enum close_why { WHY_SIZE, WHY_TIME, WHY_FULL, WHY_ORDER };

/* ------------------------------------------------------------ splitter sink */

static void on_dgram(void *arg, uint32_t client, const uint8_t *dg, uint32_t len)
{
	struct mch_conn *c = arg;

	if (client != MCH_PROBE_CLIENT) {
		mch_worker_reply(c->w, client, dg, len);
		return;
	}
	/* reply_dgrams/bytes count what clients are sent (one per request, tests check): not the probe's answer */
	c->w->pc.tx_dgrams--;
	c->w->pc.tx_bytes -= len;
}

static void on_done(void *arg, struct mch_batch *b)
{
	struct mch_conn *c = arg;
	uint32_t i;

	for (i = 0; i < b->nwaiters; i++) {
		if (b->w[i].client != MCH_PROBE_CLIENT) {
			mch_worker_peer_put(c->w, b->w[i].client);
			continue;
		}
		/* w_done counts client requests answered (== rx_dgrams when none is lost): not probes */
		if (!c->aborting && c->w->pc.w_done > 0)
			c->w->pc.w_done--;
		if (!c->aborting && c->state == MCH_CONN_PROBING) {
			/* memcached answered: it serves; clients may come */
			c->state = MCH_CONN_UP;
			c->c.probes++;
			c->c.connects++;
			c->retry_cur_ms = c->w->cfg->retry_ms;
			c->last_send = c->progress_at;
		}
	}
	c->pool[c->npool++] = b;
}

/* The probe: a `version` command, answered by any memcached that serves. */
static const uint8_t probe_dg[] = "\0\0\0\0\0\1\0\0version\r\n";

/* ---------------------------------------------------------------- set-up */

int mch_conn_init(struct mch_conn *c, struct mch_worker *w, uint32_t id)
{
	const struct mch_cfg *cfg = w->cfg;
	struct mch_sink sink = {on_dgram, on_done, c};
	uint32_t i;

	memset(c, 0, sizeof(*c));
	c->w = w;
	c->id = id;
	c->fd = -1;
	c->hz = w->hz;
	c->read_gap_lo = (uint64_t)MCH_READ_GAP_MIN_NS * c->hz / 1000000000u;
	c->read_gap_hi = (uint64_t)MCH_READ_GAP_MAX_NS * c->hz / 1000000000u;
	c->stall_ticks = (uint64_t)cfg->stall_ms * c->hz / 1000u;
	c->retry_cur_ms = cfg->retry_ms;
	c->out = malloc(MCH_CONN_OUT);
	c->in = malloc(MCH_CONN_IN);
	if (!c->out || !c->in)
		return -1;
	for (i = 0; i < MCH_CONN_BATCHES; i++) {
		c->all[i] = malloc(sizeof(struct mch_batch));
		if (!c->all[i])
			return -1;
		c->all[i]->user = i;
		c->pool[c->npool++] = c->all[i];
	}
	mch_split_init(&c->sp, &sink, &w->pc);
	mch_adapt_init(&c->ad, cfg->s_init, cfg->s_min, cfg->s_max,
		       (uint64_t)cfg->t_init * c->hz / 1000000u,
		       (uint64_t)cfg->t_min * c->hz / 1000000u,
		       (uint64_t)cfg->t_max * c->hz / 1000000u);
	return 0;
}

void mch_conn_free(struct mch_conn *c)
{
	uint32_t i;

	for (i = 0; i < MCH_CONN_BATCHES; i++)
		free(c->all[i]);
	free(c->out);
	free(c->in);
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
}

/* ------------------------------------------------------------- failures */

/*
 * Lost or broken connection: answer what waits (see mch_split_abort: END
 * for coalesced gets, nothing for forwarded commands), the open batch too.
 */
static void conn_fail(struct mch_conn *c, uint64_t now, int why)
{
	c->aborting = 1;
	mch_split_abort(&c->sp);
	if (c->open) {
		if (c->open->nwaiters > 0 && mch_split_push(&c->sp, c->open) == 0)
			mch_split_abort(&c->sp);
		else
			c->pool[c->npool++] = c->open;
		c->open = NULL;
	}
	c->aborting = 0;
	c->why = (uint8_t)why;
	c->down_tsc = now;
	if (why != MCH_DOWN_NO_ANSWERS && why != MCH_DOWN_UNACKED && why != MCH_DOWN_PROBE)
		c->why_unacked = c->why_backoff = c->why_waited_ms = 0;
	memset(c->open_filter, 0, sizeof(c->open_filter));
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	if (c->state == MCH_CONN_UP)
		c->c.disconnects++;
	else
		c->c.connect_fails++;
	c->state = MCH_CONN_DOWN;
	c->out_head = c->out_tail = 0;
	/* the first retry after --retry-ms; while it keeps failing, back off up to MCH_RETRY_MAX_MS */
	c->retry_at = now + (uint64_t)c->retry_cur_ms * c->hz / 1000u;
	c->retry_cur_ms = c->retry_cur_ms * 2u < MCH_RETRY_MAX_MS ? c->retry_cur_ms * 2u : MCH_RETRY_MAX_MS;
	if (c->retry_cur_ms < c->w->cfg->retry_ms)
		c->retry_cur_ms = c->w->cfg->retry_ms;
}

/* The first command in flight starts the answer clock (see mch_conn_state). */
static void pushed(struct mch_conn *c, uint64_t now)
{
	if (mch_split_pending(&c->sp) == 1)
		c->progress_at = now;
}

/* ------------------------------------------------------------ output buffer */

static uint32_t out_room(struct mch_conn *c, uint32_t want)
{
	if (MCH_CONN_OUT - c->out_tail < want && c->out_head > 0) {
		memmove(c->out, c->out + c->out_head, c->out_tail - c->out_head);
		c->out_tail -= c->out_head;
		c->out_head = 0;
	}
	return MCH_CONN_OUT - c->out_tail;
}

/* Write what is buffered; 1 if bytes left, 0 if none, -1 on error. */
static int out_flush(struct mch_conn *c)
{
	while (c->out_head < c->out_tail) {
		ssize_t n = send(c->fd, c->out + c->out_head, c->out_tail - c->out_head,
				 MSG_DONTWAIT | MSG_NOSIGNAL);

		if (n > 0) {
			c->out_head += (uint32_t)n;
			c->c.bytes_out += (uint64_t)n;
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
			return 1;
		return -1;
	}
	c->out_head = c->out_tail = 0;
	return 0;
}

/* Read and split answers; work done (1), nothing (0), error/EOF (-1). */
static int in_poll(struct mch_conn *c, uint64_t now)
{
	int did = 0;
	uint32_t i;

	for (i = 0; i < MCH_READS_PER_POLL; i++) {
		ssize_t n = recv(c->fd, c->in, MCH_CONN_IN, MSG_DONTWAIT);

		c->c.reads++;
		if (n > 0) {
			did = 1;
			c->progress_at = now;
			c->c.bytes_in += (uint64_t)n;
			if (mch_split_feed(&c->sp, c->in, (size_t)n) != MCH_ERR_NONE)
				return -2;
			if ((uint32_t)n < MCH_CONN_IN)
				break;
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
			c->c.reads_empty++;
			break;
		}
		return -1; /* EOF or error */
	}
	return did;
}

/* --------------------------------------------------------------- batching */

static void filter_set(struct mch_conn *c, uint32_t ch)
{
	uint32_t bit = (ch >> 8) & 255u;

	c->open_filter[bit >> 6] |= 1ull << (bit & 63u);
}

static int filter_has(const struct mch_conn *c, uint32_t ch)
{
	uint32_t bit = (ch >> 8) & 255u;

	return (c->open_filter[bit >> 6] >> (bit & 63u)) & 1u;
}

/* Encode and push the open batch.  0, or -1 if there is no room yet. */
static int close_open(struct mch_conn *c, uint64_t now, int why)
{
	struct mch_batch *b = c->open;
	size_t n;

	if (b == NULL || b->nwaiters == 0)
		return 0;
	if (mch_split_pending(&c->sp) >= MCH_SPLIT_QUEUE)
		return -1;
	if (out_room(c, MCH_GET_LINE_MAX) < MCH_GET_LINE_MAX)
		return -1;
	n = mch_get_encode(b, c->out + c->out_tail, MCH_CONN_OUT - c->out_tail, &c->w->pc);
	if (n == 0 || mch_split_push(&c->sp, b) != 0)
		return -1; /* cannot happen: room and queue were checked */
	c->out_tail += (uint32_t)n;
	pushed(c, now);
	c->open = NULL;
	memset(c->open_filter, 0, sizeof(c->open_filter));
	c->c.get_cmds++;
	mch_hist_add(&c->w->hist, b->npos);
	mch_adapt_update(&c->ad, n, now - c->last_send);
	c->last_send = now;
	if (why == WHY_SIZE)
		c->c.close_size++;
	else if (why == WHY_TIME)
		c->c.close_time++;
	else if (why == WHY_FULL)
		c->c.close_full++;
	else
		c->c.close_order++;
	return 0;
}

static int open_batch(struct mch_conn *c)
{
	if (c->npool == 0)
		return -1;
	c->open = c->pool[--c->npool];
	/* soft limits: all keys, S_max bytes; S itself only decides when to send */
	mch_get_open(c->open, MCH_BATCH_MAX_KEYS, (uint32_t)c->ad.s_max);
	return 0;
}

int mch_conn_get(struct mch_conn *c, const struct mch_req *r, uint32_t slot, uint32_t ch,
		 uint64_t now)
{
	int rc;

	if (c->state != MCH_CONN_UP)
		return MCH_CDROP_NOCONN;
	if (c->open == NULL && open_batch(c) != 0)
		return MCH_CDROP_BUSY;
	rc = mch_get_add(c->open, r, slot, &c->w->pc);
	if (rc == MCH_BADD_FULL) {
		if (close_open(c, now, WHY_FULL) != 0 || open_batch(c) != 0)
			return MCH_CDROP_BUSY;
		rc = mch_get_add(c->open, r, slot, &c->w->pc);
	}
	if (rc != MCH_BADD_OK)
		return MCH_CDROP_BIG;
	filter_set(c, ch);
	return MCH_CDROP_NONE;
}

int mch_conn_pass(struct mch_conn *c, const struct mch_req *r, uint32_t slot, uint32_t ch,
		  uint64_t now)
{
	struct mch_batch *b;
	size_t n;

	if (c->state != MCH_CONN_UP)
		return MCH_CDROP_NOCONN;
	if (!c->w->cfg->no_order && c->open && filter_has(c, ch) &&
	    close_open(c, now, WHY_ORDER) != 0)
		return MCH_CDROP_BUSY;
	if (c->npool == 0 || mch_split_pending(&c->sp) >= MCH_SPLIT_QUEUE ||
	    out_room(c, r->len) < r->len)
		return MCH_CDROP_BUSY;
	b = c->pool[--c->npool];
	/* the canonical command is never longer than the request datagram */
	n = mch_pass_encode(b, r, slot, c->out + c->out_tail, MCH_CONN_OUT - c->out_tail,
			    &c->w->pc);
	if (n == 0 || mch_split_push(&c->sp, b) != 0) {
		c->pool[c->npool++] = b;
		return MCH_CDROP_BIG;
	}
	c->out_tail += (uint32_t)n;
	pushed(c, now);
	c->c.pass_cmds++;
	return MCH_CDROP_NONE;
}

/* After a fast-path read: read again at once if it found data, else back off (see mch_conn.h). */
static void read_backoff(struct mch_conn *c, uint64_t now, int got)
{
	uint64_t hi = c->read_gap_hi;

	if (got)
		c->read_gap = 0;
	else
		c->read_gap = c->read_gap == 0 ? c->read_gap_lo : (c->read_gap * 2 < hi ? c->read_gap * 2 : hi);
	c->read_at = now + c->read_gap;
}

uint64_t mch_conn_due_in(const struct mch_conn *c, uint64_t now)
{
	uint64_t waited;

	if (c->open == NULL || c->open->nwaiters == 0)
		return UINT64_MAX;
	/*
	 * A batch that cannot be closed (every slot in flight, or no room in the output
	 * buffer) is not due: the loop waits for answers (POLLIN wakes it), it does not
	 * spin on it.
	 */
	if (mch_split_pending(&c->sp) >= MCH_SPLIT_QUEUE ||
	    MCH_CONN_OUT - c->out_tail + c->out_head < MCH_GET_LINE_MAX)
		return UINT64_MAX;
	waited = now - c->last_send;
	return waited >= c->ad.T ? 0 : c->ad.T - waited;
}

int mch_conn_poll(struct mch_conn *c, uint64_t now)
{
	int did = 0, rc;

	if (c->state != MCH_CONN_UP && c->state != MCH_CONN_PROBING)
		return 0;
	if (c->open && c->open->nwaiters > 0) {
		struct mch_batch *b = c->open;

		if (b->cost >= c->ad.S)
			did |= close_open(c, now, WHY_SIZE) == 0;
		else if (now - c->last_send >= c->ad.T)
			did |= close_open(c, now, WHY_TIME) == 0;
	}
	if (c->out_tail > c->out_head) {
		uint64_t sent = c->c.bytes_out;

		if (out_flush(c) < 0) {
			conn_fail(c, now, MCH_DOWN_CLOSED);
			return 1;
		}
		/* a full socket buffer (a stalled leg) is no work done: the loop may sleep */
		did |= c->c.bytes_out != sent;
	}
	if (mch_split_pending(&c->sp) > 0 && (int64_t)(now - c->read_at) >= 0) {
		rc = in_poll(c, now);
		if (rc < 0) {
			conn_fail(c, now, rc == -2 ? MCH_DOWN_PROTO : MCH_DOWN_CLOSED);
			return 1;
		}
		did |= rc;
		read_backoff(c, now, rc > 0);
	}
	return did;
}

/* ----------------------------------------------------------- slow path */

/* Queue the probe (`version`) on the connection.  0, or -1 (no batch free, cannot encode). */
static int push_probe(struct mch_conn *c, uint64_t now)
{
	static struct mch_req probe;
	static struct mch_counters scratch;
	struct mch_batch *b;
	size_t n;

	if (probe.len == 0 && mch_req_parse(&probe, probe_dg, sizeof(probe_dg) - 1, &scratch) != MCH_REJ_OK)
		probe.len = 0;
	if (probe.len == 0 || c->npool == 0 || out_room(c, sizeof(probe_dg)) < sizeof(probe_dg))
		return -1;
	b = c->pool[--c->npool];
	n = mch_pass_encode(b, &probe, MCH_PROBE_CLIENT, c->out + c->out_tail,
			    MCH_CONN_OUT - c->out_tail, &scratch);
	if (n == 0 || mch_split_push(&c->sp, b) != 0) {
		c->pool[c->npool++] = b;
		return -1;
	}
	c->out_tail += (uint32_t)n;
	pushed(c, now);
	return 0;
}

/* Connected: send the probe first; clients are taken once it is answered (on_done). */
static void start_probe(struct mch_conn *c, uint64_t now)
{
	c->state = MCH_CONN_PROBING;
	if (push_probe(c, now) != 0)
		conn_fail(c, now, MCH_DOWN_PROBE); /* cannot happen: a fresh connection has every batch */
}

static void start_connect(struct mch_conn *c, uint64_t now)
{
	const struct mch_cfg *cfg = c->w->cfg;
	struct sockaddr_in sa;
	int one = 1;

	c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (c->fd < 0) {
		conn_fail(c, now, MCH_DOWN_CONNECT);
		return;
	}
	setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_addr.s_addr = cfg->mc_ip;
	sa.sin_port = cfg->mc_port;
	c->conn_start = now;
	if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
		start_probe(c, now);
	else if (errno == EINPROGRESS)
		c->state = MCH_CONN_CONNECTING;
	else
		conn_fail(c, now, MCH_DOWN_CONNECT);
}

static void check_connect(struct mch_conn *c, uint64_t now)
{
	struct pollfd p = {.fd = c->fd, .events = POLLOUT};
	int err = 0;
	socklen_t el = sizeof(err);

	if (poll(&p, 1, 0) <= 0) {
		/* a leg that drops the SYN: try afresh after 4 stall bounds, not the kernel's 1 s SYN timer */
		if (now - c->conn_start > 4u * c->stall_ticks ||
		    now - c->conn_start > (uint64_t)MCH_CONNECT_TIMEOUT_MS * c->hz / 1000u)
			conn_fail(c, now, MCH_DOWN_CONNECT);
		return;
	}
	if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
		conn_fail(c, now, MCH_DOWN_CONNECT);
		return;
	}
	start_probe(c, now);
}

/*
 * No answer for --stall-ms while commands are in flight: say why (TCP_INFO tells a
 * leg whose data is not even acknowledged from a memcached that does not answer),
 * fail the connection (its waiters are answered at once) and reconnect.
 */
static void check_stall(struct mch_conn *c, uint64_t now)
{
	struct tcp_info ti;
	socklen_t tl = sizeof(ti);
	int outq = 0, why = c->state == MCH_CONN_PROBING ? MCH_DOWN_PROBE : MCH_DOWN_NO_ANSWERS;

	if (mch_split_pending(&c->sp) == 0 || now - c->progress_at <= c->stall_ticks)
		return;
	c->why_unacked = 0;
	c->why_backoff = 0;
	memset(&ti, 0, sizeof(ti));
	/* bytes in the send queue, not yet acknowledged by memcached's host (sent or not) */
	if (ioctl(c->fd, SIOCOUTQ, &outq) != 0 || outq < 0)
		outq = 0;
	c->why_unacked = (uint32_t)outq;
	if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0) {
		c->why_backoff = ti.tcpi_backoff;
		if (why == MCH_DOWN_NO_ANSWERS && outq > 0 &&
		    ti.tcpi_last_ack_recv >= c->w->cfg->stall_ms)
			why = MCH_DOWN_UNACKED;
	}
	c->why_waited_ms = (uint32_t)((now - c->progress_at) * 1000u / c->hz);
	c->c.stalls++;
	conn_fail(c, now, why);
}

void mch_conn_tick(struct mch_conn *c, uint64_t now)
{
	switch (c->state) {
	case MCH_CONN_DOWN:
		if ((int64_t)(now - c->retry_at) >= 0)
			start_connect(c, now);
		break;
	case MCH_CONN_CONNECTING:
		check_connect(c, now);
		break;
	default:
		/* notice EOF or unsolicited bytes while nothing is due */
		if (mch_split_pending(&c->sp) == 0) {
			int rc = in_poll(c, now);

			if (rc < 0)
				conn_fail(c, now, rc == -2 ? MCH_DOWN_PROTO : MCH_DOWN_CLOSED);
			/*
			 * Idle for MCH_KEEPALIVE_STALLS stall bounds: probe, so a leg that died
			 * while no client used it (a withdrawn helper) is noticed as under load,
			 * and `serving 1` means memcached answered lately (issue 43: the agent
			 * re-admits a helper only after it has served for a while).
			 */
			else if (c->state == MCH_CONN_UP &&
				 now - c->progress_at > MCH_KEEPALIVE_STALLS * c->stall_ticks &&
				 push_probe(c, now) == 0)
				c->c.keepalives++;
		} else {
			check_stall(c, now);
		}
		break;
	}
}

void mch_conn_close(struct mch_conn *c)
{
	conn_fail(c, 0, c->why);
	c->state = MCH_CONN_DOWN;
}

const char *mch_down_name(int why)
{
	static const char *const n[MCH_DOWN__COUNT] = {
		"none", "no_answers", "unacked", "probe", "connect", "closed", "proto",
	};

	return why >= 0 && why < MCH_DOWN__COUNT ? n[why] : "?";
}
