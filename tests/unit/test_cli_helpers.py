"""``vfab helpers`` and ``services/memcached-helper/control.py`` against a real etcd (no fabric, no DPDK).

A helper here is what its agent writes: an endpoint of the service plus a ``HelperStatus`` under the same
lease.  The fabric tests (tests/integration/test_mc_fabric.py) run the real thing.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from vfab.cli.main import cli
from vfab.services.memcached_helper import control
from vfab.vid.errors import NotFound
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

STATS = {"batch_S_bytes": 4101, "batch_T_ns": 14000, "b_cmds": 10, "b_keys": 120, "rx_get": 120, "conns": 2,
         "conns_up": 2, "hist_keys_8": 6, "hist_keys_16": 4, "drop_busy": 3}


@pytest.fixture
def run(registry):
    def invoke(*args: str):
        return CliRunner().invoke(cli, ["--etcd", registry.endpoint, *args])
    return invoke


def add_helper(reg, name: str, mac: str) -> int:
    lease = reg.announce(schema.Endpoint(service="mc", name=name, mac=mac), ttl=30)
    reg.put(schema.helper_key("mc", name), schema.HelperStatus(at=1.0, serves="10.0.0.1:11211", pid=7,
                                                                stats=STATS).to_json(), lease=lease)
    return lease


@pytest.fixture
def mc(registry):
    registry.create_service("mc", kind="memcached",
                            frontdoors=[{"kind": "udp", "ip": "10.0.0.1", "port": 11211, "key": "ip_src"}])
    registry.announce(schema.Endpoint(service="mc", name="mc0", mac="00:00:00:00:00:01"), ttl=30)
    registry.assign("mc", Range(0, 0xFFFFFF), "mc0")
    leases = {"h1": add_helper(registry, "h1", "00:00:00:00:00:02"),
              "h2": add_helper(registry, "h2", "00:00:00:00:00:05")}
    registry.announce(schema.Endpoint(service="mc", name="other", mac="00:00:00:00:00:09"), ttl=30)
    return leases


def ranges(reg):
    return [(r.lo, r.hi, r.owner, r.helpers) for r, _ in reg.ranges("mc")]


def test_live_helpers_are_endpoints_with_a_status(registry, mc):
    assert control.live_helpers(registry, "mc") == ["h1", "h2"]   # not mc0, not "other"
    with pytest.raises(NotFound, match="does not exist"):
        control.live_helpers(registry, "nosuch")


def test_on_and_off_for_all_ranges(run, registry, mc):
    res = run("helpers", "on", "mc", "--no-wait")
    assert res.exit_code == 0 and "helpers - -> h1,h2" in res.output, res.output
    assert ranges(registry) == [(0, 0xFFFFFF, "mc0", ["h1", "h2"])]
    res = run("helpers", "on", "mc", "--no-wait")
    assert res.exit_code == 0 and "nothing to change" in res.output       # no new epoch, no flow churn
    res = run("helpers", "off", "mc", "--no-wait")
    assert res.exit_code == 0 and "h1,h2 -> -" in res.output
    assert ranges(registry) == [(0, 0xFFFFFF, "mc0", [])]


def test_on_a_range_cuts_it_and_off_joins_it_again(run, registry, mc):
    res = run("helpers", "on", "mc", "0-0x7fffff", "--helper", "h2", "--no-wait")
    assert res.exit_code == 0, res.output
    assert ranges(registry) == [(0, 0x7FFFFF, "mc0", ["h2"]), (0x800000, 0xFFFFFF, "mc0", [])]
    epoch = max(r.epoch for r, _ in registry.ranges("mc"))
    res = run("helpers", "off", "mc", "--helper", "h2", "--no-wait")
    assert res.exit_code == 0 and "h2 -> -" in res.output, res.output
    assert ranges(registry) == [(0, 0xFFFFFF, "mc0", [])]
    assert registry.ranges("mc")[0][0].epoch > epoch


def test_bad_requests_say_what_is_wrong(run, registry, mc):
    res = run("helpers", "on", "mc", "--helper", "h9", "--no-wait")
    assert res.exit_code == 2 and "'h9' is not a live helper of 'mc' (live helpers: h1, h2)" in res.output
    res = run("helpers", "on", "mc", "--helper", "other", "--no-wait")     # an endpoint, but no helper
    assert res.exit_code == 2 and "'other' is not a live helper" in res.output
    res = run("helpers", "on", "nosuch")
    assert res.exit_code == 1 and "does not exist" in res.output
    res = run("helpers", "on", "mc", "5-1")
    assert res.exit_code == 2 and "lo must be <= hi" in res.output
    registry.assign("mc", Range(0x10, 0x1F), "")                              # an unassigned range
    res = run("helpers", "on", "mc", "0-0x20", "--no-wait")
    assert res.exit_code == 2 and "has no owner" in res.output, res.output
    assert "Traceback" not in res.output


def test_no_live_helper(run, registry, mc):
    for lease in mc.values():
        registry.revoke(lease)
    res = run("helpers", "on", "mc")
    assert res.exit_code == 1 and "no live helper of 'mc'" in res.output


def test_status_shows_stats_and_dead_helpers(run, registry, mc):
    control.set_helpers(registry, "mc", None, ["h1", "h2"])
    registry.revoke(mc["h2"])                                    # h2's agent is gone: endpoint and status
    res = run("helpers", "mc")
    assert res.exit_code == 0, res.output
    assert "h2 (DEAD)" in res.output and "DEAD" in res.output and "helpers" in res.output
    rep = control.report(registry, "mc")
    h1 = next(h for h in rep["helpers"] if h["name"] == "h1")
    assert (h1["live"], h1["S_bytes"], h1["T_us"], h1["batches"], h1["keys_per_batch"], h1["drops"]) == \
        (True, 4101, 14.0, 10, 12.0, 3)
    assert h1["hist"] == {"8": 6, "16": 4}
    assert rep["ranges"][0]["path"] == "helpers"
    res = run("status")
    assert res.exit_code == 0 and "h2 (DEAD)" in res.output, res.output


def test_a_helper_withdrawn_for_not_serving_shows_down_and_why(run, registry, mc):
    """Issue 43: an agent that withdrew its helper because its leg to memcached stalled leaves its status without
    a lease, with the reason; ``vfab helpers`` shows it DOWN with that reason, and it is no live helper."""
    control.set_helpers(registry, "mc", None, ["h1", "h2"])
    registry.revoke(mc["h2"])
    why = "1 of 1 connection(s) down: its leg to 10.0.0.1:11211 stalled; reconnecting"
    registry.put(schema.helper_key("mc", "h2"), schema.HelperStatus(at=1.0, serves="10.0.0.1:11211", pid=7,
                                                                    stats=STATS, down=why).to_json())
    assert control.live_helpers(registry, "mc") == ["h1"]
    res = run("helpers", "mc")
    assert res.exit_code == 0, res.output
    assert "h2 (DOWN)" in res.output and f"h2 does not serve (withdrawn by its agent): {why}" in res.output, \
        res.output
    h2 = next(h for h in control.report(registry, "mc")["helpers"] if h["name"] == "h2")
    assert (h2["live"], h2["down"]) == (False, why)


def test_balancer_hooks(registry, mc):
    changes = control.apply_decision(registry, {"service": "mc", "range": [0, 0xFFF], "helpers": ["h1"],
                                                "weights": [100]})
    assert [(c.rng, c.after) for c in changes] == [(Range(0, 0xFFF), ["h1"])]
    rev = control.apply_helpers(registry, "mc", 0, 0xFFF, [])
    assert rev > 0 and ranges(registry) == [(0, 0xFFFFFF, "mc0", [])]
    assert control.apply_decision(registry, {"service": "mc", "range": "0-0xfff", "helpers": []}) == []


def test_weights_by_hand_and_from_the_balancer(run, registry, mc):
    res = run("helpers", "on", "mc", "--weight", "h1=60", "--weight", "h2=20", "--no-wait")
    assert res.exit_code == 0 and "h1,h2 weights h1=60,h2=20" in res.output, res.output
    rec = registry.ranges("mc")[0][0]
    assert rec.weights == {"h1": 60, "h2": 20}
    res = run("helpers", "mc")
    assert res.exit_code == 0 and "h1 w60 (75%)" in res.output and "h2 w20 (25%)" in res.output, res.output
    assert [h["weight"] for h in control.report(registry, "mc")["ranges"][0]["helpers"]] == [60, 20]
    res = run("helpers", "on", "mc", "--weight", "h1=60", "--weight", "h2=20", "--no-wait")
    assert "nothing to change" in res.output
    # removing a helper drops its weight; off drops them all
    res = run("helpers", "off", "mc", "--helper", "h2", "--no-wait")
    assert res.exit_code == 0 and registry.ranges("mc")[0][0].weights == {"h1": 60}, res.output
    for bad, says in ((("--weight", "h1=0"), "out of range: an integer 1..65535"),
                      (("--weight", "h3=5"), "not among the helpers switched on"),
                      (("--weight", "h1"), "write NAME=WEIGHT")):
        res = run("helpers", "on", "mc", "--no-wait", *bad)
        assert res.exit_code == 2 and says in res.output, res.output
    # the balancer's decision: weights in the order of its helpers
    control.apply_decision(registry, {"service": "mc", "helpers": ["h2", "h1"], "weights": [100, 40]})
    assert registry.ranges("mc")[0][0].weights == {"h2": 100, "h1": 40}
    with pytest.raises(control.HelperError, match="2 weights for 1 helpers"):
        control.apply_decision(registry, {"service": "mc", "helpers": ["h1"], "weights": [1, 2]})
    rev = control.apply_helpers(registry, "mc", 0, 0xFFFFFF, ["h1"], {"h1": 9})
    assert rev > 0 and registry.ranges("mc")[0][0].weights == {"h1": 9}
    control.apply_decision(registry, {"service": "mc", "helpers": []})
    assert registry.ranges("mc")[0][0].weights == {} and "weights" not in registry.ranges("mc")[0][0].to_json()


def holds(reg) -> list:
    return [(h.lo, h.hi, what) for h, what, _ in reg.holds("mc")[0].ranges()]


def test_on_and_off_by_hand_hold_the_range_until_auto(run, registry, mc):
    res = run("helpers", "on", "mc", "0-0x7fffff", "--no-wait")
    assert res.exit_code == 0 and "held (on by hand)" in res.output and "vfab helpers auto mc" in res.output, \
        res.output
    assert holds(registry) == [(0, 0x7FFFFF, "on")]
    res = run("helpers", "mc")
    assert res.exit_code == 0 and "hand: on at" in res.output and "balancer" in res.output, res.output
    res = run("status")
    assert res.exit_code == 0 and "h1, h2 (held by hand)" in res.output, res.output
    # 'off' of the whole service replaces the part it covers; a split of the range under a hold keeps it
    res = run("helpers", "off", "mc", "--no-wait")
    assert res.exit_code == 0 and holds(registry) == [(0, 0xFFFFFF, "off")], res.output
    registry.assign("mc", Range(0x800000, 0xFFFFFF), "mc0")
    assert holds(registry) == [(0, 0xFFFFFF, "off")]
    assert [r["held"][0]["what"] for r in control.report(registry, "mc")["ranges"]] == ["off", "off"]
    # auto for part of it, then for the rest
    res = run("helpers", "auto", "mc", "0x400000-0x7fffff")
    assert res.exit_code == 0 and "0x400000-0x7fffff back to the balancer" in res.output, res.output
    assert holds(registry) == [(0, 0x3FFFFF, "off"), (0x800000, 0xFFFFFF, "off")]
    res = run("helpers", "auto", "mc")
    assert res.exit_code == 0 and "back to the balancer" in res.output and holds(registry) == [], res.output
    assert registry.get(schema.holds_key("mc")) is None             # no empty record left behind
    res = run("helpers", "auto", "mc")
    assert res.exit_code == 0 and "no range was held" in res.output
    res = run("helpers", "on", "mc", "--no-wait", "--no-hold")
    assert res.exit_code == 0 and "not held" in res.output and holds(registry) == [], res.output
    res = run("helpers", "auto", "nosuch")
    assert res.exit_code == 1 and "does not exist" in res.output
    control.hold(registry, "mc", None, "on")
    assert holds(registry) == [(0, 0xFFFFFF, "on")]
    registry.delete_service("mc")                                   # its holds go with it
    assert registry.get(schema.holds_key("mc")) is None


def test_a_hold_that_fails_after_the_helpers_were_set_says_they_were(run, registry, mc, monkeypatch):
    from vfab.vid.errors import RegistryError

    def etcd_gone(*args, **kwargs):
        raise RegistryError("etcd at 127.0.0.1:2379 is unreachable")
    monkeypatch.setattr(control, "hold", etcd_gone)
    res = run("helpers", "on", "mc", "--no-wait")
    assert res.exit_code == 1, res.output
    assert "helpers - -> h1,h2" in res.output and "the helpers were set as shown above" in res.output, res.output
    assert "holding them failed: etcd at 127.0.0.1:2379 is unreachable" in res.output, res.output
    assert "run this command again" in res.output and "Traceback" not in res.output, res.output
    assert [h for _, _, _, h in ranges(registry)] == [["h1", "h2"]]


def test_a_malformed_hold_record_is_refused_by_name(run, registry, mc):
    with pytest.raises(Exception, match="out of order or outside the key space"):
        schema.Holds([[5, 1, "on", 0.0]])
    with pytest.raises(Exception, match="what='maybe'"):
        control.hold(registry, "mc", Range(0, 1), "maybe")
    assert holds(registry) == []
    # a record something else wrote: shown, everything held meanwhile, and 'auto' (all of it) deletes it
    registry.put(schema.holds_key("mc"), '{"holds": [[1, 0, "on", 0]]}')
    res = run("helpers", "mc")
    assert res.exit_code == 0 and "is invalid" in res.output and "vfab helpers auto mc" in res.output, res.output
    res = run("status")
    assert res.exit_code == 0 and "(held by hand)" in res.output, res.output
    res = run("helpers", "auto", "mc", "0-0xff")
    assert res.exit_code != 0 and "(no RANGE) deletes the record" in res.output, res.output
    res = run("helpers", "auto", "mc")
    assert res.exit_code == 0 and "back to the balancer" in res.output, res.output
    assert registry.get(schema.holds_key("mc")) is None


def test_releasing_holds_with_etcd_away_says_etcd_not_the_record():
    from vfab.vid.errors import RegistryError
    from vfab.vid.registry import Registry
    dead = Registry("127.0.0.1:9")
    try:
        with pytest.raises(RegistryError, match="unreachable") as got:
            control.release(dead, "mc", Range(0, 0xFF))
        assert not isinstance(got.value, control.HelperError) and "deletes the record" not in str(got.value)
    finally:
        dead.close()


def test_remove_stats_removes_the_file_and_the_one_written_through(tmp_path):
    path = tmp_path / "h1.stats"
    path.write_text("loops 1\n")
    (tmp_path / "h1.stats.tmp").write_text("loops 2\n")
    (tmp_path / "other.stats").write_text("loops 3\n")
    control.remove_stats(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.stats"]
    control.remove_stats(str(path))   # already gone (the agent removed them): nothing to say
