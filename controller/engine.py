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
  own (fabric/compiler.py), and the app sends such switches' bundles together;
  ``Barrier()`` after a switch whose plan changes more than VID routes (the
  next ones' new routes may lead through what it adds: its bundle is answered
  before theirs go out);
- ``reports``: ``Report(dpid, revision, flows, groups)`` for every switch the
  round brings up to date, to publish only after every step ran (reports
  must not delay a cut-over), and only for switches whose commit succeeded;
- ``problems``: malformed records and front doors that were skipped; ``error``
  if nothing could be compiled (the switches are then left as they are);
- ``held``: per switch, groups no wanted flow uses any more that this round
  still keeps (see below); the app plans again once the datapath followed.

**Groups outlive the flows that use them by one round** (``place_groups``).
A ``select`` group hashes a frame and recirculates it; the bucket is chosen in
the second pass, by group id.  Deleting a group in the bundle that re-points
its flows drops the frames caught between the two passes (ovs-vswitchd counts
them as ``drop_action_of_pipeline``; 0-4 per helpers-off at 4,500 gets/s).
So a group that the switch's *current* flows use, or that ``hold`` names (kept
by an earlier round whose datapath has not yet followed), is kept in ``want``
and reported in ``held``; it goes in the next round after the app saw a whole
revalidation pass.  New groups come before the flows that use them (the
bundle adds groups first: ``ofconn.commit``).  And group ids stay put: a
wanted group takes the id of the switch's group that the same flows use now
(the compiler numbers groups in compile order, which would otherwise renumber
a range's group when another range's group comes or goes, turning one
range's group into another's under frames in flight); new groups take ids the
switch does not hold.

A switch the controller has not read yet (``installed`` lacks it) gets no
step and no report: it is planned once its tables are known.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from vfab.controller.reconcile import Plan, diff, update_order
from vfab.fabric.compiler import GROUP_BASE, compile_fabric, live_bindings, route_destinations
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
class Barrier:
    """The bundles before it must be answered before the next one is sent.  The app sends the bundles between
    two pauses or barriers together; after a switch whose plan changes more than VID routes (a new owner's host
    route or port security, a front door) comes a barrier, since the next switches' new routes may lead
    through what it adds (the order of ``update_order`` then holds commit by commit, as it did when every
    bundle was awaited)."""


ROUTE_KINDS = frozenset((Kind.VID_ROUTE, Kind.VID_MISS))


def routes_only(plan: Plan) -> bool:
    """Whether ``plan`` adds and removes VID routes (and groups) only: a cut-over's plan."""
    return (all(split_cookie(f.cookie)[0] in ROUTE_KINDS for f in plan.add_flows)
            and all(split_cookie(f.cookie)[0] in ROUTE_KINDS for f in plan.del_flows)
            and all(split_cookie(c)[0] in ROUTE_KINDS for c, _mask in plan.del_cookies))


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
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)   # dpid -> groups kept one round longer
    next_change: float | None = None   # unix s when a binding in force ends (the caller plans a round then)

    @property
    def commits(self) -> list[Commit]:
        return [s for s in self.steps if isinstance(s, Commit)]


def plan_round(items: dict[str, bytes], revision: int, installed: dict[int, Installed], *,
               settle: float = 0.005, reported: dict[int, int] | None = None, cache: dict | None = None,
               hold: dict[int, set[int]] | None = None, now: float | None = None,
               lingering: dict[str, bytes] | None = None, retired: dict[int, set[int]] | None = None) -> Round:
    """One reconcile round.  ``reported``: dpid → revision already published (no report again);
    ``cache``: records parsed in earlier rounds (``FabricState.from_items``), kept by the caller;
    ``hold``: dpid → group ids to keep although no flow uses them (the datapath may still send frames
    into them: the app holds a round's ``held`` groups until a revalidation pass has followed it);
    ``now``: unix s, for the bindings' ends (``Round.next_change`` says when the next one ends);
    ``lingering``: endpoint records etcd deleted moments ago (key → last bytes; ``FabricState.lingering``);
    ``retired``: dpid → ids of groups deleted moments ago, which a new group must not take (``place_groups``)."""
    with gc_paused():  # the heap holds every installed flow: full collections mid-round cost more than the round
        return _plan_round(items, revision, installed, settle, reported or {}, cache, hold or {}, now, lingering,
                           retired or {})


def _plan_round(items: dict[str, bytes], revision: int, installed: dict[int, Installed], settle: float,
                reported: dict[int, int], cache: dict | None, hold: dict[int, set[int]], now: float | None,
                lingering: dict[str, bytes] | None = None, retired: dict[int, set[int]] | None = None) -> Round:
    out = Round(revision)
    try:
        st = FabricState.from_items(items, cache, lingering)
        dpids = sorted(st.switches)
        links = [(lk.dpid, lk.port, lk.peer_dpid, lk.peer_port) for lk in st.links]
        hops = next_hops(dpids, links)
        out.configs = compile_fabric(st, hops=hops, now=now)
        ends = [st.bindings[mac].until for mac in live_bindings(st, now)]
        out.next_change = min(ends) if ends else None
        out.problems = list(st.problems)
        dests = route_destinations(st)
        dist = distances(dpids, hops, links)
    except Exception as exc:  # a record the parser let through but the compiler cannot use
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def dest_of(cookie: int):
        kind, sid, lo, _ = split_cookie(cookie)
        return dests.get((sid, lo)) if kind == Kind.VID_ROUTE else None

    plans = {}
    for dpid in sorted(installed):
        if dpid not in out.configs:
            continue
        want, kept = place_groups(out.configs[dpid], *installed[dpid], hold=hold.get(dpid, ()),
                                  avoid=(retired or {}).get(dpid, ()))
        out.configs[dpid] = want
        if kept:
            out.held[dpid] = kept
        plans[dpid] = diff(want, *installed[dpid])
    order = [dpid for dpid in update_order(plans, dest_of, dist) if plans[dpid]]
    for i, dpid in enumerate(order):
        plan = plans[dpid]
        out.steps.append(Commit(dpid, plan, out.configs[dpid]))
        if i + 1 == len(order):
            continue
        if settle > 0 and any(dest_of(f.cookie) is not None and _hop_by_hop(f, out.configs[dpid])
                              for f in plan.add_flows):
            out.steps.append(Pause(settle))
        elif not routes_only(plan):
            out.steps.append(Barrier())
    for dpid in sorted(plans):
        if reported.get(dpid, -1) < revision:
            want = out.configs[dpid]
            out.reports.append(Report(dpid, revision, len(want.flows), len(want.groups)))
    return out


def _group_refs(flows: dict) -> dict:
    """flow key -> the group id its actions use, for the flows that use one."""
    out = {}
    for key, f in flows.items():
        for a in f.actions:
            if a[0] == "group":
                out[key] = a[1]
                break
    return out


def place_groups(want: SwitchConfig, flows: dict, groups: dict, hold=(),
                 avoid=()) -> tuple[SwitchConfig, tuple[int, ...]]:
    """``want`` with stable group ids and the groups that must outlive their flows by a round; and those.

    ``flows``/``groups``: what the switch holds; ``avoid``: ids a new group must not take (groups deleted
    moments ago: the datapath may still hold recirculation state made for the old group under that id, and
    flows it turned into drops while the id was free, which a new group under it would meet: 1-2 frames lost
    when helpers came back at once after going).  Pure; ``want`` is not modified (a new config if needed).
    Costs one pass over the flows of a switch that holds or wants groups, nothing for the others.
    """
    if not want.groups and not groups:
        return want, ()
    have_ref = _group_refs(flows) if groups else {}
    if want.groups:
        want_ref = _group_refs(want.flows)
        users: dict[int, list] = {}
        for key, gid in want_ref.items():
            users.setdefault(gid, []).append(key)
        mapping: dict[int, int] = {}
        taken: set[int] = set()
        for gid in sorted(want.groups):   # the id the same flows use on the switch now, if the kind matches
            for h in sorted({have_ref[k] for k in users.get(gid, ()) if k in have_ref}):
                if h not in taken and h in groups and groups[h].type == want.groups[gid].type:
                    mapping[gid] = h
                    taken.add(h)
                    break
        fresh = (i for i in itertools.count(GROUP_BASE) if i not in groups and i not in taken and i not in avoid)
        for gid in sorted(want.groups):   # new groups: ids the switch does not hold (a held one may linger)
            if gid not in mapping:
                mapping[gid] = next(fresh)
                taken.add(mapping[gid])
        if any(k != v for k, v in mapping.items()):
            flows_new = dict(want.flows)
            for key, gid in want_ref.items():
                f = flows_new[key]
                flows_new[key] = replace(f, actions=tuple(("group", mapping[a[1]]) if a[0] == "group" else a
                                                          for a in f.actions))
            want = SwitchConfig(want.dpid, flows_new,
                                {mapping[g]: replace(spec, group_id=mapping[g]) for g, spec in want.groups.items()})
    used_now = set(have_ref.values())
    kept = tuple(sorted(g for g in groups if g not in want.groups and (g in used_now or g in hold)))
    if kept:
        want = SwitchConfig(want.dpid, want.flows, {**want.groups, **{g: groups[g] for g in kept}})
    return want, kept


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
