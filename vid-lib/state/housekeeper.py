"""A stateful endpoint's background duties, off the data path: load reports, mirror takeover, cleanup.

* every ``LOAD_PERIOD`` s: the endpoint's keys and requests/s per range it owns
  or mirrors (``/vfab/v1/load/<service>/<endpoint>``, leased; the keys are counted again only when the
  store changed since, ``_count``).  Reports are not on the wall clock's beats, as the
  lease keepalives are: a burst that begins at a fixed offset from a beat (sdhcp's demo starts its
  clients right after the shards' reports show up) was then cut at the same place every time, half of a
  one-second burst in each of two reports, and the balancer missed its split (2026-11-29);
* on every new view: if an owner's endpoint record is gone (its lease expired)
  and this endpoint is the range's first live mirror, it takes the range over
  in one epoch-checked transaction (the old owner stopped serving before its
  lease could expire: see :mod:`.lease`);
* old copies of ranges that moved away (from ``DROP_DELAY`` s after the move on), and rows an incoming copy
  did not overwrite, are dropped a step at a time (each step on the loop's thread, between batches), paced
  by a thread of their own
  that never talks to etcd (an etcd that hangs must not hold up a copy's SYNC); a step that fails
  (disk full, I/O error) is retried every ``DROP_RETRY`` s;
* when the source of a copy to this endpoint falls silent, etcd is asked how its operation ended
  (the loop acts on the answer: an etcd that hangs stalls this thread, never the data path).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

from vfab.vid.errors import RegistryError, VfabError
from vfab.vid.registry import Registry, schema
from vfab.vid.state.view import read_view

if TYPE_CHECKING:
    from vfab.vid.state.hosting import HousekeepingHost

log = logging.getLogger("vfab.state.housekeeper")
LOAD_PERIOD = 1.0
DROP_RETRY = 5.0
COUNT_SHARE = 0.01   # of a core, at most, spent counting a range's records again for load reports


class Housekeeper:
    def __init__(self, loop: "HousekeepingHost"):
        self.loop = loop
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._drop_wake = threading.Event()
        self._last_error = ""
        self._asks: collections.deque = collections.deque()   # silent sources' copies (Incoming), any thread
        self._reread: int | None = None   # a lease generation whose map must be read again (loop thread sets it)
        self._taken = time.monotonic()    # when the request counts were last taken (load reports)
        self._counts: dict[tuple[int, int], tuple] = {}   # (lo, hi) → (count version, records, recount after)

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"housekeeper-{self.loop.name}", daemon=True).start()
        threading.Thread(target=self._run_drops, name=f"drops-{self.loop.name}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._drop_wake.set()

    def wake(self) -> None:
        self._wake.set()
        self._drop_wake.set()

    def ask_silent(self, inc) -> None:
        """(loop thread) Ask etcd how the operation of ``inc``'s silent source ended; the answer goes to the
        loop's ``_silent_answer``."""
        self._asks.append(inc)
        self._wake.set()

    def reread(self, generation: int) -> None:
        """(loop thread) The map read after the lease was granted anew (``generation``) came in older than the
        loop's own last write: read it again and hand it over as that generation's."""
        self._reread = generation
        self._wake.set()

    def _answer_reread(self, reg: Registry) -> None:
        gen = self._reread
        if gen is None:
            return
        view = read_view(reg, self.loop.service.name)   # etcd unreachable: raised, tried again next time
        self._reread = None
        self.loop.call(lambda: self.loop._set_view(view, generation=gen), wait=False)

    def _answer_asks(self, reg: Registry) -> None:
        """For each silent source: fence the range in etcd (unless etcd gives it to us: then the operation
        committed), then read the map; the loop commits or aborts by that.  Fencing first means the
        source's flip cannot commit after we decided to abort (that lost every key of a split once)."""
        lp = self.loop
        while self._asks:
            inc = self._asks.popleft()
            if lp.incoming.get(inc.range.lo) is not inc:
                continue   # the copy ended meanwhile (its ABORT or COMMIT was waiting): nothing to fence
            try:
                mine = reg.fence(lp.service.name, inc.range, lp.name, inc.mode) is not None
                view, error = read_view(reg, lp.service.name), ""
            except VfabError as exc:   # the loop asks again later (it must hear back, or it would never)
                view, mine, error = None, False, str(exc)
            lp.call(lambda inc=inc, view=view, mine=mine, error=error: lp._silent_answer(inc, view, mine, error),
                    wait=False)

    def _run(self) -> None:
        reg = Registry(self.loop.etcd)
        last_load = 0.0
        while not self._stop.is_set():
            self._wake.wait(LOAD_PERIOD / 2)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._answer_asks(reg)
                self._answer_reread(reg)
                self._takeover(reg)
                now = time.monotonic()
                if now - last_load >= LOAD_PERIOD:
                    last_load = now
                    self._report_load(reg)
            except VfabError as exc:
                if not self._stop.is_set():   # closing: the lease was just revoked under this step's feet
                    log.warning("%s: housekeeping: %s", self.loop.name, exc)
        reg.close()

    def _takeover(self, reg: Registry) -> None:
        lp = self.loop
        view = lp.view
        if not lp.lease.valid:
            return  # we may be the one who was away
        for rec in view.ranges:
            if lp.name not in rec.mirrors or not rec.owner or rec.owner in view.endpoints:
                continue
            live = sorted(m for m in rec.mirrors if m in view.endpoints)
            if not live or live[0] != lp.name:
                continue
            try:
                # The view's two watches (ranges, endpoints) can deliver a new range before its new owner's
                # endpoint record: ask etcd itself before taking a live owner's range.
                if any(e.name == rec.owner for e in reg.endpoints(lp.service.name)):
                    continue
            except RegistryError as exc:
                log.info("%s: cannot confirm that owner %s of %s is gone (%s): not taking it over now", lp.name,
                         rec.owner, rec.range, exc)
                continue
            try:
                rev = reg.assign(lp.service.name, rec.range, lp.name, expect_epoch=rec.epoch, mirrors=live[1:],
                                 helpers=rec.helpers)
            except RegistryError as exc:
                log.info("%s: takeover of %s lost: %s", lp.name, rec.range, exc)
                continue
            log.warning("%s: owner %s of %s is gone (lease expired): took the range over as its first mirror",
                        lp.name, rec.owner, rec.range)
            new = schema.RangeRec(lo=rec.lo, hi=rec.hi, owner=lp.name, mirrors=live[1:], helpers=rec.helpers,
                                  epoch=rec.epoch + 1)
            lp.call(lambda new=new, rev=rev: lp.took_over(new, rev), wait=False)

    def _report_load(self, reg: Registry) -> None:
        lp = self.loop
        mine = lp.view.held_by(lp.name)
        rates = lp.call(lp.take_rates)
        if not isinstance(rates, dict):
            return  # the loop is shutting down
        # per second of the time these counts cover: the wake-ups come every LOAD_PERIOD/2 or earlier, so a
        # report can follow the last one after up to 1.5 x LOAD_PERIOD (and later on a loaded machine)
        now = time.monotonic()
        span, self._taken = max(now - self._taken, 0.05), now
        rows = []
        for r in mine:   # [lo, hi, records, requests/s] and, if the backend tells, the median record key
            n = self._count(r.range)
            median = self._counts[(r.lo, r.hi)][3]
            rows.append([r.lo, r.hi, n, rates.get(r.lo, 0) / span] + ([median] if median is not None else []))
        held = {(r.lo, r.hi) for r in mine}
        for gone in [k for k in self._counts if k not in held]:
            del self._counts[gone]
        role = {f"{r.lo:06x}": "owner" if r.owner == lp.name else "mirror" for r in mine}
        reg.put(schema.load_key(lp.service.name, lp.name), schema.Load(at=time.time(), ranges=rows, role=role).to_json(),
                lease=lp.lease.id or None)

    def _count(self, rng) -> int:
        """The records in ``rng`` for a load report (with the key below which half of them lie, if the backend
        tells it: ``median_key``, kept beside the count): counted again only when the store changed since (its
        ``count_version``), and then not sooner than 100x the last count's CPU time after it (``COUNT_SHARE``).
        A SQL count over 100,000 lease rows costs ~18 ms of CPU once SQLite's cache has gone cold, and a
        report goes out every second: an idle shard counted its unchanged rows each time."""
        backend = self.loop.backend
        version_of = getattr(backend, "count_version", None)
        version = version_of() if version_of is not None else None
        now = time.monotonic()
        got = self._counts.get((rng.lo, rng.hi))
        if got is not None and version is not None and (got[0] == version or now < got[2]):
            return got[1]
        t0 = time.thread_time()
        n = backend.count(rng)
        median_key = getattr(backend, "median_key", None)
        median = median_key(rng, n) if median_key is not None and n >= 2 else None
        self._counts[(rng.lo, rng.hi)] = (version, n, now + (time.thread_time() - t0) / COUNT_SHARE, median)
        return n

    def _run_drops(self) -> None:
        while not self._stop.is_set():
            self._drop_wake.wait(DROP_RETRY)   # woken when there is something to drop
            self._drop_wake.clear()
            if self._stop.is_set() or not self.loop.drops_pending():
                continue
            if not self._drain_drops():   # it failed (disk full, I/O error): retry a while later
                self._stop.wait(DROP_RETRY)

    def _drain_drops(self) -> bool:
        """Drop old copies a step at a time (each step on the loop's thread); False if a step failed."""
        while not self._stop.is_set():
            got = self.loop.call(self.loop.drop_step)
            if not isinstance(got, tuple):
                return False  # the loop is shutting down
            left, error, wait = got
            if error:
                if error != self._last_error:
                    log.warning("%s: old copy not dropped yet: %s; retried every %.0f s", self.loop.name, error,
                                DROP_RETRY)
                self._last_error = error
                return False
            self._last_error = ""
            if not left:
                return True
            if wait > 0:   # an old copy not due yet (peer.DROP_DELAY); woken early by new work (a copy's
                self._drop_wake.wait(wait)   # clearing, which a SYNC waits for) or by stop()
                self._drop_wake.clear()
        return True
