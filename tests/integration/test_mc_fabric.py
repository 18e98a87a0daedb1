"""PostMan helpers on the real fabric: OVS (userspace) + os-ken + etcd + Mininet, Debian's memcached, mc-helper
on DPDK, unmodified memcached UDP clients (``mcudp.py``).

``line,2,3``: memcached on vfh1 (vfbs1) is the helpee and owns every range of service ``mc``, whose udp front
door (``udp, ipv4_dst=<vfh1>, udp_dst=11211``, key = the client's IPv4 address) turns the clients' datagrams
into VIDs.  Helpers ``h1`` on vfh2 (vfbs1, beside memcached) and ``h2`` on vfh5 (vfbs2: its bucket crosses
the trunk) are announced by their agents.  Clients on vfh3 (vfbs1), vfh4 and vfh6 (vfbs2) keep one process and
the same sockets for a whole test while helpers are switched in and out, and while a helper is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
from click.testing import CliRunner

from vfab.cli.main import cli
from vfab.services.memcached_helper import control, topo
from vfab.services.memcached_helper.onfabric import McFabric
from vfab.testbed.procs import wait_for
from vfab.vid.registry import schema
from tests.unit.test_mch_adapt import helper_binary

SVC = "mc"
HELPERS = {"h1": "vfh2", "h2": "vfh5"}
CLIENTS = ("vfh3", "vfh4", "vfh6")
KEYS = 2000
# Helper options: sleep when idle (a shared 2-core machine), one connection and T up to 1 ms, so that the
# modest load a test can offer here still makes multi-gets of several keys.
HELPER_OPTS = ("--idle-us", "50", "--conns", "1", "--t-max", "1000")
# Recovery bound after kill -9 of a helper under load.  The path: the agent polls its child every 20 ms
# and revokes the lease (~2 ms); the controller sees the watch event, compiles, commits one bundle per
# switch (7-9 ms) and the datapath revalidates (~20 ms with few flows, TESTBED-NOTES.md): ~60-100 ms when
# the machine is idle.  On this shared 2-core machine (ovs-vswitchd, the controller, memcached, two
# polling helpers and the clients on 2 cores) a scheduling stall of a few hundred ms is common, so the
# bound is 1 s: still 2.5x under the 2-3 s a lease expiry alone would take (TTL 2 s), which is what
# this test must rule out; PostMan's own client-side recovery takes 0.4 s (1,000 connections, 1 s timeout).
RECOVERY_BOUND_S = 1.0


def cli_ok(tb, *args: str) -> str:
    res = CliRunner().invoke(cli, ["--etcd", tb.etcd_endpoint, *args])
    assert res.exit_code == 0, f"vfab {' '.join(args)} failed ({res.exit_code}):\n{res.output}"
    return res.output


def delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def ovs_drops() -> dict[str, int]:
    """ovs-vswitchd's drop counters (coverage: the pipeline's, the datapath's, by reason) by name."""
    out = subprocess.run(["ovs-appctl", "coverage/show"], capture_output=True, text=True, check=True).stdout
    return {ln.split()[0]: int(ln.split("total:")[1]) for ln in out.splitlines() if "drop" in ln and "total:" in ln}


def pipeline_drops() -> int:
    """ovs-vswitchd's count of packets its OpenFlow pipeline ended in a drop (coverage counter)."""
    return ovs_drops().get("drop_action_of_pipeline", 0)


def udp_errors(testbed, host: str) -> dict[str, int]:
    """The UDP counters of a host's network namespace that say a datagram was dropped there."""
    out = subprocess.run(["nsenter", f"--net={testbed.netns(host)}", "--", "cat", "/proc/net/snmp"],
                         capture_output=True, text=True, check=True).stdout
    names, values = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("Udp:")][:2]
    return {k: int(v) for k, v in zip(names, values) if k in ("InErrors", "RcvbufErrors", "SndbufErrors", "NoPorts")}


def where_lost(testbed, mc) -> dict:
    """A snapshot of every place on the path that counts a drop: OVS, memcached's and the clients' UDP, the
    helpers (requests received vs answered, frames not sent).  ``lost_report`` says what moved between two."""
    return {"ovs": ovs_drops(), **{f"udp {h}": udp_errors(testbed, h) for h in (mc.host, *CLIENTS)},
            **{f"helper {n}": {k: v for k, v in mc.stats(n).items()
                               if k in ("rx_dgrams", "w_done", "tx_drop", "tx_nombuf", "drop_peers", "drop_noconn",
                                        "drop_busy", "port_imissed", "port_oerrors")} for n in HELPERS}}


def lost_report(before: dict, after: dict) -> str:
    moved = []
    for where, now in after.items():
        for k, v in now.items():
            d = v - before.get(where, {}).get(k, 0)
            if d and not (where.startswith("helper") and k in ("rx_dgrams", "w_done")):
                moved.append(f"{where} {k} +{d}")
        if where.startswith("helper"):
            unanswered = delta(now, before.get(where, {}), "rx_dgrams") - delta(now, before.get(where, {}), "w_done")
            if unanswered:
                moved.append(f"{where} received but did not answer {unanswered}")
    return "drops counted: " + (", ".join(moved) or "none anywhere")


@pytest.fixture(scope="module")
def mc(testbed):
    if shutil.which("memcached") is None or shutil.which("nsenter") is None:
        pytest.fail("memcached and nsenter are needed: run scripts/bootstrap.sh")
    m = McFabric(testbed, SVC, "vfh1", binary=str(helper_binary()))
    m.start_memcached()
    assert m.preload("vfh3", KEYS)["answer"].startswith("VERSION")
    for name, host in HELPERS.items():
        m.start_helper(name, host, extra=HELPER_OPTS)
    m.bind = {h: ",".join(m.client_addresses(h, 4)) for h in CLIENTS}   # 12 client machines on 3 hosts
    testbed.wait_revision(testbed.registry.state_revision())
    yield m
    for run in list(m.helpers.values()):
        rc = m.stop(run)
        assert rc == 0, f"agent {run.name} exited {rc}:\n{run.agent.tail(30)}"
    m.stop(m.memcached)


def loads(mc, duration: float, rate: int, clients: int = 16, timeline: float = 0.0) -> list:
    extra = ["--timeline", str(timeline), "--gap-min", "0.04"] if timeline else []
    return [mc.client(h, "load", "--clients", str(clients), "--rate", str(rate), "--duration", str(duration),
                      "--keys", str(KEYS), "--drain", "1.5", "--bind", mc.bind[h], *extra) for h in CLIENTS]


def after_step(at: list[tuple[str, float]], t: float) -> str:
    """'STEP +S s': the last of the (name, time) steps begun by ``t``, and how long before ``t``."""
    name, t0 = max((a for a in at if a[1] <= t), key=lambda a: a[1], default=at[0])
    return f"{name} +{t - t0:.3f} s"


def test_front_door_reaches_memcached_and_helpers_are_registered(testbed, mc):
    """Direct: every client gets memcached's values from memcached's address; both helpers are live."""
    res = [topo.finish(p, 60) for p in loads(mc, 1.5, 300, clients=4)]
    for r in res:
        assert r["answered"] == r["sent"] > 0 and r["wrong"] == r["framing"] == r["lost"] == 0, r
        assert r["sources"] == [mc.addr], r
    assert control.live_helpers(testbed.registry, SVC) == ["h1", "h2"]
    for name in HELPERS:
        assert mc.stats(name).get("rx_get", 0) == 0, "a helper got gets while helpers were off"
    out = cli_ok(testbed, "helpers", SVC)
    assert "h1" in out and "h2" in out and "live" in out and "served by" in out, out


def test_bad_helper_requests_are_refused_clearly(testbed, mc):
    res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, "helpers", "on", SVC, "--helper", "h9"])
    assert res.exit_code == 2 and "'h9' is not a live helper of 'mc'" in res.output and "h1, h2" in res.output, \
        res.output
    res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, "helpers", "on", "nosuch"])
    assert res.exit_code != 0 and "does not exist" in res.output, res.output
    ranges = testbed.registry.ranges(SVC)
    assert ranges and all(not r.helpers for r, _ in ranges), ranges


BAD = [b"bogus\r\n", b"set bad_k 0 0 3\r\nabcde", b"get k1\r\nget k2\r\n", b"get " + b"x" * 251 + b"\r\n",
       b"touch k1 abc\r\n"]


def test_bad_commands_through_helpers_are_answered_as_directly(testbed, mc):
    """Issue 43 on the fabric: what a helper does not batch it relays to memcached's address over UDP; from a
    helper's host that must reach memcached (the door leaves the service's own hosts alone), not the helpers'
    select group again.  Every client host gets the very datagrams memcached sends it directly, and each bad
    command is relayed once (no bouncing between helpers)."""
    path = os.path.join(testbed.workdir, "bad-commands.json")
    with open(path, "w") as fh:
        json.dump([{"payload": c.hex(), "kind": "none"} for c in BAD], fh)

    def run_all() -> list[list]:
        out = []
        for h in CLIENTS:
            res = topo.finish(mc.client(h, "run", "--script", path, "--timeout", "1"), 60)["results"]
            out.append([[bytes.fromhex(d)[2:] for d in r["dgrams"]] for r in res])
        return out
    direct = run_all()
    mc.helpers_on()
    try:
        before = {n: mc.stats(n) for n in HELPERS}
        via = run_all()
        time.sleep(0.3)
        after = {n: mc.stats(n) for n in HELPERS}
    finally:
        mc.helpers_off()
    assert via == direct and all(all(r) for r in direct), (direct, via)
    relayed = sum(delta(after[n], before[n], "relay_sent") for n in HELPERS)
    assert relayed == len(BAD) * len(CLIENTS), f"{relayed} relays for {len(BAD) * len(CLIENTS)} bad commands"
    assert sum(delta(after[n], before[n], "relay_replies") for n in HELPERS) >= len(BAD) * len(CLIENTS)


BIG_DGRAMS = (65_000, 65_300, 65_301, 65_400, 65_500)   # UDP payloads of sets, up to UDP's 65,507


def big_set(n: int) -> bytes:
    """A set whose memcached frame (8-byte header + command) is exactly ``n`` bytes."""
    key = b"big%d" % n
    head = b"set %s 0 0 %%d\r\n" % key
    size = n - 8 - len(head % 0) - 2
    size -= len(head % size) - len(head % 0)
    out = (head % size) + b"v" * size + b"\r\n"
    assert 8 + len(out) == n, (n, len(out))
    return out


def test_requests_near_the_udp_limit_are_stored_or_refused_clearly(testbed, mc):
    """Issue 43: sets of 65,000 to 65,500 B (just under UDP's 65,507) through helpers.  A helper takes a request
    whole up to its receive frame (65,408 B ring frames: 65,300 B of UDP payload); a longer one arrives cut, so
    it can neither batch nor relay it: it answers ``SERVER_ERROR request of N bytes is over this helper's limit
    of L bytes`` at once (before, it dropped it and the client timed out).  Every answer is STORED or that
    error, consistently with the limit it names; direct, memcached stores them all (printed)."""
    path = os.path.join(testbed.workdir, "big-sets.json")
    with open(path, "w") as fh:
        json.dump([{"payload": big_set(n).hex(), "kind": "line"} for n in BIG_DGRAMS], fh)

    def run() -> list[bytes]:
        res = topo.finish(mc.client("vfh4", "run", "--script", path, "--timeout", "2"), 60)["results"]
        return [b"".join(bytes.fromhex(d)[8:] for d in r["dgrams"]) for r in res]
    direct = run()
    mc.helpers_on()
    try:
        before = {n: mc.stats(n) for n in HELPERS}
        via = run()
        time.sleep(0.3)
        after = {n: mc.stats(n) for n in HELPERS}
    finally:
        mc.helpers_off()
    print(f"\nsets of {BIG_DGRAMS} B: direct {direct}; through helpers {via}")
    limit = None
    for n, answer in zip(BIG_DGRAMS, via):
        if answer == b"STORED\r\n":
            assert limit is None or n <= limit, (n, answer)
            continue
        words = answer.split()
        assert answer.startswith(b"SERVER_ERROR request of %d bytes is over this helper's limit of " % n) \
            and answer.endswith(b" bytes\r\n"), (n, answer)
        limit = int(words[-2])
        assert n > limit, (n, answer)
    assert via[0] == b"STORED\r\n" and limit is not None, via
    refused = sum(1 for a in via if a.startswith(b"SERVER_ERROR"))
    assert sum(delta(after[n], before[n], "refused_big") for n in HELPERS) == refused


def test_helpers_switch_in_and_out_under_load(testbed, mc):
    """Same client processes and sockets throughout: direct, helpers on (coalesced multi-gets, values right,
    a client's set then get in order), helpers off again; nothing lost or wrong at either switch."""
    drops0, seen0 = pipeline_drops(), where_lost(testbed, mc)
    procs = loads(mc, 9.0, 1500)
    time.sleep(2.5)
    before = {n: mc.stats(n) for n in HELPERS}
    t_on = time.time()
    out = cli_ok(testbed, "helpers", "on", SVC)
    assert "helpers - -> h1,h2" in out and "applied on all switches" in out, out
    time.sleep(2.0)
    t_order = time.time()
    order = topo.finish(mc.client("vfh4", "order", "--clients", "8", "--rounds", "10", "--bind", mc.bind["vfh4"]),
                        90)
    t_order_end = time.time()
    time.sleep(0.5)
    during = {n: mc.stats(n) for n in HELPERS}
    status = cli_ok(testbed, "helpers", SVC)
    t_off = time.time()
    out = cli_ok(testbed, "helpers", "off", SVC)
    try:
        assert "h1,h2 -> -" in out, out
        time.sleep(0.5)       # requests already at a helper are still answered by it
        after_off = {n: mc.stats(n) for n in HELPERS}
        res = [topo.finish(p, 90) for p in procs]
        end = {n: mc.stats(n) for n in HELPERS}
        drops, seen = pipeline_drops() - drops0, where_lost(testbed, mc)

        lost_at = [t for r in res for t in r["lost_at"]]
        print(f"\nlost: {len(lost_at)} of {sum(r['sent'] for r in res)} (s after 'off': "
              f"{[round(t - t_off, 3) for t in lost_at]}); OVS pipeline drops {drops}")
        for r in res:
            assert r["wrong"] == 0 and r["framing"] == 0, r
            assert r["sources"] == [mc.addr], r                       # replies from memcached's address, always
        # Nothing lost switching helpers in or out (the direct path loses none at this load: the first test).  Before
        # the controller kept a group one round longer than the flows using it, OVS dropped the 0-4 frames caught
        # between the select group's hash and its recirculation at each switch-off (drop_action_of_pipeline).
        at = [("load", t_on - 2.5), ("helpers on", t_on), ("order clients", t_order), ("order clients done", t_order_end),
              ("helpers off", t_off)]
        # Before 'on' the load runs on the direct path alone: a loss there is the direct path's own (once, 5
        # datagrams at the load's start: memcached's socket buffer, RcvbufErrors), allowed up to 0.1 % and printed.
        direct = [t for t in lost_at if t < t_on]
        switched = [t for t in lost_at if t >= t_on]
        sent = sum(r["sent"] for r in res)
        assert len(direct) <= sent // 1000, f"{len(direct)} of {sent} requests lost on the direct path (sent at " \
            f"{', '.join(after_step(at, t) for t in direct)}; {lost_report(seen0, seen)})"
        assert switched == [], f"{len(switched)} requests lost around the switches (sent at " \
            f"{', '.join(after_step(at, t) for t in switched)}; {lost_report(seen0, seen)})"
        for n in HELPERS:
            got = delta(during[n], before[n], "rx_get")
            assert got > 500, f"helper {n} got {got} gets while on: {during[n]}"
            assert delta(end[n], before[n], "w_done") == delta(end[n], before[n], "rx_dgrams"), \
                f"helper {n} left requests unanswered: {end[n]}"
            batches, keys = delta(during[n], before[n], "b_cmds"), delta(during[n], before[n], "b_keys")
            multi = sum(delta(during[n], before[n], f"hist_keys_{k}") for k in (4, 8, 16, 32, 64, 128, 256))
            assert keys > 1.2 * batches > 0 and multi > 0, \
                f"helper {n}: {keys} keys in {batches} multi-gets, {multi} of 4+ keys: not coalesced"
            assert delta(end[n], after_off[n], "rx_get") == 0, f"helper {n} still got gets after 'off'"
        # a client's set then get (and get then set) take effect in order, through the helpers
        assert order["violations"] == 0 and order["missing"] == 0 and order["checked"] > 0, order
        assert order["sources"] == [mc.addr]
        assert "h1" in status and "live" in status and "hand: on at" in status, status
        ranges = testbed.registry.ranges(SVC)
        assert ranges and all(not r.helpers for r, _ in ranges), ranges
        out = cli_ok(testbed, "helpers", "auto", SVC)         # the operator's 'off' held the ranges: handed back
        assert "back to the balancer" in out and not testbed.registry.holds(SVC)[0].holds, out
    finally:
        if testbed.registry.holds(SVC)[0].holds:   # failed before its own 'auto': leave the next tests no hold
            cli_ok(testbed, "helpers", "auto", SVC)


def test_controller_and_etcd_killed_while_helpers_carry_the_load(testbed, mc):
    """What outside testers do next: kill -9 the controller while helpers carry the load, start it again
    (it must keep the helpers' select groups, not drop and re-add them), then kill -9 etcd for a second and
    start it again (the agents and the endpoints must ride it out, their leases kept).  The clients keep their
    sockets throughout: nothing lost, nothing wrong, the helpers carry gets through every step."""
    drops0, seen0 = pipeline_drops(), where_lost(testbed, mc)
    # Longer than the steps can take on a busy machine (a restarted controller reached its switches 3.5 s
    # after its start in one full-suite run, and an 11 s load had ended before etcd's step): stopped below.
    procs = loads(mc, 60.0, 1500)
    time.sleep(1.5)
    at = [("load", time.time())]                        # when each step began: where a loss falls
    mc.helpers_on()
    at.append(("helpers on", time.time()))
    time.sleep(1.0)
    steps = [("helpers on", {n: mc.stats(n) for n in HELPERS})]
    at.append(("kill -9 controller", time.time()))
    testbed.kill_controller()
    time.sleep(1.5)                                     # the switches forward alone
    steps.append(("controller dead", {n: mc.stats(n) for n in HELPERS}))
    at.append(("start controller", time.time()))
    testbed.start_controller()
    testbed.wait_revision(testbed.registry.state_revision(), timeout=30)
    time.sleep(1.0)
    steps.append(("controller back", {n: mc.stats(n) for n in HELPERS}))
    groups = {b: group_weights(b) for b in ("vfbs1", "vfbs2")}
    at.append(("kill -9 etcd", time.time()))
    testbed.etcd.kill9()
    time.sleep(1.0)
    at.append(("start etcd", time.time()))
    testbed.etcd.start()
    time.sleep(2.0)
    steps.append(("etcd back", {n: mc.stats(n) for n in HELPERS}))
    live = control.live_helpers(testbed.registry, SVC)
    at.append(("helpers off", time.time()))
    mc.helpers_off()
    time.sleep(1.0)                                     # helpers switched off under load, too
    for p in procs:
        p.send_signal(signal.SIGTERM)
    res = [topo.finish(p, 90) for p in procs]
    drops, seen = pipeline_drops() - drops0, where_lost(testbed, mc)

    lost = sum(r["lost"] for r in res)
    print(f"\nlost {lost} of {sum(r['sent'] for r in res)}; OVS pipeline drops {drops}; gets per step: " +
          ", ".join(f"{name}: {sum(delta(st[n], prev[n], 'rx_get') for n in HELPERS)}"
                    for (name, st), (_, prev) in zip(steps[1:], steps)))
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
    lost_at = sorted(t for r in res for t in r["lost_at"])
    assert lost == 0, f"{lost} requests lost across the restarts ({lost_report(seen0, seen)}); sent at " + \
        ", ".join(after_step(at, t) for t in lost_at)
    for (name, st), (_, prev) in zip(steps[1:], steps):
        for n in HELPERS:
            assert delta(st[n], prev[n], "rx_get") > 100, f"helper {n} carried no gets until '{name}': {st[n]}"
    for bridge, got in groups.items():   # the restarted controller kept one group with both helpers' buckets
        assert len(got) == 1 and len(got[0]) == 2, f"{bridge} groups after the controller's restart: {got}"
    assert live == ["h1", "h2"], f"live helpers after etcd's restart: {live}"
    assert control.live_helpers(testbed.registry, SVC) == ["h1", "h2"]



def test_every_lease_expiring_at_once_loses_nothing(testbed, mc):
    """A machine paused past the endpoints' leases (a VM its host stalled for > 2 s) resumes to an etcd that
    expires every lease at once: memcached's record and both helpers' go, and each agent registers again at
    its next keep-alive.  Here the leases are revoked together under load, as etcd does then.  Before the
    controller let a departed owner linger (--linger), the switches had no route for the range and guarded
    memcached's answers until the records were back: 407 requests lost in ~40 ms in one run of the hold test
    below (drop_action_of_pipeline)."""
    reg = testbed.registry
    mc.helpers_on()
    seen0 = where_lost(testbed, mc)
    procs = loads(mc, 60.0, 1500)                      # stopped below, once the records are back
    time.sleep(1.5)
    keys = [schema.endpoint_key(SVC, n) for n in (mc.memcached.name, *HELPERS)]
    leases = {k: reg.lease_of(k) for k in keys}
    assert all(leases.values()), leases
    t_revoke = time.time()
    for lease in set(leases.values()):
        reg.revoke(lease)
    wait_for(lambda: all(reg.lease_of(k) not in (None, leases[k]) for k in keys), 10,
             "every endpoint to register again under a new lease")
    t_back = time.time()
    testbed.wait_revision(reg.state_revision())
    time.sleep(1.0)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    res = [topo.finish(p, 90) for p in procs]
    seen = where_lost(testbed, mc)
    mc.helpers_off()
    lost_at = sorted(t for r in res for t in r["lost_at"])
    print(f"\nevery lease revoked: registered again after {t_back - t_revoke:.2f} s; lost {len(lost_at)} of "
          f"{sum(r['sent'] for r in res)}")
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
    assert lost_at == [], f"{len(lost_at)} requests lost (sent {[round(t - t_revoke, 3) for t in lost_at[:20]]} s " \
        f"after the revoke; {lost_report(seen0, seen)})"


def test_forged_memcached_replies_reach_no_client(testbed, mc):
    """A tenant on a client host forges memcached's replies (source memcached's address and port 11211, a
    guessed 16-bit request id, to another client's address): before the guard they reached that client
    through the plain-Ethernet flows, and a memcached UDP client takes the first datagram with its request
    id.  The switches drop them at the tenant's port and count them; the real replies still arrive."""
    from ipaddress import IPv4Address

    from tests.integration.conftest import frames_seen, guard_drops
    from vfab.services.sdhcp import ipudp
    from vfab.vid import codec

    rogue_host, victim_host = "vfh3", "vfh4"
    rogue = codec.mac_to_int(testbed.hosts[rogue_host]["mac"]).to_bytes(6, "big")
    victim_mac = codec.mac_to_int(testbed.hosts[victim_host]["mac"]).to_bytes(6, "big")
    victim_ip = mc.bind[victim_host].split(",")[0]
    sid = testbed.registry.service(SVC).id
    before = guard_drops(testbed, sid)
    body = b"\x00\x00\x00\x01\x00\x00VALUE k1 0 6\r\nforged\r\nEND\r\n"   # memcached's UDP header after the id
    forged = [ipudp.Datagram(victim_mac, rogue, IPv4Address(mc.ip), IPv4Address(victim_ip), 11211, 40000 + i,
                             i.to_bytes(2, "big") + body).serialize() for i in range(60)]
    got = frames_seen(testbed, rogue_host, forged, victim_host)
    assert got == 0, f"{got} of {len(forged)} forged replies reached {victim_host}"
    wait_for(lambda: guard_drops(testbed, sid) >= before + len(forged), 20,
             f"the switches to count the {len(forged)} forged replies (guard/{sid})")
    # the real replies (memcached's, directly) still reach the clients
    res = [topo.finish(p, 60) for p in loads(mc, 1.0, 300, clients=4)]
    for r in res:
        assert r["answered"] == r["sent"] > 0 and r["wrong"] == 0 and r["sources"] == [mc.addr], r


def test_requests_from_another_hosts_address_reflect_to_no_one(testbed, mc):
    """A tenant on a client host sends memcached gets from another client's address (its own MAC, so port
    security lets them pass): memcached (or a helper) answered that client, a reflection that memcached's
    multi-gets amplify.  The hosts are registered with their addresses (the testbed, ``client_addresses``),
    so the switches drop such requests at the tenant's port and count them; its own addresses still work."""
    from ipaddress import IPv4Address

    from tests.integration.conftest import frames_seen, guard_drops
    from vfab.services.sdhcp import ipudp
    from vfab.vid import codec

    rogue_host, victim_host = "vfh3", "vfh4"
    rogue = codec.mac_to_int(testbed.hosts[rogue_host]["mac"]).to_bytes(6, "big")
    mc_mac = bytes.fromhex(testbed.hosts[mc.host]["mac"].replace(":", ""))
    victim_ip = mc.bind[victim_host].split(",")[0]
    sid = testbed.registry.service(SVC).id
    before = guard_drops(testbed, sid, "spoofed")
    server = IPv4Address(mc.ip)
    spoofed = [ipudp.Datagram(mc_mac, rogue, IPv4Address(victim_ip), server, 45000 + i, 11211,
                              i.to_bytes(2, "big") + b"\x00\x00\x00\x01\x00\x00get k1 k2 k3 k4\r\n").serialize()
               for i in range(60)]

    def reply(f: bytes) -> bool:   # memcached's (or a helper's) answer to one of them
        try:
            dg = ipudp.parse(f, verify=False)
        except Exception:  # noqa: BLE001 - anything else on the victim's port is not an answer
            return False
        return dg.src_ip == server and dg.src_port == 11211 and 45000 <= dg.dst_port < 45060

    got = frames_seen(testbed, rogue_host, spoofed, victim_host, seen=reply)
    assert got == 0, f"{got} answers to {len(spoofed)} requests sent from {victim_ip} by {rogue_host} reached {victim_host}"
    wait_for(lambda: guard_drops(testbed, sid, "spoofed") >= before + len(spoofed), 20,
             f"the switches to count the {len(spoofed)} spoofed requests (spoofed/{sid})")
    assert "spoofed" in cli_ok(testbed, "services")   # the column 'vfab services' shows the count in
    # the same requests from the rogue host's own registered address are answered
    own_ip = mc.bind[rogue_host].split(",")[0]
    own = [ipudp.Datagram(mc_mac, rogue, IPv4Address(own_ip), server, 45000 + i, 11211,
                          i.to_bytes(2, "big") + b"\x00\x00\x00\x01\x00\x00get k1\r\n").serialize() for i in range(20)]
    assert frames_seen(testbed, rogue_host, own, rogue_host, seen=reply) > 0
    res = [topo.finish(p, 60) for p in loads(mc, 1.0, 300, clients=4)]
    for r in res:
        assert r["answered"] == r["sent"] > 0 and r["wrong"] == 0, r


def group_weights(bridge: str) -> list[dict[str, int]]:
    """Per select group on ``bridge`` (ovs-ofctl dump-groups): bucket eth_dst MAC -> weight."""
    out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-groups", bridge], capture_output=True, text=True,
                         check=True).stdout
    groups = []
    for ln in out.splitlines():
        if "type=select" not in ln:
            continue
        got = {}
        for b in ln.split("bucket=")[1:]:
            w = int(b.split("weight:")[1].split(",")[0])
            mac = b.split("set_field:")[1].split("->eth_dst")[0]
            got[mac] = w
        groups.append(got)
    return groups


def test_bucket_weights_reach_ovs(testbed, mc):
    """'vfab helpers on --weight' (the balancer writes the same field, ∝ spare capacity): the weights are in the
    range record, in 'vfab helpers', on every switch's select group, and the weighted helper gets more clients."""
    out = cli_ok(testbed, "helpers", "on", SVC, "--weight", "h1=90", "--weight", "h2=30")
    assert "weights h1=90,h2=30" in out and "applied on all switches" in out, out
    macs = {n: testbed.registry.get(schema.endpoint_key(SVC, n)) for n in HELPERS}
    macs = {schema.Endpoint.from_json(v[0]).mac: n for n, v in macs.items()}
    for bridge in testbed.switches:
        (got,) = group_weights(bridge)
        assert {macs[m]: w for m, w in got.items()} == {"h1": 90, "h2": 30}, (bridge, got)
    status = cli_ok(testbed, "helpers", SVC)
    assert "h1 w90 (75%)" in status and "h2 w30 (25%)" in status, status
    before = {n: mc.stats(n) for n in HELPERS}
    res = [topo.finish(p, 60) for p in loads(mc, 2.0, 600, clients=12)]
    share = {n: delta(mc.stats(n), before[n], "rx_get") for n in HELPERS}
    print(f"\nweights h1=90 h2=30: gets h1 {share['h1']}, h2 {share['h2']} (12 client addresses)")
    assert all(r["lost"] == 0 and r["wrong"] == 0 for r in res), res
    assert share["h1"] > share["h2"] > 0, share
    mc.helpers_off()
    # the group leaves one round after the route: the switches end with no group at all
    wait_for_groups = time.monotonic() + 5
    while any(group_weights(b) for b in testbed.switches) and time.monotonic() < wait_for_groups:
        time.sleep(0.05)
    assert not any(group_weights(b) for b in testbed.switches), "a group outlived its range's helpers"
    cli_ok(testbed, "helpers", "auto", SVC)


# The balancer's settings for this testbed (controller/balancer.py, "Or by the helpee's request rate"): the
# largest burst here keeps memcached at rho ~0.15, where the p99 model sees no queue, so helpers go on above
# RATE_ON requests/s and off below RATE_OFF; windows short enough for a test.
BALANCER = {"period": 0.1, "stale_after": 1.0, "min_interval": 0.5, "burst_window": 0.3, "calm_window": 1.5,
            "min_on": 2.0, "min_off": 1.0, "rate_on": 5000, "rate_off": 2500, "helper_capacity": 8000}


def test_balancer_switches_helpers_by_itself(testbed, mc):
    """A burst starts; 'vfab balancer run' turns the helpers on by itself (from memcached's own stats), the burst
    ends, and it turns them off after the calm window.  The same client processes and sockets throughout; no
    request lost, none wrong, per-client order held across both switches."""
    reg = testbed.registry
    ranges = reg.ranges(SVC)
    assert ranges and all(not r.helpers for r, _ in ranges)
    assert not reg.holds(SVC)[0].holds, "an earlier test left a hold: the balancer would leave the ranges alone"
    seen0 = where_lost(testbed, mc)
    bal = mc.start_balancer(BALANCER)
    try:
        calm = [mc.client(h, "load", "--clients", "8", "--rate", "150", "--duration", "14", "--keys", str(KEYS),
                          "--drain", "1.5", "--bind", mc.bind[h]) for h in CLIENTS]
        # paced (<= 500 requests/s): back to back, one client alone offers ~1,900/s on a quiet machine, which
        # with the calm load crossed RATE_ON before any burst
        order = mc.client("vfh6", "order", "--clients", "1", "--rounds", "1000000", "--duration", "13",
                          "--timeout", "0.5", "--gap", "0.01", "--bind", mc.bind["vfh6"])
        time.sleep(2.0)
        assert mc.decisions() == [], f"helpers on before any burst: {mc.decisions()}"
        t_burst = time.time()
        burst = loads(mc, 4.0, 3000)
        wait = time.monotonic() + 4
        while not any(d["action"] == "helpers_on" for d in mc.decisions()) and time.monotonic() < wait:
            time.sleep(0.02)
        on = next((d for d in mc.decisions() if d["action"] == "helpers_on"), None)
        assert on is not None, f"no helpers_on within 4 s of the burst: {mc.balancer_view()}"
        rec = next(r for r, _ in reg.ranges(SVC))
        assert sorted(rec.helpers) == ["h1", "h2"] and set(rec.weights) <= {"h1", "h2"}, rec
        mid = {n: mc.stats(n) for n in HELPERS}
        res_burst = [topo.finish(p, 60) for p in burst]
        t_end = time.time()
        end = {n: mc.stats(n) for n in HELPERS}
        wait = time.monotonic() + 8
        while not any(d["action"] == "helpers_off" for d in mc.decisions()) and time.monotonic() < wait:
            time.sleep(0.05)
        off = next((d for d in mc.decisions() if d["action"] == "helpers_off"), None)
        assert off is not None, f"helpers never went off after the burst: {mc.balancer_view()}"
        t_off_seen = time.time()
        res_calm = [topo.finish(p, 60) for p in calm]
        ordered = topo.finish(order, 60)
        after = {n: mc.stats(n) for n in HELPERS}
        seen = where_lost(testbed, mc)
    finally:
        testbed.sup.stop(bal)
    log = open(bal.logpath).read()
    assert "Traceback" not in log, log[-3000:]
    ds = mc.decisions()
    print(f"\nbalancer: on {on['at'] - t_burst:.2f} s after the burst began ({on['reason']}); off "
          f"{off['at'] - t_end:.2f} s after it ended ({off['reason']}); weights {on['weights']}")
    print(f"burst: {sum(r['answered'] for r in res_burst)}/{sum(r['sent'] for r in res_burst)} answered, p99 "
          f"{max(r['p99_us'] for r in res_burst):.0f} µs; calm clients: "
          f"{sum(r['answered'] for r in res_calm)}/{sum(r['sent'] for r in res_calm)}; order: {ordered}")
    assert [d["action"] for d in ds] == ["helpers_on", "helpers_off"], ds
    assert all(d["result"] == "done" for d in ds), ds
    assert "requests/s > 5000" in on["reason"] and on["at"] - t_burst < 2.0, on
    assert off["at"] > t_end and "requests/s < 2500" in off["reason"], off
    ranges = reg.ranges(SVC)
    assert ranges and all(not r.helpers and not r.weights for r, _ in ranges)
    for r in res_burst + res_calm:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
        assert r["lost"] == 0, f"lost {r['lost']} (sent {r['lost_at'][0] - on['at']:.3f}-" \
            f"{r['lost_at'][-1] - on['at']:.3f} s after 'on', 'off' at +{off['at'] - on['at']:.3f} s; " \
            f"{lost_report(seen0, seen)})"
    for n in HELPERS:
        assert delta(end[n], mid[n], "rx_get") > 500, f"helper {n} carried no burst: {end[n]}"
    assert t_off_seen > 0 and sum(delta(after[n], end[n], "rx_get") for n in HELPERS) < \
        sum(delta(end[n], mid[n], "rx_get") for n in HELPERS)
    assert ordered["violations"] == 0 and ordered["missing"] == 0 and ordered["checked"] > 0, \
        f"{ordered}; {lost_report(seen0, seen)}"


def test_an_operators_hold_stands_against_the_balancer(testbed, mc):
    """'vfab helpers off' by hand holds the ranges: a burst that turns helpers on within ~1 s otherwise
    (the test above) leaves them off for as long as the hold lasts; 'vfab helpers auto' hands the ranges back
    and the balancer then switches the helpers on by itself, in the same burst."""
    reg = testbed.registry
    out = cli_ok(testbed, "helpers", "off", SVC)
    assert "held (off by hand)" in out, out
    seen0 = where_lost(testbed, mc)
    bal = mc.start_balancer(BALANCER)
    try:
        burst = loads(mc, 7.0, 3000)
        time.sleep(3.0)
        assert mc.decisions() == [], f"the balancer overruled the operator's hold: {mc.decisions()}"
        held = reg.ranges(SVC)
        assert held and all(not r.helpers for r, _ in held), held
        t_auto = time.time()
        out = cli_ok(testbed, "helpers", "auto", SVC)
        assert "back to the balancer" in out, out
        wait = time.monotonic() + 3
        while not any(d["action"] == "helpers_on" for d in mc.decisions()) and time.monotonic() < wait:
            time.sleep(0.02)
        on = next((d for d in mc.decisions() if d["action"] == "helpers_on"), None)
        assert on is not None, f"no helpers_on within 3 s of 'auto' in a burst: {mc.balancer_view()}"
        res = [topo.finish(p, 60) for p in burst]
        seen = where_lost(testbed, mc)
    finally:
        testbed.sup.stop(bal)
    print(f"\nhold: no decision in 3 s of burst; after 'auto', helpers on in {on['at'] - t_auto:.2f} s")
    assert "Traceback" not in open(bal.logpath).read()
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0, r
        assert r["lost"] == 0, f"lost {r['lost']} of {r['sent']} (sent {r['lost_at'][0] - on['at']:.3f}-" \
            f"{r['lost_at'][-1] - on['at']:.3f} s after 'on'; {lost_report(seen0, seen)})"
    cli_ok(testbed, "helpers", "off", SVC, "--no-hold")   # the balancer is gone: back to direct, no hold
    after = reg.ranges(SVC)
    assert after and all(not r.helpers for r, _ in after) and not reg.holds(SVC)[0].holds, after


def test_helper_killed_under_load(testbed, mc):
    """kill -9 of a helper's mc-helper under load: its bucket leaves the group, its clients hash to the other
    helper without reconnecting, per-client order holds; the recovery is measured from the clients' side."""
    mc.helpers_on()
    procs = loads(mc, 7.0, 1500, timeline=0.05)
    order = mc.client("vfh6", "order", "--clients", "8", "--rounds", "100000", "--duration", "7", "--timeout", "0.5",
                      "--bind", mc.bind["vfh6"])
    time.sleep(2.5)
    before = {n: mc.stats(n) for n in HELPERS}
    time.sleep(0.5)
    mid = {n: mc.stats(n) for n in HELPERS}
    assert all(delta(mid[n], before[n], "rx_get") > 0 for n in HELPERS), "both helpers must carry traffic"
    agent = mc.helpers["h1"].agent
    t_kill = mc.kill_helper("h1")
    t_gone = mc.endpoint_gone("h1", 5.0)
    applied = testbed.wait_revision(testbed.registry.state_revision())
    res = [topo.finish(p, 90) for p in procs]
    ordered = topo.finish(order, 60)
    agent.popen.wait(10)
    assert agent.popen.returncode == 1, "the agent must exit 1 when its mc-helper dies"
    testbed.untrack(mc.helpers["h1"].pid)
    mc.stop(mc.helpers["h1"])
    assert control.live_helpers(testbed.registry, SVC) == ["h2"]
    assert testbed.registry.get(schema.helper_key(SVC, "h1")) is None

    recovery = 0.0
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
        for ci, start, length in r["gaps"]:
            if start <= t_kill + 0.05 and start + length >= t_kill:
                recovery = max(recovery, length)
        # every client is served again after the recovery (none stuck on the dead helper's bucket)
        assert min(r["last_answer"]) > t_kill + RECOVERY_BOUND_S, r["last_answer"]
        assert r["lost"] < 0.05 * r["sent"], r
    print(f"\nkill -9 h1: endpoint gone from etcd after {(t_gone - t_kill) * 1e3:.0f} ms, switches applied "
          f"{applied * 1e3:.0f} ms later; longest client pause around the kill {recovery * 1e3:.0f} ms; lost "
          f"{sum(r['lost'] for r in res)} of {sum(r['sent'] for r in res)}")
    assert 0 < recovery < RECOVERY_BOUND_S, f"clients of the killed helper waited {recovery:.3f} s"
    # h2 now carries everyone
    st = mc.stats("h2")
    assert delta(st, mid["h2"], "rx_get") > delta(mid["h2"], before["h2"], "rx_get")
    # per-client order across the failure: requests lost with h1 are missing answers, never reordered ones
    assert ordered["violations"] == 0 and ordered["checked"] > 0, ordered
    mc.helpers_off()
    assert os.path.exists(mc.memcached.agent.logpath)


def both_helpers_on(mc) -> None:
    """h1 and h2 live (an earlier test may have killed h1) and switched in."""
    if "h1" not in mc.helpers:
        mc.start_helper("h1", HELPERS["h1"], extra=HELPER_OPTS)
    mc.helpers_on()


def test_helper_host_lost_lease_expires(testbed, mc):
    """A helper host lost whole (kill -9 of agent and mc-helper together: nobody revokes the lease): its bucket
    leaves the group when the lease expires (TTL 2 s), and its clients move to the other helper then."""
    both_helpers_on(mc)
    procs = loads(mc, 6.0, 1000, timeline=0.05)
    time.sleep(2.0)
    run = mc.helpers["h1"]
    t_kill = time.time()
    os.kill(run.agent.pid, 9)
    os.kill(run.pid, 9)
    t_gone = mc.endpoint_gone("h1", 10.0)
    res = [topo.finish(p, 90) for p in procs]
    run.agent.popen.wait(5)
    testbed.untrack(run.pid)
    mc.stop(run)
    recovery = max((length for r in res for _, start, length in r["gaps"]
                    if start <= t_kill + 0.05 and start + length >= t_kill), default=0.0)
    print(f"\nkill -9 of h1's agent and mc-helper: lease expired, endpoint gone after {t_gone - t_kill:.2f} s; "
          f"longest client pause {recovery:.2f} s")
    assert 1.0 < t_gone - t_kill < 2 + 1.5, "the endpoint must go by lease expiry (TTL 2 s), not before"
    assert recovery < (t_gone - t_kill) + RECOVERY_BOUND_S
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0, r
        assert min(r["last_answer"]) > t_gone, "a client was left on the dead helper after its lease expired"
    mc.helpers_off()


def test_helper_stopped_under_load_is_withdrawn_and_comes_back(testbed, mc):
    """SIGSTOP of a helper's mc-helper under load (it lives, so nothing exits and its lease stays): its agent
    sees the stats file stop advancing (--stale, 1 s) and withdraws it; its clients move to the other helper
    without reconnecting, none is left on the stopped one, nothing wrong is answered.  SIGCONT: the agent
    announces it again by itself and it carries gets again."""
    both_helpers_on(mc)
    # Longer than the steps can take on a busy machine (a 9 s load had ended before h2 came back in one run):
    # stopped below, once h2 has been back for a while.
    procs = loads(mc, 60.0, 1000, timeline=0.05)
    time.sleep(2.0)
    run = mc.helpers["h2"]
    t_stop = time.time()
    os.kill(run.pid, signal.SIGSTOP)
    try:
        t_gone = mc.endpoint_gone("h2", 10.0)
        testbed.wait_revision(testbed.registry.state_revision())
        time.sleep(1.0)
    finally:
        os.kill(run.pid, signal.SIGCONT)
    t_cont = time.time()
    wait_for(lambda: control.live_helpers(testbed.registry, SVC) == ["h1", "h2"], 10,
             "h2 to be announced again after SIGCONT")
    t_back = time.time()
    testbed.wait_revision(testbed.registry.state_revision())
    back = mc.stats("h2")
    time.sleep(2.0)                                     # the load goes on through h2 again
    for p in procs:
        p.send_signal(signal.SIGTERM)
    res = [topo.finish(p, 90) for p in procs]
    end = mc.stats("h2")
    assert run.agent.alive(), "the agent must stay and announce its helper again"
    agent_log = open(run.agent.logpath).read()
    assert "has not changed for" in agent_log and "announcing it again" in agent_log, agent_log[-2000:]
    recovery = max((length for r in res for _, start, length in r["gaps"]
                    if start <= t_stop + 0.05 and start + length >= t_stop), default=0.0)
    print(f"\nSIGSTOP of h2's mc-helper: withdrawn after {t_gone - t_stop:.2f} s; longest client pause "
          f"{recovery:.2f} s; SIGCONT: announced again after {t_back - t_cont:.2f} s; lost "
          f"{sum(r['lost'] for r in res)} of {sum(r['sent'] for r in res)}")
    assert t_gone - t_stop < 1.0 + 1.5, "the stalled helper must be withdrawn about --stale s after it stopped"
    assert recovery < (t_gone - t_stop) + RECOVERY_BOUND_S
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
        assert min(r["last_answer"]) > t_gone, "a client was left on the stopped helper after it was withdrawn"
    assert delta(end, back, "rx_get") > 100, f"h2 carried no gets after it came back: {end}"
    mc.helpers_off()


def leg_drops_everything(testbed, host: str, on: bool) -> None:
    """Make the helper host's own kernel traffic (its TCP leg to memcached) lose every segment, or heal it: a
    ``pfifo limit 0`` qdisc on its fabric port (this kernel has no netem).  mc-helper's replies leave through
    af_packet, which bypasses the qdisc (DPDK's qdisc_bypass), so only the leg stalls."""
    cmd = ["tc", "qdisc", "add" if on else "del", "dev", testbed.hosts[host]["iface"], "root"]
    subprocess.run(["nsenter", f"--net={testbed.netns(host)}", "--", *cmd, *(["pfifo", "limit", "0"] if on else [])],
                   check=True, capture_output=True)


def h2_rejoins_then_stop(testbed, mc, procs: list, timeout: float) -> tuple[float, dict, list, dict]:
    """Once h2's leg healed: wait until h2 is announced again, let the load run through it for 1.5 s, stop the
    clients.  (when h2 was back, its stats then, the clients' results, its stats at the end)"""
    wait_for(lambda: control.live_helpers(testbed.registry, SVC) == ["h1", "h2"], timeout,
             "h2 to be announced again once its leg healed")
    t_back = time.time()
    testbed.wait_revision(testbed.registry.state_revision())
    back = mc.stats("h2")
    time.sleep(1.5)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    return t_back, back, [topo.finish(p, 90) for p in procs], mc.stats("h2")


def test_a_helper_whose_leg_stalls_gives_its_clients_back_and_rejoins(testbed, mc):
    """Issue 43's wedge on the fabric: h2's TCP leg to memcached loses every segment under load (data stuck in
    its send queue, TCP backing off).  h2 must notice within 100 ms, its agent withdraw it (the reason shown by
    ``vfab helpers``), its clients be answered through h1 within 200 ms, h2 not spin meanwhile, and h2 rejoin by
    itself once the leg heals.  (Before issue 43 it stayed in the group answering nothing: this fails there.)"""
    from vfab.vid.state.sched import run_seconds
    both_helpers_on(mc)
    procs = loads(mc, 60.0, 1000, timeline=0.05)
    time.sleep(2.0)
    run = mc.helpers["h2"]
    assert mc.stats("h2").get("serving") == 1
    t_stall, t0 = time.time(), time.monotonic()
    leg_drops_everything(testbed, HELPERS["h2"], True)
    try:
        t_gone = mc.endpoint_gone("h2", 5.0)
        # the agent writes why right after it withdrew the endpoint
        wait_for(lambda: testbed.registry.get(schema.helper_key(SVC, "h2")) is not None, 2,
                 "h2's agent to write why it withdrew it")
        down = testbed.registry.get(schema.helper_key(SVC, "h2"))
        shown = cli_ok(testbed, "helpers", SVC)
        st = mc.stats("h2")
        cpu0, w0 = run_seconds(run.pid), time.monotonic()
        testbed.wait_revision(testbed.registry.state_revision())
        time.sleep(1.0)
        cpu = (run_seconds(run.pid) - cpu0) / (time.monotonic() - w0)
    finally:
        leg_drops_everything(testbed, HELPERS["h2"], False)
    t_heal = time.time()
    t_back, back, res, end = h2_rejoins_then_stop(testbed, mc, procs, 10)
    noticed = st["down_at_mono_ms"] / 1e3 - t0
    served = max((length for r in res for _, start, length in r["gaps"]
                  if start <= t_stall + 0.05 and start + length >= t_stall), default=0.0)
    print(f"\nh2's leg stalled: noticed after {noticed * 1e3:.0f} ms, withdrawn (endpoint gone) after "
          f"{(t_gone - t_stall) * 1e3:.0f} ms; longest client pause {served * 1e3:.0f} ms; h2's CPU while "
          f"withdrawn {cpu:.3f} core; announced again {t_back - t_heal:.2f} s after the leg healed; lost "
          f"{sum(r['lost'] for r in res)} of {sum(r['sent'] for r in res)}\n{shown}")
    assert st.get("serving") == 0 and st.get("stalls", 0) >= 1, st
    assert noticed < 0.1, f"h2 noticed its stalled leg after {noticed:.3f} s"
    assert "connection(s) down" in schema.HelperStatus.from_json(down[0], "h2").down, down
    assert "h2 does not serve (withdrawn by its agent)" in shown, shown
    assert served < 0.2, f"h2's clients waited {served:.3f} s for h1"
    assert cpu < 0.3, f"h2 spun at {cpu:.2f} of a core while it could not serve"
    assert t_back - t_heal < 3.0
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
        assert min(r["last_answer"]) > t_back, "a client stopped being answered"
    assert delta(end, back, "rx_get") > 100, f"h2 carried no gets after it rejoined: {end}"
    mc.helpers_off()


def test_a_flapping_leg_does_not_flap_the_helper(testbed, mc):
    """Issue 43, re-admission with hysteresis: under load, h2's leg fails 5 times in a row (0.3 s losing every
    segment, 0.7 s healed).  h2 is withdrawn at the first failure; its agent announces it again only after it
    has served without interruption for a hold that doubles with each withdrawal within 30 s (0.5, 1, 2, 4 s;
    ``readmit.py``), and mc-helper probes an idle connection every 4 stall bounds, so the leg failing again
    while h2 carries no client is noticed too.  So while the leg flaps h2 comes back at most once, and once
    the leg stays healed it comes back by itself.  Before, it was announced again as soon as a reconnect's
    probe was answered (after each heal), and a leg that died while h2 was out went unnoticed until clients
    came back to it."""
    both_helpers_on(mc)
    procs = loads(mc, 60.0, 1000, timeline=0.05)
    time.sleep(1.5)
    run = mc.helpers["h2"]
    assert mc.stats("h2").get("serving") == 1
    announced0 = open(run.agent.logpath).read().count("announcing it again")
    st0 = mc.stats("h2")
    broken = False
    try:
        for _ in range(5):
            leg_drops_everything(testbed, HELPERS["h2"], True)
            broken = True
            time.sleep(0.3)
            leg_drops_everything(testbed, HELPERS["h2"], False)
            broken = False
            time.sleep(0.7)
    finally:
        if broken:
            leg_drops_everything(testbed, HELPERS["h2"], False)
    t_heal = time.time()
    flapping = open(run.agent.logpath).read().count("announcing it again") - announced0
    st1 = mc.stats("h2")
    t_back, back, res, end = h2_rejoins_then_stop(testbed, mc, procs, 15)
    print(f"\nh2's leg flapped 5 times (0.3 s down, 0.7 s up): stalls {delta(st1, st0, 'stalls')}, keepalives "
          f"{delta(st1, st0, 'keepalives')}, announced again {flapping} time(s) while flapping, then "
          f"{t_back - t_heal:.2f} s after the last heal; lost {sum(r['lost'] for r in res)} of "
          f"{sum(r['sent'] for r in res)}")
    assert delta(st1, st0, "stalls") >= 2, f"the flapping leg was noticed fewer than twice: {st1}"
    assert flapping <= 1, f"h2 was announced again {flapping} times while its leg flapped"
    assert t_back - t_heal < 8.0 + 3.0, "h2 must come back within the longest hold once its leg stays healed"
    for r in res:
        assert r["wrong"] == 0 and r["framing"] == 0 and r["sources"] == [mc.addr], r
        assert min(r["last_answer"]) > t_back, "a client stopped being answered"
    assert delta(end, back, "rx_get") > 100, f"h2 carried no gets after it rejoined: {end}"
    mc.helpers_off()


def test_memcached_agent_stopped_past_its_lease_comes_back(testbed, mc):
    """SIGSTOP of memcached's agent for longer than its 2 s lease (memcached itself runs on): the endpoint
    expires and the switches stop delivering (the range has no live owner).  SIGCONT: the agent finds its
    lease gone and announces again by itself, and clients are answered again within a second."""
    run = mc.memcached
    t_stop = time.time()
    os.kill(run.agent.pid, signal.SIGSTOP)
    try:
        t_gone = mc.endpoint_gone(run.name, 10.0)
    finally:
        os.kill(run.agent.pid, signal.SIGCONT)
    t_cont = time.time()
    wait_for(lambda: run.name in {e.name for e in testbed.registry.endpoints(SVC)}, 10,
             f"{run.name} to announce itself again after SIGCONT")
    t_back = time.time()
    testbed.wait_revision(testbed.registry.state_revision())
    print(f"\nmemcached's agent stopped: endpoint gone {t_gone - t_stop:.2f} s later; announced again "
          f"{t_back - t_cont:.2f} s after SIGCONT")
    assert t_back - t_cont < 1.5
    res = [topo.finish(p, 60) for p in loads(mc, 1.0, 300, clients=4)]
    for r in res:
        assert r["answered"] == r["sent"] > 0 and r["wrong"] == 0 and r["sources"] == [mc.addr], r
    log_text = open(run.agent.logpath).read()
    assert log_text.count("keepalive failed") <= 3, "the dead lease's keepalive must stop, not log forever"


SIZES = "100,1400,1500,3000,9000,20000,60000"   # value sizes in turn; multi-gets near them (mcudp order --sizes)


def test_large_requests_follow_their_client_through_helpers_on_off_on(testbed, mc):
    """Issue 43, item 4: requests from ~100 B to ~60 KB (sets of large values, multi-gets of up to 250 keys),
    the large ones in IP fragments, pipelined by the same clients (set then get, get then set) while helpers
    are on, off and on again: every answer right and in each client's order, all from memcached's address.
    Before, the door matched ``udp_dst`` only: OVS zeroes the ports of fragments, so a large request went
    straight to memcached while the client's small ones waited in a helper's batch (order broken); and a helper
    could not take a request longer than one 2 KB frame (the kernel reassembles fragments for af_packet)."""
    def run() -> dict:
        return topo.finish(mc.client("vfh4", "order", "--clients", "4", "--rounds", "7", "--sizes", SIZES,
                                     "--prefix", "frag", "--timeout", "2", "--bind", mc.bind["vfh4"]), 180)

    def helper_stats() -> dict:
        """Each helper's counters from a stats file written after this call (they are written every 50 ms)."""
        t0 = {n: mc.stats(n).get("uptime_ms", 0) for n in HELPERS}
        wait_for(lambda: all(mc.stats(n).get("uptime_ms", 0) >= t0[n] + 120 for n in HELPERS), 5,
                 "the helpers' stats files to be written again")
        return {n: mc.stats(n) for n in HELPERS}

    phases = {}
    s0 = helper_stats()
    phases["direct"] = run()
    try:
        mc.helpers_on()
        s1 = helper_stats()
        phases["on"] = run()
        s2 = helper_stats()
        mc.helpers_off()
        phases["off"] = run()
        s3 = helper_stats()
        mc.helpers_on()
        phases["on again"] = run()
        s4 = helper_stats()
    finally:
        mc.helpers_off()
    requests = 4 + 7 * 4 * 5          # mcudp order: an initial set per client, then 5 requests per client and round
    got = {n: {"on": delta(s2[n], s1[n], "rx_dgrams"), "off": delta(s3[n], s2[n], "rx_dgrams"),
               "on again": delta(s4[n], s3[n], "rx_dgrams"),
               **{k: delta(s4[n], s0[n], k) for k in ("net_truncated", "net_fragment", "relay_sent", "w_done",
                                                      "rx_dgrams", "relay_noconn", "stalls", "disconnects",
                                                      "drop_busy", "drop_noconn", "close_order", "ord_held",
                                                      "ord_filled", "ord_expired", "ord_late")}}
           for n in HELPERS}
    print(f"\nmixed sizes {SIZES}: " + "; ".join(f"{k}: checked {r['checked']}, violations {r['violations']}, "
                                                   f"missing {r['missing']} {r['examples']}" for k, r in phases.items())
          + f"\nhelpers: {got}")
    for name, r in phases.items():
        assert r["sources"] == [mc.addr], (name, r)
        if name.startswith("on"):
            assert r["missing"] == 0 and r["checked"] == 4 * 7 * 2, (name, r)
            # Strict: the switch may hand a helper a client's fragmented set ahead of the small get sent before it
            # (OVS's datapath executes a receive batch flow by flow); the helper serves a client's requests in
            # the order of their request ids (mch_order.c).  Without that (mc-helper --order-hold-us 0, the
            # code before) 1-2 of these 56 pairs came back reordered in a phase in 3 of 7 runs of the previous
            # session and in the first run of this one (2026-12-07: "on" 1, "off" 1 and direct 1, always c3).
            assert r["violations"] == 0, (name, r)
    # Direct (before, and while off) is memcached's own UDP, not the fabric's doing: it lost 4 and reordered 1 of
    # these 56 pairs in a run on 2026-12-07 (a 60 KB datagram's answer missing, a get overtaking a set); printed.
    # every request of the client, the large ones too, went through a helper while helpers were on
    for phase, want in (("on", requests), ("off", 0), ("on again", requests)):
        assert sum(g[phase] for g in got.values()) == want, f"{phase}: helpers got {got}, {want} requests sent"
    for n in HELPERS:
        assert got[n]["net_truncated"] == got[n]["net_fragment"] == 0, got
        assert got[n]["w_done"] == got[n]["rx_dgrams"], f"helper {n} left requests unanswered: {got[n]}"
