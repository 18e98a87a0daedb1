"""Prometheus metrics of every long-running vfab process: the one module that owns the plumbing.

A process declares its metrics with ``prometheus_client`` (``Counter``, ``Gauge``, ``Histogram`` at module
level, or a collector that reads numbers it already keeps at scrape time) and updates them; this module
starts its exporter and makes it findable::

    exporter = metrics.start(args, "endpoint", "kvs-a", etcd="127.0.0.1:2379", service="kvs")

serves ``/metrics`` on ``--metrics-host`` (loopback unless the host's control address is given) and
``--metrics-port`` (0: a free port), and registers the address in etcd under
``/vfab/v1/metrics/<process>/<service or ->/<name>`` (a ``schema.MetricsTarget``) under a lease of its own: the key
vanishes with the process, and comes back if etcd lost the lease.  ``vfab metrics targets --out FILE``
turns the registered targets into a Prometheus ``file_sd`` file (:func:`file_sd`), so one Prometheus finds
every target of a fabric, on one host or many.

Conventions (checked by :func:`check_name` in the unit tests over every declared family): names start with
``vfab_``, counters end in ``_total``, durations are histograms in ``_seconds``, sizes in ``_bytes``; labels
are drawn from a bounded set (``service``, ``endpoint``, ``range``, ``switch``, ``op``, ``phase``, ...),
never a key, a client or a request id.

``--no-metrics`` (``disable()``) turns the hooks of the hot paths off (``enabled()`` is False): what the
exporters cost is measured against that (``bench/metrics_cost.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import time

from prometheus_client import REGISTRY, start_http_server

__all__ = ["REGISTRY", "Exporter", "add_arguments", "configure", "start", "targets", "file_sd", "write_file_sd"]

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.metrics")

PREFIX = "vfab_"
TTL = 10   # s: a dead process's target leaves etcd this long after it died
# Durations from sub-millisecond (a batch of requests, an etcd read) to seconds (a state operation)
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)
LABELS = frozenset({"service", "endpoint", "range", "switch", "host", "op", "phase", "outcome", "event", "type",
                    "action", "result", "reason", "state", "le", "quantile"})
UNITS = ("_seconds", "_bytes", "_total", "_keys", "_requests", "_ratio", "_info", "_created")
_NAME_RE = re.compile(r"^vfab_[a-z][a-z0-9_]*$")

_enabled = True


def enabled() -> bool:
    """False when the process runs with ``--no-metrics``: hooks on hot paths do nothing."""
    return _enabled


def disable() -> None:
    global _enabled
    _enabled = False


def check_name(name: str, kind: str, labels: list[str] | tuple = ()) -> None:
    """ValueError unless a metric family follows the conventions above (``kind``: counter, gauge, histogram)."""
    if not _NAME_RE.match(name):
        raise ValueError(f"metric {name!r}: names are vfab_ and snake_case (a-z, 0-9, _)")
    if kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")
    if kind != "counter" and name.endswith("_total"):
        raise ValueError(f"{kind} {name!r} must not end in _total (only counters do)")
    if kind == "histogram" and not name.endswith(("_seconds", "_bytes", "_keys", "_requests")):
        raise ValueError(f"histogram {name!r} must say its unit: _seconds, _bytes, _keys or _requests")
    for bad in ("_ms", "_us", "_milliseconds", "_kb", "_mb"):
        if bad + "_" in name + "_":
            raise ValueError(f"metric {name!r}: use base units (_seconds, _bytes), not {bad}")
    for label in labels:
        if label not in LABELS:
            raise ValueError(f"metric {name!r}: label {label!r} is not one of the bounded labels "
                             f"{', '.join(sorted(LABELS))}")


def vfab_families(registry=REGISTRY) -> list:
    """(name, type, label names) of every vfab_ family the registry exposes now."""
    out = []
    for fam in registry.collect():
        if fam.name.startswith(PREFIX):
            labels = sorted({k for s in fam.samples for k in s.labels})
            out.append((fam.name + ("_total" if fam.type == "counter" else ""), fam.type, labels))
    return out


# -- the exporter ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--metrics-port``, ``--metrics-host``, ``--no-metrics`` for a process's command line."""
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="port of this process's Prometheus /metrics (default 0: any free port; the address is "
                        "registered in etcd, see 'vfab metrics targets')")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                   help="address /metrics listens on (default 127.0.0.1; the host's control address for a "
                        "Prometheus on another machine)")
    p.add_argument("--no-metrics", action="store_true", help="no /metrics, and no metrics kept on hot paths")


class Exporter:
    """A started ``/metrics`` server and its registration in etcd."""

    def __init__(self, process: str, name: str, host: str = "127.0.0.1", port: int = 0, service: str = "",
                 registry=REGISTRY):
        if not 0 <= port < 65536:
            raise RegistryError(f"metrics port {port} is out of range: 0..65535 (0: any free port)")
        schema.metrics_key(process, name, service)   # checks them
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise RegistryError(f"cannot serve metrics on {host}:{port}: {exc.strerror}: give another "
                                "--metrics-port (0 picks a free one) or --metrics-host") from None
        self.port = self.server.server_port
        self.addr = f"{host}:{self.port}"
        self.target = schema.MetricsTarget(process=process, name=name, addr=self.addr, service=service,
                                           host=socket.gethostname(), pid=os.getpid(), at=time.time())
        self.key = schema.metrics_key(process, name, service)
        self.lease = None
        log.info("metrics of %s %s on http://%s/metrics", process, name, self.addr)

    def register(self, etcd: str, ttl: int = TTL) -> None:
        """Publish the target under a lease of its own, kept alive (and the key put back if etcd lost it)."""
        from vfab.vid.state.lease import EndpointLease

        self.lease = EndpointLease(etcd, ttl, f"metrics-{self.target.name}")
        self.lease.on_renewed.append(lambda lease_id: self._put(lease_id))
        self._put(self.lease.grant())
        self.lease.start()

    def _put(self, lease_id: int) -> None:
        self.lease.reg.put(self.key, self.target.to_json(), lease=lease_id)

    def close(self) -> None:
        if self.lease is not None:
            self.lease.revoke()   # the key goes with it
            self.lease = None
        self.server.shutdown()
        self.server.server_close()


def configure(args: argparse.Namespace) -> None:
    """Take ``--no-metrics`` into account: call before the process builds what holds hooks."""
    if getattr(args, "no_metrics", False):
        disable()


def start(args: argparse.Namespace, process: str, name: str, etcd: str | None = None,
          service: str = "") -> Exporter | None:
    """The process's exporter as its options say (None with ``--no-metrics``), registered in etcd when
    ``etcd`` is given.  Failing to register is logged, not fatal: the process serves without being found."""
    configure(args)
    if not enabled():
        return None
    exp = Exporter(process, name, getattr(args, "metrics_host", "127.0.0.1"), getattr(args, "metrics_port", 0),
                   service=service)
    if etcd:
        try:
            exp.register(etcd)
        except RegistryError as exc:
            log.warning("metrics of %s %s not registered in etcd (%s): Prometheus will not find it", process, name,
                        exc)
    return exp


# -- finding the targets ---------------------------------------------------------------------------------------
def targets(reg: Registry) -> list[schema.MetricsTarget]:
    """Every registered exporter of the fabric, by process kind and name."""
    _, items = reg.get_prefix(schema.metrics_prefix())
    recs = [t for _, t, _ in schema.records(items, schema.MetricsTarget)]
    return sorted(recs, key=lambda t: (t.process, t.name))


def file_sd(found: list[schema.MetricsTarget]) -> list[dict]:
    """Prometheus ``file_sd`` target groups: one per target, labelled with its process kind, name, service
    and host (``vfab_`` prefixed: they never collide with the metrics' own labels)."""
    out = []
    for t in found:
        labels = {"vfab_process": t.process, "vfab_name": t.name, "vfab_host": t.host}
        if t.service:
            labels["vfab_service"] = t.service
        out.append({"targets": [t.addr], "labels": labels})
    return out


def write_file_sd(path: str, groups: list[dict]) -> None:
    """Write ``groups`` atomically (Prometheus re-reads the file when it changes; never half of it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(groups, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
