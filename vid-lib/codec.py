"""VID codec (DESIGN.md §2): the only module that turns (class, service, key) into a MAC.

A VID is 48 bits written as a locally administered unicast MAC::

    prefix layout (default)          suffix layout
    octet 0   : cccc 1110            octet 0   : cccc 1110
    octet 1-2 : service id (16 bits) octet 1-3 : key (24 bits)
    octet 3-5 : key (24 bits)        octet 4-5 : service id (16 bits)

``cccc`` is the VID class.  Everything else in vfab goes through this module.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from vfab.vid.errors import VidError

KEY_BITS = 24
KEY_MAX = (1 << KEY_BITS) - 1
SERVICE_BITS = 16
SERVICE_MAX = (1 << SERVICE_BITS) - 1
MAC_BITS = 48
MAC_MAX = (1 << MAC_BITS) - 1
VID_NIBBLE = 0xE  # low nibble of octet 0: locally administered, unicast


class VidClass(enum.IntEnum):
    """The high nibble of octet 0."""

    SERVICE = 0x0
    ENDPOINT = 0x1
    HELPER = 0x2
    CONTROL = 0x3


class Layout(str, enum.Enum):
    PREFIX = "prefix"
    SUFFIX = "suffix"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        try:
            return cls(text)
        except ValueError:
            raise VidError(
                f"unknown VID layout {text!r}: use 'prefix' (default) or 'suffix'"
            ) from None


def _check(name: str, value: int, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise VidError(f"{name} {value!r} is out of range: it must be an integer in 0..{limit}")


def _vid_class(value: object) -> VidClass:
    try:
        return VidClass(value)
    except (ValueError, TypeError):
        known = ", ".join(f"{c.value} ({c.name.lower()})" for c in VidClass)
        raise VidError(f"VID class {value!r} is unknown: known classes are {known}") from None


def _shifts(layout: Layout | str) -> tuple[int, int]:
    """(service shift, key shift) inside the 48-bit MAC."""
    # A plain "prefix" string is not the enum member: parse, never compare by identity.
    if Layout.parse(layout) is Layout.PREFIX:
        return 24, 0
    return 0, 16


@dataclass(frozen=True)
class Vid:
    service: int
    key: int
    cls: VidClass = VidClass.SERVICE
    layout: Layout = Layout.PREFIX

    def __post_init__(self) -> None:
        _check("service id", self.service, SERVICE_MAX)
        _check("key", self.key, KEY_MAX)
        object.__setattr__(self, "cls", _vid_class(self.cls))
        object.__setattr__(self, "layout", Layout.parse(self.layout))

    @property
    def value(self) -> int:
        s_shift, k_shift = _shifts(self.layout)
        return ((int(self.cls) << 4 | VID_NIBBLE) << 40) | (self.service << s_shift) | (
            self.key << k_shift
        )

    @property
    def mac(self) -> str:
        return int_to_mac(self.value)

    @property
    def packed(self) -> bytes:
        return self.value.to_bytes(6, "big")

    def __str__(self) -> str:
        return self.mac


def encode(service: int, key: int, cls: VidClass = VidClass.SERVICE,
           layout: Layout = Layout.PREFIX) -> Vid:
    return Vid(service, key, _vid_class(cls), layout)


@functools.lru_cache(maxsize=65536)
def packed(service: int, key: int, layout: Layout = Layout.PREFIX) -> bytes:
    """``encode(service, key, layout=layout).packed``, remembered: the data path asks it once per frame
    (a client's destination, a server's reply source), and building and checking a Vid each time cost
    clients ~10 % of their time per request."""
    return encode(service, key, layout=layout).packed


def is_vid(mac: int | str | bytes) -> bool:
    value = mac_to_int(mac)
    return (value >> 40) & 0xF == VID_NIBBLE


def decode(mac: int | str | bytes, layout: Layout = Layout.PREFIX) -> Vid:
    value = mac_to_int(mac)
    if not is_vid(value):
        raise VidError(
            f"{int_to_mac(value)} is not a VID: octet 0 must end in nibble E "
            "(locally administered unicast, e.g. 0e:...)"
        )
    s_shift, k_shift = _shifts(layout)
    return Vid(
        service=(value >> s_shift) & SERVICE_MAX,
        key=(value >> k_shift) & KEY_MAX,
        cls=_vid_class((value >> 44) & 0xF),
        layout=layout,
    )


def block_match(service: int, key_value: int, key_mask: int, cls: VidClass = VidClass.SERVICE,
                layout: Layout = Layout.PREFIX) -> tuple[int, int]:
    """(value, mask) over the whole MAC for a block of keys given as key value/mask."""
    _check("key mask", key_mask, KEY_MAX)
    s_shift, k_shift = _shifts(layout)
    value = encode(service, key_value & key_mask, cls, layout).value
    mask = (0xFF << 40) | (SERVICE_MAX << s_shift) | (key_mask << k_shift)
    return value, mask


def service_match(service: int, cls: VidClass = VidClass.SERVICE,
                  layout: Layout = Layout.PREFIX) -> tuple[int, int]:
    """(value, mask) matching every VID of a service."""
    return block_match(service, 0, 0, cls, layout)


_HEX = frozenset("0123456789abcdef")
ANY_VID = ((VID_NIBBLE << 40), (0xF << 40))  # matches every VID of every class


def mac_to_int(mac: int | str | bytes) -> int:
    if isinstance(mac, bool):
        raise VidError(f"MAC {mac!r} is not a MAC address")
    if isinstance(mac, int):
        _check("MAC", mac, MAC_MAX)
        return mac
    if isinstance(mac, (bytes, bytearray)):
        if len(mac) != 6:
            raise VidError(f"a packed MAC is 6 bytes, got {len(mac)}")
        return int.from_bytes(mac, "big")
    text = str(mac).strip().lower().replace("-", ":")
    parts = text.split(":")
    if len(parts) != 6 or not all(len(p) in (1, 2) for p in parts):
        raise VidError(f"MAC {mac!r} is malformed: write six hex octets like 0e:00:01:00:00:2a")
    if not all(c in _HEX for p in parts for c in p):  # int(p, 16) would take "+f" or " f"
        raise VidError(f"MAC {mac!r} has a non-hex octet: write e.g. 0e:00:01:00:00:2a")
    octets = [int(p, 16) for p in parts]
    return int.from_bytes(bytes(octets), "big")


def int_to_mac(value: int) -> str:
    return ":".join(f"{b:02x}" for b in value.to_bytes(6, "big"))


def parse_key(text: str) -> int:
    """A key as the operator writes it: decimal, 0x-hex."""
    try:
        key = int(str(text), 0)
    except ValueError:
        raise VidError(
            f"key {text!r} is not a number: write decimal (42) or hex (0x2a), in 0..{KEY_MAX}"
        ) from None
    _check("key", key, KEY_MAX)
    return key
