"""``python -m vfab.services.echo {server,client} ...``"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vfab.services.echo import client, server
from vfab.vid.errors import VfabError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.echo",
                                description="echo service of vfab: a server and a load client")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    server.add_arguments(sub.add_parser("server", help="announce and answer requests"))
    client.add_arguments(sub.add_parser("client", help="send requests and record replies"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(name)s[{os.getpid()}] %(levelname)s %(message)s")
    try:
        return server.run(args) if args.cmd == "server" else client.run(args)
    except VfabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
