"""The controller's logic, pure: etcd items + what each switch holds → an ordered plan of steps.

No I/O, no clock (faucet's valve.py to the app's faucet.py): ``plan_round``
takes the mirror of the ``/vfab/v1/`` prefix and, per switch the controller
has read, the flows and groups it holds; it returns a ``Round``:

- ``steps``: ``Commit(dpid, plan, want)`` — one atomic bundle bringing that
  switch to ``want`` — in the order that loses no frame at a cut-over
  (switches without a route change first, then nearest-to-the-new-owner
  first), with ``Pause(seconds)`` after a switch whose changed VID routes go
  hop by hop (an rx=bpf/promisc owner: the VID stays on the wire, so the next
  switch on the path must not turn before this one's datapath did) if another
  switch follows.  Routes to rx=ovs owners need no pause: the first switch
  rewrites the frame to the owner's MAC, so every frame is consistent on its
  own (fabric/compiler.py);
- ``reports``: ``Report(dpid, revision, flows, groups)`` for every switch the
  round brings up to date, to publish only after every step ran (reports
  must not delay a cut-over), and only for switches whose commit succeeded;
- ``problems``: malformed records and front doors that were skipped; ``error``
  if nothing could be compiled (the switches are then left as they are).

A switch the controller has not read yet (``installed`` lacks it) gets no
step and no report: it is planned once its tables are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vfab.controller.reconcile import Plan, diff, update_order
from vfab.fabric.compiler import compile_fabric, route_destinations
from vfab.fabric.flows import Kind, SwitchConfig, gc_paused, split_cookie
from vfab.fabric.state import FabricState
from vfab.fabric.topology import distances, next_hops

Installed = tuple[dict, dict]  # (flow key -> FlowSpec, group id -> GroupSpec) a switch holds


@dataclass(frozen=True)
class Commit:
    dpid: int
    plan: Plan
    want: SwitchConfig


@dataclass(frozen=True)
class Pause:
    """Before the next switch turns: the last one's datapath must follow its tables (the app waits for a
    revalidation pass where it can ask the switch's daemon, else ``seconds``)."""
    seconds: float


@dataclass(frozen=True)
class Report:
    dpid: int
    revision: int
    flows: int
    groups: int


@dataclass
class Round:
    revision: int
    steps: list = field(default_factory=list)        # Commit | Pause, in order
    reports: list[Report] = field(default_factory=list)
    configs: dict[int, SwitchConfig] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def commits(self) -> list[Commit]:
        return [s for s in self.steps if isinstance(s, Commit)]


def plan_round(items: dict[str, bytes], revision: int, installed: dict[int, Installed], *,
               settle: float = 0.005, reported: dict[int, int] | None = None, cache: dict | None = None) -> Round:
    """One reconcile round.  ``reported``: dpid → revision already published (no report again);
    ``cache``: records parsed in earlier rounds (``FabricState.from_items``), kept by the caller."""
    with gc_paused():  # the heap holds every installed flow: full collections mid-round cost more than the round
        return _plan_round(items, revision, installed, settle, reported or {}, cache)


def _plan_round(items: dict[str, bytes], revision: int, installed: dict[int, Installed], settle: float,
                reported: dict[int, int], cache: dict | None) -> Round:
    out = Round(revision)
    try:
        st = FabricState.from_items(items, cache)
        dpids = sorted(st.switches)
        links = [(lk.dpid, lk.port, lk.peer_dpid, lk.peer_port) for lk in st.links]
        hops = next_hops(dpids, links)
        out.configs = compile_fabric(st, hops=hops)
        out.problems = list(st.problems)
        dests = route_destinations(st)
        dist = distances(dpids, hops, links)
    except Exception as exc:  # a record the parser let through but the compiler cannot use
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def dest_of(cookie: int):
        kind, sid, lo, _ = split_cookie(cookie)
        return dests.get((sid, lo)) if kind == Kind.VID_ROUTE else None

    plans = {dpid: diff(out.configs[dpid], *installed[dpid]) for dpid in sorted(installed) if dpid in out.configs}
    order = [dpid for dpid in update_order(plans, dest_of, dist) if plans[dpid]]
    for i, dpid in enumerate(order):
        plan = plans[dpid]
        out.steps.append(Commit(dpid, plan, out.configs[dpid]))
        if settle > 0 and i + 1 < len(order) and any(dest_of(f.cookie) is not None
                                                      and _hop_by_hop(f, out.configs[dpid]) for f in plan.add_flows):
            out.steps.append(Pause(settle))
    for dpid in sorted(plans):
        if reported.get(dpid, -1) < revision:
            want = out.configs[dpid]
            out.reports.append(Report(dpid, revision, len(want.flows), len(want.groups)))
    return out


def _hop_by_hop(flow, cfg: SwitchConfig) -> bool:
    """True if some copy of the flow's frames leaves this switch still addressed to the VID."""
    def plain(actions) -> bool:
        rewritten = False
        for a in actions:
            if a[0] == "set_eth_dst":
                rewritten = True
            elif a[0] == "output" and not rewritten:
                return True
            elif a[0] == "group":
                g = cfg.groups.get(a[1])
                if g is None or any(plain(b.actions) for b in g.buckets):
                    return True
        return False
    return plain(flow.actions)


def replan(want: SwitchConfig, installed: Installed) -> Plan:
    """The plan again, for a switch whose tables were re-read between ``plan_round`` and its commit."""
    return diff(want, *installed)


def drifted(dumped: Installed, known: Installed) -> bool:
    """True if an audit's dump differs from what the controller believes the switch holds."""
    return dumped[0] != known[0] or dumped[1] != known[1]
