"""The process behind ``vfab up``: holds a Testbed until SIGTERM (or SIGINT, SIGHUP), then tears it down.

It writes a state file (JSON) that ``vfab status/down/exec`` read: its own PID,
the etcd endpoint, the controller's PID and port, and each host's shell PID.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

from vfab.testbed.fabric import Testbed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vfab-fabric")
    ap.add_argument("--topo", default="line,2,3")
    ap.add_argument("--state-file", required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--etcd-members", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: stop.set())
    tb = Testbed(args.topo, workdir=args.workdir, etcd_members=args.etcd_members)
    try:
        tb.start()
        state = {
            "pid": os.getpid(), "topo": args.topo, "etcd": tb.etcd_endpoint, "workdir": tb.workdir,
            "etcd_members": {m.name: {"pid": m.pid, "endpoint": m.endpoint, "log": str(m.log_path)}
                             for m in tb.etcd.members} if tb.etcd else {},
            "controller": {"pid": tb.controller.pid, "port": tb.ctl_port, "log": tb.controller.logpath},
            "switches": tb.switches,
            "hosts": {n: dict(h, pid=tb.host(n).pid) for n, h in tb.hosts.items()},
        }
        tmp = args.state_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(state, fh, indent=1)
        os.replace(tmp, args.state_file)
        logging.info("fabric up: %s", args.state_file)
        stop.wait()
    finally:
        tb.stop()
        try:
            os.unlink(args.state_file)
        except OSError:
            pass


if __name__ == "__main__":
    main()
