/*
 * mch_stats.c - the stats file (see mch_stats.h).  Counters are read while
 * the lcores run: aligned 64-bit loads, so each value is whole, the snapshot
 * as a whole is not atomic (it does not need to be).
 */
#include "mch_stats.h"

#include <stdio.h>
#include <string.h>

#include <rte_cycles.h>
#include <rte_ethdev.h>

/* sum of one uint64_t field at byte offset off over all workers */
static uint64_t sum_at(struct mch_worker *const *w, uint32_t nw, size_t off)
{
	uint64_t s = 0;
	uint32_t i;

	for (i = 0; i < nw; i++)
		s += *(const volatile uint64_t *)((const uint8_t *)w[i] + off);
	return s;
}

static uint64_t conn_sum(struct mch_worker *const *w, uint32_t nw, size_t off)
{
	uint64_t s = 0;
	uint32_t i, j;

	for (i = 0; i < nw; i++)
		for (j = 0; j < w[i]->nconns; j++)
			s += *(const volatile uint64_t *)((const uint8_t *)&w[i]->conns[j] + off);
	return s;
}

#define WOFF(f) offsetof(struct mch_worker, f)
#define COFF(f) offsetof(struct mch_conn, f)

struct mch_stat_field {
	const char *name;
	size_t off;
};

static const struct mch_stat_field worker_fields[] = {
	{"loops", WOFF(c.loops)}, {"rx_bursts", WOFF(c.rx_bursts)},
	{"rx_frames", WOFF(c.rx_frames)}, {"drop_peers", WOFF(c.drop_peers)},
	{"drop_noconn", WOFF(c.drop_noconn)}, {"relay_noconn", WOFF(c.relay_noconn)}, {"drop_busy", WOFF(c.drop_busy)},
	{"refused_big", WOFF(c.refused_big)},
	{"tx_frames", WOFF(c.tx_frames)}, {"tx_nombuf", WOFF(c.tx_nombuf)},
	{"tx_drop", WOFF(c.tx_drop)}, {"idle_sleeps", WOFF(c.idle_sleeps)},
	/* protocol core (struct mch_counters) */
	{"rx_dgrams", WOFF(pc.rx)}, {"rx_get", WOFF(pc.rx_get)}, {"rx_gets", WOFF(pc.rx_gets)},
	{"rx_keys", WOFF(pc.rx_keys)}, {"rx_pass", WOFF(pc.rx_pass)},
	{"b_full", WOFF(pc.b_full)}, {"b_cmds", WOFF(pc.b_cmds)}, {"b_keys", WOFF(pc.b_keys)},
	{"b_refs", WOFF(pc.b_refs)}, {"b_waiters", WOFF(pc.b_waiters)},
	{"b_pass", WOFF(pc.b_pass)}, {"s_values", WOFF(pc.s_values)},
	{"s_value_bytes", WOFF(pc.s_value_bytes)}, {"s_misses", WOFF(pc.s_misses)},
	{"s_lines", WOFF(pc.s_lines)}, {"reply_dgrams", WOFF(pc.tx_dgrams)},
	{"reply_bytes", WOFF(pc.tx_bytes)}, {"w_done", WOFF(pc.w_done)},
	{"w_silent", WOFF(pc.w_silent)}, {"w_abort_miss", WOFF(pc.w_abort_miss)},
	{"w_abort_drop", WOFF(pc.w_abort_drop)},
	/* the UDP relay of rejected requests (mch_relay.h) */
	{"ord_held", WOFF(order.c.held)}, {"ord_filled", WOFF(order.c.filled)},
	{"ord_expired", WOFF(order.c.expired)}, {"ord_late", WOFF(order.c.late)}, {"ord_full", WOFF(order.c.full)},
	{"relay_sent", WOFF(relay.c.sent)}, {"relay_unsafe", WOFF(relay.c.unsafe)},
	{"relay_busy", WOFF(relay.c.busy)}, {"relay_fail", WOFF(relay.c.fail)},
	{"relay_replies", WOFF(relay.c.replies)}, {"relay_late", WOFF(relay.c.late)},
	{"relay_expired", WOFF(relay.c.expired)},
};

static const struct mch_stat_field conn_fields[] = {
	{"connects", COFF(c.connects)}, {"stalls", COFF(c.stalls)}, {"probes", COFF(c.probes)}, {"keepalives", COFF(c.keepalives)}, {"connect_fails", COFF(c.connect_fails)},
	{"disconnects", COFF(c.disconnects)}, {"tcp_bytes_out", COFF(c.bytes_out)},
	{"tcp_bytes_in", COFF(c.bytes_in)}, {"tcp_reads", COFF(c.reads)},
	{"tcp_reads_empty", COFF(c.reads_empty)}, {"get_cmds", COFF(c.get_cmds)},
	{"pass_cmds", COFF(c.pass_cmds)}, {"close_size", COFF(c.close_size)},
	{"close_time", COFF(c.close_time)}, {"close_full", COFF(c.close_full)},
	{"close_order", COFF(c.close_order)},
};

#define NFIELDS(a) (sizeof(a) / sizeof((a)[0]))

static void write_conns(FILE *f, struct mch_worker *const *w, uint32_t nw, uint64_t mono_ms)
{
	uint64_t s_sum = 0, t_sum = 0, up = 0;
	const struct mch_conn *down = NULL;
	uint32_t i, j;

	for (i = 0; i < nw; i++) {
		for (j = 0; j < w[i]->nconns; j++) {
			const struct mch_conn *c = &w[i]->conns[j];
			uint64_t S = c->ad.S, T_ns = c->ad.T * 1000000000u / c->hz;
			uint8_t st = c->state;

			fprintf(f, "conn_%u_%u_state %u\n", i, j, st);
			fprintf(f, "conn_%u_%u_S_bytes %llu\n", i, j, (unsigned long long)S);
			fprintf(f, "conn_%u_%u_T_ns %llu\n", i, j, (unsigned long long)T_ns);
			fprintf(f, "conn_%u_%u_S_moves %llu\n", i, j,
				(unsigned long long)c->ad.s_moves);
			fprintf(f, "conn_%u_%u_T_moves %llu\n", i, j,
				(unsigned long long)c->ad.t_moves);
			fprintf(f, "conn_%u_%u_inflight %u\n", i, j, c->sp.qlen);
			fprintf(f, "conn_%u_%u_why %u\n", i, j, c->why);
			if (st == MCH_CONN_UP) {
				up++;
				s_sum += S;
				t_sum += T_ns;
			} else if (down == NULL) {
				down = c;
			}
		}
	}
	fprintf(f, "conns_up %llu\n", (unsigned long long)up);
	fprintf(f, "serving %u\n", down == NULL);
	if (down != NULL) {
		uint32_t total = 0;

		for (i = 0; i < nw; i++)
			total += w[i]->nconns;
		uint64_t ago = (rte_rdtsc() - down->down_tsc) * 1000u / down->hz;

		fprintf(f, "conns_down %llu\ndown_why_%s 1\ndown_waited_ms %u\n"
			"down_unacked_bytes %u\ndown_backoff %u\ndown_at_mono_ms %llu\n",
			(unsigned long long)(total - up), mch_down_name(down->why),
			down->why_waited_ms, down->why_unacked, down->why_backoff,
			(unsigned long long)(mono_ms > ago ? mono_ms - ago : 0));
	}
	fprintf(f, "batch_S_bytes %llu\n", (unsigned long long)(up ? s_sum / up : 0));
	fprintf(f, "batch_T_ns %llu\n", (unsigned long long)(up ? t_sum / up : 0));
}

uint64_t mch_stats_health(struct mch_worker *const *w, uint32_t nw)
{
	uint64_t h = 0;
	uint32_t i, j;

	for (i = 0; i < nw; i++)
		for (j = 0; j < w[i]->nconns; j++)
			h = h * 31u + (w[i]->conns[j].state == MCH_CONN_UP) +
			    2u * w[i]->conns[j].c.stalls;
	return h;
}

int mch_stats_write(const char *path, struct mch_worker *const *w, uint32_t nw,
		    uint64_t uptime_ms, uint16_t port, uint64_t mono_ms)
{
	char tmp[300];
	struct rte_eth_stats ps;
	FILE *f;
	uint32_t i, k;

	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	f = fopen(tmp, "w");
	if (!f)
		return -1;
	fprintf(f, "uptime_ms %llu\nlcores %u\nconns %u\n", (unsigned long long)uptime_ms, nw,
		nw ? nw * w[0]->nconns : 0);
	for (k = 0; k < NFIELDS(worker_fields); k++)
		fprintf(f, "%s %llu\n", worker_fields[k].name,
			(unsigned long long)sum_at(w, nw, worker_fields[k].off));
	for (k = 0; k < NFIELDS(conn_fields); k++)
		fprintf(f, "%s %llu\n", conn_fields[k].name,
			(unsigned long long)conn_sum(w, nw, conn_fields[k].off));
	for (k = 0; k < MCH_NET__COUNT; k++)
		fprintf(f, "net_%s %llu\n", mch_net_rej_name((int)k),
			(unsigned long long)sum_at(w, nw, WOFF(c.net) + k * sizeof(uint64_t)));
	for (k = 1; k < MCH_REJ__COUNT; k++)
		fprintf(f, "rej_%s %llu\n", mch_rej_name((int)k),
			(unsigned long long)sum_at(w, nw, WOFF(pc.rej) + k * sizeof(uint64_t)));
	for (k = 1; k < MCH_ERR__COUNT; k++)
		fprintf(f, "err_%s %llu\n", mch_err_name((int)k),
			(unsigned long long)sum_at(w, nw, WOFF(pc.s_err) + k * sizeof(uint64_t)));
	for (k = 0; k < MCH_HIST_BUCKETS; k++)
		fprintf(f, "hist_keys_%u %llu\n", mch_hist_lo(k),
			(unsigned long long)sum_at(w, nw, WOFF(hist.n) + k * sizeof(uint64_t)));
	write_conns(f, w, nw, mono_ms);
	for (i = 0; i < nw; i++) {
		fprintf(f, "lcore_%u_loops %llu\n", i, (unsigned long long)w[i]->c.loops);
		fprintf(f, "lcore_%u_rx_frames %llu\n", i, (unsigned long long)w[i]->c.rx_frames);
		fprintf(f, "lcore_%u_tx_frames %llu\n", i, (unsigned long long)w[i]->c.tx_frames);
		fprintf(f, "lcore_%u_peers_used %u\n", i, w[i]->peers_used);
	}
	/* only this thread asks the port for its counters */
	if (rte_eth_stats_get(port, &ps) == 0)
		fprintf(f, "port_ipackets %llu\nport_imissed %llu\nport_ierrors %llu\n"
			"port_opackets %llu\nport_oerrors %llu\n",
			(unsigned long long)ps.ipackets, (unsigned long long)ps.imissed,
			(unsigned long long)ps.ierrors, (unsigned long long)ps.opackets,
			(unsigned long long)ps.oerrors);
	if (fclose(f) != 0)
		return -1;
	return rename(tmp, path);
}
