"""etcd cut in two, on the real parts: 3 emulated hosts, one etcd member in each, a host partitioned off the
underlay and the control network (issue 45; docs/architecture.md, "etcd cluster").

On each side a probe process (``vfab.testbed.etcdprobe``, vfab's etcd client with its member list, its own
member first) writes every 50 ms and follows the prefix it writes under.  The partitioned host's probe must
see no leader and stop acting: its writes refused with a clear message, its watch cancelled; the majority
elects (when the leader was cut off) and keeps serving; nothing acknowledged is lost, nothing the minority
was told was refused is applied; after ``heal`` both resume, the minority's watch from its revision."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from vfab.testbed.hosts import HostsTestbed
from vfab.testbed.procs import wait_for

PREFIX = "/vfabtest/probe/"


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    bed = HostsTestbed(3, workdir=str(tmp_path_factory.mktemp("partition")), agents=False)
    if os.environ.get("VFAB_PRE_VOTE") == "0":   # to measure what etcd's --pre-vote buys (it is on by default)
        bed.etcd_options = {"pre_vote": False}
    bed.start()
    try:
        yield bed
    finally:
        bed.stop()


class Probe:
    def __init__(self, tb: HostsTestbed, host: str, name: str):
        self.name = name
        self.proc = tb.run_on(host, f"probe-{name}", [sys.executable, "-m", "vfab.testbed.etcdprobe", "--etcd",
                                                       tb.etcd_endpoint(host), "--name", name, "--prefix", PREFIX])

    def lines(self) -> list[str]:
        with open(self.proc.logpath, errors="replace") as fh:
            return fh.read().splitlines()

    def records(self) -> list[dict]:
        out = []
        for line in self.lines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass   # a line being written
        return out

    def puts(self, since: float = 0.0) -> list[dict]:
        return [r for r in self.records() if r["op"] == "put" and r["t"] >= since]

    def acked(self, since: float = 0.0) -> list[dict]:
        return [r for r in self.puts(since) if r["ok"]]

    def log(self) -> str:
        return "\n".join(ln for ln in self.lines() if not ln.startswith("{"))


def wait_acks(p: Probe, since: float, n: int, timeout: float = 15.0) -> None:
    wait_for(lambda: len(p.acked(since)) >= n, timeout, f"{n} writes of {p.name} acknowledged")


def check_history(tb: HostsTestbed, probes: list[Probe]) -> dict:
    """Nothing acknowledged lost, nothing refused applied, each watch's copy complete and in order."""
    _, items = tb.registry.get_prefix(PREFIX)
    stored = {k: mod for k, (_, mod) in items.items()}
    out = {}
    for p in probes:
        for r in p.puts():
            key = f"{PREFIX}{p.name}/{r['seq']:06d}"
            if r["ok"]:
                assert stored.get(key) == r["rev"], f"{p.name}'s acknowledged write {r['seq']} (revision {r['rev']}) " \
                                                    f"is {'at ' + str(stored[key]) if key in stored else 'lost'}"
            elif r["sure"]:
                assert key not in stored, f"{p.name}'s write {r['seq']} was refused ({r['error']}) yet applied"
        # the watch: events in revision order, none twice, and with the resets the whole store up to its last
        seen: dict[str, int] = {}
        last, resets = 0, 0
        for r in p.records():
            if r["op"] == "reset":
                resets += 1
                seen = dict(r["keys"])
                last = r["rev"]
            elif r["op"] == "events":
                assert r["revs"] == sorted(r["revs"]) and r["revs"][0] > last, f"{p.name}: events out of order"
                for key, rev in zip(r["keys"], r["revs"]):
                    seen[key] = rev
                last = r["revs"][-1]
        want = {k: mod for k, mod in stored.items() if mod <= last}
        assert seen == want, f"{p.name}'s copy differs from etcd's up to revision {last}: " \
                             f"missing {sorted(set(want) - set(seen))[:5]}, extra {sorted(set(seen) - set(want))[:5]}"
        out[p.name] = {"resets": resets, "last": last}
    return out


def longest_gap(p: Probe, start: float, end: float) -> float:
    """The longest time in [start, end] without an acknowledged write of ``p``."""
    acks = [start, *(r["t"] for r in p.acked(start) if r["t"] <= end), end]
    return max(b - a for a, b in zip(acks, acks[1:]))


def partition_round(tb: HostsTestbed, leader_host: str, cut: str) -> dict:
    tb.etcd.make_leader(tb.hosts[leader_host].member)
    tb.registry.delete_prefix(PREFIX)
    tag = f"{cut}-lead-{leader_host}"
    maj, minority = Probe(tb, "host1", f"maj-{tag}"), Probe(tb, cut, f"min-{tag}")
    probes = [maj, minority]
    try:
        t0 = time.time()
        wait_acks(maj, t0, 10)
        wait_acks(minority, t0, 10)
        t_cut = time.time()
        tb.partition(cut)
        # the minority: writes refused, saying there is no leader; its watch cancelled by its member
        wait_for(lambda: [r for r in minority.puts(t_cut) if not r["ok"] and r["sure"]], 20,
                 "a write of the partitioned host's probe refused")
        refused = next(r for r in minority.puts(t_cut) if not r["ok"] and r["sure"])
        t_refused = refused["t"] - t_cut
        assert "no leader" in refused["error"] and "is a majority of its members down?" in refused["error"], refused
        wait_for(lambda: "no leader" in minority.log() and "watching /vfabtest/probe/ again" in minority.log(), 20,
                 "the partitioned member to cancel the probe's watch")
        t_watch = time.time() - t_cut
        # the majority elects (if it lost its leader) and keeps serving
        wait_acks(maj, t_cut, 20)
        lead = tb.etcd.leader()
        assert lead is not tb.hosts[cut].member
        ok_minority = minority.acked(t_cut + 1.0)
        assert not ok_minority, f"the partitioned host's probe had writes acknowledged: {ok_minority[:3]}"
        t_heal = time.time()
        tb.heal(cut)
        wait_acks(minority, t_heal, 5, timeout=30)
        back = minority.acked(t_heal)[0]["t"] - t_heal
        last_maj = maj.acked(t_heal)[-1]["rev"] if maj.acked(t_heal) else 0
        # the minority's watch catches up with the majority's writes
        wait_for(lambda: any(r["op"] == "events" and r["revs"][-1] >= last_maj for r in minority.records()), 30,
                 "the partitioned probe's watch to resume")
        wait_acks(maj, time.time(), 20)   # the majority a second on after the heal
        t_end = time.time()
    finally:
        for p in probes:
            tb.sup.stop(p.proc)
    gap_cut, gap_heal = longest_gap(maj, t_cut - 0.2, t_heal), longest_gap(maj, t_heal - 0.2, t_end)
    hist = check_history(tb, probes)
    # the partitioned probe resumed its watch from its revision: the prefix was read whole only at its start
    assert hist[minority.name]["resets"] == 1, hist
    failed = {p.name: (sum(1 for r in p.puts() if not r["ok"] and r["sure"]),
                       sum(1 for r in p.puts() if not r["ok"] and not r["sure"])) for p in probes}
    return {"refused_after": t_refused, "watch_cut_after": t_watch, "gap": gap_cut, "gap_heal": gap_heal,
            "back": back, "hist": hist, "refused": refused["error"], "failed": failed}


def report(label: str, got: dict) -> None:
    print(f"{label}: first write refused {got['refused_after']:.2f} s after the cut, watch cancelled by "
          f"{got['watch_cut_after']:.2f} s; the majority's longest time without an ack {got['gap']:.2f} s while cut, "
          f"{got['gap_heal']:.2f} s around the heal; the cut-off probe writing again {got['back']:.2f} s after the "
          f"heal; watches {got['hist']}; writes (refused, maybe applied) {got['failed']}")


def test_partitioned_follower_host_stops_acting_and_resumes(tb):
    got = partition_round(tb, "host1", "host3")
    report("follower cut off", got)
    assert got["gap"] < 1.0, "the majority's writes stalled although its leader stayed"
    assert got["gap_heal"] < 1.0 or tb.etcd_options, "the healed member deposed the majority's leader"


def test_partitioned_leader_host_loses_it_and_majority_elects(tb):
    got = partition_round(tb, "host3", "host3")
    report("leader cut off", got)
    assert got["gap"] < 5.0, "the majority took more than 5 s to elect a leader and write again"
    assert got["gap_heal"] < 1.0 or tb.etcd_options, "the healed member deposed the majority's leader"
