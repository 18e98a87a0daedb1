"""Address blocks: which shard may hand out which address, through etcd (issue 44).

Every address of the pool has a **row key**, a key of the 24-bit VID key space; the shard that owns that key
(the range map, fenced by the ranges' revisions and epochs) is the only one that may hand the address out,
and the address's ``addr`` row lives under that key in the store, so the state layer copies, replicates and
drops it with the range (split, merge, move, mirror take it along with the leases).

* By default an address's row key is its **home key** (``pool.py``: address *i* at ``home(i)``, spread evenly
  over the key space): a shard's default share of the pool is the slice of its ranges.
* The **block table**, one etcd record per service (``schema.sdhcp_blocks_key``), lists **blocks**: index
  intervals ``[a, b]`` of the pool with an **anchor** key each, which overrides the home key of every address
  in them.  Whoever owns the anchor owns the block, and the block's rows live under the anchor.

A shard that runs low asks for addresses (a *want* record, ``agent.py``); a shard with spare ones lends some:
addresses it may hand out and **has never written a row for** (so no row of them exists anywhere: not here,
not at a mirror, not in a copy under way) become a block anchored at a key the borrower owns.  The lender
writes the new table in one etcd transaction that compares the table's revision (no two lenders build on the
same table), the want's (one answer per want) and the lender's range records' (it still owns what it lends):
so no address has two row keys at once, and no two shards ever offer the same address.  Because an address
changes its row key only while it has no row, no row is ever re-keyed, and the stores need no migration:
with an empty table (every service before this module) the rule is exactly the old home-key rule.

Record (this module owns it)::

    {"v": 1, "pool": "<fingerprint, 8 hex digits>", "blocks": [[a, b, anchor], ...]}

``a <= b`` are indexes into the pool (0 .. size-1), blocks sorted by ``a`` and disjoint; ``anchor`` a key.
"""

from __future__ import annotations

import bisect
import json
from typing import Iterable, Iterator

from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.pool import Pool, probe_order
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import Range

VERSION = 1
HOME = -1              # the anchor of an interval that follows the home keys (Blocks.owned)
MAX_BLOCKS = 20_000    # blocks in one table (~400 KB of JSON, well under etcd's 1.5 MB request limit)


class BlockError(DhcpError):
    """A block table that cannot be read or applied; the message says what and how to fix it."""


class Blocks:
    """The block table of a pool (immutable: a lend makes a new one)."""

    def __init__(self, pool: Pool, blocks: Iterable[tuple[int, int, int]] = (), revision: int = 0):
        self.pool = pool
        self.blocks: tuple[tuple[int, int, int], ...] = tuple(sorted((int(a), int(b), int(k)) for a, b, k in blocks))
        self.revision = revision          # etcd mod revision of the record (0: no record yet)
        self._starts = [a for a, _, _ in self.blocks]
        prev = -1
        for a, b, k in self.blocks:
            if not (prev < a <= b < pool.size) or not 0 <= k <= KEY_MAX:
                raise BlockError(f"block [{a}, {b}] -> {k:#x} overlaps another, is out of order, or lies outside "
                                 f"the pool of {pool.size} addresses: the block table is corrupt (edited by hand?); "
                                 "every lend is in its lender's log ('lent N addresses ... anchored at KEY'): "
                                 "rebuild the record from those")
            prev = b
        if len(self.blocks) > MAX_BLOCKS:
            raise BlockError(f"{len(self.blocks)} blocks, more than {MAX_BLOCKS}")
        self._owned: dict[tuple, tuple] = {}

    # -- one address --------------------------------------------------------------------------------
    def anchor(self, index: int) -> int | None:
        """The anchor of the block holding address ``index``; None: it follows its home key."""
        j = bisect.bisect_right(self._starts, index) - 1
        if j >= 0 and self.blocks[j][1] >= index:
            return self.blocks[j][2]
        return None

    def rowkey(self, ip: int) -> int:
        """The key that decides who may hand out ``ip`` (an address of the pool) and under which its row lives."""
        i = ip - self.pool.first
        k = self.anchor(i)
        return self.pool.home(i) if k is None else k

    def may(self, ranges: Iterable[Range], ip: int) -> bool:
        """Whether whoever holds ``ranges`` may hand out ``ip``."""
        if ip not in self.pool:
            return False
        k = self.rowkey(ip)
        return any(k in r for r in ranges)

    # -- what a shard holds -------------------------------------------------------------------------
    def owned(self, ranges: Iterable[Range]) -> tuple[tuple[int, int, int], ...]:
        """Sorted, disjoint index intervals ``(a, b, anchor)`` whose addresses ``ranges`` may hand out;
        anchor ``HOME``: each address's row key is its home key."""
        rs = tuple(sorted((r.lo, r.hi) for r in ranges))
        got = self._owned.get(rs)
        if got is not None:
            return got
        rngs = [Range(lo, hi) for lo, hi in rs]
        out: list[tuple[int, int, int]] = []
        for a, b in self.pool.slots(rngs):
            out += [(x, y, HOME) for x, y in self._minus_blocks(a, b)]
        out += [blk for blk in self.blocks if any(blk[2] in r for r in rngs)]
        out.sort()
        if len(self._owned) > 64:
            self._owned.clear()
        self._owned[rs] = got = tuple(out)
        return got

    def _minus_blocks(self, a: int, b: int) -> Iterator[tuple[int, int]]:
        j = max(0, bisect.bisect_right(self._starts, a) - 1)
        x = a
        while j < len(self.blocks) and self.blocks[j][0] <= b:
            ba, bb, _ = self.blocks[j]
            if bb >= x:
                if ba > x:
                    yield x, min(b, ba - 1)
                x = max(x, bb + 1)
            j += 1
        if x <= b:
            yield x, b

    def size(self, ranges: Iterable[Range]) -> int:
        return sum(b - a + 1 for a, b, _ in self.owned(ranges))

    def segments(self, key: int, ranges: Iterable[Range]) -> Iterator[tuple[int, int]]:
        """The owned index intervals in probe order for ``key``: from ``slot(key)`` upward, then wrapping."""
        yield from probe_order(((a, b) for a, b, _ in self.owned(ranges)), self.pool.slot(key))

    def count_anchored(self, ranges: Iterable[Range]) -> tuple[int, int]:
        """(blocks, addresses) of the table anchored in ``ranges`` (status)."""
        rngs = list(ranges)
        got = [b - a + 1 for a, b, k in self.blocks if any(k in r for r in rngs)]
        return len(got), sum(got)

    # -- lending ------------------------------------------------------------------------------------
    def lent(self, intervals: Iterable[tuple[int, int]], anchor: int, revision: int = 0) -> "Blocks":
        """This table with the addresses of ``intervals`` (indexes) anchored at ``anchor``; adjacent blocks of
        one anchor coalesce."""
        cut: list[tuple[int, int, int]] = list(self.blocks)
        for x, y in sorted(intervals):
            nxt = []
            for a, b, k in cut:
                if b < x or a > y:
                    nxt.append((a, b, k))
                    continue
                if a < x:
                    nxt.append((a, x - 1, k))
                if b > y:
                    nxt.append((y + 1, b, k))
            nxt.append((x, y, anchor))
            cut = nxt
        cut.sort()
        out: list[list[int]] = []
        for a, b, k in cut:
            if out and out[-1][2] == k and out[-1][1] + 1 == a:
                out[-1][1] = b
            else:
                out.append([a, b, k])
        return Blocks(self.pool, [tuple(x) for x in out], revision)

    # -- the record ---------------------------------------------------------------------------------
    def to_json(self, fingerprint: int) -> str:
        return json.dumps({"v": VERSION, "pool": f"{fingerprint:08x}", "blocks": [list(b) for b in self.blocks]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str, pool: Pool, fingerprint: int, revision: int = 0) -> "Blocks":
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or rec.get("v") != VERSION:
                raise ValueError(f"version {rec.get('v') if isinstance(rec, dict) else rec!r}, not {VERSION}")
            blocks = rec["blocks"]
            if not isinstance(blocks, list) or not all(
                    isinstance(x, list) and len(x) == 3 and all(isinstance(v, int) for v in x) for x in blocks):
                raise ValueError("blocks is not a list of [a, b, anchor] integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise BlockError(f"sdhcp block table unreadable: {exc}; this shard runs another vfab release than "
                             "the one that wrote it, or the record was edited by hand") from None
        if rec.get("pool") != f"{fingerprint:08x}":
            raise BlockError(f"the block table was written for pool fingerprint {rec.get('pool')}, this shard's is "
                             f"{fingerprint:08x}: every shard of a service needs the same pool, mask and server")
        return cls(pool, [tuple(x) for x in blocks], revision)


def runs(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indexes as maximal intervals."""
    out: list[list[int]] = []
    for i in sorted(indexes):
        if out and out[-1][1] + 1 == i:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [(a, b) for a, b in out]


__all__ = ["Blocks", "BlockError", "HOME", "runs"]
