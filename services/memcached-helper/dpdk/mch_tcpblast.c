/*
 * mch_tcpblast.c - an open-loop memcached TCP get generator (bench/helper_burst.py's
 * twemproxy path): single-key `get` commands at a fixed total rate, spread over N
 * connections and pipelined (a connection never waits for an answer before its
 * next get), for a given time.  Plain C, no memcached code beyond "get KEY\r\n"
 * and counting the "END\r\n" that closes each answer.
 *
 *   mch_tcpblast --dst IP:PORT [--conns N] [--keys N] [--prefix P]
 *                [--rate GETS] [--duration S] [--from S] [--to S] [--backlog N]
 *
 * TCP loses nothing, so past the server's capacity answers simply lag; a
 * client would give up on a get after its timeout.  --backlog bounds the gets
 * a connection may have unanswered: a get due while it is full is not sent
 * (counted "skipped"), as a client that has timed out on its backlog would
 * stop piling on.  The gets sent and answered between --from and --to seconds
 * are counted on their own (the bench's measurement window).
 *
 * Prints one JSON line.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CONNS_MAX 512
#define OUT_MAX   65536

struct conn {
	int fd;
	char out[OUT_MAX];
	size_t out_len;
	uint64_t unanswered;
	int match; /* bytes of "END\r\n" matched so far */
};

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int fcntl_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL, 0);

	return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void die(const char *what, const char *v)
{
	fprintf(stderr, "mch_tcpblast: %s%s%s\n", what, v ? ": " : "", v ? v : "");
	exit(2);
}

int main(int argc, char **argv)
{
	static struct conn c[CONNS_MAX];
	static const char end[] = "END\r\n";
	const char *dst = NULL, *prefix = "k";
	unsigned conns = 64, keys = 1000, backlog = 2000, i;
	double rate = 10000, duration = 3, from = 0, to = 1e9, t0, t;
	uint64_t sent = 0, answered = 0, skipped = 0, w_sent = 0, w_answered = 0, w_skipped = 0, errors = 0;
	struct sockaddr_in sa;
	char buf[65536], host[64];
	struct pollfd pf[CONNS_MAX];

	for (i = 1; i < (unsigned)argc; i++) {
		const char *a = argv[i], *v = i + 1 < (unsigned)argc ? argv[i + 1] : NULL;

		if (!v)
			die("missing value for", a);
		if (!strcmp(a, "--dst"))
			dst = v;
		else if (!strcmp(a, "--conns"))
			conns = (unsigned)atoi(v);
		else if (!strcmp(a, "--keys"))
			keys = (unsigned)atoi(v);
		else if (!strcmp(a, "--prefix"))
			prefix = v;
		else if (!strcmp(a, "--rate"))
			rate = atof(v);
		else if (!strcmp(a, "--duration"))
			duration = atof(v);
		else if (!strcmp(a, "--from"))
			from = atof(v);
		else if (!strcmp(a, "--to"))
			to = atof(v);
		else if (!strcmp(a, "--backlog"))
			backlog = (unsigned)atoi(v);
		else
			die("unknown option (see the comment at the top of mch_tcpblast.c)", a);
		i++;
	}
	if (!dst || conns == 0 || conns > CONNS_MAX || keys == 0 || rate <= 0 || strlen(prefix) > 200)
		die("need --dst IP:PORT, --conns 1..512, --keys >= 1, --rate > 0, --prefix up to 200 bytes", NULL);
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	if (sscanf(dst, "%63[^:]:%hu", host, &sa.sin_port) != 2 || inet_pton(AF_INET, host, &sa.sin_addr) != 1)
		die("--dst must be IPv4:PORT", dst);
	sa.sin_port = htons(sa.sin_port);
	for (i = 0; i < conns; i++) {
		int one = 1;

		c[i].fd = socket(AF_INET, SOCK_STREAM, 0);
		if (c[i].fd < 0 || connect(c[i].fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
			die("cannot connect", dst);
		setsockopt(c[i].fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		if (fcntl_nonblock(c[i].fd) != 0)
			die("cannot make a socket non-blocking", NULL);
		pf[i].fd = c[i].fd;
	}
	t0 = now_s();
	for (t = t0; t - t0 < duration; t = now_s()) {
		double el = t - t0;
		uint64_t due = (uint64_t)(el * rate);
		int in_window = el >= from && el < to;

		/* open loop: every get that is due is sent (round robin over the connections) */
		while (sent + skipped < due) {
			struct conn *k = &c[(sent + skipped) % conns];
			int n;

			if (k->unanswered >= backlog || k->out_len + 220 > OUT_MAX) {
				skipped++;
				w_skipped += in_window;
				continue;
			}
			n = snprintf(k->out + k->out_len, OUT_MAX - k->out_len, "get %s%u\r\n", prefix,
				     (unsigned)((sent * 2654435761u) % keys));
			k->out_len += (size_t)n;
			k->unanswered++;
			sent++;
			w_sent += in_window;
		}
		for (i = 0; i < conns; i++) {
			pf[i].events = POLLIN | (c[i].out_len ? POLLOUT : 0);
			pf[i].revents = 0;
		}
		if (poll(pf, conns, 1) < 0 && errno != EINTR)
			die("poll failed", NULL);
		for (i = 0; i < conns; i++) {
			struct conn *k = &c[i];
			ssize_t r;

			if ((pf[i].revents & POLLOUT) && k->out_len) {
				r = send(k->fd, k->out, k->out_len, MSG_DONTWAIT | MSG_NOSIGNAL);
				if (r > 0) {
					memmove(k->out, k->out + r, k->out_len - (size_t)r);
					k->out_len -= (size_t)r;
				} else if (r < 0 && errno != EAGAIN) {
					errors++;
				}
			}
			if (pf[i].revents & (POLLIN | POLLERR | POLLHUP)) {
				r = recv(k->fd, buf, sizeof(buf), MSG_DONTWAIT);
				if (r == 0 || (r < 0 && errno != EAGAIN)) {
					errors++;
					continue;
				}
				for (ssize_t j = 0; j < r; j++) {
					k->match = buf[j] == end[k->match] ? k->match + 1 : (buf[j] == 'E');
					if (k->match == 5) {
						k->match = 0;
						k->unanswered--;
						answered++;
						w_answered += in_window;
					}
				}
			}
		}
	}
	printf("{\"sent\": %llu, \"answered\": %llu, \"skipped\": %llu, \"window_sent\": %llu, "
	       "\"window_answered\": %llu, \"window_skipped\": %llu, \"errors\": %llu, \"elapsed_s\": %.4f}\n",
	       (unsigned long long)sent, (unsigned long long)answered, (unsigned long long)skipped,
	       (unsigned long long)w_sent, (unsigned long long)w_answered, (unsigned long long)w_skipped,
	       (unsigned long long)errors, now_s() - t0);
	for (i = 0; i < conns; i++)
		close(c[i].fd);
	return 0;
}
