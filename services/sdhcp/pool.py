"""Which shard may hand out which address: the pool slice follows the key range.

Each address of a pool of N has a fixed **home key** in the 24-bit key space,
spread evenly over it; a client's **first choice** is the address whose home
is the nearest at or below the client's own key (its MAC's key, ``vfab.vid.mackey``)::

    slot(k) = floor(k * N / 2**24)          the client's first-choice address index
    home(i) = ceil(i * 2**24 / N)           the home key of address index i

    home(i) <= k  <=>  i <= slot(k)         (so home(slot(k)) <= k < home(slot(k) + 1))

**Rule.** A shard may offer or assign address ``i`` only while ``home(i)`` lies in
a range it owns (and is not pausing for a state operation).  The range map
gives every key exactly one owner, so every address has at most one shard that
may hand it out; a split, merge or move hands the addresses over together with
the keys, because the records of an address live under its home key
(``store.py``) and the state layer copies records by key.  A client probes its
candidates upward from ``slot(k)``, cyclically, over the owned slots only
(:func:`probe`); which slots a shard owns is :func:`slots` of its ranges.

Consequence (a limit, see README): a shard's slice is about N x (width of its
ranges) / 2**24 addresses, whatever the number of clients whose MACs fall in
them.  Keys clustered in a narrow range (MACs numbered in sequence under the
old ``mac-low24`` key function) exhaust that range's slice first.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from vfab.vid.codec import KEY_BITS
from vfab.vid.ranges import Range

KEYS = 1 << KEY_BITS


class Pool:
    """The addresses ``first .. first + size - 1`` (as integers) and their home keys."""

    def __init__(self, first: int, size: int):
        if not 1 <= size:
            raise ValueError(f"a pool needs at least one address, got {size}")
        self.first = int(first)
        self.size = int(size)

    @property
    def last(self) -> int:
        return self.first + self.size - 1

    def __contains__(self, ip: object) -> bool:
        return isinstance(ip, int) and self.first <= ip <= self.last

    def slot(self, key: int) -> int:
        """The first-choice address index of a client with VID key ``key``."""
        return (key * self.size) >> KEY_BITS

    def home(self, index: int) -> int:
        """The home key of address index ``index``."""
        return ((index << KEY_BITS) + self.size - 1) // self.size

    def home_of(self, ip: int) -> int:
        return self.home(ip - self.first)

    def slots(self, ranges: Iterable[Range]) -> list[tuple[int, int]]:
        """Sorted, disjoint, merged index intervals [a, b] whose home keys lie in ``ranges``."""
        out: list[list[int]] = []
        for r in sorted(ranges, key=lambda r: r.lo):
            a = 0 if r.lo == 0 else self.slot(r.lo - 1) + 1
            b = self.slot(r.hi)
            if a > b:
                continue           # a range narrower than the spacing of home keys: no address
            if out and out[-1][1] + 1 >= a:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    def owns(self, ranges: Iterable[Range], ip: int) -> bool:
        """Whether ``ip`` may be handed out by whoever holds ``ranges``."""
        if ip not in self:
            return False
        h = self.home_of(ip)
        return any(h in r for r in ranges)

    def segments(self, key: int, ranges: Iterable[Range]) -> Iterator[tuple[int, int]]:
        """The owned index intervals in probe order for ``key``: from slot(key) upward, then wrapping."""
        yield from probe_order(self.slots(ranges), self.slot(key))

    def probe(self, key: int, ranges: Iterable[Range]) -> Iterator[int]:
        """Candidate addresses (integers) of a client with VID key ``key``, best first."""
        for a, b in self.segments(key, list(ranges)):
            for i in range(a, b + 1):
                yield self.first + i


def probe_order(intervals: Iterable[tuple[int, int]], s: int) -> Iterator[tuple[int, int]]:
    """Sorted index ``intervals`` in probe order from index ``s``: those at or above it (the one holding it
    from ``s`` on), then the rest from the lowest, wrapping round the pool."""
    before = []
    for a, b in intervals:
        if b < s:
            before.append((a, b))
        elif a < s:
            yield s, b
            before.append((a, s - 1))
        else:
            yield a, b
    yield from before


def subtract(ranges: Iterable[Range], holes: Iterable[Range]) -> list[Range]:
    """``ranges`` minus ``holes`` (e.g. owned ranges minus the ones being paused)."""
    out = list(ranges)
    for h in holes:
        nxt = []
        for r in out:
            nxt.extend(r.subtract(h) if r.overlaps(h) else [r])
        out = nxt
    return sorted(out, key=lambda r: r.lo)

