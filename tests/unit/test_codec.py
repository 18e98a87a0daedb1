"""vid-lib/codec.py: VIDs as locally administered unicast MACs (DESIGN.md §2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vfab.vid import codec
from vfab.vid.codec import KEY_MAX, SERVICE_MAX, Layout, VidClass
from vfab.vid.errors import VidError
from vfab.vid.ranges import Range, to_masks

services = st.integers(0, SERVICE_MAX)
keys = st.integers(0, KEY_MAX)
classes = st.sampled_from(list(VidClass))
layouts = st.sampled_from(list(Layout))


# -- layouts ------------------------------------------------------------------
def test_prefix_layout_octets():
    vid = codec.encode(0x1234, 0xABCDEF)
    assert vid.mac == "0e:12:34:ab:cd:ef"
    assert vid.packed == bytes.fromhex("0e1234abcdef")
    assert str(vid) == vid.mac


def test_suffix_layout_octets():
    vid = codec.encode(0x1234, 0xABCDEF, layout=Layout.SUFFIX)
    assert vid.mac == "0e:ab:cd:ef:12:34"


@pytest.mark.parametrize("cls, octet0", [(VidClass.SERVICE, 0x0E), (VidClass.ENDPOINT, 0x1E),
                                         (VidClass.HELPER, 0x2E), (VidClass.CONTROL, 0x3E)])
def test_class_is_high_nibble_of_octet0(cls, octet0):
    for layout in Layout:
        vid = codec.encode(7, 42, cls, layout)
        assert vid.packed[0] == octet0
        assert codec.decode(vid.mac, layout).cls is cls


def test_layout_given_as_plain_string_is_the_same_layout():
    # Regression: "prefix" (a str, not the enum member) used to select the suffix layout.
    assert codec.encode(1, 42, layout="prefix") == codec.encode(1, 42, layout=Layout.PREFIX)
    assert codec.encode(1, 42, layout="prefix").mac == "0e:00:01:00:00:2a"
    assert codec.encode(1, 42, layout="suffix").mac == "0e:00:00:2a:00:01"
    assert codec.decode("0e:00:01:00:00:2a", "prefix").key == 42
    assert codec.block_match(1, 0, 0, layout="prefix") == codec.block_match(1, 0, 0)


@given(services, keys, classes, layouts)
def test_round_trip_every_form(service, key, cls, layout):
    vid = codec.encode(service, key, cls, layout)
    for form in (vid.mac, vid.value, vid.packed, vid.mac.upper(), vid.mac.replace(":", "-")):
        back = codec.decode(form, layout)
        assert back == vid
        assert (back.service, back.key, back.cls, back.layout) == (service, key, cls, layout)
    assert codec.mac_to_int(codec.int_to_mac(vid.value)) == vid.value


@given(services, keys, classes, layouts)
def test_octet0_low_nibble_is_e_local_unicast(service, key, cls, layout):
    octet0 = codec.encode(service, key, cls, layout).packed[0]
    assert octet0 & 0x0F == 0xE
    assert octet0 & 0x01 == 0  # unicast (I/G bit clear)
    assert octet0 & 0x02 == 0x02  # locally administered (U/L bit set)
    assert octet0 >> 4 == int(cls)
    assert codec.is_vid(codec.encode(service, key, cls, layout).value)


@given(services, keys, layouts)
def test_layouts_differ_but_decode_with_own_layout(service, key, layout):
    vid = codec.encode(service, key, layout=layout)
    other = Layout.SUFFIX if layout is Layout.PREFIX else Layout.PREFIX
    swapped = codec.decode(vid.mac, other)
    # Same bits read with the other layout give a different (service, key) unless symmetric.
    assert codec.encode(swapped.service, swapped.key, layout=other).value == vid.value


@given(st.integers(0, codec.MAC_MAX))
def test_is_vid_iff_nibble_e(value):
    assert codec.is_vid(value) == ((value >> 40) & 0xF == 0xE)


def test_non_vid_mac_is_rejected_with_reason():
    for mac in ("02:00:00:00:00:01", "0f:00:01:00:00:2a", "ff:ff:ff:ff:ff:ff"):
        with pytest.raises(VidError, match="not a VID.*nibble E"):
            codec.decode(mac)


def test_unknown_class_nibble_is_a_vid_error():
    # Regression: used to leak a bare ValueError from the VidClass enum.
    with pytest.raises(VidError, match="VID class 4 is unknown.*0 \\(service\\)"):
        codec.decode("4e:00:01:00:00:2a")
    with pytest.raises(VidError, match="VID class 9 is unknown"):
        codec.encode(1, 2, cls=9)
    with pytest.raises(VidError, match="VID class"):
        codec.Vid(1, 2, cls=0xF)


# -- block matches --------------------------------------------------------------
@st.composite
def blocks(draw):
    lo = draw(keys)
    hi = draw(st.integers(lo, KEY_MAX))
    masks = to_masks(Range(lo, hi))
    return draw(st.sampled_from(masks))


@given(services, blocks(), keys, classes, layouts)
def test_block_match_covers_exactly_the_keys(service, block, key, cls, layout):
    kv, km = block
    value, mask = codec.block_match(service, kv, km, cls, layout)
    assert value & mask == value
    hit = codec.encode(service, key, cls, layout).value & mask == value
    assert hit == (key & km == kv)


@given(services, services, blocks(), keys, layouts)
def test_block_match_is_per_service_and_class(service, other, block, key, layout):
    kv, km = block
    value, mask = codec.block_match(service, kv, km, VidClass.SERVICE, layout)
    if other != service:
        assert codec.encode(other, key, layout=layout).value & mask != value
    assert codec.encode(service, kv, VidClass.ENDPOINT, layout).value & mask != value


def test_block_match_exhaustive_on_small_block():
    value, mask = codec.block_match(3, 0x10, KEY_MAX & ~0xF)  # keys 0x10..0x1f
    hits = [k for k in range(0x40) if codec.encode(3, k).value & mask == value]
    assert hits == list(range(0x10, 0x20))


@given(services, keys, layouts)
def test_service_match_and_any_vid(service, key, layout):
    value, mask = codec.service_match(service, layout=layout)
    assert codec.encode(service, key, layout=layout).value & mask == value
    any_value, any_mask = codec.ANY_VID
    for cls in VidClass:
        assert codec.encode(service, key, cls, layout).value & any_mask == any_value
    assert 0x020000000001 & any_mask != any_value


def test_block_match_rejects_bad_mask():
    with pytest.raises(VidError, match="key mask"):
        codec.block_match(1, 0, KEY_MAX + 1)


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("service, key, what", [
    (-1, 0, "service id -1 is out of range.*0..65535"),
    (SERVICE_MAX + 1, 0, "service id 65536"),
    (1, -1, "key -1 is out of range"),
    (1, KEY_MAX + 1, f"key {KEY_MAX + 1} is out of range.*0..{KEY_MAX}"),
    (True, 0, "service id True"),
    (1, 1.5, "key 1.5"),
    ("1", 0, "service id '1'"),
])
def test_encode_bounds(service, key, what):
    with pytest.raises(VidError, match=what):
        codec.encode(service, key)


@pytest.mark.parametrize("mac, what", [
    ("0e:00:01:00:00", "malformed.*six hex octets"),
    ("0e:00:01:00:00:2a:00", "malformed"),
    ("0e:000:01:00:00:2a", "malformed"),
    ("0e::01:00:00:2a", "malformed"),
    ("0e:00:01:00:00:zz", "non-hex octet"),
    ("+e:00:01:00:00:2a", "non-hex octet"),  # int("+e", 16) would have taken it
    (b"\x0e\x00\x01", "6 bytes, got 3"),
    (-1, "MAC -1 is out of range"),
    (1 << 48, "out of range"),
    (True, "not a MAC"),
    (None, "malformed"),
])
def test_bad_mac(mac, what):
    with pytest.raises(VidError, match=what):
        codec.mac_to_int(mac)


def test_bad_layout():
    with pytest.raises(VidError, match="unknown VID layout 'middle'.*prefix.*suffix"):
        Layout.parse("middle")
    with pytest.raises(VidError, match="unknown VID layout"):
        codec.encode(1, 2, layout="middle")


def test_parse_key():
    assert codec.parse_key("42") == 42
    assert codec.parse_key("0x2a") == 42
    assert codec.parse_key(str(KEY_MAX)) == KEY_MAX
    with pytest.raises(VidError, match="not a number.*decimal.*hex"):
        codec.parse_key("forty")
    with pytest.raises(VidError, match="out of range"):
        codec.parse_key(hex(KEY_MAX + 1))
    with pytest.raises(VidError, match="out of range"):
        codec.parse_key("-1")


def test_vid_error_is_a_value_error():
    assert issubclass(VidError, ValueError)
