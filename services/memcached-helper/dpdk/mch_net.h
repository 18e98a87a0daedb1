/*
 * mch_net.h - Ethernet/IPv4/UDP around the memcached datagrams: which
 * received frames are requests for the service, and the reply frames.
 * Knows nothing of memcached's syntax (mc_proto.c does).
 *
 *   request  eth(dst = our port MAC) / IPv4(dst = service address, not a
 *            fragment, header checksum right) / UDP(dst = service port,
 *            checksum right or 0) / memcached frame
 *   reply    eth(src = our port MAC, dst = the request's source MAC) /
 *            IPv4(src = service address, DF, TTL 64) / UDP(src = service
 *            port, dst = the client's port) / memcached frame,
 *            checksums computed in software (net_af_packet has no offload)
 *
 * The reply comes from the service's address and port: the helper answers on
 * memcached's behalf, so an unmodified client sees the source it expects.
 */
#ifndef MCH_NET_H
#define MCH_NET_H

#include <stdint.h>

#include <rte_ether.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

enum mch_net_rej {
	MCH_NET_OK = 0,
	MCH_NET_NOT_IP,     /* not IPv4 (ARP, IPv6, VLAN-tagged, ...) */
	MCH_NET_NOT_MINE,   /* destination MAC is not ours */
	MCH_NET_BAD_IP,     /* short, bad version/IHL/length, header checksum */
	MCH_NET_TRUNCATED,  /* IP length beyond the frame (larger than the rx frame size) */
	MCH_NET_FRAGMENT,   /* an IP fragment (the kernel reassembles before af_packet) */
	MCH_NET_NOT_SVC,    /* not UDP to the service address and port */
	MCH_NET_BAD_UDP,    /* UDP length wrong, source port 0 */
	MCH_NET_BAD_CSUM,   /* UDP checksum wrong (see TESTBED-NOTES: tx offload off) */
	MCH_NET__COUNT
};

struct mch_net_cfg {
	struct rte_ether_addr mac; /* our port's MAC */
	uint32_t svc_ip;           /* service address, network order */
	uint16_t svc_port;         /* service port, network order */
	uint8_t any_mac;           /* accept any destination MAC (no front door rewrite) */
	uint32_t ip_sum0, ph_sum0; /* reply checksums' constant parts (mch_net_prepare) */
};

/* The client as seen in its request: where the reply goes. */
struct mch_peer {
	struct rte_ether_addr mac;
	uint16_t port; /* network order */
	uint32_t ip;   /* network order */
	uint32_t next; /* free list link (owned by the worker) */
};

struct mch_rx {
	const uint8_t *dg; /* memcached frame (8-byte header + ASCII) */
	uint32_t len;
	struct mch_peer from;
};

/* Classify one received frame; on MCH_NET_OK rx points into the mbuf. */
enum mch_net_rej mch_net_parse(const struct mch_net_cfg *cfg, struct rte_mbuf *m,
			       struct mch_rx *rx);

/*
 * A frame mch_net_parse() called MCH_NET_TRUNCATED: is it a request for the
 * service cut to the receive frame (a datagram longer than the helper takes)?
 * 0 if so: rx holds its client and the part received (at least the 8-byte
 * memcached header), *dgram_len the datagram's real length.  -1 otherwise.
 */
int mch_net_cut_request(const struct mch_net_cfg *cfg, struct rte_mbuf *m, struct mch_rx *rx,
			uint32_t *dgram_len);

/* Once the fields above are set: the reply checksums' constant parts. */
void mch_net_prepare(struct mch_net_cfg *cfg);

/* Fill the empty mbuf m with a reply frame carrying dg[0..len) to `to`; -1 if it does not fit. */
int mch_net_reply(const struct mch_net_cfg *cfg, struct rte_mbuf *m, const struct mch_peer *to,
		  uint16_t ip_id, const uint8_t *dg, uint32_t len);

const char *mch_net_rej_name(int rej);

#endif /* MCH_NET_H */
