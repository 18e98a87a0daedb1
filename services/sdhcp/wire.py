"""DHCPv4 messages (RFC 2131, options RFC 2132/3396/6842): the only module that knows their format.

::

    0                   1                   2                   3
    0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
   +---------------+---------------+---------------+---------------+
   |  op (1 or 2)  |  htype (1=Eth)|  hlen (<=16)  |     hops      |    0
   +---------------+---------------+---------------+---------------+
   |                      xid (transaction id)                     |    4
   +-------------------------------+-------------------------------+
   |             secs              |B|      flags (rest MBZ)       |    8
   +-------------------------------+-------------------------------+
   |            ciaddr (client's address, when it has one)         |   12
   +---------------------------------------------------------------+
   |            yiaddr ("your" address, set by the server)         |   16
   +---------------------------------------------------------------+
   |            siaddr (next server, e.g. TFTP)                    |   20
   +---------------------------------------------------------------+
   |            giaddr (relay agent, 0 when on-link)               |   24
   +---------------------------------------------------------------+
   |            chaddr (client hardware address, 16 B, hlen used)  |   28
   +---------------------------------------------------------------+
   |            sname (64 B, NUL-padded; or options if overloaded) |   44
   +---------------------------------------------------------------+
   |            file (128 B, NUL-padded; or options if overloaded) |  108
   +---------------------------------------------------------------+
   |            magic cookie 99.130.83.99                          |  236
   +---------------------------------------------------------------+
   |  options: code(1) len(1) value(len) ... end(255), then pads   |  240
   +---------------------------------------------------------------+

``B`` is the broadcast flag (0x8000).  Options are TLVs except pad (0) and
end (255), which are one byte.  Overload (52) in the options field says that
``file`` (1), ``sname`` (2) or both (3) carry options too; the aggregate option
buffer is options, then file, then sname (RFC 3396 §5), and every instance of
one code is concatenated in that order (values over 255 B travel as several
instances, RFC 3396).

What :func:`parse` accepts, and why:

* Every field that holds options must end with an end option (RFC 2131 §4.1):
  a missing end is how truncation shows.  Bytes after the end are ignored.
* Options whose format RFC 2132 fixes (addresses, times, sizes, the message
  type) must have that length; unknown options are kept as raw bytes and sent
  back unchanged.  Message type (53) is required: this is a DHCP parser, a
  plain BOOTP message is an error.
* Overload (52) is a layout detail, not content: parse removes it and
  :meth:`Message.serialize` decides on its own whether to overload.  Overload
  inside ``file`` or ``sname`` (a loop) is an error.
* No upper size limit: a message is as long as the datagram that carried it,
  and :mod:`ipudp` never reassembles IP fragments, so what arrives is bounded
  by the link MTU (1472 B of UDP payload on a 1500 B link, more on jumbo
  frames) and parsing is linear in it.  Option 57 (maximum message size) is
  the sender's *receive* limit: it bounds the reply (``serialize(max_size)``,
  see ``reply.reply_limit``), never the request.

``parse(m.serialize(...)) == m`` holds whenever serialize succeeds: parse strips
trailing NULs of ``sname``/``file`` and keeps ``chaddr[:hlen]`` only, and
``Message`` normalises the same way when built.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from ipaddress import AddressValueError, IPv4Address
from typing import Iterable, Iterator

from vfab.services.sdhcp.errors import DhcpError

HEADER = struct.Struct("!BBBBIHH4s4s4s4s16s64s128sI")
MIN_LEN = HEADER.size  # 236 B of BOOTP header + 4 B of magic cookie
MAGIC = 0x63825363
BOOTP_MIN_LEN = 300  # RFC 1542 §2.1: relays and old clients drop shorter messages; serialize pads to it
SNAME_OFF, SNAME_LEN = 44, 64
FILE_OFF, FILE_LEN = 108, 128
CHADDR_LEN = 16
FLAG_BROADCAST = 0x8000
BOOTREQUEST, BOOTREPLY = 1, 2
HTYPE_ETHERNET = 1
ZERO = IPv4Address(0)
_ZERO4 = bytes(4)
_NO_MSG_TYPE = "no message type (option 53): this is plain BOOTP or a broken DHCP message; sdhcp serves DHCP only"
PAD, END = 0, 255
OVERLOAD_FILE, OVERLOAD_SNAME = 1, 2


class MessageType(enum.IntEnum):
    """Option 53 (RFC 2132 §9.6)."""

    DISCOVER = 1
    OFFER = 2
    REQUEST = 3
    DECLINE = 4
    ACK = 5
    NAK = 6
    RELEASE = 7
    INFORM = 8


class Opt(enum.IntEnum):
    """Option codes this module decodes (RFC 2132 section in brackets); any other code is kept raw."""

    SUBNET_MASK = 1  # [3.3]
    ROUTER = 3  # [3.5]
    DNS = 6  # [3.8]
    HOSTNAME = 12  # [3.14]
    REQUESTED_IP = 50  # [9.1]
    LEASE_TIME = 51  # [9.2]
    OVERLOAD = 52  # [9.3]
    MSG_TYPE = 53  # [9.6]
    SERVER_ID = 54  # [9.7]
    PARAM_REQUEST_LIST = 55  # [9.8]
    MESSAGE = 56  # [9.9]
    MAX_MESSAGE_SIZE = 57  # [9.10]
    RENEWAL_TIME = 58  # [9.11] T1
    REBINDING_TIME = 59  # [9.12] T2
    VENDOR_CLASS = 60  # [9.13]
    CLIENT_ID = 61  # [9.14]


# kind -> (exact length or None, length step, minimum length); see _check_option
_KINDS = {
    "ip": (4, 1, 4), "ips": (None, 4, 4), "u32": (4, 1, 4), "u16": (2, 1, 2), "u8": (1, 1, 1),
    "text": (None, 1, 1), "codes": (None, 1, 1), "bytes": (None, 1, 1), "id": (None, 1, 2),
}
# code -> (name used in errors, kind)
SPECS: dict[int, tuple[str, str]] = {
    Opt.SUBNET_MASK: ("subnet mask", "ip"),
    Opt.ROUTER: ("router", "ips"),
    Opt.DNS: ("DNS servers", "ips"),
    Opt.HOSTNAME: ("hostname", "text"),
    Opt.REQUESTED_IP: ("requested address", "ip"),
    Opt.LEASE_TIME: ("lease time", "u32"),
    Opt.OVERLOAD: ("overload", "u8"),
    Opt.MSG_TYPE: ("message type", "u8"),
    Opt.SERVER_ID: ("server identifier", "ip"),
    Opt.PARAM_REQUEST_LIST: ("parameter request list", "codes"),
    Opt.MESSAGE: ("message", "text"),
    Opt.MAX_MESSAGE_SIZE: ("maximum message size", "u16"),
    Opt.RENEWAL_TIME: ("renewal time T1", "u32"),
    Opt.REBINDING_TIME: ("rebinding time T2", "u32"),
    Opt.VENDOR_CLASS: ("vendor class", "bytes"),
    Opt.CLIENT_ID: ("client identifier", "id"),
}
_FIXED_KINDS = {"ip", "u32", "u16", "u8"}  # never split across fields when overloading
_MSG_TYPES = frozenset(int(t) for t in MessageType)


def length_rule(code: int) -> tuple[int | None, int, int] | None:
    """(exact length or None, multiple of, at least) that RFC 2132 sets for option ``code``; None if unknown
    (then any length is kept).  ``parse`` checks every option by it; the native lane gets the same table."""
    spec = SPECS.get(code)
    return None if spec is None else _KINDS[spec[1]]


def pieces(options: dict[int, bytes]) -> Iterator[tuple[int, bytes]]:
    """(code, value) instances of at most 255 B each, in option order (RFC 3396 split)."""
    for code, value in options.items():
        if not value:
            yield code, b""
        for i in range(0, len(value), 255):
            yield code, value[i:i + 255]


def encode_options(options: dict[int, bytes]) -> bytes:
    """The wire bytes of encoded ``options`` in order (without the end option), as ``serialize`` writes them
    when they fit."""
    return b"".join(bytes((c, len(v))) + v for c, v in pieces(options))


def option_name(code: int) -> str:
    spec = SPECS.get(code)
    return f"option {code} ({spec[0]})" if spec else f"option {code}"


def _check_option(code: int, value: bytes) -> None:
    spec = SPECS.get(code)
    if spec is None:
        return
    exact, step, least = _KINDS[spec[1]]
    n = len(value)
    if exact is not None and n != exact:
        raise DhcpError(f"{option_name(code)} is {n} B long: it must be exactly {exact} B (RFC 2132)")
    if n < least or n % step:
        rule = f"a non-zero multiple of {step} B" if step > 1 else f"at least {least} B"
        raise DhcpError(f"{option_name(code)} is {n} B long: it must be {rule} (RFC 2132)")
    if code == Opt.MSG_TYPE and value[0] not in _MSG_TYPES:
        raise DhcpError(f"message type {value[0]} is unknown: RFC 2132 defines DISCOVER (1) .. INFORM (8)")


def encode_option(code: int, value: object) -> bytes:
    """The wire bytes of a typed option value: an address (str or IPv4Address) for kind ip, a list of
    addresses for ips, an int for times/sizes/message type, str for text, a list of codes for 55; bytes
    pass unchanged (the only form an unknown code accepts).  Raises DhcpError for a value that does not fit."""
    code = _check_code(code)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        kind = SPECS[code][1] if code in SPECS else "bytes"
        try:
            raw = _ENCODERS[kind](value)
        except (ValueError, TypeError, OverflowError, AddressValueError, KeyError) as exc:
            raise DhcpError(f"{option_name(code)}: value {value!r} does not encode as {kind}: {exc}") from None
    _check_option(code, raw)
    return raw


def _packed(v: object) -> bytes:
    # IPv4Address(an IPv4Address) converts through the address's text form: avoid it on every reply
    return v.packed if isinstance(v, IPv4Address) else IPv4Address(v).packed  # type: ignore[arg-type]


def _encode_ips(value: object) -> bytes:
    if isinstance(value, (str, IPv4Address)):
        value = [value]
    return b"".join(_packed(v) for v in value)  # type: ignore[union-attr]


_ENCODERS = {
    "ip": _packed,
    "ips": _encode_ips,
    "u32": lambda v: int(v).to_bytes(4, "big"),
    "u16": lambda v: int(v).to_bytes(2, "big"),
    "u8": lambda v: int(v).to_bytes(1, "big"),
    "text": lambda v: v.encode("ascii"),
    "codes": lambda v: bytes(v),
    "bytes": lambda v: bytes(v),
    "id": lambda v: bytes(v),
}


def _check_code(code: object) -> int:
    if not isinstance(code, int) or not 1 <= code <= 254:
        raise DhcpError(f"option code {code!r} is invalid: use 1..254 (0 is pad and 255 is end)")
    if code == Opt.OVERLOAD:
        raise DhcpError("option 52 (overload) is not content: serialize(max_size=...) overloads by itself")
    return int(code)


def as_ip(value: object, what: str) -> IPv4Address:
    if isinstance(value, IPv4Address):
        return value
    try:
        return IPv4Address(value)  # type: ignore[arg-type]
    except (AddressValueError, ValueError, TypeError):
        raise DhcpError(f"{what} {value!r} is not an IPv4 address: use dotted quad like '192.0.2.10'") from None


def _check_uint(what: str, value: object, bits: int) -> None:
    if not isinstance(value, int) or not 0 <= value < 1 << bits:
        raise DhcpError(f"{what} {value!r} is out of range: it is an unsigned {bits}-bit field")


class _once:
    """A property computed on first read and kept in the instance's ``__dict__`` (which then answers every
    later read: a non-data descriptor gives way to it).  ``functools.cached_property`` without its lock: on
    Python 3.11 it takes an RLock on each first read, which cost a shard ~2% of its time per request."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True)
class Message:
    """One DHCP message.  Option values are wire bytes (use the typed properties to read them and
    :func:`encode_option` to build them); ``options`` keeps insertion order and one entry per code."""

    op: int
    xid: int
    chaddr: bytes
    options: dict[int, bytes] = field(default_factory=dict)
    htype: int = HTYPE_ETHERNET
    hops: int = 0
    secs: int = 0
    flags: int = 0
    ciaddr: IPv4Address = ZERO
    yiaddr: IPv4Address = ZERO
    siaddr: IPv4Address = ZERO
    giaddr: IPv4Address = ZERO
    sname: bytes = b""
    file: bytes = b""

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.op not in (BOOTREQUEST, BOOTREPLY):
            raise DhcpError(f"op {self.op!r} is neither BOOTREQUEST (1) nor BOOTREPLY (2)")
        for name, bits in (("htype", 8), ("hops", 8), ("xid", 32), ("secs", 16), ("flags", 16)):
            _check_uint(name, getattr(self, name), bits)
        for name in ("ciaddr", "yiaddr", "siaddr", "giaddr"):
            put(self, name, as_ip(getattr(self, name), name))
        for name, size in (("chaddr", CHADDR_LEN), ("sname", SNAME_LEN), ("file", FILE_LEN)):
            value = getattr(self, name)
            if not isinstance(value, (bytes, bytearray)) or len(value) > size:
                raise DhcpError(f"{name} {value!r} does not fit: it must be bytes of at most {size} B")
            put(self, name, bytes(value) if name == "chaddr" else bytes(value).rstrip(b"\0"))
        if not isinstance(self.options, dict):
            raise DhcpError(f"options must be a dict {{code: bytes}}, not {type(self.options).__name__}")
        opts = {}
        for code, value in self.options.items():
            code = _check_code(code)
            if not isinstance(value, (bytes, bytearray)):
                raise DhcpError(f"{option_name(code)} holds {value!r}: values are wire bytes (see encode_option)")
            _check_option(code, bytes(value))
            opts[code] = bytes(value)
        if Opt.MSG_TYPE not in opts:
            raise DhcpError(_NO_MSG_TYPE)
        put(self, "options", opts)

    @classmethod
    def _checked_already(cls, op: int, xid: int, chaddr: bytes, options: dict[int, bytes], htype: int, hops: int,
                         secs: int, flags: int, ciaddr: IPv4Address, yiaddr: IPv4Address, siaddr: IPv4Address,
                         giaddr: IPv4Address, sname: bytes, file: bytes) -> "Message":
        """A Message from fields that already hold what ``__post_init__`` would make of them (every value
        in range, addresses as IPv4Address, ``sname``/``file`` without trailing NULs, options checked and
        53 among them).  For :func:`parse` and ``reply.reply``, which check exactly that themselves:
        checking each message twice was the largest part of a shard's Python per request (profile under
        perfdhcp).  Everyone else builds a Message the ordinary way."""
        m = object.__new__(cls)
        m.__dict__.update(op=op, xid=xid, chaddr=chaddr, options=options, htype=htype, hops=hops, secs=secs,
                          flags=flags, ciaddr=ciaddr, yiaddr=yiaddr, siaddr=siaddr, giaddr=giaddr, sname=sname,
                          file=file)
        return m

    # ------------------------------------------------------------------ typed accessors

    def option(self, code: int) -> bytes | None:
        return self.options.get(code)

    def _ip(self, code: int) -> IPv4Address | None:
        v = self.options.get(code)
        return None if v is None else IPv4Address(v)

    def _int(self, code: int) -> int | None:
        v = self.options.get(code)
        return None if v is None else int.from_bytes(v, "big")

    def _text(self, code: int) -> str | None:
        v = self.options.get(code)
        return None if v is None else v.rstrip(b"\0").decode("ascii", "replace")

    def _ips(self, code: int) -> list[IPv4Address]:
        v = self.options.get(code, b"")
        return [IPv4Address(v[i:i + 4]) for i in range(0, len(v), 4)]

    @_once
    def msg_type(self) -> MessageType:
        # cached in the instance's __dict__ (a frozen dataclass allows that; equality looks at fields only):
        # a shard asks it several times per request
        return MessageType(self.options[Opt.MSG_TYPE][0])

    @property
    def broadcast(self) -> bool:
        return bool(self.flags & FLAG_BROADCAST)

    @property
    def subnet_mask(self) -> IPv4Address | None:
        return self._ip(Opt.SUBNET_MASK)

    @property
    def routers(self) -> list[IPv4Address]:
        return self._ips(Opt.ROUTER)

    @property
    def dns_servers(self) -> list[IPv4Address]:
        return self._ips(Opt.DNS)

    @property
    def hostname(self) -> str | None:
        return self._text(Opt.HOSTNAME)

    @property
    def requested_ip(self) -> IPv4Address | None:
        return self._ip(Opt.REQUESTED_IP)

    @property
    def lease_time(self) -> int | None:
        return self._int(Opt.LEASE_TIME)

    @property
    def server_id(self) -> IPv4Address | None:
        return self._ip(Opt.SERVER_ID)

    @property
    def param_request_list(self) -> tuple[int, ...]:
        return tuple(self.options.get(Opt.PARAM_REQUEST_LIST, b""))

    @property
    def message(self) -> str | None:
        return self._text(Opt.MESSAGE)

    @property
    def max_message_size(self) -> int | None:
        return self._int(Opt.MAX_MESSAGE_SIZE)

    @property
    def t1(self) -> int | None:
        return self._int(Opt.RENEWAL_TIME)

    @property
    def t2(self) -> int | None:
        return self._int(Opt.REBINDING_TIME)

    @property
    def vendor_class(self) -> bytes | None:
        return self.options.get(Opt.VENDOR_CLASS)

    @property
    def client_id(self) -> bytes | None:
        return self.options.get(Opt.CLIENT_ID)

    # ------------------------------------------------------------------ encoding

    def _pieces(self) -> Iterator[tuple[int, bytes]]:
        return pieces(self.options)

    def serialize(self, max_size: int | None = None) -> bytes:
        """Wire bytes, padded to 300 B.  With ``max_size`` (the DHCP message size the receiver accepts,
        see ``reply.reply_limit``) options that do not fit spill into empty ``file`` then ``sname``
        fields (option 52); DhcpError if even that is too small."""
        body = encode_options(self.options) + bytes((END,))
        sname, file = self.sname, self.file
        if max_size is not None:
            if not isinstance(max_size, int) or max_size < BOOTP_MIN_LEN:
                raise DhcpError(f"max_size {max_size!r} is too small: a DHCP message takes at least "
                                f"{BOOTP_MIN_LEN} B (RFC 2131 clients accept 548 B)")
            if MIN_LEN + len(body) > max_size:
                body, sname, file = self._overload(list(self._pieces()), max_size, len(body))
        out = HEADER.pack(self.op, self.htype, len(self.chaddr), self.hops, self.xid, self.secs, self.flags,
                          self.ciaddr.packed, self.yiaddr.packed, self.siaddr.packed, self.giaddr.packed,
                          self.chaddr, sname, file, MAGIC) + body
        return out + bytes(max(0, BOOTP_MIN_LEN - len(out)))

    def _overload(self, pieces: list[tuple[int, bytes]], max_size: int, need: int) -> tuple[bytes, bytes, bytes]:
        # fields in RFC 3396 order: [name, capacity, content]; the options field reserves 3 B for option 52
        fields: list[list] = [["options", max_size - MIN_LEN - 3, bytearray()]]
        if not self.file:
            fields.append(["file", FILE_LEN, bytearray()])
        if not self.sname:
            fields.append(["sname", SNAME_LEN, bytearray()])
        f = 0
        for code, rest in pieces:
            splittable = code not in SPECS or SPECS[code][1] not in _FIXED_KINDS
            while True:
                _, cap, out = fields[f]
                room = cap - len(out) - 1  # one byte stays free for the end option
                if len(rest) + 2 <= room:
                    out += bytes((code, len(rest))) + rest
                    break
                if splittable and rest and room >= 3:  # RFC 3396: split on any octet boundary
                    out += bytes((code, room - 2)) + rest[:room - 2]
                    rest = rest[room - 2:]
                f += 1
                if f == len(fields):
                    raise DhcpError(
                        f"the options take {need} B but the receiver accepts a {max_size} B message (option 57) "
                        "even with the file and sname fields overloaded: send fewer or shorter options")
        used = {name: out for name, _, out in fields}
        flag = (OVERLOAD_FILE if used.get("file") else 0) | (OVERLOAD_SNAME if used.get("sname") else 0)
        body = bytes((Opt.OVERLOAD, 1, flag)) + bytes(used["options"]) + bytes((END,))
        file = bytes(used["file"]) + bytes((END,)) if used.get("file") else self.file
        sname = bytes(used["sname"]) + bytes((END,)) if used.get("sname") else self.sname
        return body, sname, file


# ---------------------------------------------------------------------- parsing


def _scan(buf: bytes, start: int, end: int, where: str) -> Iterator[tuple[int, bytes]]:
    """The option instances of one field, up to its end option."""
    i = start
    while i < end:
        code = buf[i]
        if code == PAD:
            i += 1
            continue
        if code == END:
            return
        if i + 1 >= end:
            raise DhcpError(f"{option_name(code)} at byte {i} of the {where} field has no length byte: "
                            "the message is truncated or corrupt")
        n = buf[i + 1]
        if i + 2 + n > end:
            raise DhcpError(f"{option_name(code)} at byte {i} of the {where} field claims {n} B but only "
                            f"{end - i - 2} B remain: it runs past the end of the field")
        yield code, buf[i + 2:i + 2 + n]
        i += 2 + n
    raise DhcpError(f"the {where} field has no end option (255): the message is truncated or corrupt")


def _collect(pieces: Iterable[tuple[int, bytes]], into: dict[int, bytes], where: str) -> None:
    for code, value in pieces:
        if code == Opt.OVERLOAD and where != "options":
            raise DhcpError(f"option 52 (overload) inside the {where} field: only the options field may carry "
                            "it (an overload loop)")
        into[code] = into.get(code, b"") + value


def parse(data: bytes) -> Message:
    """Parse one DHCP message (the UDP payload).  Raises DhcpError, and nothing else, for bad input."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DhcpError(f"parse() takes the UDP payload as bytes, not {type(data).__name__}")
    buf = bytes(data)
    if len(buf) < MIN_LEN:
        raise DhcpError(f"truncated DHCP message: {len(buf)} B, the BOOTP header and magic cookie alone take "
                        f"{MIN_LEN} B")
    (op, htype, hlen, hops, xid, secs, flags, ciaddr, yiaddr, siaddr, giaddr, chaddr, sname, file,
     cookie) = HEADER.unpack_from(buf)
    if cookie != MAGIC:
        raise DhcpError(f"bad magic cookie {cookie:#010x}: DHCP needs 0x63825363 (99.130.83.99) after the "
                        "BOOTP header; plain BOOTP is not served")
    if op not in (BOOTREQUEST, BOOTREPLY):
        raise DhcpError(f"op {op} is neither BOOTREQUEST (1) nor BOOTREPLY (2)")
    if hlen > CHADDR_LEN:
        raise DhcpError(f"hlen {hlen} is larger than the {CHADDR_LEN} B chaddr field")
    opts: dict[int, bytes] = {}
    _collect(_scan(buf, MIN_LEN, len(buf), "options"), opts, "options")
    overload = opts.pop(Opt.OVERLOAD, None)
    if overload is not None:
        if len(overload) != 1 or overload[0] not in (1, 2, 3):
            raise DhcpError(f"option 52 (overload) is {overload.hex() or 'empty'}: it must be one byte, "
                            "1 (file), 2 (sname) or 3 (both)")
        if overload[0] & OVERLOAD_FILE:
            _collect(_scan(buf, FILE_OFF, FILE_OFF + FILE_LEN, "file"), opts, "file")
            file = b""
        if overload[0] & OVERLOAD_SNAME:
            _collect(_scan(buf, SNAME_OFF, SNAME_OFF + SNAME_LEN, "sname"), opts, "sname")
            sname = b""
    # What Message.__post_init__ would check of these fields (the header's fields are in range by their
    # struct sizes, op and hlen are checked above): every option, and that 53 is there.
    for code, value in opts.items():
        _check_option(code, value)
    if Opt.MSG_TYPE not in opts:
        raise DhcpError(_NO_MSG_TYPE)
    return Message._checked_already(op, xid, chaddr[:hlen], opts, htype, hops, secs, flags, _ip4(ciaddr),
                                    _ip4(yiaddr), _ip4(siaddr), _ip4(giaddr), sname.rstrip(b"\0"),
                                    file.rstrip(b"\0"))


def _ip4(packed: bytes) -> IPv4Address:
    return ZERO if packed == _ZERO4 else IPv4Address(packed)
