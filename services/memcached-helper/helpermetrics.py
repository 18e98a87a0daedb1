"""A PostMan helper's metrics, for ``vfab.vid.metrics``: the C fast path's own counters, read at scrape time.

mc-helper writes its counters to its stats file every ``--stats-ms``; the agent reads that file anyway
(``HelperAgent.tick``).  :func:`families` turns the agent's last read into Prometheus families — the batch
histogram (keys per coalesced multi-get, the C program's power-of-two buckets), the current batch size S and
interval T of Algorithm 1, what it received, batched, relayed and dropped — so a scrape costs the fast path
nothing.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

EP = ["service", "endpoint"]
# stats-file counter -> the event it counts (vfab_helper_events_total{event})
EVENTS = {"rx_dgrams": "rx_datagrams", "rx_get": "rx_get", "rx_gets": "rx_multiget", "rx_keys": "rx_keys",
          "rx_pass": "passed", "b_cmds": "batches", "b_keys": "batched_keys", "close_size": "closed_size",
          "close_time": "closed_time", "close_full": "closed_full", "close_order": "closed_order",
          "drop_peers": "drop_peers", "drop_noconn": "drop_noconn", "drop_busy": "drop_busy", "tx_nombuf": "tx_nombuf",
          "tx_drop": "tx_drop", "tx_frames": "tx_frames", "connects": "connects", "disconnects": "disconnects",
          "stalls": "stalls", "relay_sent": "relay_sent", "relay_replies": "relay_replies"}


def batch_histogram(stats: dict) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets from ``hist_keys_<lo>`` (bucket lo holds lo .. 2*lo-1 keys; the last one
    lo and more): the upper bound of bucket lo is 2*lo - 1."""
    rows = sorted((int(k[len("hist_keys_"):]), v) for k, v in stats.items()
                  if k.startswith("hist_keys_") and k[len("hist_keys_"):].isdigit())
    out, total = [], 0
    for i, (lo, n) in enumerate(rows):
        total += n
        if i + 1 < len(rows):
            out.append((str(2 * lo - 1), total))
    out.append(("+Inf", total))
    return out


def families(service: str, endpoint: str, stats: dict, serving: bool) -> list:
    lab = [service, endpoint]
    up = GaugeMetricFamily("vfab_helper_up", "1 while the helper is announced (its fast path serves), 0 while "
                           "withdrawn", labels=EP)
    up.add_metric(lab, 1 if serving else 0)
    out = [up]
    if not stats:
        return out
    hist = HistogramMetricFamily("vfab_helper_batch_keys", "keys per multi-get the helper sent to the helpee",
                                 labels=EP)
    hist.add_metric(lab, batch_histogram(stats), sum_value=stats.get("b_keys", 0))
    size = GaugeMetricFamily("vfab_helper_batch_size_bytes", "batch size S now (Algorithm 1)", labels=EP)
    size.add_metric(lab, stats.get("batch_S_bytes", 0))
    interval = GaugeMetricFamily("vfab_helper_batch_interval_seconds", "batch interval T now (Algorithm 1)",
                                 labels=EP)
    interval.add_metric(lab, stats.get("batch_T_ns", 0) / 1e9)
    conns = GaugeMetricFamily("vfab_helper_connections", "TCP connections to the helpee, by state", labels=[*EP,
                              "state"])
    conns.add_metric([*lab, "up"], stats.get("conns_up", 0))
    conns.add_metric([*lab, "configured"], stats.get("conns", 0))
    events = CounterMetricFamily("vfab_helper_events", "the fast path's counters (its stats file)",
                                 labels=[*EP, "event"])
    for key, event in EVENTS.items():
        if key in stats:
            events.add_metric([*lab, event], stats[key])
    tcp = CounterMetricFamily("vfab_helper_tcp_bytes", "bytes on the helper's TCP connections to the helpee",
                              labels=[*EP, "type"])
    tcp.add_metric([*lab, "out"], stats.get("tcp_bytes_out", 0))
    tcp.add_metric([*lab, "in"], stats.get("tcp_bytes_in", 0))
    return [*out, hist, size, interval, conns, events, tcp]


class HelperCollector:
    """Collects ``families`` from ``read()`` -> (service, endpoint, last stats, serving) at scrape time."""

    def __init__(self, read: Callable[[], tuple[str, str, dict, bool]]):
        self.read = read

    def describe(self) -> list:
        return []

    def collect(self):
        yield from families(*self.read())
