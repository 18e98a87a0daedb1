"""services/elastic-kvs/standard.py: the paper's select()-loop, file-per-key KVS baseline, on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from vfab.services.elastic_kvs import proto, standard
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.testbed.procs import wait_for


@contextlib.contextmanager
def running(datadir):
    srv = standard.StandardServer(str(datadir))
    stop = threading.Event()
    thread = threading.Thread(target=srv.serve_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        stop.set()
        thread.join(5)
        srv.close()
    assert not thread.is_alive(), "serve_forever did not return after stop was set"


@pytest.fixture
def server(tmp_path):
    with running(tmp_path / "data") as srv:
        yield srv


@pytest.fixture
def client(server):
    c = standard.StandardClient("127.0.0.1", server.port)
    yield c
    c.close()


class Raw:
    """A hand-driven connection: send any bytes, read reply frames (parsed here, not by standard.py)."""

    def __init__(self, server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> proto.Reply | None:
        """The next reply; None if the server closed the connection."""
        while len(self.buf) < 4 or len(self.buf) < struct.unpack_from("!I", self.buf)[0]:
            data = self.sock.recv(65536)
            if not data:
                assert self.buf == b"", f"connection closed mid-reply after {len(self.buf)} B"
                return None
            self.buf += data
        (length,) = struct.unpack_from("!I", self.buf)
        payload, self.buf = self.buf[4:length], self.buf[length:]
        return proto.parse_reply(payload)

    def close(self) -> None:
        self.sock.close()


def req_frame(op: int, reqid: int, key: bytes, value: bytes = b"", client: int = 42) -> bytes:
    payload = proto.REQ.pack(op, 0, len(key), client, reqid, 0, 0) + key + value
    return struct.pack("!I", 4 + len(payload)) + payload


def test_round_trip(client):
    assert client.get(b"alpha") is None
    assert client.put(b"alpha", b"one") == 0
    assert client.get(b"alpha") == b"one"
    assert client.put(b"beta", b"") == 0
    assert client.get(b"beta") == b""
    assert client.delete(b"alpha") is True
    assert client.get(b"alpha") is None
    assert client.delete(b"alpha") is False
    assert client.get(b"beta") == b""


def test_overwrite_leaves_one_file(server, client):
    client.put(b"k", b"first value")
    client.put(b"k", b"2nd")
    assert client.get(b"k") == b"2nd"
    assert sorted(os.listdir(server.datadir)) == [b"k".hex()]  # no temp file left behind
    with open(os.path.join(server.datadir, b"k".hex()), "rb") as f:
        assert f.read() == b"2nd"


def test_durable_and_survives_restart(tmp_path):
    data = tmp_path / "data"
    long_key = bytes(range(128))  # hex would be 256 chars: hashed name
    value = bytes(range(256)) * 5  # 1280 B, the limit
    with running(data) as srv:
        c = standard.StandardClient("127.0.0.1", srv.port)
        c.put(b"\x00key\xff", b"persist me")
        c.put(long_key, value)
        # the file is there with the bytes as soon as put returned (fsynced before the ack)
        assert (data / b"\x00key\xff".hex()).read_bytes() == b"persist me"
        name = standard.key_filename(long_key)
        assert name.startswith("h") and len(name) == 65
        assert (data / name).read_bytes() == value
        c.close()
    with running(data) as srv:
        c = standard.StandardClient("127.0.0.1", srv.port)
        assert c.get(b"\x00key\xff") == b"persist me"
        assert c.get(long_key) == value
        assert c.delete(b"\x00key\xff") is True
        c.close()
    assert not (data / b"\x00key\xff".hex()).exists()


def test_put_and_delete_fsync_before_the_ack(server, client, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    client.put(b"d", b"v")  # returns only after the server replied
    assert synced == [os.path.join(server.datadir, standard.TMP_NAME), server.datadir]
    synced.clear()
    assert client.delete(b"d") is True
    assert synced == [server.datadir]


def test_key_filename():
    assert standard.key_filename(b"\x01\xab") == "01ab"
    assert standard.key_filename(b"x" * 127) == "78" * 127  # 254 chars: still plain hex
    assert standard.key_filename(b"x" * 128) != standard.key_filename(b"x" * 127 + b"y")


def test_client_side_limits(server, client):
    with pytest.raises(KvsError, match=r"1\.\.128"):
        client.put(b"", b"v")
    with pytest.raises(KvsError, match=r"1\.\.128"):
        client.get(b"k" * 129)
    with pytest.raises(KvsError, match="1280"):
        client.put(b"k", b"v" * 1281)
    with pytest.raises(KvsError, match="bytes"):
        client.get("text")
    assert server.counters["requests"] == 0  # nothing went on the wire
    assert client.put(b"k", b"v" * 1280) == 0  # and the client still works


def test_load_many_clients(server):
    keys = [os.urandom(16) for _ in range(256)]
    res = standard.load("127.0.0.1", server.port, clients=8, duration=1.0, keys=keys, value=b"v" * 64)
    assert res["errors"] == 0
    assert res["ops"] > 0
    assert res["req_per_s"] == pytest.approx(res["ops"] / res["elapsed_s"])
    assert 0.9 <= res["elapsed_s"] <= 1.0
    assert 0 < res["lat_ms"]["median"] <= res["lat_ms"]["p99"]
    by_op = res["lat_ms_by_op"]
    assert set(by_op) == {"PUT", "GET", "DEL"} and sum(v["n"] for v in by_op.values()) == res["ops"]
    assert all(0 < v["median"] <= v["p99"] for v in by_op.values())
    assert 0 < res["not_found"] < res["ops"]
    assert server.counters["connections"] == 8
    assert server.counters["requests"] >= res["ops"]
    assert server.counters["bad_requests"] == 0
    assert 0 < len(os.listdir(server.datadir)) <= 256


def test_load_get_only_mix(server, client):
    client.put(b"only", b"x")
    res = standard.load("127.0.0.1", server.port, 2, 0.3, [b"only"], b"", mix=(0, 1, 0))
    assert res["ops"] > 0 and res["errors"] == 0 and res["not_found"] == 0
    assert list(res["lat_ms_by_op"]) == ["GET"] and res["lat_ms_by_op"]["GET"]["n"] == res["ops"]
    assert client.get(b"only") == b"x"


def test_malformed_frames_get_bad_request(server, client):
    s = Raw(server)
    garbage = b"\xff" * 40
    s.send(struct.pack("!I", 4 + len(garbage)) + garbage)
    rep = s.reply()
    assert rep.status is Status.BAD_REQUEST and "unknown op 255" in rep.message
    s.send(req_frame(9, 7, b"k"))
    rep = s.reply()
    assert (rep.status, rep.reqid) == (Status.BAD_REQUEST, 7) and "unknown op 9" in rep.message
    s.send(struct.pack("!I", 6) + b"ab")
    rep = s.reply()
    assert rep.status is Status.BAD_REQUEST and "truncated" in rep.message
    s.send(req_frame(Op.GET, 8, b"k", b"extra"))
    rep = s.reply()
    assert (rep.status, rep.reqid) == (Status.BAD_REQUEST, 8) and "carries no value" in rep.message
    s.send(req_frame(Op.PUT, 9, b"k", b"v" * 1281))  # value over the limit, frame still in bounds
    rep = s.reply()
    assert (rep.status, rep.reqid) == (Status.BAD_REQUEST, 9) and "limit is 1280 B" in rep.message
    s.send(req_frame(Op.PUT, 10, b"k" * 128, b"v" * 1281))  # frame 1 B over MAX_FRAME
    rep = s.reply()
    assert rep.status is Status.BAD_REQUEST and f"frames are 4..{standard.MAX_FRAME} B" in rep.message
    assert s.reply() is None  # the server closed that connection
    s.close()
    s = Raw(server)
    s.send(struct.pack("!I", 0xFFFFFFFF) + b"whatever")
    rep = s.reply()
    assert rep.status is Status.BAD_REQUEST and str(standard.MAX_FRAME) in rep.message
    assert s.reply() is None
    s.close()
    assert server.counters["bad_requests"] == 7
    assert client.put(b"k", b"fine") == 0 and client.get(b"k") == b"fine"


def test_same_connection_keeps_going_after_bad_request(server):
    s = Raw(server)
    s.send(req_frame(0, 1, b"k") + req_frame(Op.PUT, 2, b"k", b"v") + req_frame(Op.GET, 3, b"k"))
    replies = [s.reply() for _ in range(3)]
    assert [(r.status, r.reqid) for r in replies] == [(Status.BAD_REQUEST, 1), (Status.OK, 2), (Status.OK, 3)]
    assert replies[2].body == b"v"
    s.close()


def test_pipelined_and_split_requests(server):
    s = Raw(server)
    s.send(req_frame(Op.PUT, 1, b"p", b"pipelined") + req_frame(Op.GET, 2, b"p"))
    third = req_frame(Op.DEL, 3, b"p")
    for i in range(len(third)):  # one byte per segment
        s.send(third[i:i + 1])
        time.sleep(0.002)
    replies = [s.reply() for _ in range(3)]
    assert [(r.status, r.reqid, r.body) for r in replies] == [
        (Status.OK, 1, b""), (Status.OK, 2, b"pipelined"), (Status.OK, 3, b"")]
    s.close()


def test_vanishing_clients_do_not_disturb_others(server, client):
    client.put(b"k", b"before")
    stalled = Raw(server)
    stalled.send(req_frame(Op.PUT, 1, b"k", b"never finished")[:20])  # half a frame, then silence
    assert client.get(b"k") == b"before"  # served while another request hangs half-sent
    gone = Raw(server)
    gone.send(req_frame(Op.PUT, 1, b"k", b"never finished")[:25])
    gone.close()
    reset = Raw(server)
    reset.send(req_frame(Op.GET, 1, b"k")[:10])
    reset.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()  # RST
    assert client.put(b"k", b"after") == 0
    assert client.get(b"k") == b"after"
    stalled.close()
    wait_for(lambda: server.counters["open"] == 1, 2, "only our client left open", interval=0.01)
    assert server.counters["bad_requests"] == 0
    assert client.get(b"k") == b"after"


def fake_server(reply_with):
    """A one-connection TCP server answering every request frame with reply_with(reqid) (None: stay silent)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            while True:
                head = conn.recv(4)
                if len(head) < 4:
                    return
                body = b""
                while len(body) < struct.unpack("!I", head)[0] - 4:
                    body += conn.recv(65536)
                out = reply_with(proto.REQ.unpack_from(body)[4])
                if out is not None:
                    conn.sendall(standard.frame(out))

    threading.Thread(target=serve, daemon=True).start()
    return lsock


def test_client_raises_server_message_and_timeout():
    lsock = fake_server(lambda reqid: proto.error_reply(reqid, Status.BAD_REQUEST, "limit is 7 apples"))
    c = standard.StandardClient("127.0.0.1", lsock.getsockname()[1])
    with pytest.raises(KvsError, match="BAD_REQUEST: limit is 7 apples"):
        c.get(b"k")
    c.close()
    lsock.close()
    lsock = fake_server(lambda reqid: None)
    c = standard.StandardClient("127.0.0.1", lsock.getsockname()[1], timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(KvsError, match="no reply .* within 0.2 s"):
        c.put(b"k", b"v")
    assert 0.15 < time.monotonic() - t0 < 1.0
    c.close()
    lsock.close()


def test_client_skips_stale_reply(server):
    c = standard.StandardClient("127.0.0.1", server.port)
    c._rx += standard.frame(proto.Reply(Status.OK, 0xDEAD, 0, b"stale").serialize())  # as if a late reply
    c.put(b"s", b"fresh")
    assert c.get(b"s") == b"fresh"
    c.close()


def test_connect_refused_is_kvs_error():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(KvsError, match="cannot connect"):
        standard.StandardClient("127.0.0.1", port)


def test_standard_server_command(tmp_path):
    code = ("import argparse, logging, sys; from vfab.services.elastic_kvs import standard; "
            "logging.basicConfig(level=logging.INFO); p = argparse.ArgumentParser(); standard.add_arguments(p); "
            "sys.exit(standard.run(p.parse_args()))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--dir", str(tmp_path / "d")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "ready" and int(line[1]) > 0, line
        c = standard.StandardClient("127.0.0.1", int(line[1]))
        c.put(b"cli", b"ok")
        assert c.get(b"cli") == b"ok"
        c.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "vfab.kvs.standard" in err and "'requests': 2" in err
    assert (tmp_path / "d" / b"cli".hex()).read_bytes() == b"ok"
