"""The registry's own HTTP/1.1 client (``_Http``): the answers etcd's gateway gives (a real member) and the
framings and failures a member or a proxy in front of it could give (a scripted socket server)."""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry
from vfab.vid.registry.etcd import _Http


class Scripted:
    """A TCP server on loopback that answers each request on a connection with the next of ``answers``,
    sent in pieces of ``piece`` bytes (1: a byte per send), and closes after the last one."""

    def __init__(self, answers: list[bytes], piece: int = 1 << 16):
        self.answers, self.piece = answers, piece
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            for answer in self.answers:
                req = b""
                while b"\r\n\r\n" not in req:
                    got = conn.recv(4096)
                    if not got:
                        return
                    req += got
                head, _, body = req.partition(b"\r\n\r\n")
                length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
                while len(body) < length:
                    body += conn.recv(4096)
                self.requests.append(head + b"\r\n\r\n" + body)
                for i in range(0, len(answer), self.piece):
                    conn.sendall(answer[i:i + self.piece])

    def close(self) -> None:
        self.srv.close()
        self.thread.join(5)


def chunked(body: bytes, sizes: list[int], ext: bytes = b"", trailer: bytes = b"") -> bytes:
    out, at = b"", 0
    for n in sizes:
        out += b"%x%s\r\n%s\r\n" % (n, ext, body[at:at + n])
        at += n
    return out + b"0\r\n" + trailer + b"\r\n"


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("piece", [1, 7, 1 << 16])
def test_each_framing_in_any_pieces(piece):
    body = b'{"result":{"TTL":"1"}}'
    answers = [OK + b"Content-Length: %d\r\n\r\n" % len(body) + body,
               OK + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, [5, 0 + len(body) - 5]),
               OK + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, [len(body)], b";x=1", b"X-T: 1\r\n"),
               b"HTTP/1.1 204 No Content\r\n\r\n",
               b"HTTP/1.1 100 Continue\r\n\r\n" + OK + b"content-length: 2\r\n\r\n{}",
               OK + b"Connection: close\r\n\r\n" + body]
    srv = Scripted(answers, piece)
    h = _Http("127.0.0.1", srv.port, 5)
    try:
        assert h.post("/v3/a", b"{}") == (200, body, False)
        assert h.post("/v3/b", b"{}") == (200, body, False)
        assert h.post("/v3/c", b"{}") == (200, body, False)
        assert h.post("/v3/d", b"{}") == (204, b"", False)
        assert h.post("/v3/e", b"{}") == (200, b"{}", False)
        assert h.post("/v3/f", b'{"k":1}') == (200, body, True)   # no length: the body runs to the close
    finally:
        h.close()
        srv.close()
    first = srv.requests[0]
    assert first.startswith(b"POST /v3/a HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % srv.port)
    assert b"Content-Length: 2\r\n" in first and first.endswith(b"\r\n\r\n{}")
    assert srv.requests[-1].endswith(b'\r\n\r\n{"k":1}')


@pytest.mark.parametrize("answer, error", [
    (b"", http.client.RemoteDisconnected),                                        # closed before answering
    (b"SPDY/3 200 OK\r\n\r\n", http.client.BadStatusLine),
    (b"HTTP/1.1 2000 OK\r\n\r\n", http.client.BadStatusLine),
    (OK + b"no colon here\r\n\r\n", http.client.HTTPException),
    (OK + b"Content-Length: 10\r\n\r\n{}", http.client.RemoteDisconnected),     # cut short
    (OK + b"Content-Length: ten\r\n\r\n", http.client.HTTPException),
    (OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", http.client.HTTPException),
    (OK + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", http.client.HTTPException),
    (OK + b"X: " + b"a" * 70000 + b"\r\n\r\n", http.client.LineTooLong),
])
def test_a_broken_answer_raises_what_http_client_would(answer, error):
    srv = Scripted([answer])
    h = _Http("127.0.0.1", srv.port, 5)
    try:
        with pytest.raises(error):
            h.post("/v3/x", b"{}")
    finally:
        h.close()
        srv.close()


def test_bytes_past_the_answer_end_the_connection():
    """What a member sends beyond its answer must never be read as the next request's answer."""
    srv = Scripted([OK + b"Content-Length: 2\r\n\r\n{}" + OK + b"Content-Length: 2\r\n\r\n[]"])
    h = _Http("127.0.0.1", srv.port, 5)
    try:
        assert h.post("/v3/x", b"{}") == (200, b"{}", True)
    finally:
        h.close()
        srv.close()


def test_the_registry_says_etcd_is_unreachable_on_a_broken_answer_and_reconnects():
    srv = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{"])
    reg = Registry(f"127.0.0.1:{srv.port}", timeout=5)
    try:
        with pytest.raises(RegistryError, match="unreachable .RemoteDisconnected"):
            reg.get("/t/x")
        assert reg._gw._local.conn is None   # dropped: the next call connects anew
    finally:
        reg.close()
        srv.close()


def test_a_real_member_through_it(registry):
    """etcd's gateway answers keepalives chunked and everything else with a length: both read, and a
    lease etcd does not know reads as gone."""
    lease = registry.lease(5)
    assert registry.keepalive_once(lease) == 5
    registry.put("/t/http", "v" * 100_000, lease=lease)
    assert registry.get("/t/http")[0] == b"v" * 100_000
    registry.revoke(lease)
    assert registry.keepalive_once(lease) == 0
    assert registry.get("/t/http") is None
