"""One switch's OpenFlow channel: xids, replies, atomic bundles, table dumps, counter reads.

The app routes the replies it receives (commit replies, errors, multipart
replies) to ``OFConn.on_reply``; everything else here sends bytes built by
``ofmsg`` straight onto the datapath's socket queue, many messages per write.
A bundle takes one block of xids (open, one per message, commit), so an error
for any of its messages fails it without per-message bookkeeping.

Flow-stats replies are the one thing os-ken would otherwise parse into
objects (~50 µs per flow): ``install_raw_flow_stats`` makes os-ken hand their
body over as bytes, which ``ofmsg`` parses ~20× faster (a counter poll reads
only the fixed header of each entry).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Iterable

from os_ken.lib import hub
from os_ken.ofproto import ofproto_v1_4 as ofp

from vfab.controller import ofmsg
from vfab.controller.reconcile import Plan
from vfab.fabric.flows import gc_paused

log = logging.getLogger("vfab.controller")

CHUNK = 256 * 1024           # bytes per socket write
BUNDLE_FLAGS = ofp.OFPBF_ATOMIC | ofp.OFPBF_ORDERED


class OpError(Exception):
    """A switch refused, failed or did not answer an operation."""


class RawFlowStats:
    """A flow-stats reply body left as bytes: ``buf[offset:offset + length]`` holds ofp_flow_stats entries."""

    __slots__ = ("buf", "offset", "length")

    def __init__(self, buf, offset: int, length: int):
        self.buf, self.offset, self.length = buf, offset, length

    @classmethod
    def parser(cls, buf, offset: int) -> "RawFlowStats":
        return cls(buf, offset, len(buf) - offset)


def install_raw_flow_stats() -> None:
    """Make os-ken keep OpenFlow 1.4 flow-stats reply bodies as ``RawFlowStats`` (idempotent).

    The reply class keeps os-ken's name, so ``EventOFPFlowStatsReply`` still fires.
    """
    from os_ken.ofproto import ofproto_v1_4_parser as parser

    registry = parser.OFPMultipartReply._STATS_MSG_TYPES
    if getattr(registry.get(ofp.OFPMP_FLOW), "raw_body", False):
        return

    class OFPFlowStatsReply(parser.OFPFlowStatsReply):
        raw_body = True
        cls_stats_body_cls = RawFlowStats

    registry[ofp.OFPMP_FLOW] = OFPFlowStatsReply


class _Pending:
    """An operation waiting for replies whose xids lie in [lo, hi].

    A plain ``threading.Event``: os-ken's ``hub.Event.wait(timeout)`` never times
    out with its default native-thread hub, so a lost reply would hang forever.
    """

    __slots__ = ("lo", "hi", "what", "done", "body", "error")

    def __init__(self, lo: int, hi: int, what: str):
        self.lo, self.hi, self.what = lo, hi, what
        self.done = threading.Event()
        self.body: list = []
        self.error: str | None = None


class OFConn:
    """Used from several threads (reconcile, counter polls, os-ken's receive loop): one lock guards xids
    and the pending operations."""

    def __init__(self, dp, timeout: float = 30.0):
        self.dp = dp
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._recent: collections.deque = collections.deque(maxlen=16)   # (lo, hi) of finished operations
        self._bundle_ids = itertools.count(1)
        self.closed: str | None = None

    @property
    def dpid(self) -> int:
        return self.dp.id

    # -- xids and replies ------------------------------------------------------------------
    def _start(self, n: int, what: str, each: bool = False) -> list[_Pending]:
        """Take ``n`` consecutive xids from the datapath's counter (never wrapping inside a block) and register
        one operation over all of them, or (``each``) one per xid."""
        with self._lock:
            if self.closed:
                raise OpError(self.closed)
            first = (self.dp.xid + 1) & ofmsg.MAX_XID
            if first == 0 or first + n > ofmsg.MAX_XID:
                first = 1
            self.dp.xid = first + n - 1
            ops = [_Pending(first + i, first + i, what) for i in range(n)] if each else \
                [_Pending(first, first + n - 1, what)]
            self._pending.extend(ops)
            return ops

    def _finish(self, p: _Pending) -> None:
        with self._lock:
            if p in self._pending:
                self._pending.remove(p)
            self._recent.append((p.lo, p.hi))

    def on_reply(self, xid: int, body: Iterable = (), more: bool = False, error: str | None = None) -> bool:
        """A reply (or error) for ``xid``; False if no operation expects it."""
        with self._lock:
            for p in self._pending:
                if p.lo <= xid <= p.hi:
                    if body:
                        p.body.extend(body)
                    if error is not None and p.error is None:
                        p.error = error
                    if not more or error is not None:
                        p.done.set()
                    return True
            return any(lo <= xid <= hi for lo, hi in self._recent)  # e.g. the commit error after a failed add

    def close(self, reason: str) -> None:
        """The connection is gone: every waiting operation fails now, later ones at once."""
        with self._lock:
            self.closed = reason
            for p in self._pending:
                if p.error is None:
                    p.error = reason
                p.done.set()

    def _wait(self, p: _Pending) -> list:
        try:
            if not p.done.wait(timeout=self.timeout):
                raise OpError(f"no reply to {p.what} in {self.timeout:.0f} s")
            if p.error is not None:
                raise OpError(f"{p.what}: {p.error}")
            return p.body
        finally:
            self._finish(p)

    def _send(self, data: bytes) -> None:
        if not self.dp.send(data):
            raise OpError("the connection is closing")

    # -- bundles ---------------------------------------------------------------------------
    def commit(self, plan: Plan) -> int:
        """Apply ``plan`` as one atomic, ordered bundle; returns the number of messages in it.

        Order inside the bundle: new groups, changed groups, deletes (by cookie,
        then strict), adds (an ADD replaces a flow of the same match), dropped groups.
        """
        return self.wait_bundle(self.send_bundle(plan))

    def wait_bundle(self, sent: tuple[_Pending, int]) -> int:
        """Wait for the switch's answer to a bundle :meth:`send_bundle` sent; the number of messages in it."""
        pending, n = sent
        self._wait(pending)
        return n

    def send_bundle(self, plan: Plan) -> tuple[_Pending, int]:
        """Send ``plan`` as one bundle, ending in its commit request, without waiting for the switch's answer
        (:meth:`wait_bundle`): bundles to several switches are then in flight at once (the app does that
        between two pauses, where the order in which switches turn does not matter)."""
        try:
            inner: list[bytes] = [ofmsg.group_mod(g, "add") for g in plan.add_groups]
            inner += [ofmsg.group_mod(g, "modify") for g in plan.mod_groups]
            inner += [ofmsg.flow_delete_cookie(c, m) for c, m in plan.del_cookies]
            inner += [ofmsg.flow_delete_strict(f) for f in plan.del_flows]
            tail = [ofmsg.group_mod(None, "delete", group_id=gid) for gid in plan.del_groups]
        except (ValueError, KeyError) as exc:
            raise OpError(f"plan cannot be encoded: {exc}") from None
        n = len(inner) + len(plan.add_flows) + len(tail)
        bid = next(self._bundle_ids) & ofmsg.MAX_XID
        (pending,) = self._start(n + 2, f"bundle {bid} ({n} messages)")
        first = pending.lo
        try:
            with gc_paused():
                xid = first
                out = [ofmsg.bundle_ctrl(bid, ofp.OFPBCT_OPEN_REQUEST, BUNDLE_FLAGS, xid)]
                size = 0
                for msg in inner:
                    xid += 1
                    out.append(ofmsg.bundle_add(bid, BUNDLE_FLAGS, msg, xid))
                for msg in ofmsg.bundled_adds(bid, BUNDLE_FLAGS, plan.add_flows, xid + 1):
                    out.append(msg)
                    size += len(msg)
                    if size >= CHUNK:  # let the socket take it while the next chunk is encoded
                        self._send(b"".join(out))
                        out, size = [], 0
                        hub.sleep(0)
                xid += len(plan.add_flows)
                for msg in tail:
                    xid += 1
                    out.append(ofmsg.bundle_add(bid, BUNDLE_FLAGS, msg, xid))
                out.append(ofmsg.bundle_ctrl(bid, ofp.OFPBCT_COMMIT_REQUEST, BUNDLE_FLAGS, xid + 1))
                self._send(b"".join(out))
        except (ValueError, OpError) as exc:
            self._finish(pending)
            self.dp.send(ofmsg.bundle_ctrl(bid, ofp.OFPBCT_DISCARD_REQUEST, BUNDLE_FLAGS, first))
            raise OpError(f"bundle {bid} not sent: {exc}") from None
        return pending, n

    # -- reading the switch ------------------------------------------------------------------
    def _requests(self, build: list, what: str) -> list[list]:
        """Send several requests (each a function of its xid) at once; their reply bodies, in order."""
        pending = self._start(len(build), what, each=True)
        first = pending[0].lo
        try:
            self._send(b"".join(b(first + i) for i, b in enumerate(build)))
        except OpError:
            for p in pending:
                self._finish(p)
            raise
        return [self._wait(p) for p in pending]

    def dump(self) -> tuple[dict, dict]:
        """(flow key -> FlowSpec, group id -> GroupSpec) the switch holds now."""
        t0 = time.monotonic()
        stats, descs = self._requests([ofmsg.flow_stats_request, ofmsg.group_desc_request], "table dump")
        flows = {}
        with gc_paused():
            try:
                for part in stats:
                    if isinstance(part, RawFlowStats):
                        for f, _, _ in ofmsg.parse_flow_stats(part.buf, part.offset, part.offset + part.length):
                            flows[f.key] = f
                    else:  # os-ken parsed it (install_raw_flow_stats not called)
                        f = ofmsg.flow_from_stats(part)
                        flows[f.key] = f
            except ofmsg.WireError as exc:
                raise OpError(f"unreadable flow table dump: {exc}") from None
        groups = {g.group_id: g for g in (ofmsg.group_from_desc(d) for d in descs)}
        log.debug("switch %016x: dumped %d flows, %d groups in %.1f ms", self.dpid, len(flows), len(groups),
                  (time.monotonic() - t0) * 1e3)
        return flows, groups

    def counter_stats(self, selectors: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """(table, cookie, packets, bytes) of the flows in each (table, cookie, cookie mask) selector."""
        build = [(lambda xid, t=t, c=c, m=m: ofmsg.flow_stats_request(xid, t, c, m)) for t, c, m in selectors]
        rows: list[tuple[int, int, int, int]] = []
        for body in self._requests(build, "counter poll"):
            for part in body:
                if isinstance(part, RawFlowStats):
                    try:
                        rows.extend(ofmsg.parse_flow_counters(part.buf, part.offset, part.offset + part.length))
                    except ofmsg.WireError as exc:
                        raise OpError(f"unreadable counter reply: {exc}") from None
                else:
                    rows.append((part.table_id, part.cookie, part.packet_count, part.byte_count))
        return rows
