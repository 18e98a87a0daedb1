/*
 * mch_blast.c - a raw memcached UDP get generator for throughput runs
 * (bench/helper_throughput.py): single-key `get` frames, sent on an
 * interface through AF_PACKET (sendmmsg, qdisc bypass) as fast as it can or
 * at a given rate, for a given time.  Plain C, no DPDK, no memcached code:
 * the frames are built once, before the clock starts.
 *
 *   mch_blast --iface IF --dst-mac MAC [--src-mac MAC] --dst IP[:PORT] \
 *             [--src-ip IP] [--ports N] [--keys N] [--prefix P] \
 *             [--duration S] [--rate PPS] [--batch N]
 *
 * The frames are what a Linux memcached UDP client sends (IPv4 header
 * checksum, UDP checksum, memcached's 8-byte frame header, "get KEY\r\n"),
 * from N source ports and K keys.  Their source MAC is --src-mac, by default
 * a locally administered one that is not the interface's: the device under
 * test answers (or io-forwards) to that MAC, so the generator's kernel drops
 * the returning frames as "other host" before IP, for a helper's replies and
 * for testpmd's forwarded frames alike; the bench counts them on the
 * interface (rx_packets), not through a socket.
 *
 * Prints one JSON line: frames sent, seconds, frames per second, send errors.
 */
#define _GNU_SOURCE /* sendmmsg */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define NFRAMES   8192u /* distinct frames, cycled */
#define FRAME_MAX 320u
#define BATCH_MAX 256u

struct opts {
	const char *iface, *prefix;
	uint8_t dst_mac[6], src_mac[6];
	uint32_t dst_ip, src_ip; /* network order */
	uint16_t dst_port;
	uint32_t ports, keys, batch;
	double duration, rate;
};

static void usage(void)
{
	fprintf(stderr,
		"usage: mch_blast --iface IF --dst-mac MAC --dst IP[:PORT] [options]\n"
		"  --src-mac MAC   source MAC of the frames (02:00:00:00:00:01: not the interface's,\n"
		"                  so what comes back is dropped before IP)\n"
		"  --src-ip IP     source address (10.77.0.11)\n"
		"  --ports N       distinct UDP source ports, from 20000 (256)\n"
		"  --keys N        distinct keys PREFIX0..PREFIX<N-1> (1000)\n"
		"  --prefix P      key prefix (k)\n"
		"  --duration S    seconds to send (2)\n"
		"  --rate PPS      frames per second (0: as fast as possible, the default)\n"
		"  --batch N       frames per sendmmsg, 1..%u (64)\n",
		BATCH_MAX);
	exit(2);
}

static void die(const char *what, const char *arg)
{
	fprintf(stderr, "mch_blast: %s%s%s\n", what, arg ? ": " : "", arg ? arg : "");
	exit(2);
}

static void parse_mac(const char *s, uint8_t *mac)
{
	unsigned int b[6];
	int i;

	if (sscanf(s, "%x:%x:%x:%x:%x:%x", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]) != 6)
		die("not a MAC address (aa:bb:cc:dd:ee:ff)", s);
	for (i = 0; i < 6; i++) {
		if (b[i] > 255)
			die("not a MAC address (aa:bb:cc:dd:ee:ff)", s);
		mac[i] = (uint8_t)b[i];
	}
}

static uint32_t parse_u32(const char *s, uint32_t lo, uint32_t hi, const char *name)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(s, &end, 10);
	if (errno || *end || end == s || v < lo || v > hi) {
		fprintf(stderr, "mch_blast: %s %s: expected an integer in %u..%u\n", name, s, lo, hi);
		exit(2);
	}
	return (uint32_t)v;
}

static void parse_args(int argc, char **argv, struct opts *o)
{
	int i;
	int have_dmac = 0;

	memset(o, 0, sizeof(*o));
	parse_mac("02:00:00:00:00:01", o->src_mac);
	o->src_ip = inet_addr("10.77.0.11");
	o->dst_port = htons(11211);
	o->ports = 256;
	o->keys = 1000;
	o->prefix = "k";
	o->duration = 2;
	o->batch = 64;
	for (i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--help") || !strcmp(a, "-h"))
			usage();
		if (v == NULL)
			die("option needs a value", a);
		i++;
		if (!strcmp(a, "--iface")) {
			o->iface = v;
		} else if (!strcmp(a, "--dst-mac")) {
			parse_mac(v, o->dst_mac);
			have_dmac = 1;
		} else if (!strcmp(a, "--src-mac")) {
			parse_mac(v, o->src_mac);
		} else if (!strcmp(a, "--dst")) {
			char host[64];
			const char *c = strchr(v, ':');
			size_t n = c ? (size_t)(c - v) : strlen(v);
			struct in_addr in;

			if (n == 0 || n >= sizeof(host))
				die("--dst expects IP[:PORT]", v);
			memcpy(host, v, n);
			host[n] = '\0';
			if (inet_pton(AF_INET, host, &in) != 1)
				die("--dst: not an IPv4 address", v);
			o->dst_ip = in.s_addr;
			if (c)
				o->dst_port = htons((uint16_t)parse_u32(c + 1, 1, 65535, "--dst port"));
		} else if (!strcmp(a, "--src-ip")) {
			struct in_addr in;

			if (inet_pton(AF_INET, v, &in) != 1)
				die("--src-ip: not an IPv4 address", v);
			o->src_ip = in.s_addr;
		} else if (!strcmp(a, "--ports")) {
			o->ports = parse_u32(v, 1, 40000, "--ports");
		} else if (!strcmp(a, "--keys")) {
			o->keys = parse_u32(v, 1, 10000000, "--keys");
		} else if (!strcmp(a, "--prefix")) {
			if (strlen(v) > 200)
				die("--prefix longer than 200 bytes", v);
			o->prefix = v;
		} else if (!strcmp(a, "--duration")) {
			o->duration = atof(v);
			if (!(o->duration > 0 && o->duration <= 3600))
				die("--duration must be in (0, 3600] seconds", v);
		} else if (!strcmp(a, "--rate")) {
			o->rate = atof(v);
			if (!(o->rate >= 0))
				die("--rate must be >= 0 (0: as fast as possible)", v);
		} else if (!strcmp(a, "--batch")) {
			o->batch = parse_u32(v, 1, BATCH_MAX, "--batch");
		} else {
			die("unknown option (see --help)", a);
		}
	}
	if (!o->iface || !have_dmac || !o->dst_ip)
		die("--iface, --dst-mac and --dst are required (see --help)", NULL);
}

static uint32_t csum_add(uint32_t s, const uint8_t *p, size_t n)
{
	size_t i;

	for (i = 0; i + 1 < n; i += 2)
		s += (uint32_t)(p[i] << 8 | p[i + 1]);
	if (n & 1)
		s += (uint32_t)p[n - 1] << 8;
	return s;
}

static uint16_t csum_fold(uint32_t s)
{
	while (s >> 16)
		s = (s & 0xffffu) + (s >> 16);
	return (uint16_t)~s;
}

/* One request frame into buf; its length. */
static size_t build(const struct opts *o, uint32_t i, uint8_t *buf)
{
	uint8_t *ip = buf + 14, *udp = ip + 20, *dg = udp + 8;
	uint32_t key = (i * 7919u) % o->keys, s;
	uint16_t sport = (uint16_t)(20000u + i % o->ports), rid = (uint16_t)(i + 1u);
	int n = snprintf((char *)dg + 8, FRAME_MAX - 14 - 20 - 8 - 8, "get %s%u\r\n", o->prefix,
			 key);
	size_t ulen = 8u + 8u + (size_t)n, tot = 20u + ulen;
	uint16_t v;

	memcpy(buf, o->dst_mac, 6);
	memcpy(buf + 6, o->src_mac, 6);
	buf[12] = 0x08;
	buf[13] = 0x00;
	/* memcached frame header: request id, seq 0, total 1, reserved */
	dg[0] = (uint8_t)(rid >> 8);
	dg[1] = (uint8_t)rid;
	memset(dg + 2, 0, 6);
	dg[5] = 1;
	/* IPv4 */
	memset(ip, 0, 20);
	ip[0] = 0x45;
	ip[2] = (uint8_t)(tot >> 8);
	ip[3] = (uint8_t)tot;
	ip[4] = (uint8_t)(i >> 8);
	ip[5] = (uint8_t)i;
	ip[6] = 0x40; /* DF */
	ip[8] = 64;
	ip[9] = 17;
	memcpy(ip + 12, &o->src_ip, 4);
	memcpy(ip + 16, &o->dst_ip, 4);
	v = csum_fold(csum_add(0, ip, 20));
	ip[10] = (uint8_t)(v >> 8);
	ip[11] = (uint8_t)v;
	/* UDP with its checksum, as the kernel of a real client computes it */
	udp[0] = (uint8_t)(sport >> 8);
	udp[1] = (uint8_t)sport;
	memcpy(udp + 2, &o->dst_port, 2);
	udp[4] = (uint8_t)(ulen >> 8);
	udp[5] = (uint8_t)ulen;
	udp[6] = udp[7] = 0;
	s = csum_add(0, ip + 12, 8); /* pseudo header: addresses, protocol, length */
	s += 17u + (uint32_t)ulen;
	s = csum_add(s, udp, ulen);
	v = csum_fold(s);
	if (v == 0)
		v = 0xffff;
	udp[6] = (uint8_t)(v >> 8);
	udp[7] = (uint8_t)v;
	return 14u + tot;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	static uint8_t frames[NFRAMES][FRAME_MAX];
	static struct iovec iov[NFRAMES];
	static struct mmsghdr msgs[BATCH_MAX];
	struct opts o;
	struct sockaddr_ll sll;
	uint64_t sent = 0, errs = 0, pos = 0;
	double t0, t, end;
	int fd, one = 1;
	uint32_t i;

	parse_args(argc, argv, &o);
	for (i = 0; i < NFRAMES; i++) {
		iov[i].iov_base = frames[i];
		iov[i].iov_len = build(&o, i, frames[i]);
	}
	fd = socket(AF_PACKET, SOCK_RAW, 0); /* protocol 0: send only, nothing is received */
	if (fd < 0)
		die("socket(AF_PACKET) failed (needs root)", strerror(errno));
	memset(&sll, 0, sizeof(sll));
	sll.sll_family = AF_PACKET;
	sll.sll_ifindex = (int)if_nametoindex(o.iface);
	if (sll.sll_ifindex == 0)
		die("no such interface in this namespace", o.iface);
	if (bind(fd, (struct sockaddr *)&sll, sizeof(sll)) != 0)
		die("bind to the interface failed", strerror(errno));
	/* straight to the driver: no qdisc between the generator and the veth */
	setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof(one));

	t0 = now_s();
	end = t0 + o.duration;
	for (t = t0; t < end; t = now_s()) {
		uint32_t n = o.batch, k;
		int r;

		if (o.rate > 0) {
			double due = (t - t0) * o.rate - (double)sent;

			if (due < 1.0) {
				struct timespec ts = {0, 20000};

				nanosleep(&ts, NULL);
				continue;
			}
			if (due < n)
				n = (uint32_t)due;
		}
		for (k = 0; k < n; k++) {
			memset(&msgs[k].msg_hdr, 0, sizeof(msgs[k].msg_hdr));
			msgs[k].msg_hdr.msg_iov = &iov[(pos + k) % NFRAMES];
			msgs[k].msg_hdr.msg_iovlen = 1;
		}
		r = sendmmsg(fd, msgs, n, 0);
		if (r > 0) {
			sent += (uint64_t)r;
			pos += (uint64_t)r;
		} else if (r < 0) {
			errs++;
			if (errno != ENOBUFS && errno != EAGAIN && errno != EINTR)
				die("sendmmsg failed", strerror(errno));
		}
	}
	t = now_s() - t0;
	close(fd);
	printf("{\"sent\": %llu, \"elapsed_s\": %.4f, \"pps\": %.1f, \"send_errors\": %llu}\n",
	       (unsigned long long)sent, t, (double)sent / t, (unsigned long long)errs);
	return 0;
}
