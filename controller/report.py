"""What the controller tells etcd: applied revisions per switch, and flow counters under a lease.

``counters_from_stats`` is pure (flow-stats rows → the published counter
names); ``Reporter`` does the writes.  Key names and records come from the
registry's schema.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterable

from vfab.fabric.flows import Kind, split_cookie
from vfab.vid.registry import schema

log = logging.getLogger("vfab.controller")

# Flows whose counters are published: (cookie kind, table).
COUNTED = ((Kind.VID_ROUTE, 1), (Kind.VID_MISS, 1), (Kind.DENY, 0), (Kind.GUARD, 0), (Kind.SPOOF, 0))


def counters_from_stats(stats: Iterable[tuple[int, int, int, int]]) -> dict[str, list[int]]:
    """{name: [packets, bytes]} from (table, cookie, packets, bytes) rows.

    Names: ``<service id>/<range lo as 6 hex digits>`` for a range's route blocks
    (summed), ``deny/<port>`` and ``vid_miss/0`` for the drop flows, ``guard/<service id>`` for a service's
    answers dropped on ports with no server of it (summed), ``spoofed/<service id>`` for its front-door requests
    dropped for a source address their host is not registered with (summed).
    """
    per: dict[str, list[int]] = {}
    for table, cookie, packets, nbytes in stats:
        kind, service, lo, _ = split_cookie(cookie)
        if kind == Kind.VID_ROUTE and table == 1:
            name = f"{service}/{lo:06x}"
        elif kind in (Kind.DENY, Kind.VID_MISS):
            name = f"{Kind(kind).name.lower()}/{lo}"
        elif kind == Kind.GUARD:
            name = f"guard/{service}"
        elif kind == Kind.SPOOF:
            name = f"spoofed/{service}"
        else:
            continue
        acc = per.setdefault(name, [0, 0])
        acc[0] += packets
        acc[1] += nbytes
    return per


class Reporter:
    """Writes the controller's reports; the counters live under one lease (they vanish with the controller)."""

    def __init__(self, registry, poll: float, clock: Callable[[], float] = time.time):
        self.registry = registry
        self.ttl = max(int(poll * 10), 10)
        self.clock = clock
        self.lease: int | None = None
        self._lease_stop = None
        self.reported: dict[int, int] = {}   # dpid -> last revision reported applied
        self.last: dict[int, dict[str, list[int]]] = {}   # dpid -> the counters last polled (ctlmetrics)

    def applied(self, dpid: int, revision: int, flows: int, groups: int, committed: float = 0.0,
                datapath: bool = False) -> bool:
        """Publish that ``dpid`` holds ``revision`` (see ``schema.Applied``); False (logged) if etcd refused."""
        try:
            rec = schema.Applied(dpid=dpid, revision=revision, flows=flows, groups=groups, at=self.clock(),
                                 committed=committed or self.clock(), datapath=datapath)
            self.registry.put(schema.applied_key(dpid), rec.to_json(), repeat=True)   # ours alone
            self.reported[dpid] = revision
            return True
        except Exception as exc:
            log.warning("switch %016x: could not report applied revision %d: %s", dpid, revision, exc)
            return False

    def forget(self, dpid: int) -> None:
        """The switch (re)connected: its next applied revision is reported whatever it is."""
        self.reported.pop(dpid, None)

    def counters(self, dpid: int, per: dict[str, list[int]]) -> None:
        self.last[dpid] = per
        if self.lease is None:
            self.lease = self.registry.lease(self.ttl)
            self._lease_stop = self.registry.keepalive(self.lease, self.ttl)
        try:
            self.registry.put(schema.counters_key(dpid), json.dumps({"at": self.clock(), "counters": per}),
                              lease=self.lease)
        except Exception:
            self._lease_stop.set()  # lease lost (e.g. etcd restarted): take a new one next time
            self.lease = None
            raise
