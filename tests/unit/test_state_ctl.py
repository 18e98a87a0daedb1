"""statectl.wait on a real etcd when the op record vanishes under it (the source's lease expired).

The source's control socket is a real ZeroMQ ROUTER answering PING the way an endpoint's loop does (with
the ops whose record is still its to write); the record is written, deleted and written again in etcd.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from vfab.vid.envelope import decode
from vfab.vid.errors import NotFound
from vfab.vid.registry import Registry, schema
from vfab.vid.state import ctl
from vfab.testbed.procs import wait_for

SVC, OP = "kvs-ctl", "a.0badcafe"


class FakeSource:
    """Answers PING with ``ops`` (settable) on a real ROUTER socket."""

    def __init__(self) -> None:
        self.ops: list[str] = [OP]
        self.pings = 0
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            env = decode(frames)
            if env.type == "PING":
                self.pings += 1
                self.sock.send_multipart([ident, *env.reply("OK", "a", ops=list(self.ops)).frames()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)


@pytest.fixture
def etcd_reg(tmp_path):
    from vfab.testbed.etcd import LocalEtcd, free_port

    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port())
    etcd.start(timeout=20)
    reg = Registry(etcd.endpoint)
    reg.create_service(SVC)
    try:
        yield reg
    finally:
        reg.close()
        etcd.stop()


def record(phase: str = "copy", done: int = 10) -> str:
    return schema.OpRec(op="split", source="a", peer="b", ranges=[[0, 9]], phase=phase, done=done,
                        id=OP).to_json()


def start_wait(reg: Registry) -> tuple[threading.Thread, dict]:
    """ctl.wait on its own thread; returns once it has seen the record (so a deletion is one it follows).
    ``out``: "rec" or "exc" when it ended, "notices" what it told meanwhile."""
    out: dict = {"notices": []}
    seen = threading.Event()

    def run() -> None:
        try:
            out["rec"] = ctl.wait(Registry(reg.endpoint), SVC, OP, timeout=30, progress=lambda rec: seen.set(),
                                  notice=out["notices"].append)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert seen.wait(10), "wait never saw the record"
    return t, out


def vanish(reg: Registry, join: float) -> tuple[dict, float]:
    """The op record under a lease of its own, a waiter following it, the lease revoked (what etcd does when
    the source's lease expires): how the waiter ended (``start_wait``'s out), and how long after the revoke."""
    lease = reg.lease(3)
    reg.put(schema.op_key(SVC, OP), record(), lease=lease)
    t, out = start_wait(reg)
    t0 = time.monotonic()
    reg.revoke(lease)
    t.join(join)
    assert not t.is_alive()
    return out, time.monotonic() - t0


def announce(reg: Registry, src: FakeSource) -> int:
    return reg.announce(schema.Endpoint(service=SVC, name="a", mac="02:00:00:00:00:0a", ctl=src.addr), ttl=3)


def test_a_record_taken_by_an_expired_lease_is_waited_for_while_its_source_still_runs_the_op(etcd_reg):
    reg, src = etcd_reg, FakeSource()
    try:
        announce(reg, src)
        key = schema.op_key(SVC, OP)
        lease = reg.lease(3)
        reg.put(key, record(), lease=lease)
        t, out = start_wait(reg)
        reg.revoke(lease)                   # what etcd does when the source's lease expires
        wait_for(lambda: src.pings, 10, "the wait to ask the source")
        assert t.is_alive(), out   # asked the source, which still runs it: still waiting
        reg.put(key, record("done", 20))    # the source's final record (under no lease)
        t.join(10)
        assert not t.is_alive() and "exc" not in out, out
        assert out["rec"].phase == "done" and out["rec"].done == 20
        told = out["notices"]                   # said once that it waits, once that the record is back
        assert len(told) == 2 and "vanished: a's etcd lease expired" in told[0] and "waiting for a" in told[0] \
            and told[1].startswith(f"a wrote the record of {OP} again after"), told
    finally:
        src.close()


def test_a_vanished_record_whose_source_no_longer_runs_the_op_is_reported_at_once(etcd_reg):
    reg, src = etcd_reg, FakeSource()
    try:
        announce(reg, src)
        src.ops = []                        # restarted: the op is unknown to it
        out, took = vanish(reg, 10)
        assert isinstance(out.get("exc"), NotFound) and "no longer runs it" in str(out["exc"]), out
        assert took < 5
    finally:
        src.close()


def test_a_vanished_record_whose_source_is_unreachable_is_reported_after_the_grace(etcd_reg, monkeypatch):
    monkeypatch.setattr(ctl, "VANISHED_GRACE", 2.0)
    out, took = vanish(etcd_reg, 15)                         # no endpoint "a" registered at all
    assert isinstance(out.get("exc"), NotFound) and "died or is stopped" in str(out["exc"]), out
    assert 2.0 <= took < 10
