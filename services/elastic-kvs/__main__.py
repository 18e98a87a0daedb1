"""``python -m vfab.services.elastic_kvs {server,load,standard-server} ...``"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vfab.services.elastic_kvs import loadgen, server, standard
from vfab.vid.errors import VfabError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.elastic_kvs",
                                description="elastic-KVS: a persistent key-value store on vfab")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    server.add_arguments(sub.add_parser("server", help="serve key ranges from a durable store"))
    loadgen.add_arguments(sub.add_parser("load", help="closed-loop load from N clients, history recorded"))
    standard.add_arguments(sub.add_parser("standard-server", help="the select()-loop TCP baseline"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(name)s[{os.getpid()}] %(levelname)s %(message)s")
    runner = {"server": server.run, "load": loadgen.run, "standard-server": standard.run}[args.cmd]
    try:
        return runner(args)
    except VfabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
