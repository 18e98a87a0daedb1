"""The balancer's policy (DESIGN.md §4): burst → helpers on, calm → helpers off, sustained load → split,
idle → merge.  Pure: no I/O, no clock — ``Balancer.decide(now, observations)`` returns decisions.

The runner (``controller/balancer_run.py``) gathers the observations (switch counters and endpoint load
reports from etcd, memcached ``stats``, sdhcp shards' STATS, helpers' stats files), calls ``decide``
once per period and applies what comes back the way an operator would.  Keeping the policy pure lets
the tests drive it through hours of made-up load in milliseconds, and lets anyone read off *why* it
acted: every decision carries its reason and the numbers behind it.

**When helpers go on (PostMan, paper 000 §5.3).**  PostMan enables helpers when the helpee's latency
passes its SLA (p99 > 500 µs) and disables them when its load is low again.  We cannot measure a
client's p99 from the controller, so we *predict* it from what the helpee tells us, with paper 001's
bottleneck decomposition: the tail latency is the tail queueing time of the bottleneck stage plus the
sum of the service times (its Formula 1).  The bottleneck here is the helpee's CPU:

* service time ``S`` = CPU seconds per request (memcached: rusage delta / requests delta),
* utilisation ``ρ`` = CPU seconds per second / cores,
* tail queueing time of a G/G/1 stage by the exponential approximation the paper uses (its Formula 6,
  after Abate, Choudhury and Whitt): ``P(W > t) ≈ ρ·exp(−ρt/E[W])`` with Kingman's
  ``E[W] = S·ρ/(1−ρ)·(ca²+cs²)/2``, so ``W_p = E[W]/ρ · ln(ρ/(1−p))`` (0 when ``ρ ≤ 1−p``; ``∞`` at
  ``ρ ≥ 1``, where a burst's queue only grows: the paper's linear-in-burst-length regime),
* predicted p99 = ``base_us + S + W_99``.

``ca²``/``cs²`` default to 1 and 0 (Poisson-ish arrivals, the paper's deterministic service).  Helpers go
on when the predicted p99 stays above ``p99_on_us`` for ``burst_window`` s.  The model then picks *how
many* ranges to hand to helpers: the hottest ranges first, until the p99 predicted with their requests
costing ``S/helper_gain`` (coalesced gets: 6–7× cheaper here, TESTBED-NOTES.md) is under ``p99_off_us``.
And it decides *off*: with helpers on, the helpee's own CPU no longer shows what it would do alone, so
the policy predicts the *direct* p99 from today's request rate and the CPU per request it measured the
last time it ran without helpers; helpers go off only when that prediction stays under ``p99_off_us``
(lower than the on threshold) for ``calm_window`` s, and not before they were on ``min_on`` s.

**Or by the helpee's request rate** (``rate_on``/``rate_off``, off by default).  The model needs a helpee
that a burst drives towards saturation.  On this testbed it does not: the largest burst Python clients
can offer through the userspace switch (12,000 gets/s) keeps memcached at rho 0.14-0.16 and the model
at 30-60 µs, *below* its calm prediction (45-80 µs: at 900 gets/s memcached spends 30-40 CPU-µs per get,
at 12,000 only 12, its wake-ups amortised), so no p99 threshold separates the two.  With ``rate_on`` set,
helpers also go on when the helpee's own request rate (``served``: memcached's ``cmd_get + cmd_set`` per
second, read every period; the switches' counters lag a revalidation pass) stays above ``rate_on`` for
``burst_window``; and off is then decided by that rate alone: below ``rate_off`` (``<= rate_on/2``)
for ``calm_window`` (the direct prediction needs the offered rate, which with helpers on only the
switches' counters give, and they lag and jump by a revalidation pass).  With helpers on, ``served`` counts the keys the helpers ask, which is the clients'
requests less the keys a batch asks once for several clients.

Which helpers: the live ones with the most spare capacity (``helper_capacity`` minus what each already
receives), enough of them to carry the helped requests with 25 % headroom (PostMan adds helper #2 when
one is not enough); bucket weights ∝ spare capacity.  A helper that drops requests (busy, out of peers
or buffers) for ``burst_window`` s makes the policy add the next helper.

**Split and merge (the virtual-servers paper's sdhcp, paper 002 §V).**  A shard whose request rate
(all its ranges) stays above ``split_rate`` — or whose key count passes ``split_keys``, the paper's
table limit — for ``split_window`` s gives the upper half of its hottest range to a spare endpoint (a
live stateful endpoint owning and mirroring nothing).  Two *adjacent* ranges (``a.hi + 1 == b.lo``) of
two different owners, neither with helpers, same mirrors, whose requests together stay under
``merge_rate`` for ``merge_window`` s are merged: the range whose owner then owns nothing (else the one
with fewer keys, else the upper one) goes to the other owner, freeing an endpoint.  ``merge_rate ≤
split_rate/2`` is enforced, so a merged pair is at least 2× below the split threshold.

**Never flapping.**  Separate on/off thresholds; a condition counts only when it held at *every*
observation for its whole window (one sample the other way restarts the window; a missing or stale
sample restarts it too — no decisions on old data); minimum dwell times (``min_on``, ``min_off``);
a range changed by any decision (or seen with a new epoch) is left alone for ``op_dwell`` s; at most one
decision per service per ``min_interval`` s; and nothing touches a range while a state operation on it
(or on its owner) runs.

**An operator's word stands.**  A range an operator switched helpers on or off for by hand (``vfab helpers
on|off``, which holds it: ``RangeObs.held``) keeps its helpers as set, in a burst or in calm, until ``vfab
helpers auto`` hands it back; its owner's other ranges are still balanced.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ACTIONS = ("helpers_on", "helpers_off", "split", "merge")


class BalancerConfigError(ValueError):
    """A balancer setting that cannot be used."""


@dataclass(frozen=True)
class BalancerConfig:
    period: float = 1.0               # s between observations while a condition is timed (else etcd_every); a
                                      # new usage report starts one at once
    etcd_every: float = 0.25          # s between reads of the range map, endpoints, operations and load reports
                                      # (and status writes); each period when the period is longer
    stale_after: float = 5.0          # s: observations older than this count as missing
    min_interval: float = 2.0         # s between two decisions of one service (rate limit)
    op_dwell: float = 10.0            # s a range is left alone after it changed (split, merge, helpers, new epoch)
    retry_after: float = 30.0         # s before the same decision on the same ranges is made again (if the
                                      # first was not applied: the map did not change)
    # helpers (PostMan)
    p99_on_us: float = 500.0          # predicted p99 above this (sustained) → helpers on (PostMan's SLA)
    p99_off_us: float = 250.0         # predicted direct p99 below this (sustained) → helpers off
    percentile: float = 0.99
    scv_arrival: float = 1.0          # ca²: squared coefficient of variation of inter-arrival times
    scv_service: float = 0.0          # cs²: of service times (0 = deterministic, paper 001's assumption)
    base_us: float = 50.0             # the constant part of the latency (stacks, fabric, client)
    helper_gain: float = 6.0          # helpee CPU per request direct / through helpers (6-7x measured here)
    rate_on: float = 0.0              # helpee requests/s above which (sustained) helpers go on too; 0 = model only
    rate_off: float = 0.0             # with rate_on: helpee requests/s below which (sustained) they may go off
    helper_capacity: float = 400000.0  # requests/s one helper carries
    max_helpers: int = 4
    burst_window: float = 2.0         # s the burst must last before helpers go on
    calm_window: float = 5.0          # s the calm must last before helpers go off
    min_on: float = 10.0              # s helpers stay on at least
    min_off: float = 5.0              # s helpers stay off at least, once turned off
    # split / merge (stateful services)
    split_rate: float = 1000.0        # requests/s of one shard above which it splits
    split_keys: int = 0               # keys of one shard above which it splits (0 = no key limit)
    merge_rate: float = 200.0         # two neighbours below this together merge
    split_window: float = 5.0
    merge_window: float = 10.0
    min_split_width: int = 256        # never split a range of fewer keys
    split_median: int = 0             # 1: split at the median key of the range's records (its owner's load report:
                                      # half its clients go), not at the middle of the range; 0: the middle

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want = int if f.type == "int" else (int, float)
            if not isinstance(value, want) or isinstance(value, bool):
                kind = "an integer" if f.type == "int" else "a number"
                raise BalancerConfigError(f"balancer setting {f.name!r} must be {kind}, got {value!r}")

        def within(name: str, lo: float, hi: float, unit: str = "") -> None:
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise BalancerConfigError(f"balancer setting {name} = {v}{unit} is out of range: {lo}..{hi}{unit}")

        within("period", 0.01, 60, " s")
        within("etcd_every", 0.01, 60, " s")
        for name in ("stale_after", "min_interval", "op_dwell", "retry_after", "burst_window", "calm_window", "min_on", "min_off",
                     "split_window", "merge_window"):
            within(name, 0, 3600, " s")
        if self.stale_after < self.period:
            raise BalancerConfigError(f"stale_after ({self.stale_after} s) is shorter than the period "
                                      f"({self.period} s): every observation would be stale; make it >= period")
        within("percentile", 0.5, 0.9999)
        within("scv_arrival", 0, 100)
        within("scv_service", 0, 100)
        within("base_us", 0, 1e7, " µs")
        within("p99_on_us", 1, 1e8, " µs")
        within("p99_off_us", 1, 1e8, " µs")
        if self.p99_off_us >= self.p99_on_us:
            raise BalancerConfigError(f"p99_off_us ({self.p99_off_us}) must be below p99_on_us ({self.p99_on_us}): "
                                      "the gap is the hysteresis that keeps helpers from flapping; e.g. half of it")
        within("rate_on", 0, 1e9, " requests/s")
        within("rate_off", 0, 1e9, " requests/s")
        if self.rate_on > 0 and not 0 < self.rate_off * 2 <= self.rate_on:
            raise BalancerConfigError(f"rate_off ({self.rate_off}/s) must be above 0 and at most half of rate_on "
                                      f"({self.rate_on}/s): the gap is the hysteresis; e.g. rate_off = "
                                      f"{self.rate_on / 3:g}")
        within("helper_gain", 1, 1000)
        within("helper_capacity", 1, 1e9, " requests/s")
        within("max_helpers", 1, 64)
        within("split_rate", 0.001, 1e9, " requests/s")
        within("merge_rate", 0, 1e9, " requests/s")
        if self.merge_rate * 2 > self.split_rate:
            raise BalancerConfigError(f"merge_rate ({self.merge_rate}/s) must be at most half of split_rate "
                                      f"({self.split_rate}/s), or a merged pair could split again at once; "
                                      f"lower merge_rate to <= {self.split_rate / 2:g}")
        within("split_keys", 0, 1 << 40)
        within("min_split_width", 2, 1 << 23, " keys")
        within("split_median", 0, 1)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "balancer config") -> "BalancerConfig":
        if not isinstance(data, dict):
            raise BalancerConfigError(f"{where} must be a JSON object of settings, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise BalancerConfigError(f"{where} has unknown settings {unknown}: known settings are {known}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, where: str = "balancer config") -> "BalancerConfig":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise BalancerConfigError(f"{where} is not JSON: {exc}") from None
        return cls.from_dict(data, where)

    def to_dict(self) -> dict:
        return asdict(self)


# -- observations ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RangeObs:
    """One range of the map with what is known of its traffic (None = not known this round)."""

    lo: int
    hi: int
    owner: str
    epoch: int = 0
    helpers: tuple = ()
    mirrors: tuple = ()
    state: str = "active"
    rate: float | None = None   # requests/s (the owner's load report, else packets/s at the switches)
    keys: int | None = None
    busy: bool = False          # a state operation on it (or by its owner) is running
    median: int | None = None   # the key below which half of its records lie (the owner's load report)
    held: bool = False          # an operator set its helpers by hand ('vfab helpers on|off'): never touched here

    @property
    def width(self) -> int:
        return self.hi - self.lo + 1


@dataclass(frozen=True)
class EndpointObs:
    """An endpoint's own load: CPU seconds per second and requests/s it served (None = unknown)."""

    name: str
    cpu: float | None = None
    served: float | None = None
    cores: float = 1.0


@dataclass(frozen=True)
class HelperObs:
    name: str
    rate: float | None = None    # requests/s it receives
    drops: float = 0.0           # requests/s it drops for want of room (busy, peers, buffers)


@dataclass(frozen=True)
class ServiceObs:
    name: str
    ranges: tuple = ()                               # RangeObs, by lo
    endpoints: dict = field(default_factory=dict)    # name -> EndpointObs (owners' own load)
    helpers: dict = field(default_factory=dict)      # live helper endpoints: name -> HelperObs
    spares: tuple = ()                               # live stateful endpoints owning and mirroring nothing
    stateful: bool = False                           # split/merge possible (endpoints run the state layer)


@dataclass(frozen=True)
class Decision:
    action: str                 # one of ACTIONS
    service: str
    ranges: tuple               # ((lo, hi), ...): helpers_on/off: the ranges; split: the part given away;
                                # merge: the range given away
    reason: str
    at: float
    owner: str = ""
    helpers: tuple = ()         # helpers_on: the helper set, best first
    weights: tuple = ()         # helpers_on: bucket weights (1..100, ∝ spare capacity)
    peer: str = ""              # split: the spare taking the range; merge: the endpoint taking it
    p99_us: float | None = None  # the model's prediction behind a helpers decision

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranges"] = [list(r) for r in self.ranges]
        d["helpers"], d["weights"] = list(self.helpers), list(self.weights)
        if d["p99_us"] is not None and math.isinf(d["p99_us"]):
            d["p99_us"] = "inf"
        return d


# -- the model (paper 001) ------------------------------------------------------------------------------
def predict_p99_us(rho: float, service_us: float, cfg: BalancerConfig) -> float:
    """Predicted ``cfg.percentile`` latency in µs of a stage at utilisation ``rho`` with service time
    ``service_us`` (module docstring): ``base + S + W_p``; infinite at ``rho >= 1``."""
    if rho >= 1:
        return math.inf
    service_us = max(service_us, 0.0)
    q = 1 - cfg.percentile
    wait = 0.0
    if rho > q:
        mean_wait = service_us * rho / (1 - rho) * (cfg.scv_arrival + cfg.scv_service) / 2
        wait = mean_wait / rho * math.log(rho / q)
    return cfg.base_us + service_us + wait


def _window(since: dict, key, cond: bool | None, now: float) -> float:
    """How long ``cond`` has held at every observation: 0 at the first observation where it holds, -1 when it does
    not hold now (None restarts too), so ``held >= window`` is false then even for a window of 0."""
    if not cond:
        since.pop(key, None)
        return -1.0
    start = since.setdefault(key, now)
    return now - start


@dataclass
class _Owner:
    direct_s: float | None = None   # CPU s per request measured without helpers (EWMA)
    on_at: float = -math.inf
    off_at: float = -math.inf


class Balancer:
    """The policy with its memory (windows, dwell times, what it measured).  One per runner."""

    def __init__(self, cfg: BalancerConfig | None = None):
        self.cfg = cfg or BalancerConfig()
        self.since: dict = {}             # (what, key) -> when the condition started holding
        self.owners: dict[tuple, _Owner] = {}
        self.seen: dict[tuple, float] = {}        # (service, lo, hi, epoch) -> first seen
        self.last_decision: dict[str, float] = {}
        self.recent: dict[tuple, tuple] = {}      # (service, action, ranges) -> (when decided, the map then)
        self.view: dict[str, dict] = {}   # service -> per owner: what the model saw (for the status record)

    # -- helpers -------------------------------------------------------------------------------------
    def _owner(self, service: str, name: str) -> _Owner:
        return self.owners.setdefault((service, name), _Owner())

    def _settled(self, svc: str, r: RangeObs, now: float) -> bool:
        first = self.seen.get((svc, r.lo, r.hi, r.epoch), now)
        return now - first >= self.cfg.op_dwell and not r.busy and r.state == "active"

    def timing(self) -> bool:
        """Some condition is being timed (a burst, a calm, a load to split or merge on): the runner observes every
        period then; otherwise nothing can come of a round but what a new report brings."""
        return bool(self.since)

    def decide(self, now: float, observations: list[ServiceObs]) -> list[Decision]:
        """At most one decision per service; call once per period with fresh observations."""
        out = []
        for obs in observations:
            for r in obs.ranges:
                self.seen.setdefault((obs.name, r.lo, r.hi, r.epoch), now)
            d = self._decide_service(now, obs)
            if d is not None:
                out.append(d)
                self.last_decision[obs.name] = now
        live = {(o.name, r.lo, r.hi, r.epoch) for o in observations for r in o.ranges}
        names = {o.name for o in observations}
        self.seen = {k: v for k, v in self.seen.items() if k in live or k[0] not in names}
        return out

    def _decide_service(self, now: float, obs: ServiceObs) -> Decision | None:
        cfg = self.cfg
        by_owner: dict[str, list[RangeObs]] = {}
        for r in obs.ranges:
            if r.owner:
                by_owner.setdefault(r.owner, []).append(r)
        candidates: list[Decision] = []
        view = {}
        for owner, ranges in sorted(by_owner.items()):
            d, seen = self._helpers(now, obs, owner, ranges)
            view[owner] = seen
            if d is not None:
                candidates.append(d)
        self.view[obs.name] = view
        if obs.stateful:
            for owner, ranges in sorted(by_owner.items()):
                d = self._split(now, obs, owner, ranges)
                if d is not None:
                    candidates.append(d)
            d = self._merge(now, obs, by_owner)
            if d is not None:
                candidates.append(d)
        sig = _signature(obs)
        candidates = [d for d in candidates if not self._repeat(now, d, sig)]
        if not candidates:
            return None
        if now - self.last_decision.get(obs.name, -math.inf) < cfg.min_interval:
            return None   # rate limit: the conditions keep holding and are acted on at the next chance
        best = min(candidates, key=lambda d: ACTIONS.index(d.action))
        self._commit(now, obs, best)
        return best

    def _commit(self, now: float, obs: ServiceObs, d: Decision) -> None:
        """Remember what a decision changes: dwell clocks restart, windows of what it touched restart."""
        self.recent = {k: v for k, v in self.recent.items() if now - v[0] < self.cfg.retry_after}
        self.recent[(d.service, d.action, d.ranges)] = (now, _signature(obs))
        if d.action == "helpers_on":
            self._owner(obs.name, d.owner).on_at = now
        elif d.action == "helpers_off":
            self._owner(obs.name, d.owner).off_at = now
        touched = {d.owner, d.peer} - {""}
        for key in list(self.since):
            if key[1] == obs.name and touched & set(key[2:]):
                self.since.pop(key, None)

    def _repeat(self, now: float, d: Decision, sig: tuple) -> bool:
        """The same decision was made less than ``retry_after`` s ago and the map has not changed since
        (it was not applied, or not yet): do not ask again."""
        got = self.recent.get((d.service, d.action, d.ranges))
        return got is not None and now - got[0] < self.cfg.retry_after and got[1] == sig

    # -- helpers on/off -------------------------------------------------------------------------------
    def _helpers(self, now: float, obs: ServiceObs, owner: str, ranges: list[RangeObs]):
        cfg = self.cfg
        ep = obs.endpoints.get(owner)
        st = self._owner(obs.name, owner)
        helped = [r for r in ranges if r.helpers]
        seen: dict = {"helped": len(helped)}
        if ep is None or ep.cpu is None or ep.served is None:
            _window(self.since, ("hot", obs.name, owner), None, now)
            _window(self.since, ("calm", obs.name, owner), None, now)
            return None, seen
        cores = max(ep.cores, 1e-9)
        per_req = ep.cpu / ep.served if ep.served > 0 else None
        if not helped and per_req is not None:
            st.direct_s = per_req if st.direct_s is None else 0.7 * st.direct_s + 0.3 * per_req
        s_us = (per_req or st.direct_s or 0.0) * 1e6
        # offered load: what the switches count towards its ranges (a saturated helpee serves less than it
        # is sent, and its CPU cannot pass its cores); what it served if the switches' numbers are missing
        rates = [r.rate for r in ranges]
        lam = sum(rates) if None not in rates else ep.served
        lam = max(lam, ep.served)
        rho = max(ep.cpu / cores, lam * (per_req or 0.0) / cores)
        p99 = predict_p99_us(rho, s_us, cfg)
        seen.update(rho=round(rho, 4), service_us=round(s_us, 2), p99_us=p99, rate=lam)
        # direct prediction: today's requests at the CPU per request measured without helpers
        direct_s = st.direct_s if st.direct_s is not None else per_req
        rho_direct = lam * direct_s / cores if direct_s is not None else rho
        p99_direct = predict_p99_us(rho_direct, (direct_s or 0.0) * 1e6, cfg)
        seen["p99_direct_us"] = p99_direct
        seen["served"] = round(ep.served, 1)
        by_rate = cfg.rate_on > 0 and ep.served > cfg.rate_on
        hot = _window(self.since, ("hot", obs.name, owner), p99 > cfg.p99_on_us or by_rate, now)
        # with rate_on, calm is the helpee's own rate alone: the direct prediction needs the offered rate, and with
        # helpers on that comes from the switches' counters, which lag and jump by a revalidation pass (measured
        # here: 12,000 requests/s read as 28,000 every other second), enough to keep "calm" from ever holding
        calm_now = ep.served < cfg.rate_off if cfg.rate_on > 0 else p99_direct < cfg.p99_off_us
        calm = _window(self.since, ("calm", obs.name, owner), bool(helped) and calm_now, now)
        live = obs.helpers
        # off: the whole owner at once, once calm long enough and on long enough
        if helped and calm >= cfg.calm_window and now - st.on_at >= cfg.min_on:
            todo = [r for r in helped if not r.busy and not r.held and r.state == "active"]
            if todo:
                if cfg.rate_on > 0:
                    why = (f"{ep.served:.0f} requests/s < {cfg.rate_off:g} for {calm:.1f} s (predicted direct "
                           f"p{cfg.percentile * 100:g} {_us(p99_direct)})")
                else:
                    why = (f"predicted direct p{cfg.percentile * 100:g} {_us(p99_direct)} < {cfg.p99_off_us:g} µs "
                           f"for {calm:.1f} s (rho alone {rho_direct:.2f})")
                return Decision("helpers_off", obs.name, tuple((r.lo, r.hi) for r in todo), why,
                                now, owner=owner, p99_us=p99_direct), seen
        # more helpers: the ones in use drop requests
        in_use = sorted({h for r in helped for h in r.helpers})
        dropping = bool(in_use) and any(live.get(h) is not None and live[h].drops > 0 for h in in_use)
        grow = _window(self.since, ("grow", obs.name, owner), dropping, now)
        if grow >= cfg.burst_window and len(in_use) < min(cfg.max_helpers, len(live)):
            want = len(in_use) + 1
            names, weights = self._pick(live, want, prefer=in_use)
            todo = [r for r in helped if not r.busy and not r.held and r.state == "active"]
            if todo and set(names) != set(in_use):
                return Decision("helpers_on", obs.name, tuple((r.lo, r.hi) for r in todo),
                                f"helpers {','.join(in_use)} drop requests for {grow:.1f} s: adding one",
                                now, owner=owner, helpers=names, weights=weights, p99_us=p99), seen
        # on: hot long enough, not within min_off of the last off
        if hot < cfg.burst_window or now - st.off_at < cfg.min_off or not live:
            return None, seen
        plain = [r for r in ranges if not r.helpers and not r.busy and not r.held and r.state == "active"]
        if not plain:
            return None, seen
        chosen = self._choose_ranges(plain, lam, cores, direct_s or per_req or 0.0, helped)
        # the chosen ranges' requests; scaled up when the switches' counters (which lag a revalidation pass) count
        # fewer requests than the helpee itself serves, as at a burst's onset
        known = sum(r.rate or 0.0 for r in ranges)
        lam_h = sum(r.rate or 0.0 for r in chosen) * (lam / known if 0 < known < lam else 1.0)
        if lam_h <= 0:
            lam_h = lam * len(chosen) / max(len(ranges), 1)
        need = max(1, min(cfg.max_helpers, math.ceil(lam_h * 1.25 / cfg.helper_capacity)))
        names, weights = self._pick(live, need, prefer=in_use)
        why = (f"predicted p{cfg.percentile * 100:g} {_us(p99)} > {cfg.p99_on_us:g} µs" if p99 > cfg.p99_on_us else
               f"{ep.served:.0f} requests/s > {cfg.rate_on:g} (predicted p{cfg.percentile * 100:g} {_us(p99)})")
        return Decision("helpers_on", obs.name, tuple((r.lo, r.hi) for r in chosen),
                        f"{why} for {hot:.1f} s (rho {rho:.2f}, {s_us:.1f} µs/request, {lam:.0f} requests/s); "
                        f"{len(names)} helper(s) for {lam_h:.0f} requests/s at {cfg.helper_capacity:g} each",
                        now, owner=owner, helpers=names, weights=weights, p99_us=p99), seen

    def _choose_ranges(self, plain: list[RangeObs], lam: float, cores: float, direct_s: float,
                       helped: list[RangeObs]) -> list[RangeObs]:
        """Hottest ranges first, until the p99 predicted with them behind helpers is under p99_off_us."""
        cfg = self.cfg
        if any(r.rate is None for r in plain):
            return plain   # no per-range rates: every range
        lam_direct = max(lam - sum(r.rate or 0.0 for r in helped), 0.0)
        lam_helped = sum(r.rate or 0.0 for r in helped)
        chosen: list[RangeObs] = []
        for r in sorted(plain, key=lambda r: (-(r.rate or 0.0), r.lo)):
            chosen.append(r)
            lam_h = lam_helped + sum(x.rate or 0.0 for x in chosen)
            rho = (max(lam_direct - (lam_h - lam_helped), 0.0) + lam_h / cfg.helper_gain) * direct_s / cores
            if predict_p99_us(rho, direct_s * 1e6, cfg) < cfg.p99_off_us:
                break
        return sorted(chosen, key=lambda r: r.lo)

    def _pick(self, live: dict, want: int, prefer: list) -> tuple[tuple, tuple]:
        """``want`` helpers, those in use first, then by spare capacity; weights ∝ spare capacity."""
        cap = self.cfg.helper_capacity

        def spare(name: str) -> float:
            rate = live[name].rate
            return max(cap - (rate or 0.0), cap * 0.01)
        order = sorted(live, key=lambda n: (n not in prefer, live[n].drops > 0, -spare(n), n))
        names = tuple(order[:max(1, min(want, len(order)))])
        top = max(spare(n) for n in names)
        return names, tuple(max(1, round(100 * spare(n) / top)) for n in names)

    # -- split / merge --------------------------------------------------------------------------------
    def _split(self, now: float, obs: ServiceObs, owner: str, ranges: list[RangeObs]) -> Decision | None:
        cfg = self.cfg
        rates = [r.rate for r in ranges]
        known = None not in rates
        rate = sum(rates) if known else None
        keys = [r.keys for r in ranges]
        nkeys = sum(keys) if None not in keys else None
        over_rate = known and rate > cfg.split_rate
        over_keys = cfg.split_keys > 0 and nkeys is not None and nkeys > cfg.split_keys
        cond = (over_rate or over_keys) if known else (True if over_keys else None)
        held = _window(self.since, ("split", obs.name, owner), cond, now)
        if held < cfg.split_window or not obs.spares:
            return None
        if any(r.busy for r in ranges):
            return None
        cands = [r for r in ranges if self._settled(obs.name, r, now) and not r.helpers and not r.mirrors
                 and r.width >= max(cfg.min_split_width, 2)]
        if not cands:
            return None
        hot = max(cands, key=lambda r: (r.rate or 0.0, r.keys or 0, r.width, -r.lo))
        mid, part = hot.lo + hot.width // 2, "upper half"
        if cfg.split_median and hot.median is not None and hot.lo < hot.median <= hot.hi:
            mid, part = hot.median, f"part from its median record key {hot.median:#08x}"
        why = (f"{rate:.0f} requests/s > {cfg.split_rate:g}" if over_rate else f"{nkeys} keys > {cfg.split_keys}")
        return Decision("split", obs.name, ((mid, hot.hi),),
                        f"{owner}: {why} for {held:.1f} s; {part} of {hot.lo:#08x}-{hot.hi:#08x} to spare "
                        f"{obs.spares[0]}", now, owner=owner, peer=obs.spares[0])

    def _merge(self, now: float, obs: ServiceObs, by_owner: dict) -> Decision | None:
        cfg = self.cfg
        rs = list(obs.ranges)
        best = None
        for a, b in zip(rs, rs[1:]):
            if a.hi + 1 != b.lo or not a.owner or not b.owner or a.owner == b.owner:
                continue
            key = ("merge", obs.name, a.lo, b.lo, a.owner, b.owner)
            ok = (a.rate is not None and b.rate is not None) or None
            if ok:
                ok = a.rate + b.rate < cfg.merge_rate and not a.helpers and not b.helpers \
                    and tuple(a.mirrors) == tuple(b.mirrors)
                if cfg.split_keys and a.keys is not None and b.keys is not None:
                    ok = ok and a.keys + b.keys <= cfg.split_keys // 2
            held = _window(self.since, key, ok, now)
            if held < cfg.merge_window or best is not None:
                continue
            owners_busy = any(r.busy for r in by_owner.get(a.owner, []) + by_owner.get(b.owner, []))
            if owners_busy or not (self._settled(obs.name, a, now) and self._settled(obs.name, b, now)):
                continue
            only_a, only_b = len(by_owner[a.owner]) == 1, len(by_owner[b.owner]) == 1
            if only_b != only_a:
                give, into = (b, a) if only_b else (a, b)
            elif a.keys is not None and b.keys is not None and a.keys != b.keys:
                give, into = (a, b) if a.keys < b.keys else (b, a)
            else:
                give, into = b, a
            best = Decision("merge", obs.name, ((give.lo, give.hi),),
                            f"{a.lo:#08x}-{a.hi:#08x} ({a.owner}) and {b.lo:#08x}-{b.hi:#08x} ({b.owner}): "
                            f"{a.rate + b.rate:.1f} requests/s together < {cfg.merge_rate:g} for {held:.1f} s",
                            now, owner=give.owner, peer=into.owner)
        return best


def _signature(obs: ServiceObs) -> tuple:
    return tuple((r.lo, r.hi, r.owner, r.epoch, tuple(r.helpers), tuple(r.mirrors)) for r in obs.ranges)


def _us(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.0f} µs"
