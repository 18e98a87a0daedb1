"""The scale bench's route agent: one per emulated host, compiling its own switch's route flows from etcd.

What main has, assembled per host (OVN's split, DESIGN.md §8): the records are read from etcd
(``FabricState``), each range's owner endpoint leads to its host record's switch and so to the node whose
``dpid`` that is; ``fabric/tworoute.py`` compiles node ``me``'s flows (own ranges exact, the rest as prefixes
per remote node); ``reconcile.diff`` plans; ``OFConn`` commits one atomic bundle on the node's own switch.

- ``RouteView`` is the pure part: the parsed fabric as this agent sees it (services, range owners per
  service), updated by watch events (``apply``), compiled per service (``service_flows``).  Views of many
  agents share the parsed records they were loaded with (read-only); a change replaces one service's list
  in the agent's own view.
- ``Agent`` is the shell: its own etcd watch on ``ranges/`` (a thread), its own OpenFlow channel, and for
  each watch response it recompiles only the services the response touched and commits their difference
  (strict deletes: the other services' flows are not in the diff).  It records when each response came
  and when its bundle was answered (``done``), for the bench.

Another agent (e.g. the controller's own route agent, issue 45) plugs in as a class with the same
``start``/``stop``/``full_reconcile``/``done`` (bench/scale.py ``--agent``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from vfab.controller.ofconn import OFConn
from vfab.controller.reconcile import diff
from vfab.fabric.flows import SwitchConfig, gc_paused, split_cookie
from vfab.fabric.state import FabricState
from vfab.fabric.tworoute import MISS, Owned, node_routes
from vfab.vid.registry import Registry, schema

RANGES = schema.ROOT + "ranges/"
IDLE = 2.0          # s without events after which an agent renews its watch (and looks at its stop flag)


@dataclass
class Shared:
    """What every agent's view starts from: the records parsed once, the node of each switch, and each
    service's ranges with their owners' nodes (built on first use, then shared: read-only)."""

    state: FabricState
    revision: int
    node_of_dpid: dict[int, str]
    tunnel_port: dict[str, dict[str, int]]     # node -> (remote node -> port of the tunnel to it)
    owned: dict[str, list[Owned]] = field(default_factory=dict)

    @classmethod
    def load(cls, items: dict[str, bytes], revision: int, tunnel_port) -> "Shared":
        with gc_paused():
            st = FabricState.from_items(items)
            nodes = [schema.Node.from_json(v, k) for k, v in items.items() if k.startswith(schema.ROOT + "nodes/")]
        return cls(st, revision, {n.dpid: n.name for n in nodes}, tunnel_port)

    def node_of(self, service: str, endpoint: str) -> str:
        """The node whose switch the endpoint's host record names (MISS: none, or no such endpoint)."""
        ep = self.state.endpoints.get((service, endpoint)) if endpoint else None
        host = self.state.hosts.get(ep.mac) if ep is not None else None
        return self.node_of_dpid.get(host.dpid, MISS) if host is not None else MISS

    def ranges_of(self, service: str) -> list[Owned]:
        got = self.owned.get(service)
        if got is None:
            got = [Owned(r.lo, r.hi, self.node_of(service, r.owner), r.epoch)
                   for r in self.state.ranges.get(service, ())]
            self.owned[service] = got
        return got


@dataclass
class RouteView:
    me: str
    shared: Shared
    owned: dict[str, list[Owned]] = field(default_factory=dict)     # service -> its ranges, where they changed

    def ranges_of(self, service: str) -> list[Owned]:
        got = self.owned.get(service)
        return got if got is not None else self.shared.ranges_of(service)

    def apply(self, events) -> set[str]:
        """Watch events under ``ranges/``: the services whose ranges changed."""
        dirty = set()
        for ev in events:
            parsed = schema.parse_key(ev.key)
            if parsed is None or parsed[0] != "ranges" or len(parsed[1]) != 2:
                continue
            service, lo = parsed[1][0], int(parsed[1][1], 16)
            rs = [r for r in self.ranges_of(service) if r.lo != lo]
            if ev.value is not None:
                rec = schema.RangeRec.from_json(ev.value, ev.key)
                rs.append(Owned(rec.lo, rec.hi, self.shared.node_of(service, rec.owner), rec.epoch))
                rs.sort(key=lambda r: r.lo)
            self.owned[service] = rs
            dirty.add(service)
        return dirty

    def service_flows(self, service: str) -> list:
        svc = self.shared.state.services.get(service)
        if svc is None:
            return []
        port = LOCAL_PORT
        return node_routes(svc.id, svc.layout, self.ranges_of(service), self.me, self.shared.tunnel_port[self.me],
                           lambda r: (("output", port),))

    def all_flows(self) -> SwitchConfig:
        cfg = SwitchConfig(0)
        with gc_paused():
            for service in self.shared.state.services:
                for f in self.service_flows(service):
                    cfg.add(f)
        return cfg


LOCAL_PORT = 1      # the port of the node's endpoints (every host record the bench writes says so)


def by_service(flows: dict) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for key, f in flows.items():
        out.setdefault(split_cookie(f.cookie)[1], {})[key] = f
    return out


class Agent:
    """One node's route agent: ``view`` kept current from its own watch, its switch through ``conn``."""

    def __init__(self, view: RouteView, conn: OFConn, endpoint: str, installed: dict | None = None):
        self.view = view
        self.conn = conn
        self.reg = Registry(endpoint)
        self.installed = by_service(installed or {})      # service id -> key -> FlowSpec on the switch
        # per watch response: (revision, got at, answered at, messages sent, thread CPU s, s waiting on bundles)
        self.done: list[tuple[int, float, float, int, float, float]] = []
        self.seen = view.shared.revision
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self, revision: int) -> None:
        """Watch from the revision after ``revision`` (the one the view and ``installed`` were read at)."""
        ready = threading.Event()
        self.seen = revision
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name=f"agent-{self.view.me}")
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        # The watch is renewed after IDLE s without events, so ``stop`` is seen that often: closing a watch
        # stream from another thread while this one reads it would block both (Registry.watch_batches).
        try:
            while not self._stop.is_set():
                batches, cancel = self.reg.watch_batches(RANGES, self.seen + 1, idle=IDLE)
                ready.set()
                try:
                    for batch in batches:
                        got, cpu = time.monotonic(), time.thread_time()
                        msgs, waited = self.on_batch(batch)
                        rev = max(ev.revision for ev in batch)
                        self.done.append((rev, got, time.monotonic(), msgs, time.thread_time() - cpu, waited))
                        self.seen = rev
                        if self._stop.is_set():
                            break
                finally:
                    cancel()
        except Exception as exc:  # noqa: BLE001 - reported by the bench, which fails the run
            if not self._stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            ready.set()

    def on_batch(self, batch) -> tuple[int, float]:
        """Recompile the services ``batch`` touched and commit their difference; (messages sent (0: none),
        seconds spent waiting for the switch's answers)."""
        sent, waited = 0, 0.0
        for service in sorted(self.view.apply(batch)):
            svc = self.view.shared.state.services.get(service)
            if svc is None:
                continue
            want = SwitchConfig(self.conn.dpid)
            for f in self.view.service_flows(service):
                want.add(f)
            plan = diff(want, self.installed.get(svc.id, {}), {}, by_cookie=False)
            if plan:
                t0 = time.monotonic()
                sent += self.conn.commit(plan)
                waited += time.monotonic() - t0
                self.installed[svc.id] = want.flows
        return sent, waited

    def signal_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Stop (within IDLE s: the watch's renewal); ``signal_stop`` all agents first to stop many at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=IDLE + 5)
        self.reg.close()


def full_reconcile(me: str, conn: OFConn, endpoint: str, tunnel_port) -> tuple[dict, RouteView, dict, int]:
    """A restarted agent: read every record, compile the node's flows, read the switch, commit the difference.
    Returns (seconds per phase, the view, the flows now on the switch, the revision read)."""
    t = {}
    t0 = time.monotonic()
    reg = Registry(endpoint)
    try:
        revision, raw = reg.get_prefix(schema.ROOT)
    finally:
        reg.close()
    items = {k: v for k, (v, _mod) in raw.items()}
    t["etcd_read_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    view = RouteView(me, Shared.load(items, revision, tunnel_port))
    t["parse_s"] = time.monotonic() - t1
    t2 = time.monotonic()
    want = view.all_flows()
    want = SwitchConfig(conn.dpid, want.flows)
    t["compile_s"] = time.monotonic() - t2
    t3 = time.monotonic()
    flows, groups = conn.dump()
    t["dump_s"] = time.monotonic() - t3
    t4 = time.monotonic()
    plan = diff(want, flows, groups)
    t["diff_s"] = time.monotonic() - t4
    t5 = time.monotonic()
    msgs = conn.commit(plan) if plan else 0
    t["commit_s"] = time.monotonic() - t5
    t["total_s"] = time.monotonic() - t0
    t["flows"] = len(want.flows)
    t["added"] = len(plan.add_flows)
    t["removed"] = plan.removed
    t["messages"] = msgs
    return t, view, want.flows, revision
