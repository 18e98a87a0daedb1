/*
 * mch_relay.c - the UDP relay to memcached for requests the helper does not
 * batch (see mch_relay.h).
 */
#include "mch_relay.h"

#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mc_proto.h"
#include "mch_worker.h"

#define MCH_RELAY_GAP_US 50u /* read back-off while relays wait and nothing came */

int mch_relay_init(struct mch_relay *r, uint32_t ip, uint16_t port, uint64_t hz)
{
	struct sockaddr_in sa;

	memset(r, 0, sizeof(*r));
	r->hz = hz;
	r->ttl = (uint64_t)MCH_RELAY_MS * hz / 1000u;
	r->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (r->fd < 0)
		return -1;
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_addr.s_addr = ip;
	sa.sin_port = port;
	if (connect(r->fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		close(r->fd);
		r->fd = -1;
		return -1;
	}
	return 0;
}

void mch_relay_free(struct mch_relay *r)
{
	if (r->fd >= 0)
		close(r->fd);
	r->fd = -1;
}

static uint8_t is_retrieval(const uint8_t *p, uint32_t n)
{
	return (n >= 4 && (!memcmp(p, "get ", 4) || !memcmp(p, "gat ", 4))) ||
	       (n >= 5 && (!memcmp(p, "gets ", 5) || !memcmp(p, "gats ", 5)));
}

/* Whether datagram buf[0, n) ends the answer of relay slot k (see mch_relay.h). */
static int answer_ends(const struct mch_relay *r, uint32_t k, const uint8_t *buf, ssize_t n)
{
	uint16_t seq = (uint16_t)(buf[2] << 8 | buf[3]), total = (uint16_t)(buf[4] << 8 | buf[5]);

	if (!r->s[k].one || total == 0 || seq + 1u != total)
		return 0;
	return !r->s[k].retr || (n >= (ssize_t)MCH_UDP_HDR + 5 && !memcmp(buf + n - 5, "END\r\n", 5));
}

int mch_relay_send(struct mch_relay *r, uint32_t peer, const uint8_t *dg, uint32_t len, int one_cmd,
		   uint64_t now)
{
	uint8_t hdr[MCH_UDP_HDR];
	struct iovec iov[2];
	struct msghdr mh;
	uint32_t k;

	if (r->fd < 0) {
		r->c.fail++;
		return -1;
	}
	if (!mch_req_relay_safe(dg, len)) {
		r->c.unsafe++;
		return -1;
	}
	k = r->next_id % MCH_RELAY_SLOTS;
	if (r->s[k].until != 0) {
		r->c.busy++;
		return -1;
	}
	memcpy(hdr, dg, sizeof(hdr));
	hdr[0] = (uint8_t)(r->next_id >> 8);
	hdr[1] = (uint8_t)r->next_id;
	iov[0].iov_base = hdr;
	iov[0].iov_len = sizeof(hdr);
	iov[1].iov_base = (void *)(uintptr_t)(dg + MCH_UDP_HDR);
	iov[1].iov_len = len - MCH_UDP_HDR;
	memset(&mh, 0, sizeof(mh));
	mh.msg_iov = iov;
	mh.msg_iovlen = 2;
	if (sendmsg(r->fd, &mh, MSG_DONTWAIT) < 0) {
		r->c.fail++;
		return -1;
	}
	r->s[k].until = now + r->ttl;
	r->s[k].peer = peer;
	r->s[k].id = r->next_id;
	r->s[k].rid = (uint16_t)(dg[0] << 8 | dg[1]);
	r->s[k].one = one_cmd != 0;
	r->s[k].retr = is_retrieval(dg + MCH_UDP_HDR, len - MCH_UDP_HDR);
	r->next_id++;
	r->live++;
	r->read_at = now;
	r->c.sent++;
	return 0;
}

static void expire(struct mch_relay *r, struct mch_worker *w, uint64_t now)
{
	uint32_t k;

	for (k = 0; k < MCH_RELAY_SLOTS && r->live > 0; k++) {
		if (r->s[k].until == 0 || (int64_t)(now - r->s[k].until) < 0)
			continue;
		r->s[k].until = 0;
		r->live--;
		r->c.expired++;
		mch_worker_peer_put(w, r->s[k].peer);
	}
}

int mch_relay_poll(struct mch_relay *r, struct mch_worker *w, uint64_t now)
{
	uint8_t buf[MCH_UDP_MAX + 64];
	int did = 0, i;

	if (r->live == 0 || (int64_t)(now - r->read_at) < 0)
		return 0;
	for (i = 0; i < 32; i++) {
		ssize_t n = recv(r->fd, buf, sizeof(buf), MSG_DONTWAIT);
		uint16_t id;
		uint32_t k;

		if (n < 0)
			break;
		if (n < (ssize_t)MCH_UDP_HDR)
			continue;
		id = (uint16_t)(buf[0] << 8 | buf[1]);
		k = id % MCH_RELAY_SLOTS;
		if (r->s[k].until == 0 || r->s[k].id != id) {
			r->c.late++;
			continue;
		}
		buf[0] = (uint8_t)(r->s[k].rid >> 8);
		buf[1] = (uint8_t)r->s[k].rid;
		mch_worker_reply(w, r->s[k].peer, buf, (uint32_t)n);
		r->c.replies++;
		did = 1;
		if (answer_ends(r, k, buf, n)) { /* its answer is complete: the slot is free again */
			r->s[k].until = 0;
			r->live--;
			mch_worker_peer_put(w, r->s[k].peer);
		}
	}
	if (!did)
		r->read_at = now + (uint64_t)MCH_RELAY_GAP_US * r->hz / 1000000u;
	expire(r, w, now);
	return did;
}
