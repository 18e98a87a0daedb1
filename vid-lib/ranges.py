"""Range algebra over the 24-bit key space of one service.

A range is ``[lo, hi]`` inclusive.  Ranges of a service are disjoint and cover
the key space.  ``to_masks`` gives the minimal CIDR-style (prefix) cover: the
fewest aligned power-of-two blocks whose union is exactly the range; at most
``2*w - 2`` blocks for a w-bit space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from vfab.vid.codec import KEY_BITS, KEY_MAX
from vfab.vid.errors import VidError


@dataclass(frozen=True, order=True)
class Range:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        for name, v in (("lo", self.lo), ("hi", self.hi)):
            if not isinstance(v, int) or not 0 <= v <= KEY_MAX:
                raise VidError(f"range {name} {v!r} is out of bounds: keys are 0..{KEY_MAX}")
        if self.lo > self.hi:
            raise VidError(f"range {self.lo}-{self.hi} is empty: lo must be <= hi")

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.lo <= key <= self.hi

    def contains(self, other: "Range") -> bool:
        return self.lo <= other.lo and other.hi <= self.hi

    def overlaps(self, other: "Range") -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def adjacent(self, other: "Range") -> bool:
        return self.hi + 1 == other.lo or other.hi + 1 == self.lo

    def split(self, at: int) -> tuple["Range", "Range"]:
        """Split into ``[lo, at-1]`` and ``[at, hi]``."""
        if not self.lo < at <= self.hi:
            raise VidError(
                f"cannot split {self} at {at}: the split point must be in {self.lo + 1}..{self.hi}"
            )
        return Range(self.lo, at - 1), Range(at, self.hi)

    def halves(self) -> tuple["Range", "Range"]:
        if self.size < 2:
            raise VidError(f"cannot halve {self}: it holds a single key")
        return self.split(self.lo + self.size // 2)

    def merge(self, other: "Range") -> "Range":
        if not self.adjacent(other):
            raise VidError(f"cannot merge {self} and {other}: they are not adjacent")
        return Range(min(self.lo, other.lo), max(self.hi, other.hi))

    def subtract(self, other: "Range") -> list["Range"]:
        """What is left of self after removing other (0, 1 or 2 ranges)."""
        if not self.overlaps(other):
            return [self]
        out = []
        if other.lo > self.lo:
            out.append(Range(self.lo, other.lo - 1))
        if other.hi < self.hi:
            out.append(Range(other.hi + 1, self.hi))
        return out

    def __str__(self) -> str:
        return f"{self.lo:#08x}-{self.hi:#08x}"

    @classmethod
    def parse(cls, text: str) -> "Range":
        """``LO-HI`` with decimal or 0x-hex bounds, or a single key."""
        parts = str(text).split("-")
        if len(parts) not in (1, 2) or not all(p.strip() for p in parts):
            raise VidError(
                f"range {text!r} is malformed: write LO-HI, e.g. 0-0x7fffff or 100-199"
            )
        try:
            bounds = [int(p.strip(), 0) for p in parts]
        except ValueError:
            raise VidError(
                f"range {text!r} has a bound that is not a number: write decimal or 0x-hex"
            ) from None
        return cls(bounds[0], bounds[-1])


FULL = Range(0, KEY_MAX)


def to_masks(rng: Range, width: int = KEY_BITS) -> list[tuple[int, int]]:
    """Minimal prefix cover of ``rng`` as (value, mask) pairs on ``width`` bits."""
    full = (1 << width) - 1
    if rng.hi > full:
        raise VidError(f"range {rng} does not fit in {width} bits")
    out: list[tuple[int, int]] = []
    lo, hi = rng.lo, rng.hi
    while lo <= hi:
        # Largest aligned block starting at lo that stays inside [lo, hi].
        size = lo & -lo if lo else 1 << width
        while size > hi - lo + 1:
            size >>= 1
        out.append((lo, full & ~(size - 1)))
        lo += size
    return out


def check_partition(ranges: Iterable[Range]) -> list[Range]:
    """Sorted ranges if they are disjoint and cover the key space, else VidError."""
    ordered = sorted(ranges)
    expect = 0
    for r in ordered:
        if r.lo != expect:
            what = "overlap" if r.lo < expect else "gap"
            raise VidError(f"ranges do not partition the key space: {what} at key {expect:#x}")
        expect = r.hi + 1
    if expect != KEY_MAX + 1:
        raise VidError(f"ranges do not partition the key space: gap at key {expect:#x}")
    return ordered
