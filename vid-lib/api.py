"""The service API (DESIGN.md §5) over :class:`RawPort` and the :class:`Registry`.

Server::

    srv = announce(registry, "kvs", "kvs-1", "h1-eth0", rx="ovs")
    srv.listen(0, 0x7FFFFF)
    while (req := srv.accept(timeout=1.0)) is not None:
        req.reply(b"...")

Client::

    cli = Client(registry, "kvs", "h2-eth0")
    ch = cli.bind(key)            # a channel to the VID of key
    seq = ch.send(b"get x")
    rep = ch.recv(timeout=1.0)    # next REPLY on this channel (or None)
    rep = cli.request(key, b"get x", timeout=1.0)   # one-shot, matched by (channel, seq)

Replies are demultiplexed by channel: a reply read while waiting on one channel
is buffered for the channel it belongs to.  Channel 0 is the client's request
channel (``request``/``send_request``/``wait_reply``/``recv_reply``); ``bind``
hands out 1..65535.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from dataclasses import dataclass, field

from vfab.vid import codec
from vfab.vid.registry import schema
from vfab.vid.codec import Layout
from vfab.vid.errors import TransportError
from vfab.vid.frame import Frame, FrameType, pack
from vfab.vid.ranges import Range, to_masks
from vfab.vid.registry import Registry
from vfab.vid.state.lease import EndpointLease
from vfab.vid.transport import RawPort

log = logging.getLogger("vfab.api")

REQUEST_CHANNEL = 0
CHANNEL_MAX = 0xFFFF
SEQ_MOD = 1 << 32
BUFFER_LIMIT = 4096  # replies buffered per channel before the oldest are dropped


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(timeout, 0.0)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def service_blocks(svc: schema.Service, rng: Range) -> list[tuple[int, int]]:
    """(value, mask) blocks over the MAC that cover the VIDs of ``rng`` in ``svc``."""
    layout = Layout.parse(svc.layout)
    return [codec.block_match(svc.id, v, m, layout=layout) for v, m in to_masks(rng)]


# ---------------------------------------------------------------------------- server


class _FrameView:
    """Read-only shortcuts to the fields of the frame a message came in."""

    frame: Frame

    @property
    def src(self) -> bytes:
        return self.frame.src

    @property
    def dst(self) -> bytes:
        return self.frame.dst

    @property
    def payload(self) -> bytes:
        return self.frame.payload

    @property
    def channel(self) -> int:
        return self.frame.channel

    @property
    def seq(self) -> int:
        return self.frame.seq


@dataclass
class Request(_FrameView):
    """A REQUEST frame as the server sees it."""

    frame: Frame
    key: int | None  # from the destination VID; None when OVS rewrote it to our MAC
    server: "Server" = field(repr=False)

    def reply(self, data: bytes, priority: int | None = None) -> bool:
        """Send a REPLY to the requester with the same channel and seq; False if the queue was full."""
        return self.server.send(self.frame.src, data, channel=self.frame.channel, seq=self.frame.seq,
                                type=FrameType.REPLY,
                                priority=self.frame.priority if priority is None else priority)


class Server:
    """An announced endpoint of a service; obtain one with :func:`announce`."""

    def __init__(self, registry: Registry, svc: schema.Service, name: str, port: RawPort,
                 lease: EndpointLease):
        self.registry = registry
        self.service = svc
        self.layout = Layout.parse(svc.layout)
        self.name = name
        self.port = port
        self._lease = lease
        self.ranges: list[Range] = []
        self.counters: dict[str, int] = {"requests": 0, "not_requests": 0}

    @property
    def lease(self) -> int:
        """The endpoint's etcd lease now (a new one after etcd lost the old: see :func:`announce`)."""
        return self._lease.id

    @property
    def mac(self) -> bytes:
        return self.port.mac

    def refresh(self) -> list[Range]:
        """Re-read the ranges this endpoint owns (or mirrors) and update the receive filter."""
        owned = [rec.range for rec, _ in self.registry.ranges(self.service.name)
                 if rec.owner == self.name or self.name in rec.mirrors]
        self.ranges = owned
        blocks = [b for r in owned for b in service_blocks(self.service, r)]
        self.port.set_blocks(blocks)
        return owned

    def listen(self, lo: int, hi: int) -> int:
        """Take keys ``lo..hi`` of the service (one etcd transaction); returns the etcd revision."""
        rng = Range(lo, hi)
        rev = self.registry.assign(self.service.name, rng, self.name)
        self.refresh()
        log.info("server %s/%s: listening on %s", self.service.name, self.name, rng)
        return rev

    def _key_of(self, dst: bytes) -> int | None:
        if not codec.is_vid(dst):
            return None
        vid = codec.decode(dst, self.layout)
        return vid.key if vid.service == self.service.id else None

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame of any type addressed to us."""
        return self.port.recv(timeout)

    def accept(self, timeout: float | None = None) -> Request | None:
        """The next REQUEST within ``timeout`` s (other frame types are counted and skipped)."""
        deadline = _deadline(timeout)
        while True:
            frame = self.port.recv(_left(deadline))
            if frame is None:
                return None
            if frame.type is not FrameType.REQUEST:
                self.counters["not_requests"] += 1
                log.debug("server %s: skipped a %s frame", self.name, frame.type.name)
                continue
            self.counters["requests"] += 1
            return Request(frame=frame, key=self._key_of(frame.dst), server=self)

    def send(self, dst: bytes | str, data: bytes, *, channel: int = 0, seq: int = 0,
             type: FrameType = FrameType.REPLY, priority: int = 0) -> bool:
        dst_b = codec.mac_to_int(dst).to_bytes(6, "big")
        frame = Frame(dst=dst_b, src=self.port.mac, type=type, payload=bytes(data),
                      channel=channel, seq=seq % SEQ_MOD, priority=priority)
        return self.port.send(frame)

    def close(self) -> None:
        """Withdraw the endpoint (revoke its lease) and close the port. Ranges stay assigned."""
        self._lease.revoke()
        self.port.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def announce(registry: Registry, service: str, name: str, iface: str, rx: str = "ovs",
             ttl: int = 3, netns: str | None = None, ctl: str = "") -> Server:
    """Open ``iface``, register endpoint ``name`` of ``service`` under a lease, return the Server.

    ``netns``: open the data port in that network namespace (e.g. a testbed host's
    /proc/PID/ns/net) while etcd is reached from the process's own namespace.
    ``ctl``: the endpoint's ZeroMQ control address, for stateful services (state manager).
    Should etcd lose the lease (the process stopped or starved past ``ttl``), the endpoint is announced again
    under a new one as soon as the process runs again (``Server.lease`` then names it).
    """
    svc = registry.service(service)
    port = RawPort(iface, rx, netns=netns)
    lease = EndpointLease(registry.endpoint, ttl, name=f"{service}/{name}")
    try:
        ep = schema.Endpoint(service=service, name=name, mac=port.mac_str, rx=rx, host=socket.gethostname(),
                              ctl=ctl)
        registry.announce(ep, ttl, lease=lease.grant())

        def again(lease_id: int) -> None:   # the lease was granted anew: the record goes back under it
            registry.announce(ep, ttl, allow_shared=True, lease=lease_id)
            log.warning("server %s/%s: announced again (lease %x)", service, name, lease_id)

        lease.on_renewed.append(again)
        lease.start()
        server = Server(registry, svc, name, port, lease)
        server.refresh()
    except BaseException:
        lease.revoke()
        port.close()
        raise
    return server


# ---------------------------------------------------------------------------- client


@dataclass
class Reply(_FrameView):
    frame: Frame
    received: float  # time.time() when read off the socket


def resolve(registry: Registry, service: str) -> schema.Service:
    """The service record (id and VID layout); NotFound says how to create it."""
    return registry.service(service)


class Channel:
    """A client's conversation with one key of a service (from :meth:`Client.bind`)."""

    def __init__(self, client: "Client", number: int, key: int):
        self.client = client
        self.number = number
        self.key = key
        self.dst = client.vid(key)
        self._seq = 0
        self.closed = False

    def send(self, data: bytes, priority: int = 0) -> int:
        """Send a REQUEST to the key's VID; returns its seq."""
        if self.closed:
            raise TransportError(f"channel {self.number} is closed: bind the key again")
        self._seq = (self._seq + 1) % SEQ_MOD
        self.client._send(self.dst, self.number, self._seq, data, priority)
        return self._seq

    def recv(self, timeout: float | None = None) -> Reply | None:
        """The next REPLY on this channel within ``timeout`` s."""
        return self.client._recv_channel(self.number, timeout)

    def close(self) -> None:
        self.client._release(self.number)
        self.closed = True


class Client:
    """A client endpoint of one service on one interface."""

    def __init__(self, registry: Registry, service: str, iface: str, rx: str = "ovs",
                 netns: str | None = None):
        self.service = resolve(registry, service)
        self.layout = Layout.parse(self.service.layout)
        self.port = RawPort(iface, rx, netns=netns)
        self._buffers: dict[int, collections.deque[Reply]] = {REQUEST_CHANNEL: collections.deque()}
        self._next_channel = 1
        self._req_seq = 0
        self.counters: dict[str, int] = {"orphans": 0, "not_replies": 0, "overflow": 0}

    @property
    def mac(self) -> bytes:
        return self.port.mac

    def vid(self, key: int) -> bytes:
        return codec.packed(self.service.id, key, self.layout)

    # -- channels ---------------------------------------------------------
    def bind(self, key: int) -> Channel:
        """A new channel to ``key`` (numbers are unique among this client's open channels)."""
        codec.encode(self.service.id, key, layout=self.layout)  # validates the key
        if len(self._buffers) > CHANNEL_MAX:
            raise TransportError(
                f"this client has {CHANNEL_MAX} channels open, the limit: close some (Channel.close) "
                "or use Client.request"
            )
        while self._next_channel in self._buffers:
            self._next_channel = self._next_channel % CHANNEL_MAX + 1
        number = self._next_channel
        self._next_channel = number % CHANNEL_MAX + 1
        self._buffers[number] = collections.deque()
        return Channel(self, number, key)

    def _release(self, number: int) -> None:
        if number != REQUEST_CHANNEL:
            self._buffers.pop(number, None)

    def _send(self, dst: bytes, channel: int, seq: int, data: bytes, priority: int) -> None:
        # dst is codec.packed's and src the port's own: 6 bytes each, no Frame to build and check
        if not self.port.send(pack(dst, self.port.mac, FrameType.REQUEST, data, channel, seq, priority)):
            log.debug("client: request %d/%d dropped by the local queue", channel, seq)

    def _pump(self, timeout: float | None) -> Reply | None:
        """Read one REPLY off the port (skipping other types); None on timeout."""
        deadline = _deadline(timeout)
        while True:
            frame = self.port.recv(_left(deadline))
            if frame is None:
                return None
            if frame.type is FrameType.REPLY:
                return Reply(frame, time.time())
            self.counters["not_replies"] += 1

    def _stash(self, reply: Reply) -> None:
        buf = self._buffers.get(reply.channel)
        if buf is None:
            self.counters["orphans"] += 1
            log.debug("client: reply on unknown channel %d (seq %d) dropped", reply.channel, reply.seq)
            return
        if len(buf) >= BUFFER_LIMIT:
            buf.popleft()
            self.counters["overflow"] += 1
        buf.append(reply)

    def _recv_channel(self, channel: int, timeout: float | None) -> Reply | None:
        buf = self._buffers.get(channel)
        if buf is None:
            raise TransportError(f"channel {channel} is not open: bind a key first")
        if buf:
            return buf.popleft()
        deadline = _deadline(timeout)
        while True:
            reply = self._pump(_left(deadline))
            if reply is None:
                return None
            if reply.channel == channel:
                return reply
            self._stash(reply)

    # -- one-shot requests (channel 0) ------------------------------------
    def send_request(self, key: int, data: bytes, priority: int = 0) -> int:
        """Send a REQUEST to ``key`` on the request channel; returns its seq."""
        dst = self.vid(key)
        self._req_seq = (self._req_seq + 1) % SEQ_MOD
        self._send(dst, REQUEST_CHANNEL, self._req_seq, data, priority)
        return self._req_seq

    def recv_reply(self, timeout: float | None = None) -> Reply | None:
        """The next reply on the request channel, whatever its seq (late and duplicate ones too)."""
        return self._recv_channel(REQUEST_CHANNEL, timeout)

    def wait_reply(self, seq: int, timeout: float | None = None) -> Reply | None:
        """The reply to request ``seq``; other request-channel replies stay buffered."""
        buf = self._buffers[REQUEST_CHANNEL]
        for i, reply in enumerate(buf):
            if reply.seq == seq:
                del buf[i]
                return reply
        deadline = _deadline(timeout)
        while True:
            reply = self._pump(_left(deadline))
            if reply is None:
                return None
            if reply.channel == REQUEST_CHANNEL and reply.seq == seq:
                return reply
            self._stash(reply)

    def request(self, key: int, data: bytes, timeout: float = 1.0, priority: int = 0) -> Reply | None:
        """Send to ``key`` and wait for the matching (channel, seq) reply; None on timeout."""
        return self.wait_reply(self.send_request(key, data, priority), timeout)

    def close(self) -> None:
        self.port.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
