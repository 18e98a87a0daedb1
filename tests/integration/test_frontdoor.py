"""The dhcp4 front door on real OVS + os-ken + etcd in Mininet (``line,2,3``).

Service ``dh`` has a ``dhcp4`` front door and two owners: ``a`` on vfh1
(vfbs1, rx=ovs: the first switch rewrites to vfh1's MAC) owns the lower half of
the key space, ``b`` on vfh5 (vfbs2, rx=bpf: the VID arrives as is) the upper
half.  Clients vfh2, vfh3 (vfbs1) and vfh4, vfh6 (vfbs2) send DHCPDISCOVER-like
broadcasts (built by hand on raw sockets) from their own MAC and from extra
MACs registered on their ports, with keys in both halves.  A raw socket in
every host's namespace sees what arrives where.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import subprocess
import time

import pytest

from vfab.fabric.compiler import compile_fabric
from vfab.fabric.state import FabricState
from vfab.vid import codec
from vfab.vid.netns import netns
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

SVC = "dh"
HALF = codec.KEY_MAX // 2
CLIENTS = ("vfh2", "vfh3", "vfh4", "vfh6")
OWNERS = {"a": "vfh1", "b": "vfh5"}
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
BCAST = b"\xff" * 6


def _csum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def discover(src_mac: int, xid: int) -> bytes:
    """Ethernet broadcast / IPv4 0.0.0.0 → 255.255.255.255 / UDP 68 → 67 / BOOTREQUEST with DHCPDISCOVER."""
    chaddr = src_mac.to_bytes(6, "big")
    bootp = struct.pack("!BBBBIHH4s4s4s4s16s64s128s", 1, 1, 6, 0, xid, 0, 0x8000, bytes(4), bytes(4), bytes(4),
                        bytes(4), chaddr, b"", b"")
    bootp += bytes([99, 130, 83, 99, 53, 1, 1, 255])          # magic cookie, option 53 = DISCOVER, end
    udp = struct.pack("!HHHH", 68, 67, 8 + len(bootp), 0) + bootp   # UDP checksum 0: none (IPv4)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, bytes(4), b"\xff" * 4)
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return BCAST + chaddr + b"\x08\x00" + ip + udp


def xid_of(frame: bytes) -> int | None:
    """The BOOTP xid of a UDP/67 IPv4 frame, else None."""
    if len(frame) < 14 + 20 + 8 + 8 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    ihl = (frame[14] & 0xF) * 4
    if struct.unpack_from("!H", frame, 14 + ihl + 2)[0] != 67:
        return None
    return struct.unpack_from("!I", frame, 14 + ihl + 8 + 4)[0]


class Taps:
    """A raw socket on every host's interface (inside its namespace): what arrives where."""

    def __init__(self, tb):
        self.tb = tb
        self.socks = {}
        for host, info in tb.hosts.items():
            with netns(tb.netns(host)):
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((info["iface"], 0))
            s.setblocking(False)
            self.socks[host] = s

    def close(self) -> None:
        for s in self.socks.values():
            s.close()

    def drain(self) -> None:
        for s in self.socks.values():
            while True:
                try:
                    s.recv(65536)
                except BlockingIOError:
                    break

    def send(self, host: str, frame: bytes) -> None:
        s = self.socks[host]
        s.send(frame)

    def collect(self, want: set[int], timeout: float = 5.0, linger: float = 0.3) -> dict[int, list]:
        """xid → [(host, eth_dst)] for every copy of our frames seen arriving, until ``want`` all arrived."""
        seen: dict[int, list] = {}
        deadline = time.monotonic() + timeout
        quiet_until = None
        by_fd = {s.fileno(): (h, s) for h, s in self.socks.items()}
        while True:
            now = time.monotonic()
            if want <= set(seen) and quiet_until is None:
                quiet_until = now + linger   # a little longer: copies must not turn up elsewhere
            end = quiet_until if quiet_until is not None else deadline
            if now >= end:
                return seen
            ready, _, _ = select.select(list(by_fd), [], [], end - now)
            for fd in ready:
                host, s = by_fd[fd]
                while True:
                    try:
                        frame, addr = s.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if addr[2] == PACKET_OUTGOING:
                        continue
                    x = xid_of(frame)
                    if x is not None:
                        seen.setdefault(x, []).append((host, int.from_bytes(frame[:6], "big")))


@pytest.fixture(scope="module")
def door(testbed):
    reg = testbed.registry
    svc = reg.create_service(SVC)
    svc = schema.Service(name=SVC, id=svc.id, frontdoors=[{"kind": "dhcp4"}])
    reg.put(schema.service_key(SVC), svc.to_json())
    for name, host in OWNERS.items():
        ep = schema.Endpoint(service=SVC, name=name, mac=testbed.hosts[host]["mac"],
                             rx="ovs" if name == "a" else "bpf", host=host)
        reg.put(schema.endpoint_key(SVC, name), ep.to_json())
    reg.assign(SVC, Range(0, HALF), "a")
    reg.assign(SVC, Range(HALF + 1, codec.KEY_MAX), "b")
    # Each client port gets two more MACs (a port may carry several), one key in each half.
    rnd = random.Random(11)
    macs: dict[str, list[int]] = {}
    for host in CLIENTS:
        info = testbed.hosts[host]
        own = codec.mac_to_int(info["mac"])
        extra = [0x025A00000000 | rnd.randrange(1, HALF), 0x025A00000000 | rnd.randrange(HALF + 1, codec.KEY_MAX)]
        for mac in extra:
            reg.put_host(schema.Host(mac=codec.int_to_mac(mac), dpid=info["dpid"], port=info["port"], name=host))
        macs[host] = [own, *extra]
    testbed.wait_revision(reg.state_revision())
    taps = Taps(testbed)
    yield {"svc": svc, "macs": macs, "taps": taps, "since": time.monotonic()}
    taps.close()


def owner_of(tb, key: int) -> str:
    return next(rec.owner for rec, _ in tb.registry.ranges(SVC) if rec.lo <= key <= rec.hi)


def where_it_should_go(tb, svc, mac: int) -> tuple[str, int]:
    """(host, eth_dst) the owner of ``mac``'s key receives."""
    key = mac & codec.KEY_MAX
    owner = owner_of(tb, key)
    host = OWNERS[owner]
    if owner == "a":  # rx=ovs: rewritten to the owner's MAC (at the first switch)
        return host, codec.mac_to_int(tb.hosts[host]["mac"])
    return host, codec.encode(svc.id, key).value


def send_all(tb, door, xid0: int) -> dict[int, tuple[str, int]]:
    """Every client sends one DISCOVER from each of its MACs; xid → where it must arrive."""
    expect = {}
    taps = door["taps"]
    taps.drain()
    xid = xid0
    for host in CLIENTS:
        for mac in door["macs"][host]:
            taps.send(host, discover(mac, xid))
            expect[xid] = where_it_should_go(tb, door["svc"], mac)
            xid += 1
    return expect


def check_delivery(tb, door, xid0: int) -> set[str]:
    expect = send_all(tb, door, xid0)
    seen = door["taps"].collect(set(expect))
    wrong = {x: (seen.get(x), want) for x, want in expect.items() if seen.get(x) != [want]}
    assert not wrong, f"DISCOVERs not delivered once, to their key's owner only: {wrong}"
    return {host for host, _ in expect.values()}


def test_dhcp_reaches_the_owner_of_the_client_mac_key(testbed, door):
    assert check_delivery(testbed, door, 0x1000) == {"vfh1", "vfh5"}  # both owners, both switches
    # The front door is what OVS holds for every registered MAC of every host port of vfbs1 (3 hosts'
    # own MACs, 2 extra on each of vfh2 and vfh3): a move of the MAC's low 24 bits into the VID.
    flows = testbed.dump_flows("vfbs1")
    doors = [f for f in flows if "priority=400" in f]
    assert len(doors) == 7 and all("move:NXM_OF_ETH_SRC[0..23]->NXM_OF_ETH_DST[0..23]" in f for f in doors), doors


def test_forged_source_is_dropped(testbed, door):
    taps = door["taps"]
    taps.drain()
    victim = door["macs"]["vfh4"][1]          # registered on vfh4's port, sent from vfh3's
    taps.send("vfh3", discover(victim, 0x2000))
    taps.send("vfh3", discover(0x02DEADBEEF01, 0x2001))   # registered nowhere
    taps.send("vfh2", discover(door["macs"]["vfh2"][1], 0x2002))  # control: a legitimate one
    seen = taps.collect({0x2002}, timeout=5.0, linger=0.5)
    assert 0x2000 not in seen and 0x2001 not in seen, f"forged DISCOVERs arrived: {seen}"
    assert seen[0x2002] == [where_it_should_go(testbed, door["svc"], door["macs"]["vfh2"][1])]


def test_cutover_moves_the_front_door_traffic(testbed, door):
    rev = testbed.registry.assign(SVC, Range(0, codec.KEY_MAX), "b")
    testbed.wait_revision(rev)
    assert check_delivery(testbed, door, 0x3000) == {"vfh5"}
    rev = testbed.registry.assign(SVC, Range(0, HALF), "a")
    testbed.wait_revision(rev)
    assert check_delivery(testbed, door, 0x4000) == {"vfh1", "vfh5"}


def test_front_door_flows_do_not_churn_at_audits(testbed, door):
    """What the controller installed reads back equal from the switch: an audit finds nothing to repair."""
    def since_last_commit() -> dict[int, str]:
        with open(testbed.controller.logpath) as fh:
            text = fh.read()
        return {dpid: text[text.rfind(f"switch {dpid:016x}: revision"):] for dpid in testbed.switches.values()}

    deadline = time.monotonic() + 2 * 10 * testbed.poll + 5   # audits run every 10 counter polls
    while time.monotonic() < deadline:
        tails = since_last_commit()
        for dpid, tail in tails.items():
            assert f"switch {dpid:016x}: tables differ" not in tail, tail
        if all(f"switch {dpid:016x}: audit:" in tail for dpid, tail in tails.items()):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no clean audit of every switch after its last commit: {since_last_commit()}")
    with open(testbed.controller.logpath) as fh:
        text = fh.read()
    assert "Traceback" not in text and " ERROR " not in text, text[-2000:]
    # And each switch holds exactly the flows the compiler wants.
    _, items = testbed.registry.get_prefix(schema.ROOT)
    want = compile_fabric(FabricState.from_items({k: v for k, (v, _) in items.items()}))
    for name, dpid in testbed.switches.items():
        out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-aggregate", name], capture_output=True,
                             text=True, check=True).stdout
        assert f"flow_count={len(want[dpid].flows)}" in out, (name, out)
