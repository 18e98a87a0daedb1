"""vid-lib transport: BPF programs, the three receive backends on a real veth pair, fuzzing,
and the echo service end to end (etcd + server + client in a private network namespace).

The veth tests need root; every namespace they make is named ``vfx<random>`` and deleted
in teardown (the veth pair lives inside it and goes with it).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vfab.vid import bpf, codec
from vfab.vid.errors import FrameError, TransportError
from vfab.vid.frame import ETH_TYPE, MIN_LEN, Frame, FrameType, parse
from vfab.vid.ranges import Range, to_masks
from vfab.vid.transport import RawPort

from tests.unit.conftest import ROOT, Netns  # noqa: F401 - Netns for type hints; `ns` is the fixture

PY = sys.executable
needs_root = pytest.mark.skipif(not ROOT, reason="needs root and iproute2 (veth in a private netns)")

SERVICE = 5
OTHER_MAC = bytes.fromhex("020000bbbbbb")


# ----------------------------------------------------------------------------- helpers


def blocks_for(lo: int, hi: int, service: int = SERVICE) -> list[tuple[int, int]]:
    return [codec.block_match(service, v, m) for v, m in to_masks(Range(lo, hi))]


def vid(key: int, service: int = SERVICE) -> bytes:
    return codec.encode(service, key).packed


def frame(dst: bytes, src: bytes, seq: int = 0, payload: bytes = b"x") -> bytes:
    return Frame(dst=dst, src=src, type=FrameType.REQUEST, payload=payload, seq=seq).serialize()


def run_bpf(prog: list[bpf.Insn], pkt: bytes, pkttype: int = 0) -> int:
    """A small classic-BPF interpreter (the subset libpcap emits for our expressions)."""
    a = x = 0
    mem = [0] * 16
    pc = 0

    def load(k: int, size: int) -> int | None:
        if size == 4 and k == (bpf.SKF_AD_OFF + bpf.SKF_AD_PKTTYPE) & 0xFFFFFFFF:
            return pkttype
        if k + size > len(pkt):
            return None
        return int.from_bytes(pkt[k:k + size], "big")

    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x00:  # LD
            mode, size = code & 0xE0, {0x00: 4, 0x08: 2, 0x10: 1}[code & 0x18]
            if mode == 0x00:  # IMM
                a = k
            elif mode == 0x20:  # ABS
                v = load(k, size)
                if v is None:
                    return 0
                a = v
            elif mode == 0x40:  # IND
                v = load(x + k, size)
                if v is None:
                    return 0
                a = v
            elif mode == 0x60:
                a = mem[k]
            else:
                raise AssertionError(f"unsupported LD {code:#x}")
        elif cls == 0x01:  # LDX
            x = k if code & 0xE0 == 0x00 else mem[k] if code & 0xE0 == 0x60 else None
            if x is None:
                raise AssertionError(f"unsupported LDX {code:#x}")
        elif cls == 0x02:
            mem[k] = a
        elif cls == 0x03:
            mem[k] = x
        elif cls == 0x04:  # ALU
            src = x if code & 0x08 else k
            op = code & 0xF0
            ops = {0x00: lambda: a + src, 0x10: lambda: a - src, 0x20: lambda: a * src,
                   0x40: lambda: a | src, 0x50: lambda: a & src, 0x60: lambda: a << (src & 31),
                   0x70: lambda: a >> (src & 31), 0xA0: lambda: a ^ src}
            a = ops[op]() & 0xFFFFFFFF
        elif cls == 0x05:  # JMP
            src = x if code & 0x08 else k
            op = code & 0xF0
            if op == 0x00:
                pc += k
                continue
            cond = {0x10: a == src, 0x20: a > src, 0x30: a >= src, 0x40: bool(a & src)}[op]
            pc += jt if cond else jf
        elif cls == 0x06:  # RET
            return a if code & 0x18 == 0x10 else k
        elif cls == 0x07:
            if code == 0x07:
                x = a
            else:
                a = x
        else:
            raise AssertionError(f"unsupported instruction {code:#x}")


# ----------------------------------------------------------------------------- BPF programs


def test_vid_filter_semantics_match_blocks() -> None:
    rnd = random.Random(1)
    own = bytes.fromhex("02aabbccddee")
    ranges = [Range(0, 99), Range(1000, 1999), Range(0x7FFF00, 0x800100)]
    blocks = [b for r in ranges for b in blocks_for(r.lo, r.hi)] + blocks_for(0, 0xFFFFFF, service=9)
    prog = bpf.vid_filter(blocks, own_mac=own)
    assert 0 < len(prog) <= bpf.BPF_MAXINSNS
    cases = [vid(k) for k in (0, 99, 100, 999, 1000, 1999, 2000, 0x7FFEFF, 0x7FFF00, 0x800100, 0x800101)]
    cases += [vid(rnd.randrange(1 << 24)) for _ in range(300)]
    cases += [vid(rnd.randrange(1 << 24), service=rnd.choice([4, 6, 9, 0x105])) for _ in range(300)]
    cases += [codec.encode(SERVICE, rnd.randrange(1 << 24), cls=codec.VidClass.HELPER).packed for _ in range(50)]
    cases += [own, OTHER_MAC, b"\xff" * 6] + [rnd.randbytes(6) for _ in range(200)]
    for dst in cases:
        value = int.from_bytes(dst, "big")
        want = dst == own or any(value & m == v for v, m in blocks)
        for eth_type in (ETH_TYPE, 0x0800):
            pkt = dst + own + eth_type.to_bytes(2, "big") + bytes(20)
            got = run_bpf(prog, pkt) > 0
            assert got == (want and eth_type == ETH_TYPE), (dst.hex(), hex(eth_type))


def test_vid_filter_edge_cases() -> None:
    assert run_bpf(bpf.vid_filter([]), vid(1) + bytes(6) + b"\x88\xb5" + bytes(20)) == 0
    everything = bpf.vid_filter([(0, 0)])
    assert run_bpf(everything, OTHER_MAC + bytes(6) + b"\x88\xb5" + bytes(20)) > 0
    assert run_bpf(everything, OTHER_MAC + bytes(6) + b"\x08\x00" + bytes(20)) == 0
    # Contained and duplicate blocks collapse.
    assert bpf.normalize_blocks(blocks_for(0, 255) + blocks_for(16, 31) + blocks_for(0, 255)) == blocks_for(0, 255)
    with pytest.raises(codec.VidError, match="out of range"):
        bpf.normalize_blocks([(1 << 48, 0)])


def test_host_only_filter_semantics() -> None:
    prog = bpf.host_only_filter()
    pkt = OTHER_MAC + bytes(6) + b"\x88\xb5" + bytes(20)
    assert run_bpf(prog, pkt, pkttype=0) > 0  # PACKET_HOST
    for pkttype in (1, 2, 3, 4):  # broadcast, multicast, other host, outgoing
        assert run_bpf(prog, pkt, pkttype=pkttype) == 0
    assert run_bpf(prog, OTHER_MAC + bytes(6) + b"\x08\x00" + bytes(20), pkttype=0) == 0


def test_missing_libpcap_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpf, "_pcap", None)
    monkeypatch.setattr(bpf, "PCAP_SONAMES", ("libpcap-does-not-exist.so.9",))
    monkeypatch.setattr(bpf.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(TransportError, match="apt-get install libpcap0.8"):
        bpf.vid_filter(blocks_for(0, 9))


def test_bad_rx_mode_and_iface_name() -> None:
    with pytest.raises(TransportError, match="unknown"):
        RawPort("lo", rx="magic")
    with pytest.raises(TransportError, match="invalid"):
        RawPort("x" * 20)


# ----------------------------------------------------------------------------- veth fixture

def drain(port: RawPort, timeout: float = 0.2) -> list[Frame]:
    out = []
    while (f := port.recv(timeout)) is not None:
        out.append(f)
    return out


# ----------------------------------------------------------------------------- backends


@needs_root
def test_port_reads_mac_and_errors(ns: Netns) -> None:
    shown = subprocess.run(["ip", "netns", "exec", ns.name, "cat", f"/sys/class/net/{ns.a}/address"],
                           capture_output=True, text=True, check=True).stdout.strip()
    with ns.port(ns.a) as pa:
        assert pa.mac_str == shown
    with pytest.raises(TransportError, match="no such interface"):
        ns.port("vfxnosuchdev0")
    ns.sh("ip", "link", "set", ns.b, "down")
    with pytest.raises(TransportError, match="is down"):
        ns.port(ns.b)


@needs_root
def test_ovs_mode_receives_only_own_mac(ns: Netns) -> None:
    with ns.port(ns.a) as tx, ns.port(ns.b, "ovs") as rx:
        tx.send(frame(vid(7), tx.mac, seq=1))
        tx.send(frame(OTHER_MAC, tx.mac, seq=2))
        tx.send(frame(b"\xff" * 6, tx.mac, seq=3))
        tx.send(frame(rx.mac, tx.mac, seq=4))
        got = rx.recv(2.0)
        assert got is not None and got.seq == 4 and got.dst == rx.mac
        assert drain(rx) == []
        assert rx.counters["rx"] == 1 and rx.counters["filtered"] == 0 and rx.counters["bad_frames"] == 0
        assert tx.counters["tx"] == 4


@needs_root
def test_bpf_mode_kernel_filters_and_refilters(ns: Netns) -> None:
    with ns.port(ns.a) as tx, ns.port(ns.b, "bpf", blocks=blocks_for(0, 99)) as rx:
        for seq, dst in enumerate([vid(150), vid(100), vid(50, service=6), OTHER_MAC, vid(50), rx.mac], 1):
            tx.send(frame(dst, tx.mac, seq=seq))
        got = [f.seq for f in drain(rx, 0.5)]
        assert got == [5, 6]
        # Dropped in the kernel, not in userspace.
        assert rx.counters["filtered"] == 0 and rx.counters["rx"] == 2

        rx.set_blocks(blocks_for(100, 199))
        for seq, dst in enumerate([vid(50), vid(99), vid(200), vid(150), vid(100)], 10):
            tx.send(frame(dst, tx.mac, seq=seq))
        got = [f.seq for f in drain(rx, 0.5)]
        assert got == [13, 14]
        assert rx.counters["filtered"] == 0

        rx.set_blocks([])
        tx.send(frame(vid(150), tx.mac, seq=20))
        tx.send(frame(rx.mac, tx.mac, seq=21))
        assert [f.seq for f in drain(rx, 0.5)] == [21]


@needs_root
def test_promisc_mode_filters_in_userspace(ns: Netns) -> None:
    with ns.port(ns.a) as tx, ns.port(ns.b, "promisc", blocks=blocks_for(0, 99)) as rx:
        dsts = [vid(150), vid(100), vid(50, service=6), OTHER_MAC, vid(50), rx.mac, vid(99)]
        for seq, dst in enumerate(dsts, 1):
            tx.send(frame(dst, tx.mac, seq=seq))
        got = [f.seq for f in drain(rx, 0.5)]
        assert got == [5, 6, 7]
        assert rx.counters["filtered"] == 4 and rx.counters["rx"] == 3


def fuzz_inputs(dst: bytes, src: bytes, n: int, seed: int) -> list[bytes]:
    """Deliverable (right dst and EtherType) but mostly malformed frames."""
    rnd = random.Random(seed)
    eth = dst + src + ETH_TYPE.to_bytes(2, "big")
    good = frame(dst, src, seq=1, payload=b"hello fuzz")
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # random body of random length
            body = rnd.randbytes(rnd.randrange(0, 80))
        elif kind == 1:  # a valid frame, truncated
            body = good[14:rnd.randrange(14, len(good))]
        elif kind == 2:  # a valid frame with a few header bytes flipped
            raw = bytearray(good[14:])
            for _ in range(rnd.randrange(1, 4)):
                raw[rnd.randrange(0, MIN_LEN - 14)] ^= 1 << rnd.randrange(8)
            body = bytes(raw)
        else:  # plausible header, wrong length field / type / version
            body = bytes([rnd.choice([0, 1, 2, 255]), rnd.randrange(0, 8), rnd.randrange(0, 256), 0])
            body += rnd.randbytes(4) + rnd.randbytes(8) + rnd.randbytes(rnd.randrange(0, 20))
        out.append(eth + body)
    return out


@needs_root
@pytest.mark.parametrize("rx_mode", ["ovs", "bpf", "promisc"])
def test_fuzz_bad_frames_are_counted_never_raised(ns: Netns, rx_mode: str) -> None:
    with ns.port(ns.a) as tx, ns.port(ns.b, rx_mode, blocks=blocks_for(0, 99)) as rx:
        inputs = fuzz_inputs(rx.mac, tx.mac, 2000, seed={"ovs": 1, "bpf": 2, "promisc": 3}[rx_mode])
        expect_bad = 0
        for data in inputs:
            try:
                parse(data)
            except FrameError:
                expect_bad += 1
        received = []
        for start in range(0, len(inputs), 200):  # stay well inside the socket buffer
            for data in inputs[start:start + 200]:
                assert tx.send(data)
            received += drain(rx, 0.3)
        assert 1500 < expect_bad < 2000
        assert rx.counters["bad_frames"] == expect_bad
        assert rx.counters["rx"] == len(received) == len(inputs) - expect_bad
        # The port is still healthy afterwards.
        tx.send(frame(rx.mac, tx.mac, seq=77))
        got = rx.recv(2.0)
        assert got is not None and got.seq == 77


# ----------------------------------------------------------------------------- echo, end to end


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_root
@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs the etcd binary")
@pytest.mark.parametrize("rx_mode", ["bpf", "promisc"])
def test_echo_service_end_to_end(ns: Netns, tmp_path: Path, rx_mode: str) -> None:
    """etcd, an echo server on b and the echo client on a, all inside the namespace (no OVS:
    the server receives the VIDs itself, so rx is bpf or promisc)."""
    port = _free_port()
    ep = f"127.0.0.1:{port}"
    netns = ["ip", "netns", "exec", ns.name]
    procs: list[subprocess.Popen] = []
    try:
        etcd = subprocess.Popen(
            netns + ["etcd", "--data-dir", str(tmp_path / "etcd"), "--name", "t",
                     "--listen-client-urls", f"http://{ep}", "--advertise-client-urls", f"http://{ep}",
                     "--listen-peer-urls", f"http://127.0.0.1:{_free_port()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(etcd)
        for _ in range(100):
            probe = subprocess.run(netns + [PY, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 0.2)"],
                                   capture_output=True)
            if probe.returncode == 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("etcd did not start")
        mod = ["-m", "vfab.services.echo"]
        server = subprocess.Popen(
            netns + [PY, *mod, "server", "--etcd", ep, "--service", "echo", "--name", "e1", "--iface", ns.b,
                     "--rx", rx_mode, "--create", "--listen", "0-999"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(server)
        line = server.stdout.readline()
        assert line.strip() == "ready", server.stderr.read()
        out = tmp_path / "client.json"
        client = subprocess.run(
            netns + [PY, *mod, "client", "--etcd", ep, "--service", "echo", "--iface", ns.a,
                     "--count", "300", "--keys", "0-1099", "--timeout", "0.2", "--grace", "0.3",
                     "--seed", "3", "--out", str(out)],
            capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert "echo client: sent 300" in client.stdout, client.stdout
        recs = json.loads(out.read_text())
        assert len(recs) == 300 and [r["seq"] for r in recs] == list(range(300))
        for r in recs:
            owned = r["key"] <= 999
            assert (r["reply_from"] == "e1") == owned, r
            assert r["lost"] == (not owned), r
            assert r["dup_count"] == 0 and not r["late"]
            if owned:
                assert r["replied"] >= r["sent"]
        server.terminate()
        assert server.wait(10) == 0
        assert "exiting" in server.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
