"""testbed/routeagents.py without a testbed: the command line a host's route agent runs, and the bridge it
points (the hosts testbed's integration bridge, given as an attribute because testbed.hosts imports this
module)."""

from __future__ import annotations

from types import SimpleNamespace

from vfab.testbed.hosts import INT, HostsTestbed


def test_the_route_agents_bridge_is_the_hosts_testbeds_integration_bridge():
    assert HostsTestbed.int_bridge == INT


def test_a_route_agent_runs_in_its_hosts_namespace_with_its_node_name():
    tb = HostsTestbed.__new__(HostsTestbed)
    tb.hosts = {"host2": SimpleNamespace(ns="vfn2", name="host2", rundir="/tmp/x/host2/ovs",
                                         enter=lambda: ["ip", "netns", "exec", "vfn2"])}
    tb.etcd_endpoint = lambda host: f"172.16.46.2:2379,172.16.46.1:2379 ({host}'s own first)"
    cmd = tb.route_agent_command("host2", 6654, "--election-ttl", "2")
    assert cmd[:4] == ["ip", "netns", "exec", "vfn2"]
    assert cmd[cmd.index("--etcd") + 1].startswith("172.16.46.2:2379")
    assert cmd[cmd.index("--node") + 1] == "host2" and cmd[cmd.index("--port") + 1] == "6654"
    assert cmd[cmd.index("--ovs-rundir") + 1] == "/tmp/x/host2/ovs" and cmd[-2:] == ["--election-ttl", "2"]
