"""A stateful endpoint's background duties, off the data path: load reports, mirror takeover, cleanup.

* every ``LOAD_PERIOD`` s: the endpoint's keys and requests/s per range it owns
  or mirrors (``/vfab/v1/load/<service>/<endpoint>``, leased);
* on every new view: if an owner's endpoint record is gone (its lease expired)
  and this endpoint is the range's first live mirror, it takes the range over
  in one epoch-checked transaction (the old owner stopped serving before its
  lease could expire: see :mod:`.lease`);
* old copies that could not be dropped (disk full, I/O error) are retried.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from vfab.vid.errors import RegistryError, VfabError
from vfab.vid.registry import Registry, schema

if TYPE_CHECKING:
    from vfab.vid.state.loop import EndpointLoop

log = logging.getLogger("vfab.state.housekeeper")
LOAD_PERIOD = 1.0
DROP_RETRY = 5.0


class Housekeeper:
    def __init__(self, loop: "EndpointLoop"):
        self.loop = loop
        self._stop = threading.Event()
        self._wake = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"housekeeper-{self.loop.name}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        reg = Registry(self.loop.etcd)
        last_load = last_drop = 0.0
        while not self._stop.is_set():
            self._wake.wait(LOAD_PERIOD / 2)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._takeover(reg)
                now = time.monotonic()
                if now - last_load >= LOAD_PERIOD:
                    last_load = now
                    self._report_load(reg)
                if self.loop.pending_drops and now - last_drop >= DROP_RETRY:
                    last_drop = now
                    self._retry_drops()
            except VfabError as exc:
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
                rev = reg.assign(lp.service.name, rec.range, lp.name, expect_epoch=rec.epoch, mirrors=live[1:],
                                 helpers=rec.helpers)
            except RegistryError as exc:
                log.info("%s: takeover of %s lost: %s", lp.name, rec.range, exc)
                continue
            log.warning("%s: owner %s of %s is gone (lease expired): took the range over as its first mirror",
                        lp.name, rec.owner, rec.range)
            new = schema.RangeRec(lo=rec.lo, hi=rec.hi, owner=lp.name, mirrors=live[1:], helpers=rec.helpers,
                                  epoch=rec.epoch + 1)
            lp.call(lambda new=new, rev=rev: lp._patch(new, rev), wait=False)

    def _report_load(self, reg: Registry) -> None:
        lp = self.loop
        mine = lp.view.held_by(lp.name)
        rates, lp.rates = lp.rates, {}
        rows = [[r.lo, r.hi, lp.backend.count(r.range), rates.get(r.lo, 0) / LOAD_PERIOD] for r in mine]
        role = {f"{r.lo:06x}": "owner" if r.owner == lp.name else "mirror" for r in mine}
        reg.put(schema.load_key(lp.service.name, lp.name), schema.Load(at=time.time(), ranges=rows, role=role).to_json(),
                lease=lp.lease.id or None)

    def _retry_drops(self) -> None:
        lp = self.loop
        held = [r.range for r in lp.view.held_by(lp.name)] + [i.range for i in list(lp.incoming.values())]
        for rng in list(lp.pending_drops):
            if any(rng.overlaps(h) for h in held):
                lp.pending_drops.remove(rng)  # ours again: nothing to drop
                continue
            try:
                n = lp.backend.drop(rng)
            except VfabError as exc:
                log.warning("%s: old copy of %s still not dropped: %s", lp.name, rng, exc)
                continue
            lp.pending_drops.remove(rng)
            log.info("%s: old copy of %s dropped (%d records)", lp.name, rng, n)
