"""memcached over UDP, the client side: the frame, reply assembly, and the clients the tests and benchmarks run.

This is the Python module that knows memcached's UDP wire format (the C one is ``dpdk/mc_proto.c``)::

     0      2      4      6      8
     +------+------+------+------+---------------------------------+
     | rid  | seq  |total | rsvd | ASCII command / answer bytes    |
     +------+------+------+------+---------------------------------+

A reply is a sequence of messages; each message is cut into datagrams numbered seq 0..total-1 under the
request's id.  The reply is complete when the concatenated bytes form a complete answer (``END`` after values,
one line for storage/delete/arith commands, ``END`` after ``STAT`` lines).

It runs standalone (stdlib only) so the tests can start it inside a network namespace::

    python mcudp.py run --server 10.77.0.1:11211 --script reqs.json     # scripted requests, raw replies
    python mcudp.py load --server 10.77.0.1:11211 --clients 16 ...      # many clients, gets, verified values
    python mcudp.py load --tcp --server 10.77.0.3:22122 ...              # the same over TCP (twemproxy)
    python mcudp.py order --server 10.77.0.1:11211 --clients 8 ...      # per-client order of set/get
    python mcudp.py preload --tcp 10.78.0.1:11211 --keys 1000 ...       # fill memcached over TCP
    python mcudp.py store --tcp 10.78.0.1:11211 --items items.json      # given items over TCP
    python mcudp.py fuzz --server 10.77.0.1:11211 --dgrams 2000 ...     # mutated datagrams, damaged frames

Each prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import struct
import sys
import time

HDR = struct.Struct("!HHHH")
UDP_MAX = 1400  # datagram payload including the 8-byte header
SO_RCVBUFFORCE = 33


def frame(payload: bytes, rid: int, seq: int = 0, total: int = 1, rsvd: int = 0) -> bytes:
    return HDR.pack(rid & 0xFFFF, seq, total, rsvd) + payload


def kind_of(payload: bytes) -> str:
    """The shape of memcached's answer to a request: values, line or stats."""
    word = payload.split(b" ", 1)[0].split(b"\r", 1)[0]
    if word in (b"get", b"gets", b"gat", b"gats"):
        return "values"
    if word == b"stats" and payload.strip() != b"stats reset":
        return "stats"
    return "line"


def answer_complete(buf: bytes, kind: str) -> bool:
    if kind == "line":
        return buf.endswith(b"\r\n")
    if buf.startswith((b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")):
        return buf.endswith(b"\r\n")
    if kind == "stats":
        return buf.endswith(b"END\r\n")
    i = 0
    while True:
        if buf[i:] == b"END\r\n":
            return True
        if not buf.startswith(b"VALUE ", i) or (e := buf.find(b"\r\n", i)) < 0:
            return False
        try:
            i = e + 2 + int(buf[i:e].split(b" ")[3]) + 2
        except (IndexError, ValueError):
            return False
        if i > len(buf):
            return False


def framing_error(dgrams: list[bytes], rid: int) -> str | None:
    """None if the datagrams are one reply framed as memcached frames it, else what is wrong."""
    expect_seq, total = 0, None
    for n, d in enumerate(dgrams):
        if len(d) < 8:
            return f"datagram {n}: {len(d)} bytes, no header"
        if len(d) > UDP_MAX:
            return f"datagram {n}: {len(d)} bytes, over {UDP_MAX}"
        r, seq, tot, rsvd = HDR.unpack_from(d)
        if r != rid:
            return f"datagram {n}: request id {r}, expected {rid}"
        if tot == 0 and len(d) == 8:
            continue  # memcached's empty frame after a miss
        if seq != expect_seq or (total is not None and tot != total) or seq >= tot:
            return f"datagram {n}: seq {seq}/{tot}, expected {expect_seq}/{total}"
        total = tot
        expect_seq = seq + 1
        if expect_seq == tot:
            expect_seq, total = 0, None
    if total is not None:
        return f"message cut short: seq {expect_seq} of {total} missing"
    return None


def parse_values(buf: bytes) -> dict[bytes, bytes]:
    """key -> data of a complete VALUE ... END answer (later duplicates win)."""
    out, i = {}, 0
    while buf.startswith(b"VALUE ", i):
        e = buf.index(b"\r\n", i)
        parts = buf[i:e].split(b" ")
        n = int(parts[3])
        out[parts[1]] = buf[e + 2:e + 2 + n]
        i = e + 2 + n + 2
    return out


def value_for(key: bytes, size: int) -> bytes:
    """The value the load's keys hold: derived from the key, so any mix-up shows."""
    seed = (key + b"|") * (size // (len(key) + 1) + 1)
    return seed[:size]


def make_socket(rcvbuf: int = 8 << 20, addr: str = "0.0.0.0") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((addr, 0))
    return s


def client_sockets(args) -> list[socket.socket]:
    """``--clients`` sockets, bound in turn to the addresses of ``--bind`` (a host standing for many client
    machines: on the fabric the front door's key and the helpers' select hash come from the source address)."""
    addrs = [a for a in args.bind.split(",") if a] or ["0.0.0.0"]
    return [make_socket(addr=addrs[i % len(addrs)]) for i in range(args.clients)]


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.partition(":")
    return host, int(port or 11211)


class Client:
    """One UDP client (one socket, one source port) sending requests one at a time."""

    def __init__(self, server: tuple[str, int]):
        self.server = server
        self.sock = make_socket()
        self.rid = 1

    def send_bad_checksum(self, data: bytes) -> None:
        """One UDP datagram from this client's address and port whose UDP checksum is wrong (raw socket)."""
        port = self.sock.getsockname()[1]
        udp = struct.pack("!HHHH", port, self.server[1], 8 + len(data), 0x1234) + data
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP) as raw:
            raw.sendto(udp, (self.server[0], 0))

    def ask(self, payload: bytes, kind: str | None = None, timeout: float = 2.0, raw: bytes | None = None,
            quiet: float = 0.05, bad_checksum: bool = False) -> dict:
        """Send one request; collect datagrams until the answer is complete (then ``quiet`` more seconds, so
        anything extra shows) or ``timeout``.  ``kind`` "none" expects no answer.  ``raw`` is sent as the whole
        datagram instead of a framed payload."""
        kind = kind or kind_of(payload)
        rid = self.rid
        self.rid = (self.rid + 1) & 0xFFFF or 1
        data = raw if raw is not None else frame(payload, rid)
        if bad_checksum:
            self.send_bad_checksum(data)
        else:
            self.sock.sendto(data, self.server)
        got, srcs = [], set()
        deadline = time.monotonic() + (quiet * 4 if kind == "none" else timeout)
        done = False
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            d, src = self.sock.recvfrom(65536)
            if len(d) >= 2 and HDR.unpack_from(d)[0] != rid and raw is None:
                continue  # a late datagram of an earlier request
            got.append(d)
            srcs.add(f"{src[0]}:{src[1]}")
            if not done and kind != "none" and answer_complete(b"".join(x[8:] for x in got), kind):
                done = True
                deadline = min(deadline, time.monotonic() + quiet)
        return {"rid": rid, "dgrams": [d.hex() for d in got], "sources": sorted(srcs), "complete": done,
                "framing": framing_error(got, rid) if got else None}


# ----------------------------------------------------------------- run: scripted requests

def cmd_run(args) -> dict:
    """Requests from a JSON list of {"payload": hex, "kind"?: str, "client"?: int, "raw"?: hex,
    "bad_checksum"?: bool}, in order."""
    with open(args.script) as fh:
        script = json.load(fh)
    server = parse_addr(args.server)
    clients: dict[int, Client] = {}
    out = []
    for item in script:
        c = clients.setdefault(item.get("client", 0), Client(server))
        payload = bytes.fromhex(item.get("payload", ""))
        raw = bytes.fromhex(item["raw"]) if "raw" in item else None
        out.append(c.ask(payload, item.get("kind"), timeout=args.timeout, raw=raw,
                         bad_checksum=item.get("bad_checksum", False)))
    return {"results": out}


# ----------------------------------------------------------------- load: many clients' gets

def answer_end(buf: bytes | bytearray) -> int | None:
    """Where the first complete answer to a retrieval command ends in a TCP stream (None: not complete yet).
    An error line, or any line that is not VALUE/END, is an answer of its own."""
    i = 0
    while True:
        e = buf.find(b"\r\n", i)
        if e < 0:
            return None
        line = bytes(buf[i:e])
        if line == b"END":
            return e + 2
        if not line.startswith(b"VALUE "):
            return e + 2
        try:
            i = e + 2 + int(line.split(b" ")[3]) + 2
        except (IndexError, ValueError):
            return e + 2
        if i > len(buf):
            return None


def tcp_client_sockets(args, server: tuple[str, int]) -> list[socket.socket]:
    """``--clients`` TCP connections to the server (``--tcp``), from the ``--bind`` addresses in turn."""
    addrs = [a for a in args.bind.split(",") if a] or [""]
    socks = []
    for i in range(args.clients):
        s = socket.create_connection(server, timeout=5, source_address=(addrs[i % len(addrs)], 0))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    return socks


def cmd_load(args) -> dict:
    """K clients send gets of keys P0..P(N-1) (``--multi`` keys each), open loop at ``--rate`` per second in
    total, or closed loop with ``--window`` outstanding per client; every answer is checked against
    value_for(key): ``wrong`` counts answers with a value that is not the key's, ``missed`` answers that lack
    a key, ``lost`` requests never answered.  With ``--tcp`` each client is one TCP connection speaking
    memcached's text protocol (to memcached or a proxy such as twemproxy), its requests pipelined and answered
    in order; everything else is the same."""
    server = parse_addr(args.server)
    tcp = args.tcp
    socks = tcp_client_sockets(args, server) if tcp else client_sockets(args)
    for s in socks:
        s.setblocking(False)
    inbuf = [bytearray() for _ in socks]     # TCP: bytes received, not yet a whole answer
    outbuf = [bytearray() for _ in socks]    # TCP: requests not yet taken by the socket
    by_fd = {s.fileno(): i for i, s in enumerate(socks)}
    ep = select.epoll()
    for s in socks:
        ep.register(s.fileno(), select.EPOLLIN)
    keys = [f"{args.prefix}{i}".encode() for i in range(args.keys)]
    rid = [1] * args.clients
    pending: list[dict[int, tuple[float, list[bytes], list[bytes]]]] = [{} for _ in socks]
    stats = {"sent": 0, "answered": 0, "wrong": 0, "missed": 0, "framing": 0, "lost": 0, "sources": set(),
             "lat": []}
    seq = 0
    if args.start_at:  # several processes (hosts) begin at one instant: a burst's onset, not a ramp
        time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.monotonic()
    t0_wall = time.time()
    # --timeline BIN: answers per BIN s, and every pause of a client's answers longer than --gap-min
    # ([client, wall-clock start, seconds]): how long a re-route or a helper failure left which clients unserved
    last = [t0] * args.clients
    gaps: list[list] = []
    bins: list[int] = []
    end = t0 + args.duration
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    next_send = t0

    def send(ci: int, now: float) -> None:
        nonlocal seq
        ks = [keys[(seq + j * 7919) % len(keys)] for j in range(args.multi)]
        seq += 1
        r = rid[ci]
        rid[ci] = (r + 1) & 0xFFFF or 1
        if tcp:
            outbuf[ci] += b"get " + b" ".join(ks) + b"\r\n"
            flush(ci)
        else:
            socks[ci].sendto(frame(b"get " + b" ".join(ks) + b"\r\n", r), server)
        pending[ci][r] = (now, ks, [])
        stats["sent"] += 1

    def flush(ci: int) -> None:
        if outbuf[ci]:
            try:
                del outbuf[ci][:socks[ci].send(outbuf[ci])]
            except BlockingIOError:
                pass

    def account(ci: int, now: float, t: float, ks: list[bytes], body: bytes) -> None:
        stats["answered"] += 1
        stats["lat"].append(now - t)
        if args.timeline:
            if now - last[ci] > args.gap_min:
                gaps.append([ci, round(t0_wall + (last[ci] - t0), 4), round(now - last[ci], 4)])
            last[ci] = now
            b = int((now - t0) / args.timeline)
            bins.extend([0] * (b + 1 - len(bins)))
            bins[b] += 1
        vals = parse_values(body)
        if any(k in vals and vals[k] != value_for(k, args.value_size) for k in ks):
            stats["wrong"] += 1     # a value that is not the key's: never acceptable
        elif len(vals) < len(set(ks)):
            stats["missed"] += 1    # a miss: a legal cache answer (and the helper's after a lost connection)

    def receive_tcp(ci: int, now: float) -> None:
        s, buf = socks[ci], inbuf[ci]
        while True:
            try:
                data = s.recv(1 << 20)
            except BlockingIOError:
                break
            if not data:
                raise ConnectionError(f"client {ci}: the server closed the connection")
            buf += data
        stats["sources"].add("%s:%d" % s.getpeername())
        while pending[ci] and (e := answer_end(buf)) is not None:
            r = next(iter(pending[ci]))       # answers come in request order
            t, ks, _ = pending[ci].pop(r)
            body = bytes(buf[:e])
            del buf[:e]
            account(ci, now, t, ks, body)

    def receive(ci: int, now: float) -> None:
        if tcp:
            receive_tcp(ci, now)
            return
        s = socks[ci]
        while True:
            try:
                d, src = s.recvfrom(65536)
            except BlockingIOError:
                return
            stats["sources"].add(f"{src[0]}:{src[1]}")
            r = HDR.unpack_from(d)[0] if len(d) >= 8 else -1
            if r not in pending[ci]:
                continue
            t, ks, parts = pending[ci][r]
            parts.append(d)
            body = b"".join(x[8:] for x in parts)
            if not answer_complete(body, "values"):
                continue
            del pending[ci][r]
            if framing_error(parts, r):
                stats["framing"] += 1
            account(ci, now, t, ks, body)

    # SIGTERM ends the load early, as its --duration would: the requests in flight are drained and the
    # results printed (a test whose steps take as long as the machine lets them stops its load after the last)
    stopped: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(time.monotonic()))
    rr = 0
    while True:
        now = time.monotonic()
        if stopped:
            end = min(end, stopped[0])
        if now >= end:
            break
        if interval:
            n = 0
            while next_send <= now and n < 256:
                send(rr, now)
                rr = (rr + 1) % len(socks)
                next_send += interval
                n += 1
        else:
            for ci in range(len(socks)):
                while len(pending[ci]) < args.window:
                    send(ci, now)
        if tcp:
            for ci in range(len(socks)):
                flush(ci)
        wait = max(0.0, min(next_send - time.monotonic(), 0.002)) if interval else 0.002
        for fd, _ in ep.poll(wait):
            receive(by_fd[fd], time.monotonic())
    drain_end = time.monotonic() + args.drain
    while time.monotonic() < drain_end and any(pending):
        for fd, _ in ep.poll(0.01):
            receive(by_fd[fd], time.monotonic())
    stats["lost"] = sum(len(p) for p in pending)
    # when the lost requests were sent (wall clock, the first 200): which moment lost them
    stats["lost_at"] = sorted(round(t0_wall + (t - t0), 4) for p in pending for t, _, _ in p.values())[:200]
    lat = sorted(stats.pop("lat"))
    elapsed = min(time.monotonic(), end) - t0
    stats["sources"] = sorted(stats["sources"])
    stats["elapsed_s"] = round(elapsed, 3)
    stats["rate"] = round(stats["answered"] / elapsed, 1) if elapsed > 0 else 0.0
    if lat:
        stats["p50_us"] = round(lat[len(lat) // 2] * 1e6, 1)
        stats["p99_us"] = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1)
    if args.timeline:
        stats.update(t0_wall=t0_wall, bin_s=args.timeline, bins=bins, gaps=gaps,
                     last_answer=[round(t0_wall + (x - t0), 4) for x in last])
    return stats


# ----------------------------------------------------------------- order: per-client set/get order

def cmd_order(args) -> dict:
    """Each client owns key P<c> and, round after round, sends without waiting:
         set k v_i ; get k      -> the get must return v_i (it was sent after the set)
         get k ; set k v_(i+1)  -> the get must return v_i (it was sent before the set)
    All clients run interleaved, so their gets share coalesced batches.  Counts answers that break order.
    ``--sizes``: value lengths, in turn (value i has sizes[i % n] bytes), and the set-then-get's get is a
    multi-get of as many missing filler keys as bring it near sizes[(i + 3) % n] bytes (at most 250 keys):
    requests from ~100 B to ~60 KB, the large ones in IP fragments."""
    server = parse_addr(args.server)
    socks = client_sockets(args)
    for s in socks:
        s.settimeout(args.timeout)
    rid = [1] * len(socks)
    res = {"rounds": 0, "checked": 0, "violations": 0, "missing": 0, "examples": [], "sources": set()}

    def send(ci: int, payload: bytes) -> int:
        r = rid[ci]
        rid[ci] = (r + 1) & 0xFFFF or 1
        socks[ci].sendto(frame(payload, r), server)
        return r

    def collect(ci: int, want: dict[int, str]) -> dict[int, bytes]:
        """Answers to the rids in want (rid -> kind) on client ci."""
        got: dict[int, list[bytes]] = {r: [] for r in want}
        done: dict[int, bytes] = {}
        while len(done) < len(want):
            try:
                d, src = socks[ci].recvfrom(65536)
            except TimeoutError:
                break
            res["sources"].add(f"{src[0]}:{src[1]}")
            r = HDR.unpack_from(d)[0]
            if r not in got or r in done:
                continue
            got[r].append(d)
            body = b"".join(x[8:] for x in got[r])
            if answer_complete(body, want[r]):
                done[r] = body
        return done

    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [args.pad]

    def value(ci: int, i: int) -> bytes:
        return f"c{ci}-v{i}-".encode() + b"x" * sizes[i % len(sizes)]

    def get_cmd(ci: int, k: bytes, size: int = 0) -> bytes:
        fill = [b"%s-f%d-%d-" % (args.prefix.encode(), ci, j) for j in range(min(250, max(0, size - 20) // 241))]
        return b"get " + b"".join(f.ljust(240, b"z") + b" " for f in fill) + k + b"\r\n"

    def set_cmd(k: bytes, v: bytes) -> bytes:
        return b"set %s 0 0 %d\r\n%s\r\n" % (k, len(v), v)

    keys = [f"{args.prefix}{ci}".encode() for ci in range(len(socks))]
    for ci, k in enumerate(keys):  # initial value v0, acknowledged
        r = send(ci, set_cmd(k, value(ci, 0)))
        collect(ci, {r: "line"})
    t_end = time.monotonic() + args.duration if args.duration else None
    for i in range(args.rounds):
        if t_end is not None and time.monotonic() > t_end:
            break
        if i and args.gap:
            time.sleep(args.gap)
        res["rounds"] += 1
        plan = []
        for ci, k in enumerate(keys):  # get-then-set: the get must see v_i
            g = send(ci, b"get " + k + b"\r\n")
            s = send(ci, set_cmd(k, value(ci, i + 1)))
            plan.append((ci, g, s, value(ci, i), "get-then-set"))
        for ci, g, s, want, what in plan:
            ans = collect(ci, {g: "values", s: "line"})
            check(res, ans, g, s, keys[ci], want, what)
        plan = []
        for ci, k in enumerate(keys):  # set-then-get: the get must see the new value
            s = send(ci, set_cmd(k, value(ci, i + 2)))
            g = send(ci, get_cmd(ci, k, sizes[(i + 3) % len(sizes)] if args.sizes else 0))
            plan.append((ci, g, s, value(ci, i + 2), "set-then-get"))
        for ci, g, s, want, what in plan:
            ans = collect(ci, {g: "values", s: "line"})
            check(res, ans, g, s, keys[ci], want, what)
        for ci, k in enumerate(keys):  # back to v_(i+1) for the next round, acknowledged
            r = send(ci, set_cmd(k, value(ci, i + 1)))
            collect(ci, {r: "line"})
    res["sources"] = sorted(res["sources"])
    return res


def check(res: dict, ans: dict[int, bytes], g: int, s: int, key: bytes, want: bytes, what: str) -> None:
    if g not in ans or s not in ans:
        res["missing"] += 1
        return
    res["checked"] += 1
    got = parse_values(ans[g]).get(key)
    if got != want or ans[s] != b"STORED\r\n":
        res["violations"] += 1
        if len(res["examples"]) < 5:
            res["examples"].append({"what": what, "want": want[:24].decode(errors="replace"),
                                    "got": (got or b"<miss>")[:24].decode(errors="replace"),
                                    "set": ans[s][:60].decode(errors="replace"), "len": len(want)})


# ----------------------------------------------------------------- fuzz: mutated datagrams and frames

FUZZ_SEEDS = [b"get fz1\r\n", b"gets fz1 fz2 fz3\r\n", b"set fz9 0 0 5\r\nhello\r\n", b"delete fz9\r\n",
              b"incr fzn 3\r\n", b"touch fz1 10\r\n", b"stats\r\n", b"version\r\n", b"get " + b"f" * 250 + b"\r\n",
              b"get " + b" ".join(b"fz%d" % i for i in range(300)) + b"\r\n"]


def mutate(rng, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.choice([b" ", b"\r\n", b"\n", b"\x00", b"\x80", b"\r", b"noreply", b"99999999999999999999",
                                 b"-1", bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))])
        elif op == 2 and b:
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 16)]
        elif op == 3 and b:
            del b[rng.randrange(len(b)):]
        elif op == 4 and len(b) >= 8:
            b[rng.randrange(8)] = rng.randrange(256)     # the frame header
        elif op == 5 and b:
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 64)]
        else:
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(b)


def ip_checksum(h: bytes) -> int:
    s = sum(struct.unpack(f"!{len(h) // 2}H", h[:len(h) // 2 * 2]))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def request_frame(src_mac: bytes, dst_mac: bytes, src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    """A well-formed Ethernet/IPv4/UDP frame (UDP checksum 0: none) carrying payload."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + len(payload), 1, 0, 64, 17, 0, socket.inet_aton(src),
                     socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", ip_checksum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
    return dst_mac + src_mac + b"\x08\x00" + ip + udp + payload


def mutate_frame(rng, f: bytes) -> bytes:
    """Header-level damage: the fields the helper's frame classification reads."""
    b = bytearray(f)
    op = rng.randrange(9)
    if op == 0:
        del b[rng.randint(14, len(b)):]                       # cut anywhere after the Ethernet header
    elif op == 1:
        b[14] = rng.choice([0x40, 0x44, 0x46, 0x4F, 0x65, 0x00, rng.randrange(256)])   # version / IHL
    elif op == 2:
        b[16:18] = struct.pack("!H", rng.choice([0, 19, 27, 28, len(b) - 14 + rng.randint(1, 3000), 65535]))
    elif op == 3:  # MF / fragment offset: the kernel's defrag (af_packet fanout) holds these back
        b[20:22] = struct.pack("!H", rng.choice([0x2000, 0x0001, 0x3FFF, 0x2010]))
    elif op == 4:
        b[23] = rng.choice([6, 1, 0, 255])                     # not UDP
    elif op == 5:
        b[38:40] = struct.pack("!H", rng.choice([0, 7, 8, 9, 65535, len(b) - 34 + 1]))  # UDP length
    elif op == 6:
        b[12:14] = rng.choice([b"\x81\x00", b"\x86\xdd", b"\x08\x06", rng.randbytes(2)])   # EtherType
    elif op == 7:
        b[34:36] = b"\x00\x00"                               # source port 0
    else:
        i = rng.randrange(14, len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def is_fragment(f: bytes) -> bool:
    """An IPv4 fragment the kernel would try to reassemble (what its defrag checks before holding it)."""
    if len(f) < 34 or f[12:14] != b"\x08\x00" or f[14] >> 4 != 4 or f[14] & 15 < 5:
        return False
    tot = struct.unpack_from("!H", f, 16)[0]
    return len(f) - 14 >= tot >= (f[14] & 15) * 4 and bool(struct.unpack_from("!H", f, 20)[0] & 0x3FFF)


def cmd_fuzz(args) -> dict:
    """--dgrams mutated memcached datagrams on a UDP socket, then --frames damaged Ethernet frames on the
    client's interface (AF_PACKET) to --dst-mac; counts what was sent and what was answered."""
    import random
    rng = random.Random(args.seed)
    server = parse_addr(args.server)
    c = Client(server)
    c.sock.setblocking(False)
    sent_d = answered = 0
    for i in range(args.dgrams):
        data = mutate(rng, frame(rng.choice(FUZZ_SEEDS), i & 0xFFFF))[:args.max_len]
        try:
            c.sock.sendto(data, server)
            sent_d += 1
        except OSError:
            pass
        if i % 50 == 49:
            time.sleep(0.005)
    sent_f = frags = 0
    if args.frames:
        with open(f"/sys/class/net/{args.iface}/address") as fh:
            src_mac = bytes.fromhex(fh.read().strip().replace(":", ""))
        dst_mac = bytes.fromhex(args.dst_mac.replace(":", ""))
        src_ip = args.src_ip
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        raw.bind((args.iface, 0))
        port = c.sock.getsockname()[1]
        for i in range(args.frames):
            good = request_frame(src_mac, dst_mac, src_ip, server[0], port, server[1],
                                 frame(rng.choice(FUZZ_SEEDS[:8]), i & 0xFFFF))
            bad = mutate_frame(rng, good)
            raw.send(bad)
            sent_f += 1
            if is_fragment(bad):
                frags += 1
            if i % 50 == 49:
                time.sleep(0.005)
        raw.close()
    time.sleep(0.3)
    while True:
        try:
            c.sock.recvfrom(65536)
            answered += 1
        except BlockingIOError:
            break
    return {"dgrams": sent_d, "frames": sent_f, "fragments": frags, "answer_dgrams": answered}


# ----------------------------------------------------------------- preload over TCP

def store_tcp(addr: str, items) -> str:
    """Store (key, flags, value) items over one TCP connection (noreply, then ``version`` as a barrier)."""
    host, port = parse_addr(addr)
    with socket.create_connection((host, port), timeout=10) as s:
        buf = bytearray()
        for k, flags, v in items:
            buf += b"set %s %d 0 %d noreply\r\n%s\r\n" % (k, flags, len(v), v)
            if len(buf) > 1 << 16:
                s.sendall(buf)
                buf.clear()
        buf += b"version\r\n"
        s.sendall(buf)
        got = b""
        while not got.endswith(b"\r\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    return got.decode(errors="replace").strip()


def cmd_preload(args) -> dict:
    keys = (f"{args.prefix}{i}".encode() for i in range(args.keys))
    answer = store_tcp(args.tcp, ((k, 0, value_for(k, args.value_size)) for k in keys))
    return {"loaded": args.keys, "answer": answer}


def cmd_store(args) -> dict:
    """Items from a JSON list of [key hex, flags, value hex]."""
    with open(args.items) as fh:
        items = [(bytes.fromhex(k), f, bytes.fromhex(v)) for k, f, v in json.load(fh)]
    return {"stored": len(items), "answer": store_tcp(args.tcp, items)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="scripted requests, raw replies")
    p.add_argument("--server", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--timeout", type=float, default=2.0)
    p = sub.add_parser("load", help="many clients' gets, values verified")
    p.add_argument("--server", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=2.0,
                   help="s of load (SIGTERM ends it earlier; either way the answers in flight are drained)")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s in total (0: closed loop)")
    p.add_argument("--window", type=int, default=1, help="closed loop: outstanding per client")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--multi", type=int, default=1, help="keys per get")
    p.add_argument("--prefix", default="k")
    p.add_argument("--value-size", type=int, default=64)
    p.add_argument("--drain", type=float, default=1.0)
    p.add_argument("--bind", default="", help="comma-separated source addresses, one per client in turn")
    p.add_argument("--timeline", type=float, default=0.0, metavar="BIN",
                   help="report answers per BIN s and pauses of each client's answers (0: off)")
    p.add_argument("--gap-min", type=float, default=0.05, help="pauses longer than this are reported (s)")
    p.add_argument("--start-at", type=float, default=0.0, metavar="EPOCH",
                   help="begin sending at this wall-clock time (time.time()), so processes start together")
    p.add_argument("--tcp", action="store_true",
                   help="clients are TCP connections (text protocol, pipelined), e.g. to twemproxy at --server")
    p = sub.add_parser("order", help="per-client order of set and get")
    p.add_argument("--server", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--prefix", default="ord")
    p.add_argument("--pad", type=int, default=16)
    p.add_argument("--sizes", default="", help="comma-separated value sizes in turn (and multi-gets near them)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many s (0: all --rounds)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="s between rounds (0: back to back; a round is 5 requests per client)")
    p.add_argument("--bind", default="", help="comma-separated source addresses, one per client in turn")
    p.add_argument("--timeout", type=float, default=2.0)
    p = sub.add_parser("preload", help="fill memcached over TCP")
    p.add_argument("--tcp", required=True)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--prefix", default="k")
    p.add_argument("--value-size", type=int, default=64)
    p = sub.add_parser("fuzz", help="mutated datagrams and damaged frames")
    p.add_argument("--server", required=True)
    p.add_argument("--dgrams", type=int, default=1000)
    p.add_argument("--frames", type=int, default=0)
    p.add_argument("--iface", default="")
    p.add_argument("--dst-mac", default="")
    p.add_argument("--src-ip", default="")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-len", type=int, default=1400)
    p = sub.add_parser("store", help="store given items over TCP")
    p.add_argument("--tcp", required=True)
    p.add_argument("--items", required=True)
    args = ap.parse_args(argv)
    out = {"run": cmd_run, "load": cmd_load, "order": cmd_order, "preload": cmd_preload,
           "store": cmd_store, "fuzz": cmd_fuzz}[args.cmd](args)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
