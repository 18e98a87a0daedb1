"""The balancer's runner: observations from etcd, ``Balancer.decide`` (pure), decisions written to etcd, fenced.

Why a process of its own (``vfab balancer run``) and not a thread of the os-ken controller: the
controller holds nothing etcd does not and must reconcile at once after a restart; the balancer has
memory (windows, dwell times, the helpee's CPU per request without helpers) and does slow, blocking
things (follows state operations for seconds).  Kept apart, neither can delay the other's work, either
can be restarted alone, and the balancer is what DESIGN.md §4 says it is: one more operator writing etcd.
Its code lives in ``controller/`` beside the policy (DESIGN.md §1).

**It reads etcd only** (issue 45, 5; DESIGN.md §8): no socket to memcached, no file, no network namespace,
so it runs on any host of the fabric.  Per service:

* **ranges**, **operations** running (their ranges, and every range of their source and peer, are busy),
  **endpoints** (stateful ones owning and mirroring nothing are the spares a split can take), operators'
  **holds**: read every ``etcd_every`` s;
* **requests/s per range**: the owner's load report (``/vfab/v1/load/...``), else the switches' route
  counters the controller publishes (``/vfab/v1/counters/<dpid>``, packets differenced per switch);
* **helpers**: the endpoints whose agent writes a ``HelperStatus`` (``/vfab/v1/helpers/...``: received
  datagrams → requests/s, drops, and why it does not serve when its agent withdrew it);
* **the helpee's own load**: ``Usage`` reports (``/vfab/v1/usage/<service>/<endpoint>``: CPU s/s, requests/s,
  cores) that a reporter beside memcached writes (its agent reads ``stats`` locally,
  ``services/memcached-helper/usage.py``).  Followed by a watch, so a new report reaches the policy at
  once: a report wakes the round.  Without reports a round comes every ``period`` while the policy times a
  condition (a burst, a calm), else every ``etcd_every``: an idle balancer costs little.  A report older than
  ``stale_after`` is ignored and said so in the status's problems and the log.

**One active at a time** per service (``controller/leader.py``): a runner campaigns for
``/vfab/v1/leaders/balancer/<service>``; a standby tries again every ``retry`` s and takes over when the key
goes (the active one stopped: at once; killed: its lease's TTL).  Every write of the active one — the
helpers of a range (``Registry.assign``), its status record, the record of a split or merge it is about to
ask for — carries the key's create revision as a compare in the same transaction, so an old active runner
that was paused and resumes after a successor won cannot write a decision: etcd refuses it, the runner logs
the refusal and stands by.  (Splits and merges are then asked of the owner over ZeroMQ: the fenced record is
written first, so a stale runner is stopped before it asks; one paused between that write and the request
would still send it.)

Decisions are applied the way an operator would: helpers by writing ``RangeRec.helpers`` and their bucket
weights (``RangeRec.weights``, ∝ spare capacity) in one epoch-checked, fenced transaction, splits and merges
by asking the owner over ZeroMQ exactly as ``vfab split`` / ``vfab merge`` do (``vfab.vid.state.ctl``), then
following the operation's record in a thread.  Every decision, its reason and its outcome go to
``/vfab/v1/balancer/<service>`` (``vfab balancer status``, which also shows who is active and since when).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace

from vfab.controller.balancer import (Balancer, BalancerConfig, Decision, EndpointObs, HelperObs, RangeObs,
                                      ServiceObs)
from vfab.controller import ctlmetrics
from vfab.controller.leader import Election, LeaseKeeper, whoami
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import Conflict, RegistryError, StateError, VfabError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema
from vfab.vid.state import ctl as statectl

log = logging.getLogger("vfab.balancer")
KEEP_DECISIONS = 50
HELPER_DROPS = ("drop_peers", "drop_busy", "drop_noconn", "tx_nombuf", "tx_drop")
HELPER_EVERY = 1.0   # s between a helper agent's status records (its --period): their staleness is judged on
                     # max(stale_after, 3 x this)


def helper_down(h: str, st: schema.HelperStatus, problems: list[str]) -> None:
    """A helper whose agent withdrew it (``down``: issue 43, its leg to memcached stalled, ...): the reason, in the
    balancer's problems, so its status shows why it is not used."""
    s = st.stats
    problems.append(f"helper {h} does not serve ({st.down}: {s.get('conns_down', 0):.0f} connection(s) to "
                    f"memcached down); withdrawn by its agent until it serves again")


def usage_obs(ep: str, rec: schema.Usage, now: float, stale_after: float, problems: list[str]) -> EndpointObs:
    """An endpoint's own load from its Usage report; unknown (None) when it is stale or says it failed."""
    if rec.error:
        problems.append(f"usage report of {ep}: {rec.error}")
        return EndpointObs(ep)
    if rec.stale(now, stale_after):
        problems.append(f"usage report of {ep} ({rec.source}) is {rec.age(now):.1f} s old, past stale_after "
                        f"{stale_after:g} s: ignored (its reporter stopped, or the hosts' clocks differ)")
        return EndpointObs(ep)
    return EndpointObs(ep, cpu=rec.cpu, served=rec.served, cores=rec.cores)


class Rates:
    """Rates of monotonic counters: ``rate(key, t, value)`` is (value - previous) / (t - previous t);
    None at the first sample, when time did not advance, or when the counter went back (a restart)."""

    def __init__(self) -> None:
        self.last: dict = {}

    def rate(self, key, t: float, value: float) -> float | None:
        prev = self.last.get(key)
        if prev is not None and t <= prev[0]:
            return prev[2]          # the same report again: the rate it had
        r = None
        if prev is not None and value >= prev[1]:
            r = (value - prev[1]) / (t - prev[0])
        self.last[key] = (t, value, r)
        return r


def apply_helpers(reg: Registry, service: str, lo: int, hi: int, helpers: list[str],
                  weights: dict[str, int] | None = None, fence: tuple = ()) -> int:
    """Set the helpers of range ``lo-hi`` (exactly one range of the map) and their bucket weights (name ->
    1..65535, ∝ spare capacity) in one epoch-checked transaction, with ``fence``'s compares; the etcd
    revision.  Owner, mirrors and state are kept."""
    rec = next((r for r, _ in reg.ranges(service) if (r.lo, r.hi) == (lo, hi)), None)
    if rec is None:
        raise StateError(f"{Range(lo, hi)} of {service!r} is no longer one range of the map: the map changed")
    return reg.assign(service, Range(lo, hi), rec.owner, expect_epoch=rec.epoch, mirrors=rec.mirrors,
                      helpers=list(helpers), state=rec.state,
                      weights={h: w for h, w in (weights or {}).items() if h in helpers}, fence=fence)


class NotActive(VfabError):
    """A write refused by the election's fence: another runner is the active one now."""


class Runner:
    def __init__(self, reg: Registry, services: list[str], cfg: BalancerConfig | None = None,
                 clock=time.time, ttl: int = 2, retry: float = 0.2, who: str | None = None):
        self.reg = reg
        self.services = list(services)
        self.cfg = cfg or BalancerConfig()
        self.policy = Balancer(self.cfg)
        self.clock = clock
        self.rates = Rates()
        self.decisions: dict[str, list[dict]] = {s: [] for s in self.services}
        self.pending: dict[str, set] = {s: set() for s in self.services}   # ranges of ops we started
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.runner = who or whoami()
        self.apply_helpers = apply_helpers
        # one election per service, one lease for all of them
        self.keeper = LeaseKeeper(reg, ttl)
        self.elections = {s: Election(reg, "balancer", s, self.keeper, self.runner) for s in self.services}
        self.retry = retry
        self.tried = -math.inf
        # etcd's slow part of each service's observation (when read, what), reused for cfg.etcd_every
        self.etcd_view: dict[str, tuple[float, tuple]] = {}
        self.published: dict[str, float] = {}
        # the Usage reports, kept current by a watch (follow_usage): {service: {endpoint: Usage}}
        self.usage: dict[str, dict[str, schema.Usage]] = {s: {} for s in self.services}
        self.wake = threading.Event()
        self.unusable: set[tuple[str, str]] = set()   # (service, endpoint) whose usage report is stale or failed
        self.usage_seen: dict[str, dict] = {}

    # -- the election ---------------------------------------------------------------------------------------
    def active(self) -> list[str]:
        return [s for s in self.services if self.elections[s].active]

    def campaign(self) -> None:
        """Try for the services this runner is not active for, at most every ``retry`` s."""
        if len(self.active()) == len(self.services) or time.monotonic() - self.tried < self.retry:
            return
        self.tried = time.monotonic()
        for s, el in self.elections.items():
            if not el.active:
                try:
                    if el.campaign():
                        self.etcd_view.pop(s, None)   # what the last active one changed: read afresh
                except RegistryError as exc:
                    log.warning("balancer: campaign for %s failed: %s", s, exc)

    def refused(self, service: str, what: str) -> bool:
        """A write of ``service`` failed: if the fence did it, step down and say so; True then."""
        el = self.elections[service]
        if el.still_mine():
            return False
        el.lost(f"its {what} was refused: the fence (create revision {el.revision}) no longer holds")
        return True

    # -- one round ----------------------------------------------------------------------------------------
    def tick(self) -> list[Decision]:
        now = self.clock()
        observed, problems = [], {}
        active = self.active()
        for name in active:
            probs: list[str] = []
            try:
                observed.append(self.observe(name, now, probs))
            except VfabError as exc:
                probs.append(f"observing {name}: {exc}")
            problems[name] = probs
        decisions = self.policy.decide(now, observed)
        for d in decisions:
            self.apply(d)
        decided = {d.service for d in decisions}
        for name in active:
            if name in decided or problems.get(name) or \
                    not 0 <= now - self.published.get(name, -math.inf) < self.cfg.etcd_every:
                self.publish(name, now, problems.get(name, []), next((o for o in observed if o.name == name), None))
                self.published[name] = now
        return decisions

    def run(self, stop: threading.Event, duration: float | None = None) -> None:
        end = None if duration is None else time.monotonic() + duration
        follower = threading.Thread(target=self.follow_usage, args=(stop,), name="balancer-usage", daemon=True)
        follower.start()
        try:
            while not stop.is_set() and (end is None or time.monotonic() < end):
                t0 = time.monotonic()
                try:
                    self.campaign()
                    self.tick()
                except Exception:   # a bug in one round must not stop balancing for good
                    log.exception("balancer round failed")
                # the next round: at the next usage report of an active service, or after the period while the
                # policy times a condition (else after etcd_every: nothing but a report could change its mind)
                with self.lock:
                    busy = any(self.pending.values())
                every = self.cfg.period if self.policy.timing() or busy else max(self.cfg.period, self.cfg.etcd_every)
                if len(self.active()) < len(self.services):
                    every = min(every, self.retry)   # standing by somewhere: the next try in time
                self.wake.wait(max(0.0, every - (time.monotonic() - t0)))
                self.wake.clear()
        finally:
            stop.set()
            for el in self.elections.values():
                el.resign()
            self.keeper.close()
            for t in self.threads:
                t.join(timeout=0)

    # -- the helpee's usage reports, followed ----------------------------------------------------------------
    def follow_usage(self, stop: threading.Event) -> None:
        prefix = schema.usage_prefix()

        def put(key: str, raw: bytes | None) -> str | None:
            parts = key[len(prefix):].split("/")
            if len(parts) != 2 or parts[0] not in self.usage:
                return None
            svc, ep = parts
            if raw is None:
                self.usage[svc].pop(ep, None)
                return svc
            try:
                self.usage[svc][ep] = schema.Usage.from_json(raw, key)
            except RegistryError as exc:
                log.warning("balancer: %s", exc)
                self.usage[svc].pop(ep, None)
            return svc

        def reset(items: dict, _rev: int) -> None:
            with self.lock:
                for svc in self.usage:
                    self.usage[svc] = {}
                for key, (raw, _) in items.items():
                    put(key, raw)
            self.wake.set()

        def apply(batch: list) -> None:
            with self.lock:
                touched = {put(ev.key, ev.value) for ev in batch}
            if any(s is not None and self.elections[s].active for s in touched):
                self.wake.set()

        def failed(exc: Exception, first: bool) -> None:
            if first:
                log.warning("balancer: usage reports: %s; reading them again in 1 s", exc)

        self.reg.follow(prefix, reset, apply, stop, idle=1.0, errors=(RegistryError,), on_error=failed)

    # -- observations ---------------------------------------------------------------------------------------
    def observe(self, name: str, now: float, problems: list[str]) -> ServiceObs:
        seen = self.etcd_view.get(name)
        if seen is None or not 0 <= now - seen[0] < self.cfg.etcd_every:
            seen = (now, self._from_etcd(name, now, problems))
            self.etcd_view[name] = seen
        ranges, eps, robs, busy_eps, helpers, helper_problems = seen[1]
        problems.extend(helper_problems)
        with self.lock:
            pending = list(self.pending[name])
            usage = dict(self.usage.get(name, {}))
        if pending:
            robs = tuple(replace(r, busy=True) if any(b.overlaps(Range(r.lo, r.hi)) for b in pending) else r
                         for r in robs)
        endpoints = {}
        for ep, rec in sorted(usage.items()):
            if ep in eps:
                endpoints[ep] = got = usage_obs(ep, rec, now, self.cfg.stale_after, problems)
                self._say_stale(name, ep, got.served is None, problems)
                ctlmetrics.helpee_cpu(name, ep, got.cpu, got.served)
        # what the status shows of the reports: their numbers and age at this round
        self.usage_seen[name] = {ep: {"served": round(rec.served, 1), "cpu": round(rec.cpu, 4),
                                      "age_s": round(rec.age(now), 3), "used": endpoints[ep].served is not None}
                                 for ep, rec in usage.items() if ep in endpoints}
        used = {r.owner for r in ranges} | {m for r in ranges for m in r.mirrors}
        spares = tuple(sorted(n for n, e in eps.items() if e.ctl and n not in used and n not in helpers
                              and n not in busy_eps))
        stateful = any(e.ctl for e in eps.values())
        return ServiceObs(name, ranges=robs, endpoints=endpoints, helpers=helpers, spares=spares,
                          stateful=stateful)

    def _say_stale(self, service: str, ep: str, unusable: bool, problems: list[str]) -> None:
        """Log once when an endpoint's usage report becomes unusable (stale or failed), and when it is back."""
        key = (service, ep)
        if unusable and key not in self.unusable:
            self.unusable.add(key)
            log.warning("balancer: %s: %s", service, problems[-1] if problems else f"usage report of {ep} unusable")
        elif not unusable and key in self.unusable:
            self.unusable.discard(key)
            log.warning("balancer: %s: usage report of %s is fresh again", service, ep)

    def _from_etcd(self, name: str, now: float, problems: list[str]) -> tuple:
        """(range records, endpoints, RangeObs, busy endpoints, live helpers, helpers' problems) as etcd has them."""
        reg, cfg = self.reg, self.cfg
        svc = reg.service(name)
        ranges = [r for r, _ in reg.ranges(name)]
        eps = {e.name: e for e in reg.endpoints(name)}
        busy_ranges, busy_eps = [], set()
        for op in reg.ops(name):
            if not op.finished:
                busy_eps |= {op.source, op.peer}
                for rr in op.ranges:
                    try:
                        busy_ranges.append(Range(int(rr[0]), int(rr[1])))
                    except (TypeError, ValueError, IndexError):
                        continue
        loads = {}
        try:
            for ep_name, load in reg.loads(name).items():
                if now - load.at > cfg.stale_after:
                    continue
                for row in load.ranges:
                    try:
                        lo, _hi, keys, rate, *median = row   # the median record key: reported by some
                        if load.role.get(f"{int(lo):06x}", "owner") == "owner":
                            loads[(ep_name, int(lo))] = (int(keys), float(rate), int(median[0]) if median else None)
                    except (TypeError, ValueError):
                        continue
        except RegistryError as exc:
            problems.append(f"load reports: {exc}")
        pps = self.switch_rates(svc.id, now, problems)
        try:
            held = [h for h, _, _ in reg.holds(name)[0].ranges()]
        except RegistryError as exc:   # unreadable: hold everything rather than overrule an operator
            problems.append(f"helper holds: {exc}")
            held = [Range(0, KEY_MAX)]
        robs = []
        for r in ranges:
            got = loads.get((r.owner, r.lo))
            rate = got[1] if got else pps.get(r.lo)
            busy = r.state == "moving" or r.owner in busy_eps or any(b.overlaps(r.range) for b in busy_ranges)
            robs.append(RangeObs(r.lo, r.hi, r.owner if r.state != "unassigned" else "", epoch=r.epoch,
                                 helpers=tuple(r.helpers), mirrors=tuple(r.mirrors), state=r.state, rate=rate,
                                 keys=got[0] if got else None, busy=busy, median=got[2] if got else None,
                                 held=any(h.overlaps(r.range) for h in held)))
        hprobs: list[str] = []
        helpers = self.helpers(name, eps, now, hprobs)
        return ranges, eps, tuple(robs), busy_eps, helpers, tuple(hprobs)

    def helpers(self, name: str, eps: dict, now: float, problems: list[str]) -> dict[str, HelperObs]:
        """The live helpers (an endpoint whose agent writes a HelperStatus that serves): their requests/s and
        drops/s from the records' counters; a record that says it does not serve: its reason."""
        try:
            _, items = self.reg.get_prefix(schema.helper_prefix(name))
        except RegistryError as exc:
            problems.append(f"helper reports: {exc}")
            return {}
        out = {}
        limit = max(self.cfg.stale_after, 3 * HELPER_EVERY)
        for key, st, _ in schema.records(items, schema.HelperStatus):
            h = key.rsplit("/", 1)[1]
            if st.down or h not in eps:
                if st.down:
                    helper_down(h, st, problems)
                continue
            if now - st.at > limit:
                problems.append(f"status of helper {h} is {now - st.at:.1f} s old, past {limit:g} s: its numbers "
                                "are ignored")
                out[h] = HelperObs(h)
                continue
            s = st.stats
            rate = self.rates.rate(("h-rx", name, h), st.at, float(s.get("rx_dgrams", 0)))
            drops = self.rates.rate(("h-drop", name, h), st.at, float(sum(s.get(k, 0) for k in HELPER_DROPS)))
            out[h] = HelperObs(h, rate=rate, drops=drops or 0.0)
        return out

    def switch_rates(self, sid: int, now: float, problems: list[str]) -> dict[int, float]:
        """{range lo: packets/s summed over switches} from the controller's fresh counter reports."""
        try:
            _, items = self.reg.get_prefix(schema.folder("counters"))
        except RegistryError as exc:
            problems.append(f"switch counters: {exc}")
            return {}
        out: dict[int, float] = {}
        prefix = f"{sid}/"
        for key, (raw, _) in items.items():
            try:
                rec = schema.Counters.from_json(raw, key)
            except RegistryError:
                continue
            if now - rec.at > self.cfg.stale_after:
                continue
            for cname, (packets, _bytes) in rec.counters.items():
                if not cname.startswith(prefix):
                    continue
                try:
                    lo = int(cname[len(prefix):], 16)
                except ValueError:
                    continue
                r = self.rates.rate(("sw", key, cname), rec.at, packets)
                if r is not None:
                    out[lo] = out.get(lo, 0.0) + r
        return out

    # -- applying --------------------------------------------------------------------------------------------
    def apply(self, d: Decision) -> None:
        self.etcd_view.pop(d.service, None)   # the next round sees what this changed
        ctlmetrics.DECISIONS.labels(d.service, d.action).inc()
        entry = d.to_dict()
        entry["result"] = "requested"
        log.warning("balancer: %s %s %s: %s", d.service, d.action,
                    ", ".join(str(Range(lo, hi)) for lo, hi in d.ranges), d.reason)
        self._record(d.service, entry)
        el = self.elections[d.service]
        try:
            if d.action in ("helpers_on", "helpers_off"):
                helpers = list(d.helpers) if d.action == "helpers_on" else []
                weights = dict(zip(helpers, d.weights))   # bucket weights ∝ spare capacity
                for lo, hi in d.ranges:
                    try:
                        self.apply_helpers(self.reg, d.service, lo, hi, helpers, weights, fence=(el.fence(),))
                    except Conflict:
                        if self.refused(d.service, "decision"):
                            raise NotActive(f"refused by etcd: {self.runner} is no longer the active balancer "
                                            f"of {d.service}") from None
                        raise
                entry["result"] = "done"
            else:
                # the decision in etcd first, fenced: a runner that is no longer the active one asks no owner
                self.publish(d.service, d.at, [], None, strict=True)
                (lo, hi), = d.ranges
                rng = Range(lo, hi)
                start = statectl.split if d.action == "split" else statectl.merge
                started = start(self.reg, d.service, rng, d.peer)
                entry["op"] = started.op
                entry["result"] = "running"
                with self.lock:
                    self.pending[d.service].add(rng)
                t = threading.Thread(target=self._follow, args=(d.service, rng, started.op, entry),
                                     name=f"balancer-{started.op}", daemon=True)
                self.threads.append(t)
                t.start()
        except NotActive as exc:
            entry["result"] = f"refused: {exc}"
            log.warning("balancer: %s %s %s", d.service, d.action, entry["result"])
        except (VfabError, OSError) as exc:
            entry["result"] = f"failed: {exc}"
            log.warning("balancer: %s %s failed: %s", d.service, d.action, exc)

    def _follow(self, service: str, rng: Range, op_id: str, entry: dict) -> None:
        try:
            rec = statectl.wait(Registry(self.reg.endpoint), service, op_id, timeout=600)
            entry["result"] = rec.phase if rec.phase == "done" else f"{rec.phase}: {rec.error}"
            if rec.phase == "done" and entry["action"] == "merge":
                self.reg.coalesce(service)
        except (VfabError, OSError) as exc:
            entry["result"] = f"unknown: {exc}"
        finally:
            with self.lock:
                self.pending[service].discard(rng)
            log.warning("balancer: %s %s %s: %s", service, entry["action"], op_id, entry["result"])

    def _record(self, service: str, entry: dict) -> None:
        with self.lock:
            self.decisions[service].append(entry)
            del self.decisions[service][:-KEEP_DECISIONS]

    def publish(self, service: str, now: float, problems: list[str], obs: ServiceObs | None,
                strict: bool = False) -> None:
        """The status record, fenced; ``strict``: a refusal or failure raises (before a split is asked)."""
        view = {"owners": _finite(self.policy.view.get(service, {}))}
        if obs is not None:
            view["ranges"] = [{"lo": r.lo, "hi": r.hi, "owner": r.owner, "rate": r.rate, "keys": r.keys,
                               "helpers": list(r.helpers), "busy": r.busy} for r in obs.ranges]
            view["spares"] = list(obs.spares)
            view["usage"] = self.usage_seen.get(service, {})
        elif strict:
            got = self.reg.get(schema.balancer_key(service))
            if got is not None:
                try:
                    view = schema.BalancerStatus.from_json(got[0]).view
                except RegistryError:
                    pass
        with self.lock:
            decisions = [dict(e) for e in self.decisions[service]]
        rec = schema.BalancerStatus(at=now, runner=self.runner, decisions=decisions, view=view,
                                    problems=list(problems))
        el = self.elections[service]
        try:
            ok, _ = self.reg.txn([el.fence()], {schema.balancer_key(service): rec.to_json()})
        except RegistryError as exc:
            log.warning("balancer: status of %s not written: %s", service, exc)
            if strict:
                raise
            return
        if not ok:
            self.refused(service, "status record")
            log.warning("balancer: status of %s refused by etcd: %s is no longer the active balancer", service,
                        self.runner)
            if strict:
                raise NotActive(f"refused by etcd: {self.runner} is no longer the active balancer of {service}")


def _finite(x):
    """JSON has no infinity: 'inf' instead."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
