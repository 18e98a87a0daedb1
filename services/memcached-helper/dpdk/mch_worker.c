/*
 * mch_worker.c - the lcore loop: burst rx, classify, parse, queue on the
 * client's connection, poll the connections (send due batches, read and
 * split answers), burst tx the replies.  Counters only, never a log line.
 *
 * A waiting client request holds a slot in the worker's peer table (where
 * its reply goes); the slot number is the "client" the protocol core hands
 * back with every reply datagram, and it is freed when the batch is done.
 */
#include "mch_worker.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rte_cycles.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>

#define MCH_TICK_HZ      1000u /* slow path rate */
#define MCH_IDLE_LOOPS   64u   /* empty loops before sleeping (--idle-us) */
#define MCH_TX_TRIES     64u

/* ------------------------------------------------------------- peer slots */

static uint32_t peer_get(struct mch_worker *w, const struct mch_peer *from)
{
	uint32_t s = w->peer_free;

	if (s == MCH_NO_PEER)
		return MCH_NO_PEER;
	w->peer_free = w->peers[s].next;
	w->peers[s] = *from;
	w->peers_used++;
	return s;
}

void mch_worker_peer_put(struct mch_worker *w, uint32_t slot)
{
	w->peers[slot].next = w->peer_free;
	w->peer_free = slot;
	w->peers_used--;
}

/* ----------------------------------------------------------------- tx */

static void tx_flush(struct mch_worker *w)
{
	uint16_t sent = 0;
	uint32_t tries = 0;

	while (sent < w->ntx && tries++ < MCH_TX_TRIES)
		sent += rte_eth_tx_burst(w->port, w->queue, w->txq + sent, w->ntx - sent);
	w->c.tx_frames += sent;
	if (sent < w->ntx) {
		w->c.tx_drop += w->ntx - sent;
		rte_pktmbuf_free_bulk(w->txq + sent, w->ntx - sent);
	}
	w->ntx = 0;
}

/* An empty mbuf for a reply, from a stash refilled MCH_TX_BURST at a time; NULL if the pool is empty. */
static struct rte_mbuf *reply_mbuf(struct mch_worker *w)
{
	if (w->nstash == 0) {
		if (rte_pktmbuf_alloc_bulk(w->mp, w->stash, MCH_TX_BURST) == 0)
			w->nstash = MCH_TX_BURST;
		else
			return rte_pktmbuf_alloc(w->mp); /* fewer than a burst left */
	}
	return w->stash[--w->nstash];
}

void mch_worker_reply(struct mch_worker *w, uint32_t slot, const uint8_t *dg, uint32_t len)
{
	struct rte_mbuf *m = reply_mbuf(w);

	if (m == NULL) {
		w->c.tx_nombuf++;
		return;
	}
	if (mch_net_reply(&w->net, m, &w->peers[slot], w->ip_id++, dg, len) != 0) {
		rte_pktmbuf_free(m);
		w->c.tx_nombuf++;
		return;
	}
	w->txq[w->ntx++] = m;
	if (w->ntx == MCH_TX_BURST)
		tx_flush(w);
}

/* ----------------------------------------------------------------- rx */

static uint32_t client_hash(const struct mch_peer *p)
{
	uint32_t h = p->ip ^ ((uint32_t)p->port * 0x9e3779b1u);

	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

/* Serve one request the port classified as ours: batch it, forward it, or relay it. */
static void serve(struct mch_worker *w, const struct mch_rx *rx, uint64_t now)
{
	struct mch_req req;
	struct mch_conn *c;
	uint32_t slot, ch;
	int rc;

	if (mch_req_parse(&req, rx->dg, rx->len, &w->pc) != MCH_REJ_OK) {
		/* counted by reason in w->pc.rej[]; memcached answers it as it would directly */
		slot = peer_get(w, &rx->from);
		if (slot == MCH_NO_PEER)
			w->c.drop_peers++;
		else if (mch_relay_send(&w->relay, slot, rx->dg, rx->len, 0, now) != 0)
			mch_worker_peer_put(w, slot);
		return;
	}
	slot = peer_get(w, &rx->from);
	if (slot == MCH_NO_PEER) {
		w->c.drop_peers++;
		return;
	}
	ch = client_hash(&rx->from);
	c = &w->conns[ch % w->nconns];
	rc = mch_req_is_get(&req) ? mch_conn_get(c, &req, slot, ch, now)
				  : mch_conn_pass(c, &req, slot, ch, now);
	if (rc == MCH_CDROP_NONE)
		return;
	/*
	 * Its connection is down (reconnecting, or its probe not yet answered): the request goes
	 * to memcached as it is, over the relay, until the agent has withdrawn the helper (issue
	 * 43: no client worse off than direct).  A full in-flight queue is overload: shed.
	 */
	if (rc == MCH_CDROP_NOCONN && mch_relay_send(&w->relay, slot, rx->dg, rx->len, 1, now) == 0) {
		w->c.relay_noconn++;
		return;
	}
	mch_worker_peer_put(w, slot);
	if (rc == MCH_CDROP_NOCONN)
		w->c.drop_noconn++;
	else
		w->c.drop_busy++;
}

static uint64_t client_key(const struct mch_peer *p)
{
	return (uint64_t)p->ip << 16 | p->port;
}

/* Serve the held requests of client `key` that are now next in its order (mch_order.h), freeing them. */
static void serve_held(struct mch_worker *w, uint64_t key, uint64_t now)
{
	struct rte_mbuf *m;
	struct mch_rx rx;

	while ((m = mch_order_next(&w->order, key)) != NULL) {
		if (mch_net_parse(&w->net, m, &rx) == MCH_NET_OK) /* it was, when it came (counted then) */
			serve(w, &rx, now);
		rte_pktmbuf_free(m);
	}
}

/* Held requests whose hold time passed (an earlier one of their client was lost): served now. */
static int serve_expired(struct mch_worker *w, uint64_t now)
{
	struct rte_mbuf *m;
	struct mch_rx rx;
	uint64_t key;
	int did = 0;

	while ((m = mch_order_expired(&w->order, now, &key)) != NULL) {
		if (mch_net_parse(&w->net, m, &rx) == MCH_NET_OK)
			serve(w, &rx, now);
		rte_pktmbuf_free(m);
		serve_held(w, key, now);
		did = 1;
	}
	return did;
}

/*
 * A request longer than the receive frame (over ~65,350 B with --rx-buf 65535, up
 * to UDP's 65,507; over ~2 KB with the default frames): the helper never has it
 * whole, so it can neither batch nor relay it.  Its client is told so at once,
 * with memcached's error framing under its request id, rather than timing out.
 */
static void refuse_big(struct mch_worker *w, const struct mch_rx *rx, uint32_t dgram_len)
{
	uint8_t dg[160];
	struct rte_mbuf *m;
	int n;

	n = snprintf((char *)dg + 8, sizeof(dg) - 8,
		     "SERVER_ERROR request of %u bytes is over this helper's limit of %u bytes\r\n",
		     dgram_len, rx->len);
	if (n <= 0 || (size_t)n >= sizeof(dg) - 8)
		return;
	dg[0] = rx->dg[0];
	dg[1] = rx->dg[1];
	dg[2] = dg[3] = dg[6] = dg[7] = 0; /* seq 0 of total 1, reserved 0 */
	dg[4] = 0;
	dg[5] = 1;
	m = reply_mbuf(w);
	if (m == NULL) {
		w->c.tx_nombuf++;
		return;
	}
	if (mch_net_reply(&w->net, m, &rx->from, w->ip_id++, dg, 8u + (uint32_t)n) != 0) {
		rte_pktmbuf_free(m);
		w->c.tx_nombuf++;
		return;
	}
	w->c.refused_big++;
	w->txq[w->ntx++] = m;
	if (w->ntx == MCH_TX_BURST)
		tx_flush(w);
}

/* One received frame: classify it, and serve it now or hold it for its client's earlier requests.
 * 1 if the mbuf was kept (held), 0 if the caller frees it. */
static int handle_frame(struct mch_worker *w, struct rte_mbuf *m, uint64_t now)
{
	struct mch_rx rx;
	enum mch_net_rej nr = mch_net_parse(&w->net, m, &rx);
	uint64_t key;
	uint32_t big;

	w->c.net[nr]++;
	if (nr == MCH_NET_TRUNCATED && mch_net_cut_request(&w->net, m, &rx, &big) == 0)
		refuse_big(w, &rx, big);
	if (nr != MCH_NET_OK)
		return 0;
	key = client_key(&rx.from);
	if (rx.len >= 8u && mch_order_arrive(&w->order, key, (uint16_t)(rx.dg[0] << 8 | rx.dg[1]), m, now) ==
	    MCH_ORDER_HOLD)
		return 1;
	serve(w, &rx, now);
	serve_held(w, key, now);
	return 0;
}

/* ---------------------------------------------------------------- idle */

/*
 * Sleep until an answer arrives, the next batch is due, or the idle time passes:
 * --idle-us after MCH_IDLE_LOOPS empty loops, doubling with each idle sleep in a
 * row up to --idle-max-us (frames from the port cannot wake it: net_af_packet has
 * no rx interrupt, so a switched-off helper backs off instead, ~500 wake-ups a
 * second at 2 ms; the first frame after a calm waits at most that long, and the
 * kernel's ring holds it meanwhile).
 */
static void idle_sleep(struct mch_worker *w, uint64_t now)
{
	struct pollfd p[64];
	uint64_t wait = (uint64_t)w->idle_cur_us * w->hz / 1000000u, d;
	uint32_t i, n = 0;
	struct timespec ts;

	for (i = 0; i < w->nconns; i++) {
		struct mch_conn *c = &w->conns[i];

		d = mch_conn_due_in(c, now);
		if (d < wait)
			wait = d;
		if ((c->state == MCH_CONN_UP || c->state == MCH_CONN_PROBING) && n < 64u) {
			p[n].fd = c->fd;
			p[n].events = POLLIN | (c->out_tail > c->out_head ? POLLOUT : 0);
			p[n].revents = 0;
			n++;
		}
	}
	d = mch_order_due_in(&w->order, now);
	if (d < wait)
		wait = d;
	if (w->relay.live > 0 && w->relay.fd >= 0 && n < 64u) {
		p[n].fd = w->relay.fd;
		p[n].events = POLLIN;
		p[n].revents = 0;
		n++;
	}
	if (wait == 0)
		return;
	ts.tv_sec = (time_t)(wait / w->hz);
	ts.tv_nsec = (long)((wait % w->hz) * 1000000000u / w->hz);
	w->c.idle_sleeps++;
	if (ppoll(p, n, &ts, NULL) == 0 && w->idle_cur_us < w->cfg->idle_max_us)
		w->idle_cur_us = w->idle_cur_us * 2u < w->cfg->idle_max_us ? w->idle_cur_us * 2u
									   : w->cfg->idle_max_us;
}

/* ---------------------------------------------------------------- loop */

int mch_worker_main(void *arg)
{
	struct mch_worker *w = arg;
	struct rte_mbuf *bufs[MCH_RX_BURST];
	uint64_t tick = w->hz / MCH_TICK_HZ, next_tick = 0;
	uint32_t idle = 0, i, nfree;

	while (!*w->quit) {
		uint64_t now = rte_rdtsc();
		uint16_t nb = rte_eth_rx_burst(w->port, w->queue, bufs, MCH_RX_BURST);
		int did = nb > 0;

		w->c.loops++;
		if (nb > 0) {
			w->c.rx_bursts++;
			w->c.rx_frames += nb;
			for (i = 0, nfree = 0; i < nb; i++)
				if (!handle_frame(w, bufs[i], now))
					bufs[nfree++] = bufs[i];
			rte_pktmbuf_free_bulk(bufs, nfree);
			now = rte_rdtsc();
		}
		if (w->order.nheld > 0)
			did |= serve_expired(w, now);
		for (i = 0; i < w->nconns; i++)
			did |= mch_conn_poll(&w->conns[i], now);
		did |= mch_relay_poll(&w->relay, w, now);
		if (w->ntx > 0)
			tx_flush(w);
		if ((int64_t)(now - next_tick) >= 0) {
			for (i = 0; i < w->nconns; i++)
				mch_conn_tick(&w->conns[i], now);
			next_tick = now + tick;
		}
		if (did) {
			idle = 0;
			w->idle_cur_us = w->cfg->idle_us;
		} else {
			idle++;
		}
		if (w->cfg->idle_us > 0 && idle >= MCH_IDLE_LOOPS)
			idle_sleep(w, now);
	}
	serve_expired(w, rte_rdtsc() + w->order.hold + 1u); /* whatever is held goes now */
	for (i = 0; i < w->nconns; i++)
		mch_conn_close(&w->conns[i]);
	if (w->ntx > 0)
		tx_flush(w);
	return 0;
}

/* ------------------------------------------------------------- set-up */

int mch_worker_init(struct mch_worker *w, uint32_t id, const struct mch_cfg *cfg,
		    const struct mch_net_cfg *net, struct rte_mempool *mp, uint16_t port,
		    uint16_t queue, volatile int *quit)
{
	uint32_t i;

	memset(w, 0, sizeof(*w));
	w->id = id;
	w->cfg = cfg;
	w->net = *net;
	w->mp = mp;
	w->port = port;
	w->queue = queue;
	w->quit = quit;
	w->hz = rte_get_tsc_hz();
	w->idle_cur_us = cfg->idle_us;
	w->npeers = cfg->peers;
	w->peers = calloc(w->npeers, sizeof(*w->peers));
	w->nconns = cfg->conns;
	w->conns = calloc(w->nconns, sizeof(*w->conns));
	if (!w->peers || !w->conns)
		return -1;
	for (i = 0; i < w->npeers; i++)
		w->peers[i].next = i + 1u < w->npeers ? i + 1u : MCH_NO_PEER;
	w->peer_free = 0;
	mch_order_init(&w->order, (uint64_t)cfg->order_hold_us * w->hz / 1000000u);
	for (i = 0; i < w->nconns; i++)
		if (mch_conn_init(&w->conns[i], w, i) != 0)
			return -1;
	if (mch_relay_init(&w->relay, cfg->mc_ip, cfg->mc_port, w->hz) != 0)
		w->relay.fd = -1; /* counted relay_fail per request; the rest works */
	return 0;
}

void mch_worker_free(struct mch_worker *w)
{
	uint32_t i;

	for (i = 0; w->conns && i < w->nconns; i++)
		mch_conn_free(&w->conns[i]);
	mch_relay_free(&w->relay);
	if (w->nstash > 0)
		rte_pktmbuf_free_bulk(w->stash, w->nstash);
	w->nstash = 0;
	free(w->conns);
	free(w->peers);
	w->conns = NULL;
	w->peers = NULL;
}
