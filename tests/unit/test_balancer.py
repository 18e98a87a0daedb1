"""The balancer's policy (controller/balancer.py), driven through made-up time and load.

Each test plays observations one period at a time into one ``Balancer`` and checks what it decides
and when: a sustained burst turns helpers on, a short spike does nothing, calm turns them off only
after the dwell, oscillating load never flaps, hot shards split, idle neighbours merge (never
non-adjacent or busy ones), and nothing happens to a range while an operation on it runs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from vfab.controller.balancer import (Balancer, BalancerConfig, BalancerConfigError, EndpointObs, HelperObs,
                                      RangeObs, ServiceObs, predict_p99_us)

KEY_MAX = 0xFFFFFF
HALF = 0x800000
# Quick clocks for the tests: 1 s period, 2 s burst window, 5 s calm, 10 s min on, 5 s min off.
CFG = BalancerConfig(op_dwell=0.0, min_interval=0.0, burst_window=2, calm_window=5, min_on=10, min_off=5,
                     split_rate=1000, merge_rate=200, split_window=3, merge_window=4, base_us=50)
S_US = 4.4   # memcached CPU µs per UDP get, measured here (TESTBED-NOTES.md)


# -- helpee (memcached) observations -------------------------------------------------------------------
def mc(rate: float, helped: bool = False, ranges=None, helpers=("h1", "h2"), cores: float = 1.0,
       helper_drops: float = 0.0, busy=(), rates=None, epoch: int = 1, held=()) -> ServiceObs:
    """memcached ``m`` owning ``ranges``, sent ``rate`` gets/s (the switches count them); it serves what its
    cores allow; with helpers on, its CPU per get is 6x lower."""
    ranges = ranges or [(0, KEY_MAX)]
    per_req = S_US / 1e6 / (6.0 if helped else 1.0)
    served = min(rate, cores / per_req)
    rs = tuple(RangeObs(lo, hi, "m", epoch=epoch, helpers=("h1",) if helped else (),
                        rate=(rates[i] if rates else rate / len(ranges)), busy=(lo, hi) in busy,
                        held=(lo, hi) in held)
               for i, (lo, hi) in enumerate(ranges))
    return ServiceObs("mc", ranges=rs, endpoints={"m": EndpointObs("m", cpu=served * per_req, served=served, cores=cores)},
                      helpers={h: HelperObs(h, rate=0.0, drops=helper_drops) for h in helpers})


def play(bal: Balancer, t0: float, obs_at, seconds: int) -> list:
    """Feed one observation per second for ``seconds``; every decision with its time."""
    out = []
    for t in range(int(t0), int(t0) + seconds):
        for d in bal.decide(float(t), [obs_at(t)]):
            out.append(d)
    return out


class Helpee:
    """memcached whose helpers follow the decisions (as the runner applies them)."""

    def __init__(self, load, **kw):
        self.load, self.kw, self.on, self.epoch = load, kw, False, 1

    def __call__(self, t: int) -> ServiceObs:
        return mc(self.load(t), helped=self.on, epoch=self.epoch, **self.kw)

    def play(self, bal: Balancer, t0: int, seconds: int) -> list:
        out = []
        for t in range(t0, t0 + seconds):
            for d in bal.decide(float(t), [self(t)]):
                out.append(d)
                self.on = d.action == "helpers_on"
                self.epoch += 1      # every change of a range is a new epoch
        return out


def rate_for_p99(p99_us: float, cfg: BalancerConfig = CFG) -> float:
    """The get rate at which the model predicts ``p99_us`` (bisection on rho)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if predict_p99_us(mid, S_US, cfg) < p99_us:
            lo = mid
        else:
            hi = mid
    return lo / (S_US / 1e6)


HOT = rate_for_p99(2000)      # well above the 500 µs trigger
WARM = rate_for_p99(400)      # between off (250) and on (500)
CALM = rate_for_p99(100)      # well below off


# -- the model ---------------------------------------------------------------------------------------------
def test_model_matches_mm1_and_md1():
    mm1 = dataclasses.replace(CFG, scv_arrival=1.0, scv_service=1.0, base_us=0.0)
    # M/M/1: P(W > t) = rho exp(-mu (1-rho) t) → W_99 = S ln(rho/0.01) / (1 - rho)
    for rho in (0.1, 0.5, 0.9, 0.99):
        want = 10 + 10 * math.log(rho / 0.01) / (1 - rho)
        assert predict_p99_us(rho, 10.0, mm1) == pytest.approx(want)
    md1 = dataclasses.replace(CFG, base_us=0.0)   # ca2=1, cs2=0: half the M/M/1 wait
    assert predict_p99_us(0.9, 10.0, md1) - 10 == pytest.approx((predict_p99_us(0.9, 10.0, mm1) - 10) / 2)
    assert predict_p99_us(0.005, 10.0, mm1) == pytest.approx(10.0)      # rho < 1 - p: no queueing at p99
    assert predict_p99_us(1.0, 10.0, mm1) == math.inf
    assert predict_p99_us(1.7, 10.0, mm1) == math.inf
    # monotone in load
    vals = [predict_p99_us(r / 100, 5.0, CFG) for r in range(1, 100)]
    assert vals == sorted(vals)
    assert CALM < WARM < HOT < 1e6 / S_US


# -- helpers on/off ------------------------------------------------------------------------------------------
def test_sustained_burst_turns_helpers_on_after_the_window():
    bal = Balancer(CFG)
    got = Helpee(lambda t: CALM if t < 10 else HOT).play(bal, 0, 20)
    assert len(got) == 1
    d = got[0]
    assert d.action == "helpers_on" and d.at == 12.0, d    # hot from t=10, window 2 s
    assert d.ranges == ((0, KEY_MAX),) and d.owner == "m"
    assert d.helpers and set(d.helpers) <= {"h1", "h2"} and len(d.weights) == len(d.helpers)
    assert d.p99_us > CFG.p99_on_us and "µs" in d.reason


def test_rate_trigger_where_the_model_sees_no_queue():
    """This testbed's bursts keep memcached far from saturation: the model predicts no tail, but the request
    rate crosses rate_on.  On after the burst window, off after calm (below rate_off) and min_on; a rate
    between rate_off and rate_on neither turns them on nor off; without rate_on nothing happens."""
    cfg = dataclasses.replace(CFG, rate_on=6000.0, rate_off=2000.0)
    burst = lambda t: 10000.0 if 10 <= t < 30 else 1000.0   # noqa: E731
    assert predict_p99_us(10000 * S_US / 1e6, S_US, cfg) < cfg.p99_off_us      # the model alone: calm
    assert Helpee(burst).play(Balancer(CFG), 0, 60) == []
    got = Helpee(burst).play(Balancer(cfg), 0, 60)
    assert [(d.action, d.at) for d in got] == [("helpers_on", 12.0), ("helpers_off", 35.0)], got
    assert "10000 requests/s > 6000" in got[0].reason and "1000 requests/s < 2000" in got[1].reason
    # helpers sized from what memcached serves when the switches' counters lag (a burst's onset)
    lagging = dataclasses.replace(cfg, helper_capacity=8000.0)
    d, = play(Balancer(lagging), 0, lambda t: mc(10000.0, rates=[2000.0]), 5)
    assert d.action == "helpers_on" and d.helpers == ("h1", "h2"), d          # 10000 * 1.25 / 8000 -> 2
    warm = Helpee(lambda t: 4000.0).play(Balancer(cfg), 0, 30)
    assert warm == []
    h = Helpee(lambda t: 10000.0 if t < 20 else 4000.0)
    got = h.play(Balancer(cfg), 0, 60)
    assert [d.action for d in got] == ["helpers_on"], got        # 4000/s: not calm enough to go off


def test_zero_windows_act_on_one_observation_and_only_then():
    """burst_window 0: the first observation above the trigger decides, and nothing else does (a calm service
    must not get helpers, nor helpers that drop nothing get company)."""
    cfg = dataclasses.replace(CFG, rate_on=6000.0, rate_off=2000.0, burst_window=0.0, calm_window=0.0, min_on=0.0,
                              min_off=0.0)
    got = Helpee(lambda t: 10000.0 if 5 <= t < 8 else 0.0).play(Balancer(cfg), 0, 12)
    assert [(d.action, d.at) for d in got] == [("helpers_on", 5.0), ("helpers_off", 8.0)], got
    assert Helpee(lambda t: 1000.0).play(Balancer(cfg), 0, 10) == []


def test_short_spike_does_nothing():
    bal = Balancer(CFG)
    # spikes of 1 s and 2 s (the window is 2 s: a condition must hold at every sample of the window)
    spiky = {10, 20, 21, 40}
    got = Helpee(lambda t: HOT if t in spiky else CALM).play(bal, 0, 60)
    assert got == []


def test_no_helpers_without_live_helpers_or_without_cpu_numbers():
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: mc(HOT, helpers=()), 20) == []
    blind = lambda t: dataclasses.replace(mc(HOT), endpoints={"m": EndpointObs("m")})  # noqa: E731
    assert play(Balancer(CFG), 0, blind, 20) == []


def test_calm_turns_helpers_off_only_after_calm_window_and_min_on():
    bal = Balancer(CFG)
    on = play(bal, 0, lambda t: mc(HOT), 3)
    assert [d.action for d in on] == ["helpers_on"] and on[0].at == 2.0
    # the load drops at t=3 (helpers on now): calm 5 s would be t=8, but min_on (10 s) holds until t=12
    got = play(bal, 3, lambda t: mc(CALM, helped=True), 20)
    assert [(d.action, d.at) for d in got] == [("helpers_off", 12.0)]
    assert got[0].ranges == ((0, KEY_MAX),) and got[0].p99_us < CFG.p99_off_us


def test_helpers_stay_on_while_the_load_would_overload_the_helpee_alone():
    """With helpers on, memcached's own CPU looks calm (6x less per get); the policy predicts the
    direct p99 from the CPU per get it measured before and keeps helpers on."""
    bal = Balancer(CFG)
    play(bal, 0, lambda t: mc(HOT), 3)
    helped = mc(HOT, helped=True)
    assert helped.endpoints["m"].cpu < 0.2    # looks idle through the helpers
    assert play(bal, 3, lambda t: helped, 60) == []
    # between the thresholds: neither on nor off
    bal2 = Balancer(CFG)
    play(bal2, 0, lambda t: mc(HOT), 3)
    assert play(bal2, 3, lambda t: mc(WARM, helped=True), 60) == []


def test_oscillating_load_does_not_flap():
    """Load flipping between hot and calm every 1-4 s for 10 minutes: at most a handful of changes,
    and never an on and an off closer than the dwell times."""
    for period in (1, 2, 3, 4, 7):
        bal = Balancer(CFG)
        state = {"on": False}

        def obs(t, period=period, state=state):
            return mc(HOT if (t // period) % 2 == 0 else CALM, helped=state["on"])
        got = []
        for t in range(600):
            for d in bal.decide(float(t), [obs(t)]):
                got.append(d)
                state["on"] = d.action == "helpers_on"
        times = [d.at for d in got]
        for a, b in zip(got, got[1:]):
            assert a.action != b.action
            gap = b.at - a.at
            assert gap >= (CFG.min_on if a.action == "helpers_on" else CFG.min_off), (period, times)
        assert len(got) <= 600 / (CFG.min_on + CFG.min_off) * 2 + 1, (period, times)
        if period < CFG.burst_window + 1:
            assert got == [], (period, times)    # never hot for a whole window


def test_warm_load_between_thresholds_never_acts():
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: mc(WARM), 120) == []


def test_min_off_dwell_after_helpers_off():
    loads = [HOT] * 3 + [CALM] * 12 + [HOT] * 20   # on at 2, off at 12, hot again from 15
    got = [(d.action, d.at) for d in Helpee(lambda t: loads[t]).play(Balancer(CFG), 0, len(loads))]
    assert got[:2] == [("helpers_on", 2.0), ("helpers_off", 12.0)]
    assert got[2] == ("helpers_on", 17.0)    # hot from 15, window 2 s; min_off (5 s) passed at 17


def test_hottest_ranges_first_and_only_as_many_as_needed():
    quarters = [(0, 0x3FFFFF), (0x400000, 0x7FFFFF), (0x800000, 0xBFFFFF), (0xC00000, KEY_MAX)]
    # 70 % of the gets hit one quarter: helping that quarter alone brings the helpee under p99_off
    bal = Balancer(CFG)
    shares = (0.1, 0.7, 0.1, 0.1)
    got = play(bal, 0, lambda t: mc(HOT, ranges=quarters, rates=[HOT * s for s in shares]), 3)
    assert [d.ranges for d in got] == [((0x400000, 0x7FFFFF),)]
    # barely overloaded, evenly spread: one quarter is enough (rho 0.99 -> 0.79)
    bal = Balancer(CFG)
    got = play(bal, 0, lambda t: mc(HOT, ranges=quarters), 3)
    assert len(got) == 1 and len(got[0].ranges) == 1
    # sent twice what it can serve (the switches count it; its CPU is pegged at 1 core): three quarters
    # (rho 2 -> 1.58 -> 1.17 -> 0.75)
    bal = Balancer(CFG)
    got = play(bal, 0, lambda t: mc(2e6 / S_US, ranges=quarters), 3)
    assert len(got) == 1 and len(got[0].ranges) == 3, got
    # no per-range numbers: all of them
    bal = Balancer(CFG)

    def blind(t):
        o = mc(HOT, ranges=quarters)
        return dataclasses.replace(o, ranges=tuple(dataclasses.replace(r, rate=None) for r in o.ranges))
    got = play(bal, 0, blind, 3)
    assert len(got) == 1 and got[0].ranges == tuple(quarters)


def test_helper_count_and_weights_follow_spare_capacity():
    cfg = dataclasses.replace(CFG, helper_capacity=50000.0)
    rate = rate_for_p99(2000, cfg)
    helpers = {"h1": HelperObs("h1", rate=40000.0), "h2": HelperObs("h2", rate=0.0), "h3": HelperObs("h3", rate=10000.0)}
    bal = Balancer(cfg)
    got = play(bal, 0, lambda t: dataclasses.replace(mc(rate), helpers=helpers), 3)
    d = got[0]
    need = math.ceil(rate * 1.25 / 50000)
    assert len(d.helpers) == min(need, 3)
    assert d.helpers[0] == "h2" and d.weights[0] == 100       # the idlest first, full weight
    spare = {"h1": 10000, "h2": 50000, "h3": 40000}
    for name, w in zip(d.helpers, d.weights):
        assert w == max(1, round(100 * spare[name] / 50000))


def test_a_dropping_helper_gets_company():
    bal = Balancer(CFG)
    play(bal, 0, lambda t: mc(HOT, helpers=("h1",)), 3)
    # h1 in use and dropping; h2 appears
    got = play(bal, 3, lambda t: mc(HOT, helped=True, helper_drops=50.0), 10)
    assert got and got[0].action == "helpers_on" and set(got[0].helpers) == {"h1", "h2"}, got
    assert got[0].helpers[0] == "h1"          # the one in use stays first
    assert got[0].at == 5.0                   # dropping from 3, burst window 2 s


def test_no_helper_decision_on_a_busy_range():
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: mc(HOT, busy=[(0, KEY_MAX)]), 20) == []
    # the busy range is skipped, the other one helped
    two = [(0, HALF - 1), (HALF, KEY_MAX)]
    got = play(Balancer(CFG), 0, lambda t: mc(HOT, ranges=two, busy=[(0, HALF - 1)]), 3)
    assert [d.ranges for d in got] == [((HALF, KEY_MAX),)]


def test_a_range_held_by_an_operator_keeps_its_helpers_as_set():
    """'vfab helpers off' by hand in a burst, 'on' by hand in calm: the balancer overrules neither, for as long
    as the hold lasts, and still balances the owner's other ranges."""
    assert play(Balancer(CFG), 0, lambda t: mc(HOT, held=[(0, KEY_MAX)]), 30) == []
    assert play(Balancer(CFG), 0, lambda t: mc(CALM, helped=True, held=[(0, KEY_MAX)]), 60) == []
    two = [(0, HALF - 1), (HALF, KEY_MAX)]
    got = play(Balancer(CFG), 0, lambda t: mc(HOT, ranges=two, held=[(0, HALF - 1)]), 3)
    assert [(d.action, d.ranges) for d in got] == [("helpers_on", ((HALF, KEY_MAX),))]
    # released (no longer held): the burst turns them on
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: mc(HOT, held=[(0, KEY_MAX)]), 10) == []
    assert [d.action for d in play(bal, 10, lambda t: mc(HOT), 5)] == ["helpers_on"]


def test_decisions_are_rate_limited_per_service():
    cfg = dataclasses.replace(CFG, min_interval=30.0)
    bal = Balancer(cfg)
    state = {"on": False}
    got = []
    for t in range(100):
        for d in bal.decide(float(t), [mc(HOT if t < 4 else CALM, helped=state["on"])]):
            got.append(d)
            state["on"] = d.action == "helpers_on"
    assert [(d.action, d.at) for d in got] == [("helpers_on", 2.0), ("helpers_off", 32.0)]


def test_stale_or_missing_sample_restarts_the_window():
    bal = Balancer(CFG)

    def obs(t):
        if t % 2 == 1:   # every other sample lost: the window never completes
            return dataclasses.replace(mc(HOT), endpoints={})
        return mc(HOT)
    assert play(bal, 0, obs, 30) == []


# -- split / merge ---------------------------------------------------------------------------------------
def shards(spec, spares=("sp",), busy=(), helpers=(), mirrors=None) -> ServiceObs:
    """spec: [(lo, hi, owner, rate, keys)]."""
    rs = tuple(RangeObs(lo, hi, own, epoch=1, rate=rate, keys=keys, busy=(lo, hi) in busy,
                        helpers=("h",) if (lo, hi) in helpers else (), mirrors=tuple((mirrors or {}).get((lo, hi), ())))
               for lo, hi, own, rate, keys in spec)
    return ServiceObs("dh", ranges=rs, spares=tuple(spares), stateful=True)


def test_hot_shard_splits_its_hottest_range_to_a_spare():
    bal = Balancer(CFG)
    spec = lambda t: [(0, 0x3FFFFF, "a", 300.0, 10), (0x400000, KEY_MAX, "a", 900.0 if t >= 5 else 100.0, 10)]  # noqa
    got = play(bal, 0, lambda t: shards(spec(t)), 20)
    assert len(got) == 1
    d = got[0]
    assert d.action == "split" and d.at == 8.0            # over 1000/s from t=5, window 3 s
    assert d.owner == "a" and d.peer == "sp"
    assert d.ranges == ((0x400000 + 0xC00000 // 2, KEY_MAX),)   # the upper half of the hot range
    assert "requests/s" in d.reason


def test_short_load_peak_does_not_split_and_no_spare_no_split():
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: shards([(0, KEY_MAX, "a", 5000.0 if t % 3 == 0 else 10.0, 0)]), 60) == []
    assert play(Balancer(CFG), 0, lambda t: shards([(0, KEY_MAX, "a", 5000.0, 0)], spares=()), 30) == []


def test_split_on_key_count_and_never_below_min_width():
    cfg = dataclasses.replace(CFG, split_keys=50)
    got = play(Balancer(cfg), 0, lambda t: shards([(0, KEY_MAX, "a", 1.0, 60)]), 10)
    assert [d.action for d in got] == ["split"] and "60 keys > 50" in got[0].reason
    narrow = dataclasses.replace(cfg, min_split_width=1 << 20)
    assert play(Balancer(narrow), 0, lambda t: shards([(0, 0xFFFF, "a", 5000.0, 60)]), 20) == []


def test_idle_adjacent_neighbours_merge_freeing_an_endpoint():
    bal = Balancer(CFG)
    spec = [(0, HALF - 1, "a", 10.0, 100), (HALF, KEY_MAX, "b", 20.0, 300)]
    got = play(bal, 0, lambda t: shards(spec), 10)
    assert len(got) == 1
    d = got[0]
    assert d.action == "merge" and d.at == 4.0
    # both own one range: the one with fewer keys is moved (less state to copy)
    assert d.ranges == ((0, HALF - 1),) and d.owner == "a" and d.peer == "b"
    # an owner with other ranges keeps them; the one left with nothing gives
    spec3 = [(0, 0x3FFFFF, "a", 1.0, 500), (0x400000, HALF - 1, "b", 1.0, 1), (HALF, KEY_MAX, "a", 150.0, 500)]
    got = play(Balancer(CFG), 0, lambda t: shards(spec3), 10)
    assert got[0].action == "merge" and got[0].owner == "b" and got[0].peer == "a"


def test_never_merge_busy_non_adjacent_helped_mirrored_or_same_owner():
    def never(spec, **kw):
        return play(Balancer(CFG), 0, lambda t: shards(spec, **kw), 30) == []
    # busy: the sum is over merge_rate
    assert never([(0, HALF - 1, "a", 150.0, 1), (HALF, KEY_MAX, "b", 100.0, 1)])
    # non-adjacent: a gap between them (and the middle range unowned)
    assert never([(0, 0x3FFFFF, "a", 1.0, 1), (0x400000, 0x400000, "", None, None), (0x400001, KEY_MAX, "b", 1.0, 1)])
    # a state operation running on either
    assert never([(0, HALF - 1, "a", 1.0, 1), (HALF, KEY_MAX, "b", 1.0, 1)], busy=[(HALF, KEY_MAX)])
    # helpers on one of them
    assert never([(0, HALF - 1, "a", 1.0, 1), (HALF, KEY_MAX, "b", 1.0, 1)], helpers=[(0, HALF - 1)])
    # different mirrors
    assert never([(0, HALF - 1, "a", 1.0, 1), (HALF, KEY_MAX, "b", 1.0, 1)], mirrors={(HALF, KEY_MAX): ["c"]})
    # unknown load
    assert never([(0, HALF - 1, "a", None, 1), (HALF, KEY_MAX, "b", 1.0, 1)])


def test_split_then_merge_never_oscillate():
    """A shard split under load is not merged back while the load lasts, and a merged pair is far
    below the split threshold (merge_rate <= split_rate / 2 is enforced)."""
    cfg = dataclasses.replace(CFG, op_dwell=10.0)
    bal = Balancer(cfg)
    owners = {"ranges": [(0, KEY_MAX, "a")], "epoch": 1}
    got = []
    for t in range(200):
        load = 1500.0 if t < 60 else (600.0 if t < 120 else 20.0)
        rs = owners["ranges"]
        per = load / len(rs)
        obs = ServiceObs("dh", ranges=tuple(RangeObs(lo, hi, o, epoch=owners["epoch"], rate=per, keys=5)
                                            for lo, hi, o in rs),
                         spares=("sp",) if len(rs) == 1 else (), stateful=True)
        for d in bal.decide(float(t), [obs]):
            got.append((d.action, d.at))
            owners["epoch"] += 1
            if d.action == "split":
                (lo, hi), = d.ranges
                owners["ranges"] = [(0, lo - 1, "a"), (lo, hi, "sp")]
            elif d.action == "merge":
                owners["ranges"] = [(0, KEY_MAX, d.peer)]
    assert [a for a, _ in got] == ["split", "merge"], got
    split_at, merge_at = got[0][1], got[1][1]
    assert split_at == 10.0        # op_dwell from the first sight, then the 3 s window had held
    assert merge_at >= 120 + cfg.merge_window


def test_no_split_or_merge_while_an_operation_runs():
    bal = Balancer(CFG)
    assert play(bal, 0, lambda t: shards([(0, KEY_MAX, "a", 5000.0, 1)], busy=[(0, KEY_MAX)]), 20) == []
    # and once the operation ended (range no longer busy), a held window acts at once
    got = play(bal, 20, lambda t: shards([(0, KEY_MAX, "a", 5000.0, 1)]), 2)
    assert [d.action for d in got] == ["split"]


def test_op_dwell_after_a_change_of_epoch():
    cfg = dataclasses.replace(CFG, op_dwell=10.0)
    bal = Balancer(cfg)

    def obs(t):   # epoch bumps at t=20 (somebody changed the range)
        o = shards([(0, KEY_MAX, "a", 5000.0, 1)])
        return dataclasses.replace(o, ranges=tuple(dataclasses.replace(r, epoch=1 if t < 20 else 2) for r in o.ranges))
    got = play(bal, 0, obs, 15)
    assert [d.at for d in got] == [10.0]
    bal = Balancer(cfg)
    play(bal, 0, lambda t: obs(0), 5)     # seen at 0..4, window held, not dwelt yet
    got = play(bal, 20, obs, 15)          # new epoch at 20: ten more seconds
    assert [d.at for d in got] == [30.0]


def test_stateless_services_never_split():
    o = dataclasses.replace(shards([(0, KEY_MAX, "a", 5000.0, 1)]), stateful=False)
    assert play(Balancer(CFG), 0, lambda t: o, 30) == []


def test_two_services_are_independent():
    bal = Balancer(CFG)
    got = []
    for t in range(10):
        got += bal.decide(float(t), [mc(HOT), shards([(0, KEY_MAX, "a", 5000.0, 1)])])
    assert sorted((d.service, d.action, d.at) for d in got) == [("dh", "split", 3.0), ("mc", "helpers_on", 2.0)]


# -- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, words", [
    ({"p99_off_us": 600.0}, ["p99_off_us", "below p99_on_us", "hysteresis"]),
    ({"merge_rate": 600.0}, ["merge_rate", "half of split_rate", "<= 500"]),
    ({"period": 0.0}, ["period", "0.01..60"]),
    ({"stale_after": 0.5, "period": 1.0}, ["stale_after", "make it >= period"]),
    ({"percentile": 1.0}, ["percentile", "0.5..0.9999"]),
    ({"max_helpers": 0}, ["max_helpers", "1..64"]),
    ({"max_helpers": 2.5}, ["max_helpers", "integer"]),
    ({"burst_window": -1}, ["burst_window", "0..3600 s"]),
    ({"helper_gain": 0.5}, ["helper_gain", "1..1000"]),
    ({"split_rate": True}, ["split_rate", "number"]),
    ({"rate_on": 6000.0, "rate_off": 4000.0}, ["rate_off", "at most half of rate_on", "e.g. rate_off = 2000"]),
    ({"rate_on": 6000.0}, ["rate_off", "above 0"]),
])
def test_config_errors_name_the_setting_the_limit_and_the_fix(changes, words):
    with pytest.raises(BalancerConfigError) as exc:
        dataclasses.replace(BalancerConfig(), **changes)
    for w in words:
        assert w in str(exc.value), str(exc.value)


def test_config_from_json():
    cfg = BalancerConfig.from_json('{"split_rate": 50, "merge_rate": 10}')
    assert cfg.split_rate == 50 and cfg.merge_rate == 10
    with pytest.raises(BalancerConfigError, match="unknown settings.*split_rat"):
        BalancerConfig.from_json('{"split_rat": 50}')
    with pytest.raises(BalancerConfigError, match="not JSON"):
        BalancerConfig.from_json("{")
    assert BalancerConfig.from_dict(BalancerConfig().to_dict()) == BalancerConfig()


# -- the runner's parts against real etcd and a real memcached: tests/unit/test_balancer_etcd.py ---------------
