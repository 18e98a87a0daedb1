/*
 * mch_worker.h - one lcore of the helper: its rx/tx queue pair, its TCP
 * connections to memcached, its table of waiting clients and its counters.
 * Workers share nothing; the port's fanout hash keeps a client on one queue
 * (so on one worker), the worker keeps it on one connection.
 */
#ifndef MCH_WORKER_H
#define MCH_WORKER_H

#include <stdint.h>

#include <rte_mbuf.h>
#include <rte_mempool.h>

#include "mc_proto.h"
#include "mch_adapt.h"
#include "mch_cfg.h"
#include "mch_conn.h"
#include "mch_net.h"
#include "mch_order.h"
#include "mch_relay.h"

#define MCH_RX_BURST 32u
#define MCH_TX_BURST 32u
#define MCH_NO_PEER  UINT32_MAX

/* Counters of the worker (the protocol core has its own, struct mch_counters). */
struct mch_wctr {
	uint64_t loops, rx_bursts, rx_frames;
	uint64_t net[MCH_NET__COUNT]; /* frames by classification (net[0]: requests) */
	uint64_t drop_peers;  /* no free waiting-client slot */
	uint64_t drop_noconn; /* its connection was down (and the relay could not take it) */
	uint64_t relay_noconn; /* its connection was down: relayed to memcached's UDP port */
	uint64_t drop_busy;   /* its connection's queue or buffer was full */
	uint64_t refused_big; /* longer than a receive frame: answered SERVER_ERROR naming the limit */
	uint64_t tx_frames, tx_nombuf, tx_drop;
	uint64_t idle_sleeps;
};

struct mch_worker {
	uint32_t id;
	unsigned int lcore;
	uint16_t port, queue;
	const struct mch_cfg *cfg;
	struct mch_net_cfg net;
	struct rte_mempool *mp;
	volatile int *quit;
	uint64_t hz;
	struct mch_counters pc; /* protocol core */
	struct mch_wctr c;
	struct mch_hist hist;   /* keys per coalesced get */
	struct mch_conn *conns;
	struct mch_relay relay; /* what the parser rejects, to memcached's UDP port as it is */
	struct mch_order order; /* a client's requests in the order it numbered them (held mbufs) */
	uint32_t nconns;
	struct mch_peer *peers;
	uint32_t npeers, peer_free, peers_used;
	uint16_t ip_id;
	uint32_t idle_cur_us; /* the next idle sleep (back-off, see idle_sleep) */
	uint16_t ntx;
	struct rte_mbuf *txq[MCH_TX_BURST];
	struct rte_mbuf *stash[MCH_TX_BURST]; /* empty mbufs for replies (mch_worker_reply) */
	uint16_t nstash;
};

int mch_worker_init(struct mch_worker *w, uint32_t id, const struct mch_cfg *cfg,
		    const struct mch_net_cfg *net, struct rte_mempool *mp, uint16_t port,
		    uint16_t queue, volatile int *quit);
void mch_worker_free(struct mch_worker *w);

/* The lcore loop (rte_eal_remote_launch). */
int mch_worker_main(void *arg);

/* Called by the splitter through the connections: */
void mch_worker_reply(struct mch_worker *w, uint32_t slot, const uint8_t *dg, uint32_t len);
void mch_worker_peer_put(struct mch_worker *w, uint32_t slot);

#endif /* MCH_WORKER_H */
