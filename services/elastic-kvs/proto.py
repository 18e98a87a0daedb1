"""elastic-KVS request and reply payloads: the only module that knows their wire format.

They ride in the payload of a vfab REQUEST/REPLY frame (``vfab.vid.frame``).

Request::

    0               1               2               3
    +---------------+---------------+-------------------------------+
    |  op (1 B)     |  flags = 0    |        key length (2 B)       |
    +---------------+---------------+-------------------------------+
    |                    client id (8 B, random per client)         |
    +---------------------------------------------------------------+
    |     request id = sequence number (8 B, 1, 2, ... per client)  |
    +---------------------------------------------------------------+
    |  acked (8 B): the client has the final outcome of every       |
    |  request of its with a lower sequence number (0: says nothing)|
    +-------------------------------+-------------------------------+
    |  deadline (4 B, UNIX seconds) |
    +-------------------------------+-------------------------------+
    |  key (key length B) ... value (rest of the payload, PUT only) |

Reply (sent from the VID that was asked: a client drops replies from anywhere else)::

    +---------------+---------------+-------------------------------+
    |  status (1 B) |  flags = 0    |          reserved = 0         |
    +---------------+---------------+-------------------------------+
    |                    client id (8 B, echoed)                    |
    +---------------------------------------------------------------+
    |                    request id (8 B, echoed)                   |
    +---------------------------------------------------------------+
    |                    version (8 B) of the key after the op      |
    +---------------------------------------------------------------+
    |  value (GET, status OK) or a UTF-8 error message (status >= 3) |

The client id is a random 64-bit number (a client session), so a host that is not the key's owner can
neither guess a reply's ids nor send it from the key's VID (port security).  (client id, request id)
names one logical operation: a retried PUT or DELETE carries the same pair and is applied once, however
late a copy of it arrives and wherever the key has moved meanwhile: the key's completion records
(``session.py``) answer it, ``acked`` lets the server forget them, and ``deadline`` (by when the client
stops retrying) bounds how long a session's records must be kept.  A request whose deadline has passed
is refused (EXPIRED), never applied.  Versions start at 1 for the first write of a key and grow by one
per write (a DELETE of a missing key too: it leaves a tombstone with its completion record); a deleted
key keeps its version as a tombstone.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from hashlib import blake2b

from vfab.vid.errors import VfabError

REQ = struct.Struct("!BBHQQQI")
REP = struct.Struct("!BBHQQQ")
REQ_LEN = REQ.size
REP_LEN = REP.size
MAX_KEY = 128
MAX_VALUE = 1280  # + header + key fits one vfab frame (1488 B of payload)


class KvsError(VfabError):
    """A KVS operation failed; the message says what is wrong, the limit and the fix."""


class Op(enum.IntEnum):
    GET = 1
    PUT = 2
    DEL = 3


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    BAD_REQUEST = 3  # malformed or over a limit: the message says which
    WRONG_OWNER = 4  # the range is not this server's (a stale route); retry
    UNAVAILABLE = 5  # the server could not make the write durable; retry later
    EXPIRED = 6      # the request's deadline passed before a server could apply it: it was not applied


def check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise KvsError(f"key must be bytes, not {type(key).__name__}: encode it (e.g. key.encode())")
    if not 1 <= len(key) <= MAX_KEY:
        raise KvsError(f"key of {len(key)} B is out of bounds: keys are 1..{MAX_KEY} B")
    return bytes(key)


def check_value(value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise KvsError(f"value must be bytes, not {type(value).__name__}: encode it first")
    if len(value) > MAX_VALUE:
        raise KvsError(f"value of {len(value)} B is too large: the limit is {MAX_VALUE} B (one frame); "
                       "split it over several keys")
    return bytes(value)


@dataclass(frozen=True)
class Request:
    op: Op
    client: int
    reqid: int
    key: bytes
    value: bytes = b""
    acked: int = 0
    deadline: int = 0

    def serialize(self) -> bytes:
        check_key(self.key)
        if self.op is Op.PUT:
            check_value(self.value)
        elif self.value:
            raise KvsError(f"{self.op.name} carries no value")
        return pack_request(self.op, self.client, self.reqid, self.key, self.value, self.acked, self.deadline)


def pack_request(op: Op, client: int, reqid: int, key: bytes, value: bytes = b"", acked: int = 0,
                 deadline: int = 0) -> bytes:
    """A request's bytes from fields already checked (``check_key``/``check_value``; ``Request.serialize``
    checks them first)."""
    return REQ.pack(op, 0, len(key), client, reqid, acked, deadline) + key + value


def parse_request(data: bytes) -> Request:
    """Parse a request; KvsError says what is wrong. Never raises anything else."""
    if len(data) < REQ_LEN:
        raise KvsError(f"truncated request: {len(data)} B, the header alone is {REQ_LEN} B")
    op, flags, klen, client, reqid, acked, deadline = REQ.unpack_from(data, 0)
    try:
        op = Op(op)
    except ValueError:
        raise KvsError(f"unknown op {op}: use GET (1), PUT (2) or DEL (3)") from None
    if flags:
        raise KvsError(f"reserved flags {flags:#x} are set: the client speaks another revision")
    if not 1 <= klen <= MAX_KEY:
        raise KvsError(f"key length {klen} is out of bounds: keys are 1..{MAX_KEY} B")
    if REQ_LEN + klen > len(data):
        raise KvsError(f"truncated request: key length says {klen} B, {len(data) - REQ_LEN} B follow")
    if reqid == 0:
        raise KvsError("request id 0 is reserved: number a client's requests from 1")
    if acked > reqid:
        raise KvsError(f"acked {acked} is above the request's own id {reqid}: a client acknowledges only "
                       "requests it sent before")
    key = bytes(data[REQ_LEN:REQ_LEN + klen])
    value = bytes(data[REQ_LEN + klen:])
    if op is not Op.PUT and value:
        raise KvsError(f"{op.name} carries no value, but {len(value)} B follow the key")
    if len(value) > MAX_VALUE:
        raise KvsError(f"value of {len(value)} B is too large: the limit is {MAX_VALUE} B")
    return Request(op, client, reqid, key, value, acked, deadline)


def peek(data: bytes) -> tuple[int, int, bytes | None]:
    """(client id, request id, key or None) of whatever can be read of a request; never raises."""
    if len(data) < REQ_LEN:
        return 0, 0, None
    _op, _flags, klen, client, reqid, _acked, _deadline = REQ.unpack_from(data, 0)
    key = bytes(data[REQ_LEN:REQ_LEN + klen]) if 1 <= klen <= MAX_KEY and REQ_LEN + klen <= len(data) else None
    return client, reqid, key


@dataclass(frozen=True)
class Reply:
    status: Status
    reqid: int
    version: int = 0
    body: bytes = b""
    client: int = 0

    def serialize(self) -> bytes:
        return REP.pack(int(self.status), 0, 0, self.client, self.reqid, self.version) + self.body

    @property
    def message(self) -> str:
        return self.body.decode("utf-8", "replace")


def parse_reply(data: bytes) -> Reply:
    if len(data) < REP_LEN:
        raise KvsError(f"truncated reply: {len(data)} B, the header alone is {REP_LEN} B")
    status, _flags, _res, client, reqid, version = REP.unpack_from(data, 0)
    try:
        status = Status(status)
    except ValueError:
        raise KvsError(f"unknown reply status {status}: the server speaks another revision") from None
    return Reply(status, reqid, version, bytes(data[REP_LEN:]), client)


def error_reply(reqid: int, status: Status, message: str, client: int = 0) -> bytes:
    return Reply(status, reqid, 0, message.encode()[:MAX_VALUE], client).serialize()


def key_of(payload: bytes) -> int:
    """The VID key of a request payload; KvsError if it has no readable key."""
    _client, _reqid, key = peek(payload)
    if key is None:
        raise KvsError(f"request of {len(payload)} B has no readable key: the header is {REQ_LEN} B, then "
                       f"1..{MAX_KEY} B of key")
    return vkey(key)


def vkey(key: bytes) -> int:
    """The 24-bit VID key of a KVS key: the top bits of its BLAKE2b hash (spreads keys evenly).

    Remembered for the last ``VKEYS_MAX`` keys (all forgotten at once past that): clients and servers ask it
    for every request, mostly of keys they asked for before."""
    if type(key) is not bytes:
        key = bytes(key)   # a bytearray or memoryview: the cache keeps only immutable keys
    vk = _vkeys.get(key)
    if vk is None:
        if len(_vkeys) >= VKEYS_MAX:
            _vkeys.clear()
        vk = _vkeys[key] = int.from_bytes(blake2b(key, digest_size=8).digest()[:3], "big")
    return vk


VKEYS_MAX = 65536
_vkeys: dict[bytes, int] = {}
