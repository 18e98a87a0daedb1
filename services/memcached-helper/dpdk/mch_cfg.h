/*
 * mch_cfg.h - the helper's settings: one table of options (name, kind,
 * bounds, help), parsed and checked before DPDK starts, so that
 * `mc-helper -- --check ...` validates a configuration without a port.
 * Unknown options, wrong types and values out of bounds are errors that name
 * the option, the limit and the fix.
 */
#ifndef MCH_CFG_H
#define MCH_CFG_H

#include <stddef.h>
#include <stdint.h>

#define MCH_CFG_PATH_MAX 256u

struct mch_cfg {
	uint32_t svc_ip;    /* address clients send to, network order */
	uint16_t svc_port;  /* its UDP port, network order */
	uint32_t mc_ip;     /* memcached's TCP address, network order */
	uint16_t mc_port;   /* network order */
	uint32_t conns;     /* TCP connections per lcore */
	uint32_t s_init, s_min, s_max; /* batch size S, bytes of command line */
	uint32_t t_init, t_min, t_max; /* batch interval T, microseconds */
	uint32_t idle_us;   /* sleep this long when idle (0: busy poll) */
	uint32_t idle_max_us; /* ... doubling per idle sleep in a row up to this (back-off) */
	uint32_t order_hold_us; /* hold a request numbered ahead of its client's next this long (0: never) */
	uint32_t stall_ms;  /* a leg with commands in flight and no answer this long is reconnected */
	uint32_t mbufs;     /* mbufs in the pool */
	uint32_t rx_buf;    /* data room of the received frames' mbufs (0: the pool's, one 2 KB frame) */
	uint32_t peers;     /* client requests waiting per lcore */
	uint32_t stats_ms;  /* stats file period */
	uint32_t retry_ms;  /* reconnect delay */
	uint8_t any_mac;    /* accept any destination MAC (promiscuous) */
	uint8_t no_order;   /* tests only: drop the per-client order rule */
	uint8_t check;      /* validate and exit */
	uint8_t help;
	char stats_file[MCH_CFG_PATH_MAX];
};

/*
 * Parse the application's arguments (those after "--").  Returns 0, or -1
 * with a message in err.
 */
int mch_cfg_parse(struct mch_cfg *cfg, int argc, char **argv, char *err, size_t errlen);

/* Human-readable summary of the options (for --help and errors). */
void mch_cfg_usage(const char *prog);

/* One line describing the settings in effect (the start-up log line). */
void mch_cfg_describe(const struct mch_cfg *cfg, char *out, size_t len);

#endif /* MCH_CFG_H */
