"""Route agents in the multi-host testbed (issue 45's control plane per host): one os-ken route agent per host,
on that host's own switch (``python -m vfab.controller --node HOST``, controller/nodeplan.py).

A mixin of ``testbed.hosts.HostsTestbed`` (kept apart so the host faults and etcd members of that module and
the route agents here change separately).  Each agent runs inside its host's namespace exactly as on a real
machine; each host's loopback is its own, so every agent listens on the same port there.  Several agents of one
host (a restart overlapping the old one, or the fencing test) listen on different ports and the switch is
pointed at all of them.
"""

from __future__ import annotations

import sys

from vfab.testbed.procs import Proc

ROUTE_PORT = 6653


class RouteAgents:
    """``start_route_agent`` / ``kill_route_agent`` / ``restart_route_agent`` / ``route_agent`` per host."""

    hosts: dict
    sup: object
    etcd: object
    route_bridge = "vfint"   # testbed.hosts.INT (that module imports this one, so it is not imported here)

    def _agents(self, host: str) -> dict[int, Proc]:
        return self.__dict__.setdefault("_route_agents", {}).setdefault(host, {})

    def route_agent_command(self, host: str, port: int = ROUTE_PORT, *extra: str) -> list[str]:
        """``host``'s route agent as run inside its namespace (a real machine runs the same line)."""
        h = self.hosts[host]
        return ["ip", "netns", "exec", h.ns, sys.executable, "-m", "vfab.controller", "--etcd", self.etcd.endpoint,
                "--node", h.name, "--listen", "127.0.0.1", "--port", str(port), "--ovs-rundir", h.rundir, *extra]

    def _point_switch(self, host: str) -> None:
        targets = [f"tcp:127.0.0.1:{p}" for p in sorted(self._agents(host))]
        h = self.hosts[host]
        if targets:
            h.ovs.vsctl("set-controller", self.route_bridge, *targets)
        else:
            h.ovs.vsctl("del-controller", self.route_bridge)

    def start_route_agent(self, host: str, port: int = ROUTE_PORT, *extra: str) -> Proc:
        """Start ``host``'s route agent on ``port`` and point its switch at it (besides the agents already
        there)."""
        proc = self.sup.start(f"{host}-route-{port}", self.route_agent_command(host, port, *extra))
        self._agents(host)[port] = proc
        self.hosts[host].procs.append(proc)     # killed with the host (kill_host)
        self._point_switch(host)
        return proc

    def start_route_agents(self, *extra: str) -> None:
        for host in self.hosts:
            self.start_route_agent(host, ROUTE_PORT, *extra)

    def kill_route_agent(self, host: str, port: int = ROUTE_PORT) -> None:
        """SIGKILL ``host``'s route agent on ``port``: its switch keeps its flows (fail mode secure) and keeps
        trying to reach it."""
        proc = self._agents(host).get(port)
        if proc is not None:
            self.sup.kill9(proc)
            if proc in self.hosts[host].procs:
                self.hosts[host].procs.remove(proc)

    def restart_route_agent(self, host: str, port: int = ROUTE_PORT, *extra: str) -> Proc:
        self.kill_route_agent(host, port)
        return self.start_route_agent(host, port, *extra)

    def route_agent(self, host: str, port: int = ROUTE_PORT) -> Proc | None:
        return self._agents(host).get(port)
