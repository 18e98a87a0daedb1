"""The C protocol core against a real memcached 1.6 on loopback (started here, stopped by PID).

For every client request, the datagrams the splitter builds from memcached's TCP answer (to the coalesced
multi-get, or to the forwarded command) must equal, byte for byte and datagram for datagram, what memcached
itself sends that client over UDP.  The one thing memcached sends that the core does not: empty frames with
total = 0 (a miss followed by another key); they carry no bytes.  Writes go to two fresh instances in the
same order, one directly over UDP and one through the core over TCP, so their answers (cas values included)
and the state they leave can be compared too.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import time

import pytest

from tests.unit.test_mc_proto import McDriver, core_build, dg
from vfab.services.memcached_helper.mcudp import answer_complete
from vfab.testbed.procs import Supervisor, free_port, wait_for

HOST = "127.0.0.1"
RNG = random.Random(8)


class Memcached:
    """One memcached with TCP and UDP on loopback, tracked by the supervisor (stopped by PID)."""

    def __init__(self, sup: Supervisor, name: str):
        self.sup = sup
        self.tcp_port, self.udp_port = free_port(), free_port()
        cmd = ["memcached", "-l", HOST, "-p", str(self.tcp_port), "-U", str(self.udp_port), "-t", "1", "-m", "64"]
        if os.geteuid() == 0:
            cmd += ["-u", "root"]
        self.proc = sup.start(name, cmd)
        wait_for(self._up, 10, f"{name} listening on {HOST}:{self.tcp_port}")
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):  # root may exceed rmem_max: a 500 KB value is 360 datagrams
            self.udp.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        self.rid = 1000

    def _up(self) -> bool:
        assert self.proc.alive(), f"memcached exited:\n{self.proc.tail()}"
        with contextlib.suppress(OSError), socket.create_connection((HOST, self.tcp_port), timeout=0.5):
            return True
        return False

    def stop(self) -> None:
        self.udp.close()
        self.sup.stop(self.proc)

    def tcp_command(self, data: bytes, until: bytes = b"\r\n") -> bytes:
        with socket.create_connection((HOST, self.tcp_port), timeout=5) as s:
            s.sendall(data)
            buf = b""
            while not buf.endswith(until):
                got = s.recv(1 << 20)
                assert got, f"memcached closed the connection after {buf[-200:]!r}"
                buf += got
            return buf

    def udp_ask(self, payload: bytes, rid: int, shape: str) -> list[bytes]:
        """All datagrams memcached answers to one UDP request (shape: values, line, stats or none)."""
        self.udp.sendto(dg(payload, rid), (HOST, self.udp_port))
        got: list[bytes] = []
        deadline = time.monotonic() + (0.3 if shape == "none" else 5)
        while time.monotonic() < deadline:
            self.udp.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                d = self.udp.recv(65536)
            except TimeoutError:
                break
            if struct.unpack("!H", d[:2])[0] != rid:
                continue  # late datagram of an earlier request
            got.append(d)
            if reply_complete(b"".join(x[8:] for x in got), shape):
                deadline = min(deadline, time.monotonic() + 0.02)  # anything after the end would show
        assert shape == "none" or reply_complete(b"".join(x[8:] for x in got), shape), (payload[:60], got[:3])
        return got


def reply_complete(buf: bytes, shape: str) -> bool:
    """Whether ``buf`` holds memcached's whole answer of this shape (none: never; the rest as the helpers'
    UDP client reads it, mcudp.answer_complete)."""
    return shape != "none" and answer_complete(buf, shape)


def nonempty(dgrams: list[bytes]) -> list[bytes]:
    """memcached's datagrams minus its empty total=0 frames (the only thing the core does not send)."""
    for d in dgrams:
        if len(d) == 8:
            assert struct.unpack("!HHHH", d)[2] == 0, d
    return [d for d in dgrams if len(d) > 8]


@pytest.fixture
def sup(tmp_path):
    s = Supervisor(str(tmp_path / "logs"))
    yield s
    s.stop_all()


@pytest.fixture
def drv():
    d = McDriver(core_build() / "san" / "mc_test")
    yield d
    d.close()


def through_core(drv: McDriver, mc: Memcached, requests, max_keys=256, max_line=65536, chunk=0):
    """Coalesce/forward requests [(client, rid, payload)], send to mc over one TCP connection, split the answer."""
    drv.open(max_keys, max_line)
    wire, pushed = [], []
    for client, rid, payload in requests:
        res = drv.add(client, dg(payload, rid))
        if res == "FULL":
            bid, command = drv.close_batch()
            wire.append(command)
            pushed.append(bid)
            drv.open(max_keys, max_line)
            res = drv.add(client, dg(payload, rid))
        kind, *rest = res.split()
        assert kind in ("ADDED", "PASS"), (payload[:60], res)
        if kind == "PASS":
            wire.append(bytes.fromhex(rest[1]))
            pushed.append(int(rest[0]))
    closed = drv.close_batch()
    if closed:
        wire.append(closed[1])
        pushed.append(closed[0])
    out: dict[int, list[bytes]] = {}
    done: list[int] = []
    with socket.create_connection((HOST, mc.tcp_port), timeout=10) as s:
        s.sendall(b"".join(wire))
        while len(done) < len(pushed):
            data = s.recv(1 << 20)
            assert data, "memcached closed the TCP connection"
            got, d, status = drv.feed(data, chunk)
            assert status == "FED", status
            done += d
            for c, ds in got.items():
                out.setdefault(c, []).extend(ds)
    assert done == pushed
    return out, wire


def direct(mc: Memcached, requests, shapes=None):
    return {client: mc.udp_ask(payload, rid, (shapes or {}).get(client, "values"))
            for client, rid, payload in requests}


def assert_same(helper: dict, direct_: dict, requests):
    for client, _, payload in requests:
        want, got = nonempty(direct_[client]), helper.get(client, [])
        if got == want:
            continue
        i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        show = [x[i][:60] + b"..." + x[i][-20:] if i < len(x) else None for x in (got, want)]
        pytest.fail(f"client {client} {payload[:60]!r}: {len(got)} datagrams from the core, {len(want)} from "
                    f"memcached; first difference at datagram {i}: core {show[0]!r} memcached {show[1]!r}")


# ---------------------------------------------------------------- the data

BOUNDARY = [1366, 1367, 1368, 1369, 1370, 1371, 1372, 1373, 2759, 2760, 2761, 2764, 2765]  # see below


def dataset() -> list[tuple[bytes, int, bytes]]:
    """(key, flags, value).  "VALUE bNN 0 SSSS\\r\\n" is 18 bytes, so BOUNDARY sizes put the message
    (line + value + CRLF, + END when last) just below, at and just above 1392 and 2 x 1392 bytes."""
    items = [
        (b"k0", 0, b""),
        (b"k1", 1, b"x"),
        (b"bin", 4294967295, bytes(range(256)) * 4),
        (b"proto", 12345, b"\r\nEND\r\nVALUE k1 0 1\r\nx\r\nEND\r\n"),
        (b"big5k", 0, RNG.randbytes(5000)),
        (b"big100k", 7, RNG.randbytes(100_000)),
        (b"huge", 0, RNG.randbytes(500_000)),
        (b"L" * 250, 3, b"long key"),
        (b"\xc3\xa9t\xc3\xa9", 0, b"high bytes in the key"),
        (b"a:b/c?d=e&f", 9, b"punctuation"),
        (b"\x10" * 8 + b"IIFCbHy8yL", 0, b"memaslap's key shape: control bytes in the key"),
        (b"t\tab\x7f\x01", 0, b"tab, DEL and SOH in the key"),
        (b"n", 0, b"10"),
    ]
    items += [(b"b%02d" % i, 0, RNG.randbytes(size)) for i, size in enumerate(BOUNDARY)]
    return items


def store(mc: Memcached, items) -> None:
    for key, flags, value in items:
        cmd = b"set %s %d 0 %d\r\n%s\r\n" % (key, flags, len(value), value)
        assert mc.tcp_command(cmd) == b"STORED\r\n"


def read_requests(items) -> list[tuple[int, int, bytes]]:
    keys = [k for k, _, _ in items]
    bkeys = [k for k in keys if k.startswith(b"b") and k[1:].isdigit()]
    bodies = [b"get " + k + b"\r\n" for k in keys] + [b"gets " + k + b"\r\n" for k in keys[:4]] + [
        b"get nope\r\n", b"gets nope\r\n", b"get k1 nope\r\n", b"get nope k1\r\n", b"get nope1 nope2 nope3\r\n",
        b"get k1 k1\r\n", b"gets k1 bin\r\n", b"get bin k1\r\n", b"get k1 bin\r\n", b"get k0 big5k proto\r\n",
        b"get  k1   bin  \r\n", b"get huge k1\r\n", b"get k1 huge\r\n", b"gets big100k nope b00\r\n",
        b"get " + b" ".join(bkeys) + b"\r\n", b"get " + b" ".join(reversed(bkeys)) + b"\r\n",
        b"gets " + b" ".join(k for k in keys if k != b"huge") + b"\r\n",
        b"get " + b" ".join(b"m%02d" % i if i % 3 else keys[i % len(keys)] for i in range(100)) + b"\r\n",
    ]
    return [(i, 7000 + i, body) for i, body in enumerate(bodies)]


# ---------------------------------------------------------------- tests

def test_coalesced_gets_match_memcached_udp_replies(sup, drv):
    mc = Memcached(sup, "memcached-reads")
    items = dataset()
    store(mc, items)
    reqs = read_requests(items)
    want = direct(mc, reqs)
    got, wire = through_core(drv, mc, reqs, chunk=-4096)
    assert len(wire) == 1 and wire[0].startswith(b"gets ")  # one coalesced command for every client
    assert_same(got, want, reqs)
    c = drv.counters()
    assert c["b_refs"] > c["b_keys"] and c["w_done"] == len(reqs)  # keys asked by several clients went once
    n_empty = sum(len(d) == 8 for ds in want.values() for d in ds)
    print(f"{len(reqs)} requests, {sum(map(len, got.values()))} datagrams identical to memcached's; "
          f"{c['b_refs']} (request, key) pairs served by {c['b_keys']} keys in 1 command; "
          f"memcached also sent {n_empty} empty total=0 frames")


def test_many_small_batches_fed_byte_by_byte_match_too(sup, drv):
    mc = Memcached(sup, "memcached-bytes")
    items = [it for it in dataset() if len(it[2]) < 10_000]
    store(mc, items)
    reqs = [r for r in read_requests(items) if b"huge" not in r[2] and b"big100k" not in r[2]]
    want = direct(mc, reqs)
    got, wire = through_core(drv, mc, reqs, max_keys=3, max_line=64, chunk=1)
    assert len(wire) > 10  # the limits cut the stream into many commands on one connection
    assert_same(got, want, reqs)


def test_largest_coalesced_command_is_accepted_by_memcached(sup, drv):
    """256 keys of 250 bytes: the core's upper bound (64,261-byte line) is answered correctly."""
    mc = Memcached(sup, "memcached-maxline")
    keys = [(b"%03d" % i * 84)[:250] for i in range(256)]
    store(mc, [(k, i, b"v%d" % i) for i, k in enumerate(keys) if i % 3 == 0])
    reqs = [(i, i, b"get " + k + b"\r\n") for i, k in enumerate(keys)]
    reqs.append((256, 999, b"get " + b" ".join(keys[:20]) + b"\r\n"))
    want = direct(mc, reqs)
    got, wire = through_core(drv, mc, reqs)
    assert [len(w) for w in wire] == [3 + 256 * 251 + 2]
    assert_same(got, want, reqs)


WRITES = [
    (b"set w1 5 0 3\r\nabc\r\n", "line"),
    (b"set w2 0 0 1000\r\n" + b"z" * 1000 + b"\r\n", "line"),
    (b"add w1 0 0 1\r\nx\r\n", "line"),
    (b"replace nope 0 0 1\r\nx\r\n", "line"),
    (b"append w1 0 0 2\r\nde\r\n", "line"),
    (b"prepend w1 0 0 2\r\nzz\r\n", "line"),
    (b"cas w1 0 0 1 999999\r\nq\r\n", "line"),
    (b"set w3 0 0 2 noreply\r\nhi\r\n", "none"),
    (b"delete w2\r\n", "line"),
    (b"delete w2\r\n", "line"),
    (b"delete w3 noreply\r\n", "none"),
    (b"incr n 5\r\n", "line"),
    (b"decr n 100\r\n", "line"),
    (b"incr w1 1\r\n", "line"),
    (b"incr nope 1\r\n", "line"),
    (b"touch k1 100\r\n", "line"),
    (b"touch nope 1\r\n", "line"),
    (b"version\r\n", "line"),
    (b"verbosity 0\r\n", "line"),
    (b"gat 100 k1 nope w1\r\n", "values"),
    (b"gats 0 w1 bin\r\n", "values"),
    (b"set w4 0 0 4 noreply\r\n\r\n\r\n\r\n", "none"),
]


def test_forwarded_writes_match_memcached_udp_replies(sup, drv):
    """Same writes, same order: UDP to memcached A, through the core over TCP to memcached B."""
    a, b = Memcached(sup, "memcached-a"), Memcached(sup, "memcached-b")
    items = [it for it in dataset() if len(it[2]) < 10_000]
    store(a, items)
    store(b, items)
    shapes = {i: shape for i, (_, shape) in enumerate(WRITES)}
    reqs = [(i, 100 + i, body) for i, (body, _) in enumerate(WRITES)]
    want = direct(a, reqs, shapes)
    got, wire = through_core(drv, b, reqs, chunk=-64)
    assert len(wire) == len(WRITES) and b"noreply" not in b"".join(wire)
    assert_same(got, want, reqs)
    assert all(c not in got and want[c] == [] for c, shape in shapes.items() if shape == "none")
    # a cas with the right value: the same on A and B, which saw the same writes
    cas = [mc.tcp_command(b"gets w1\r\n", b"END\r\n").split()[4] for mc in (a, b)]
    assert cas[0] == cas[1]
    cas_req = [(50, 150, b"cas w1 0 0 1 " + cas[0] + b"\r\nq\r\n")]
    assert_same(through_core(drv, b, cas_req)[0], direct(a, cas_req, {50: "line"}), cas_req)
    # the state both leave behind is the same too
    reads = [(60, 160, b"gets w1 w2 w3 w4 n k1\r\n"), (61, 161, b"get nope w1 w4\r\n")]
    assert_same(through_core(drv, b, reads)[0], direct(a, reads), reads)


def test_stats_pass_through_is_framed_like_memcached(sup, drv):
    mc = Memcached(sup, "memcached-stats")
    reqs = [(1, 41, b"stats\r\n"), (2, 42, b"stats settings\r\n")]
    want = direct(mc, reqs, {1: "stats", 2: "stats"})
    got, _ = through_core(drv, mc, reqs, chunk=-100)
    for client, _, _ in reqs:
        for ds in (got[client], want[client]):
            total = struct.unpack("!HHHH", ds[0][:8])[2]
            assert [struct.unpack("!HHHH", d[:8])[1:3] for d in ds] == [(i, total) for i in range(total)]
            assert all(len(d) == 1400 for d in ds[:-1])
        names = [[ln.split()[1] for ln in b"".join(d[8:] for d in ds).split(b"\r\n") if ln.startswith(b"STAT ")]
                 for ds in (got[client], want[client])]
        assert names[0] == names[1] and len(names[0]) > 10  # same statistics; values differ (pid, uptime, ...)


def test_malformed_set_is_rejected_before_it_can_reach_memcached(sup, drv):
    mc = Memcached(sup, "memcached-victim")
    store(mc, [(b"k1", 0, b"hi")])
    short_set = b"set victim 0 0 100\r\nabc\r\n"
    assert drv.add(1, dg(short_set, 1)) == "REJ bad_data"  # nothing was queued for the TCP leg
    reqs = [(2, 2, b"get k1\r\n")]
    got, wire = through_core(drv, mc, reqs)
    assert wire == [b"get k1\r\n"] and got[2] == [dg(b"VALUE k1 0 2\r\nhi\r\nEND\r\n", 2)]
    assert drv.counters()["rej_bad_data"] == 1
    # what forwarding it would have done: memcached swallows the next client's request on a shared connection
    with socket.create_connection((HOST, mc.tcp_port), timeout=0.5) as s:
        s.sendall(short_set + b"get k1\r\n")
        with pytest.raises(TimeoutError):
            s.recv(100)
    # ... and on its UDP port (parser state shared by every client of the worker thread)
    mc.udp.sendto(dg(short_set, 3), (HOST, mc.udp_port))
    time.sleep(0.05)
    assert mc.udp_ask(b"get k1\r\n", 4, "none") == []
