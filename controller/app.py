"""The os-ken route controller: a thin shell over state → compile → diff → bundle.

It holds nothing etcd does not: a mirror of the ``/vfab/v1/`` prefix kept by a
watch, and per switch the flows last read from (or committed to) it.  On
(re)connect a switch is dumped and diffed, so killing and restarting the
controller reconciles; switches keep forwarding meanwhile (fail-mode secure).

Environment: VFAB_ETCD (HOST:PORT), VFAB_POLL (s between counter polls).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time

from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import DEAD_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub
from os_ken.ofproto import ofproto_v1_4

from vfab.controller import ofmsg
from vfab.controller.reconcile import diff, update_order
from vfab.fabric.compiler import compile_fabric, route_destinations
from vfab.fabric.flows import Kind, split_cookie
from vfab.fabric.state import FabricState
from vfab.fabric.topology import distances, next_hops
from vfab.vid.registry import schema
from vfab.vid.registry import DEFAULT_ENDPOINT, Registry

log = logging.getLogger("vfab.controller")


AUDIT_EVERY = 10  # counter polls between full-table audits


class OpError(Exception):
    pass


class _Waiter:
    def __init__(self) -> None:
        self.done = hub.Event()
        self.body: list = []
        self.error = None


class VfabController(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_4.OFP_VERSION]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.registry = Registry(os.environ.get("VFAB_ETCD", DEFAULT_ENDPOINT))
        self.poll = float(os.environ.get("VFAB_POLL", "2"))
        self.settle = float(os.environ.get("VFAB_SETTLE_MS", "5")) / 1e3
        self.items: dict[str, bytes] = {}
        self.revision = 0
        self.dps: dict = {}
        self.installed: dict[int, tuple[dict, dict]] = {}
        self.reported: dict[int, int] = {}
        self.locks: dict[int, threading.Lock] = {}
        self.waiters: dict[int, _Waiter] = {}
        self.dirty = hub.Event()
        self.bundle_ids = itertools.count(1)
        self.lease = None
        self.threads = [hub.spawn(self._watch_loop), hub.spawn(self._reconcile_loop),
                        hub.spawn(self._poll_loop)]

    # -- etcd -------------------------------------------------------------
    def _watch_loop(self) -> None:
        while True:
            try:
                rev, items = self.registry.get_prefix(schema.ROOT)
                self.items = {k: v for k, (v, _) in items.items()}
                self.revision = rev
                log.info("etcd %s: loaded %d keys at revision %d", self.registry.endpoint, len(items), rev)
                self.dirty.set()
                # Whole watch responses: a revision (one etcd txn) is applied to the mirror at
                # once, so the reconcile loop never compiles or reports half of a transaction.
                batches, cancel = self.registry.watch_batches(schema.ROOT, rev + 1)
                try:
                    for batch in batches:
                        changed = False
                        for ev in batch:
                            if ev.value is None:
                                self.items.pop(ev.key, None)
                            else:
                                self.items[ev.key] = ev.value
                            self.revision = max(self.revision, ev.revision)
                            parsed = schema.parse_key(ev.key)
                            if not (parsed and parsed[0] in schema.PASSIVE):
                                changed = True
                        if changed:
                            self.dirty.set()
                finally:
                    cancel()
                log.warning("etcd watch ended; reloading")
            except Exception as exc:  # etcd down or compacted: reload after a pause
                log.warning("etcd %s: %s; retrying in 1 s", self.registry.endpoint, exc)
                hub.sleep(1)

    # -- reconcile --------------------------------------------------------
    def _reconcile_loop(self) -> None:
        while True:
            self.dirty.wait()
            self.dirty.clear()
            rev = self.revision
            try:
                state = FabricState.from_items(dict(self.items))
                configs = compile_fabric(state)
            except Exception:
                log.exception("compile failed at revision %d; keeping the switches as they are", rev)
                continue
            plans = {}
            for dpid in list(self.dps):
                if dpid in configs and dpid in self.installed:
                    flows, groups = self.installed[dpid]
                    plans[dpid] = diff(configs[dpid], flows, groups)
            dests = route_destinations(state)
            links = [(lk.dpid, lk.port, lk.peer_dpid, lk.peer_port) for lk in state.links]
            dist = distances(sorted(state.switches), next_hops(sorted(state.switches), links), links)

            def dest_of(cookie: int):
                kind, sid, lo, _ = split_cookie(cookie)
                return dests.get((sid, lo)) if kind == Kind.VID_ROUTE else None

            done = []
            order = update_order(plans, dest_of, dist)
            for i, dpid in enumerate(order):
                if self._apply(dpid, configs[dpid], rev):
                    done.append(dpid)
                if i + 1 < len(order) and any(dest_of(f.cookie) is not None for f in plans[dpid].add_flows):
                    # A committed bundle is in the OpenFlow tables at once, but OVS's datapath
                    # keeps serving cached flows until its revalidators catch up (a few ms
                    # here); the next switch on the path must not turn before that.
                    hub.sleep(self.settle)
            # Reported only once every switch has its bundle: the reports must not delay a cut-over.
            for dpid in done:
                if self.reported.get(dpid, -1) < rev:
                    self._report(dpid, rev, len(configs[dpid].flows), len(configs[dpid].groups))

    def _apply(self, dpid: int, want, rev: int) -> bool:
        """Bring one switch to ``want`` in one bundle; True if it now holds it."""
        dp = self.dps.get(dpid)
        if dp is None:
            return False
        with self.locks[dpid]:
            if dpid not in self.installed:
                return False
            flows, groups = self.installed[dpid]
            plan = diff(want, flows, groups)  # again: a poll may have re-read the switch meanwhile
            try:
                if plan:
                    t0 = time.monotonic()
                    self._commit(dp, plan)
                    log.info("switch %016x: revision %d: %s in %.1f ms", dpid, rev,
                             plan.summary(), (time.monotonic() - t0) * 1e3)
                self.installed[dpid] = (dict(want.flows), dict(want.groups))
            except OpError as exc:
                log.error("switch %016x: bundle failed (%s); re-reading its tables", dpid, exc)
                self.installed.pop(dpid, None)
                hub.spawn(self._sync, dp)
                return False
        return True

    def _report(self, dpid: int, rev: int, nflows: int, ngroups: int) -> None:
        try:
            rec = schema.Applied(dpid=dpid, revision=rev, flows=nflows, groups=ngroups, at=time.time())
            self.registry.put(schema.applied_key(dpid), rec.to_json())
            self.reported[dpid] = rev
        except Exception as exc:
            log.warning("switch %016x: could not report applied revision: %s", dpid, exc)

    def _commit(self, dp, plan) -> None:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        msgs = [ofmsg.group_mod(dp, g, "add") for g in plan.add_groups]
        msgs += [ofmsg.group_mod(dp, g, "modify") for g in plan.mod_groups]
        msgs += [ofmsg.flow_delete(dp, f) for f in plan.del_flows]
        msgs += [ofmsg.flow_add(dp, f) for f in plan.add_flows]
        msgs += [ofmsg.group_mod(dp, None, "delete", gid) for gid in plan.del_groups]
        bid = next(self.bundle_ids) & 0xFFFFFFFF
        flags = ofp.OFPBF_ATOMIC | ofp.OFPBF_ORDERED
        waiter = _Waiter()
        xids = []
        dp.send_msg(parser.OFPBundleCtrlMsg(dp, bid, ofp.OFPBCT_OPEN_REQUEST, flags, []))
        for m in msgs:
            add = parser.OFPBundleAddMsg(dp, bid, flags, m, [])
            dp.set_xid(add)
            m.xid = add.xid
            xids.append(add.xid)
            self.waiters[add.xid] = waiter
            dp.send_msg(add)
        commit = parser.OFPBundleCtrlMsg(dp, bid, ofp.OFPBCT_COMMIT_REQUEST, flags, [])
        xids.append(dp.set_xid(commit))
        self.waiters[commit.xid] = waiter
        dp.send_msg(commit)
        try:
            if not waiter.done.wait(timeout=10):
                raise OpError(f"no commit reply for bundle {bid} in 10 s")
            if waiter.error is not None:
                raise OpError(waiter.error)
        finally:
            for x in xids:
                self.waiters.pop(x, None)

    def _request(self, dp, req, timeout: float = 10.0) -> list:
        waiter = _Waiter()
        self.waiters[dp.set_xid(req)] = waiter
        try:
            dp.send_msg(req)
            if not waiter.done.wait(timeout=timeout):
                raise OpError(f"no reply to {type(req).__name__} in {timeout:.0f} s")
            if waiter.error is not None:
                raise OpError(waiter.error)
            return waiter.body
        finally:
            self.waiters.pop(req.xid, None)

    def _dump(self, dp) -> tuple[dict, dict, list]:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        stats = self._request(dp, parser.OFPFlowStatsRequest(dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY,
                                                             0, 0, parser.OFPMatch()))
        descs = self._request(dp, parser.OFPGroupDescStatsRequest(dp, 0))
        flows = {}
        for st in stats:
            f = ofmsg.flow_from_stats(ofp, st)
            flows[f.key] = f
        groups = {g.group_id: g for g in (ofmsg.group_from_desc(ofp, d) for d in descs)}
        return flows, groups, stats

    def _sync(self, dp) -> None:
        dpid = dp.id
        try:
            with self.locks[dpid]:
                flows, groups, _ = self._dump(dp)
                self.installed[dpid] = (flows, groups)
            log.info("switch %016x: read %d flows, %d groups", dpid, len(flows), len(groups))
            self.dirty.set()
        except (OpError, KeyError) as exc:
            log.error("switch %016x: could not read its tables: %s", dpid, exc)

    # -- counters ---------------------------------------------------------
    def _poll_loop(self) -> None:
        """Publish counters every ``poll`` s; every AUDIT_EVERY polls also audit the whole tables.

        Counter polls ask the switch only for the flows whose counters are published
        (by cookie kind), without the switch's lock, so they never hold up a cut-over.
        """
        n = 0
        while True:
            hub.sleep(self.poll)
            n += 1
            for dpid, dp in list(self.dps.items()):
                if dpid not in self.installed:
                    continue
                try:
                    if n % AUDIT_EVERY == 0:
                        self._audit(dpid, dp)
                    self._publish(dpid, self._counter_stats(dp))
                except Exception as exc:
                    log.warning("switch %016x: counter poll failed: %s", dpid, exc)

    def _counter_stats(self, dp) -> list:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        stats = []
        for kind, table in ((Kind.VID_ROUTE, 1), (Kind.VID_MISS, 1), (Kind.DENY, 0)):
            stats += self._request(dp, parser.OFPFlowStatsRequest(
                dp, 0, table, ofp.OFPP_ANY, ofp.OFPG_ANY, int(kind) << 56, 0xFF << 56, parser.OFPMatch()))
        return stats

    def _audit(self, dpid: int, dp) -> None:
        """Re-read the switch; if its tables drifted from what was committed, reconcile."""
        with self.locks[dpid]:
            flows, groups, _ = self._dump(dp)
            known_f, known_g = self.installed.get(dpid, ({}, {}))
            if flows != known_f or groups != known_g:
                log.warning("switch %016x: tables differ from what was committed; reconciling", dpid)
                self.installed[dpid] = (flows, groups)
                self.dirty.set()

    def _publish(self, dpid: int, stats: list) -> None:
        per: dict[str, list[int]] = {}
        for st in stats:
            kind, service, lo, _ = split_cookie(st.cookie)
            if kind == Kind.VID_ROUTE and st.table_id == 1:
                name = f"{service}/{lo:06x}"
            elif kind in (Kind.DENY, Kind.VID_MISS):
                name = f"{Kind(kind).name.lower()}/{lo}"
            else:
                continue
            acc = per.setdefault(name, [0, 0])
            acc[0] += st.packet_count
            acc[1] += st.byte_count
        if self.lease is None:
            ttl = max(int(self.poll * 10), 10)
            self.lease = self.registry.lease(ttl)
            self.lease_stop = self.registry.keepalive(self.lease, ttl)
        try:
            self.registry.put(schema.counters_key(dpid), json.dumps({"at": time.time(), "counters": per}),
                              lease=self.lease)
        except Exception:
            self.lease_stop.set()  # lease lost (e.g. etcd restarted): take a new one next time
            self.lease = None
            raise

    # -- OpenFlow events ----------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev):
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            log.info("switch %016x: connected", dp.id)
            self.dps[dp.id] = dp
            self.locks.setdefault(dp.id, threading.Lock())
            self.installed.pop(dp.id, None)
            self.reported.pop(dp.id, None)
            hub.spawn(self._sync, dp)
        elif ev.state == DEAD_DISPATCHER and dp.id is not None:
            if self.dps.get(dp.id) is dp:
                log.warning("switch %016x: disconnected (it keeps its flows)", dp.id)
                self.dps.pop(dp.id, None)
                self.installed.pop(dp.id, None)

    def _reply(self, msg, body=None, error=None, more=False) -> None:
        waiter = self.waiters.get(msg.xid)
        if waiter is None:
            if error:
                log.error("switch %016x: unsolicited error: %s", msg.datapath.id, error)
            return
        if body:
            waiter.body.extend(body)
        if error is not None and waiter.error is None:
            waiter.error = error
        if not more or error is not None:
            waiter.done.set()

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats(self, ev):
        msg = ev.msg
        self._reply(msg, msg.body, more=bool(msg.flags & msg.datapath.ofproto.OFPMPF_REPLY_MORE))

    @set_ev_cls(ofp_event.EventOFPGroupDescStatsReply, MAIN_DISPATCHER)
    def _group_desc(self, ev):
        msg = ev.msg
        self._reply(msg, msg.body, more=bool(msg.flags & msg.datapath.ofproto.OFPMPF_REPLY_MORE))

    @set_ev_cls(ofp_event.EventOFPBundleCtrlMsg, MAIN_DISPATCHER)
    def _bundle_ctrl(self, ev):
        msg = ev.msg
        if msg.type == msg.datapath.ofproto.OFPBCT_COMMIT_REPLY:
            self._reply(msg)

    @set_ev_cls(ofp_event.EventOFPErrorMsg, MAIN_DISPATCHER)
    def _error(self, ev):
        msg = ev.msg
        self._reply(msg, error=f"OpenFlow error type={msg.type} code={msg.code}")
