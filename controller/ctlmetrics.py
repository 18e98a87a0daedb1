"""The route controller's metrics, for ``vfab.vid.metrics``: cut-overs as they happen, the rest read at scrape.

- ``vfab_cutover_duration_seconds{switch}``: from the watch event that brought a change of etcd to the
  moment the switch's ``applied`` report says it holds it (its bundle committed and, where the controller can
  ask ovs-vswitchd, a revalidation pass followed), per switch the change touched.
- read from what the app keeps anyway when Prometheus scrapes (:class:`ControllerCollector`): per-range
  packets and bytes from the switches' flow counters (the counters it publishes under ``counters/``), drops
  by reason, flows and groups per switch, the revision each switch holds beside the newest revision that
  changed what the controller compiles, and per service its ranges by whether a live endpoint serves them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vfab.vid import metrics
from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema

CUTOVER_SECONDS = Histogram("vfab_cutover_duration_seconds", "a change of etcd until the switch reported "
                            "holding it (bundle committed, datapath revalidated where it can be asked)", ["switch"],
                            buckets=metrics.DURATION_BUCKETS)
DECISIONS = Counter("vfab_balancer_decisions_total", "what the balancer decided (helpers_on, helpers_off, split, "
                    "merge)", ["service", "action"])
HELPEE_CPU = Gauge("vfab_helpee_cpu_per_request_seconds", "CPU a helpee (memcached) spent per request it served, "
                   "as the balancer last measured it (its rusage over its gets and sets)", ["service", "endpoint"])
DROPS = ("deny", "vid_miss", "guard", "spoofed")   # the counter names' prefixes of report.counters_from_stats


def cutover(dpid: int, since: float) -> None:
    """A switch reported holding a change that came at ``since`` (time.monotonic())."""
    CUTOVER_SECONDS.labels(f"{dpid:016x}").observe(time.monotonic() - since)


def helpee_cpu(service: str, endpoint: str, cpu: float | None, served: float | None) -> None:
    """The balancer measured a helpee's CPU s/s and requests/s (either may be unknown yet)."""
    if cpu is not None and served:
        HELPEE_CPU.labels(service, endpoint).set(cpu / served)


def range_states(items: dict[str, bytes]) -> dict[str, dict[str, int]]:
    """Per service, its ranges by state: ``served`` (a live owner), ``unassigned`` (nobody), ``owner_down``
    (its owner's endpoint record is gone, a live mirror can take over), ``lost`` (owner gone, no live mirror)."""
    live: set[tuple[str, str]] = set()
    ranges: list[tuple[str, schema.RangeRec]] = []
    for key, raw in items.items():
        parsed = schema.parse_key(key)
        if parsed is None or len(parsed[1]) != 2:
            continue
        folder, (service, name) = parsed
        if folder == "endpoints":
            live.add((service, name))
        elif folder == "ranges":
            try:
                ranges.append((service, schema.RangeRec.from_json(raw, key)))
            except RegistryError:
                continue
    out: dict[str, dict[str, int]] = {}
    for service, rec in ranges:
        counts = out.setdefault(service, dict.fromkeys(("served", "unassigned", "owner_down", "lost"), 0))
        if not rec.owner:
            counts["unassigned"] += 1
        elif (service, rec.owner) in live:
            counts["served"] += 1
        elif any((service, m) in live for m in rec.mirrors):
            counts["owner_down"] += 1
        else:
            counts["lost"] += 1
    return out


def service_names(items: dict[str, bytes]) -> dict[int, str]:
    """Service id -> name, from the mirror's ``services/`` records."""
    out = {}
    for key, raw in items.items():
        if key.startswith(schema.folder("services")):
            try:
                svc = json.loads(raw)
                out[int(svc["id"])] = str(svc["name"])
            except (ValueError, KeyError, TypeError):
                continue
    return out


def counter_families(per_switch: dict[int, dict[str, list[int]]], names: dict[int, str]) -> list:
    """The published flow counters (``{dpid: {name: [packets, bytes]}}``) as Prometheus families."""
    pk = CounterMetricFamily("vfab_range_packets", "packets the switch routed for a range (its route flows' "
                             "counters, summed)", labels=["switch", "service", "range"])
    by = CounterMetricFamily("vfab_range_bytes", "bytes the switch routed for a range", labels=["switch", "service",
                             "range"])
    dr = CounterMetricFamily("vfab_switch_dropped_packets", "packets the switch dropped, by reason (deny: a port "
                             "spoke for a MAC not its own; vid_miss: no range; guard, spoofed: front-door guards)",
                             labels=["switch", "reason"])
    for dpid, per in sorted(per_switch.items()):
        sw = f"{dpid:016x}"
        drops = dict.fromkeys(DROPS, 0)
        for name, (packets, nbytes) in per.items():
            head, _, tail = name.partition("/")
            if head in drops:
                drops[head] += packets
            elif head.isdigit():
                service = names.get(int(head), head)
                pk.add_metric([sw, service, tail], packets)
                by.add_metric([sw, service, tail], nbytes)
        for reason, n in drops.items():
            dr.add_metric([sw, reason], n)
    return [pk, by, dr]


class ControllerCollector:
    """What the app holds, read at scrape time (no lock is taken: dict copies are atomic under the GIL)."""

    def __init__(self, app: Any):
        self.app = app

    def describe(self) -> list:
        return []

    def collect(self):
        app = self.app
        items = dict(app.items)
        yield from counter_families(dict(app.reporter.last), service_names(items))
        flows = GaugeMetricFamily("vfab_switch_flows", "flows the controller installed on the switch", labels=["switch"])
        groups = GaugeMetricFamily("vfab_switch_groups", "OpenFlow groups the controller installed on the switch",
                                   labels=["switch"])
        for dpid, (fl, gr) in sorted(dict(app.installed).items()):
            flows.add_metric([f"{dpid:016x}"], len(fl))
            groups.add_metric([f"{dpid:016x}"], len(gr))
        yield flows
        yield groups
        applied = GaugeMetricFamily("vfab_switch_applied_revision", "the etcd revision the switch was last reported "
                                    "to hold", labels=["switch"])
        for dpid, rev in sorted(dict(app.reporter.reported).items()):
            applied.add_metric([f"{dpid:016x}"], rev)
        yield applied
        state = GaugeMetricFamily("vfab_controller_state_revision", "the newest etcd revision that changed what the "
                                  "controller compiles (every switch should reach it)")
        state.add_metric([], app.state_revision)
        yield state
        connected = GaugeMetricFamily("vfab_controller_switches", "switches connected to this controller")
        connected.add_metric([], len(app.conns))
        yield connected
        fam = GaugeMetricFamily("vfab_service_ranges", "a service's ranges by state: served (live owner), "
                                "unassigned, owner_down (a live mirror can take over), lost (no live owner or "
                                "mirror)", labels=["service", "state"])
        for service, counts in sorted(range_states(items).items()):
            for st, n in counts.items():
                fam.add_metric([service, st], n)
        yield fam


class NodeCollector:
    """A node agent's (``vfab node join``) record, read at scrape time: its tunnels' peers and the tunnel packets
    its underlay filter refused (``read()`` returns the agent's last ``schema.Node`` record, or None)."""

    def __init__(self, read):
        self.read = read

    def describe(self) -> list:
        return []

    def collect(self):
        rec = self.read()
        if rec is None:
            return
        peers = GaugeMetricFamily("vfab_node_peers", "nodes this node has a tunnel to", labels=["host"])
        peers.add_metric([rec.name], len(rec.peers))
        refused = CounterMetricFamily("vfab_node_refused_packets", "tunnel packets from addresses that are no node's, "
                                      "dropped by the underlay filter", labels=["host"])
        refused.add_metric([rec.name], rec.refused)
        yield peers
        yield refused
