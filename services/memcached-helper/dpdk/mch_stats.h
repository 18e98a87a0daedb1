/*
 * mch_stats.h - the helper's counters, S/T and batch-size histogram, written
 * as a text file ("name value" per line) by a control thread, never by the
 * fast path.  The file is replaced atomically (PATH.tmp, then rename), so a
 * reader always sees one whole snapshot.  Names:
 *
 *   uptime_ms lcores conns conns_up
 *   <counter>              sum over lcores (rx_frames, tx_frames, drop_busy,
 *                          net_<reason>, rej_<reason>, err_<kind>, b_cmds,
 *                          b_keys, close_size, ..., see mch_stats.c)
 *   hist_keys_<lo>         coalesced gets with lo..2*lo-1 keys (lo = 1, 2, 4 .. 256)
 *   batch_S_bytes batch_T_ns   mean over connections that are up
 *   conn_<lcore>_<i>_{state,S_bytes,T_ns,S_moves,T_moves,inflight,why}
 *   serving                1 when every connection is up (answered its probe)
 *   conns_down down_why_<reason> down_waited_ms down_unacked_bytes down_backoff
 *                          how many are not, and why the first of them went down
 *                          (enum mch_down: no_answers, unacked, probe, ...) and
 *                          when (down_at_mono_ms: CLOCK_MONOTONIC, comparable across processes)
 *   lcore_<n>_{loops,rx_frames,tx_frames,peers_used}
 *   port_{ipackets,imissed,ierrors,opackets,oerrors}   the port's own counters
 *                          (net_af_packet: imissed = frames the kernel dropped
 *                          because the rx ring was full)
 */
#ifndef MCH_STATS_H
#define MCH_STATS_H

#include <stdint.h>

#include "mch_worker.h"

/* Write one snapshot to path (via path.tmp).  0 or -1 (errno set). */
int mch_stats_write(const char *path, struct mch_worker *const *w, uint32_t nw,
		    uint64_t uptime_ms, uint16_t port, uint64_t mono_ms);

/*
 * A number that changes when any connection goes up or down: the stats thread
 * writes the file at once when it does (the agent withdraws a helper that does
 * not serve), not only every --stats-ms.
 */
uint64_t mch_stats_health(struct mch_worker *const *w, uint32_t nw);

#endif /* MCH_STATS_H */
