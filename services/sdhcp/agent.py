"""A shard's block agent: keeps its block table current, asks for addresses when it runs low, lends spare ones.

The table and the rule are ``blocks.py``'s; this module is the protocol between shards, all through etcd
(``/vfab/v1/sdhcp/<service>/``):

* **Table.** Followed by a watch; a newer one is installed on the loop's thread (the store decides by it, the
  native lane is granted its new intervals at once, and DISCOVERs parked for want of an address are served
  again).  A shard hands out nothing before it has read the table, and nothing in a range it has just come to
  own (a split, a move, a mirror's takeover) before it has read the table again at a revision at least that of
  the range map that gave it the range (a lend the old owner made just before may not have reached its watch).
* **Want.** When the free addresses of a shard fall below ``low`` (``LOW_SHARE`` of what it may hand out, at
  least ``LOW_MIN``), or a DISCOVER found none, it writes ``wants/<shard>`` = ``{need, parked, anchor, at}``
  under its endpoint lease (a dead shard's want goes with it): ``need`` addresses to reach ``2 * low``,
  ``parked`` clients waiting now, ``anchor`` a key of its own where lent blocks are to be anchored.
* **Lend.** Every other shard looks at each want.  One with spare addresses (``lendable``: addresses it may hand
  out and has no row of, i.e. never handed out) **fences** them first, on its loop's thread: its table becomes
  the one it means to write, with them anchored at the borrower's key, so neither its loop nor its lane (granted
  anew, which waits out a pass under way) hands them out any more; what got a row meanwhile is taken back out.
  Then one etcd transaction compares the table's revision, the want's and those of the lender's range records
  holding the lent addresses' row keys, puts the new table and deletes the want.  Failed: the fence is lifted.
  A lender keeps ``min(low, lendable // 2)`` when it asks for nothing itself; a lender that asks too lends only
  to clients parked elsewhere, past its own parked ones, so the last free addresses of the pool reach whoever
  has a client waiting.

kill -9 anywhere in that: before the transaction nothing changed in etcd (the lender's fence dies with it, its
mirror takes over the table as etcd has it); after it the table in etcd is the truth for everyone, and the
borrower's rows of a block live under the block's anchor, so its mirror has them.  No address can be in two
shards' share at once, because only the owner of an address's row key changes it, under a compare of its
range records, and only while the address has no row anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from vfab.services.sdhcp.blocks import Blocks, BlockError, runs
from vfab.vid.errors import RegistryError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.sdhcp.agent")

TICK = 0.1            # s between two looks at the shard's free addresses
LOW_SHARE = 0.05      # a shard asks for addresses below this share of what it may hand out ...
LOW_MIN = 8           # ... or below this many
LEND_MAX = 4096       # addresses one lend hands over at most
WANT_AGAIN = 0.5      # s after which an unanswered want is written again (wakes lenders that missed it)
PARK_S = 2.0          # s a DISCOVER that found no address is kept for a retry (one DHCP retransmission)
ERROR_LOG_S = 10.0


@dataclass(frozen=True)
class Want:
    need: int
    parked: int
    anchor: int
    at: float

    def to_json(self) -> str:
        return json.dumps({"need": self.need, "parked": self.parked, "anchor": self.anchor, "at": self.at})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Want | None":
        try:
            d = json.loads(raw)
            w = cls(int(d["need"]), int(d["parked"]), int(d["anchor"]), float(d["at"]))
        except (ValueError, KeyError, TypeError):
            return None
        return w if w.need >= 0 and w.parked >= 0 and 0 <= w.anchor <= 0xFFFFFF else None


def low_water(size: int) -> int:
    return max(LOW_MIN, int(size * LOW_SHARE))


def lend_count(want: Want, lendable: int, low: int, own: Want | None) -> int:
    """How many addresses to lend for ``want`` with ``lendable`` spare, ``low`` our low-water mark and ``own``
    our own want (None: we ask for nothing)."""
    if own is None:
        keep = min(low, lendable // 2)
        return max(0, min(want.need, lendable - keep, LEND_MAX))
    return max(0, min(want.parked, lendable - own.parked, LEND_MAX))


def _pause(where: str) -> None:
    """Test hook (tests/integration): VFAB_SDHCP_LEND_PAUSE=before:S or after:S sleeps S s there in a lend."""
    spec = os.environ.get("VFAB_SDHCP_LEND_PAUSE", "")
    at, _, secs = spec.partition(":")
    if at == where and secs:
        log.warning("lend paused %s s %s its etcd transaction (VFAB_SDHCP_LEND_PAUSE)", secs, where)
        time.sleep(float(secs))


class BlockAgent:
    """The block side of one shard (``loop``: its ``SdhcpLoop``)."""

    def __init__(self, loop, registry: Registry):
        self.loop = loop
        self.reg = registry
        self.store = loop.backend.store
        self.service = loop.service.name
        self.name = loop.name
        self.key = schema.sdhcp_blocks_key(self.service)
        self.confirmed: Blocks | None = None      # the newest table read from etcd (loop thread installs it)
        self.checked: tuple = ()                  # owned ranges the table was read for at a fresh enough revision
        self.lending: tuple | None = None         # (runs, anchor) fenced for a lend under way (loop thread)
        self.wants: dict[str, tuple[Want, int]] = {}   # shard -> (want, mod revision)
        self.own: Want | None = None
        self.own_at = 0.0
        self.counters = {"lent": 0, "lends": 0, "lend_conflicts": 0, "borrows": 0, "wants": 0, "tables": 0,
                         "borrow_ms_last": 0, "borrow_ms_max": 0}
        self._asked_at = 0.0   # monotonic s of the first want not answered yet by a lend to this shard
        self._wake = threading.Event()
        self._refresh = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._logged = 0.0
        self._threads: list[threading.Thread] = []

    # -- threads --------------------------------------------------------------------------------
    def start(self) -> None:
        self._read_table()   # before serving: a shard hands out nothing it has not seen the table for
        for target, name in ((self._follow, "sdhcp-blocks"), (self._work, "sdhcp-lend")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def nudge(self) -> None:
        """A DISCOVER found no address: look now, not at the next tick."""
        self._wake.set()

    def _error(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._logged >= ERROR_LOG_S:
            self._logged = now
            log.warning("%s: blocks: %s: %s (retrying)", self.name, what, exc)

    def _follow(self) -> None:
        def reset(items: dict, rev: int) -> None:
            with self._lock:
                self.wants = {}
            self._take(items.items())

        def apply(batch: list) -> None:
            self._take([(ev.key, None if ev.value is None else (ev.value, ev.revision)) for ev in batch])

        self.reg.follow(schema.sdhcp_prefix(self.service), reset, apply, self._stop, idle=10.0,
                        on_error=lambda exc, first: self._error("watching the table and the wants", exc))

    def _take(self, items) -> None:
        wp = schema.sdhcp_want_prefix(self.service)
        for key, val in items:
            if key == self.key and val is not None:
                self._offer_table(val[0], val[1])
            elif key.startswith(wp):
                shard = key[len(wp):]
                with self._lock:
                    want = Want.from_json(val[0]) if val is not None else None
                    if want is None:
                        self.wants.pop(shard, None)
                    else:
                        self.wants[shard] = (want, val[1])
        self._wake.set()

    def _offer_table(self, raw: bytes, revision: int) -> None:
        try:
            table = Blocks.from_json(raw, self.store.pool, self.store.fp, revision)
        except BlockError as exc:
            self._error("the table in etcd", exc)
            return
        self.loop.call(lambda: self.install(table), wait=False)

    def _read_table(self) -> None:
        """Read the table now (start, and after the shard's owned ranges changed): install it and mark the
        ranges owned at that revision as checked."""
        got = self.reg.get_many([self.key])
        rev, items = got
        raw = items.get(self.key)
        table = Blocks(self.store.pool) if raw is None else Blocks.from_json(raw[0], self.store.pool, self.store.fp,
                                                                             raw[1])

        def done() -> None:
            self.install(table)
            if self.loop.view.revision <= rev:
                self.checked = tuple(r.range for r in self.loop.view.owned_by(self.name))
            else:
                self._refresh.set()   # the map moved on meanwhile: read again
                self._wake.set()
            self.loop.blocks_changed()

        self.loop.call(done, wait=self.loop._thread is not None)

    # -- the loop's thread ------------------------------------------------------------------------
    def install(self, table: Blocks) -> None:
        """(loop thread) A table read from etcd: decide by it if it is newer."""
        if self.confirmed is not None and table.revision <= self.confirmed.revision:
            return
        mine = self.loop.allocatable()
        before = self.store.blocks.count_anchored(mine)[1]
        self.confirmed = table
        self.counters["tables"] += 1
        self._apply()
        if self._asked_at and table.count_anchored(mine)[1] > before:   # a lend to us: how long we waited
            ms = int((time.monotonic() - self._asked_at) * 1000)
            self._asked_at = 0.0
            self.counters["borrows"] += 1
            self.counters["borrow_ms_last"] = ms
            self.counters["borrow_ms_max"] = max(self.counters["borrow_ms_max"], ms)

    def _apply(self) -> None:
        table = self.confirmed or Blocks(self.store.pool)
        if self.lending is not None:
            table = table.lent(*self.lending, revision=table.revision)
        if table.blocks != self.store.blocks.blocks or table.revision != self.store.blocks.revision:
            self.store.blocks = table
            self.store._may_free()
            self.loop.blocks_changed()

    def allowed(self, owned: list[Range]) -> list[Range]:
        """(loop thread) Of the owned ranges, those the table was read for (see the module's docstring)."""
        if self.confirmed is None:
            return []
        out = [r for r in owned if any(c.lo <= r.lo and r.hi <= c.hi for c in self.checked)]
        if len(out) != len(owned):
            self._refresh.set()
            self._wake.set()
        return out

    def _fence(self, anchor: int, count: int):
        """(loop thread) Fence up to ``count`` addresses to lend; (runs, row keys' ranges) or None."""
        try:
            return self._fence_some(anchor, count)
        except BaseException:
            self.lending = None   # never leave addresses fenced for a lend that will not happen
            self._apply()
            raise

    def _fence_some(self, anchor: int, count: int):
        if not self.loop._authoritative() or self.lending is not None or self.confirmed is None:
            return None
        ranges = self.loop.allocatable()
        if not ranges or any(anchor in r for r in ranges):
            return None   # a want anchored in our own ranges (a stale one): nothing to hand over
        pool, table = self.store.pool, self.store.blocks
        picked: list[int] = []
        for a, b, _ in reversed(table.owned(ranges)):
            picked += self.store.rowless(pool.first + a, pool.first + b, count - len(picked))
            if len(picked) >= count:
                break
        if not picked:
            return None
        self.lending = (runs(ip - pool.first for ip in picked), anchor)
        self._apply()                              # nobody here hands them out from now on (the lane re-granted)
        lo, hi = min(picked), max(picked)
        ok = set(self.store.rowless(lo, hi, hi - lo + 1))
        kept = [ip for ip in picked if ip in ok]   # one got a row before the fence: it stays ours
        if not kept:
            self.lending = None
            self._apply()
            return None
        if len(kept) != len(picked):
            self.lending = (runs(ip - pool.first for ip in kept), anchor)
            self._apply()
        recs = [self.loop.view.find(table.rowkey(ip)) for ip in kept]
        if any(r is None or r.owner != self.name for r in recs):
            self.lending = None
            self._apply()
            return None
        return self.lending[0], sorted({r.lo for r in recs}), self.loop.view.revision

    def _settle(self, table: Blocks | None) -> None:
        """(loop thread) The lend's transaction ended: with the table it wrote, or None (failed)."""
        self.lending = None
        if table is not None:
            self.install(table)
        self._apply()

    # -- the worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._refresh.is_set():
                    self._refresh.clear()
                    self._read_table()
                self._ask()
                self._lend()
            except (RegistryError, BlockError) as exc:
                self._error("asking for or lending addresses", exc)
            except Exception:  # noqa: BLE001 - a bug here must not stop the shard from asking and lending
                log.exception("%s: blocks: asking for or lending addresses failed", self.name)
                self._stop.wait(1.0)

    def _free(self) -> tuple[int, int, int]:
        """(size, free, anchor) of what this shard may hand out now (read on the loop's thread)."""
        def look():
            ranges = self.loop.allocatable()
            segs = self.store.blocks.owned(ranges)
            now = int(self.loop.backend.clock() * 1000)
            size = sum(b - a + 1 for a, b, _ in segs)
            taken = sum(self.store.taken(self.store.pool.first + a, self.store.pool.first + b, now)
                        for a, b, _ in segs)
            anchor = ranges[0].lo + (ranges[0].hi - ranges[0].lo) // 2 if ranges else -1
            return size, size - taken, anchor
        got = self.loop.call(look, timeout=5.0)
        return got if isinstance(got, tuple) else (0, 0, -1)

    def _ask(self) -> None:
        size, free, anchor = self._free()
        parked = self.loop.parked_count()
        low = low_water(size)
        key = schema.sdhcp_want_key(self.service, self.name)
        if anchor < 0 or (free >= low and not parked):
            if self.own is not None and (free >= 2 * low or anchor < 0):
                self.own = None
                self._asked_at = 0.0
                self.reg.delete(key)
            return
        want = Want(max(2 * low - free, parked), parked, anchor, time.time())
        with self._lock:
            posted = self.wants.get(self.name)
        fresh = posted is not None and (posted[0].need, posted[0].parked) == (want.need, want.parked)
        if fresh and (not want.parked or time.monotonic() - self.own_at < WANT_AGAIN):
            return   # asked already (again every WANT_AGAIN while clients wait, for lenders that missed it)
        self.own, self.own_at = want, time.monotonic()
        if not self._asked_at:
            self._asked_at = self.own_at
        self.reg.put(key, want.to_json(), lease=self.loop.lease.id or None)
        self.counters["wants"] += 1

    def _lend(self) -> None:
        with self._lock:
            wants = [(s, w, rev) for s, (w, rev) in self.wants.items() if s != self.name]
        if not wants:
            return
        size, free, _ = self._free()
        own = self.own
        for shard, want, rev in sorted(wants, key=lambda x: -x[1].parked):
            lendable_now = self.loop.call(self._lendable, timeout=5.0)
            if not isinstance(lendable_now, int):
                return
            n = lend_count(want, lendable_now, low_water(size), own)
            if n > 0:
                self._lend_to(shard, want, rev, n)

    def _lendable(self) -> int:
        ranges = self.loop.allocatable()
        pool = self.store.pool
        return sum(len(self.store.rowless(pool.first + a, pool.first + b, LEND_MAX))
                   for a, b, _ in self.store.blocks.owned(ranges))

    def _lend_to(self, shard: str, want: Want, want_rev: int, n: int) -> None:
        fenced = self.loop.call(lambda: self._fence(want.anchor, n), timeout=5.0)
        if not isinstance(fenced, tuple):
            return
        lent_runs, range_los, view_rev = fenced
        ok, table = False, None
        try:
            _pause("before")
            base = self.confirmed
            new = base.lent(lent_runs, want.anchor)
            wkey = schema.sdhcp_want_key(self.service, shard)
            rkeys = [schema.range_key(self.service, lo) for lo in range_los]
            _, items = self.reg.get_many(rkeys)
            compares = [self.reg.cmp_mod(self.key, base.revision), self.reg.cmp_mod(wkey, want_rev)]
            for rk in rkeys:
                got = items.get(rk)
                # the range as the fence saw it (not changed since the map it decided by), still ours
                if got is None or got[1] > view_rev or schema.RangeRec.from_json(got[0], rk).owner != self.name:
                    return
                compares.append(self.reg.cmp_mod(rk, got[1]))
            ok, rev = self.reg.txn(compares, {self.key: new.to_json(self.store.fp)}, deletes=[wkey])
            if ok:
                table = Blocks(self.store.pool, new.blocks, rev)
                lent = sum(b - a + 1 for a, b in lent_runs)
                self.counters["lends"] += 1
                self.counters["lent"] += lent
                log.info("%s: lent %d addresses (%d blocks: pool indexes %s) to %s, anchored at %#x (table revision "
                         "%d)", self.name, lent, len(lent_runs),
                         ",".join(f"{x}-{y}" for x, y in lent_runs[:32]) + ("..." if len(lent_runs) > 32 else ""),
                         shard, want.anchor, rev)
                _pause("after")
            else:
                self.counters["lend_conflicts"] += 1
        finally:
            self.loop.call(lambda: self._settle(table), wait=False)


__all__ = ["BlockAgent", "Want", "lend_count", "low_water", "PARK_S"]
