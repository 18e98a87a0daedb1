"""The process behind ``vfab up``: holds a Testbed until SIGTERM (or SIGINT, SIGHUP), then tears it down.

It writes a state file (JSON) that ``vfab status/down/exec`` read: its own PID,
the etcd endpoint, the controller's PID and port, and each host's shell PID.
With ``--hosts N`` it holds a ``HostsTestbed`` instead (N emulated hosts, an etcd
member on each of the first 3, node agents): ``hosts`` then lists the ports one
can run programs in (each its own namespace) and ``nodes`` the hosts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

from vfab.testbed.fabric import Testbed
from vfab.testbed.hosts import HostsTestbed
from vfab.testbed.procs import unwind_on_signals


class _Stop(threading.Event):
    def wait_for_signal(self) -> None:
        """Take SIGTERM, SIGINT and SIGHUP as "stop" from now on, and wait for one."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.set())
        self.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vfab-fabric")
    ap.add_argument("--topo", default="line,2,3")
    ap.add_argument("--state-file", required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--etcd-members", type=int, default=None)
    ap.add_argument("--hosts", type=int, default=0)
    ap.add_argument("--ports", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = _Stop()
    # While starting (waiting for the testbed lock, building) a signal unwinds it: the finally below stops
    # what was started.  Once up, a signal only ends the wait: the teardown then runs to its end.
    unwind_on_signals()
    if args.hosts:
        hosts_main(args, stop)
        return
    tb = Testbed(args.topo, workdir=args.workdir, etcd_members=args.etcd_members or 1)
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
        serve(args.state_file, state, stop)
    finally:
        tear_down(tb, args.state_file)


def serve(path: str, state: dict, stop: _Stop) -> None:
    """The fabric is up: say so in the state file ('vfab status' and 'vfab down' read it), then wait."""
    write_state(path, state)
    stop.wait_for_signal()


def tear_down(tb, path: str) -> None:
    tb.stop()
    try:
        os.unlink(path)
    except OSError:
        pass


def write_state(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=1)
    os.replace(tmp, path)
    logging.info("fabric up: %s", path)


def hosts_state(tb: HostsTestbed) -> dict:
    """What ``vfab`` reads of a multi-host testbed: the ports as ``hosts`` (where programs run), the hosts as
    ``nodes``."""
    return {
        "pid": os.getpid(), "kind": "hosts", "etcd": tb.etcd_endpoint(), "workdir": tb.workdir,
        "etcd_members": {m.name: {"pid": m.pid, "endpoint": m.endpoint, "via": m.reach, "log": str(m.log_path),
                                  "host": next(h.name for h in tb.hosts.values() if h.member is m)}
                         for m in tb.etcd.members},
        "controller": None,
        "switches": {h.name: h.dpid for h in tb.hosts.values()},
        "nodes": {h.name: {"netns": h.ns_path, "tunnel_ip": h.tunnel_ip, "control_ip": h.ctl_ip,
                           "etcd": tb.etcd_endpoint(h.name), "ovs_rundir": h.rundir,
                           "agent": h.agent.pid if h.agent else None} for h in tb.hosts.values()},
        "hosts": {port: {"netns": tb.port_ns(port), "iface": "eth0", "mac": info["mac"], "node": h.name}
                  for h in tb.hosts.values() for port, info in h.ports.items()},
    }


def hosts_main(args, stop: _Stop) -> None:
    tb = HostsTestbed(args.hosts, workdir=args.workdir, etcd_members=args.etcd_members, ttl=5)
    try:
        tb.start()
        for h in tb.hosts:
            for _ in range(args.ports):
                tb.add_port(h)
        serve(args.state_file, hosts_state(tb), stop)
    finally:
        tear_down(tb, args.state_file)


if __name__ == "__main__":
    main()
