"""The vfab frame: the only module that knows its wire format.

::

    0                   1                   2                   3
    0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
   +---------------------------------------------------------------+
   |            Ethernet dst (VID or MAC), src, type 0x88B5         |  14 B
   +---------------+---------------+---------------+---------------+
   |    version    |     type      |     flags     |   reserved=0  |
   +---------------+---------------+---------------+---------------+
   |            channel            |            length             |
   +-------------------------------+-------------------------------+
   |                              seq                              |
   +---------------------------------------------------------------+
   |                              ack                              |
   +---------------------------------------------------------------+
   |                   payload (length bytes) ...                  |

flags: bits 0-2 priority label (0 lowest .. 7 highest), bit 3 ACK valid,
bits 4-7 reserved (must be 0).  ``length`` counts payload bytes; Ethernet
padding after the payload is allowed and ignored.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from vfab.vid.errors import FrameError

ETH_TYPE = 0x88B5
VERSION = 1
ETH_HDR = struct.Struct("!6s6sH")
HDR = struct.Struct("!BBBBHHII")
WIRE_HDR = struct.Struct("!6s6sHBBBBHHII")   # both in one
ETH_LEN = ETH_HDR.size
HDR_LEN = HDR.size
MIN_LEN = ETH_LEN + HDR_LEN
MAX_PAYLOAD = 1500 - HDR_LEN
FLAG_PRIO_MASK = 0x07
FLAG_ACK = 0x08
FLAG_RESERVED = 0xF0


class FrameType(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ACK = 3
    CONTROL = 4


@dataclass(frozen=True)
class Frame:
    dst: bytes
    src: bytes
    type: FrameType
    payload: bytes = b""
    channel: int = 0
    seq: int = 0
    ack: int | None = None
    priority: int = 0
    version: int = VERSION

    def serialize(self) -> bytes:
        for name, mac in (("dst", self.dst), ("src", self.src)):
            # struct's "6s" would silently pad or truncate a MAC of the wrong size.
            if not isinstance(mac, (bytes, bytearray)) or len(mac) != 6:
                raise FrameError(f"{name} MAC {mac!r} is not 6 packed bytes: use codec's Vid.packed")
        return pack(self.dst, self.src, self.type, self.payload, self.channel, self.seq, self.priority, self.ack,
                    self.version)


def pack(dst: bytes, src: bytes, ftype: int, payload: bytes, channel: int = 0, seq: int = 0, priority: int = 0,
         ack: int | None = None, version: int = VERSION) -> bytes:
    """The wire bytes of a frame, without building a :class:`Frame`: for a sender whose MACs are already 6
    packed bytes (``codec.packed``, a port's own, a received frame's); ``Frame.serialize`` checks them first.
    The payload's size and the priority are checked here."""
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} B is too large: the limit is {MAX_PAYLOAD} B "
                         "(one Ethernet frame); split it into several frames")
    if not 0 <= priority <= FLAG_PRIO_MASK:
        raise FrameError(f"priority {priority} is out of range: use 0..7")
    flags = priority | (FLAG_ACK if ack is not None else 0)
    return WIRE_HDR.pack(dst, src, ETH_TYPE, version, ftype, flags, 0, channel & 0xFFFF, len(payload),
                         seq & 0xFFFFFFFF, (ack or 0) & 0xFFFFFFFF) + payload


def parse(data: bytes) -> Frame:
    """Parse one frame; FrameError says what is wrong. Never raises anything else."""
    if len(data) < MIN_LEN:
        raise FrameError(f"truncated frame: {len(data)} B, a vfab frame is at least {MIN_LEN} B")
    dst, src, eth_type, version, ftype, flags, reserved, channel, length, seq, ack = WIRE_HDR.unpack_from(data, 0)
    if eth_type != ETH_TYPE:
        raise FrameError(f"not a vfab frame: EtherType {eth_type:#06x}, expected {ETH_TYPE:#06x}")
    if version != VERSION:
        raise FrameError(f"unsupported vfab version {version}: this receiver speaks {VERSION}")
    if reserved or flags & FLAG_RESERVED:
        raise FrameError("reserved header bits are set: the sender speaks another revision")
    try:
        ftype = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    end = MIN_LEN + length
    if end > len(data):
        raise FrameError(
            f"wrong length: header says {length} B of payload, frame carries {len(data) - MIN_LEN} B"
        )
    return Frame(dst=dst, src=src, type=ftype, payload=bytes(data[MIN_LEN:end]),
                 channel=channel, seq=seq, ack=ack if flags & FLAG_ACK else None,
                 priority=flags & FLAG_PRIO_MASK, version=version)
