"""What a stateful endpoint knows of its service: the range map and live endpoints, kept by etcd watches.

A :class:`View` is an immutable snapshot (replaced, never changed, so threads
share it without locks) tagged with the etcd revision it reflects.
:class:`ViewWatcher` keeps one current from two watches (the service's ranges
and endpoints) and hands each new snapshot to a callback within milliseconds
of the etcd write.  When a watch breaks (etcd restarted, compacted) it reloads
and re-watches.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.state.view")
RETRY = 0.3  # s between attempts to re-watch a broken etcd stream
# s without events after which a watch is renewed (and the stop flag checked).  A renewal is a new HTTP
# watch request: ~1.4 ms of the endpoint's CPU and as much of etcd's; at 1 s the two watches were most of an
# idle sdhcp shard's ~9 ms of CPU per second.  A broken stream (etcd restarted) is noticed at once anyway.
IDLE = 10.0


@dataclass(frozen=True)
class View:
    ranges: tuple = ()                               # RangeRec, by lo
    endpoints: dict = field(default_factory=dict)    # name -> Endpoint (live: leased)
    revision: int = 0                                # etcd revision of the range map (at least)

    def find(self, vk: int) -> schema.RangeRec | None:
        for rec in self.ranges:
            if rec.lo <= vk <= rec.hi:
                return rec
        return None

    def owned_by(self, name: str) -> list[schema.RangeRec]:
        return [r for r in self.ranges if r.owner == name]

    def held_by(self, name: str) -> list[schema.RangeRec]:
        """Ranges ``name`` owns or mirrors."""
        return [r for r in self.ranges if r.owner == name or name in r.mirrors]

    def patched(self, rec: schema.RangeRec) -> "View":
        """This view with ``rec`` in place of the ranges it overlaps (what our own etcd write just did)."""
        keep = [r for r in self.ranges if not r.range.overlaps(rec.range)]
        cut = []
        for r in self.ranges:
            if r.range.overlaps(rec.range):
                cut += [replace(r, lo=p.lo, hi=p.hi) for p in r.range.subtract(rec.range)]
        return replace(self, ranges=tuple(sorted([*keep, *cut, rec], key=lambda r: r.lo)))


def read_view(reg: Registry, service: str) -> View:
    """A fresh view straight from etcd (both prefixes at one revision or later)."""
    rev1, ranges = reg.get_prefix(schema.range_prefix(service))
    rev2, eps = reg.get_prefix(schema.endpoint_prefix(service))
    return View(ranges=tuple(_ranges(ranges)), endpoints=_endpoints(eps), revision=rev1)


def _ranges(items: dict) -> list[schema.RangeRec]:
    out = []
    for key, (raw, *_rest) in items.items():
        try:
            out.append(schema.RangeRec.from_json(raw, key))
        except RegistryError as exc:
            log.warning("ignoring %s", exc)
    return sorted(out, key=lambda r: r.lo)


def _endpoints(items: dict) -> dict:
    out = {}
    for key, (raw, *_rest) in items.items():
        try:
            ep = schema.Endpoint.from_json(raw, key)
            out[ep.name] = ep
        except RegistryError as exc:
            log.warning("ignoring %s", exc)
    return out


class ViewWatcher:
    """Keeps a :class:`View` of ``service`` current; calls ``on_view(view)`` on every change."""

    def __init__(self, endpoint: str, service: str, on_view):
        self.endpoint = endpoint
        self.service = service
        self.on_view = on_view
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ranges: dict = {}
        self._eps: dict = {}
        self._revs = [0, 0]

    def start(self) -> None:
        for i, prefix in enumerate((schema.range_prefix(self.service), schema.endpoint_prefix(self.service))):
            threading.Thread(target=self._run, args=(i, prefix), name=f"view-{i}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()  # the watch threads notice within IDLE s (closing a stream another thread reads blocks)

    def _emit(self) -> None:
        # on_view under the lock (it only hands the view to the loop): the two watch threads' views then reach
        # the loop in the order they were made.  Outside it, the endpoints thread's first view, made before
        # the ranges were loaded (no ranges, revision 0), could arrive after the ranges thread's and stay
        # the loop's view until the next event: a shard that had just claimed its range owned nothing and
        # answered every request "unroutable" (seen once in bench/sdhcp_lease.py, for 15 s).
        with self._lock:
            view = View(ranges=tuple(_ranges(self._ranges)), endpoints=_endpoints(self._eps),
                        revision=self._revs[0])
            self.on_view(view)

    def _run(self, i: int, prefix: str) -> None:
        reg = Registry(self.endpoint)
        store = self._ranges if i == 0 else self._eps

        def reset(items: dict, rev: int) -> None:
            with self._lock:
                store.clear()
                store.update({k: (v,) for k, (v, _) in items.items()})
                self._revs[i] = rev
            self._emit()

        def apply(batch: list) -> None:
            with self._lock:
                for ev in batch:
                    if ev.value is None:
                        store.pop(ev.key, None)
                    else:
                        store[ev.key] = (ev.value,)
                    self._revs[i] = max(self._revs[i], ev.revision)
            self._emit()

        def failed(exc: Exception, first: bool) -> None:
            if first and self._revs[i]:   # once per outage, and not while the first read fails (said elsewhere)
                log.warning("%s: watch of %s: %s; retrying every %.1f s", self.service, prefix, exc, RETRY)

        try:
            reg.follow(prefix, reset, apply, self._stop, idle=IDLE, retry=RETRY, on_error=failed)
        finally:
            reg.close()
