/*
 * mch_net.c - request frame classification and reply frame building.
 * See mch_net.h for the frames.  net_af_packet hands over one frame per mbuf
 * (one segment), so headers are read in place.
 */
#include "mch_net.h"

#include <string.h>

#include <rte_byteorder.h>
#include <rte_ip.h>
#include <rte_udp.h>

#include "mch_csum.h"

#define MCH_REPLY_TTL 64

enum mch_net_rej mch_net_parse(const struct mch_net_cfg *cfg, struct rte_mbuf *m,
			       struct mch_rx *rx)
{
	uint32_t n = rte_pktmbuf_data_len(m), ihl, tot, ulen;
	const struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, const struct rte_ether_hdr *);
	const struct rte_ipv4_hdr *ip;
	const struct rte_udp_hdr *udp;

	if (n < sizeof(*eth))
		return MCH_NET_NOT_IP;
	if (!cfg->any_mac && !rte_is_same_ether_addr(&eth->dst_addr, &cfg->mac))
		return MCH_NET_NOT_MINE;
	if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4))
		return MCH_NET_NOT_IP;
	n -= sizeof(*eth);
	ip = (const struct rte_ipv4_hdr *)(eth + 1);
	if (n < sizeof(*ip) || (ip->version_ihl >> 4) != 4)
		return MCH_NET_BAD_IP;
	ihl = (ip->version_ihl & 0x0fu) * 4u;
	tot = rte_be_to_cpu_16(ip->total_length);
	if (ihl < sizeof(*ip) || ihl > n || tot < ihl)
		return MCH_NET_BAD_IP;
	if (mch_csum(ip, ihl) != 0xffff)
		return MCH_NET_BAD_IP;
	if (tot > n)
		return MCH_NET_TRUNCATED;
	if (ip->fragment_offset &
	    rte_cpu_to_be_16(RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK))
		return MCH_NET_FRAGMENT;
	if (ip->next_proto_id != IPPROTO_UDP || ip->dst_addr != cfg->svc_ip)
		return MCH_NET_NOT_SVC;
	if (tot - ihl < sizeof(*udp))
		return MCH_NET_BAD_UDP;
	udp = (const struct rte_udp_hdr *)((const uint8_t *)ip + ihl);
	if (udp->dst_port != cfg->svc_port)
		return MCH_NET_NOT_SVC;
	ulen = rte_be_to_cpu_16(udp->dgram_len);
	if (ulen != tot - ihl || udp->src_port == 0)
		return MCH_NET_BAD_UDP;
	/* a right checksum makes the sum over pseudo-header, header and data 0xffff */
	if (udp->dgram_cksum != 0 &&
	    mch_csum_fold((uint64_t)rte_ipv4_phdr_cksum(ip, 0) + mch_csum(udp, ulen)) != 0xffff)
		return MCH_NET_BAD_CSUM;
	rx->dg = (const uint8_t *)(udp + 1);
	rx->len = ulen - (uint32_t)sizeof(*udp);
	rte_ether_addr_copy(&eth->src_addr, &rx->from.mac);
	rx->from.ip = ip->src_addr;
	rx->from.port = udp->src_port;
	return MCH_NET_OK;
}

int mch_net_cut_request(const struct mch_net_cfg *cfg, struct rte_mbuf *m, struct mch_rx *rx,
			uint32_t *dgram_len)
{
	uint32_t n = rte_pktmbuf_data_len(m), ihl, tot;
	const struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, const struct rte_ether_hdr *);
	const struct rte_ipv4_hdr *ip = (const struct rte_ipv4_hdr *)(eth + 1);
	const struct rte_udp_hdr *udp;

	/* mch_net_parse checked the Ethernet and IPv4 headers and that tot > what is here */
	ihl = (ip->version_ihl & 0x0fu) * 4u;
	tot = rte_be_to_cpu_16(ip->total_length);
	if (ip->fragment_offset & rte_cpu_to_be_16(RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK))
		return -1;
	if (ip->next_proto_id != IPPROTO_UDP || ip->dst_addr != cfg->svc_ip)
		return -1;
	if (n < sizeof(*eth) + ihl + sizeof(*udp) + 8u)
		return -1;
	udp = (const struct rte_udp_hdr *)((const uint8_t *)ip + ihl);
	if (udp->dst_port != cfg->svc_port || udp->src_port == 0 ||
	    rte_be_to_cpu_16(udp->dgram_len) != tot - ihl)
		return -1;
	rx->dg = (const uint8_t *)(udp + 1);
	rx->len = n - (uint32_t)(sizeof(*eth) + ihl + sizeof(*udp));
	*dgram_len = tot - ihl - (uint32_t)sizeof(*udp);
	rte_ether_addr_copy(&eth->src_addr, &rx->from.mac);
	rx->from.ip = ip->src_addr;
	rx->from.port = udp->src_port;
	return 0;
}

void mch_net_prepare(struct mch_net_cfg *cfg)
{
	struct rte_ipv4_hdr t;

	/* the reply's IPv4 header with its per-reply fields (length, id, destination, checksum) 0 */
	memset(&t, 0, sizeof(t));
	t.version_ihl = RTE_IPV4_VHL_DEF;
	t.fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
	t.time_to_live = MCH_REPLY_TTL;
	t.next_proto_id = IPPROTO_UDP;
	t.src_addr = cfg->svc_ip;
	cfg->ip_sum0 = mch_csum(&t, sizeof(t));
	/* the UDP pseudo-header's source and protocol */
	cfg->ph_sum0 = mch_csum(&cfg->svc_ip, sizeof(cfg->svc_ip)) + rte_cpu_to_be_16(IPPROTO_UDP);
}

int mch_net_reply(const struct mch_net_cfg *cfg, struct rte_mbuf *m, const struct mch_peer *to,
		  uint16_t ip_id, const uint8_t *dg, uint32_t len)
{
	const uint32_t hdrs = sizeof(struct rte_ether_hdr) + sizeof(struct rte_ipv4_hdr) +
			      sizeof(struct rte_udp_hdr);
	struct rte_ether_hdr *eth;
	struct rte_ipv4_hdr *ip;
	struct rte_udp_hdr *udp;
	uint64_t sum;
	uint16_t cksum;

	eth = (struct rte_ether_hdr *)rte_pktmbuf_append(m, (uint16_t)(hdrs + len));
	if (eth == NULL)
		return -1;
	rte_ether_addr_copy(&to->mac, &eth->dst_addr);
	rte_ether_addr_copy(&cfg->mac, &eth->src_addr);
	eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);

	ip = (struct rte_ipv4_hdr *)(eth + 1);
	ip->version_ihl = RTE_IPV4_VHL_DEF;
	ip->type_of_service = 0;
	ip->total_length = rte_cpu_to_be_16((uint16_t)(sizeof(*ip) + sizeof(*udp) + len));
	ip->packet_id = rte_cpu_to_be_16(ip_id);
	ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
	ip->time_to_live = MCH_REPLY_TTL;
	ip->next_proto_id = IPPROTO_UDP;
	ip->src_addr = cfg->svc_ip;
	ip->dst_addr = to->ip;
	/* the constant fields' sum (mch_net_prepare) plus this reply's; summed as stored (RFC 1071 §2(B)) */
	ip->hdr_checksum = (uint16_t)~mch_csum_fold((uint64_t)cfg->ip_sum0 + ip->total_length +
						   ip->packet_id + (to->ip & 0xffffu) + (to->ip >> 16));

	udp = (struct rte_udp_hdr *)(ip + 1);
	udp->src_port = cfg->svc_port;
	udp->dst_port = to->port;
	udp->dgram_len = rte_cpu_to_be_16((uint16_t)(sizeof(*udp) + len));
	/*
	 * The data summed as it is copied; then the pseudo-header (source and protocol from
	 * mch_net_prepare, the destination, the UDP length) and the header (checksum field 0,
	 * the length again).
	 */
	sum = mch_csum_copy(udp + 1, dg, len);
	sum += (uint64_t)cfg->ph_sum0 + (to->ip & 0xffffu) + (to->ip >> 16) +
	       2u * (uint32_t)udp->dgram_len + udp->src_port + udp->dst_port;
	cksum = (uint16_t)~mch_csum_fold(sum);
	udp->dgram_cksum = cksum == 0 ? 0xffff : cksum; /* 0 means "no checksum" in UDP */
	return 0;
}

const char *mch_net_rej_name(int rej)
{
	static const char *const n[MCH_NET__COUNT] = {
		"ok", "not_ip", "not_mine", "bad_ip", "truncated", "fragment", "not_svc",
		"bad_udp", "bad_csum",
	};

	return rej >= 0 && rej < MCH_NET__COUNT ? n[rej] : "?";
}
