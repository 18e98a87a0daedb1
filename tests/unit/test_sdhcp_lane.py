"""sdhcp's native lane (services/sdhcp/native/sdhcp_lane.c) against the Python backend, request for request.

Two stores of one pool: A is served by the Python backend alone; B by the lane first (``NativeLane.serve``,
one pass over given frames, as its thread runs them) and by the Python backend for whatever the lane leaves
to the loop.  Every reply frame must be byte for byte the same, and so must every lease and address row
after each request.  The conversations are those of udhcpc, dhclient, dhcpcd and perfdhcp (client ids,
option 57, the broadcast flag, relays), the cases the lane must leave alone, and then the same frames
mutated at random (the fuzz; also under AddressSanitizer in a child process).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from ipaddress import IPv4Address

import pytest

from vfab.services.sdhcp import frames, ipudp, lane as lanemod
from vfab.services.sdhcp.backend import SdhcpBackend
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.lane import NativeLane
from vfab.services.sdhcp.store import Store
from vfab.services.sdhcp.wire import Message, MessageType, Opt
from vfab.services.sdhcp.errors import DhcpError
from vfab.vid import mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.frame import parse as parse_frame
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BadRequest, Request

SERVER = IPv4Address("192.168.77.1")
RELAY = IPv4Address("192.168.77.99")
OPTS = {"pool": "192.168.77.10-192.168.77.250", "mask": "24", "server": str(SERVER), "router": "192.168.77.254",
        "dns": "192.168.77.53,192.168.77.54", "lease": "600", "t1": "300", "t2": "525", "relays": str(RELAY)}
PORT_MAC = bytes.fromhex("02000000aa01")
RELAY_MAC = bytes.fromhex("02aaaaaaaaaa")
VID_BASE = 0x0E << 40            # the backend's own vid_mac when no loop sets it
NOW = 1_800_000_000_000          # ms

pytestmark = pytest.mark.skipif(not os.path.exists(lanemod.NATIVE_PATH),
                                reason="run 'make -C services/sdhcp/native' (make bootstrap builds it)")


class Pair:
    """Store A (Python) and store B (lane, then Python), fed the same frames."""

    def __init__(self, tmp_path, lib_path: str = lanemod.NATIVE_PATH, key_fn: str = mackey.LOW24,
                 forwarded: bool = False):
        self.forwarded = forwarded   # feed the lane each frame as another shard forwards it (frames.wrap)
        config = parse_opts(OPTS)
        self.a = SdhcpBackend(Store(str(tmp_path / "a.sqlite"), config, key_fn))
        self.b = SdhcpBackend(Store(str(tmp_path / "b.sqlite"), config, key_fn))
        self.now = NOW
        for be in (self.a, self.b):
            be.clock = lambda: self.now / 1000
        self.lane = NativeLane(self.b, -1, VID_BASE, lib_path)
        self.b.store.lane = self.b.store.writer_lock = self.lane
        self.grant([(0, KEY_MAX)])
        self.served = self.punted = 0
        self.kinds: dict[str, list[bool]] = {}

    def grant(self, ranges, valid_for: float = 3600.0) -> None:
        self.lane.grant(ranges, time.monotonic() + valid_for, 1)
        self.a.allocatable = self.b.allocatable = lambda: [Range(lo, hi) for lo, hi in ranges]

    def close(self) -> None:
        self.b.store.writer_lock = self.b.store.lane = None
        self.lane.close()
        self.a.store.close()
        self.b.store.close()

    @staticmethod
    def python(be: SdhcpBackend, raw: bytes) -> bytes | None:
        if raw[12:14] != b"\x08\x00":
            return None   # the loop's ARP or nothing
        try:
            payload = parse_frame(frames.wrap(raw, PORT_MAC)).payload   # what the loop serves (server.py)
        except DhcpError:
            return None
        try:
            key = be.key_of(payload)
        except BadRequest:
            return None
        replies, _ = be.handle_batch([Request(payload, key, raw[6:12])])
        return replies[0]

    def send(self, raw: bytes, kind: str = "") -> bytes | None:
        want = self.python(self.a, raw)
        got = self.lane.serve([raw], self.now)[0] if not self.forwarded else self.lane_forwarded(raw)
        native = got is not None
        if not native:
            got = self.python(self.b, raw)
            self.punted += 1
        else:
            self.served += 1
        if kind:
            self.kinds.setdefault(kind, []).append(native)
        assert got == want, f"{kind}: native={native}\n lane/B {got and got.hex()}\n python {want and want.hex()}"
        assert self.rows(self.a) == self.rows(self.b), kind
        return got

    def lane_forwarded(self, raw: bytes) -> bytes | None:
        try:
            wrapped = frames.wrap(raw, PORT_MAC)
        except DhcpError:
            return None   # not a request any shard would forward
        return self.lane.serve_forwarded([wrapped], self.now)[0]

    @staticmethod
    def rows(be: SdhcpBackend):
        db = be.store.db
        return (db.execute("SELECT chaddr, vkey, ip, state, expires, client_id, version FROM lease ORDER BY chaddr")
                .fetchall(),
                db.execute("SELECT ip, vkey, holder, state, until, version FROM addr ORDER BY ip").fetchall())


def frame(mac: bytes, mtype: MessageType, *, src: bytes | None = None, dst_ip: str = "255.255.255.255",
          src_ip: str = "0.0.0.0", sport: int = 68, opts: dict | None = None, **kw) -> bytes:
    """The Ethernet frame a client's DHCP message reaches a shard in (the front door rewrote eth_dst)."""
    msg = Message(op=kw.pop("op", 1), xid=kw.pop("xid", 0x5EED), chaddr=mac,
                  options={Opt.MSG_TYPE: bytes([mtype]), **(opts or {})}, **kw).serialize()
    return ipudp.udp_frame(PORT_MAC, src or mac, IPv4Address(src_ip).packed, IPv4Address(dst_ip).packed, sport, 67,
                           msg)


def yiaddr(reply: bytes) -> IPv4Address:
    return IPv4Address(ipudp.parse(reply).payload[16:20])


def conversation(p: Pair, mac: bytes, style: str, rnd: random.Random) -> None:
    """One client's life: DORA, renew, rebind, init-reboot, and what only the loop answers."""
    extra = {}
    if style in ("udhcpc", "dhcpcd"):
        extra[Opt.CLIENT_ID] = b"\x01" + mac
    if style == "udhcpc":
        extra[Opt.MAX_MESSAGE_SIZE] = (576).to_bytes(2, "big")
        extra[Opt.PARAM_REQUEST_LIST] = bytes([1, 3, 6, 12, 15, 28, 42])
        extra[60] = b"udhcp 1.35.0"
    if style == "dhclient":
        extra[Opt.HOSTNAME] = b"h" + mac.hex().encode()
    flags = 0x8000 if style == "dhcpcd" else 0
    relayed = style == "perfdhcp"
    via = dict(src=RELAY_MAC, giaddr=RELAY, dst_ip=str(SERVER), src_ip=str(RELAY), sport=67, hops=1) if relayed \
        else {}
    offer = p.send(frame(mac, MessageType.DISCOVER, opts=extra, flags=flags, **via), "discover")
    assert offer is not None
    ip = yiaddr(offer)
    p.now += rnd.randint(1, 50)
    ack = p.send(frame(mac, MessageType.REQUEST, flags=flags, **via,
                       opts={**extra, Opt.SERVER_ID: SERVER.packed, Opt.REQUESTED_IP: ip.packed}), "selecting")
    assert ack is not None and yiaddr(ack) == ip
    if relayed:
        return
    p.now += 300_000
    p.send(frame(mac, MessageType.REQUEST, opts=extra, ciaddr=ip, src_ip=str(ip), dst_ip=str(SERVER)), "renewing")
    p.now += 225_000
    p.send(frame(mac, MessageType.REQUEST, opts=extra, ciaddr=ip, src_ip=str(ip)), "rebinding")
    p.send(frame(mac, MessageType.REQUEST, opts={**extra, Opt.REQUESTED_IP: ip.packed}), "init_reboot")
    # the loop's: a bound client's DISCOVER, a request for another address (NAK), another server's selection
    p.send(frame(mac, MessageType.DISCOVER, opts=extra), "rediscover")
    other = IPv4Address(int(ip) + 1)
    p.send(frame(mac, MessageType.REQUEST, opts={**extra, Opt.REQUESTED_IP: other.packed}), "nak")
    p.send(frame(mac, MessageType.REQUEST, opts={**extra, Opt.SERVER_ID: b"\x0a\0\0\x01",
                                                 Opt.REQUESTED_IP: ip.packed}), "other_server")
    if rnd.random() < 0.5:
        p.send(frame(mac, MessageType.RELEASE, opts={Opt.SERVER_ID: SERVER.packed}, ciaddr=ip, src_ip=str(ip),
                     dst_ip=str(SERVER)), "release")
        p.send(frame(mac, MessageType.REQUEST, opts={**extra, Opt.REQUESTED_IP: ip.packed}), "after_release")
        p.send(frame(mac, MessageType.RELEASE, opts={Opt.SERVER_ID: SERVER.packed}, ciaddr=ip, src_ip=str(ip),
                     dst_ip=str(SERVER)), "release")
        p.now += 61_000
        p.send(frame(mac, MessageType.DISCOVER, opts=extra), "released_discover")   # offered its address again
    elif rnd.random() < 0.5:   # declined: it holds no address, and a fresh one is found for it
        p.send(frame(mac, MessageType.DECLINE, opts={Opt.REQUESTED_IP: ip.packed, Opt.SERVER_ID: SERVER.packed}),
               "decline")
        p.send(frame(mac, MessageType.DISCOVER, opts=extra), "declined_discover")


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    yield p
    p.close()


@pytest.fixture(params=[(mackey.HASH, False), (mackey.LOW24, False), (mackey.HASH, True)],
                ids=["mac-hash", "mac-low24", "forwarded"])
def keyed(tmp_path, request):
    """A pair under each key function (vfab.vid.mackey), and one whose lane gets each frame as another shard
    forwards it to this one (``NativeLane.serve_forwarded``)."""
    p = Pair(tmp_path, key_fn=request.param[0], forwarded=request.param[1])
    yield p
    p.close()


def test_the_lane_answers_every_common_request_as_the_python_backend_does(keyed):
    pair = keyed
    rnd = random.Random(7)
    styles = ["udhcpc", "dhclient", "dhcpcd", "perfdhcp"]
    macs = set()
    while len(macs) < 120:
        macs.add(bytes([2, 0x5D]) + rnd.randbytes(4))
    for i, mac in enumerate(sorted(macs)):
        conversation(pair, mac, styles[i % 4], rnd)
    k = pair.kinds
    # a released client asking for its address again gets it back (it stays associated), and a bound one
    # starting over is offered its own address: the lane's too
    # (and a client whose lease ended or that declined its address gets an address again)
    offers = ("discover", "rediscover", "released_discover", "declined_discover")
    for kind in (*offers, "selecting", "renewing", "rebinding", "init_reboot", "after_release"):
        assert k.get(kind) and all(k[kind]), f"the lane left a {kind} to the loop"
    for kind in ("nak", "other_server", "release"):
        assert k.get(kind) and not any(k[kind]), f"the lane served a {kind} (the loop's), or none was sent"
    c = pair.lane.counters()
    assert c["offers"] == sum(len(k[x]) for x in offers)
    assert c["acks"] == sum(len(k[x]) for x in ("selecting", "renewing", "rebinding", "init_reboot", "after_release"))


def test_consecutive_macs_share_a_first_slot_and_get_the_same_addresses(pair):
    """perfdhcp's clients: neighbouring keys, one first choice for all (the free-address search's hints)."""
    for i in range(60):
        mac = bytes([2, 0, 0, 0x20, 0, i])
        pair.send(frame(mac, MessageType.DISCOVER), "discover")
    assert all(pair.kinds["discover"])


def test_the_lane_keys_clients_by_the_stores_key_function(keyed):
    """Sequential MACs granted half the key space: the lane serves exactly those whose key (mackey, the front
    door's) is in it, with the key's VID as the reply's source; the rest go to the loop.  Under mac-hash about
    half of them; under mac-low24 all (their low 24 bits are all below the half)."""
    half = KEY_MAX // 2
    keyed.grant([(0, half)])
    fn = keyed.b.store.key_fn
    macs = [bytes([0, 0x0C, 1, 2, 3, i]) for i in range(64)]
    mine = [m for m in macs if mackey.key(m, fn) <= half]
    assert len(mine) == (64 if fn == mackey.LOW24 else len(mine)) and (fn == mackey.LOW24 or 16 < len(mine) < 48)
    for mac in macs:
        got = keyed.lane.serve([frame(mac, MessageType.DISCOVER)], keyed.now)[0]
        assert (got is not None) == (mac in mine), (mac.hex(), fn)
        if got is not None:
            assert got[6:12] == (VID_BASE | mackey.key(mac, fn)).to_bytes(6, "big")
            assert keyed.b.store.db.execute("SELECT vkey FROM lease WHERE chaddr=?",
                                            (int.from_bytes(mac, "big"),)).fetchone()[0] == mackey.key(mac, fn)


def test_the_lane_serves_only_what_it_is_granted_and_only_until_its_deadline(pair):
    half = KEY_MAX // 2
    pair.grant([(0, half)])
    low, high = bytes([2, 0, 0, 0x10, 0, 1]), bytes([2, 0, 0, 0x90, 0, 1])
    assert pair.lane.serve([frame(low, MessageType.DISCOVER)], pair.now)[0] is not None
    assert pair.lane.serve([frame(high, MessageType.DISCOVER)], pair.now)[0] is None   # not granted
    pair.lane.grant([(0, half)], time.monotonic() - 0.001, 1)                       # the lease ran out
    assert pair.lane.serve([frame(bytes([2, 0, 0, 0x10, 0, 2]), MessageType.DISCOVER)], pair.now)[0] is None
    pair.lane.extend(time.monotonic() + 60, 2)                                       # another lease's keepalive
    assert pair.lane.serve([frame(bytes([2, 0, 0, 0x10, 0, 3]), MessageType.DISCOVER)], pair.now)[0] is None
    pair.lane.extend(time.monotonic() + 60, 1)                                       # its own
    assert pair.lane.serve([frame(bytes([2, 0, 0, 0x10, 0, 4]), MessageType.DISCOVER)], pair.now)[0] is not None
    pair.lane.grant([], 0.0, 0)
    assert pair.lane.serve([frame(bytes([2, 0, 0, 0x10, 0, 5]), MessageType.DISCOVER)], pair.now)[0] is None
    assert pair.lane.take_rates() == {0: 2}


def test_an_address_freed_by_the_python_side_is_found_again_by_the_lane(pair):
    """A release ends a lease; a decline frees nothing but the hold runs out: the lane's search hints are
    forgotten whenever the Python store may have freed an address (Store._may_free), as its own are."""
    macs = [bytes([2, 0, 0, 0x20, 0, i]) for i in range(8)]
    ips = []
    for mac in macs:
        ips.append(yiaddr(pair.send(frame(mac, MessageType.DISCOVER), "discover")))
    pair.send(frame(macs[0], MessageType.DECLINE, opts={Opt.REQUESTED_IP: ips[0].packed,
                                                        Opt.SERVER_ID: SERVER.packed}), "decline")
    pair.now += 600_001                                  # the decline's hold is over, the offers too
    got = yiaddr(pair.send(frame(bytes([2, 0, 0, 0x20, 0, 99]), MessageType.DISCOVER), "fresh"))
    assert got == ips[0]


def _mutations(rnd: random.Random, good: list[bytes], n: int):
    for _ in range(n):
        data = bytearray(rnd.choice(good))
        how = rnd.random()
        if how < 0.5:
            for _ in range(rnd.randint(1, 4)):
                data[rnd.randrange(len(data))] = rnd.randrange(256)
        elif how < 0.7:
            data = data[:rnd.randrange(14, len(data))]
        elif how < 0.85:   # an option's length byte: the checks the lane takes from wire.py
            at = rnd.randrange(14 + 20 + 8 + 240, len(data))
            data[at] = rnd.choice([0, 1, 2, 3, 4, 5, 255])
        else:
            data += bytes(rnd.randrange(1, 40))
        yield bytes(data)


def run_fuzz(tmp_path, lib_path: str, rounds: int, seed: int, forwarded: bool = False) -> tuple[int, int]:
    """Mutated frames through both paths; whatever the lane serves, Python answers the same."""
    p = Pair(tmp_path, lib_path, forwarded=forwarded)
    try:
        rnd = random.Random(seed)
        good = []
        for i in range(12):
            mac = bytes([2, 0x5D, 0, i * 16, 0, i])
            offer = p.send(frame(mac, MessageType.DISCOVER, opts={Opt.CLIENT_ID: b"\x01" + mac}))
            ip = yiaddr(offer)
            good += [frame(mac, MessageType.DISCOVER, opts={Opt.CLIENT_ID: b"\x01" + mac}),
                     frame(mac, MessageType.REQUEST, opts={Opt.SERVER_ID: SERVER.packed, Opt.REQUESTED_IP: ip.packed,
                                                           Opt.MAX_MESSAGE_SIZE: b"\x05\xdc"}),
                     frame(mac, MessageType.REQUEST, ciaddr=ip, src_ip=str(ip), dst_ip=str(SERVER))]
        fuzzed = list(_mutations(rnd, good, rounds))
        for raw in fuzzed:
            p.send(raw)
        return p.served, p.punted
    finally:
        p.close()


def test_mutated_frames_are_served_as_python_serves_them_or_left_to_the_loop(tmp_path):
    served, punted = run_fuzz(tmp_path, lanemod.NATIVE_PATH, 4000, 11)
    assert served > 100 and punted > 1000   # both sides of the lane were exercised


def test_mutated_forwarded_requests_are_served_as_python_serves_them(tmp_path):
    served, punted = run_fuzz(tmp_path, lanemod.NATIVE_PATH, 2000, 12, forwarded=True)
    assert served > 50 and punted > 500


def test_a_forwarded_pass_stops_at_the_first_request_left_to_the_loop_and_waits_for_the_loop(pair):
    """In order: a request the lane leaves to the loop (a RELEASE) stops the pass, the ones after it too;
    and nothing is served while a frame the lane handed to the loop is unfinished."""
    a, b = bytes([2, 0, 0, 0x10, 0, 1]), bytes([2, 0, 0, 0x10, 0, 2])
    wrapped = [frames.wrap(frame(m, t), PORT_MAC) for m, t in
               ((a, MessageType.DISCOVER), (a, MessageType.RELEASE), (b, MessageType.DISCOVER))]
    got = pair.lane.serve_forwarded(wrapped, pair.now)
    assert got[0] is not None and got[1:] == [None, None]
    assert pair.lane.serve_forwarded(wrapped[2:], pair.now)[0] is not None
    bad = bytearray(wrapped[0])
    bad[14] = 2                                          # vfab version 2: not ours to read
    assert pair.lane.serve_forwarded([bytes(bad)], pair.now) == [None]


def test_the_fuzz_under_address_sanitizer(tmp_path):
    """The same fuzz with the library built with ASan and UBSan, in a child process (the sanitizer's runtime
    must be loaded first)."""
    native = os.path.dirname(lanemod.NATIVE_PATH)
    asan_lib = os.path.join(native, "libvfab_sdhcp_asan.so")
    subprocess.run(["make", "-s", "-C", os.path.dirname(native), "build/libvfab_sdhcp_asan.so"], check=True)
    runtime = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                             check=True).stdout.strip()
    (tmp_path / "fwd").mkdir()
    code = ("import sys, pathlib; sys.path.insert(0, %r); import test_sdhcp_lane as t; "
            "print(t.run_fuzz(pathlib.Path(%r), %r, 1500, 5), t.run_fuzz(pathlib.Path(%r), %r, 800, 6, True))"
            % (os.path.dirname(__file__), str(tmp_path), asan_lib, str(tmp_path / "fwd"), asan_lib))
    env = {**os.environ, "LD_PRELOAD": runtime, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "ERROR: AddressSanitizer" not in out.stderr and "runtime error" not in out.stderr, out.stderr[-4000:]


def test_the_loop_grants_only_owned_unmirrored_ranges_no_operation_touches():
    """SdhcpLoop._lane_ranges: what the lane may serve is what the loop could serve without a peer's help."""
    from types import SimpleNamespace as NS

    from vfab.services.sdhcp.server import SdhcpLoop

    def rec(lo, hi, mirrors=()):
        return NS(lo=lo, hi=hi, range=Range(lo, hi), mirrors=list(mirrors))

    recs = [rec(0, 0x3FFFFF), rec(0x400000, 0x7FFFFF, ["m"]), rec(0x800000, 0xBFFFFF), rec(0xC00000, 0xFFFFFF)]
    fake = NS(name="s1", paused={}, targets={}, pending=[], view=NS(owned_by=lambda name: recs),
              _authoritative=lambda: True)
    assert SdhcpLoop._lane_ranges(fake) == [(0, 0x3FFFFF), (0x800000, 0xBFFFFF), (0xC00000, 0xFFFFFF)]
    fake.paused = {0x800000: (Range(0x900000, 0x9FFFFF), [])}        # a split pauses part of a range
    fake.targets = {"s2": [Range(0xC00000, 0xFFFFFF)]}             # a copy runs to s2
    assert SdhcpLoop._lane_ranges(fake) == [(0, 0x3FFFFF)]
    fake.pending = [(b"held request", 0)]                            # released from a hold, not served yet
    assert SdhcpLoop._lane_ranges(fake) == []
    fake.pending = []
    fake._authoritative = lambda: False                              # the lease lapsed or the map is stale
    assert SdhcpLoop._lane_ranges(fake) == []


def test_every_write_transaction_of_the_store_takes_the_lanes_lock(pair):
    """The Python store's writes and the lane's passes never interleave: begin/commit, rollback and _txn
    take and give back Store.writer_lock (the lane's mutex), also when a transaction fails."""
    import threading

    store = pair.b.store
    store.begin()
    store.rollback()
    with pytest.raises(ZeroDivisionError):
        store._txn(lambda db: 1 / 0)
    store.begin_copy()                       # a _txn that commits
    pair.lane.acquire()                      # the lane mid-pass: the Python store's next write waits for it
    done = threading.Event()

    def write() -> None:
        store.begin()
        store.commit()
        done.set()
    t = threading.Thread(target=write, daemon=True)
    t.start()
    try:
        assert not done.wait(0.3), "a write transaction began while the lane held the store"
    finally:
        pair.lane.release()
    assert done.wait(10)
    t.join(10)
    served = pair.lane.serve([frame(bytes([2, 0, 0, 0x10, 0, 9]), MessageType.DISCOVER)], pair.now)
    assert served[0] is not None             # and every lock taken above was given back


def test_the_lane_answers_arp_for_the_server_address_as_the_loop_does(pair):
    """server.py's _arp: the owner of the asking MAC's key answers from that key's VID; anything else is the
    loop's (which drops it or answers it the same way)."""
    mac = bytes([2, 0x5D, 0, 0x20, 0, 7])
    key = int.from_bytes(mac, "big") & KEY_MAX
    spa = IPv4Address("192.168.77.40").packed

    def request(sha: bytes, src: bytes, tpa: bytes, op: int = 1) -> bytes:
        return (b"\xff" * 6 + src + frames.ETH_P_ARP.to_bytes(2, "big") +
                frames.ARP.pack(1, ipudp.ETH_P_IP, 6, 4, op, sha, spa, b"\0" * 6, tpa)).ljust(60, b"\0")

    want = frames.arp_reply(pair.b.vid_mac(key), SERVER.packed, mac, spa)
    assert pair.lane.serve([request(mac, mac, SERVER.packed)], pair.now) == [want]
    assert frames.parse_arp_request(request(mac, mac, SERVER.packed)) == (mac, spa, SERVER.packed)
    for raw in (request(mac, mac, IPv4Address("192.168.77.2").packed),       # another address
                request(mac, bytes([2, 0, 0, 0, 0, 1]), SERVER.packed),      # speaking for another MAC
                request(mac, mac, SERVER.packed, op=2)):                     # a reply, not a request
        assert pair.lane.serve([raw], pair.now) == [None]
    pair.grant([(0, 0x1FFFFF)])                                              # its key no longer granted
    assert pair.lane.serve([request(mac, mac, SERVER.packed)], pair.now) == [None]
    assert pair.lane.counters()["arp_replies"] == 1


def test_calls_while_and_after_the_lane_closes_do_nothing(tmp_path):
    """The lease's keepalive moves the lane's deadline from its own thread; one that came back while the
    shard closed called into the freed lane and crashed the process (a fresh-clone run of the unit tests).
    Here threads keep calling through a close and after it, in a child process, so a crash fails the test;
    a call that waits for the store's mutex (held by a write transaction) lets the close wait, not hang."""
    code = f"""
import sys, threading, time
sys.path.insert(0, {os.getcwd()!r})
import pathlib
from tests.unit.test_sdhcp_lane import Pair, KEY_MAX
pair = Pair(pathlib.Path({str(tmp_path)!r}))
lane, stop = pair.lane, threading.Event()
inside = [0.0, 0.0, 0.0]             # when each hammer last went into extend (0: not in it)
def hammer(i):
    while not stop.is_set():
        inside[i] = time.monotonic()
        lane.extend(time.monotonic() + 60, 1)
        inside[i] = 0.0
        lane.watch({{1, 2}})
        lane.counters()
        lane.pop()
threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
lane.acquire()                       # a write transaction holds the mutex: extend waits for it
t0 = time.monotonic()                # on a loaded machine a hammer may take a while to get there
while not any(0 < t < time.monotonic() - 0.05 for t in inside) and time.monotonic() - t0 < 20:
    time.sleep(0.01)
closer = threading.Thread(target=lane.close)
closer.start()
time.sleep(0.2)
assert closer.is_alive(), "the lane was freed while a call was in it"
lane.release()
closer.join(10)
assert not closer.is_alive(), "the close hung"
time.sleep(0.2)                      # calls after the close
stop.set()
for t in threads:
    t.join(10)
assert lane.h is None and lane.extend(1.0, 1) is None and lane.counters() == {{}} and lane.pop() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-3000:])


def test_an_offer_whose_udp_checksum_computes_to_zero_says_none_on_both_paths(tmp_path):
    """The xid is chosen so that the OFFER's UDP checksum computes to 0: the lane sends 0 ("none") as the
    Python side does (ipudp says why not RFC 768's 0xFFFF), byte for byte."""
    mac = bytes([2, 0x5D, 0, 0, 0, 9])
    probe = Pair(tmp_path / "probe")   # a fresh store offers the same address to the same client
    try:
        offer = probe.send(frame(mac, MessageType.DISCOVER, xid=0))
    finally:
        probe.close()
    xid = int.from_bytes(offer[40:42], "big")   # the checksum added to the sum (as the xid) makes it compute 0
    p = Pair(tmp_path / "real")
    try:
        got = p.send(frame(mac, MessageType.DISCOVER, xid=xid), "discover")   # lane and Python agree
        assert p.kinds["discover"] == [True], "the loop served it, not the lane"
        assert got[40:42] == b"\0\0" and ipudp.parse(got).payload[4:8] == xid.to_bytes(4, "big")
    finally:
        p.close()
