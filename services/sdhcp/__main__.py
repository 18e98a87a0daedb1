"""``python -m vfab.services.sdhcp server ...``: run one shard of an sdhcp service."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vfab.services.sdhcp import server
from vfab.vid.errors import VfabError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.sdhcp",
                                description="sdhcp: an elastic DHCPv4 service on vfab, sharded by client MAC")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    server.add_arguments(sub.add_parser("server", help="serve DHCP for the key ranges this shard owns",
                                        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(name)s[{os.getpid()}] %(levelname)s %(message)s")
    try:
        return server.run(args)
    except VfabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
