"""The balancer's runner: observations in, ``Balancer.decide`` (pure), decisions applied like an operator.

Why a process of its own (``vfab balancer run``) and not a thread of the os-ken controller: the
controller holds nothing etcd does not and must reconcile at once after a restart; the balancer has
memory (windows, dwell times, the helpee's CPU per request without helpers) and does slow, blocking
things (asks memcached for ``stats``, sdhcp shards for STATS, follows state operations for seconds).
Kept apart, neither can delay the other's work (a cut-over waits for no stats poll), either can be
restarted alone, and the balancer is what DESIGN.md §4 says it is: one more operator writing etcd.
Its code lives in ``controller/`` beside the policy (DESIGN.md §1).

Each period, per service:

* **ranges** (``reg.ranges``), **operations** running (``reg.ops``: their ranges, and every range of
  their source and peer, are busy), **endpoints** (stateful ones owning and mirroring nothing are the
  spares a split can take);
* **requests/s per range**: the owner's load report (``/vfab/v1/load/...``), else the switches' route
  counters the controller publishes (``/vfab/v1/counters/<dpid>``, ``<service id>/<lo:06x>``: packets,
  summed over switches, differenced per switch between its reports);
* **endpoint load**: memcached's ``stats`` over TCP (``rusage_user + rusage_system`` → CPU s/s,
  ``cmd_get + cmd_set`` → requests/s, ``threads`` → cores), optionally opened inside a testbed host's
  network namespace; **helpers'** stats files (``rx_dgrams`` → requests/s, ``drop_*``/``tx_nombuf`` →
  drops/s); **sdhcp shards'** STATS (bound leases, slice, DHCP counters) for the status record.

Decisions are applied the way an operator would: helpers by writing ``RangeRec.helpers`` and their
bucket weights (``RangeRec.weights``, ∝ spare capacity) in one epoch-checked transaction
(``apply_helpers``; replaceable by ``vfab helpers``' own apply through ``Runner.apply_helpers``), splits
and merges by asking the owner over ZeroMQ exactly as ``vfab split`` / ``vfab merge`` do
(``vfab.vid.state.ctl``), then following the operation's record in a thread.
Every decision, its reason and its outcome go to ``/vfab/v1/balancer/<service>`` (``vfab balancer
status``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace

from vfab.controller.balancer import (Balancer, BalancerConfig, Decision, EndpointObs, HelperObs, RangeObs,
                                      ServiceObs)
from vfab.controller import ctlmetrics
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import RegistryError, StateError, VfabError
from vfab.vid.netns import netns
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema
from vfab.vid.state import ctl as statectl

log = logging.getLogger("vfab.balancer")
KEEP_DECISIONS = 50
HELPER_DROPS = ("drop_peers", "drop_busy", "drop_noconn", "tx_nombuf", "tx_drop")


@dataclass(frozen=True)
class Memcached:
    """Where an endpoint's memcached answers ``stats``: HOST:PORT, optionally inside a network namespace."""

    host: str
    port: int
    netns: str = ""

    @classmethod
    def parse(cls, text: str) -> "Memcached":
        addr, _, ns = text.partition("@")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"memcached address {text!r} is malformed: write HOST:PORT[@NETNS-PATH], "
                             "e.g. 10.0.0.1:11211@/proc/1234/ns/net")
        return cls(host, int(port), ns)


def memcached_stats(where: Memcached, timeout: float = 1.0) -> dict[str, str]:
    """memcached's ``stats`` (``STAT name value`` lines up to ``END``) over a fresh TCP connection."""
    with netns(where.netns or None):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((where.host, where.port))
        sock.sendall(b"stats\r\n")
        buf = b""
        while not buf.endswith(b"END\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("memcached closed the connection before END")
            buf += chunk
            if len(buf) > 1 << 20:
                raise OSError("stats answer larger than 1 MB: not memcached?")
    finally:
        sock.close()
    out = {}
    for line in buf.decode("ascii", "replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "STAT":
            out[parts[1]] = parts[2]
    return out


def read_stats_file(path: str) -> dict[str, float]:
    """A helper's stats file: one ``name value`` per line (mc-helper's ``--stats-file``)."""
    out = {}
    with open(path) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 2:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    continue
    return out


def helper_down(h: str, path: str, problems: list[str]) -> None:
    """A helper not among the live endpoints whose stats file says it does not serve (``serving 0``, issue 43:
    its agent withdrew it): the reason, in the balancer's problems, so its status shows why it is not used."""
    try:
        st = read_stats_file(path)
    except OSError:
        return
    if st.get("serving", 1) == 0:
        why = next((k[len("down_why_"):] for k, v in st.items() if k.startswith("down_why_") and v), "?")
        problems.append(f"helper {h} does not serve ({why}: {st.get('conns_down', 0):.0f} connection(s) to "
                        f"memcached down, the oldest command waited {st.get('down_waited_ms', 0):.0f} ms); "
                        "withdrawn by its agent until it serves again")


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
                  weights: dict[str, int] | None = None) -> int:
    """Set the helpers of range ``lo-hi`` (exactly one range of the map) and their bucket weights (name ->
    1..65535, ∝ spare capacity) in one epoch-checked transaction; the etcd revision.  Owner, mirrors and state
    are kept."""
    rec = next((r for r, _ in reg.ranges(service) if (r.lo, r.hi) == (lo, hi)), None)
    if rec is None:
        raise StateError(f"{Range(lo, hi)} of {service!r} is no longer one range of the map: the map changed")
    return reg.assign(service, Range(lo, hi), rec.owner, expect_epoch=rec.epoch, mirrors=rec.mirrors,
                      helpers=list(helpers), state=rec.state,
                      weights={h: w for h, w in (weights or {}).items() if h in helpers})


@dataclass
class ServiceSources:
    """Where the load of one service comes from, besides etcd."""

    name: str
    memcached: dict = field(default_factory=dict)   # endpoint -> Memcached
    helpers: dict = field(default_factory=dict)     # helper endpoint -> stats file ("" = none)


class Runner:
    def __init__(self, reg: Registry, services: list[ServiceSources], cfg: BalancerConfig | None = None,
                 clock=time.time):
        self.reg = reg
        self.services = services
        self.cfg = cfg or BalancerConfig()
        self.policy = Balancer(self.cfg)
        self.clock = clock
        self.rates = Rates()
        self.decisions: dict[str, list[dict]] = {s.name: [] for s in services}
        self.pending: dict[str, set] = {s.name: set() for s in services}   # ranges of ops we started
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.runner = f"{socket.gethostname()}:{os.getpid()}"
        self.apply_helpers = apply_helpers
        # etcd's part of each service's observation (when read, what), reused for cfg.etcd_every: a fast period
        # reads only the helpee's stats (a burst is seen within a period or two), not six etcd ranges a round
        self.etcd_view: dict[str, tuple[float, tuple]] = {}
        self.published: dict[str, float] = {}

    # -- one round ----------------------------------------------------------------------------------------
    def tick(self) -> list[Decision]:
        now = self.clock()
        observed, problems = [], {}
        for src in self.services:
            probs: list[str] = []
            try:
                observed.append(self.observe(src, now, probs))
            except VfabError as exc:
                probs.append(f"observing {src.name}: {exc}")
            problems[src.name] = probs
        decisions = self.policy.decide(now, observed)
        for d in decisions:
            self.apply(d)
        decided = {d.service for d in decisions}
        for src in self.services:
            if src.name in decided or problems.get(src.name) or \
                    not 0 <= now - self.published.get(src.name, -math.inf) < self.cfg.etcd_every:
                self.publish(src.name, now, problems.get(src.name, []), next((o for o in observed
                                                                              if o.name == src.name), None))
                self.published[src.name] = now
        return decisions

    def run(self, stop: threading.Event, duration: float | None = None) -> None:
        end = None if duration is None else time.monotonic() + duration
        while not stop.is_set() and (end is None or time.monotonic() < end):
            t0 = time.monotonic()
            try:
                self.tick()
            except Exception:   # a bug in one round must not stop balancing for good
                log.exception("balancer round failed")
            stop.wait(max(0.0, self.cfg.period - (time.monotonic() - t0)))
        for t in self.threads:
            t.join(timeout=0)

    # -- observations ---------------------------------------------------------------------------------------
    def observe(self, src: ServiceSources, now: float, problems: list[str]) -> ServiceObs:
        name = src.name
        seen = self.etcd_view.get(name)
        if seen is None or not 0 <= now - seen[0] < self.cfg.etcd_every:
            seen = (now, self._from_etcd(src, now, problems))
            self.etcd_view[name] = seen
        ranges, eps, robs, busy_eps = seen[1]
        with self.lock:
            pending = list(self.pending[name])
        if pending:
            robs = tuple(replace(r, busy=True) if any(b.overlaps(Range(r.lo, r.hi)) for b in pending) else r
                         for r in robs)
        endpoints = {}
        for ep_name, where in src.memcached.items():
            endpoints[ep_name] = self.memcached_obs(name, ep_name, where, now, problems)
        helpers = {}
        for h, path in src.helpers.items():
            if h in eps:
                helpers[h] = self.helper_obs(name, h, path, now, problems)
            elif path:
                helper_down(h, path, problems)
        used = {r.owner for r in ranges} | {m for r in ranges for m in r.mirrors}
        spares = tuple(sorted(n for n, e in eps.items() if e.ctl and n not in used and n not in src.helpers
                              and n not in busy_eps))
        stateful = any(e.ctl for e in eps.values())
        return ServiceObs(name, ranges=robs, endpoints=endpoints, helpers=helpers, spares=spares,
                          stateful=stateful)

    def _from_etcd(self, src: ServiceSources, now: float, problems: list[str]) -> tuple:
        """(range records, endpoints, RangeObs, busy endpoints) of a service as etcd has them now."""
        reg, cfg, name = self.reg, self.cfg, src.name
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
        return ranges, eps, tuple(robs), busy_eps

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

    def memcached_obs(self, service: str, ep: str, where: Memcached, now: float, problems: list[str]) -> EndpointObs:
        try:
            st = memcached_stats(where)
            cpu_s = float(st["rusage_user"]) + float(st["rusage_system"])
            reqs = float(st["cmd_get"]) + float(st.get("cmd_set", 0))
            threads = float(st.get("threads", 1))
        except (OSError, VfabError, KeyError, ValueError) as exc:
            problems.append(f"memcached stats of {ep} at {where.host}:{where.port}: {exc}")
            return EndpointObs(ep)
        t = self.clock()   # when the counters were read (an etcd read may have come first this round)
        cpu = self.rates.rate(("mc-cpu", service, ep), t, cpu_s)
        served = self.rates.rate(("mc-req", service, ep), t, reqs)
        ctlmetrics.helpee_cpu(service, ep, cpu, served)
        return EndpointObs(ep, cpu=cpu, served=served, cores=max(threads, 1.0))

    def helper_obs(self, service: str, h: str, path: str, now: float, problems: list[str]) -> HelperObs:
        if not path:
            return HelperObs(h)
        try:
            st = read_stats_file(path)
        except OSError as exc:
            problems.append(f"stats file of helper {h}: {exc}")
            return HelperObs(h)
        t = self.clock()
        rate = self.rates.rate(("h-rx", service, h), t, st.get("rx_dgrams", 0.0))
        drops = self.rates.rate(("h-drop", service, h), t, sum(st.get(k, 0.0) for k in HELPER_DROPS))
        return HelperObs(h, rate=rate, drops=drops or 0.0)

    # -- applying --------------------------------------------------------------------------------------------
    def apply(self, d: Decision) -> None:
        self.etcd_view.pop(d.service, None)   # the next round sees what this changed
        ctlmetrics.DECISIONS.labels(d.service, d.action).inc()
        entry = d.to_dict()
        entry["result"] = "requested"
        log.warning("balancer: %s %s %s: %s", d.service, d.action,
                    ", ".join(str(Range(lo, hi)) for lo, hi in d.ranges), d.reason)
        self._record(d.service, entry)
        try:
            if d.action in ("helpers_on", "helpers_off"):
                helpers = list(d.helpers) if d.action == "helpers_on" else []
                weights = dict(zip(helpers, d.weights))   # bucket weights ∝ spare capacity
                for lo, hi in d.ranges:
                    self.apply_helpers(self.reg, d.service, lo, hi, helpers, weights)
                entry["result"] = "done"
            else:
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

    def publish(self, service: str, now: float, problems: list[str], obs: ServiceObs | None) -> None:
        view = {"owners": _finite(self.policy.view.get(service, {}))}
        if obs is not None:
            view["ranges"] = [{"lo": r.lo, "hi": r.hi, "owner": r.owner, "rate": r.rate, "keys": r.keys,
                               "helpers": list(r.helpers), "busy": r.busy} for r in obs.ranges]
            view["spares"] = list(obs.spares)
        with self.lock:
            decisions = [dict(e) for e in self.decisions[service]]
        rec = schema.BalancerStatus(at=now, runner=self.runner, decisions=decisions, view=view,
                                    problems=list(problems))
        try:
            self.reg.put(schema.balancer_key(service), rec.to_json())
        except RegistryError as exc:
            log.warning("balancer: status of %s not written: %s", service, exc)


def _finite(x):
    """JSON has no infinity: 'inf' instead."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
