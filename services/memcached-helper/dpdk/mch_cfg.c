/*
 * mch_cfg.c - the option table and its parser (see mch_cfg.h).
 */
#include "mch_cfg.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum opt_kind { OPT_ADDR, OPT_U32, OPT_FLAG, OPT_PATH };

struct mch_opt {
	const char *name;
	uint8_t kind;
	size_t off;   /* field in struct mch_cfg */
	size_t off2;  /* OPT_ADDR: the port field */
	uint32_t min, max;
	const char *help;
};

#define F(f) offsetof(struct mch_cfg, f)

static const struct mch_opt mch_opts[] = {
	{"service", OPT_ADDR, F(svc_ip), F(svc_port), 0, 0,
	 "IP[:PORT]  address and UDP port clients send to (required; port 11211)"},
	{"memcached", OPT_ADDR, F(mc_ip), F(mc_port), 0, 0,
	 "IP[:PORT]  memcached's TCP address (default: the service address)"},
	{"conns", OPT_U32, F(conns), 0, 1, 64, "N  TCP connections to memcached per lcore (2)"},
	{"s-init", OPT_U32, F(s_init), 0, 1, 65536, "BYTES  initial batch size S (1500)"},
	{"s-min", OPT_U32, F(s_min), 0, 1, 65536, "BYTES  lower bound of S (1500, the paper's)"},
	{"s-max", OPT_U32, F(s_max), 0, 1, 65536, "BYTES  upper bound of S (32768)"},
	{"t-init", OPT_U32, F(t_init), 0, 1, 1000000, "US  initial batch interval T (50)"},
	{"t-min", OPT_U32, F(t_min), 0, 1, 1000000, "US  lower bound of T (10, the paper's)"},
	{"t-max", OPT_U32, F(t_max), 0, 1, 1000000, "US  upper bound of T (200)"},
	{"idle-us", OPT_U32, F(idle_us), 0, 0, 100000,
	 "US  when idle, sleep this long (0: busy poll; default 20)"},
	{"idle-max-us", OPT_U32, F(idle_max_us), 0, 0, 100000,
	 "US  idle sleeps in a row double up to this (default 2000; an answer wakes at once)"},
	{"stall-ms", OPT_U32, F(stall_ms), 0, 5, 60000,
	 "MS  a connection with commands in flight and no answer for this long is failed and "
	 "reconnected, its clients answered as after a lost connection (default 50)"},
	{"order-hold-us", OPT_U32, F(order_hold_us), 0, 0, 100000,
	 "US  a request whose id is 1..8 ahead of the one its client numbered next waits this long for "
	 "the ones between (the switch may deliver a client's fragmented request before its small one "
	 "sent earlier), then is served anyway (default 1000; 0: serve in arrival order)"},
	{"mbufs", OPT_U32, F(mbufs), 0, 512, 1u << 20, "N  mbufs in the pool (4095)"},
	{"rx-buf", OPT_U32, F(rx_buf), 0, 2176, 65535,
	 "BYTES  received frames go into mbufs of this data room, from a pool of their own (default: one "
	 "2 KB frame); 65535 takes whole datagrams of up to ~65,300 B, which the kernel reassembles from "
	 "IP fragments (af_packet's fanout defrag): give the vdev framesz up to BYTES - 96"},
	{"peers", OPT_U32, F(peers), 0, 64, 1u << 20,
	 "N  client requests that may wait per lcore (16384)"},
	{"stats-file", OPT_PATH, F(stats_file), 0, 0, 0,
	 "PATH  write counters, S, T and the histogram here (tmp + rename)"},
	{"stats-ms", OPT_U32, F(stats_ms), 0, 10, 60000, "MS  stats file period (200)"},
	{"retry-ms", OPT_U32, F(retry_ms), 0, 1, 60000, "MS  reconnect delay (100)"},
	{"any-mac", OPT_FLAG, F(any_mac), 0, 0, 0,
	 "accept frames whatever their destination MAC (promiscuous port)"},
	{"no-order", OPT_FLAG, F(no_order), 0, 0, 0,
	 "tests only: do not keep a client's forwarded commands behind its gets"},
	{"check", OPT_FLAG, F(check), 0, 0, 0, "validate the settings and exit"},
	{"help", OPT_FLAG, F(help), 0, 0, 0, "this text"},
};

#define NOPTS (sizeof(mch_opts) / sizeof(mch_opts[0]))

static void defaults(struct mch_cfg *c)
{
	memset(c, 0, sizeof(*c));
	c->conns = 2;
	c->s_init = c->s_min = 1500;
	c->s_max = 32768;
	c->t_init = 50;
	c->t_min = 10;
	c->t_max = 200;
	c->mbufs = 4095;
	c->peers = 16384;
	c->stats_ms = 200;
	c->retry_ms = 100;
	c->idle_us = 20;
	c->idle_max_us = 2000;
	c->stall_ms = 50;
	c->order_hold_us = 1000;
}

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return -1;
}

static int parse_addr(const struct mch_opt *o, const char *v, struct mch_cfg *c, char *err,
		      size_t errlen)
{
	char host[64];
	const char *colon = strchr(v, ':');
	size_t hl = colon ? (size_t)(colon - v) : strlen(v);
	unsigned long port = 11211;
	struct in_addr a;
	char *end;

	if (hl == 0 || hl >= sizeof(host))
		return fail(err, errlen, "--%s %s: expected IPv4[:PORT], e.g. 10.0.0.1:11211",
			    o->name, v);
	memcpy(host, v, hl);
	host[hl] = '\0';
	if (inet_pton(AF_INET, host, &a) != 1)
		return fail(err, errlen, "--%s %s: '%s' is not an IPv4 address", o->name, v, host);
	if (colon) {
		errno = 0;
		port = strtoul(colon + 1, &end, 10);
		if (errno || *end || end == colon + 1 || port == 0 || port > 65535)
			return fail(err, errlen, "--%s %s: port must be 1..65535", o->name, v);
	}
	memcpy((uint8_t *)c + o->off, &a.s_addr, sizeof(uint32_t));
	*(uint16_t *)((uint8_t *)c + o->off2) = htons((uint16_t)port);
	return 0;
}

static int parse_u32(const struct mch_opt *o, const char *v, struct mch_cfg *c, char *err,
		     size_t errlen)
{
	unsigned long long x;
	char *end;

	errno = 0;
	x = strtoull(v, &end, 10);
	if (errno || *end || end == v || v[0] == '-' || x < o->min || x > o->max)
		return fail(err, errlen, "--%s %s: expected an integer in %u..%u", o->name, v,
			    o->min, o->max);
	*(uint32_t *)((uint8_t *)c + o->off) = (uint32_t)x;
	return 0;
}

static const struct mch_opt *find_opt(const char *name)
{
	size_t i;

	for (i = 0; i < NOPTS; i++)
		if (!strcmp(name, mch_opts[i].name))
			return &mch_opts[i];
	return NULL;
}

static int apply(const struct mch_opt *o, const char *v, struct mch_cfg *c, char *err,
		 size_t errlen)
{
	switch (o->kind) {
	case OPT_ADDR:
		return parse_addr(o, v, c, err, errlen);
	case OPT_U32:
		return parse_u32(o, v, c, err, errlen);
	case OPT_PATH:
		if (strlen(v) == 0 || strlen(v) >= MCH_CFG_PATH_MAX)
			return fail(err, errlen, "--%s: path must be 1..%u bytes", o->name,
				    MCH_CFG_PATH_MAX - 1u);
		snprintf((char *)c + o->off, MCH_CFG_PATH_MAX, "%s", v);
		return 0;
	default:
		*((uint8_t *)c + o->off) = 1;
		return 0;
	}
}

static int check_all(struct mch_cfg *c, int have_mc, char *err, size_t errlen)
{
	if (c->help)
		return 0;
	if (c->svc_ip == 0)
		return fail(err, errlen, "--service IP[:PORT] is required (the address clients "
			    "send to, e.g. --service 10.0.0.1:11211)");
	if (!have_mc) {
		c->mc_ip = c->svc_ip;
		c->mc_port = c->svc_port;
	}
	if (c->s_min > c->s_max)
		return fail(err, errlen, "--s-min %u is above --s-max %u", c->s_min, c->s_max);
	if (c->t_min > c->t_max)
		return fail(err, errlen, "--t-min %u is above --t-max %u", c->t_min, c->t_max);
	if (c->s_init < c->s_min || c->s_init > c->s_max)
		return fail(err, errlen, "--s-init %u is outside --s-min..--s-max (%u..%u)",
			    c->s_init, c->s_min, c->s_max);
	if (c->idle_max_us < c->idle_us)
		c->idle_max_us = c->idle_us;
	if (c->t_init < c->t_min || c->t_init > c->t_max)
		return fail(err, errlen, "--t-init %u is outside --t-min..--t-max (%u..%u)",
			    c->t_init, c->t_min, c->t_max);
	return 0;
}

int mch_cfg_parse(struct mch_cfg *cfg, int argc, char **argv, char *err, size_t errlen)
{
	int i, have_mc = 0;

	defaults(cfg);
	for (i = 0; i < argc; i++) {
		const char *a = argv[i], *eq, *v;
		const struct mch_opt *o;
		char name[32];
		size_t nl;

		if (strncmp(a, "--", 2) != 0)
			return fail(err, errlen, "unexpected argument '%s' (options are --name value)",
				    a);
		eq = strchr(a + 2, '=');
		nl = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
		if (nl == 0 || nl >= sizeof(name))
			return fail(err, errlen, "unknown option '%s' (see --help)", a);
		memcpy(name, a + 2, nl);
		name[nl] = '\0';
		o = find_opt(name);
		if (!o)
			return fail(err, errlen, "unknown option '--%s' (see --help)", name);
		if (o->kind == OPT_FLAG) {
			if (eq)
				return fail(err, errlen, "--%s takes no value", name);
			v = "";
		} else if (eq) {
			v = eq + 1;
		} else if (i + 1 < argc) {
			v = argv[++i];
		} else {
			return fail(err, errlen, "--%s needs a value: --%s %s", name, name, o->help);
		}
		if (apply(o, v, cfg, err, errlen))
			return -1;
		if (o->off == F(mc_ip))
			have_mc = 1;
	}
	return check_all(cfg, have_mc, err, errlen);
}

void mch_cfg_usage(const char *prog)
{
	size_t i;

	printf("usage: %s [EAL options] -- --service IP[:PORT] [options]\n"
	       "EAL, e.g.: -l 0 --no-huge --no-pci -m 64 --file-prefix=mch1 "
	       "--vdev=net_af_packet0,iface=IFACE[,qpairs=N for N lcores]\n"
	       "options:\n",
	       prog);
	for (i = 0; i < NOPTS; i++)
		printf("  --%-12s %s\n", mch_opts[i].name, mch_opts[i].help);
}

void mch_cfg_describe(const struct mch_cfg *c, char *out, size_t len)
{
	char svc[INET_ADDRSTRLEN], mc[INET_ADDRSTRLEN];

	inet_ntop(AF_INET, &c->svc_ip, svc, sizeof(svc));
	inet_ntop(AF_INET, &c->mc_ip, mc, sizeof(mc));
	snprintf(out, len,
		 "service %s:%u memcached %s:%u conns %u S %u [%u, %u] B T %u [%u, %u] us "
		 "idle %u..%u us stall %u ms order hold %u us mbufs %u peers %u%s%s",
		 svc, ntohs(c->svc_port), mc, ntohs(c->mc_port), c->conns, c->s_init, c->s_min,
		 c->s_max, c->t_init, c->t_min, c->t_max, c->idle_us, c->idle_max_us, c->stall_ms, c->order_hold_us,
		 c->mbufs, c->peers,
		 c->any_mac ? " any-mac" : "", c->no_order ? " NO-ORDER(test)" : "");
}
