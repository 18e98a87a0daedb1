"""controller/engine.py without a switch: etcd items + switch dumps → ordered commits, pauses, reports.

Fabric: a line of three switches, two hosts each (host port 1 and 2; trunks 10/11)::

    hA1 hA2          hB1 hB2          hC1 hC2
      s1 ─p10══p11─ s2 ─p10══p11─ s3
"""

from __future__ import annotations

import random
import re

import pytest

from vfab.controller import engine
from vfab.controller.engine import Barrier, Commit, Pause, Report, plan_round, replan
from vfab.controller.reconcile import ALL_ONES, diff
from vfab.fabric.flows import Kind, split_cookie
from vfab.vid import codec
from vfab.vid.registry import schema

S1, S2, S3 = 1, 2, 3
LINKS = [(S1, 10, S2, 11), (S2, 11, S1, 10), (S2, 10, S3, 11), (S3, 11, S2, 10)]
HOSTS = {f"h{sw}{p}": (f"02:00:00:00:0{sw}:0{p}", sw, p) for sw in (S1, S2, S3) for p in (1, 2)}
EPS = {"a": "h11", "b": "h21", "c": "h31"}
HALF = codec.KEY_MAX // 2


def items(ranges=((0, HALF, "a"), (HALF + 1, codec.KEY_MAX, "c")), hosts=HOSTS, extra=None,
          rx="bpf") -> dict[str, bytes]:
    """rx=bpf by default: hop-by-hop routes, the case where the order and the pauses matter."""
    recs: list[tuple[str, schema.Record]] = [(schema.service_key("kv"), schema.Service(name="kv", id=9))]
    recs += [(schema.switch_key(s), schema.Switch(dpid=s, name=f"s{s}")) for s in (S1, S2, S3)]
    recs += [(schema.link_key(d, p), schema.Link(d, p, pd, pp)) for d, p, pd, pp in LINKS]
    recs += [(schema.host_key(mac), schema.Host(mac=mac, dpid=d, port=p, name=n)) for n, (mac, d, p) in hosts.items()]
    recs += [(schema.endpoint_key("kv", ep), schema.Endpoint(service="kv", name=ep, mac=HOSTS[h][0], host=h, rx=rx))
             for ep, h in EPS.items()]
    recs += [(schema.range_key("kv", r[0]), schema.RangeRec(lo=r[0], hi=r[1], owner=r[2],
                                                           epoch=r[3] if len(r) > 3 else e + 1))
             for e, r in enumerate(ranges)]
    out = {k: v.to_json().encode() for k, v in recs}
    out.update(extra or {})
    return out


def synced(rnd: engine.Round) -> dict:
    """What each switch holds after every commit of ``rnd``."""
    return {d: (c.flows, c.groups) for d, c in rnd.configs.items()}


def empty() -> dict:
    return {d: ({}, {}) for d in (S1, S2, S3)}


def test_fresh_switches_get_everything_and_reports_follow():
    rnd = plan_round(items(), 5, empty())
    assert rnd.error is None and rnd.problems == []
    commits = rnd.commits
    assert sorted(c.dpid for c in commits) == [S1, S2, S3]
    for c in commits:
        assert sorted(c.plan.add_flows, key=lambda f: f.key) == sorted(c.want.flows.values(), key=lambda f: f.key)
        assert not c.plan.del_flows and not c.plan.del_cookies
    assert rnd.reports == [Report(d, 5, len(rnd.configs[d].flows), len(rnd.configs[d].groups)) for d in (S1, S2, S3)]
    # Reports are data for after the steps: never among them.
    assert all(isinstance(s, (Commit, Pause, Barrier)) for s in rnd.steps)


def test_nothing_to_do_is_no_step_but_still_a_report_once():
    held = synced(plan_round(items(), 5, empty()))
    rnd = plan_round(items(), 6, held)
    assert rnd.steps == [] and [r.dpid for r in rnd.reports] == [S1, S2, S3]
    assert plan_round(items(), 6, held, reported={S1: 6, S2: 6, S3: 6}).reports == []
    assert [r.dpid for r in plan_round(items(), 6, held, reported={S1: 6, S2: 5}).reports] == [S2, S3]


def test_cutover_commits_nearest_to_the_new_owner_first_with_pauses_between():
    held = synced(plan_round(items(), 5, empty()))
    # a's half moves to c (on s3): s3 first, then s2, then s1; a pause after each but the last.
    rnd = plan_round(items(ranges=((0, HALF, "c"), (HALF + 1, codec.KEY_MAX, "c"))), 6, held, settle=0.005)
    assert [(type(s).__name__, getattr(s, "dpid", getattr(s, "seconds", None))) for s in rnd.steps] == [
        ("Commit", S3), ("Pause", 0.005), ("Commit", S2), ("Pause", 0.005), ("Commit", S1)]
    # And back to a (on s1): s1 first.
    held2 = synced(rnd)
    back = plan_round(items(), 7, held2, settle=0.005)
    assert [s.dpid for s in back.commits] == [S1, S2, S3]
    assert not isinstance(back.steps[-1], Pause)


def test_no_pause_when_the_first_switch_decides_the_path():
    """rx=ovs owners: every switch rewrites a range's frames to the owner's MAC itself, so a frame never
    depends on a later switch having turned: the cut-over needs no pause between switches."""
    held = synced(plan_round(items(rx="ovs"), 5, empty()))
    rnd = plan_round(items(ranges=((0, HALF, "c"), (HALF + 1, codec.KEY_MAX, "c")), rx="ovs"), 6, held, settle=0.005)
    assert len(rnd.commits) == 3 and not any(isinstance(s, Pause) for s in rnd.steps)
    # ... nor a barrier: the three bundles are in flight together (the app sends all, then awaits all)
    assert all(isinstance(s, Commit) for s in rnd.steps)
    assert all(engine.routes_only(c.plan) for c in rnd.commits)


def test_a_barrier_follows_a_switch_that_adds_more_than_vid_routes():
    """A new owner's host route and port security must be in its switch's tables before the other switches
    send it frames: such a switch's bundle is answered before the next one goes out (as when every bundle was
    awaited), while a pure cut-over's bundles go together."""
    held = synced(plan_round(items(rx="ovs"), 5, empty()))
    # d, a new endpoint on a new host on s3, gets a's half in the same round as it appears
    more = dict(HOSTS, h33=("02:00:00:00:03:03", S3, 3))
    new = items(ranges=((0, HALF, "d"), (HALF + 1, codec.KEY_MAX, "c")), hosts=more, rx="ovs")
    new[schema.endpoint_key("kv", "d")] = schema.Endpoint(service="kv", name="d", mac=more["h33"][0], host="h33",
                                                          rx="ovs").to_json().encode()
    rnd = plan_round(new, 6, held, settle=0.005)
    kinds = [type(s).__name__ for s in rnd.steps]
    assert rnd.commits[0].dpid == S3 and kinds == ["Commit", "Barrier", "Commit", "Barrier", "Commit"]
    assert not any(engine.routes_only(c.plan) for c in rnd.commits)   # the new host is routed everywhere


def test_pause_only_after_a_switch_whose_vid_routes_changed():
    held = synced(plan_round(items(), 5, empty()))
    # A new host changes host routes and port security everywhere, but no VID route: no pause.
    more = dict(HOSTS, h13=("02:00:00:00:01:03", S1, 3))
    rnd = plan_round(items(hosts=more), 6, held, settle=0.005)
    assert len(rnd.commits) == 3 and not any(isinstance(s, Pause) for s in rnd.steps)
    # settle 0: never a pause.
    moved = items(ranges=((0, HALF, "b"), (HALF + 1, codec.KEY_MAX, "c")))
    assert not any(isinstance(s, Pause) for s in plan_round(moved, 6, held, settle=0).steps)
    # Only the switches whose route changed are followed by a pause: s2 (the new owner's) first.
    rnd = plan_round(moved, 6, held, settle=0.005)
    kinds = [type(s).__name__ for s in rnd.steps]
    assert rnd.commits[0].dpid == S2 and kinds[1] == "Pause" and kinds[-1] == "Commit"


def test_switch_not_yet_read_is_skipped():
    held = empty()
    del held[S2]
    rnd = plan_round(items(), 5, held)
    assert sorted(c.dpid for c in rnd.commits) == [S1, S3]
    assert [r.dpid for r in rnd.reports] == [S1, S3]
    # A switch etcd does not know (not compiled) is skipped too.
    rnd = plan_round(items(), 5, {**empty(), 99: ({}, {})})
    assert 99 not in {c.dpid for c in rnd.commits} | {r.dpid for r in rnd.reports}


def test_malformed_records_do_not_crash():
    bad = {
        schema.endpoint_key("kv", "zz"): b'{"service": "kv", "name": "zz", "mac": "not a mac"}',
        schema.range_key("kv", 0x123): b"\xff\xfe garbage",
        schema.service_key("x"): b'{"name": "x", "id": 70000}',
        schema.host_key("02:00:00:00:09:09"): b"[]",
        schema.MISS_KEY: b"explode",
        schema.ROOT + "unknown-folder/1": b"whatever",
        schema.service_key("door"): schema.Service(name="door", id=11, frontdoors=[{"kind": "nope"}]).to_json().encode(),
    }
    rnd = plan_round(items(extra=bad), 5, empty())
    assert rnd.error is None and len(rnd.commits) == 3
    assert len(rnd.problems) == 6, rnd.problems
    assert any("kind 'nope' is unknown" in p for p in rnd.problems)
    # What is sound still compiles: a's range reaches a.
    assert any(split_cookie(f.cookie)[0] == Kind.VID_ROUTE for f in rnd.configs[S1].flows.values())


def test_compile_error_leaves_the_switches_alone(monkeypatch):
    def boom(*a, **k):
        raise KeyError("no such thing")
    monkeypatch.setattr(engine, "compile_fabric", boom)
    rnd = plan_round(items(), 5, empty())
    assert rnd.steps == [] and rnd.reports == [] and "KeyError" in rnd.error


def test_replan_after_a_re_read():
    rnd = plan_round(items(), 5, empty())
    c = rnd.commits[0]
    # The switch was re-read meanwhile and already holds half of it.
    half = dict(list(c.want.flows.items())[::2])
    again = replan(c.want, (half, {}))
    assert len(again.add_flows) == len(c.want.flows) - len(half)
    assert engine.drifted((half, {}), (c.want.flows, {})) and not engine.drifted((half, {}), (dict(half), {}))


# -- the plans themselves: applying one as OVS would yields exactly what is wanted ------------------
def apply(plan, flows: dict, groups: dict) -> tuple[dict, dict]:
    """OpenFlow semantics of a bundle: cookie deletes (all tables), strict deletes, ADD replaces, groups."""
    flows = dict(flows)
    for cookie, mask in plan.del_cookies:
        flows = {k: f for k, f in flows.items() if f.cookie & mask != cookie}
    for f in plan.del_flows:
        flows.pop(f.key, None)
    for f in plan.add_flows:
        flows[f.key] = f
    groups = dict(groups)
    for g in plan.add_groups + plan.mod_groups:
        groups[g.group_id] = g
    for gid in plan.del_groups:
        groups.pop(gid, None)
    return flows, groups


def random_ranges(rng: random.Random) -> list[tuple[int, int, str]]:
    cuts = sorted(rng.sample(range(1, codec.KEY_MAX), rng.randrange(0, 6)))
    edges = [0, *cuts, codec.KEY_MAX + 1]
    return [(lo, hi - 1, rng.choice("abc")) for lo, hi in zip(edges, edges[1:])]


def test_plans_converge_from_any_previous_state():
    rng = random.Random(7)
    held = empty()
    for i in range(40):
        rnd = plan_round(items(ranges=random_ranges(rng)), i, held)
        for c in rnd.commits:
            held[c.dpid] = apply(c.plan, *held[c.dpid])
        for d, cfg in rnd.configs.items():
            assert held[d] == (cfg.flows, cfg.groups), f"round {i}: switch {d} did not converge"
        # A foreign flow and a stale one with a wanted cookie: both go.
        if i % 10 == 0:
            from vfab.fabric.flows import FlowSpec, match
            f1 = FlowSpec(1, 999, match(eth_dst=0x99), (), 0x99)
            some = next(iter(rnd.configs[S1].flows.values()))
            f2 = FlowSpec(1, 998, match(eth_dst=0x98), (), some.cookie)
            held[S1][0][f1.key] = f1
            held[S1][0][f2.key] = f2
            plan = diff(rnd.configs[S1], *held[S1])
            assert plan.del_flows == [f2] and (0, 0xFF << 56) in plan.del_cookies
            held[S1] = apply(plan, *held[S1])
            assert held[S1][0] == rnd.configs[S1].flows


def test_a_removed_range_goes_by_cookie():
    held = synced(plan_round(items(), 5, empty()))
    three = ((0, 0xFFF, "b"), (0x1000, HALF, "a"), (HALF + 1, codec.KEY_MAX, "c"))
    held = synced(plan_round(items(ranges=three), 6, held))
    # The registry gives the joined range a new epoch, hence a new cookie.
    rnd = plan_round(items(ranges=((0, HALF, "a", 7), (HALF + 1, codec.KEY_MAX, "c", 3))), 7, held)
    for c in rnd.commits:
        assert c.plan.del_flows == [], c.plan.summary()
        assert all(mask == ALL_ONES for _, mask in c.plan.del_cookies)
        assert c.plan.removed == sum(c.plan.del_cookies.values()) > 0


@pytest.mark.parametrize("settle", [0.0, 0.01])
def test_rounds_are_deterministic(settle):
    a = plan_round(items(), 5, empty(), settle=settle)
    b = plan_round(dict(reversed(list(items().items()))), 5, empty(), settle=settle)
    assert a.steps == b.steps and a.reports == b.reports


# -- the controller's configuration -------------------------------------------------------------------
def test_config_is_validated_like_the_records():
    from vfab.controller.config import ConfigError, ControllerConfig

    cfg = ControllerConfig()
    assert cfg.settle == 0.005 and cfg.port == 6653
    assert ControllerConfig.from_dict({"poll": 1, "settle_ms": 0}).poll == 1
    for bad, says in [({"pol": 1}, "unknown settings ['pol']: known settings are ['etcd', 'listen', 'port'"),
                      ({"port": "6653"}, "'port' must be an integer, got '6653'"),
                      ({"poll": "2"}, "'poll' must be a number"),
                      ({"verbose": 1}, "'verbose' must be true or false"),
                      ({"audit_polls": True}, "'audit_polls' must be an integer"),
                      ({"etcd": "localhost"}, "write HOST:PORT"),
                      ({"listen": "eth0"}, "is not an IP address"),
                      ({"port": 70000}, "1..65535"),
                      ({"poll": 0}, "0.05..3600"),
                      ({"settle_ms": -1}, "0..1000 ms"),
                      ({"bundle_timeout": 0}, "1..3600"),
                      ({"linger": 61}, "linger 61 s is out of range: 0..60 s")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            ControllerConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="not JSON"):
        ControllerConfig.from_json("{", "f.json")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ControllerConfig.from_json("[1]", "f.json")
    assert cfg.merged(poll=None, port=7000) == ControllerConfig(port=7000)


def test_command_line_and_config_file(tmp_path, capsys):
    from vfab.controller.main import main, parse_config

    path = tmp_path / "ctl.json"
    path.write_text('{"etcd": "127.0.0.1:2400", "poll": 3, "settle_ms": 2}')
    cfg, check = parse_config(["--config", str(path), "--poll", "0.5", "--port", "6999"])
    assert (cfg.etcd, cfg.poll, cfg.settle_ms, cfg.port, check) == ("127.0.0.1:2400", 0.5, 2, 6999, False)
    # testbed/fabric.py starts it this way.
    cfg, _ = parse_config(["--etcd", "127.0.0.1:2379", "--port", "6653", "--poll", "1.0", "--settle-ms", "5"])
    from vfab.controller.config import ControllerConfig

    assert cfg == ControllerConfig(poll=1.0)
    main(["--check", "--audit-polls", "3", "--linger", "0.5"])
    out = capsys.readouterr().out
    assert '"audit_polls": 3' in out and '"linger": 0.5' in out
    for argv, says in ([["--port", "0"], "OpenFlow port 0 is out of range"],
                       [["--config", str(tmp_path / "nope.json")], "cannot read"]):
        with pytest.raises(SystemExit) as exc:
            parse_config(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_parse_cache_reuses_unchanged_records_only():
    from vfab.fabric.state import FabricState

    cache: dict = {}
    base = items(extra={schema.MISS_KEY: b"explode"})
    first = FabricState.from_items(base, cache)
    assert first == FabricState.from_items(base) and len(first.problems) == 1
    assert schema.MISS_KEY not in cache  # not a record; and bad records are never cached
    again = FabricState.from_items(base, cache)
    assert again.services["kv"] is first.services["kv"] and again.problems == first.problems
    # Changed bytes are parsed again; deleted keys leave the cache.
    moved = items(ranges=((0, codec.KEY_MAX, "b"),))
    third = FabricState.from_items(moved, cache)
    assert third == FabricState.from_items(moved)
    assert set(cache) == {k for k in moved if not k.endswith("/config/miss")}
    # Rounds with and without the cache are the same.
    c2: dict = {}
    for its in (items(), moved, items()):
        a, b = plan_round(its, 5, empty(), cache=c2), plan_round(its, 5, empty())
        assert a.steps == b.steps and a.reports == b.reports


# -- groups: stable ids, deleted one round after the flows stop using them -------------------------------------
def helped(helpers_lo=("b", "c"), helpers_hi=(), epochs=(1, 2)) -> dict[str, bytes]:
    """a owns the lower half, c the upper; each half optionally behind helpers (a select group on every switch)."""
    out = items(rx="ovs")
    for (lo, hi, owner), hs, ep in zip(((0, HALF, "a"), (HALF + 1, codec.KEY_MAX, "c")), (helpers_lo, helpers_hi),
                                       epochs):
        out[schema.range_key("kv", lo)] = schema.RangeRec(lo=lo, hi=hi, owner=owner, helpers=list(hs),
                                                          epoch=ep).to_json().encode()
    return out


def groups_used(cfg) -> set[int]:
    return {a[1] for f in cfg.flows.values() for a in f.actions if a[0] == "group"}


def test_helpers_off_keeps_the_group_one_round_then_deletes_it():
    """The defect of issue 8: the group must not go in the bundle that re-points its flows away from it."""
    on = plan_round(helped(), 5, empty())
    held = synced(on)
    gids = {d: groups_used(c) for d, c in on.configs.items()}
    assert gids and all(len(g) == 1 for g in gids.values()) and on.held == {}
    off = plan_round(helped(helpers_lo=(), epochs=(3, 2)), 6, held)
    assert off.commits
    for c in off.commits:
        assert c.plan.del_groups == [], f"switch {c.dpid}: group deleted with the route change: {c.plan.summary()}"
        assert groups_used(c.want) == set() and set(c.want.groups) == gids[c.dpid]   # unused, still there
        assert any(f.cookie and f in c.plan.add_flows for f in c.want.flows.values())  # the route did change
    assert off.held == {d: tuple(sorted(g)) for d, g in gids.items()}
    after = synced(off)
    # the app holds them until a revalidation pass followed: a round meanwhile keeps them
    again = plan_round(helped(helpers_lo=(), epochs=(3, 2)), 7, after, hold={d: set(g) for d, g in gids.items()})
    assert again.commits == [] and again.held == off.held
    # then they go, alone in their bundle
    last = plan_round(helped(helpers_lo=(), epochs=(3, 2)), 7, after)
    assert sorted(c.dpid for c in last.commits) == [S1, S2, S3] and last.held == {}
    for c in last.commits:
        assert c.plan.del_groups == sorted(gids[c.dpid]) and not c.plan.add_flows and not c.plan.removed
        assert c.want.groups == {}


def test_helpers_on_adds_the_group_with_the_flows_that_use_it():
    held = synced(plan_round(helped(helpers_lo=()), 5, empty()))
    on = plan_round(helped(epochs=(3, 2)), 6, held)
    assert on.commits
    for c in on.commits:
        assert [g.group_id for g in c.plan.add_groups] == sorted(groups_used(c.want)) and not c.plan.del_groups
        assert on.held == {}


def test_a_group_that_comes_back_moments_after_it_went_takes_a_new_id():
    """Helpers off (the group goes a round later), then on again at once (a machine paused past every lease:
    the helpers' records go and come back within a second): the new group must not take the id just freed,
    or it meets what the datapath still holds for the old one (recirculations, flows turned into drops)."""
    on = plan_round(helped(), 5, empty())
    gids = {d: groups_used(c) for d, c in on.configs.items()}
    off = plan_round(helped(helpers_lo=(), epochs=(3, 2)), 6, synced(on))
    gone = plan_round(helped(helpers_lo=(), epochs=(3, 2)), 7, synced(off))
    assert all(c.plan.del_groups == sorted(gids[c.dpid]) for c in gone.commits)
    after = synced(gone)
    again = plan_round(helped(epochs=(4, 2)), 8, after, retired=gids)
    for c in again.commits:
        added = [g.group_id for g in c.plan.add_groups]
        assert len(added) == 1 and added[0] not in gids[c.dpid], (added, gids[c.dpid])
    # without the app's memory of the deleted ids, the lowest free id is taken again (what it guards against)
    reused = plan_round(helped(epochs=(4, 2)), 8, after)
    assert all([g.group_id for g in c.plan.add_groups] == sorted(gids[c.dpid]) for c in reused.commits)


def test_group_ids_stay_put_when_another_range_leaves_its_group():
    both = plan_round(helped(helpers_hi=("a", "b")), 5, empty())
    held = synced(both)
    hi_gid = {d: next(a[1] for f in c.flows.values() if split_cookie(f.cookie)[2] == HALF + 1
                      for a in f.actions if a[0] == "group") for d, c in both.configs.items()}
    # The lower half goes direct: the compiler would now number the upper half's group 1 (compile order)
    rnd = plan_round(helped(helpers_lo=(), helpers_hi=("a", "b"), epochs=(3, 2)), 6, held)
    assert rnd.commits
    for c in rnd.commits:
        assert not c.plan.mod_groups and not c.plan.add_groups and not c.plan.del_groups, c.plan.summary()
        assert all(split_cookie(f.cookie)[2] != HALF + 1 for f in c.plan.add_flows), "upper half re-pointed"
        assert hi_gid[c.dpid] in c.want.groups
    # A group that comes while another is held takes an id the switch does not hold.
    held = synced(rnd)
    new = plan_round(helped(helpers_lo=("c", "b"), helpers_hi=("a", "b"), epochs=(4, 2)), 7, held,
                     hold={d: set(g) for d, g in rnd.held.items()})
    for c in new.commits:
        added = [g.group_id for g in c.plan.add_groups]
        assert len(added) == 1 and added[0] not in held[c.dpid][1], (added, sorted(held[c.dpid][1]))


def test_groups_converge_through_random_helper_changes():
    """Applied as OVS would, with the app's hold released after every round: every switch ends as wanted and no
    group a flow still uses (on the switch before the bundle) is ever deleted."""
    rng = random.Random(3)
    held = empty()
    choices = [(), ("b",), ("b", "c"), ("c", "a")]
    for i in range(30):
        its = helped(helpers_lo=rng.choice(choices), helpers_hi=rng.choice(choices), epochs=(2 * i + 1, 2 * i + 2))
        rnd = plan_round(its, i, held)
        for c in rnd.commits:
            before = groups_used(type(c.want)(c.dpid, held[c.dpid][0], held[c.dpid][1]))
            assert not set(c.plan.del_groups) & before, f"round {i}: deleted a group in use"
            assert not {g.group_id for g in c.plan.mod_groups} & (before - groups_used(c.want)), \
                f"round {i}: changed a group its flows are leaving"
            held[c.dpid] = apply(c.plan, *held[c.dpid])
        for d, cfg in rnd.configs.items():
            assert held[d] == (cfg.flows, cfg.groups)
    rnd = plan_round(its, 99, held)   # one more round: nothing held any more
    for c in rnd.commits:
        held[c.dpid] = apply(c.plan, *held[c.dpid])
    for d, cfg in plan_round(its, 100, held).configs.items():
        assert set(cfg.groups) == groups_used(cfg) and held[d][1] == cfg.groups
