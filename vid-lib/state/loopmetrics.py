"""Metrics of a stateful endpoint (the state loop under elastic-KVS and sdhcp shards), for ``vfab.vid.metrics``.

Hot paths pay one call per *batch* of requests, never per request (:meth:`LoopMetrics.batch`, plain ints read at
scrape time); everything the
loop already counts (its ``counters``, the records per range its load reports count, a running operation's
phase, sdhcp's leases and pool) is read when Prometheus scrapes (:class:`LoopCollector`), at no cost between
scrapes.  ``range`` labels are a range's lo as 6 hex digits (the key etcd files it under).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from vfab.vid import metrics
from vfab.vid.envelope import Envelope
from vfab.vid.registry import schema

EP = ["service", "endpoint"]
BATCH_HELP = ("time the backend took to serve one batch of requests (their service time; replies leave after it, "
              "or after the batch's fsync and replication; its _count is the batches: requests per batch = "
              "vfab_endpoint_requests_total / _count)")
FSYNC_SECONDS = Histogram("vfab_endpoint_fsync_duration_seconds", "group commits' fsync of the store (sdhcp's)", EP,
                          buckets=metrics.DURATION_BUCKETS)
OPS = Counter("vfab_state_ops_total", "state operations this endpoint ran as their source, by outcome",
              ["service", "endpoint", "op", "outcome"])
OP_SECONDS = Histogram("vfab_state_op_duration_seconds", "state operations from start to their end (done)",
                       ["service", "op"], buckets=metrics.DURATION_BUCKETS)
PHASE_SECONDS = Histogram("vfab_state_op_phase_duration_seconds", "where a finished state operation's time went "
                          "(begin, copy, sync, flip: the clients' pause, etcd, after)", ["service", "op", "phase"],
                          buckets=metrics.DURATION_BUCKETS)
OP_KEYS = Counter("vfab_state_op_keys_total", "records state operations copied to their peer", ["service", "op"])


class LoopMetrics:
    """The hooks one endpoint's loop calls.

    The per-batch numbers (requests, the batch-time histogram) are kept here in plain ints, written by the loop's
    thread alone and read by :class:`LoopCollector` when Prometheus scrapes: 0.6 µs a batch, where
    ``prometheus_client``'s Counter and Histogram, which take a lock on every update, cost 1.5 µs (1-3
    requests per batch at 16 clients: up to 2.5 % of a request's ~60 µs of CPU)."""

    def __init__(self, service: str, endpoint: str):
        self.service, self.endpoint = service, endpoint
        self.requests = 0
        self.batch_counts = [0] * (len(metrics.DURATION_BUCKETS) + 1)   # per bucket, the last one +Inf
        self.batch_sum = 0.0
        self._fsync = FSYNC_SECONDS.labels(service, endpoint)

    def batch(self, n: int, seconds: float) -> None:
        self.requests += n
        self.batch_counts[bisect_left(metrics.DURATION_BUCKETS, seconds)] += 1   # le: the first bound >= seconds
        self.batch_sum += seconds

    def families(self) -> list:
        lab = [self.service, self.endpoint]
        req = CounterMetricFamily("vfab_endpoint_requests", "requests the endpoint's backend served", labels=EP)
        req.add_metric(lab, self.requests)
        counts, total = list(self.batch_counts), 0
        buckets = []
        for bound, n in zip((*(floatToGoString(b) for b in metrics.DURATION_BUCKETS), "+Inf"), counts):
            total += n
            buckets.append((bound, total))
        hist = HistogramMetricFamily("vfab_endpoint_batch_duration_seconds", BATCH_HELP, labels=EP)
        hist.add_metric(lab, buckets, sum_value=self.batch_sum)
        return [req, hist]

    def fsync(self, seconds: float) -> None:
        self._fsync.observe(seconds)

    def op_ended(self, rec: schema.OpRec) -> None:
        OPS.labels(self.service, self.endpoint, rec.op, rec.phase).inc()
        if rec.done:
            OP_KEYS.labels(self.service, rec.op).inc(rec.done)
        if rec.phase != "done":
            return
        OP_SECONDS.labels(self.service, rec.op).observe(rec.timings.get("total_s", 0.0))
        for name, seconds in rec.timings.items():
            if name.endswith("_s") and name != "total_s":
                PHASE_SECONDS.labels(self.service, rec.op, name[:-2]).observe(seconds)


class LoopCollector:
    """What the loop keeps anyway, read at scrape time."""

    def __init__(self, loop: Any):
        self.loop = loop
        self.labels = [loop.service.name, loop.name]

    def describe(self) -> list:
        return []   # families vary with the backend: no duplicate check at registration

    def collect(self):
        lp, lab = self.loop, self.labels
        events = CounterMetricFamily("vfab_endpoint_events", "what the loop counted: requests held during an "
                                     "operation, forwarded, fenced, refused, long passes (stall_*), ...",
                                     labels=[*EP, "event"])
        for name, n in dict(lp.counters).items():
            if not name.endswith("_ms"):   # the *_max_ms are the longest waits yet, not counts
                events.add_metric([*lab, name], n)
        yield events
        keys = GaugeMetricFamily("vfab_range_keys", "records of a range this endpoint holds (as owner or mirror), "
                                 "as its last load report counted them", labels=[*EP, "range"])
        for (lo, _hi), row in dict(lp.housekeeper._counts).items():
            keys.add_metric([*lab, f"{lo:06x}"], row[1])
        yield keys
        age = GaugeMetricFamily("vfab_state_op_phase_age_seconds", "how long the running state operation has "
                                "been in its phase", labels=[*EP, "op", "phase"])
        op = lp.op
        if op is not None:
            age.add_metric([*lab, op.rec.op, op.rec.phase], time.monotonic() - op.phase_since)
        yield age
        hooks = getattr(lp, "metrics", None)
        if hooks is not None:
            yield from hooks.families()
        yield from self._backend()

    def _backend(self):
        """sdhcp: leases, the pool slice and the DHCP message counts (its STATS, asked on the loop's thread)."""
        if not hasattr(self.loop, "lane"):
            return
        got = self.loop.call(lambda: self.loop._control(Envelope("STATS", "metrics")), timeout=1.0)
        stats = getattr(got, "body", {}).get("sdhcp") if isinstance(got, Envelope) else None
        if not stats:
            return
        lab = self.labels
        for name, what, value in (("vfab_sdhcp_leases_active", "bound leases not ended", stats.get("bound", 0)),
                                  ("vfab_sdhcp_leases_offered", "addresses offered, not yet requested",
                                   stats.get("offered", 0)),
                                  ("vfab_sdhcp_pool_addresses", "addresses of the pool in the ranges this shard "
                                   "owns", stats.get("slice", 0))):
            fam = GaugeMetricFamily(name, what, labels=EP)
            fam.add_metric(lab, value)
            yield fam
        msgs = CounterMetricFamily("vfab_sdhcp_messages", "DHCP answers and requests by type (native lane "
                                   "included)", labels=[*EP, "type"])
        counters = stats.get("counters", {})
        for kind in ("offers", "acks", "naks", "releases", "declines", "informs", "pool_exhausted"):
            msgs.add_metric([*lab, kind], counters.get(kind, 0))
        yield msgs


def attach(loop: Any) -> LoopMetrics | None:
    """The loop's hooks, and its collector in the process's registry (None when metrics are off)."""
    if not metrics.enabled():
        return None
    loop.metrics_collector = LoopCollector(loop)
    REGISTRY.register(loop.metrics_collector)
    return LoopMetrics(loop.service.name, loop.name)


def detach(loop: Any) -> None:
    col = getattr(loop, "metrics_collector", None)
    if col is not None:
        loop.metrics_collector = None
        try:
            REGISTRY.unregister(col)
        except KeyError:
            pass
