"""Build a testbed, start an echo server in it, report what it made, then wait to be killed.

Run by tests/integration/test_testbed_kill.py as
``python -m tests.integration.hold_testbed --topo line,2,2 --ready FILE``: once
the fabric is up it writes FILE (JSON: its PID, the record path, every PID it
started, bridges, workdir) and sleeps with the signal handling a benchmark or
demo has (nothing of its own), so SIGTERM/SIGHUP/SIGKILL hit the testbed code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import wait_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topo", default="line,2,2")
    ap.add_argument("--ready", required=True)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tb = Testbed(args.topo, workdir=args.workdir, poll=1.0)
    tb.start()
    try:
        tb.registry.create_service("echo")
        out = os.path.join(tb.workdir, "server.out")
        server = tb.run_on("vfh1", "srv", ["-m", "vfab.services.echo", "server", "--etcd", tb.etcd_endpoint,
                                            "--service", "echo", "--name", "srv", "--iface",
                                            tb.hosts["vfh1"]["iface"], "--rx", "ovs", "--listen", "0-0xffffff"],
                           stdout=open(out, "wb"))
        wait_for(lambda: b"ready" in open(out, "rb").read() or not server.alive(), 30, "the echo server")
        state = {
            "pid": os.getpid(), "record": tb.record.path, "workdir": tb.workdir,
            "switches": sorted(tb.switches), "nodes": tb.spec.node_names(),
            "etcd": tb.etcd.pid, "controller": tb.controller.pid, "server": server.pid,
            "shells": {n.name: n.pid for n in (*tb.net.hosts, *tb.net.switches, *tb.net.controllers)},
        }
        with open(args.ready + ".tmp", "w") as fh:
            json.dump(state, fh)
        os.replace(args.ready + ".tmp", args.ready)
        while True:
            time.sleep(1)
    finally:
        tb.stop()


if __name__ == "__main__":
    main()
