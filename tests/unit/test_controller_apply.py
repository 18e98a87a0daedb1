"""The controller app's commit steps without a switch: bundles between two pauses are in flight together.

The app is built without os-ken's app manager (only the attributes ``_reconcile`` and ``_apply`` read) and
each switch is a fake connection that records when a bundle is sent and when its answer is awaited.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from vfab.controller import app as app_mod
from vfab.controller import engine
from vfab.controller.ofconn import OpError


class FakePlan:
    def __bool__(self) -> bool:
        return True

    def summary(self) -> str:
        return "1 flow added"


class FakeConn:
    def __init__(self, dpid: int, events: list, fail_send: bool = False, fail_wait: bool = False):
        self.dpid, self.events, self.fail_send, self.fail_wait = dpid, events, fail_send, fail_wait

    def send_bundle(self, plan):
        if self.fail_send:
            raise OpError("the connection is closing")
        self.events.append(("send", self.dpid))
        return (self.dpid, 1)

    def wait_bundle(self, sent):
        self.events.append(("wait", self.dpid))
        if self.fail_wait:
            raise OpError("bundle 7: OFPBFC_MSG_FAILED")
        return sent[1]


def want(dpid: int):
    return SimpleNamespace(flows={("flow", dpid): 1}, groups={})


def make_app(conns: dict[int, FakeConn], events: list):
    app = object.__new__(app_mod.VfabController)
    app.conns = conns
    app.locks = {d: threading.Lock() for d in conns}
    app.installed = {d: ({}, {}) for d in conns}
    app.generation, app.verified = {}, set()
    app.resynced = []
    app._sync = app.resynced.append   # hub.spawn(self._sync, conn) after a failed bundle
    app._pause = lambda step: events.append(("pause", step.seconds))
    return app


def commit(dpid: int) -> engine.Commit:
    return engine.Commit(dpid, FakePlan(), want(dpid))


def test_bundles_to_several_switches_are_sent_before_any_answer_is_awaited():
    events: list = []
    app = make_app({d: FakeConn(d, events) for d in (1, 2, 3)}, events)
    failed = app._apply([commit(2), commit(1), commit(3)], dict(app.installed), 5)
    assert failed == set()
    # one round trip for all three, in the engine's order; sequential commits would interleave send/wait
    assert events == [("send", 2), ("send", 1), ("send", 3), ("wait", 2), ("wait", 1), ("wait", 3)]
    assert all(app.installed[d] == (want(d).flows, {}) for d in (1, 2, 3))
    assert all(not lock.locked() for lock in app.locks.values())


@pytest.mark.parametrize("where", ["send", "wait"])
def test_a_failed_bundle_fails_its_switch_alone_and_has_it_read_again(where, monkeypatch):
    monkeypatch.setattr(app_mod.hub, "spawn", lambda fn, *a: fn(*a))
    events: list = []
    conns = {1: FakeConn(1, events), 2: FakeConn(2, events, fail_send=where == "send", fail_wait=where == "wait"),
             3: FakeConn(3, events)}
    app = make_app(conns, events)
    failed = app._apply([commit(1), commit(2), commit(3)], dict(app.installed), 5)
    assert failed == {2}
    assert 2 not in app.installed and app.resynced == [conns[2]]
    assert app.installed[1] == (want(1).flows, {}) and app.installed[3] == (want(3).flows, {})
    assert all(not lock.locked() for lock in app.locks.values())


def test_a_switch_that_went_away_is_failed_and_the_others_turn():
    events: list = []
    app = make_app({d: FakeConn(d, events) for d in (1, 3)}, events)   # switch 2 disconnected
    failed = app._apply([commit(1), commit(2), commit(3)], dict(app.installed), 5)
    assert failed == {2}
    assert events == [("send", 1), ("send", 3), ("wait", 1), ("wait", 3)]


def test_a_pause_or_a_barrier_ends_the_group_of_bundles_in_flight(monkeypatch):
    """A hop-by-hop route's next switch must not turn before the last one's datapath did: the pause waits
    for the answers of every bundle before it, and the bundles after it are sent only then; a barrier the
    same, without the pause."""
    events: list = []
    app = make_app({d: FakeConn(d, events) for d in (1, 2, 3, 4, 5)}, events)
    rnd = engine.Round(revision=9, steps=[commit(1), engine.Pause(0.005), commit(2), commit(3), engine.Barrier(),
                                          commit(4), commit(5)])
    monkeypatch.setattr(app_mod.engine, "plan_round", lambda *a, **k: rnd)
    app.mirror_lock, app.hold_lock, app.report_cv = threading.Lock(), threading.Lock(), threading.Condition()
    app.items, app.revision, app.hold, app.parsed, app.problems, app.to_report = {}, 9, {}, {}, set(), []
    app.departed, app.retired = {}, {}
    app.config = SimpleNamespace(settle=0.005, node="")
    app.reporter = SimpleNamespace(reported={})
    app._hold_groups = lambda held, failed: None
    app._reconcile()
    assert events == [("send", 1), ("wait", 1), ("pause", 0.005), ("send", 2), ("send", 3), ("wait", 2),
                      ("wait", 3), ("send", 4), ("send", 5), ("wait", 4), ("wait", 5)]   # a barrier: no pause


def test_a_deleted_endpoint_record_lingers_for_the_configured_time_then_goes():
    """Only endpoint records linger (a range's or a helper status's deletion does not), for ``config.linger``
    seconds; the next round after that ends is asked for (the earliest end)."""
    from vfab.vid.registry import schema

    app = object.__new__(app_mod.VfabController)
    app.config, app.departed = SimpleNamespace(linger=2.0, node=""), {}
    ep, rng = schema.endpoint_key("mc", "h1"), schema.range_key("mc", 0)
    t0 = app_mod.time.time()
    app._departed(ep, b"{ep}")
    app._departed(rng, b"{range}")
    lingering, end = app._lingering(t0)
    assert lingering == {ep: b"{ep}"} and t0 + 1.9 < end <= app_mod.time.time() + 2.0
    assert app._lingering(end + 0.01) == ({}, None) and app.departed == {}
    app.config = SimpleNamespace(linger=0.0, node="")
    app._departed(ep, b"{ep}")
    assert app.departed == {}


def test_an_endpoint_gone_across_an_etcd_reload_lingers_too():
    """The watch's reload (etcd restarted, the watch lost): an endpoint record missing from the reloaded items
    lingers like one deleted by an event; one that is back, or any other record gone, does not."""
    from vfab.vid.registry import schema

    gone, back, rng = (schema.endpoint_key("mc", "mc0"), schema.endpoint_key("mc", "h1"),
                       schema.range_key("mc", 0))

    class Registry:
        endpoint = "etcd-under-test"

        def follow(self, prefix, reset, apply, stop, **kwargs):
            reset({back: (b"{h1}", 7)}, 7)                         # mc0 and the range vanished meanwhile

    app = object.__new__(app_mod.VfabController)
    app.config, app.departed, app.registry = SimpleNamespace(linger=2.0, node=""), {}, Registry()
    app.mirror_lock, app.dirty = threading.Lock(), threading.Event()
    app.items, app.revision = {gone: b"{mc0}", back: b"{h1}", rng: b"{range}"}, 5
    app._watch_loop()
    assert app.items == {back: b"{h1}"} and app.revision == 7 and app.dirty.is_set()
    assert list(app.departed) == [gone] and app.departed[gone][0] == b"{mc0}"
    lingering, _ = app._lingering(app_mod.time.time())
    assert lingering == {gone: b"{mc0}"}


def test_a_route_agent_compiles_what_changed_and_the_whole_switch_after_a_failed_round(monkeypatch):
    """Node mode: the first round compiles the whole switch; a round after an adopted one gets the keys
    that changed (``node_changed``, which the watch fills) and commits what a whole compile makes; a failed
    bundle makes the next round compile the whole switch again (its memory is not what the switch holds)."""
    from bench import scale_model as model
    from bench.scale import range_record, records
    from vfab.controller import nodeplan
    from vfab.fabric.nodecompile import Memory, compile_node
    from vfab.vid.registry import schema

    monkeypatch.setattr(app_mod.hub, "spawn", lambda fn, *a: None)
    w = model.Workload(4, 8, 3, per_service=2)
    items = {k: v.encode() for k, v in records(w).items()}
    events: list = []
    app = make_app({1: FakeConn(1, events)}, events)
    app.mirror_lock, app.hold_lock, app.report_cv = threading.Lock(), threading.Lock(), threading.Condition()
    app.items, app.revision, app.hold, app.parsed, app.problems, app.to_report = items, 1, {}, {}, set(), []
    app.departed, app.retired, app.changed_at, app.dirty = {}, {}, None, threading.Event()
    app.config = SimpleNamespace(settle=0.005, node="n1", node_whole=False, linger=0.0)
    app.reporter = SimpleNamespace(reported={})
    app._hold_groups = lambda held, failed: None
    app._switch_ports = lambda: {}
    app.node_memory, app.node_changed, app.node_waiting, app.node_waiting_keys = Memory(), None, {}, frozenset()
    app.lead = 1
    calls = []
    real = nodeplan.compile_node
    monkeypatch.setattr(nodeplan, "compile_node", lambda *a, **k: calls.append(k["changed"]) or real(*a, **k))

    def move(revision: int) -> str:   # a range move as the watch brings it: the mirror and the changed keys
        sid, index, to = model.pick_change(w, rnd)
        w.owned.update(model.move(w, sid, index, to).owned)
        r = w.owned[sid][index]
        key = schema.range_key(f"s{sid}", r.lo)
        with app.mirror_lock:
            app.items[key] = range_record(w, sid, r).to_json().encode()
            app.revision = revision
            if app.node_changed is not None:
                app.node_changed.add(key)
        return key

    def whole(revision: int, memory) -> dict:
        return compile_node(dict(app.items), "n1", revision, memory, tunnel_ports={}).config.flows

    import random
    rnd = random.Random(3)
    app._reconcile()
    assert calls == [None] and app.installed[1][0] == whole(1, None) and app.node_changed == set()
    key, memory = move(2), app.node_memory
    app._reconcile()
    assert calls[-1] == {key} and app.installed[1][0] == whole(2, memory)
    app.conns[1].fail_send = True
    revision = 3
    while 1 in app.installed:   # until a move changes n1's flows: its bundle fails
        assert revision < 30 and calls[-1] is not None
        move(revision)
        app._reconcile()
        revision += 1
    assert app.node_changed is None
    app.installed[1] = ({}, {})   # read again (an empty table)
    app.conns[1].fail_send = False
    move(revision)
    memory = app.node_memory
    app._reconcile()
    assert calls[-1] is None and app.installed[1][0] == whole(revision, memory)
