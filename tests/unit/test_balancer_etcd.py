"""The balancer's runner against a real etcd (and a real memcached): it reads etcd only (issue 45, 5).

Usage reports (the helpee's load, written by a reporter beside memcached) and their staleness; helpers from
their agents' status records; the election that keeps one runner active per service and the fence that
refuses an old active runner's writes.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import socket
import subprocess
import threading
import time

import pytest
from click.testing import CliRunner

from vfab.cli.main import cli
from vfab.controller.balancer import BalancerConfig, Decision
from vfab.controller.balancer_run import Runner, apply_helpers
from vfab.services.memcached_helper import control
from vfab.services.memcached_helper.usage import Memcached, UsageMeter, UsageReporter, memcached_stats
from vfab.testbed.etcd import free_port
from vfab.testbed.procs import wait_for
from vfab.vid.errors import RegistryError, VidError
from vfab.vid.ranges import Range
from vfab.vid.registry import schema as sch

KEY_MAX = 0xFFFFFF
HALF = 0x800000
CFG = BalancerConfig(op_dwell=0.0, min_interval=0.0, burst_window=2, calm_window=5, min_on=10, min_off=5,
                     split_rate=1000, merge_rate=200, split_window=3, merge_window=4, base_us=50, stale_after=5.0)


def mc_service(reg, helpers=("h1", "h2"), halves: bool = True):
    svc = reg.create_service("mc")
    for i, name in enumerate(("m", *helpers)):
        reg.announce(sch.Endpoint(service="mc", name=name, mac=f"02:00:00:00:00:0{i + 1}"), ttl=10)
    if halves:
        reg.assign("mc", Range(0, HALF - 1), "m")
        reg.assign("mc", Range(HALF, KEY_MAX), "m")
    else:
        reg.assign("mc", Range(0, KEY_MAX), "m")
    return svc


def helper_status(reg, name: str, at: float, rx: int = 0, drops: int = 0, down: str = "") -> None:
    """What a helper's agent writes (services/memcached-helper/agent.py)."""
    reg.put(sch.helper_key("mc", name), sch.HelperStatus(at=at, serves="10.0.0.1:11211", pid=1, down=down,
                                                         stats={"rx_dgrams": rx, "drop_busy": drops}).to_json())


def usage(reg, ep: str, at: float, cpu: float = 0.1, served: float = 1000.0, error: str = "") -> None:
    reg.put(sch.usage_key("mc", ep), sch.Usage(at=at, cpu=cpu, served=served, cores=1.0, window=0.1, every=0.5,
                                               source="memcached 10.0.0.1:11211", error=error).to_json())


# -- the report's schema and staleness --------------------------------------------------------------------------
def test_usage_record_round_trips_and_rejects_bad_fields():
    rec = sch.Usage(at=100.0, cpu=0.25, served=12000.0, cores=2.0, window=0.1, every=0.5, source="memcached x")
    assert sch.Usage.from_json(rec.to_json()) == rec
    assert sch.usage_key("mc", "mc0") == "/vfab/v1/usage/mc/mc0" and sch.usage_prefix("mc") == "/vfab/v1/usage/mc/"
    for bad, words in (({"cpu": -1.0}, "negative"), ({"cores": 0}, "above 0"), ({"served": "many"}, "wrong type"),
                       ({"every": True}, "wrong type")):
        with pytest.raises(VidError, match=words):
            dataclasses.replace(rec, **bad)
    with pytest.raises(RegistryError, match="unknown fields"):
        sch.Usage.from_json('{"at": 1, "load": 3}', "/vfab/v1/usage/mc/mc0")
    with pytest.raises(VidError, match="endpoint name"):
        sch.usage_key("mc", "Bad/Name")
    assert "usage" in sch.PASSIVE and "leaders" in sch.PASSIVE   # the controller never recompiles on them


def test_usage_staleness_is_age_past_the_limit_and_a_clock_ahead_is_not_stale():
    rec = sch.Usage(at=100.0)
    assert rec.age(101.5) == 1.5 and not rec.stale(101.5, 2.0) and rec.stale(102.01, 2.0)
    assert rec.age(99.0) == 0.0 and not rec.stale(99.0, 0.5)   # the reporter's clock ahead of ours


def test_leader_record_and_key():
    rec = sch.Leader(who="hostA:123", since=5.0, lease=7)
    assert sch.Leader.from_json(rec.to_json()) == rec
    assert sch.leader_key("balancer", "mc") == "/vfab/v1/leaders/balancer/mc"
    with pytest.raises(VidError, match="empty"):
        sch.Leader(who="", since=1.0)


def test_usage_meter_rates_writes_on_a_move_or_the_heartbeat_and_resets_on_a_restart():
    m = UsageMeter("memcached x", every=0.1, heartbeat=0.5)

    def st(cpu: float, gets: int, threads: int = 2) -> dict:
        return {"rusage_user": str(cpu), "rusage_system": "0.0", "cmd_get": str(gets), "cmd_set": "0",
                "threads": str(threads)}
    assert m.read(10.0, st(1.0, 1000)) is None                  # first read: no rate yet
    rec = m.read(10.1, st(1.01, 1100))
    assert rec is not None and math.isclose(rec.served, 1000.0) and math.isclose(rec.cpu, 0.1)
    assert rec.cores == 2.0 and math.isclose(rec.window, 0.1) and rec.every == 0.5
    m.sent = rec
    assert m.read(10.2, st(1.02, 1203)) is None                # 1,030/s: moved 3 %, under the 10 %: not written
    burst = m.read(10.3, st(1.05, 2403))                       # 12,000/s: the onset goes out at once
    assert burst is not None and math.isclose(burst.served, 12000.0)
    m.sent = burst
    assert m.read(10.4, st(1.08, 3603)) is None                # steady
    beat = m.read(10.8, st(1.20, 8403))                        # the heartbeat: written though steady
    assert beat is not None and math.isclose(beat.served, 12000.0)
    m.sent = beat
    assert m.read(10.9, st(0.01, 5)) is None                   # counters went back: memcached restarted
    err = m.failed(11.0, "refused")
    assert err is not None and err.error == "refused"
    m.sent = err
    assert m.failed(11.1, "refused") is None                   # the same failure: once per heartbeat
    assert m.failed(11.6, "refused") is not None


def _try(fn, *a):
    try:
        return fn(*a)
    except OSError:
        return None


@pytest.fixture
def memcached():
    exe = shutil.which("memcached") or "/usr/bin/memcached"
    port = free_port()
    proc = subprocess.Popen([exe, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-t", "2", "-u", "nobody"])
    try:
        where = Memcached.parse(f"127.0.0.1:{port}")
        wait_for(lambda: _try(memcached_stats, where), 10, "memcached to answer stats")
        yield where
    finally:
        proc.terminate()
        proc.wait(5)


def test_memcached_stats_from_a_real_memcached(memcached):
    before = memcached_stats(memcached)
    with socket.create_connection((memcached.host, memcached.port)) as s:
        for i in range(25):
            s.sendall(f"get k{i}\r\n".encode())
            assert s.recv(100) == b"END\r\n"
    after = memcached_stats(memcached)
    assert int(after["cmd_get"]) - int(before["cmd_get"]) == 25
    assert float(after["rusage_user"]) >= float(before["rusage_user"]) and after["threads"] == "2"
    with pytest.raises(OSError):
        memcached_stats(Memcached("127.0.0.1", free_port()), timeout=0.5)   # none there: an error to report
    with pytest.raises(ValueError, match="HOST:PORT"):
        Memcached.parse("localhost")


def test_reporter_writes_a_leased_usage_report_of_a_real_memcached(registry, memcached):
    """The reporter beside memcached: its gets/s and CPU in etcd under its lease; gone with the lease."""
    registry.create_service("mc")
    lease = registry.lease(5)
    rep = UsageReporter(registry, "mc", "mc0", memcached, every=0.05, heartbeat=0.2)
    got: list = []
    with socket.create_connection((memcached.host, memcached.port)) as s:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(got) < 3:
            for i in range(50):
                s.sendall(f"get k{i}\r\n".encode())
                assert s.recv(100) == b"END\r\n"
            rec = rep.tick(lease)
            if rec is not None:
                got.append(rec)
            time.sleep(0.01)
    assert len(got) == 3, got
    raw, _ = registry.get(sch.usage_key("mc", "mc0"))
    last = sch.Usage.from_json(raw)
    assert last == got[-1] and last.served > 100 and last.cores == 2.0 and last.source.startswith("memcached ")
    assert registry.lease_of(sch.usage_key("mc", "mc0")) == lease
    with pytest.raises(ValueError, match="heartbeat"):
        UsageReporter(registry, "mc", "mc0", memcached, every=1.0, heartbeat=0.5)
    registry.revoke(lease)
    assert registry.get(sch.usage_key("mc", "mc0")) is None


# -- the runner: etcd only --------------------------------------------------------------------------------------
def test_runner_observes_etcd_applies_helpers_and_publishes(registry):
    svc = mc_service(registry, helpers=("h1", "h2", "h3"))
    clock = {"t": 1000.0}
    for h in ("h1", "h2"):
        helper_status(registry, h, 1000.0)
    helper_status(registry, "h9", 1000.0)                              # a status but no endpoint: not live
    helper_status(registry, "h3", 1000.0, down="unacked")              # withdrawn by its agent: its reason

    def counters(at: float, a: int, b: int) -> None:   # what the controller publishes, for two switches
        for dpid, share in ((1, 1.0), (2, 0.5)):
            registry.put(sch.counters_key(dpid), sch.Counters(at=at, counters={
                f"{svc.id}/{0:06x}": [int(a * share), 0], f"{svc.id}/{HALF:06x}": [int(b * share), 0],
                "deny/3": [7, 0]}).to_json())
    run = Runner(registry, ["mc"], CFG, clock=lambda: clock["t"])
    run.campaign()
    assert run.active() == ["mc"]
    counters(1000.0, 0, 0)
    run.tick()
    clock["t"] = 1002.0
    counters(1002.0, 2000, 600)
    helper_status(registry, "h1", 1002.0, rx=3000, drops=10)
    run.etcd_view.clear()
    problems: list = []
    obs = run.observe("mc", clock["t"], problems)
    assert {r.lo: r.rate for r in obs.ranges} == {0: 1500.0, HALF: 450.0}   # (2000 + 1000) / 2 s, (600 + 300) / 2
    assert set(obs.helpers) == {"h1", "h2"}
    assert obs.helpers["h1"].rate == 1500.0 and obs.helpers["h1"].drops == 5.0
    assert any("helper h3 does not serve (unacked" in p for p in problems), problems
    assert obs.spares == () and obs.stateful is False and obs.endpoints == {}
    control.hold(registry, "mc", Range(HALF, HALF + 5), "off")   # an operator's hold on part of the upper range
    run.etcd_view.clear()
    assert {r.lo: r.held for r in run.observe("mc", clock["t"], []).ranges} == {0: False, HALF: True}
    registry.put(sch.holds_key("mc"), "not json")            # unreadable: every range held, and said
    run.etcd_view.clear()
    problems = []
    assert {r.held for r in run.observe("mc", clock["t"], problems).ranges} == {True}
    assert any("helper holds" in p for p in problems), problems
    control.release(registry, "mc", None)
    clock["t"] = 1010.0                                # the counters are now stale: no rates
    run.etcd_view.clear()
    assert {r.rate for r in run.observe("mc", clock["t"], []).ranges} == {None}

    # a decision applied: helpers written in one epoch-checked, fenced txn each, status published
    epochs = {r.lo: r.epoch for r, _ in registry.ranges("mc")}
    d = Decision("helpers_on", "mc", ((HALF, KEY_MAX),), "a test burst", clock["t"], owner="m", helpers=("h2", "h1"),
                 weights=(100, 40), p99_us=math.inf)
    run.apply(d)
    run.publish("mc", clock["t"], ["one problem"], None)
    after = {r.lo: r for r, _ in registry.ranges("mc")}
    assert after[HALF].helpers == ["h2", "h1"] and after[HALF].epoch == epochs[HALF] + 1
    assert after[HALF].weights == {"h2": 100, "h1": 40}
    assert after[0].helpers == [] and after[HALF].owner == "m"
    st = sch.BalancerStatus.from_json(registry.get(sch.balancer_key("mc"))[0])
    assert st.decisions[-1]["action"] == "helpers_on" and st.decisions[-1]["result"] == "done"
    assert st.decisions[-1]["p99_us"] == "inf" and st.problems == ["one problem"] and st.runner == run.runner
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "status", "mc"])
    assert res.exit_code == 0 and "helpers_on" in res.output and "a test burst" in res.output, res.output
    assert f"active balancer: {run.runner} since " in res.output, res.output
    # off, then a stale map: the apply fails and says so
    run.apply(dataclasses.replace(d, action="helpers_off", helpers=(), weights=()))
    assert {r.lo: (r.helpers, r.weights) for r, _ in registry.ranges("mc")}[HALF] == ([], {})
    with pytest.raises(Exception, match="no longer one range"):
        apply_helpers(registry, "mc", 0, KEY_MAX, ["h1"])
    run.apply(dataclasses.replace(d, ranges=((0, KEY_MAX),)))
    assert run.decisions["mc"][-1]["result"].startswith("failed: ")
    assert run.active() == ["mc"]                                  # a failed apply on data is no lost election
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "status", "nosuch"])
    assert res.exit_code == 1 and "does not exist" in res.output
    run.keeper.close()


def test_runner_takes_the_helpees_load_from_usage_reports_and_ignores_stale_ones(registry):
    """Each round reads the helpee's load from the usage reports its watch keeps (no memcached socket); etcd's
    map every etcd_every; a report older than stale_after is not used, and said so."""
    mc_service(registry, helpers=("h1",), halves=False)
    clock = {"t": 1000.0}
    cfg = dataclasses.replace(CFG, period=0.02, etcd_every=0.25, stale_after=1.0)
    run = Runner(registry, ["mc"], cfg, clock=lambda: clock["t"])
    run.campaign()
    reads: list = []
    real = registry.ranges
    registry.ranges = lambda *a, **k: reads.append(clock["t"]) or real(*a, **k)
    stop = threading.Event()
    follower = threading.Thread(target=run.follow_usage, args=(stop,), daemon=True)
    follower.start()
    try:
        usage(registry, "m", 1000.0, cpu=0.2, served=12000.0)
        wait_for(lambda: "m" in run.usage["mc"], 5, "the usage report through the watch")
        assert run.wake.is_set()                                  # a report of an active service wakes the round
        for t in (1000.0, 1000.02, 1000.04):
            clock["t"] = t
            problems: list = []
            obs = run.observe("mc", t, problems)
            ep = obs.endpoints["m"]
            assert (ep.cpu, ep.served, ep.cores) == (0.2, 12000.0, 1.0) and problems == []
        assert reads == [1000.0]                                  # the map once per etcd_every
        run.publish("mc", clock["t"], [], obs)                    # the status shows the report and its age
        view = sch.BalancerStatus.from_json(registry.get(sch.balancer_key("mc"))[0]).view
        assert view["usage"] == {"m": {"served": 12000.0, "cpu": 0.2, "age_s": 0.04, "used": True}}, view
        res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "status", "mc"])
        assert "m: usage report 12000.0 requests/s, CPU 0.2 s/s, 0.04 s old" in res.output, res.output
        usage(registry, "m", 1000.05, served=300.0)
        wait_for(lambda: run.usage["mc"]["m"].served == 300.0, 5, "the next report")
        clock["t"] = 1001.2                                       # 1.15 s after the report: stale
        problems = []
        ep = run.observe("mc", clock["t"], problems).endpoints["m"]
        assert ep.cpu is None and ep.served is None
        assert any("usage report of m" in p and "past stale_after 1 s: ignored" in p for p in problems), problems
        assert run.unusable == {("mc", "m")}                      # logged once, until it is fresh again
        usage(registry, "m", 1001.2, error="stats of memcached 10.0.0.1:11211: connection refused")
        wait_for(lambda: run.usage["mc"]["m"].error != "", 5, "the error report")
        problems = []
        assert run.observe("mc", clock["t"], problems).endpoints["m"].served is None
        assert any("connection refused" in p for p in problems), problems
        registry.delete(sch.usage_key("mc", "m"))
        wait_for(lambda: "m" not in run.usage["mc"], 5, "the report's deletion")
        assert run.observe("mc", clock["t"], []).endpoints == {}
    finally:
        stop.set()
        registry.ranges = real
        run.keeper.close()


def test_one_active_runner_and_a_paused_old_one_cannot_write(registry):
    """Two runners: the first wins, the second stands by and publishes nothing.  The first 'pauses' past its
    lease (its lease revoked, as etcd does when it expires); the second takes over; the first's decision and
    status writes are then refused by etcd (the fence), and it stands by."""
    mc_service(registry, helpers=("h1",), halves=False)
    helper_status(registry, "h1", time.time())
    a = Runner(registry, ["mc"], CFG, who="hostA:1")
    b = Runner(registry, ["mc"], CFG, who="hostB:2")
    a.campaign()
    b.campaign()
    assert a.active() == ["mc"] and b.active() == []
    b.tick()
    assert registry.get(sch.balancer_key("mc")) is None            # a standby writes nothing
    a.tick()
    assert sch.BalancerStatus.from_json(registry.get(sch.balancer_key("mc"))[0]).runner == "hostA:1"
    lead = sch.Leader.from_json(registry.get(sch.leader_key("balancer", "mc"))[0])
    assert lead.who == "hostA:1" and lead.lease == a.keeper.id
    # a is paused past its lease: etcd drops it (here: revoked, as at expiry); its keepalive has not run yet
    registry.revoke(a.keeper.id)
    b.tried = -math.inf
    b.campaign()
    assert b.active() == ["mc"] and a.active() == ["mc"]           # a still believes it is active...
    epoch = registry.ranges("mc")[0][0].epoch
    a.apply(Decision("helpers_on", "mc", ((0, KEY_MAX),), "a stale burst", time.time(), owner="m",
                     helpers=("h1",), weights=(100,)))
    rec = registry.ranges("mc")[0][0]
    assert rec.helpers == [] and rec.epoch == epoch                # ...but etcd refused its decision
    assert a.decisions["mc"][-1]["result"].startswith("refused: refused by etcd: hostA:1 is no longer the active")
    assert a.active() == []                                        # and it stood down
    b.tick()
    a.publish("mc", time.time(), [], None)                         # a status write of the old one: refused too
    st = sch.BalancerStatus.from_json(registry.get(sch.balancer_key("mc"))[0])
    assert st.runner == "hostB:2" and all(d.get("reason") != "a stale burst" for d in st.decisions)
    a.tried = -math.inf
    a.campaign()
    assert a.active() == [] and b.active() == ["mc"]               # it campaigns again, and loses
    # the active one stops: it resigns, and the other takes over at its next try
    b.keeper.close()
    for el in b.elections.values():
        el.resign()
    a.tried = -math.inf
    a.campaign()
    assert a.active() == ["mc"]
    a.keeper.close()


def test_balancer_cli_refuses_the_old_sources_and_status_names_no_active_one(registry):
    registry.create_service("mc")
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "run", "mc", "--memcached",
                                   "mc/m=10.0.0.1:11211"])
    assert res.exit_code == 2 and "reads etcd only" in res.output, res.output
    registry.put(sch.balancer_key("mc"), sch.BalancerStatus(at=time.time(), runner="x:1").to_json())
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "status", "mc"])
    assert res.exit_code == 0 and "active balancer: none" in res.output, res.output
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "balancer", "report", "mc", "--memcached",
                                   "127.0.0.1:1"])
    assert res.exit_code == 2 and "SERVICE/ENDPOINT" in res.output, res.output


# -- real runner processes: one active, kill -9, SIGSTOP/SIGCONT --------------------------------------------------
TTL = 1            # s: the test etcd's election timeout is 500 ms, so leases may be this short
TAKEOVER_BOUND_S = TTL + 1.5   # the lease's TTL, etcd's expiry check (every 0.5 s), the standby's next try (0.2 s)
PROC_SETTINGS = {"period": 0.05, "etcd_every": 5.0, "stale_after": 1.0, "min_interval": 0.2, "burst_window": 0.1,
                 "calm_window": 0.3, "min_on": 0.3, "min_off": 0.1, "op_dwell": 0.0, "rate_on": 5000,
                 "rate_off": 2500, "helper_capacity": 20000}


class Runners:
    """``vfab balancer run mc`` processes against the test's etcd; stopped by PID afterwards."""

    def __init__(self, registry, tmp_path):
        self.reg, self.tmp, self.procs = registry, tmp_path, {}

    def start(self, name: str) -> subprocess.Popen:
        import sys
        sets = [a for k, v in PROC_SETTINGS.items() for a in ("--set", f"{k}={v}")]
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "vfab.cli", "--etcd", self.reg.endpoint, "-v", "balancer", "run",
                              "mc", "--ttl", str(TTL), *sets], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = p
        wait_for(lambda: "running for" in self.log(name) or p.poll() is not None, 15, f"runner {name} to start")
        assert p.poll() is None, self.log(name)
        return p

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def active(self) -> str:
        got = self.reg.get(sch.leader_key("balancer", "mc"))
        return sch.Leader.from_json(got[0]).who if got else ""

    def is_active(self, name: str) -> bool:
        return self.active().endswith(f":{self.procs[name].pid}")

    def status_by(self, name: str) -> bool:
        got = self.reg.get(sch.balancer_key("mc"))
        return bool(got) and sch.BalancerStatus.from_json(got[0]).runner.endswith(f":{self.procs[name].pid}")

    def stop(self) -> None:
        import os
        import signal
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def test_runner_processes_one_active_kill9_takeover_and_a_resumed_old_one_is_refused(registry, tmp_path):
    """Three 'vfab balancer run' processes for one service.  One is active, the others write nothing.  kill -9
    of the active one: a standby wins within TAKEOVER_BOUND_S (printed) and decides on the next burst (helpers
    on).  SIGSTOP of that one past its lease: the third wins; a burst while the old one is stopped; SIGCONT:
    the old one acts on what it saw, and etcd refuses its write (the election's fence): the range map and the
    status are the new active one's only.  On the old code (no election) the standby published and decided too."""
    import os
    import signal

    mc_service(registry, helpers=("h1",), halves=False)
    served = {"v": 300.0}
    stop = threading.Event()

    def reporter() -> None:   # what memcached's agent writes, every 50 ms
        while not stop.wait(0.05):
            usage(registry, "m", time.time(), cpu=0.05, served=served["v"])
            helper_status(registry, "h1", time.time())
    threading.Thread(target=reporter, daemon=True).start()
    runners = Runners(registry, tmp_path)
    try:
        runners.start("a")
        wait_for(lambda: runners.is_active("a") and runners.status_by("a"), 10, "runner a active")
        runners.start("b")
        runners.start("c")
        time.sleep(0.5)
        assert runners.is_active("a") and runners.status_by("a")
        assert "is now the active one" not in runners.log("b") + runners.log("c")
        # kill -9 of the active one
        t_kill = time.time()
        os.kill(runners.procs["a"].pid, signal.SIGKILL)
        wait_for(lambda: runners.active() and not runners.is_active("a"), 10, "a standby to win")
        took = time.time() - t_kill
        new, other = ("b", "c") if runners.is_active("b") else ("c", "b")
        wait_for(lambda: runners.status_by(new), 5, f"{new}'s first round")
        print(f"\nkill -9 of the active balancer: {new} won {took:.2f} s after the kill (TTL {TTL} s), published "
              f"{time.time() - t_kill:.2f} s after it")
        assert took < TAKEOVER_BOUND_S
        served["v"] = 12000.0                                     # a burst: the new active one decides
        wait_for(lambda: registry.ranges("mc")[0][0].helpers == ["h1"], 5, f"helpers on by {new}")
        served["v"] = 300.0                                       # calm: it switches them off again
        wait_for(lambda: registry.ranges("mc")[0][0].helpers == [], 5, f"helpers off by {new}")
        time.sleep(0.3)                                           # past min_off
        # SIGSTOP of the active one past its lease; the other standby wins; a burst while it is stopped
        os.kill(runners.procs[new].pid, signal.SIGSTOP)
        t_stop = time.time()
        wait_for(lambda: runners.is_active(other), 10, f"{other} to win while {new} is stopped")
        print(f"SIGSTOP of {new}: {other} won {time.time() - t_stop:.2f} s later")
        before = registry.ranges("mc")[0][0]
        served["v"] = 12000.0
        wait_for(lambda: registry.ranges("mc")[0][0].helpers == ["h1"], 5, f"helpers on by {other}")
        on = registry.ranges("mc")[0][0]
        assert on.epoch == before.epoch + 1
        os.kill(runners.procs[new].pid, signal.SIGCONT)
        wait_for(lambda: "refused by etcd" in runners.log(new), 5, f"{new}'s write to be refused")
        line = next(ln for ln in runners.log(new).splitlines() if "refused by etcd" in ln)
        print(f"{new} after SIGCONT: {line.split(' ', 2)[-1]}")
        time.sleep(0.5)
        assert runners.is_active(other) and runners.status_by(other)
        assert "is no longer the active one" in runners.log(new)
        st = sch.BalancerStatus.from_json(registry.get(sch.balancer_key("mc"))[0])
        assert all("refused" not in d["result"] for d in st.decisions), st.decisions
        for name in ("b", "c"):
            assert runners.procs[name].poll() is None and "Traceback" not in runners.log(name), runners.log(name)
    finally:
        stop.set()
        runners.stop()


def test_a_campaign_whose_answer_was_lost_but_won_holds_the_key(registry):
    """The campaign's transaction applied but its answer was lost (a member died with it): the key is ours, under
    our live lease.  The next campaign must take it up, not fail on its own key forever (which left no active
    runner at all: our lease kept the key alive while we stood by)."""
    from vfab.controller.leader import Election, LeaseKeeper

    keeper = LeaseKeeper(registry, 2)
    try:
        el = Election(registry, "balancer", "svc", keeper, who="r1@test")
        lease = keeper.get()
        key = sch.leader_key("balancer", "svc")
        ok, rev = registry.txn([registry.cmp_mod(key, 0)],
                               {key: sch.Leader(who="r1@test", since=time.time(), lease=lease).to_json()},
                               lease=lease)                      # what the lost transaction did
        assert ok and not el.active
        assert el.campaign() and el.active and el.revision == rev
        assert registry.txn([el.fence()], {})[0]                  # its fence holds
        other = Election(registry, "balancer", "svc", keeper, who="r2@test")
        assert not other.campaign() and not other.active          # someone else's key is not taken up
    finally:
        keeper.close()
