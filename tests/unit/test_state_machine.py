"""The state operations' decisions, driven by scripted results: no zmq, no etcd, no clock."""

from __future__ import annotations

import pytest

from vfab.vid.errors import StateError
from vfab.vid.ranges import Range
from vfab.vid.registry import schema
from vfab.vid.state import machine as m

FULL = Range(0, 0xFFFFFF)
HALF = Range(0x800000, 0xFFFFFF)


def rec(lo, hi, owner, epoch=1, mirrors=()):
    return schema.RangeRec(lo=lo, hi=hi, owner=owner, mirrors=list(mirrors), epoch=epoch)


class Script:
    """Drives an operation: answers each action with ``answer(action)``; records the actions."""

    def __init__(self, answer):
        self.answer = answer
        self.actions: list = []
        self.now = 100.0

    def run(self, gen) -> m.Outcome:
        action = gen.send(None)
        while True:
            self.actions.append(action)
            self.now += 0.001
            try:
                action = gen.send(m.Result(self.now, self.answer(action)))
            except StopIteration as stop:
                return stop.value

    def kinds(self) -> list[str]:
        out = []
        for a in self.actions:
            if isinstance(a, m.Ask):
                out.append(a.type)
            elif isinstance(a, m.LoopCmd):
                out.append(f"{a.cmd}{'>' + a.to if a.to else ''}")
            elif not isinstance(a, (m.Now, m.Publish)):
                out.append(type(a).__name__)
        return out


def world(maps, assign=lambda a: 42, ask=lambda a: {}, copy=lambda a: 10, drop=lambda a: 5, loop=lambda a: None):
    """An answer function: successive ReadRanges return successive maps (the last one repeats)."""
    maps = list(maps)

    def answer(a):
        if isinstance(a, m.ReadRanges):
            return maps.pop(0) if len(maps) > 1 else maps[0]
        if isinstance(a, m.Assign):
            return assign(a)
        if isinstance(a, m.Ask):
            return ask(a)
        if isinstance(a, m.Copy):
            return copy(a)
        if isinstance(a, m.Drop):
            return drop(a)
        if isinstance(a, m.LoopCmd):
            return loop(a)
        return None
    return answer


def test_split_happy_path_order():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 3)]]))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "done" and not out.error and not out.notes
    assert s.kinds() == ["ReadRanges", "BEGIN", "target>b", "Copy", "SYNC", "ReadRanges", "pause", "SYNC",
                         "Assign", "release>b", "COMMIT", "Drop", "Coalesce"]
    assign = next(a for a in s.actions if isinstance(a, m.Assign))
    assert (assign.owner, assign.expect_epoch, assign.rng) == ("b", 3, HALF)
    release = next(a for a in s.actions if isinstance(a, m.LoopCmd) and a.cmd == "release")
    assert release.rec.owner == "b" and release.rec.epoch == 4 and release.revision == 42
    assert {"copy_s", "flip_s", "total_s"} <= set(out.timings)


def test_mirror_never_undoes_an_ownership_change_made_during_its_copy():
    # While the copy ran, the range moved to c (epoch 2): the mirror must not assign a back as owner.
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)], [rec(0, 0xFFFFFF, "c", 2)]]))
    out = s.run(m.operation("mirror", "a", "b", [FULL], 0.0))
    assert out.phase == "failed" and "now owned by c" in out.error
    assert not any(isinstance(a, m.Assign) for a in s.actions)
    assert s.kinds()[-2:] == ["untarget", "ABORT"]


def test_mirror_with_a_vanished_range_fails_clearly_instead_of_index_error():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)], []]))
    out = s.run(m.operation("mirror", "a", "b", [FULL], 0.0))
    assert out.phase == "failed" and "no longer inside one range" in out.error
    assert not any(isinstance(a, m.Assign) for a in s.actions)


def test_mirror_happy_path_adds_the_peer_without_pausing():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1, ["x"])]]))
    out = s.run(m.operation("mirror", "a", "b", [FULL], 0.0))
    assert out.phase == "done"
    assert "pause" not in s.kinds()
    assign = next(a for a in s.actions if isinstance(a, m.Assign))
    assert assign.owner == "a" and assign.mirrors == ["b", "x"]


def test_abort_after_the_pause_releases_held_requests_here():
    # The peer dies while the range is paused (its last SYNC is unanswered): the held requests are served here.
    syncs = []

    def ask(a):
        if a.type == "SYNC":
            syncs.append(a)
            if len(syncs) == 2:
                return m.Failure("peer", "b did not answer SYNC within 3 s")
        return {}
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], ask=ask))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "failed" and "last writes durable" in out.error
    release = [a for a in s.actions if isinstance(a, m.LoopCmd) and a.cmd == "release"]
    assert len(release) == 1 and release[0].to == "" and release[0].rec is None
    assert s.kinds()[-1] == "ABORT"
    assert not any(isinstance(a, m.Assign) for a in s.actions)


def test_an_epoch_change_seen_before_the_pause_aborts_without_pausing():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)], [rec(0, 0xFFFFFF, "a", 2)]]))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "failed" and "changed while it was copied" in out.error
    assert "pause" not in s.kinds() and s.kinds()[-2:] == ["untarget", "ABORT"]


def test_commit_unanswered_after_the_flip_is_done_with_a_note():
    def ask(a):
        return m.Failure("peer", "b did not answer COMMIT within 3 s") if a.type == "COMMIT" else {}
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], ask=ask))
    out = s.run(m.operation("mirror", "a", "b", [FULL], 0.0))
    assert out.phase == "done" and not out.error
    assert any("did not confirm the commit" in n for n in out.notes)
    assert "ABORT" not in s.kinds()


def test_a_drop_failure_after_the_flip_is_done_with_a_note_naming_the_cause():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], drop=lambda a: m.Failure("disk", "database or disk is full")))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "done" and not out.error
    assert any("database or disk is full" in n for n in out.notes)


def test_ambiguous_flip_that_committed_is_recognised():
    maps = [[rec(0, 0xFFFFFF, "a", 1)], [rec(0, 0xFFFFFF, "a", 1)],
            [rec(0, 0x7FFFFF, "a", 2), rec(0x800000, 0xFFFFFF, "b", 2)]]
    s = Script(world(maps, assign=lambda a: m.Failure("etcd", "etcd unreachable (ConnectionError)")))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "done", out.error
    assert sum(isinstance(a, m.Assign) for a in s.actions) == 1


def test_ambiguous_flip_that_did_not_commit_is_retried():
    tries = []

    def assign(a):
        tries.append(a)
        return m.Failure("etcd", "etcd unreachable") if len(tries) == 1 else 77
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], assign=assign))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "done" and len(tries) == 2


def test_lost_race_aborts():
    maps = [[rec(0, 0xFFFFFF, "a", 1)], [rec(0, 0xFFFFFF, "a", 1)], [rec(0, 0xFFFFFF, "z", 2)]]
    s = Script(world(maps, assign=lambda a: m.Failure("conflict", "epoch moved")))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "failed" and "lost a race" in out.error
    assert s.kinds()[-2:] == ["release", "ABORT"]


def test_cancel_during_the_copy():
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], copy=lambda a: m.Failure("cancelled", "cancelled")))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "cancelled" and "nothing changed" in out.error
    assert s.kinds()[-2:] == ["untarget", "ABORT"]
    assert not any(isinstance(a, m.Assign) for a in s.actions)


def test_a_failed_replication_fails_the_pause():
    def loop(a):
        return m.Failure("replication", "replication to b failed (did not acknowledge)") if a.cmd == "pause" else None
    s = Script(world([[rec(0, 0xFFFFFF, "a", 1)]], loop=loop))
    out = s.run(m.operation("split", "a", "b", [HALF], 0.0))
    assert out.phase == "failed" and "replication to b failed" in out.error
    assert not any(isinstance(a, m.Assign) for a in s.actions)


def test_etcd_down_at_the_start_fails_before_anything_is_sent():
    s = Script(world([m.Failure("etcd", "etcd at 127.0.0.1:1 is unreachable")]))
    out = s.run(m.operation("move", "a", "b", [FULL], 0.0))
    assert out.phase == "failed" and "unreachable" in out.error
    assert s.kinds() == ["ReadRanges"]


def test_move_of_several_ranges_stops_at_the_first_failure():
    maps = [[rec(0, 0x7FFFFF, "a", 1), rec(0x800000, 0xFFFFFF, "a", 1)]]

    def ask(a):
        return m.Failure("peer", "b refused BEGIN: disk full") if a.type == "BEGIN" and a.body["lo"] else {}
    s = Script(world(maps, ask=ask))
    out = s.run(m.operation("move", "a", "b", [Range(0, 0x7FFFFF), HALF], 0.0))
    assert out.phase == "failed" and "disk full" in out.error
    assert sum(isinstance(a, m.Assign) for a in s.actions) == 1


# -- validation -----------------------------------------------------------------------------------
EPS = {"a": schema.Endpoint(service="s", name="a", mac="00:00:00:00:00:01", ctl="tcp://127.0.0.1:1"),
       "b": schema.Endpoint(service="s", name="b", mac="00:00:00:00:00:02", ctl="tcp://127.0.0.1:2"),
       "x": schema.Endpoint(service="s", name="x", mac="00:00:00:00:00:03")}


@pytest.mark.parametrize("kind, peer, rng, ranges, busy, match", [
    ("split", "a", HALF, [rec(0, 0xFFFFFF, "a")], "", "the peer is this endpoint itself"),
    ("split", "nobody", HALF, [rec(0, 0xFFFFFF, "a")], "", "not a live stateful endpoint"),
    ("split", "x", HALF, [rec(0, 0xFFFFFF, "a")], "", "not a live stateful endpoint"),
    ("split", "b", HALF, [rec(0, 0x8FFFFF, "a"), rec(0x900000, 0xFFFFFF, "b")], "", "does not own all of"),
    ("split", "b", None, [rec(0, 0xFFFFFF, "a")], "", "split needs a range"),
    ("move", "b", None, [rec(0, 0xFFFFFF, "b")], "", "owns no range"),
    ("mirror", "b", None, [rec(0, 0xFFFFFF, "a", mirrors=["b"])], "", "already mirrors"),
    ("split", "b", HALF, [rec(0, 0xFFFFFF, "a")], "a split to b", "already running"),
    ("shuffle", "b", HALF, [rec(0, 0xFFFFFF, "a")], "", "unknown operation"),
])
def test_validate_refuses_with_reasons(kind, peer, rng, ranges, busy, match):
    with pytest.raises(StateError, match=match):
        m.validate(kind, "a", peer, rng, ranges, EPS, busy)


def test_validate_mirror_skips_ranges_already_mirrored():
    ranges = [rec(0, 0x7FFFFF, "a", mirrors=["b"]), rec(0x800000, 0xFFFFFF, "a")]
    assert m.validate("mirror", "a", "b", None, ranges, EPS) == [HALF]


def test_a_second_operation_during_a_merge_is_refused_naming_the_merge():
    """The loop names the running operation by its record ("merge"), not by its kind (a merge runs as a split)."""
    from types import SimpleNamespace

    from vfab.vid.state.loop import EndpointLoop
    from vfab.vid.state.runner import OpRunner

    loop = object.__new__(EndpointLoop)
    loop.name = "a"
    loop.service = SimpleNamespace(name="kv")
    loop.view = SimpleNamespace(ranges=[rec(0, 0xFFFFFF, "a")], endpoints={"b": SimpleNamespace(ctl="tcp://x")})
    loop.op = OpRunner(loop, "split", "b", [HALF], 0.0, "a.0001", "merge")
    with pytest.raises(StateError, match=r"already running a merge to b \(a\.0001\)"):
        loop.start_op("split", "b", HALF)
