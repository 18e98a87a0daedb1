"""The ZeroMQ control envelope (DESIGN.md §4): the only module that knows its format.

Every endpoint-to-endpoint control message is one ZeroMQ multipart message::

    [ header (JSON object) ][ blob 0 ][ blob 1 ] ...

    header = {"v": 1, "type": "<TYPE>", "sender": "<endpoint>", "epoch": <int>,
              "id": <int, matches a reply to its request>, "body": {...}}

Blobs carry bulk bytes (state records, forwarded frames) without re-encoding.
A receiver rejects another major version ``v`` with ``EnvelopeError`` naming
both; unknown body fields are the handler's business (it ignores extras).
Types used by the state manager: BEGIN, CHUNK, REPL, SYNC, COMMIT, ABORT, FWD,
ALIVE (peer protocol; FWD and ALIVE are not answered); SPLIT (a merge is a SPLIT whose body says
``merge``), MIRROR, MOVE, CANCEL, PING, STATS (operator commands); OK and ERR answer any of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vfab.vid.errors import VfabError

VERSION = 1
MAX_HEADER = 64 * 1024


class EnvelopeError(VfabError):
    """A control message could not be decoded (wrong version, not JSON, missing fields)."""


@dataclass
class Envelope:
    type: str
    sender: str = ""
    epoch: int = 0
    id: int = 0
    body: dict = field(default_factory=dict)
    blobs: list[bytes] = field(default_factory=list)

    def frames(self) -> list[bytes]:
        head = {"v": VERSION, "type": self.type, "sender": self.sender, "epoch": self.epoch, "id": self.id,
                "body": self.body}
        return [json.dumps(head, separators=(",", ":")).encode(), *self.blobs]

    def reply(self, type: str = "OK", sender: str = "", **body) -> "Envelope":
        return Envelope(type, sender=sender, epoch=self.epoch, id=self.id, body=body)


def decode(frames: list[bytes]) -> Envelope:
    if not frames:
        raise EnvelopeError("empty control message: a header frame is required")
    raw = bytes(frames[0])
    if len(raw) > MAX_HEADER:
        raise EnvelopeError(f"control header of {len(raw)} B is too large: the limit is {MAX_HEADER} B")
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise EnvelopeError(f"control header is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise EnvelopeError("control header is not a JSON object")
    if type(head.get("v")) is not int or head.get("v") != VERSION:
        raise EnvelopeError(f"control message version {head.get('v')!r} is not supported: this endpoint speaks "
                            f"{VERSION}; upgrade the older side")
    kind, body = head.get("type"), head.get("body", {})
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise EnvelopeError("control header needs a string 'type' and an object 'body'")
    epoch, ident = head.get("epoch", 0), head.get("id", 0)
    if type(epoch) is not int or type(ident) is not int:
        raise EnvelopeError(f"control header has a non-integer 'epoch' or 'id' ({epoch!r}, {ident!r})")
    return Envelope(kind, str(head.get("sender", "")), epoch, ident, body, [bytes(f) for f in frames[1:]])
