"""vid-lib/ranges.py: range algebra and the minimal prefix (value/mask) cover."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vfab.vid.codec import KEY_BITS, KEY_MAX
from vfab.vid.errors import VidError
from vfab.vid.ranges import FULL, Range, check_partition, to_masks

keys = st.integers(0, KEY_MAX)


@st.composite
def ranges(draw, lo_min=0, hi_max=KEY_MAX):
    lo = draw(st.integers(lo_min, hi_max))
    hi = draw(st.integers(lo, hi_max))
    return Range(lo, hi)


# -- independent references ---------------------------------------------------
def min_blocks_from(lo: int, width: int) -> list[int]:
    """best[x] = fewest aligned power-of-two blocks partitioning [lo, x-1] (DP)."""
    top = 1 << width
    inf = float("inf")
    best = [inf] * (top + 1)
    best[lo] = 0
    for x in range(lo, top):
        if best[x] == inf:
            continue
        size = 1
        while size <= top and x + size <= top:
            if x % size == 0:
                best[x + size] = min(best[x + size], best[x] + 1)
            size <<= 1
    return best


def trie_min(lo: int, hi: int, node: int = 0, size: int = 1 << KEY_BITS) -> int:
    """Fewest prefix blocks covering [lo, hi]: walk the binary trie top-down."""
    end = node + size - 1
    if end < lo or node > hi:
        return 0
    if lo <= node and end <= hi:
        return 1
    half = size // 2
    return trie_min(lo, hi, node, half) + trie_min(lo, hi, node + half, half)


@functools.lru_cache(maxsize=None)
def keys_matching(value: int, mask: int, width: int) -> frozenset:
    """Literal OpenFlow semantics: every key k with k & mask == value."""
    return frozenset(k for k in range(1 << width) if k & mask == value)


# -- exhaustive on small widths -----------------------------------------------------
@pytest.mark.parametrize("width", range(1, 8))
def test_to_masks_exact_disjoint_minimal_all_ranges(width):
    full = (1 << width) - 1
    for lo in range(full + 1):
        best = min_blocks_from(lo, width)
        for hi in range(lo, full + 1):
            masks = to_masks(Range(lo, hi), width)
            covered: set = set()
            total = 0
            for value, mask in masks:
                assert 0 <= mask <= full and value & mask == value
                block = keys_matching(value, mask, width)
                total += len(block)
                covered |= block
            assert covered == set(range(lo, hi + 1)), (width, lo, hi, masks)
            assert total == len(covered), f"blocks overlap for {lo}-{hi}: {masks}"
            assert len(masks) == best[hi + 1], (width, lo, hi, masks)
            assert len(masks) <= max(1, 2 * width - 2)


def test_dp_reference_sanity():
    # [1, 6] on 3 bits: {1}, {2,3}, {4,5}, {6} -> 4 blocks = 2*3-2, the worst case.
    assert min_blocks_from(1, 3)[7] == 4
    assert trie_min(1, (1 << KEY_BITS) - 2) == 2 * KEY_BITS - 2


# -- the real 24-bit space ----------------------------------------------------------
def check_cover(rng: Range, masks: list[tuple[int, int]]) -> None:
    """Exactness by arithmetic: aligned prefix blocks, contiguous, from lo to hi."""
    expect = rng.lo
    for value, mask in masks:
        size = (~mask & KEY_MAX) + 1
        assert size & (size - 1) == 0, f"mask {mask:#x} is not a prefix mask"
        assert mask == KEY_MAX & ~(size - 1)
        assert value % size == 0 and value & mask == value, "block not aligned"
        assert value == expect, f"gap or overlap at {expect:#x}"
        expect = value + size
    assert expect == rng.hi + 1
    assert sum((~m & KEY_MAX) + 1 for _, m in masks) == rng.size


@given(ranges())
def test_to_masks_24_bits(rng):
    masks = to_masks(rng)
    check_cover(rng, masks)
    assert 1 <= len(masks) <= 2 * KEY_BITS - 2
    assert len(masks) == trie_min(rng.lo, rng.hi)


@given(keys, st.integers(0, KEY_BITS))
def test_aligned_block_is_one_mask(key, bits):
    lo = key & ~((1 << bits) - 1)
    rng = Range(lo, lo + (1 << bits) - 1)
    assert to_masks(rng) == [(lo, KEY_MAX & ~((1 << bits) - 1))]


def test_to_masks_edges():
    assert to_masks(FULL) == [(0, 0)]
    assert to_masks(Range(5, 5)) == [(5, KEY_MAX)]
    worst = to_masks(Range(1, KEY_MAX - 1))
    assert len(worst) == 2 * KEY_BITS - 2
    check_cover(Range(1, KEY_MAX - 1), worst)
    with pytest.raises(VidError, match="does not fit in 4 bits"):
        to_masks(Range(0, 16), width=4)


# -- range algebra ---------------------------------------------------------------------
def test_range_basics():
    r = Range(10, 19)
    assert r.size == 10 and 10 in r and 19 in r and 20 not in r and "10" not in r
    assert r.contains(Range(12, 15)) and not r.contains(Range(5, 12))
    assert r.overlaps(Range(19, 30)) and not r.overlaps(Range(20, 30))
    assert r.adjacent(Range(20, 30)) and r.adjacent(Range(0, 9)) and not r.adjacent(Range(21, 30))
    assert str(Range(0, KEY_MAX)) == "0x000000-0xffffff"


@given(ranges(), st.data())
def test_split_then_merge(rng, data):
    if rng.size < 2:
        with pytest.raises(VidError, match="split point must be in"):
            rng.split(rng.lo)
        with pytest.raises(VidError, match="single key"):
            rng.halves()
        return
    at = data.draw(st.integers(rng.lo + 1, rng.hi))
    left, right = rng.split(at)
    assert (left.lo, left.hi, right.lo, right.hi) == (rng.lo, at - 1, at, rng.hi)
    assert left.merge(right) == rng == right.merge(left)
    a, b = rng.halves()
    assert a.size + b.size == rng.size and 0 <= b.size - a.size <= 1 and a.merge(b) == rng


def test_split_errors():
    with pytest.raises(VidError, match=r"cannot split .* at 10: the split point must be in 11..20"):
        Range(10, 20).split(10)
    with pytest.raises(VidError, match="split point"):
        Range(10, 20).split(21)
    with pytest.raises(VidError, match="not adjacent"):
        Range(0, 5).merge(Range(7, 9))
    with pytest.raises(VidError, match="not adjacent"):
        Range(0, 5).merge(Range(3, 9))


@given(ranges(), ranges())
def test_subtract(a, b):
    rest = a.subtract(b)
    assert len(rest) <= 2
    kept = sum(r.size for r in rest)
    overlap = max(0, min(a.hi, b.hi) - max(a.lo, b.lo) + 1)
    assert kept == a.size - overlap
    for r in rest:
        assert a.contains(r) and not r.overlaps(b)
    if len(rest) == 2:
        assert rest[0].hi < rest[1].lo


def test_parse():
    assert Range.parse("100-199") == Range(100, 199)
    assert Range.parse("0-0x7fffff") == Range(0, 0x7FFFFF)
    assert Range.parse(" 0x10 - 0x20 ") == Range(16, 32)
    assert Range.parse("42") == Range(42, 42)
    for text in ("", "-", "1-", "-5", "1-2-3"):
        with pytest.raises(VidError, match="malformed: write LO-HI"):
            Range.parse(text)
    with pytest.raises(VidError, match="not a number"):
        Range.parse("a-b")
    with pytest.raises(VidError, match="empty: lo must be <= hi"):
        Range.parse("9-3")
    with pytest.raises(VidError, match=f"out of bounds: keys are 0..{KEY_MAX}"):
        Range.parse(f"0-{KEY_MAX + 1}")


def test_range_bounds():
    with pytest.raises(VidError, match="range lo -1 is out of bounds"):
        Range(-1, 3)
    with pytest.raises(VidError, match="range hi"):
        Range(0, KEY_MAX + 1)
    with pytest.raises(VidError, match="range lo"):
        Range("0", 3)


@given(st.lists(keys, max_size=12, unique=True))
def test_check_partition_of_cuts(cuts):
    points = sorted(set(cuts) - {0})
    bounds = [0, *points, KEY_MAX + 1]
    parts = [Range(a, b - 1) for a, b in zip(bounds, bounds[1:])]
    assert check_partition(reversed(parts)) == parts


def test_check_partition_errors():
    with pytest.raises(VidError, match="gap at key 0x0"):
        check_partition([])
    with pytest.raises(VidError, match="gap at key 0x0"):
        check_partition([Range(1, KEY_MAX)])
    with pytest.raises(VidError, match="gap at key 0x64"):
        check_partition([Range(0, 99), Range(101, KEY_MAX)])
    with pytest.raises(VidError, match="overlap at key 0x64"):
        check_partition([Range(0, 99), Range(50, KEY_MAX)])
    with pytest.raises(VidError, match="gap at key 0xfff000"):
        check_partition([Range(0, 0xFFEFFF)])
    assert check_partition([FULL]) == [FULL]
