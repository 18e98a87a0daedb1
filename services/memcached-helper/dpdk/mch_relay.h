/*
 * mch_relay.h - requests the helper does not batch, relayed to memcached's own
 * UDP port as they are, and memcached's answers relayed back (issue 43).
 *
 * What the parser rejects (an unknown command, a bad key, a set whose data
 * block is longer than declared, several commands in one datagram, ...) is
 * still a request memcached answers, with ERROR, CLIENT_ERROR ..., or more: a
 * client must get exactly that answer, framed as memcached frames it.  The
 * helper cannot put such a request on its shared TCP connections (memcached's
 * answer may not be one line, or its parser may fall out of step), so it sends
 * the datagram over a UDP socket of its own, its request id replaced by a
 * relay id, and sends every datagram memcached answers under that id to the
 * client with the client's request id back in place, byte for byte otherwise.
 * A datagram that could leave memcached's shared UDP parser waiting for more
 * bytes (mch_req_relay_safe) is never relayed: dropped and counted, as before.
 *
 *   client --UDP--> helper --UDP (rid := relay id)--> memcached
 *   client <--UDP-- helper <--UDP (rid == relay id)-- memcached
 *
 * A relay of one parsed command (a request relayed because its connection was
 * down) ends with memcached's answer: the last datagram of a message
 * (seq == total - 1) that, for a retrieval, ends in END (memcached sends a
 * multi-get one datagram per key); otherwise it lives MCH_RELAY_MS (memcached
 * answers in well under that, or never: an incomplete last line).  It holds
 * one waiting-client slot of the worker meanwhile; with every one of the
 * MCH_RELAY_SLOTS slots live, a new request to relay is dropped (relay_busy).
 * (Ending relays at their answer, not only at MCH_RELAY_MS, is what lets the
 * relay carry a helper's load while its connection is down, issue 43: 256
 * slots held 200 ms each took only 1,280 requests a second.)
 */
#ifndef MCH_RELAY_H
#define MCH_RELAY_H

#include <stdint.h>

#define MCH_RELAY_SLOTS 256u
#define MCH_RELAY_MS    200u

struct mch_worker;

struct mch_relay_ctr {
	uint64_t sent, unsafe, busy, fail, replies, late, expired;
};

struct mch_relay {
	int fd;                 /* UDP socket connected to memcached's UDP port; -1 if none */
	uint16_t next_id;
	uint32_t live;          /* slots in use */
	uint64_t hz, ttl;       /* ticks per second, MCH_RELAY_MS in ticks */
	uint64_t read_at;       /* next read (tsc): reads back off while nothing comes */
	struct {
		uint64_t until; /* tsc; 0: free */
		uint32_t peer;  /* the worker's waiting-client slot (where answers go) */
		uint16_t id;    /* relay id sent to memcached */
		uint16_t rid;   /* the client's request id */
		uint8_t one;    /* one parsed command: its answer may end the relay */
		uint8_t retr;   /* a retrieval (get/gets/gat/gats): its answer ends in END */
	} s[MCH_RELAY_SLOTS];
	struct mch_relay_ctr c;
};

/* Open the socket to ip:port (network order).  0, or -1 (errno) — the helper then drops such requests. */
int mch_relay_init(struct mch_relay *r, uint32_t ip, uint16_t port, uint64_t hz);
void mch_relay_free(struct mch_relay *r);

/*
 * Relay the client datagram dg[0, len) of the client in waiting slot `peer`;
 * `one_cmd`: the parser took it as one command (so its answer is one message).
 * 0 if sent (the slot is then the relay's until it expires), -1 if not (the
 * caller frees the slot; counted unsafe, busy or fail).
 */
int mch_relay_send(struct mch_relay *r, uint32_t peer, const uint8_t *dg, uint32_t len, int one_cmd,
		   uint64_t now);

/* Fast path, every loop: read memcached's answers, reply to their clients, expire old relays.  1 if work done. */
int mch_relay_poll(struct mch_relay *r, struct mch_worker *w, uint64_t now);

#endif /* MCH_RELAY_H */
