"""Round trip of a vfab frame through a Geneve tunnel between two emulated hosts, against the same round trip
between two ports of one host, side by side in one run.

``HostsTestbed(2)`` (each host: a namespace, its own ovs-vswitchd, netdev datapath; the node agents build
the tunnels).  Ports: host1 p1 (the client), host1 p2 and host2 p1 (reflectors that send each frame straight
back).  Flows put in by hand (what two-level routing compiles): VID L from p1 to host1 p2 and back; VID R
from p1 into the tunnel to host2, to host2 p1, and back through the tunnel.  The client alternates L and R
one frame at a time (so drift hits both alike) and times each round trip from its send to the echo's
arrival (``time.perf_counter`` around raw sockets; the reflectors are threads of this process).

Run: ``/opt/vfab-venv/bin/python bench/tunnel_rtt.py [--smoke] [--rounds N]`` (root).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import not_root, parser, summary, write  # noqa: E402

from vfab.testbed.hosts import INT, HostsTestbed  # noqa: E402
from vfab.vid import frame  # noqa: E402
from vfab.vid.netns import netns  # noqa: E402

VID_L = bytes.fromhex("0e0046000001")
VID_R = bytes.fromhex("0e0046000002")


def raw(port_ns: str, timeout: float | None = None) -> socket.socket:
    with netns(f"/var/run/netns/{port_ns}"):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(frame.ETH_TYPE))
    s.bind(("eth0", 0))
    s.settimeout(timeout)
    return s


def reflect(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            data, addr = sock.recvfrom(2048)
        except socket.timeout:
            continue
        except OSError:
            return
        if addr[2] != socket.PACKET_OUTGOING:   # a packet socket sees what it sends too
            sock.send(data)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000, help="round trips per path")
    args = ap.parse_args()
    if not_root("tunnel_rtt", "network namespaces, Open vSwitch"):
        return 1
    rounds = 30 if args.smoke else args.rounds
    tb = HostsTestbed(2)
    stop = threading.Event()
    socks: list[socket.socket] = []
    try:
        tb.start()
        c, l2, r1 = tb.add_port("host1"), tb.add_port("host1"), tb.add_port("host2")
        h1, h2 = tb.hosts["host1"], tb.hosts["host2"]
        pc, pl, pr = h1.ports[c]["ofport"], h1.ports[l2]["ofport"], h2.ports[r1]["ofport"]
        t12, t21 = tb.tunnel_port("host1", "host2"), tb.tunnel_port("host2", "host1")
        h1.ovs.ofctl("add-flows", INT, "-", stdin="\n".join([
            f"in_port={pc},dl_type=0x88b5,dl_dst={VID_L.hex(':')},actions=output:{pl}",
            f"in_port={pl},dl_type=0x88b5,actions=output:{pc}",
            f"in_port={pc},dl_type=0x88b5,dl_dst={VID_R.hex(':')},actions=output:{t12}",
            f"in_port={t12},dl_type=0x88b5,actions=output:{pc}"]) + "\n")
        h2.ovs.ofctl("add-flows", INT, "-", stdin="\n".join([
            f"in_port={t21},dl_type=0x88b5,actions=output:{pr}",
            f"in_port={pr},dl_type=0x88b5,actions=output:{t21}"]) + "\n")
        client = raw(c, timeout=1.0)
        socks += [client]
        for port in (l2, r1):
            s = raw(port)
            socks.append(s)
            threading.Thread(target=reflect, args=(s, stop), daemon=True).start()
        src = bytes.fromhex("02fb00010001")
        samples: dict[str, list[float]] = {"local": [], "tunnel": []}
        lost = {"local": 0, "tunnel": 0}
        for i in range(rounds + 5):    # the first 5 of each warm the datapath's caches: not counted
            for path, vid in (("local", VID_L), ("tunnel", VID_R)):
                data = frame.Frame(dst=vid, src=src, type=frame.FrameType.REQUEST,
                                   payload=struct.pack("!I", i) + b"x" * 60).serialize()
                t0 = time.perf_counter()
                client.send(data)
                while True:
                    try:
                        got, addr = client.recvfrom(2048)
                    except socket.timeout:
                        lost[path] += i >= 5
                        break
                    seq = slice(frame.MIN_LEN, frame.MIN_LEN + 4)
                    if addr[2] != socket.PACKET_OUTGOING and got[:6] == vid and got[seq] == data[seq]:
                        if i >= 5:
                            samples[path].append(time.perf_counter() - t0)
                        break
        res = {p: summary(v) for p, v in samples.items()}
        res["lost"] = lost
        if samples["local"] and samples["tunnel"]:
            res["tunnel_over_local"] = {
                "median": round(res["tunnel"]["median_ms"] / res["local"]["median_ms"], 2),
                "p99": round(res["tunnel"]["p99_ms"] / res["local"]["p99_ms"], 2)}
        write("tunnel_rtt", {"smoke": args.smoke, "rounds": rounds, "frame_bytes": len(data)}, res, args.out)
        return 0 if samples["tunnel"] and not lost["tunnel"] and not lost["local"] else 1
    finally:
        stop.set()
        for s in socks:
            s.close()
        tb.stop()


if __name__ == "__main__":
    sys.exit(main())
