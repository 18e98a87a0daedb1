"""Send raw Ethernet frames from inside a host (for port-security and parser tests).

``python -m vfab.testbed.sendraw --iface IF --src MAC --dst MAC --count N [--garbage]``
"""

from __future__ import annotations

import argparse
import os
import random
import socket

from vfab.vid import codec, frame


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="sendraw")
    ap.add_argument("--iface", required=True)
    ap.add_argument("--src", required=True, help="source MAC (may be forged)")
    ap.add_argument("--dst", required=True, help="destination MAC or VID")
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--garbage", action="store_true", help="send malformed vfab frames instead")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    src, dst = codec.mac_to_int(args.src).to_bytes(6, "big"), codec.mac_to_int(args.dst).to_bytes(6, "big")
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind((args.iface, 0))
    good = frame.Frame(dst=dst, src=src, type=frame.FrameType.REQUEST, payload=b'{"key": 0, "seq": 0}').serialize()
    for i in range(args.count):
        if args.garbage:
            data = bytearray(good)
            kind = i % 4
            if kind == 0:
                data = data[: rnd.randrange(14, frame.MIN_LEN)]          # truncated
            elif kind == 1:
                data[frame.ETH_LEN] = rnd.choice([0, 2, 7, 255])         # wrong version
            elif kind == 2:
                data[frame.ETH_LEN + 6: frame.ETH_LEN + 8] = (1400).to_bytes(2, "big")  # wrong length
            else:
                data[frame.ETH_LEN:] = os.urandom(len(data) - frame.ETH_LEN)
            data = bytes(data) + b"\0" * max(0, 14 - len(data))
        else:
            data = good
        sock.send(data)
    sock.close()


if __name__ == "__main__":
    main()
