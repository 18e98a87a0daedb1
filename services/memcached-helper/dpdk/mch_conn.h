/*
 * mch_conn.h - one persistent TCP connection to memcached: its open get
 * batch, the batches in flight (answered in order by the splitter of
 * mc_proto.c), its output buffer and its adaptive S and T.
 *
 * The leg to memcached uses kernel sockets.  memcached only speaks kernel
 * TCP, so its end is a kernel stack anyway; a helper has a handful of these
 * connections carrying large writes (a whole multi-get per send), so the
 * syscall cost is paid per batch, not per client request; and TCP gives the
 * in-order, lossless stream the splitter needs without a user-space TCP.
 * The fast path never blocks on it: non-blocking connect, send and recv.
 *
 * Per-client order.  A client always hashes to the same connection (and,
 * through the port's fanout hash, to the same lcore), and memcached executes
 * one connection's commands in order.  Gets wait in the open batch; a
 * forwarded command is written at once.  So a forwarded command of a client
 * that has a get in the open batch would overtake that get: the open batch
 * is closed (written) first.  Membership is a 256-bit filter of client
 * hashes (a false positive only closes a batch early).
 */
#ifndef MCH_CONN_H
#define MCH_CONN_H

#include <stdint.h>

#include "mc_proto.h"
#include "mch_adapt.h"

#define MCH_CONN_BATCHES (MCH_SPLIT_QUEUE + 1u) /* in flight + the open one */
#define MCH_CONN_OUT     (1u << 20)             /* output buffer bytes */
#define MCH_CONN_IN      (64u << 10)            /* one recv */
#define MCH_RETRY_MAX_MS 500u                   /* reconnect back-off bound */
#define MCH_PROBE_CLIENT UINT32_MAX             /* the probe's waiter: no client */
#define MCH_KEEPALIVE_STALLS 4u                 /* an idle connection is probed every 4 stall bounds */

struct mch_worker;

/*
 * DOWN -> CONNECTING -> PROBING -> UP.  PROBING: connected, a `version` sent
 * ahead of any client request; only its answer proves memcached serves (a
 * stopped memcached still completes the handshake: the kernel does).  A
 * connection that is UP or PROBING and has commands in flight must see
 * answer bytes within --stall-ms, or it is failed (waiters answered as after
 * a lost connection) and reconnected: a stalled leg never holds clients.
 */
enum mch_conn_state {
	MCH_CONN_DOWN = 0, MCH_CONN_CONNECTING = 1, MCH_CONN_UP = 2, MCH_CONN_PROBING = 3
};

/* why a connection last went down (stats file: conn_*_why, down_reason) */
enum mch_down {
	MCH_DOWN_NONE = 0,
	MCH_DOWN_NO_ANSWERS,  /* commands in flight, no answer byte for --stall-ms, data acknowledged */
	MCH_DOWN_UNACKED,     /* ... and memcached's host has not acknowledged our data either */
	MCH_DOWN_PROBE,       /* the probe after connecting was not answered in --stall-ms */
	MCH_DOWN_CONNECT,     /* connect refused, failed or timed out */
	MCH_DOWN_CLOSED,      /* EOF or a socket error */
	MCH_DOWN_PROTO,       /* memcached's answer did not parse (enum mch_err) */
	MCH_DOWN__COUNT
};

const char *mch_down_name(int why);

/* why a request could not be queued */
enum mch_conn_drop {
	MCH_CDROP_NONE = 0,
	MCH_CDROP_NOCONN, /* the connection is not up */
	MCH_CDROP_BUSY,   /* in-flight queue or output buffer full */
	MCH_CDROP_BIG,    /* cannot fit even an empty batch (cannot happen for parsed requests) */
};

struct mch_conn_ctr {
	uint64_t connects, connect_fails, disconnects;
	uint64_t bytes_out, bytes_in;
	uint64_t stalls;      /* failed for want of answers (MCH_DOWN_NO_ANSWERS, _UNACKED, _PROBE) */
	uint64_t probes;      /* probes answered */
	uint64_t keepalives;  /* probes sent on an idle connection (MCH_KEEPALIVE_STALLS) */
	uint64_t reads, reads_empty; /* recv calls on the TCP leg; those that found nothing (EAGAIN) */
	uint64_t get_cmds, pass_cmds;
	uint64_t close_size;  /* batches sent because they reached S */
	uint64_t close_time;  /* ... because T had passed */
	uint64_t close_full;  /* ... because the next request did not fit */
	uint64_t close_order; /* ... to keep a client's order (forwarded command) */
};

struct mch_conn {
	struct mch_worker *w;
	uint32_t id;
	int fd;
	volatile uint8_t state; /* enum mch_conn_state, read by the stats thread */
	uint64_t retry_at;      /* DOWN: next connect attempt (tsc) */
	uint64_t conn_start;    /* CONNECTING: since (tsc) */
	uint64_t progress_at;   /* last answer byte, or when the first command in flight was pushed (tsc) */
	uint64_t stall_ticks;   /* --stall-ms in tsc ticks */
	uint32_t retry_cur_ms;  /* reconnect delay now: --retry-ms, doubled per failure up to MCH_RETRY_MAX_MS */
	uint8_t aborting;       /* inside mch_split_abort (a probe completed there was not answered) */
	volatile uint8_t why;   /* enum mch_down: the last reason it went down */
	volatile uint32_t why_unacked;   /* bytes unacknowledged by memcached's host then (TCP_INFO) */
	volatile uint32_t why_backoff;   /* its retransmission back-off count then */
	volatile uint32_t why_waited_ms; /* how long the oldest command had waited for an answer */
	volatile uint64_t down_tsc;      /* when it went down */
	struct mch_split sp;
	struct mch_batch *open;   /* open get batch, NULL if none */
	uint64_t open_filter[4];  /* client hashes in it */
	struct mch_batch *pool[MCH_CONN_BATCHES];
	uint32_t npool;
	struct mch_batch *all[MCH_CONN_BATCHES];
	uint8_t *out;
	uint32_t out_head, out_tail; /* bytes [head, tail) still to send */
	uint8_t *in;
	struct mch_adapt ad;       /* S in bytes, T in tsc ticks */
	uint64_t last_send;        /* tsc of the previous batch */
	uint64_t read_at;          /* tsc before which the fast path does not read (mch_conn_poll) */
	uint64_t read_gap;         /* the back-off after the last empty read, tsc ticks; 0 after data */
	uint64_t read_gap_lo, read_gap_hi; /* MCH_READ_GAP_MIN_NS, _MAX_NS in tsc ticks */
	uint64_t hz;               /* tsc ticks per second */
	struct mch_conn_ctr c;
};

int mch_conn_init(struct mch_conn *c, struct mch_worker *w, uint32_t id);
void mch_conn_free(struct mch_conn *c);

/* Queue a get/gets of client `slot` (hash `ch`).  enum mch_conn_drop. */
int mch_conn_get(struct mch_conn *c, const struct mch_req *r, uint32_t slot, uint32_t ch,
		 uint64_t now);

/* Queue a forwarded command of client `slot` (hash `ch`).  enum mch_conn_drop. */
int mch_conn_pass(struct mch_conn *c, const struct mch_req *r, uint32_t slot, uint32_t ch,
		  uint64_t now);

/*
 * Fast path, every loop: send the open batch when due, write what is
 * buffered, read answers.  Returns non-zero when it did any work.
 *
 * Reads back off: a read that found nothing (memcached still working on a
 * batch) waits MCH_READ_GAP_MIN_NS before the next, doubling up to
 * MCH_READ_GAP_MAX_NS; a read that found data reads again at once.  Each
 * empty recv() is a system call that takes the socket's lock: read on every
 * loop, a capped helper spent 0.17 of them per frame (bench/helper_throughput.py).
 */
#define MCH_READ_GAP_MIN_NS 2000u
#define MCH_READ_GAP_MAX_NS 16000u
int mch_conn_poll(struct mch_conn *c, uint64_t now);

/* Slow path, about every millisecond: connect, reconnect, notice EOF. */
void mch_conn_tick(struct mch_conn *c, uint64_t now);

/* Ticks until the open batch is due (0: due or none open; UINT64_MAX: none). */
uint64_t mch_conn_due_in(const struct mch_conn *c, uint64_t now);

/* Whether a new client request would be taken (UP); DOWN/CONNECTING/PROBING drop it (drop_noconn). */
static inline int mch_conn_serving(const struct mch_conn *c)
{
	return c->state == MCH_CONN_UP;
}

/* Shut down: waiters still waiting are answered as after a lost connection. */
void mch_conn_close(struct mch_conn *c);

#endif /* MCH_CONN_H */
