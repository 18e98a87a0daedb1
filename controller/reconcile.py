"""Diff what a switch should hold against what it holds: pure, testable without a switch."""

from __future__ import annotations

from dataclasses import dataclass, field

from vfab.fabric.flows import FlowSpec, GroupSpec, SwitchConfig, gc_paused

ALL_ONES = (1 << 64) - 1
KIND_MASK = 0xFF << 56              # cookie bits 63..56: kind
SERVICE_MASK = 0xFFFFFF << 40       # kind + service id


@dataclass
class Plan:
    add_groups: list[GroupSpec] = field(default_factory=list)
    mod_groups: list[GroupSpec] = field(default_factory=list)
    del_groups: list[int] = field(default_factory=list)
    add_flows: list[FlowSpec] = field(default_factory=list)   # new or changed (ADD replaces)
    del_flows: list[FlowSpec] = field(default_factory=list)   # stale, one DELETE_STRICT each
    # Stale flows deleted wholesale: (cookie, mask) → how many known flows it removes (DELETE, all tables).
    del_cookies: dict[tuple[int, int], int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.add_groups or self.mod_groups or self.del_groups or self.add_flows or self.del_flows
                    or self.del_cookies)

    @property
    def removed(self) -> int:
        """Flows this plan removes (strict deletes plus what the cookie deletes cover)."""
        return len(self.del_flows) + sum(self.del_cookies.values())

    def summary(self) -> str:
        by_cookie = f" ({len(self.del_cookies)} cookie deletes)" if self.del_cookies else ""
        return (f"+{len(self.add_flows)} -{self.removed} flows{by_cookie}, +{len(self.add_groups)} "
                f"~{len(self.mod_groups)} -{len(self.del_groups)} groups")


def diff(want: SwitchConfig, flows: dict, groups: dict, by_cookie: bool = True) -> Plan:
    """``flows``: key -> FlowSpec installed; ``groups``: id -> GroupSpec installed.

    Stale flows go by cookie where no wanted flow shares it: the coarsest of kind,
    kind+service, or the exact cookie (a range's cookie names its service, lo and
    epoch, so a removed or re-routed range is one message however many blocks it
    had).  That is safe inside one atomic, ordered bundle: a wanted flow the
    cookie delete also hits carries another cookie, so it is in ``add_flows``
    and is re-added after the deletes.  The rest go one DELETE_STRICT each
    (all of them with ``by_cookie=False``).
    """
    with gc_paused():
        plan = Plan()
        for gid, g in sorted(want.groups.items()):
            have = groups.get(gid)
            if have is None:
                plan.add_groups.append(g)
            elif have != g:
                plan.mod_groups.append(g)
        wanted = want.flows
        for key, f in wanted.items():
            have = flows.get(key)
            if have is None or have.actions != f.actions or have.cookie != f.cookie:
                plan.add_flows.append(f)
        stale = [f for key, f in flows.items() if key not in wanted]
        if stale and not by_cookie:
            plan.del_flows = stale
        elif stale:
            cookies = {f.cookie for f in wanted.values()}
            kinds = {c & KIND_MASK for c in cookies}
            services = {c & SERVICE_MASK for c in cookies}
            by_cookie = plan.del_cookies
            for f in stale:
                c = f.cookie
                if c & KIND_MASK not in kinds:
                    sel = (c & KIND_MASK, KIND_MASK)
                elif c & SERVICE_MASK not in services:
                    sel = (c & SERVICE_MASK, SERVICE_MASK)
                elif c not in cookies:
                    sel = (c, ALL_ONES)
                else:
                    plan.del_flows.append(f)
                    continue
                by_cookie[sel] = by_cookie.get(sel, 0) + 1
        plan.del_groups = sorted(gid for gid in groups if gid not in want.groups)
        plan.add_flows.sort(key=lambda f: f.key)
        plan.del_flows.sort(key=lambda f: f.key)
        plan.del_cookies = dict(sorted(plan.del_cookies.items()))
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
