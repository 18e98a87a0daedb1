/*
 * mch_main.c - mc-helper: the PostMan helper for an unmodified memcached
 * (issue 8), a DPDK program.
 *
 *   mc-helper -l 0 --no-huge --no-pci -m 64 --file-prefix=mch1 \
 *       --vdev=net_af_packet0,iface=eth1 -- --service 10.0.0.1:11211 \
 *       [--memcached 10.1.0.1:11211] [--stats-file /run/mch1.stats] ...
 *
 * One worker per lcore, each with its own rx/tx queue pair (give the vdev
 * qpairs=N for N lcores), its own TCP connections to memcached and its own
 * counters.  The main lcore is a worker too; a control thread writes the
 * stats file.  SIGINT/SIGTERM stop the loops; waiting clients are answered as
 * after a lost connection, a last stats snapshot is written.
 *
 * Application options are checked before DPDK starts (mch_cfg.c):
 * `mc-helper -- --check --service ...` validates them without a port.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rte_common.h>
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_launch.h>
#include <rte_lcore.h>
#include <rte_log.h>
#include <rte_mbuf.h>

#include "mch_cfg.h"
#include "mch_stats.h"
#include "mch_worker.h"

#define RTE_LOGTYPE_MCH RTE_LOGTYPE_USER1
#define MCH_RX_DESC 1024u
#define MCH_TX_DESC 1024u
#define MCH_POOL_CACHE 256u
#define MCH_RX_BIG_MBUFS 255u  /* --rx-buf pool (a power of two minus one, as mempools like) */
#define MCH_RX_BIG_CACHE 32u

static volatile int mch_quit;

struct mch_app {
	struct mch_cfg cfg;
	uint16_t port;
	uint32_t nw;
	struct mch_worker **w;
	struct rte_mempool *mp;
	struct rte_mempool *rx_mp; /* received frames: mp, or the --rx-buf pool */
	pthread_t stats_thread;
	int stats_running;
	int stats_errno; /* errno of the last failed stats write, 0 after a good one */
	uint64_t t0_ms;
};

static void on_signal(int sig)
{
	(void)sig;
	mch_quit = 1;
}

static uint64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/*
 * Write the stats file.  A failure (a full or missing directory) is said once
 * per cause, and again once writing works: the thread retries every period,
 * and a warning each time would bury the log (100 lines a second at 10 ms).
 */
static void write_stats(struct mch_app *a)
{
	int err;

	if (!a->cfg.stats_file[0])
		return;
	uint64_t now = mono_ms();

	if (mch_stats_write(a->cfg.stats_file, a->w, a->nw, now - a->t0_ms, a->port, now) == 0) {
		if (a->stats_errno != 0)
			RTE_LOG(INFO, MCH, "writing %s again\n", a->cfg.stats_file);
		a->stats_errno = 0;
		return;
	}
	err = errno ? errno : EIO;
	if (err != a->stats_errno)
		RTE_LOG(WARNING, MCH, "cannot write %s: %s (said once until it changes; serving goes on)\n",
			a->cfg.stats_file, strerror(err));
	a->stats_errno = err;
}

/*
 * Every --stats-ms, and at once (within MCH_HEALTH_MS) when a connection goes
 * up or down: the agent withdraws a helper that cannot serve within tens of ms.
 */
#define MCH_HEALTH_MS 5u

static void *stats_main(void *arg)
{
	struct mch_app *a = arg;
	struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)MCH_HEALTH_MS * 1000000L};
	uint64_t health = mch_stats_health(a->w, a->nw), h, last = 0, now;

	while (!mch_quit) {
		now = mono_ms();
		h = mch_stats_health(a->w, a->nw);
		if (h != health || now - last >= a->cfg.stats_ms) {
			write_stats(a);
			health = h;
			last = now;
		}
		nanosleep(&ts, NULL);
	}
	return NULL;
}

/* Split argv at "--": EAL arguments before, ours after. */
static int app_args(int argc, char **argv, struct mch_cfg *cfg)
{
	char err[256];
	int i;

	for (i = 1; i < argc; i++)
		if (!strcmp(argv[i], "--"))
			break;
	if (mch_cfg_parse(cfg, argc - i - 1 > 0 ? argc - i - 1 : 0, argv + i + 1, err,
			  sizeof(err)) != 0) {
		fprintf(stderr, "mc-helper: %s\n", err);
		exit(2);
	}
	if (cfg->help) {
		mch_cfg_usage(argv[0]);
		exit(0);
	}
	if (cfg->check) {
		char d[512];

		mch_cfg_describe(cfg, d, sizeof(d));
		printf("config ok: %s\n", d);
		exit(0);
	}
	return i; /* EAL's argc */
}

static void port_init(struct mch_app *a)
{
	struct rte_eth_conf conf;
	struct rte_eth_dev_info info;
	uint16_t q, nq = (uint16_t)a->nw;
	int rc;

	if (rte_eth_dev_count_avail() == 0)
		rte_exit(EXIT_FAILURE, "no port: give one, e.g. --vdev=net_af_packet0,iface=IFACE\n");
	a->port = 0;
	while (!rte_eth_dev_is_valid_port(a->port))
		a->port++;
	rc = rte_eth_dev_info_get(a->port, &info);
	if (rc != 0)
		rte_exit(EXIT_FAILURE, "port %u: cannot get device info: %s\n", a->port,
			 rte_strerror(-rc));
	if (info.max_rx_queues < nq || info.max_tx_queues < nq)
		rte_exit(EXIT_FAILURE,
			 "port %u has %u queue pairs but %u lcores were given: add qpairs=%u to "
			 "the --vdev (one queue pair per lcore) or give fewer lcores\n",
			 a->port, info.max_rx_queues, nq, nq);
	memset(&conf, 0, sizeof(conf));
	rc = rte_eth_dev_configure(a->port, nq, nq, &conf);
	if (rc != 0)
		rte_exit(EXIT_FAILURE, "port %u: configure %u queues: %s\n", a->port, nq,
			 rte_strerror(-rc));
	for (q = 0; q < nq; q++) {
		rc = rte_eth_rx_queue_setup(a->port, q, MCH_RX_DESC,
					    rte_eth_dev_socket_id(a->port), NULL, a->rx_mp);
		if (rc == 0)
			rc = rte_eth_tx_queue_setup(a->port, q, MCH_TX_DESC,
						    rte_eth_dev_socket_id(a->port), NULL);
		if (rc != 0)
			rte_exit(EXIT_FAILURE, "port %u: queue %u setup: %s\n", a->port, q,
				 rte_strerror(-rc));
	}
	rc = rte_eth_dev_start(a->port);
	if (rc != 0)
		rte_exit(EXIT_FAILURE, "port %u: start: %s\n", a->port, rte_strerror(-rc));
	if (a->cfg.any_mac && rte_eth_promiscuous_enable(a->port) != 0)
		rte_exit(EXIT_FAILURE, "port %u: cannot enable promiscuous mode (--any-mac)\n",
			 a->port);
}

static void workers_init(struct mch_app *a)
{
	struct mch_net_cfg net;
	unsigned int lcore;
	uint32_t i = 0;

	memset(&net, 0, sizeof(net));
	if (rte_eth_macaddr_get(a->port, &net.mac) != 0)
		rte_exit(EXIT_FAILURE, "port %u: cannot read its MAC address\n", a->port);
	net.svc_ip = a->cfg.svc_ip;
	net.svc_port = a->cfg.svc_port;
	net.any_mac = a->cfg.any_mac;
	mch_net_prepare(&net);
	a->w = calloc(a->nw, sizeof(*a->w));
	if (!a->w)
		rte_exit(EXIT_FAILURE, "out of memory\n");
	/* worker 0 runs on the main lcore, the others in lcore order */
	lcore = rte_get_main_lcore();
	for (i = 0; i < a->nw; i++) {
		if (i > 0)
			lcore = rte_get_next_lcore(lcore, 1, 1);
		a->w[i] = calloc(1, sizeof(struct mch_worker));
		if (!a->w[i] || mch_worker_init(a->w[i], i, &a->cfg, &net, a->mp, a->port,
						(uint16_t)i, &mch_quit) != 0)
			rte_exit(EXIT_FAILURE, "out of memory for worker %u (--peers %u, --conns %u)\n",
				 i, a->cfg.peers, a->cfg.conns);
		a->w[i]->lcore = lcore;
	}
}

int main(int argc, char **argv)
{
	static struct mch_app app;
	struct mch_app *a = &app;
	char desc[512];
	uint32_t i;
	int eal_argc, rc;

	eal_argc = app_args(argc, argv, &a->cfg);
	rc = rte_eal_init(eal_argc, argv);
	if (rc < 0)
		rte_exit(EXIT_FAILURE, "EAL init failed (see above); e.g. -l 0 --no-huge --no-pci "
			 "-m 64 --file-prefix=UNIQUE --vdev=net_af_packet0,iface=IFACE\n");
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	a->t0_ms = mono_ms();
	a->nw = rte_lcore_count();

	a->mp = rte_pktmbuf_pool_create("mch_pool", a->cfg.mbufs, MCH_POOL_CACHE, 0,
					RTE_MBUF_DEFAULT_BUF_SIZE, rte_socket_id());
	if (a->mp == NULL)
		rte_exit(EXIT_FAILURE, "cannot create a pool of %u mbufs: %s (give more -m or "
			 "fewer --mbufs)\n", a->cfg.mbufs, rte_strerror(rte_errno));
	/*
	 * Large requests (issue 43): the kernel puts a fragmented datagram together before af_packet
	 * hands it over, so a request up to 64 KB arrives as one frame.  The PMD copies each frame
	 * into one mbuf and frees it after the burst: a few hundred large ones suffice.
	 */
	a->rx_mp = a->mp;
	if (a->cfg.rx_buf != 0) {
		a->rx_mp = rte_pktmbuf_pool_create("mch_rx", MCH_RX_BIG_MBUFS, MCH_RX_BIG_CACHE, 0,
						   (uint16_t)a->cfg.rx_buf, rte_socket_id());
		if (a->rx_mp == NULL)
			rte_exit(EXIT_FAILURE, "cannot create a pool of %u mbufs of %u B (--rx-buf): %s "
				 "(give more -m)\n", MCH_RX_BIG_MBUFS, a->cfg.rx_buf, rte_strerror(rte_errno));
	}
	port_init(a);
	workers_init(a);

	mch_cfg_describe(&a->cfg, desc, sizeof(desc));
	RTE_LOG(INFO, MCH, "port %u, %u lcore(s): %s\n", a->port, a->nw, desc);
	if (a->cfg.stats_file[0]) {
		rc = rte_ctrl_thread_create(&a->stats_thread, "mch-stats", NULL, stats_main, a);
		if (rc != 0)
			rte_exit(EXIT_FAILURE, "cannot start the stats thread: %s\n", strerror(rc));
		a->stats_running = 1;
	}
	printf("mc-helper ready: %u lcore(s), port %u\n", a->nw, a->port);
	fflush(stdout);

	for (i = 1; i < a->nw; i++)
		rte_eal_remote_launch(mch_worker_main, a->w[i], a->w[i]->lcore);
	mch_worker_main(a->w[0]);
	rte_eal_mp_wait_lcore();

	if (a->stats_running)
		pthread_join(a->stats_thread, NULL);
	write_stats(a);
	rte_eth_dev_stop(a->port);
	rte_eth_dev_close(a->port);
	for (i = 0; i < a->nw; i++) {
		mch_worker_free(a->w[i]);
		free(a->w[i]);
	}
	free(a->w);
	if (a->rx_mp != a->mp)
		rte_mempool_free(a->rx_mp);
	rte_mempool_free(a->mp);
	rte_eal_cleanup();
	return 0;
}
