"""The os-ken route controller: a thin shell — events in, ``engine`` out, ``ofconn`` to send.

It holds nothing etcd does not: a mirror of the ``/vfab/v1/`` prefix kept by a
watch, and per switch the flows last read from (or committed to) it.  On
(re)connect a switch is dumped and diffed, so killing and restarting the
controller reconciles; switches keep forwarding meanwhile (fail-mode secure).

Its configuration is a ``ControllerConfig`` handed over by ``configure()``
before os-ken instantiates the app (``main`` does that); without one the
defaults apply.

os-ken's hub runs real threads by default (``OSKEN_HUB_TYPE`` unset =
native): the etcd watch, the reconcile loop, the counter polls and os-ken's
receive loop run concurrently, so the mirror, each switch's tables and each
connection's pending replies are guarded by locks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import DEAD_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub
from os_ken.ofproto import ofproto_v1_4

from vfab.controller import ctlmetrics, engine, nodeplan
from vfab.controller.election import Election
from vfab.controller.config import ControllerConfig
from vfab.controller.datapath import Datapath, DatapathError
from vfab.controller.ofconn import OFConn, OpError, install_raw_flow_stats
from vfab.controller.report import COUNTED, Reporter, counters_from_stats
from vfab.fabric import nodecompile
from vfab.fabric.nodecompile import Memory
from vfab.vid import metrics
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.controller")
BINDING_LAG = 1.0   # s a binding may outlive its lease's end before a round removes its flows
RETIRED_S = 10.0    # s a deleted group's id is not given to a new group (engine.place_groups ``avoid``)

_config: ControllerConfig | None = None


def configure(config: ControllerConfig) -> None:
    """Set the configuration the next ``VfabController`` starts with (call before ``run_apps``)."""
    global _config
    _config = config

class VfabController(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_4.OFP_VERSION]
    state_revision = 0                  # the newest revision that changed what is compiled (ctlmetrics)
    changed_at: float | None = None     # monotonic: when the first change no round took yet came

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = _config or ControllerConfig()
        install_raw_flow_stats()
        self.registry = Registry(self.config.etcd)
        self.reporter = Reporter(self.registry, self.config.poll)
        self.items: dict[str, bytes] = {}
        self.revision = 0
        self.mirror_lock = threading.Lock()   # items + revision change together (one etcd revision at a time)
        self.conns: dict[int, OFConn] = {}
        self.installed: dict[int, engine.Installed] = {}
        self.locks: dict[int, threading.Lock] = {}
        self.dirty = threading.Event()   # not hub.Event: its wait(timeout) never times out (a binding's end)
        self.problems: set[str] = set()   # logged already (each is logged when it first appears)
        self.verified: set[int] = set()   # switches an audit found as committed since their last commit
        self.parsed: dict = {}            # records parsed in earlier rounds (reconcile thread only)
        self.generation: dict[int, int] = {}  # per switch, bumped whenever ``installed`` changes
        self.datapath = Datapath(self.config.ovs_rundir) if self.config.datapath_wait else None
        self.datapath_problem = ""          # logged once per distinct reason
        self.next_change: float | None = None   # when the next binding in force ends (unix s)
        self.to_report: list = []           # (Report, committed at, change came at), published by _report_loop
        self.hold: dict[int, set[int]] = {}  # groups kept until the datapath followed the round that unused them
        # endpoint key -> (its last record, until when it lingers): records etcd deleted (lease expired or revoked)
        # whose ranges still reach them while nobody else serves them (engine.plan_round ``lingering``)
        self.departed: dict[str, tuple[bytes, float]] = {}
        self.retired: dict[int, dict[int, float]] = {}   # dpid -> {group id: when a round may have deleted it}
        self.hold_lock = threading.Lock()
        self.report_cv = threading.Condition()
        # A route agent (config.node): its switch's routing memory (fabric/nodecompile.py), kept once committed,
        # and the nodes whose applied reports its held ranges wait for.
        self.node_memory = Memory()
        # ... and the keys that changed since the compile that made it (None: compile the whole switch next).
        self.node_changed: set[str] | None = None
        self.node_waiting: dict[str, int] = {}
        self.node_waiting_keys: frozenset[str] = frozenset()   # their applied/ key names (dpid as 16 hex digits)
        self.lead = 0          # a route agent writes only while it leads its node's election (controller/election.py)
        if metrics.enabled():
            metrics.REGISTRY.register(ctlmetrics.ControllerCollector(self))
        self.threads = [hub.spawn(self._watch_loop), hub.spawn(self._reconcile_loop),
                        hub.spawn(self._poll_loop), hub.spawn(self._report_loop)]
        if self.config.node:
            election = Election(self.registry, self.config.node, self._lead, ttl=self.config.election_ttl)
            self.threads.append(hub.spawn(election.run, threading.Event()))

    # -- etcd -------------------------------------------------------------
    def _watch_loop(self) -> None:
        def reset(items: dict, rev: int) -> None:
            with self.mirror_lock:
                fresh = {k: v for k, (v, _) in items.items()}
                for key in [k for k in self.items if k not in fresh]:
                    self._departed(key, self.items[key])
                self.items = fresh
                self.revision = self.state_revision = rev
                self.node_changed = None
                self.changed_at = self.changed_at or time.monotonic()
            log.info("etcd %s: loaded %d keys at revision %d", self.registry.endpoint, len(items), rev)
            self.dirty.set()

        def apply(batch: list) -> None:
            # Whole watch responses: a revision (one etcd txn) is applied to the mirror at once, so the
            # reconcile loop never compiles or reports half of a transaction.
            changed = False
            with self.mirror_lock:  # os-ken's hub runs real threads: the batch goes in whole
                for ev in batch:
                    if ev.value is None:
                        gone = self.items.pop(ev.key, None)
                        if gone is not None:
                            self._departed(ev.key, gone)
                    else:
                        self.items[ev.key] = ev.value
                        self.departed.pop(ev.key, None)
                    self.revision = max(self.revision, ev.revision)
                    parsed = schema.parse_key(ev.key)
                    if not (parsed and parsed[0] in schema.PASSIVE) or self._node_relevant(parsed):
                        changed = True
                        self.state_revision = max(self.state_revision, ev.revision)
                        if self.node_changed is not None:   # a route agent compiles only what changed
                            self.node_changed.add(ev.key)
                if changed and self.changed_at is None:
                    self.changed_at = time.monotonic()
            if changed:
                self.dirty.set()

        def failed(exc: Exception, first: bool) -> None:   # etcd down or compacted: reload after a pause
            log.warning("etcd %s: %s; retrying in 1 s", self.registry.endpoint, exc)

        # Reloaded whenever the watch ends (etcd restarted): never resumed from a revision it may not have.
        self.registry.follow(schema.ROOT, reset, apply, threading.Event(), resume=False, errors=(Exception,),
                             on_error=failed)

    def _node_relevant(self, parsed) -> bool:
        """A route agent also compiles from the node records (its tunnels, where hosts are) and, while a held
        range waits for a node to apply a move, from the applied reports (nodecompile's cut-over order)."""
        if not self.config.node or not parsed:
            return False
        if parsed[0] == "applied":   # not its own reports: a round would report again, and wake itself again
            return bool(parsed[1]) and parsed[1][0] in self.node_waiting_keys
        return parsed[0] == "nodes"

    # -- a route agent's election and fencing -------------------------------------
    def _lead(self, generation: int) -> None:
        """The election's verdict: lead with ``generation`` (claim MASTER on the switch), or 0 (stand by)."""
        self.lead = generation
        if generation:   # claim first (the old master can no longer write), then read what it left, then plan
            for conn in list(self.conns.values()):
                self._claim(conn.dp)
                self.installed.pop(conn.dpid, None)
                hub.spawn(self._sync, conn)

    def _claim(self, dp) -> None:
        """Role MASTER with the election's generation: the switch demotes every other agent to SLAVE and refuses
        an older generation from now on."""
        gen = self.lead
        if gen:
            ofp = dp.ofproto
            dp.send_msg(dp.ofproto_parser.OFPRoleRequest(dp, ofp.OFPCR_ROLE_MASTER, gen))

    def _fenced(self, dpid: int, why: str) -> None:
        if self.lead:
            log.error("switch %016x: %s: another route agent of node %s leads now; this one stops writing (its "
                      "election lease is gone or going)", dpid, why, self.config.node)
        self.lead = 0

    @set_ev_cls(ofp_event.EventOFPRoleReply, MAIN_DISPATCHER)
    def _role_reply(self, ev):
        msg = ev.msg
        log.info("switch %016x: role %d, generation %d", msg.datapath.id, msg.role, msg.generation_id)

    def _departed(self, key: str, value: bytes) -> None:
        """(mirror lock held) ``key`` left etcd: an endpoint's record lingers ``config.linger`` s (engine)."""
        parsed = schema.parse_key(key)
        if parsed and parsed[0] == "endpoints" and self.config.linger > 0:
            self.departed[key] = (value, time.time() + self.config.linger)

    def _lingering(self, now: float) -> tuple[dict[str, bytes], float | None]:
        """(mirror lock held) The endpoint records that linger now, and when the first of them stops."""
        for key in [k for k, (_, until) in self.departed.items() if until <= now]:
            del self.departed[key]
        ends = [until for _, until in self.departed.values()]
        return {k: v for k, (v, _) in self.departed.items()}, (min(ends) if ends else None)

    # -- reconcile --------------------------------------------------------
    def _reconcile_loop(self) -> None:
        while True:
            # A binding (a DHCP host's leased address) guards until it ends: a round then takes its flows away,
            # up to BINDING_LAG s late so that the ends of one second (clients leaving) share one round.
            wait = None if self.next_change is None else max(0.0, self.next_change - time.time()) + BINDING_LAG
            self.dirty.wait(wait)
            self.dirty.clear()
            try:
                self._reconcile()
            except Exception:  # a bug must not stop reconciling for good: log it, retry at the next change
                log.exception("reconcile round failed; the switches keep what they hold")
                self._compile_whole()

    def _reconcile(self) -> None:
        """One round: plan with the engine, commit step by step, then report."""
        t0 = time.monotonic()
        snapshot = dict(self.installed)
        now = time.time()
        with self.mirror_lock:
            items, revision = dict(self.items), self.revision
            lingering, linger_end = self._lingering(now)
            since, self.changed_at = self.changed_at, None
            if self.config.node:   # what changed since the last adopted compile; recorded afresh from here
                node_changed, self.node_changed = self.node_changed, set()
        with self.hold_lock:
            hold = {d: set(g) for d, g in self.hold.items() if g}
            for gids in self.retired.values():
                for gid in [g for g, t in gids.items() if now - t > RETIRED_S]:
                    del gids[gid]
            retired = {d: set(g) for d, g in self.retired.items() if g}
        compiled = None
        if self.config.node:
            rnd, compiled = nodeplan.plan_node_round(
                items, revision, snapshot, self.config.node, self.node_memory, switch_ports=self._switch_ports(),
                reported=dict(self.reporter.reported), hold=hold, retired=retired, now=now, lingering=lingering,
                cache=self.parsed, changed=None if self.config.node_whole else node_changed)
        else:
            rnd = engine.plan_round(items, revision, snapshot, settle=self.config.settle,
                                    reported=dict(self.reporter.reported), cache=self.parsed, hold=hold, now=now,
                                    lingering=lingering, retired=retired)
        self.next_change = min((t for t in (rnd.next_change, linger_end) if t is not None), default=None)
        if rnd.error:
            log.error("compile failed at revision %d (%s); keeping the switches as they are",
                      rnd.revision, rnd.error)
            self._compile_whole()
            return
        if rnd.steps:
            log.info("revision %d: planned %d commit(s) in %.1f ms", rnd.revision, len(rnd.commits),
                     (time.monotonic() - t0) * 1e3)
        for problem in rnd.problems:
            if problem not in self.problems:
                log.warning("revision %d: %s", rnd.revision, problem)
        self.problems = set(rnd.problems)
        failed: set[int] = set()
        run: list[engine.Commit] = []
        steps = rnd.steps
        if self.config.node and not self.lead and steps:   # a standby (or fenced) route agent never writes
            log.info("node %s: standby: %d commit(s) left to the active route agent", self.config.node,
                     len(rnd.commits))
            failed, steps = {c.dpid for c in rnd.commits}, []
        for step in [*steps, None]:
            if isinstance(step, engine.Commit):
                run.append(step)
                continue
            failed |= self._apply(run, snapshot, rnd.revision)
            run = []
            if isinstance(step, engine.Pause):
                self._pause(step)
        self._hold_groups(rnd.held, failed)
        if compiled is not None and compiled.config is not None:
            dpid = compiled.config.dpid
            if dpid in self.installed and dpid not in failed:   # what the switch holds now: the next round's past
                self.node_memory = compiled.memory
                if compiled.waiting != self.node_waiting:
                    log.info("node %s: %s", self.config.node, "holding moved ranges until " + ", ".join(
                        f"{n} reports revision {r} applied" for n, r in sorted(compiled.waiting.items()))
                        if compiled.waiting else "no moved range held any more")
                nodes = compiled.memory.base.nodes if compiled.memory.base else nodecompile.nodes_of(items)
                self.node_waiting_keys = frozenset(f"{nodes[n].dpid:016x}" for n in compiled.waiting if n in nodes)
                self.node_waiting = compiled.waiting
                if compiled.waiting:   # a report that came in while this round ran found nothing waiting for it
                    with self.mirror_lock:
                        now_items = dict(self.items)
                    done = nodecompile.applied_of(now_items, nodes)
                    if any(done.get(n, -1) >= r for n, r in compiled.waiting.items()):
                        self.dirty.set()
            else:   # the switch may not hold what this compile made
                self._compile_whole()
        # Reported once every switch has its bundle and (_report_loop) the datapath follows: the reports
        # never delay a cut-over or the next round.
        committed = time.time()
        turned = {step.dpid for step in rnd.steps if isinstance(step, engine.Commit)}   # cut-overs to time
        reports = [(rep, committed, since if rep.dpid in turned else None) for rep in rnd.reports
                   if rep.dpid not in failed and rep.dpid in self.installed]
        if reports:
            with self.report_cv:
                self.to_report.extend(reports)
                self.report_cv.notify()

    def _compile_whole(self) -> None:
        """A route agent's next round compiles the whole switch (its memory is not what this round compiled)."""
        if self.config.node:
            with self.mirror_lock:
                self.node_changed = None

    def _datapath_pass(self) -> bool:
        """Wait for a whole revalidation pass of the local daemon; False if it cannot be had."""
        if self.datapath is None:
            return False
        try:
            took = self.datapath.wait_pass(self.config.datapath_timeout)
            if self.datapath_problem:
                log.info("datapath: %s answers again", self.datapath.daemon)
                self.datapath_problem = ""
            log.debug("datapath: revalidation pass in %.1f ms", took * 1e3)
            return True
        except DatapathError as exc:
            if str(exc) != self.datapath_problem:
                log.warning("datapath: %s; 'applied' reports mean the tables were committed, not that traffic "
                            "follows them yet", exc)
                self.datapath_problem = str(exc)
            return False

    def _hold_groups(self, held: dict[int, tuple[int, ...]], failed: set[int]) -> None:
        """Groups a round kept although no flow uses them (engine.place_groups): held until a whole revalidation
        pass followed the commit (else ``group_hold``), then a new round deletes them."""
        new: dict[int, set[int]] = {}
        with self.hold_lock:
            for dpid, gids in held.items():
                if dpid in failed:
                    continue
                mine = self.hold.setdefault(dpid, set())
                fresh = set(gids) - mine
                if fresh:
                    mine |= fresh
                    new[dpid] = fresh
        if new:
            log.info("keeping %s one round longer (frames may still be in them)",
                     "; ".join(f"switch {d:016x} group(s) {sorted(g)}" for d, g in sorted(new.items())))
            hub.spawn(self._release_groups, new)

    def _release_groups(self, groups: dict[int, set[int]]) -> None:
        t0 = time.monotonic()
        if not self._datapath_pass():
            hub.sleep(self.config.group_hold)
        with self.hold_lock:
            for dpid, gids in groups.items():
                self.hold.get(dpid, set()).difference_update(gids)
                self.retired.setdefault(dpid, {}).update(dict.fromkeys(gids, time.time()))
        log.debug("released held groups after %.1f ms", (time.monotonic() - t0) * 1e3)
        self.dirty.set()

    def _pause(self, step: engine.Pause) -> None:
        """Before the next switch of a hop-by-hop path turns: this one's datapath must follow its tables."""
        if not self._datapath_pass():
            hub.sleep(step.seconds)

    def _report_loop(self) -> None:
        while True:
            with self.report_cv:
                while not self.to_report:
                    self.report_cv.wait()
                batch, self.to_report = self.to_report, []
            try:
                # A route agent's report is what the other nodes' cut-overs wait for: it goes out once the tables
                # are committed ('datapath' false), not after revalidation passes that an idle ovs-vswitchd answers
                # ~0.5 s later (measured; docs/architecture.md, "Cut-over order across hosts").
                confirmed = False if self.config.node else self._datapath_pass()
                for rep, committed, since in batch:
                    if rep.dpid in self.installed and self.reporter.reported.get(rep.dpid, -1) < rep.revision:
                        if self.reporter.applied(rep.dpid, rep.revision, rep.flows, rep.groups, committed=committed,
                                                 datapath=confirmed) and since is not None:
                            ctlmetrics.cutover(rep.dpid, since)
            except Exception:  # a bug must not stop reporting for good
                log.exception("publishing applied revisions failed")

    def _apply(self, steps: list[engine.Commit], snapshot: dict, rev: int) -> set[int]:
        """Bring each step's switch to its ``want`` in one bundle; the switches that do not hold it now.

        Between two pauses or barriers the order in which switches turn does not matter (engine.plan_round), so
        every bundle is sent before any answer is awaited: the last switch turns about one round trip after the
        first, not one round trip per switch after it (a frame entering there moved that much later)."""
        failed: set[int] = set()
        sent = []
        with contextlib.ExitStack() as locked:
            for step in steps:
                conn = self.conns.get(step.dpid)
                if conn is None:
                    failed.add(step.dpid)
                    continue
                locked.enter_context(self.locks[step.dpid])
                now = self.installed.get(step.dpid)
                if now is None:
                    failed.add(step.dpid)
                    continue
                # re-read meanwhile: plan against what it holds now
                plan = step.plan if now is snapshot.get(step.dpid) else engine.replan(step.want, now)
                try:
                    sent.append((step, conn, plan, conn.send_bundle(plan) if plan else None, time.monotonic()))
                except OpError as exc:
                    self._bundle_failed(conn, exc)
                    failed.add(step.dpid)
            for step, conn, plan, bundle, t0 in sent:
                try:
                    if bundle is not None:
                        conn.wait_bundle(bundle)
                        self.verified.discard(step.dpid)
                        log.info("switch %016x: revision %d: %s in %.1f ms", step.dpid, rev, plan.summary(),
                                 (time.monotonic() - t0) * 1e3)
                    self._set_installed(step.dpid, (step.want.flows, step.want.groups))
                except OpError as exc:
                    self._bundle_failed(conn, exc)
                    failed.add(step.dpid)
        return failed

    def _bundle_failed(self, conn: OFConn, exc: OpError) -> None:
        log.error("switch %016x: bundle failed (%s); re-reading its tables", conn.dpid, exc)
        self.installed.pop(conn.dpid, None)
        hub.spawn(self._sync, conn)

    def _sync(self, conn: OFConn) -> None:
        dpid = conn.dpid
        try:
            with self.locks[dpid]:
                flows, groups = conn.dump()
                if self.conns.get(dpid) is conn:
                    self._set_installed(dpid, (flows, groups))
            log.info("switch %016x: read %d flows, %d groups", dpid, len(flows), len(groups))
            self.dirty.set()
        except (OpError, KeyError) as exc:
            log.error("switch %016x: could not read its tables: %s", dpid, exc)

    # -- counters and audits ----------------------------------------------------
    def _poll_loop(self) -> None:
        """Publish counters every ``poll`` s; every ``audit_polls`` polls also audit the whole tables.

        Counter polls ask the switch only for the flows whose counters are published
        (by cookie kind), without the switch's lock, so they never hold up a cut-over.
        """
        n = 0
        selectors = [(table, int(kind) << 56, 0xFF << 56) for kind, table in COUNTED]
        while True:
            hub.sleep(self.config.poll)
            n += 1
            for dpid, conn in list(self.conns.items()):
                if dpid not in self.installed:
                    continue
                try:
                    if n % self.config.audit_polls == 0:
                        self._audit(conn)
                    self.reporter.counters(dpid, counters_from_stats(conn.counter_stats(selectors)))
                except Exception as exc:
                    log.warning("switch %016x: counter poll failed: %s", dpid, exc)

    def _set_installed(self, dpid: int, tables: engine.Installed) -> None:
        """What ``dpid`` holds now (caller holds its lock)."""
        self.installed[dpid] = tables
        self.generation[dpid] = self.generation.get(dpid, 0) + 1

    def _audit(self, conn: OFConn) -> None:
        """Re-read the switch; if its tables drifted from what was committed, reconcile.

        The dump runs without the switch's lock (a big table takes a second to read, and a cut-over
        must not wait for it); if anything was committed meanwhile, this audit is void.
        """
        dpid = conn.dpid
        gen = self.generation.get(dpid)
        dumped = conn.dump()
        with self.locks[dpid]:
            if self.generation.get(dpid) != gen:
                return
            known = self.installed.get(dpid)
            if known is not None and engine.drifted(dumped, known):
                log.warning("switch %016x: tables differ from what was committed; reconciling", dpid)
                self._set_installed(dpid, dumped)
                self.verified.discard(dpid)
                self.dirty.set()
            elif known is not None and dpid not in self.verified:
                log.info("switch %016x: audit: its %d flows and %d groups are as committed", dpid,
                         len(dumped[0]), len(dumped[1]))
                self.verified.add(dpid)

    # -- OpenFlow events ----------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev):
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            log.info("switch %016x: connected", dp.id)
            conn = OFConn(dp, timeout=self.config.bundle_timeout)
            self.conns[dp.id] = conn
            self.locks.setdefault(dp.id, threading.Lock())
            self.installed.pop(dp.id, None)
            self.reporter.forget(dp.id)
            if self.config.node:
                self._claim(dp)
            hub.spawn(self._sync, conn)
        elif ev.state == DEAD_DISPATCHER and dp.id is not None:
            conn = self.conns.get(dp.id)
            if conn is not None and conn.dp is dp:
                log.warning("switch %016x: disconnected (it keeps its flows)", dp.id)
                conn.close("the switch disconnected")
                self.conns.pop(dp.id, None)
                self.installed.pop(dp.id, None)
                self.reporter.last.pop(dp.id, None)

    def _switch_ports(self) -> dict[str, int]:
        """Port name -> number of every connected switch (a route agent has one): where its tunnels are."""
        out = {}
        for conn in list(self.conns.values()):
            for no, port in list(getattr(conn.dp, "ports", {}).items()):
                name = port.name.decode(errors="replace") if isinstance(port.name, bytes) else str(port.name)
                out[name] = no
        return out

    @set_ev_cls(ofp_event.EventOFPPortStatus, MAIN_DISPATCHER)
    def _port_status(self, ev):
        if self.config.node:   # a tunnel port came or went (os-ken keeps dp.ports): compile again
            self.dirty.set()

    def _reply(self, msg, body=(), error=None, more=False) -> None:
        conn = self.conns.get(msg.datapath.id)
        if (conn is None or not conn.on_reply(msg.xid, body, more, error)) and error:
            log.error("switch %016x: unsolicited error: %s", msg.datapath.id, error)

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
        ofp = msg.datapath.ofproto
        if msg.type == ofp.OFPET_ROLE_REQUEST_FAILED:
            self._fenced(msg.datapath.id, f"the switch refused role MASTER (code {msg.code}: stale generation)")
        elif msg.type == ofp.OFPET_BAD_REQUEST and msg.code == ofp.OFPBRC_IS_SLAVE:
            self._fenced(msg.datapath.id, "the switch refused a write from this agent as a SLAVE")
        self._reply(msg, error=f"OpenFlow error type={msg.type} code={msg.code}")
