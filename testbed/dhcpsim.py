"""Simulated DHCP clients on one raw socket in a testbed host: leasing, then renewing on a tight clock.

Real clients (udhcpc, dhclient, dhcpcd) renew at T1 with second-granular
timers and say little about *when* a reply came; a failover measurement needs
each client's renewals and answers timed to the millisecond.  :class:`SimClients`
plays N clients (their MACs must be registered on the host's port: port
security lets a port speak for its registered MACs only, :func:`register`)
from one ``AF_PACKET`` socket, with only ``wire`` and ``ipudp`` (the formats
the server uses):

* :meth:`SimClients.lease`: DISCOVER/OFFER/REQUEST/ACK for every client at
  once, broadcast flag set, retransmitting after ``retry`` s;
* :meth:`SimClients.renew`: RFC 2131 §4.4.5 on a short clock: each client sends a
  unicast REQUEST with ``ciaddr`` to its server (RENEWING) ``period`` s after its
  last ACK, retransmits every ``retry`` s, and once ``t2`` s have passed since
  its last ACK broadcasts it (REBINDING); an ACK from another server makes that
  server its server (Kea HA's standby has an address of its own; sdhcp's shards
  share one).  Every ACK and NAK is logged with its time, address and server.

It is a load generator and a probe, not a client a host uses: it configures
no address.
"""

from __future__ import annotations

import itertools
import select
import socket
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Callable

from vfab.services.sdhcp import ipudp, wire
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.wire import FLAG_BROADCAST, Message, MessageType, Opt
from vfab.vid import codec
from vfab.vid.netns import netns
from vfab.vid.registry import schema

BCAST_MAC, BCAST_IP, ZERO = b"\xff" * 6, IPv4Address("255.255.255.255"), IPv4Address(0)
PACKET_OUTGOING = 4


def register(tb, host: str, macs: list[bytes]) -> None:
    """Register ``macs`` on ``host``'s port (the fabric then admits them and routes them there)."""
    info = tb.hosts[host]
    for mac in macs:
        tb.registry.put_host(schema.Host(mac=codec.int_to_mac(int.from_bytes(mac, "big")), dpid=info["dpid"],
                                         port=info["port"], name=host))
    tb.wait_revision(tb.registry.state_revision(), timeout=60)


@dataclass
class Client:
    mac: bytes
    xid: int
    ip: IPv4Address | None = None
    server: IPv4Address | None = None
    last_ack: float = 0.0
    next_send: float = 0.0
    sent_at: float = 0.0               # when the request now outstanding was first sent
    last_sent: float = 0.0             # when it was last (re)sent
    acks: list = field(default_factory=list)     # (last send of the request, t_ack, yiaddr, server, kind, first send)
    naks: list = field(default_factory=list)     # (t, server, message)


class SimClients:
    def __init__(self, tb, host: str, macs: list[bytes], server_mac: Callable[[IPv4Address, bytes], bytes],
                 broadcast_mac: Callable[[bytes], bytes] | None = None):
        """Clients on testbed host ``host``'s interface.

        ``server_mac(server_ip, client_mac)``: the MAC a unicast to the client's server goes to (what the
        client's ARP would give: for sdhcp the VID of the client's key, for Kea the server's own MAC).
        ``broadcast_mac(client_mac)``: the Ethernet destination of a broadcast (default ff:ff:ff:ff:ff:ff;
        without a switch a test sends straight to the shard's MAC, as the dhcp4 front door would)."""
        self._open(tb.hosts[host]["iface"], tb.netns(host), macs, server_mac, broadcast_mac)

    @classmethod
    def at(cls, iface: str, netns_path: str | None, macs: list[bytes],
           server_mac: Callable[[IPv4Address, bytes], bytes],
           broadcast_mac: Callable[[bytes], bytes] | None = None) -> "SimClients":
        """Clients on any interface (``netns_path``: its namespace, None for ours), no testbed needed."""
        self = cls.__new__(cls)
        self._open(iface, netns_path, macs, server_mac, broadcast_mac)
        return self

    def _open(self, iface: str, netns_path: str | None, macs: list[bytes],
              server_mac: Callable[[IPv4Address, bytes], bytes],
              broadcast_mac: Callable[[bytes], bytes] | None) -> None:
        self.iface = iface
        self.server_mac = server_mac
        self.broadcast_mac = broadcast_mac or (lambda mac: BCAST_MAC)
        self.clients = [Client(mac, 0x5E000000 + i) for i, mac in enumerate(macs)]
        self._by_xid = {c.xid: c for c in self.clients}
        self._xids = itertools.count(0x5E000000 + len(macs))
        with netns(netns_path):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ipudp.ETH_P_IP))
        self.sock.bind((self.iface, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setblocking(False)
        self.sent = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SimClients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- frames ---------------------------------------------------------------------------------
    def _send(self, c: Client, mtype: MessageType, opts: dict | None = None, ciaddr: IPv4Address = ZERO,
              unicast_to: IPv4Address | None = None) -> None:
        options = {Opt.MSG_TYPE: bytes([mtype]), **(opts or {})}
        msg = Message(op=1, xid=c.xid, chaddr=c.mac, ciaddr=ciaddr, flags=0 if unicast_to else FLAG_BROADCAST,
                      options=options).serialize()
        if unicast_to is not None:
            dg = ipudp.Datagram(self.server_mac(unicast_to, c.mac), c.mac, ciaddr, unicast_to, 68, 67, msg)
        else:
            dg = ipudp.Datagram(self.broadcast_mac(c.mac), c.mac, ciaddr, BCAST_IP, 68, 67, msg)
        try:
            self.sock.send(dg.serialize())
        except BlockingIOError:
            pass  # the socket's send buffer is full: this try is lost, the retransmission follows
        c.last_sent = time.monotonic()
        self.sent += 1

    def _replies(self, timeout: float):
        """(arrival time, client, message) of DHCP replies to our clients within ``timeout`` s."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not ready:
            return
        while True:
            try:
                frame, meta = self.sock.recvfrom(65536)
            except BlockingIOError:
                return
            now = time.monotonic()
            if meta[2] == PACKET_OUTGOING:
                continue
            try:
                dg = ipudp.parse(frame)
                if dg.dst_port != 68:
                    continue
                msg = wire.parse(dg.payload)
            except DhcpError:
                continue
            c = self._by_xid.get(msg.xid)
            if c is not None and msg.chaddr == c.mac and msg.op == wire.BOOTREPLY:
                yield now, c, msg

    # -- leasing --------------------------------------------------------------------------------
    def lease(self, timeout: float = 30.0, retry: float = 1.0) -> dict[bytes, IPv4Address]:
        """DORA for every client without an address; their addresses (clients that got none are left out)."""
        want = [c for c in self.clients if c.ip is None]
        state = {id(c): "discover" for c in want}
        req: dict[int, tuple] = {}
        for c in want:
            self._send(c, MessageType.DISCOVER)
            c.sent_at = time.monotonic()
        deadline = time.monotonic() + timeout
        left = len(want)
        while left and time.monotonic() < deadline:
            for now, c, msg in self._replies(0.05):
                st = state.get(id(c))
                if msg.msg_type is MessageType.OFFER and st == "discover":
                    req[id(c)] = {Opt.SERVER_ID: msg.server_id.packed, Opt.REQUESTED_IP: msg.yiaddr.packed}
                    state[id(c)] = "request"
                    self._send(c, MessageType.REQUEST, req[id(c)])
                    c.sent_at = now
                elif msg.msg_type is MessageType.ACK and st == "request":
                    state[id(c)] = "done"
                    c.ip, c.server, c.last_ack = msg.yiaddr, msg.server_id, now
                    c.acks.append((c.last_sent, now, msg.yiaddr, msg.server_id, "select", c.sent_at))
                    c.sent_at = 0.0
                    left -= 1
                elif msg.msg_type is MessageType.NAK and st == "request":
                    state[id(c)] = "discover"
                    c.sent_at = 0.0
            now = time.monotonic()
            for c in want:
                st = state[id(c)]
                if st != "done" and now - c.sent_at > retry:
                    c.sent_at = now
                    if st == "request":
                        self._send(c, MessageType.REQUEST, req[id(c)])
                    else:
                        self._send(c, MessageType.DISCOVER)
        return {c.mac: c.ip for c in self.clients if c.ip is not None}

    # -- renewing -------------------------------------------------------------------------------
    def renew(self, duration: float, period: float = 0.5, retry: float = 0.25, t2: float = 3.0,
              tick: Callable[[float], bool | None] | None = None, finish: bool = False) -> None:
        """Renew every leased client for ``duration`` s (see the module doc); ``tick(now)`` runs every loop
        turn (a test kills a server from it at the time it chooses) and ends the renewing early by returning
        True.  A request still unanswered at the end stays in :meth:`waiting`, and the next call goes on
        retransmitting it (its wait counts from its first send).  ``finish``: send nothing new, only
        retransmit the unanswered requests, and end once each is answered (or after ``duration``)."""
        now = time.monotonic()
        live = [c for c in self.clients if c.ip is not None and (c.sent_at or not finish)]
        for i, c in enumerate(live):  # spread the first renewals over one period; unanswered ones go now
            c.next_send = now if c.sent_at else now + period * i / max(1, len(live))
        end = now + duration
        while True:
            now = time.monotonic()
            if now >= end or (finish and not any(c.sent_at for c in live)):
                return
            if tick is not None and tick(now):
                return
            for c in live:
                if now < c.next_send:
                    continue
                if not c.sent_at:
                    c.sent_at = now
                if now - c.last_ack >= t2:   # REBINDING: broadcast, any server may answer
                    self._send(c, MessageType.REQUEST, ciaddr=c.ip)
                else:                        # RENEWING: unicast to our server
                    self._send(c, MessageType.REQUEST, ciaddr=c.ip, unicast_to=c.server)
                c.next_send = now + retry
            wait = min([c.next_send for c in live] + [end]) - time.monotonic()
            for at, c, msg in self._replies(min(wait, 0.02)):
                if msg.msg_type is MessageType.ACK and c.sent_at:
                    self._acked(c, at, msg, "rebind" if at - c.last_ack >= t2 else "renew", c.last_sent)
                    c.next_send = end if finish else at + period
                elif msg.msg_type is MessageType.NAK:
                    c.naks.append((at, msg.server_id, msg.message))

    @staticmethod
    def _acked(c, at: float, msg, kind: str, sent: float) -> None:
        """Record a renewal's ACK: (last send, answered at, address, server, kind, first send) in ``acks``;
        the client now holds that address from that server and waits for nothing."""
        c.acks.append((sent, at, msg.yiaddr, msg.server_id, kind, c.sent_at))
        c.ip, c.server, c.last_ack, c.sent_at = msg.yiaddr, msg.server_id, at, 0.0

    def renew_once(self, timeout: float, macs: list[bytes] | None = None) -> dict[bytes, float | None]:
        """Each leased client (of ``macs``) sends one unicast renewal and never retransmits it: per client, the
        seconds to its ACK (None: none within ``timeout``).  A real client's next try may be many seconds
        away (ISC dhclient: 10 s, or its lease's end): this asks whether the first one is answered."""
        live = [c for c in self.clients if c.ip is not None and (macs is None or c.mac in macs)]
        for c in live:   # a transaction of its own: an answer to an earlier request still queued is not its answer
            del self._by_xid[c.xid]
            c.xid = next(self._xids) & 0xFFFFFFFF
            self._by_xid[c.xid] = c
        t0 = time.monotonic()
        for c in live:
            c.sent_at = t0
            self._send(c, MessageType.REQUEST, ciaddr=c.ip, unicast_to=c.server)
        got: dict[bytes, float | None] = {c.mac: None for c in live}
        end = t0 + timeout
        while None in got.values() and time.monotonic() < end:
            for at, c, msg in self._replies(min(0.05, end - time.monotonic())):
                if msg.msg_type is MessageType.ACK and got.get(c.mac, 0.0) is None:
                    got[c.mac] = at - t0
                    self._acked(c, at, msg, "renew", t0)
                elif msg.msg_type is MessageType.NAK:
                    c.naks.append((at, msg.server_id, msg.message))
        for c in live:
            c.sent_at = 0.0  # not retransmitted by a later renew() either
        return got

    # -- results --------------------------------------------------------------------------------
    def first_ack_after(self, t: float) -> dict[bytes, float | None]:
        """Per client: seconds from ``t`` to its first ACK of a request (last) sent after ``t`` (None: never);
        an answer already on its way at ``t`` does not count."""
        out = {}
        for c in self.clients:
            later = [at for sent, at, *_ in c.acks if sent >= t]
            out[c.mac] = (min(later) - t) if later else None
        return out

    def longest_wait(self) -> float:
        """The longest time (s) any client waited from a request's first send to its ACK."""
        return max((a[1] - a[5] for c in self.clients for a in c.acks), default=0.0)

    def waiting(self, now: float | None = None) -> dict[bytes, float]:
        """Leased clients whose last request is still unanswered and for how long (s)."""
        now = time.monotonic() if now is None else now
        return {c.mac: now - c.sent_at for c in self.clients if c.sent_at and c.ip is not None}

    def addresses(self) -> dict[bytes, set]:
        """Per client: every address it was ever ACKed."""
        return {c.mac: {a[2] for a in c.acks} for c in self.clients}


__all__ = ["SimClients", "Client", "register"]


def renew_acked(sims: list["SimClients"], timeout: float = 5.0) -> tuple[dict, list[str], dict]:
    """Every client of ``sims`` that ever had an ACK renews once (after a crash and restart, say): (MAC ->
    address of its last ACK before, MACs (hex) that got no answer, MAC (hex) -> (before, now) of those given
    another address)."""
    ever = {c.mac: c.acks[-1][2] for s in sims for c in s.clients if c.acks}
    got: dict = {}
    for s in sims:
        got.update(s.renew_once(timeout=timeout, macs=[m for m in ever if m in {c.mac for c in s.clients}]))
    lost = [m.hex() for m, t in got.items() if t is None]
    moved = {c.mac.hex(): (str(ever[c.mac]), str(c.acks[-1][2])) for s in sims for c in s.clients
             if c.mac in ever and c.acks[-1][2] != ever[c.mac]}
    return ever, lost, moved


def holders(sims: list["SimClients"]) -> tuple[list[str], dict]:
    """(MACs (hex) of clients holding no address, address -> MACs of every address two clients hold)."""
    held: dict = {}
    for s in sims:
        for c in s.clients:
            held.setdefault(c.ip, []).append(c.mac.hex())
    none = held.pop(None, [])
    return none, {str(ip): h for ip, h in held.items() if len(h) > 1}
