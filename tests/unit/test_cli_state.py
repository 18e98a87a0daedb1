"""The state-operation and KVS commands of the CLI, and the load/op columns of 'ranges'/'status'.

Against a real etcd; stateful endpoints are played by a fake: a ZeroMQ ROUTER
that accepts operator commands and publishes the operation's record in etcd
the way the state manager does (prepare → copy → flip → done, or cancelled).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq
from click.testing import CliRunner

from vfab.cli import cmd_state
from vfab.cli.main import cli
from vfab.vid.registry import schema
from vfab.vid.envelope import Envelope, decode
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry


@pytest.fixture
def run(registry):
    runner = CliRunner()

    def invoke(*args: str, input=None):
        return runner.invoke(cli, ["--etcd", registry.endpoint, *args], input=input)

    invoke.registry = registry
    return invoke


class FakeEndpoint:
    """Answers SPLIT/MOVE/MIRROR/CANCEL on a control socket and plays the op out in etcd."""

    def __init__(self, registry: Registry, service: str, name: str, mac: str, *, fail: str = "",
                 stall: bool = False, total: int = 1000):
        self.etcd, self.service, self.name = registry.endpoint, service, name
        self.fail, self.stall, self.total = fail, stall, total
        self.got: list[Envelope] = []
        self.plays: list[threading.Thread] = []
        self.cancelled = threading.Event()
        self.stop = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        registry.announce(schema.Endpoint(service=service, name=name, mac=mac, ctl=f"tcp://127.0.0.1:{port}"),
                          ttl=30)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50, zmq.POLLIN):
                continue
            ident, *rest = self.sock.recv_multipart()
            env = decode(rest)
            self.got.append(env)
            if env.type in ("SPLIT", "MOVE", "MIRROR"):
                b = env.body
                ranges = [[b["lo"], b["hi"]]] if "lo" in b else [[0, 0x7FFFFF]]
                self.op_id = f"{self.name}.{len(self.plays):08x}"
                kind = "merge" if b.get("merge") is True else env.type.lower()   # as the endpoint loop records it
                play = threading.Thread(target=self._play, args=(kind, b["peer"], ranges, self.op_id), daemon=True)
                play.start()
                self.plays.append(play)
                reply = env.reply("OK", self.name, op=self.op_id, ranges=ranges)
            elif env.type == "CANCEL":
                self.cancelled.set()
                reply = env.reply("OK", self.name, op=self.op_id)
            else:
                reply = env.reply("ERR", self.name, error=f"unknown {env.type}")
            self.sock.send_multipart([ident, *reply.frames()])
        self.sock.close(0)

    def _play(self, kind: str, peer: str, ranges: list, op_id: str) -> None:
        time.sleep(0.2)  # like the state manager, which counts the keys before it publishes the record
        reg = Registry(self.etcd)
        rec = schema.OpRec(op=kind, source=self.name, peer=peer, ranges=ranges, total=self.total,
                           started=time.time(), updated=time.time(), id=op_id)
        reg.put(schema.op_key(self.service, rec.id), rec.to_json())
        rec.phase = "copy"
        for done in range(0, self.total + 1, self.total // 4):
            rec.done = done
            reg.put(schema.op_key(self.service, rec.id), rec.to_json())
            time.sleep(0.06)
            if self.stall and done >= self.total // 2:
                self.cancelled.wait(10)
            if self.cancelled.is_set():
                rec.phase, rec.error = "cancelled", "cancelled by the operator before the flip; nothing changed"
                rec.timings = {"total_s": 0.3}
                reg.put(schema.op_key(self.service, rec.id), rec.to_json())
                return
        rec.timings = {"copy_s": 0.25}
        if self.fail:
            rec.phase, rec.error, rec.timings["total_s"] = "failed", self.fail, 0.3
            reg.put(schema.op_key(self.service, rec.id), rec.to_json())
            return
        rec.phase = "flip"
        reg.put(schema.op_key(self.service, rec.id), rec.to_json())
        for lo, hi in ranges:
            if kind == "mirror":
                reg.assign(self.service, Range(lo, hi), self.name, mirrors=[peer])
            else:
                reg.assign(self.service, Range(lo, hi), peer)
        rec.phase = "done"
        rec.timings.update(flip_s=0.012, switches_s=0.034, total_s=0.321)
        reg.put(schema.op_key(self.service, rec.id), rec.to_json())
        reg.close()

    def close(self) -> None:
        """Stop serving and let every op end before the test's etcd tree is wiped."""
        self.stop.set()
        self.thread.join(2)
        for play in self.plays:
            play.join(5)  # an op left running (--no-wait) ends normally; a stalled one on the next line
            self.cancelled.set()
            play.join(5)


@pytest.fixture
def kv(registry):
    """Service kv: s1 owns 0-0x7fffff, s2 0x800000-0xffffff; both stateless until a test adds fakes."""
    registry.create_service("kv")
    return registry


def _fakes(registry, **kw):
    s1 = FakeEndpoint(registry, "kv", "s1", "00:00:00:00:00:01", **kw)
    s2 = FakeEndpoint(registry, "kv", "s2", "00:00:00:00:00:02")
    registry.assign("kv", Range(0, 0x7FFFFF), "s1")
    registry.assign("kv", Range(0x800000, 0xFFFFFF), "s2")
    return s1, s2


@pytest.fixture
def fakes(kv):
    s1, s2 = _fakes(kv)
    yield s1, s2
    s1.close()
    s2.close()


# -- help -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["split"], ["--to", "--throttle", "--no-wait", "--timeout", "LO-HI", "starve"]),
    (["merge"], ["--into", "--throttle", "--no-wait", "--timeout", "LO-HI"]),
    (["move"], ["SOURCE", "--to", "--throttle", "--no-wait", "--timeout"]),
    (["mirror"], ["SOURCE", "--to", "--throttle", "--no-wait", "--timeout"]),
    (["cancel"], ["SERVICE", "SOURCE"]),
    (["kvs"], ["--host", "--iface", "--netns", "--timeout", "get", "put", "del"]),
    (["kvs", "get"], ["SERVICE", "KEY", "--hex"]),
    (["kvs", "put"], ["SERVICE", "KEY", "VALUE", "--hex", "stdin", "1280"]),
    (["kvs", "del"], ["SERVICE", "KEY", "--hex"]),
    ([], ["split", "merge", "move", "mirror", "kvs"]),
])
def test_help_mentions_the_options(run, args, needles):
    res = run(*args, "--help")
    assert res.exit_code == 0, res.output
    for n in needles:
        assert n in res.output, (n, res.output)


# -- bad input: exit 2 (usage) or 1 (the fabric says no) -------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["split", "kv", "5-1", "--to", "s2"], "lo must be <= hi"),
    (["split", "kv", "zz", "--to", "s2"], "not a number"),
    (["split", "kv", "0-0x1000000", "--to", "s2"], "out of bounds"),
    (["split", "kv", "0-0xff"], "Missing option '--to'"),
    (["split", "kv", "0x700000-0x900000", "--to", "s2"], "not inside one owner's ranges"),
    (["split", "kv", "0-0xff", "--to", "s1"], "already owns"),
    (["merge", "kv", "0-0xff", "--into", "S 1"], "invalid"),
    (["move", "kv", "s1", "--to", "s1"], "source itself"),
    (["move", "kv", "s1", "--to", "s2", "--throttle", "-5"], "-5"),
    (["mirror", "kv", "s1", "--to", "s2", "--timeout", "0"], "x>0"),
    (["kvs", "get", "kv", "k"], "exactly one of --host"),
    (["kvs", "--host", "vfh1", "--iface", "lo", "get", "kv", "k"], "exactly one of --host"),
    (["kvs", "--iface", "lo", "put", "kv", "k", "x" * 1281], "1280"),
    (["kvs", "--iface", "lo", "put", "kv", "", "v"], "keys are 1..128 B"),
    (["kvs", "--iface", "lo", "get", "kv", "zz", "--hex"], "not hex"),
])
def test_bad_input_is_exit_2(run, fakes, args, needle):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert "Traceback" not in res.output


def test_put_of_an_oversized_stdin_value_is_exit_2(run, kv):
    res = run("kvs", "--iface", "lo", "put", "kv", "k", "-", input=b"x" * 2000)
    assert res.exit_code == 2 and "2000 B" in res.output and "1280" in res.output


def test_unknown_peer_is_exit_1_with_the_live_stateful_endpoints(run, fakes):
    for args in (["split", "kv", "0-0xff", "--to", "s9"], ["move", "kv", "s1", "--to", "s9"],
                 ["mirror", "kv", "s1", "--to", "s9", "--no-wait"]):
        res = run(*args)
        assert res.exit_code == 1, res.output
        assert "'s9' is not a live stateful endpoint" in res.output and "s1, s2" in res.output
    assert not any(f.got for f in fakes)  # nothing was sent


def test_unknown_source_is_exit_1_with_the_live_stateful_endpoints(run, fakes):
    res = run("move", "kv", "s7", "--to", "s2")
    assert res.exit_code == 1 and "'s7'" in res.output and "live: s1, s2" in res.output


def test_stateless_owner_is_exit_1(run, kv):
    kv.announce(schema.Endpoint(service="kv", name="s1", mac="00:00:00:00:00:01"), ttl=30)
    peer = FakeEndpoint(kv, "kv", "s2", "00:00:00:00:00:02")
    try:
        kv.assign("kv", Range(0, 0xFFFFFF), "s1")
        res = run("split", "kv", "0-0xff", "--to", "s2")
        assert res.exit_code == 1 and "'s1'" in res.output and "not a live stateful endpoint" in res.output
    finally:
        peer.close()


def test_unknown_service_is_exit_1(run, kv):
    res = run("split", "nosuch", "0-1", "--to", "s2")
    assert res.exit_code == 1 and "does not exist" in res.output


def test_kvs_unknown_host_is_exit_2(run, kv, monkeypatch, tmp_path):
    from vfab.cli import common

    state = tmp_path / "up.json"
    state.write_text(json.dumps({"hosts": {"vfh1": {"iface": "vfh1-eth0", "pid": 1}}}))
    monkeypatch.setattr(common, "STATE_FILE", str(state))
    res = run("kvs", "--host", "vfh9", "get", "kv", "k")
    assert res.exit_code == 2 and "no host 'vfh9'" in res.output and "vfh1" in res.output


# -- operations against the fake endpoints ------------------------------------------------------------
def test_split_follows_the_op_and_prints_the_summary(run, fakes):
    s1, _ = fakes
    res = run("split", "kv", "0x400000-0x7fffff", "--to", "s2", "--throttle", "100")
    assert res.exit_code == 0, res.output
    sent = [e for e in s1.got if e.type == "SPLIT"][0]
    assert sent.body == {"peer": "s2", "lo": 0x400000, "hi": 0x7FFFFF, "throttle": 100.0}
    assert "copy 500/1000 keys (50%)" in res.output  # non-TTY progress: a line per phase / ~10 %
    assert "flip" in res.output
    last = res.stdout.strip().splitlines()[-1]
    assert "done" in last and "copy 0.250 s" in last and "flip 0.012 s" in last and "total 0.321 s" in last
    assert "total 0.321 s" in last and "0x400000-0x7fffff: s2" in last


def test_merge_asks_the_owner(run, fakes):
    s1, s2 = fakes
    res = run("merge", "kv", "0x800000-0xffffff", "--into", "s1")
    assert res.exit_code == 0, res.output
    assert [e.body for e in s2.got if e.type == "SPLIT"] == [
        {"peer": "s1", "lo": 0x800000, "hi": 0xFFFFFF, "throttle": 0.0, "merge": True}]   # recorded as a merge
    assert "0x800000-0xffffff: s1" in res.stdout
    res = run("status")   # the finished op: a merge from the owner that gave the range (s2) to s1, not a split
    assert res.exit_code == 0, res.output
    row = [ln for ln in res.output.splitlines() if "s2 -> s1" in ln]
    assert row and "merge" in row[0] and "split" not in row[0], res.output


def test_the_demo_prints_an_operations_progress_before_its_done_line(run, fakes):
    """The KVS demo runs the real CLI: its progress lines (stderr) come before the "done" line (stdout)."""
    from types import SimpleNamespace

    from vfab.testbed import kvs_demo

    out = kvs_demo.vfab(SimpleNamespace(etcd_endpoint=run.registry.endpoint),
                        ["split", "kv", "0x400000-0x7fffff", "--to", "s2"]).splitlines()
    progress = [i for i, ln in enumerate(out) if " keys (" in ln]
    done = [i for i, ln in enumerate(out) if ": done;" in ln]   # the summary (a progress line says "done 1000/1000")
    assert progress and done == [len(out) - 1] and max(progress) < done[0], out


def test_mirror_summary_names_the_mirror(run, fakes):
    res = run("mirror", "kv", "s1", "--to", "s2")
    assert res.exit_code == 0, res.output
    assert "0x000000-0x7fffff: s1 (mirrors s2)" in res.stdout


def test_back_to_back_ops_report_their_own_record(run, fakes):
    """The previous op's record (ended < 1 s ago) must not be taken for the new one's."""
    assert run("mirror", "kv", "s1", "--to", "s2").exit_code == 0
    res = run("move", "kv", "s1", "--to", "s2")
    assert res.exit_code == 0, res.output
    rec = [r for r in fakes[0].got if r.type in ("MIRROR", "MOVE")]
    assert [r.type for r in rec] == ["MIRROR", "MOVE"]
    op = [o for o in run.registry.ops("kv") if o.source == "s1"][-1]
    assert (op.op, op.phase) == ("move", "done")  # the CLI returned only once the move had ended
    assert "copy 250/1000 keys (25%)" in res.output
    assert "0x000000-0x7fffff: s2" in res.stdout


def test_no_wait_returns_once_accepted(run, fakes):
    res = run("move", "kv", "s1", "--to", "s2", "--no-wait")
    assert res.exit_code == 0, res.output
    assert "accepted by s1" in res.output and "vfab cancel kv s1" in res.output


def test_failed_op_is_exit_1_with_its_error(run, kv):
    s1, s2 = _fakes(kv, fail="peer did not answer CHUNK within 3 s (dead or overloaded?)")
    try:
        res = run("split", "kv", "0-0xff", "--to", "s2")
        assert res.exit_code == 1, res.output
        assert "failed" in res.output and "did not answer CHUNK" in res.output
        assert "0x000000-0x7fffff: s1" in res.output  # nothing moved
    finally:
        s1.close()
        s2.close()


def test_ctrl_c_while_following_cancels(run, kv, monkeypatch):
    s1, s2 = _fakes(kv, stall=True)
    follow = cmd_state.Follow.__call__

    def interrupt_in_copy(self, rec):
        follow(self, rec)
        if rec.phase == "copy" and rec.done >= 250:
            raise KeyboardInterrupt

    monkeypatch.setattr(cmd_state.Follow, "__call__", interrupt_in_copy)
    try:
        res = run("split", "kv", "0-0xff", "--to", "s2")
        assert res.exit_code == 1, res.output
        assert "interrupted: cancelling s1's split" in res.output
        assert "cancelled" in res.output and "nothing changed" in res.output
        assert [e.type for e in s1.got] == ["SPLIT", "CANCEL"]
        assert kv.owner_of("kv", 0x10).owner == "s1"
    finally:
        s1.close()
        s2.close()


def test_cancel_command(run, kv):
    s1, s2 = _fakes(kv, stall=True)
    try:
        assert run("split", "kv", "0-0xff", "--to", "s2", "--no-wait").exit_code == 0
        deadline = time.monotonic() + 5
        while (rec := kv.ops("kv")) == [] or rec[0].done < 500:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        res = run("cancel", "kv", "s1")
        assert res.exit_code == 0, res.output
        assert "split s1 -> s2: cancelled after 500/1000 keys" in res.stdout
    finally:
        s1.close()
        s2.close()


def test_cancel_of_an_unknown_endpoint_is_exit_1(run, fakes):
    res = run("cancel", "kv", "s5")
    assert res.exit_code == 1 and "not a live stateful endpoint" in res.output and "s1, s2" in res.output


# -- keys and req/s in 'ranges' and 'status', with state operations ----------------------------------
@pytest.fixture
def reported(kv):
    kv.announce(schema.Endpoint(service="kv", name="s1", mac="00:00:00:00:00:01"), ttl=30)
    kv.announce(schema.Endpoint(service="kv", name="s2", mac="00:00:00:00:00:02"), ttl=30)
    kv.assign("kv", Range(0, 0x7FFFFF), "s1")
    kv.assign("kv", Range(0x800000, 0xFFFFFF), "s2")
    kv.put(schema.load_key("kv", "s1"),
           schema.Load(at=time.time(), ranges=[[0, 0x7FFFFF, 4242, 123.25]], role={"000000": "owner"}).to_json())
    for rec in (schema.OpRec(op="split", source="s1", peer="s2", ranges=[[0x400000, 0x7FFFFF]], phase="copy",
                             done=300, total=1200, started=time.time(), id="s1.0001"),
                schema.OpRec(op="move", source="s2", peer="s3", ranges=[[0x800000, 0xFFFFFF]], phase="failed",
                             error="peer refused BEGIN: disk full", started=time.time(), id="s2.0001")):
        kv.put(schema.op_key("kv", rec.id), rec.to_json())
    return kv


def test_ranges_shows_keys_and_rate(run, reported):
    res = run("ranges", "kv")
    assert res.exit_code == 0, res.output
    head = [ln for ln in res.output.splitlines() if "owner" in ln][0]
    for col in ("lo", "hi", "owner", "mirrors", "helpers", "epoch", "state", "packets", "keys", "req/s"):
        assert col in head
    row1 = [ln for ln in res.output.splitlines() if "0x7fffff" in ln][0]
    assert "4242" in row1 and "123.2" in row1
    row2 = [ln for ln in res.output.splitlines() if "0xffffff" in ln][0]
    assert row2.rstrip(" │|").split()[-1] == "-" and "4242" not in row2  # s2 sent no report


def test_status_shows_load_and_ops(run, reported):
    res = run("status")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "kv: ranges" in out and "4242" in out and "123.2" in out
    assert "kv: state operations" in out
    assert "s1 -> s2" in out and "copy" in out and "300/1200" in out and "0x400000-0x7fffff" in out
    assert "s2 -> s3" in out and "failed" in out and "disk full" in out
    res = run("status", "--json")
    assert res.exit_code == 0, res.output
    svc = [s for s in json.loads(res.stdout)["services"] if s["name"] == "kv"][0]
    assert svc["ranges"] == 2 and svc["endpoints"] == ["s1", "s2"]  # the old fields stay
    assert svc["range_map"][0] == {"lo": 0, "hi": 0x7FFFFF, "owner": "s1", "mirrors": [], "helpers": [],
                                   "helpers_held": False, "state": "active",
                                   "epoch": svc["range_map"][0]["epoch"], "keys": 4242, "req_s": 123.25}
    assert svc["range_map"][1]["keys"] is None and svc["range_map"][1]["req_s"] is None
    ops = {o["source"]: o for o in svc["ops"]}
    assert ops["s1"]["phase"] == "copy" and ops["s1"]["done"] == 300 and ops["s1"]["total"] == 1200
    assert ops["s2"]["error"] == "peer refused BEGIN: disk full"


def test_a_malformed_load_report_does_not_break_status(run, reported):
    reported.put(schema.load_key("kv", "s2"), '{"at": 1, "ranges": [["x"]]}')
    res = run("ranges", "kv")
    assert res.exit_code == 0 and "4242" in res.output
    reported.put(schema.load_key("kv", "s2"), "not json")
    res = run("status")
    assert res.exit_code == 0 and "kv: ranges" in res.output and "4242" in res.output


def test_follow_says_why_the_wait_pauses_above_its_progress(capsys):
    from vfab.cli.cmd_state import Follow

    f = Follow("split kv", tty=False)
    f.notice("the record of a.1 vanished: waiting for a to write it again")
    assert capsys.readouterr().err == "split kv: the record of a.1 vanished: waiting for a to write it again\n"
