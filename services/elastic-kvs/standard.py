"""The paper's "standard KVS" baseline: one file per key, one select() loop, TCP.

It is what elastic-KVS is measured against (virtual-servers paper, §VI, Fig. 13):
a persistent file-backed store whose server is a single thread running
``select()`` over the listening socket and every client socket, doing file I/O
with POSIX ``open``/``read``/``write`` (``os.open``/``os.read``/``os.write``).

Wire format: length-prefixed frames over TCP; the payloads are exactly those of
``proto`` (same ops, client id, request id, key, value, status)::

    request frame                              reply frame
    +----------------------------------+       +----------------------------------+
    | length (4 B, big-endian)         |       | length (4 B, big-endian)         |
    +----------------------------------+       +----------------------------------+
    | proto.Request payload            |       | proto.Reply payload              |
    |  op | flags | key length         |       |  status | flags | reserved       |
    |  client id (8 B)                 |       |  request id (8 B, echoed)        |
    |  request id (8 B)                |       |  version (8 B, always 0 here)    |
    |  key ... value (PUT only)        |       |  value (GET) or error message    |
    +----------------------------------+       +----------------------------------+

``length`` counts the whole frame, itself included (4 + payload), and is at most
``MAX_FRAME`` = 4 + REQ_LEN + MAX_KEY + MAX_VALUE.  Requests may be pipelined;
replies come back in request order.  A payload ``proto.parse_request`` rejects
gets a BAD_REQUEST reply (request id echoed when the header is there, else 0)
and the connection goes on; a length prefix < 4 or > MAX_FRAME gets a
BAD_REQUEST reply and the connection is closed (the stream cannot be resynced).

Storage: key K lives in ``DIR/<hex of K>``; hex of keys over 127 B would exceed
255 chars (NAME_MAX), so those live in ``DIR/h<BLAKE2b-256 hex of K>`` (65
chars; 'h' is not a hex digit, so the two name spaces never meet).  PUT writes
``DIR/.put.tmp`` (one name is enough: one thread), fsyncs it, renames it over
the key's file and fsyncs the directory, all before the reply: an acknowledged
PUT survives a crash, as in elastic-KVS.  DEL unlinks (missing: NOT_FOUND) and
fsyncs the directory.  Files carry no versions: replies say version 0.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import random
import select
import selectors
import signal
import socket
import struct
import threading
import time

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.vid.netns import netns as in_netns

log = logging.getLogger("vfab.kvs.standard")

LEN = struct.Struct("!I")
MAX_FRAME = LEN.size + proto.REQ_LEN + proto.MAX_KEY + proto.MAX_VALUE
MAX_REPLY = LEN.size + proto.REP_LEN + proto.MAX_VALUE
MAX_CONNS = 1000  # select() watches fds < FD_SETSIZE (1024): refuse connections beyond this
TX_LIMIT = 1 << 20  # stop reading a client that pipelines without reading its replies
TMP_NAME = ".put.tmp"
POLL_S = 0.05  # how often serve_forever looks at its stop event


def key_filename(key: bytes) -> str:
    """The file name of a key: its hex, or 'h' + BLAKE2b-256 hex when the hex would exceed 255 chars."""
    name = key.hex()
    return name if len(name) <= 255 else "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def frame(payload: bytes) -> bytes:
    return LEN.pack(LEN.size + len(payload)) + payload


class _Conn:
    __slots__ = ("sock", "rx", "tx", "closing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.rx, self.tx, self.closing = sock, bytearray(), bytearray(), False


class StandardServer:
    """Single-threaded select() server over one data directory (one file per key)."""

    def __init__(self, datadir: str, host: str = "127.0.0.1", port: int = 0, *, netns: str | None = None) -> None:
        self.datadir = os.path.abspath(datadir)
        os.makedirs(self.datadir, exist_ok=True)
        self._dirfd = os.open(self.datadir, os.O_RDONLY | os.O_DIRECTORY)
        with in_netns(netns):  # a socket keeps the namespace it was created in
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            os.close(self._dirfd)
            raise KvsError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port") from None
        sock.setblocking(False)
        self._lsock: socket.socket | None = sock
        self.port: int = sock.getsockname()[1]
        self._conns: dict[socket.socket, _Conn] = {}
        self.counters = dict.fromkeys(("requests", "bad_requests", "connections", "open", "refused", "io_errors"), 0)

    def serve_forever(self, stop: threading.Event) -> None:
        lsock = self._lsock
        while not stop.is_set() and lsock is not None:
            rlist = [lsock] + [c.sock for c in self._conns.values() if not c.closing and len(c.tx) < TX_LIMIT]
            wlist = [c.sock for c in self._conns.values() if c.tx]
            readable, writable, _ = select.select(rlist, wlist, [], POLL_S)
            for s in writable:
                if s in self._conns:
                    self._flush(self._conns[s])
            for s in readable:
                if s is lsock:
                    self._accept(lsock)
                elif s in self._conns:
                    self._read(self._conns[s])

    def _accept(self, lsock: socket.socket) -> None:
        for _ in range(64):
            try:
                sock, _addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave it in the backlog, serve the others
                return log.warning("accept failed: %s", exc)
            if len(self._conns) >= MAX_CONNS:
                self.counters["refused"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[sock] = _Conn(sock)
            self.counters["connections"] += 1
            self.counters["open"] += 1

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self.counters["open"] -= 1
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # peer closed or reset (possibly mid-frame): forget it, nobody else notices
            return self._drop(conn)
        conn.rx += data
        buf, pos = conn.rx, 0
        while len(buf) - pos >= LEN.size:
            (length,) = LEN.unpack_from(buf, pos)
            if not LEN.size <= length <= MAX_FRAME:
                self.counters["requests"] += 1
                self.counters["bad_requests"] += 1
                msg = f"frame length {length} is out of bounds: frames are {LEN.size}..{MAX_FRAME} B; closing"
                conn.tx += frame(proto.error_reply(0, Status.BAD_REQUEST, msg))
                conn.closing = True
                pos = len(buf)
                break
            if len(buf) - pos < length:
                break
            conn.tx += frame(self.handle(bytes(buf[pos + LEN.size:pos + length])))
            pos += length
        del buf[:pos]
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.tx:
            try:
                n = conn.sock.send(conn.tx)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._drop(conn)
            del conn.tx[:n]
        if conn.closing:
            self._drop(conn)

    def handle(self, payload: bytes) -> bytes:
        """Apply one request payload; returns the reply payload."""
        self.counters["requests"] += 1
        try:
            req = proto.parse_request(payload)
        except KvsError as exc:
            self.counters["bad_requests"] += 1
            reqid = proto.REQ.unpack_from(payload)[4] if len(payload) >= proto.REQ_LEN else 0
            return proto.error_reply(reqid, Status.BAD_REQUEST, str(exc))
        try:
            status, body = self._apply(req)
        except OSError as exc:
            self.counters["io_errors"] += 1
            log.warning("%s of key %r failed: %s", req.op.name, req.key, exc)
            return proto.error_reply(req.reqid, Status.UNAVAILABLE,
                                     f"storage error in {self.datadir}: {exc.strerror or exc}; retry later")
        return proto.Reply(status, req.reqid, 0, body).serialize()

    def _apply(self, req: proto.Request) -> tuple[Status, bytes]:
        name, dirfd = key_filename(req.key), self._dirfd
        if req.op is Op.GET:
            try:
                fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
            except FileNotFoundError:
                return Status.NOT_FOUND, b""
            try:
                data = b""
                while len(data) <= proto.MAX_VALUE and (chunk := os.read(fd, proto.MAX_VALUE + 1 - len(data))):
                    data += chunk
            finally:
                os.close(fd)
            if len(data) > proto.MAX_VALUE:
                raise OSError(f"file {name} holds over {proto.MAX_VALUE} B (not written by this server)")
            return Status.OK, data
        if req.op is Op.PUT:
            fd = os.open(TMP_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dirfd)
            try:
                view = memoryview(req.value)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(TMP_NAME, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            os.fsync(dirfd)
            return Status.OK, b""
        try:
            os.unlink(name, dir_fd=dirfd)
        except FileNotFoundError:
            return Status.NOT_FOUND, b""
        os.fsync(dirfd)
        return Status.OK, b""

    def close(self) -> None:
        """Close every socket and the data directory; call after serve_forever returned. Idempotent."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
            os.close(self._dirfd)


def _pop_reply(buf: bytearray) -> proto.Reply | None:
    """Take one complete reply frame off ``buf``; None if it is not all there yet."""
    if len(buf) < LEN.size:
        return None
    (length,) = LEN.unpack_from(buf)
    if not LEN.size + proto.REP_LEN <= length <= MAX_REPLY:
        raise KvsError(f"reply frame of {length} B is out of bounds ({LEN.size + proto.REP_LEN}..{MAX_REPLY} B): "
                       "is the peer a standard KVS server?")
    if len(buf) < length:
        return None
    payload = bytes(buf[LEN.size:length])
    del buf[:length]
    return proto.parse_reply(payload)


class StandardClient:
    """Blocking client: one TCP connection, one request at a time."""

    def __init__(self, host: str, port: int, timeout: float = 1.0) -> None:
        self.addr, self.timeout = f"{host}:{port}", timeout
        self.client_id = random.SystemRandom().getrandbits(64)
        self._reqid, self._rx = 0, bytearray()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise KvsError(f"cannot connect to the standard KVS at {self.addr}: {exc.strerror or exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get(self, key: bytes) -> bytes | None:
        rep = self._call(Op.GET, key)
        return rep.body if rep.status is Status.OK else None

    def put(self, key: bytes, value: bytes) -> int:
        return self._call(Op.PUT, key, value).version

    def delete(self, key: bytes) -> bool:
        return self._call(Op.DEL, key).status is Status.OK

    def close(self) -> None:
        self._sock.close()

    def _call(self, op: Op, key: bytes, value: bytes = b"") -> proto.Reply:
        self._reqid += 1
        payload = proto.Request(op, self.client_id, self._reqid, key, value).serialize()  # checks the limits
        deadline = time.monotonic() + self.timeout
        try:
            self._sock.settimeout(self.timeout)
            self._sock.sendall(frame(payload))
            while True:
                while (rep := _pop_reply(self._rx)) is None:
                    self._sock.settimeout(max(deadline - time.monotonic(), 1e-6))
                    data = self._sock.recv(65536)
                    if not data:
                        raise KvsError(f"the standard KVS at {self.addr} closed the connection")
                    self._rx += data
                if rep.reqid == self._reqid or (rep.reqid == 0 and rep.status is Status.BAD_REQUEST):
                    break  # else: the late reply to a request that timed out before; skip it
        except TimeoutError:
            raise KvsError(f"no reply from the standard KVS at {self.addr} within {self.timeout} s: "
                           "is the server up? raise the timeout if it is loaded") from None
        except OSError as exc:
            raise KvsError(f"connection to the standard KVS at {self.addr} failed: {exc.strerror or exc}") from None
        if rep.status in (Status.OK, Status.NOT_FOUND):
            return rep
        raise KvsError(f"standard KVS at {self.addr} answered {rep.status.name}: {rep.message}")


def _percentile(sorted_ms: list[float], q: float) -> float | None:
    return sorted_ms[max(0, math.ceil(q * len(sorted_ms)) - 1)] if sorted_ms else None


def load(host: str, port: int, clients: int, duration: float, keys: list[bytes], value: bytes,
         mix: tuple[float, float, float] = (1, 1, 1), seed: int = 0) -> dict:
    """Closed-loop load: ``clients`` connections in this process, each with one request in flight.

    Each request is put/get/delete (weights ``mix``) of a key drawn uniformly from ``keys``,
    pregenerated in memory as in the paper.  NOT_FOUND counts as success; any other status,
    a wrong request id or a broken connection counts as an error and ends that client.
    ``lat_ms`` holds the median and p99 of the requests' latencies (None when none completed), ``lat_ms_by_op``
    the same per operation type, with its count.
    """
    if clients < 1 or duration <= 0 or not keys:
        raise KvsError(f"load needs clients >= 1 (got {clients}), duration > 0 (got {duration}) and some keys")
    keys, value, rng = [proto.check_key(k) for k in keys], proto.check_value(value), random.Random(seed)
    head = struct.Struct("!I" + proto.REQ.format.lstrip("!"))
    plan = []  # (frame length, op, key length, key + value) of each pregenerated request
    for op in rng.choices((Op.PUT, Op.GET, Op.DEL), weights=mix, k=4096):
        key = rng.choice(keys)
        body = key + value if op is Op.PUT else key
        plan.append((head.size + len(body), int(op), len(key), body))
    sel, lat, stats = selectors.DefaultSelector(), [], {"ops": 0, "errors": 0, "not_found": 0}
    by_op: dict[str, list[float]] = {}
    for _ in range(clients):
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
        except OSError as exc:
            sel.close()
            raise KvsError(f"load: cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # state of one logical client: [client id, request id, plan position, send time, rx buffer, op in flight]
        sel.register(sock, selectors.EVENT_READ,
                     [rng.getrandbits(64), 0, rng.randrange(len(plan)), 0.0, bytearray(), 0])

    def send_next(sock: socket.socket, st: list) -> None:
        length, op, klen, body = plan[st[2]]
        st[1], st[2], st[3], st[5] = st[1] + 1, (st[2] + 1) % len(plan), time.perf_counter(), op
        try:  # one frame < 1.5 KB in flight: an empty send buffer always takes it whole
            sock.sendall(head.pack(length, op, 0, klen, st[0], st[1], 0, 0) + body)  # no session fields: TCP, no retries
        except OSError:
            fail(sock)

    def fail(sock: socket.socket) -> None:
        stats["errors"] += 1
        sel.unregister(sock)
        sock.close()

    t0 = time.perf_counter()
    end = t0 + duration
    for skey in list(sel.get_map().values()):
        send_next(skey.fileobj, skey.data)
    while (now := time.perf_counter()) < end and sel.get_map():
        for skey, _mask in sel.select(timeout=end - now):
            sock, st = skey.fileobj, skey.data
            try:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("the server closed the connection")
                st[4] += data
                if (rep := _pop_reply(st[4])) is None:
                    continue
                if rep.reqid != st[1] or rep.status not in (Status.OK, Status.NOT_FOUND):
                    raise KvsError(f"reply {rep.status.name} to request {rep.reqid}, expected {st[1]}")
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, KvsError):
                fail(sock)
                continue
            if (done := time.perf_counter()) <= end:
                stats["ops"] += 1
                stats["not_found"] += rep.status is Status.NOT_FOUND
                lat.append((done - st[3]) * 1000.0)
                by_op.setdefault(Op(st[5]).name, []).append(lat[-1])
                send_next(sock, st)
    elapsed = min(time.perf_counter(), end) - t0
    for skey in list(sel.get_map().values()):
        skey.fileobj.close()
    sel.close()
    lat.sort()
    return {**stats, "clients": clients, "elapsed_s": elapsed, "req_per_s": stats["ops"] / elapsed,
            "lat_ms": {"median": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99)},
            "lat_ms_by_op": latency_by_op(by_op)}


def latency_by_op(by_op: dict[str, list[float]]) -> dict[str, dict]:
    """op name -> {"n", "median", "p99"} (ms) of the latencies recorded per operation type."""
    out = {}
    for op, ms in sorted(by_op.items()):
        ms = sorted(ms)
        out[op] = {"n": len(ms), "median": _percentile(ms, 0.5), "p99": _percentile(ms, 0.99)}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="data directory, one file per key (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port (default 0: a free one, printed as 'ready PORT')")
    p.add_argument("--netns", default=None, metavar="PATH",
                   help="open the listening socket in this network namespace (e.g. /proc/PID/ns/net); "
                        "the data directory stays in ours")


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = StandardServer(args.dir, args.host, args.port, netns=args.netns)
    try:
        print(f"ready {server.port}", flush=True)
        log.info("standard KVS on %s:%d%s, data in %s: ready", args.host, server.port,
                 f" (netns {args.netns})" if args.netns else "", server.datadir)
        server.serve_forever(stop)
    finally:
        log.info("standard KVS on port %d: exiting; counters %s", server.port, server.counters)
        server.close()
    return 0

