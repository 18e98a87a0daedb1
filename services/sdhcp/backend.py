"""sdhcp as a backend of the stateful-endpoint loop (``vfab.vid.state``): RFC 2131 server behaviour.

The loop hands it batches of DHCP requests (wrapped by ``frames.py``) whose key
(chaddr's, by the service's key function: ``Store.key``, ``vfab.vid.mackey``) lies in a range this shard owns; a batch is one
SQLite transaction, fsync'd before any reply leaves, and every lease or
address row it writes is returned as a record so the loop puts it on every
mirror (and on a running copy) before the reply leaves either.

Requests (RFC 2131 §4.3):

* DISCOVER -> OFFER: the client's current or last address if it may keep it,
  else its requested address (option 50) if available, else the first free
  candidate of ``pool.probe``; the offer is recorded (state offered, held
  ``OFFER_HOLD``) so the address is not offered to anyone else meanwhile.
* REQUEST, told apart by §4.3.2: SELECTING (server id set: ours -> ACK or NAK;
  another server's -> silence), INIT-REBOOT (requested address, no ciaddr),
  RENEWING (unicast, ciaddr) and REBINDING (broadcast, ciaddr).  The client
  must hold that address here (else NAK), or, INIT-REBOOT/RENEWING/REBINDING
  of a client we have no record of: silence.  The ACK extends the lease.
* RELEASE ends the lease (the address stays associated with the client, so it
  gets it back while nobody else needed it); DECLINE marks the address
  declined for ``DECLINE_HOLD``; INFORM is answered with the options only.

Who may hand out what (``blocks.py``): an address only by the shard owning its
row key (its home key, ``pool.py``, unless the service's block table anchors it
elsewhere), with the ``addr`` row written in the same transaction as the
client's ``lease`` row; a DISCOVER that finds none is reported (``on_exhausted``)
and parked by the server while its block agent borrows.  An address whose row key another shard owns (a split
put the client's key and the address's home on two shards) stays the client's:
the home shard keeps it reserved as long as it does not own the client's key
(it cannot tell whether the lease is alive), so the client renews and re-binds
it at its own shard; the home shard frees it once it owns both again (a merge)
and the lease is over.  So no address is ever held by two clients.

Bad input is dropped and counted in ``counters`` (``key_of`` refuses it before
the loop classifies it): unparsable (``malformed``), op 2 (``wrong_op``), not
Ethernet (``bad_chaddr``), server message types (``wrong_type``), chaddr not
the frame's Ethernet source (``spoofed``: a port may speak for its own MAC
only, so no one can exhaust the pool or release another client's lease),
relayed (giaddr set) from a relay not in ``--opt relays`` (``relayed_dropped``).
A relayed request from a listed relay is served: its chaddr cannot be checked
against the frame (the Ethernet source is the relay's), so trusting the relay
is the operator's decision; the reply goes to giaddr:67 at the relay's MAC.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address
from typing import Callable

from vfab.services.sdhcp import frames, ipudp, wire
from vfab.services.sdhcp.blocks import Blocks
from vfab.services.sdhcp.config import Config
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.pool import Pool
from vfab.services.sdhcp.reply import Options, destination, prepare, reply, reply_limit
from vfab.services.sdhcp.store import BOUND, DECLINED, FREE, HELD, NONE, OFFERED, RELEASED, Addr, Lease, Store
from vfab.services.sdhcp.wire import BOOTREQUEST, HTYPE_ETHERNET, ZERO, Message, MessageType, Opt
from vfab.vid.ranges import FULL, Range
from vfab.vid.state.backend import BadRequest, Refusal, Request, StoreBackend

log = logging.getLogger("vfab.sdhcp.backend")

OFFER_HOLD = 60_000       # ms an offered address stays reserved for the client
DECLINE_HOLD = 600_000    # ms a declined address is not handed out
FULL_MS = 1000            # ms a slice found full is trusted to stay full without a write that frees (_allocate)
FULL_LOG_MS = 10_000      # ms between two "slice full" warnings while it stays full
PARSED_MAX = 1024         # parsed requests kept between key_of and handle_batch
SERVED = {MessageType.DISCOVER, MessageType.REQUEST, MessageType.DECLINE, MessageType.RELEASE,
          MessageType.INFORM}
NO_SYNC = {MessageType.DISCOVER, MessageType.INFORM}   # batches of only these commit without an fsync


def open_backend(datadir: str, name: str, config: Config | None = None, key_fn: str | None = None) -> "SdhcpBackend":
    """The backend of shard ``name``, its leases at DATADIR/NAME.sqlite (``config``, ``key_fn`` None: the stored
    ones; ``Store``)."""
    return SdhcpBackend(Store(os.path.join(datadir, f"{name}.sqlite"), config, key_fn))


@dataclass
class _Batch:
    ranges: list          # where this shard may hand out addresses now (owned, not pausing)
    now: int              # ms since the epoch
    blocks: Blocks        # the block table the batch decides by (one per batch)
    bindings: list = field(default_factory=list)   # (chaddr, address or None: ended, until ms), in order
    exhausted: list = field(default_factory=list)  # payloads of DISCOVERs that found no address
    _slots: tuple | None = None

    def owns(self, key: int) -> bool:
        return any(key in r for r in self.ranges)

    def may(self, ip: int) -> bool:
        """Whether this shard may hand out ``ip`` now (its row key is in an allocatable range)."""
        return self.owns(self.blocks.rowkey(ip))

    def slots(self) -> tuple:
        """The owned index intervals (``Blocks.owned``), worked out once per batch (not per DISCOVER)."""
        if self._slots is None:
            self._slots = self.blocks.owned(self.ranges)
        return self._slots


class SdhcpBackend(StoreBackend):
    # A mirror taking over from a dead shard answers again what the shard got just before it died: a DHCP
    # request served twice gets the same answer (the lease is the mirror's copy), and ISC dhclient with its
    # default 10 s initial interval would otherwise not retransmit a lost renewal before a short lease ends.
    replay_on_takeover = True
    # Group commit (the state loop): under the loop, a batch's commit does not wait for the disk; the loop
    # keeps its ACKs, commits the next batches the port holds, and one fsync once the port is drained covers them.
    group_commit = True
    # An OFFER (a batch of DISCOVERs and INFORMs needs no disk) leaves at once, not behind earlier batches'
    # fsync: it promises nothing a crash could take back (the ACK to the client's REQUEST does, and waits).
    ordered_replies = False
    defer_sync = False        # set by the loop; alone (tests, tools) every durable commit fsyncs itself
    batch_unsynced = False    # the last batch committed durable-needing writes without an fsync

    def __init__(self, store: Store):
        self.store = store
        self.config: Config = store.config
        self.pool: Pool = store.pool
        self.server = self.config.server
        self._server_packed = self.server.packed
        self.counters: collections.Counter = collections.Counter()
        # Set by the server (server.py) to the loop's view: the ranges where addresses may be handed out now,
        # and the VID a reply leaves from.  Alone (tests), the shard owns everything.
        self.allocatable: Callable[[], list[Range]] = lambda: [FULL]
        self.vid_mac: Callable[[int], bytes] = lambda key: bytes([0x0E]) + key.to_bytes(5, "big")
        self.clock: Callable[[], float] = time.time
        # Set by the server to its Binder's ``offer``: after each committed batch, the leases it acknowledged to
        # clients on the fabric's ports (not relayed) and the ones they released or declined.
        self.on_bindings: Callable[[list], None] = lambda events: None
        # Set by the server: after a batch, the payloads of DISCOVERs that found no address (it parks them
        # while its block agent asks other shards for addresses: agent.py)
        self.on_exhausted: Callable[[list], None] = lambda payloads: None
        # encoded and checked once, not per reply: for OFFERs and ACKs to REQUESTs, and for ACKs to INFORMs
        self._options: Options = prepare(self._make_options())
        self._inform_options: Options = prepare({k: v for k, v in self._options.encoded.items()
                                                 if k not in (Opt.LEASE_TIME, Opt.RENEWAL_TIME, Opt.REBINDING_TIME)})
        self._network = self.config.network       # a property that builds an IPv4Network per call
        self._parsed: dict[bytes, tuple[bytes, bool, Message]] = {}   # key_of's parse, for handle_batch
        self._full: tuple[tuple, int, int] | None = None   # (slots, store.freed, ms): found full then (_allocate)
        self._last_full_log = 0

    def _make_options(self) -> dict:
        c = self.config
        opts: dict = {Opt.LEASE_TIME: c.lease, Opt.RENEWAL_TIME: c.t1, Opt.REBINDING_TIME: c.t2,
                      Opt.SUBNET_MASK: c.mask}
        if c.routers:
            opts[Opt.ROUTER] = list(c.routers)
        if c.dns:
            opts[Opt.DNS] = list(c.dns)
        return {code: wire.encode_option(code, v) for code, v in opts.items()}

    # -- the data path --------------------------------------------------------------------------
    def _read(self, payload: bytes) -> tuple[bytes, bool, Message]:
        got = self._parsed.pop(payload, None)
        if got is not None:
            return got
        src, bcast, dhcp = frames.unwrap(payload)
        return src, bcast, wire.parse(dhcp)

    def key_of(self, payload: bytes) -> int:
        """The key of a request (chaddr's, as the front door computes it); BadRequest (counted) for anything not served.

        The parsed request is kept for ``handle_batch`` (the loop asks the key of every request of a batch
        first, then serves them): parsing each twice cost ~7% of a busy shard (bench/sdhcp_lease.py, cProfile)."""
        try:
            src, bcast, msg = self._read(payload)
        except DhcpError as exc:
            self.counters["malformed"] += 1
            raise BadRequest(str(exc)) from None
        why = self._refuse(msg, src)
        if why:
            self.counters[why[0]] += 1
            raise BadRequest(why[1])
        if len(self._parsed) >= PARSED_MAX:  # requests held or forwarded are not served here: forget them
            self._parsed.clear()
        self._parsed[payload] = (src, bcast, msg)
        return self.store.key(msg.chaddr)

    def _refuse(self, msg: Message, src: bytes) -> tuple[str, str] | None:
        if msg.op != BOOTREQUEST:
            return "wrong_op", f"op {msg.op} (BOOTREPLY) sent to a server"
        if msg.htype != HTYPE_ETHERNET or len(msg.chaddr) != 6:
            return "bad_chaddr", f"hardware type {msg.htype}, {len(msg.chaddr)} B chaddr: only Ethernet is served"
        if msg.msg_type not in SERVED:
            return "wrong_type", f"{msg.msg_type.name} is a server's message"
        if msg.giaddr != ZERO:
            if msg.giaddr not in self.config.relays:
                return "relayed_dropped", f"relayed by {msg.giaddr}, not a trusted relay (--opt relays)"
        elif msg.chaddr != src:
            return "spoofed", f"chaddr {msg.chaddr.hex()} is not the frame's source {src.hex()}"
        return None

    def error_reply(self, payload: bytes, refusal: Refusal, message: str) -> None:
        """DHCP has no error reply: a refused request gets silence and the client retransmits."""
        return None

    def handle_batch(self, requests: list[Request]) -> tuple[list[bytes | None], list[tuple[int, bytes]]]:
        ctx = _Batch(list(self.allocatable()), int(self.clock() * 1000), self.store.blocks)
        replies: list[bytes | None] = []
        records: list[tuple[int, bytes]] = []
        parsed = []
        for r in requests:
            try:
                parsed.append(self._read(r.payload))
            except DhcpError:
                self.counters["malformed"] += 1
                parsed.append(None)
        # Only a batch that may acknowledge, refuse or end a lease (REQUEST, RELEASE, DECLINE) waits for the
        # disk: an OFFER promises nothing (RFC 2131 §4.3.1: the client must still REQUEST it), so a batch of
        # DISCOVERs and INFORMs commits without an fsync (Store.begin).  Its records still reach every mirror
        # before its replies leave (the loop sees to that), and the next durable batch's fsync covers it.
        durable = any(p is not None and p[2].msg_type not in NO_SYNC for p in parsed)
        self.batch_unsynced = False
        self.store.begin(durable and not self.defer_sync)
        try:
            for r, p in zip(requests, parsed):
                replies.append(None if p is None else self._one(r, p, ctx, records))
            self.store.commit()
        except BaseException:
            self.store.rollback()
            raise
        if ctx.bindings:
            self.on_bindings(ctx.bindings)
        if ctx.exhausted:
            self.on_exhausted(ctx.exhausted)
        self.counters["batches_synced" if durable else "batches_unsynced"] += 1
        self.batch_unsynced = durable and self.defer_sync
        return replies, records

    def _one(self, r: Request, parsed: tuple[bytes, bool, Message], ctx: _Batch, records: list) -> bytes | None:
        src, bcast, msg = parsed
        if self._refuse(msg, src):
            return None  # counted by key_of
        c = int.from_bytes(msg.chaddr, "big")
        lease = self.store.lease(c)
        t = msg.msg_type
        if t is MessageType.DISCOVER:
            out = self._discover(msg, c, r, lease, ctx, records)
        elif t is MessageType.REQUEST:
            out = self._request(msg, c, r.key, lease, ctx, records, bcast)
        elif t is MessageType.RELEASE:
            out = self._release(msg, lease, ctx, records)
        elif t is MessageType.DECLINE:
            out = self._decline(msg, c, lease, ctx, records)
        else:
            out = self._inform(msg)
        if out is None:
            return None
        try:
            dest = destination(msg, out, relay_mac=src if msg.giaddr != ZERO else None)
            if dest.mac is None:   # not with an Ethernet chaddr (_refuse) and the relay's own MAC
                raise DhcpError(f"no MAC to send the reply to {dest.ip} to")
            # every part is checked already (the MACs, the addresses, ports, a message within the client's
            # limit): the frame is built without a Datagram's checks of each field, reply after reply
            return ipudp.udp_frame(dest.mac, self.vid_mac(r.key), self._server_packed, dest.ip.packed, 67, dest.port,
                                   out.serialize(max_size=reply_limit(msg)))
        except DhcpError as exc:  # e.g. the client's size limit is below our options
            self.counters["reply_failed"] += 1
            log.warning("reply to %s not sent: %s", msg.chaddr.hex(), exc)
            return None

    # -- addresses ------------------------------------------------------------------------------------
    def _available(self, c: int, lease: Lease | None, ip: int, ctx: _Batch) -> tuple[bool, Addr | None, Lease | None]:
        """May client ``c`` have ``ip`` now?  (yes/no, the address row, a stale holder's lease to clear)."""
        if ip not in self.pool:
            return False, None, None
        if not ctx.may(ip):
            # Another shard (or nobody now) may hand it out; it stays ours only if this client holds it.
            return lease is not None and lease.ip == ip, None, None
        a = self.store.addr(ip)
        if a is None or a.state == FREE:
            return True, a, None
        if a.state == DECLINED:
            return a.until <= ctx.now, a, None
        if a.holder == c:
            return True, a, None
        if not ctx.owns(self.store.key(a.holder)):
            return False, a, None  # its holder is served elsewhere: kept for it
        other = self.store.lease(a.holder)
        if other is not None and other.ip == ip and other.active(ctx.now):
            return False, a, None
        return True, a, (other if other is not None and other.ip == ip else None)

    def _allocate(self, c: int, key: int, ctx: _Batch) -> tuple[int | None, Addr | None, Lease | None]:
        """The first candidate of ``pool.probe`` that is free; failing that, the first whose lease ended.

        The store finds the first free address of each segment by itself (``Store.first_free``), and the
        reclaimable ones with one query each (``Store.reclaimable``).  A search that found nothing marks this
        shard's slice **full** (``_full``): further DISCOVERs get silence at once, without searching, until an
        address may have been freed (``Store.freed`` moved: a release, a decline, a lease ended, records
        applied or dropped, a batch rolled back), the shard's ranges change, or ``FULL_MS`` passed (a lease
        that merely expired meanwhile is found then).  Without it, each DISCOVER of a flood on a full pool of
        4,000 addresses walked the whole slice: ~20 ms each, every renewal queued behind them."""
        slots = ctx.slots()
        full = self._full
        if full is not None and full[0] == slots and full[1] == self.store.freed and 0 <= ctx.now - full[2] < FULL_MS:
            return None, None, None
        for a, b in ctx.blocks.segments(key, ctx.ranges):
            ip = self.store.first_free(self.pool.first + a, self.pool.first + b, c, ctx.now)
            if ip is not None:
                return ip, self.store.addr(ip), None
        for a, b in ctx.blocks.segments(key, ctx.ranges):
            for row, other in self.store.reclaimable(self.pool.first + a, self.pool.first + b, ctx.now):
                if ctx.owns(self.store.key(row.holder)):
                    return row.ip, row, other
        if self._full is None or self._full[0] != slots or ctx.now - self._last_full_log >= FULL_LOG_MS:
            self._last_full_log = ctx.now
            log.warning("slice full: every one of the %d addresses this shard may hand out is taken; new clients get "
                        "no OFFER (counter pool_exhausted, %d so far) until a lease ends or is released, or the pool "
                        "grows or another shard lends some (blocks)", sum(b - a + 1 for a, b, _ in slots),
                    self.counters["pool_exhausted"] + 1)
        self._full = (slots, self.store.freed, ctx.now)
        return None, None, None

    def _grant(self, c: int, key: int, lease: Lease | None, ip: int, state: int, expires: int, msg: Message,
               ctx: _Batch, records: list, a: Addr | None, stale: Lease | None) -> None:
        """Give ``ip`` to client ``c`` (one transaction with the batch): its lease row, the address row when
        its home is ours, the old address freed, a stale holder's claim cleared."""
        st = self.store
        if lease is not None and lease.ip and lease.ip != ip and ctx.may(lease.ip):
            old = st.addr(lease.ip)
            if old is not None and old.holder == c and old.state == HELD:
                _, rec = st.put_addr(replace(old, holder=0, state=FREE, until=0))
                records.append((ctx.blocks.rowkey(old.ip), rec))
        home = ctx.blocks.rowkey(ip)
        if ctx.owns(home):
            if a is None:
                a = st.addr(ip)
            if a is None or a.holder != c or a.state != HELD:
                _, rec = st.put_addr(Addr(ip, c, HELD, 0, a.version if a is not None else 0))
                records.append((home, rec))
        if stale is not None and stale.chaddr != c:
            _, rec = st.put_lease(replace(stale, ip=0, state=NONE, expires=ctx.now))
            records.append((self.store.key(stale.chaddr), rec))
            self.counters["reclaimed"] += 1
        _, rec = st.put_lease(Lease(c, ip, state, expires, msg.client_id or b"",
                                    lease.version if lease is not None else 0))
        records.append((key, rec))

    # -- messages --------------------------------------------------------------------------------------
    def _discover(self, msg: Message, c: int, r: Request, lease: Lease | None, ctx: _Batch,
                  records: list) -> Message | None:
        key = r.key
        ip = None
        a = stale = None
        tries = [lease.ip] if lease is not None and lease.ip else []
        if msg.requested_ip is not None:
            tries.append(int(msg.requested_ip))
        for want in tries:
            ok, a, stale = self._available(c, lease, want, ctx)
            if ok:
                ip = want
                break
        if ip is None:
            ip, a, stale = self._allocate(c, key, ctx)
        if ip is None:
            self.counters["pool_exhausted"] += 1
            ctx.exhausted.append(r.payload)
            return None
        if lease is not None and lease.ip == ip and lease.state == BOUND and lease.expires > ctx.now:
            state, expires = BOUND, lease.expires  # a bound client starting over keeps its lease meanwhile
        else:
            state, expires = OFFERED, ctx.now + OFFER_HOLD
        self._grant(c, key, lease, ip, state, expires, msg, ctx, records, a, stale)
        self.counters["offers"] += 1
        return reply(msg, MessageType.OFFER, self.server, IPv4Address(ip), options=self._options)

    def _nak(self, msg: Message, why: str) -> Message:
        self.counters["naks"] += 1
        return reply(msg, MessageType.NAK, self.server, options={Opt.MESSAGE: why})

    def _request(self, msg: Message, c: int, key: int, lease: Lease | None, ctx: _Batch, records: list,
                 bcast: bool) -> Message | None:
        sid, req, ci = msg.server_id, msg.requested_ip, msg.ciaddr
        net = self._network
        if sid is not None:                                   # SELECTING
            if sid != self.server:
                self.counters["other_server"] += 1            # it took another server's offer
                return None
            if req is None:
                self.counters["bad_request"] += 1
                return None
            kind, target = "selecting", req
        elif ci == ZERO:                                      # INIT-REBOOT
            if req is None:
                self.counters["bad_request"] += 1
                return None
            kind, target = "init_reboot", req
        else:                                                 # RENEWING (unicast) / REBINDING (broadcast)
            kind, target = ("rebinding" if bcast else "renewing"), ci
        if target not in net:
            return self._nak(msg, f"{target} is not on network {net}")
        if kind != "selecting":
            if lease is None or not lease.ip:
                self.counters["unknown_client"] += 1          # §4.3.2: no record of this client: silence
                return None
            if lease.ip != int(target):
                return self._nak(msg, f"{target} is not this client's address")
        ok, a, stale = self._available(c, lease, int(target), ctx)
        if not ok:
            return self._nak(msg, f"{target} is not available")
        expires = ctx.now + self.config.lease * 1000
        self._grant(c, key, lease, int(target), BOUND, expires, msg, ctx, records, a, stale)
        if msg.giaddr == ZERO:
            ctx.bindings.append((c, int(target), expires))
        self.counters[kind] += 1
        self.counters["acks"] += 1
        return reply(msg, MessageType.ACK, self.server, target, options=self._options)

    def _release(self, msg: Message, lease: Lease | None, ctx: _Batch, records: list) -> None:
        if msg.server_id is not None and msg.server_id != self.server:
            self.counters["other_server"] += 1
        elif lease is not None and lease.ip and lease.ip == int(msg.ciaddr) and lease.state != RELEASED:
            _, rec = self.store.put_lease(replace(lease, state=RELEASED, expires=ctx.now))
            records.append((self.store.key(lease.chaddr), rec))
            ctx.bindings.append((lease.chaddr, None, ctx.now))
            self.counters["releases"] += 1
        else:
            self.counters["release_unknown"] += 1
        return None

    def _decline(self, msg: Message, c: int, lease: Lease | None, ctx: _Batch, records: list) -> None:
        ip = msg.requested_ip
        if ip is None or int(ip) not in self.pool:
            self.counters["bad_request"] += 1
            return None
        ip = int(ip)
        if lease is not None and lease.ip == ip:
            _, rec = self.store.put_lease(replace(lease, ip=0, state=NONE, expires=ctx.now))
            records.append((self.store.key(lease.chaddr), rec))
            ctx.bindings.append((c, None, ctx.now))
        home = ctx.blocks.rowkey(ip)
        a = self.store.addr(ip) if ctx.owns(home) else None
        if a is not None and a.holder == c:  # only the holder can say its address is taken
            _, rec = self.store.put_addr(replace(a, holder=0, state=DECLINED, until=ctx.now + DECLINE_HOLD))
            records.append((home, rec))
        self.counters["declines"] += 1
        return None

    def _inform(self, msg: Message) -> Message | None:
        if msg.ciaddr == ZERO or msg.ciaddr not in self._network:
            self.counters["inform_ignored"] += 1
            return None
        self.counters["informs"] += 1
        return reply(msg, MessageType.ACK, self.server, options=self._inform_options)

    def median_key(self, rng: Range, n: int) -> int:
        """(load reports) The key below which half of the ``n`` clients known in ``rng`` lie."""
        return self.store.median_key(rng, n)

    # -- status -----------------------------------------------------------------------------------------
    def stats(self, ranges: list[Range]) -> dict:
        """Counters, and for ``ranges`` (what this shard owns): its slice of the pool and what is in use."""
        now = int(self.clock() * 1000)
        use = self.store.usage(ranges, now)
        blocks = self.store.blocks
        slice_size = blocks.size(ranges)
        nblocks, anchored = blocks.count_anchored(ranges)
        return {"counters": dict(self.counters), "pool": self.config.describe(), "slice": slice_size,
                "home": slice_size - anchored, "blocks": nblocks, "borrowed": anchored,
                "table_blocks": len(blocks.blocks), "table_revision": blocks.revision, **use}


__all__ = ["SdhcpBackend", "open_backend", "OFFER_HOLD", "DECLINE_HOLD", "FULL_MS"]
