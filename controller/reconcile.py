"""Diff what a switch should hold against what it holds: pure, testable without a switch."""

from __future__ import annotations

from dataclasses import dataclass, field

from vfab.fabric.flows import FlowSpec, GroupSpec, SwitchConfig


@dataclass
class Plan:
    add_groups: list[GroupSpec] = field(default_factory=list)
    mod_groups: list[GroupSpec] = field(default_factory=list)
    del_groups: list[int] = field(default_factory=list)
    add_flows: list[FlowSpec] = field(default_factory=list)   # new or changed (ADD replaces)
    del_flows: list[FlowSpec] = field(default_factory=list)   # stale (DELETE_STRICT)

    def __bool__(self) -> bool:
        return bool(self.add_groups or self.mod_groups or self.del_groups or self.add_flows or self.del_flows)

    def summary(self) -> str:
        return (f"+{len(self.add_flows)} -{len(self.del_flows)} flows, +{len(self.add_groups)} "
                f"~{len(self.mod_groups)} -{len(self.del_groups)} groups")


def diff(want: SwitchConfig, flows: dict, groups: dict) -> Plan:
    """``flows``: key -> FlowSpec installed; ``groups``: id -> GroupSpec installed."""
    plan = Plan()
    for gid, g in sorted(want.groups.items()):
        have = groups.get(gid)
        if have is None:
            plan.add_groups.append(g)
        elif have != g:
            plan.mod_groups.append(g)
    for key, f in want.flows.items():
        have = flows.get(key)
        if have is None or have.actions != f.actions or have.cookie != f.cookie:
            plan.add_flows.append(f)
    plan.del_flows = [f for key, f in flows.items() if key not in want.flows]
    plan.del_groups = sorted(gid for gid in groups if gid not in want.groups)
    plan.add_flows.sort(key=lambda f: f.key)
    plan.del_flows.sort(key=lambda f: f.key)
    return plan


def update_order(plans: dict[int, Plan], dest_of, dist: dict[tuple[int, int], int]) -> list[int]:
    """Order in which to commit per-switch plans so a moved range loses no packet in transit.

    Each switch's bundle is atomic, but the fabric as a whole is not: if the
    ingress switch turned towards the new owner before the switches on the new
    path did, frames would bounce into stale routes.  So switches are committed
    nearest-to-the-new-destination first (``dest_of(cookie)`` gives the dpid a
    changed VID route now leads to); switches with no route change go first.
    """
    def rank(dpid: int) -> tuple[int, int]:
        near = [dist.get((dpid, d), 1 << 16) for d in
                (dest_of(f.cookie) for f in plans[dpid].add_flows) if d is not None]
        return (min(near) if near else -1, dpid)

    return sorted(plans, key=rank)
