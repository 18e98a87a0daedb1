"""The vfab CLI against a real etcd: output, clear errors, exit codes (2 = bad input, 1 = failure)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from vfab.cli.main import cli
from vfab.vid.registry import schema
from vfab.vid.ranges import Range


@pytest.fixture
def run(registry):
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(cli, ["--etcd", registry.endpoint, *args])

    return invoke


@pytest.fixture
def echo(registry):
    registry.create_service("echo")
    for name, mac in (("s1", "00:00:00:00:00:01"), ("s2", "00:00:00:00:00:02")):
        registry.announce(schema.Endpoint(service="echo", name=name, mac=mac), ttl=30)
    registry.assign("echo", Range(0, 0x7FFFFF), "s1")
    return registry


@pytest.mark.parametrize("args, needle", [
    (["route", "echo", "5-1", "--to", "s1"], "lo must be <= hi"),
    (["route", "echo", "0-0x1000000", "--to", "s1"], "out of bounds"),
    (["route", "echo", "zz", "--to", "s1"], "not a number"),
    (["route", "Echo!", "0-1", "--to", "s1"], "invalid"),
    (["route", "echo", "0-1"], "Missing option '--to'"),
    (["resolve", "echo", "-3"], "No such option"),
    (["resolve", "echo", "0x1000000"], "out of range"),
    (["up", "--topo", "ring,3"], "not supported"),
    (["service", "add", "x", "--layout", "middle"], "middle"),
    (["nosuchcommand"], "No such command"),
])
def test_bad_input_is_exit_2_with_a_clear_message(run, echo, args, needle):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_route_to_a_dead_endpoint_is_rejected(run, echo):
    res = run("route", "echo", "0-100", "--to", "s9", "--no-wait")
    assert res.exit_code == 2 and "not live" in res.output and "s1, s2" in res.output


def test_unknown_service_is_exit_1(run, echo):
    res = run("ranges", "nosuch")
    assert res.exit_code == 1 and "does not exist" in res.output and "echo" in res.output


def test_unreachable_etcd_is_exit_1():
    res = CliRunner().invoke(cli, ["--etcd", "127.0.0.1:1", "services"])
    assert res.exit_code == 1 and "unreachable" in res.output and "Traceback" not in res.output


def test_route_with_a_stale_epoch_loses(run, echo):
    epoch = echo.ranges("echo")[0][0].epoch
    assert run("route", "echo", "0-0xff", "--to", "s2", "--epoch", str(epoch), "--no-wait").exit_code == 0
    res = run("route", "echo", "0-0xff", "--to", "s1", "--epoch", str(epoch), "--no-wait")
    assert res.exit_code == 1 and "not " + str(epoch) in res.output and "retry" in res.output
    assert echo.owner_of("echo", 0x10).owner == "s2"


def test_listing_commands(run, echo):
    res = run("services")
    assert res.exit_code == 0 and "echo" in res.output and "s1, s2" in res.output
    res = run("ranges", "echo")
    assert res.exit_code == 0 and "0x7fffff" in res.output and "s1" in res.output
    res = run("resolve", "echo", "0x10")
    assert res.exit_code == 0 and "0e:00:01:00:00:10" in res.output and "s1 (00:00:00:00:00:01)" in res.output
    res = run("route", "echo", "0x800000-0xffffff", "--to", "s2", "--no-wait")
    assert res.exit_code == 0, res.output
    assert echo.owner_of("echo", 0x900000).owner == "s2"
    res = run("flows")
    assert res.exit_code == 0  # no switches registered: prints nothing, fails nothing


@pytest.fixture
def stateful(registry):
    registry.create_service("kv")
    for name, mac in (("a", "00:00:00:00:00:0a"), ("b", "00:00:00:00:00:0b"), ("m", "00:00:00:00:00:0c")):
        registry.announce(schema.Endpoint(service="kv", name=name, mac=mac, ctl=f"tcp://127.0.0.1:{9000 + ord(name)}"),
                          ttl=30)
    registry.assign("kv", Range(0, 0xFFFFFF), "a", mirrors=["m"])
    return registry


def test_route_refuses_to_move_a_stateful_range_without_force(run, stateful):
    res = run("route", "kv", "0-0xff", "--to", "b", "--no-wait")
    assert res.exit_code == 2, res.output
    assert "stateful" in res.output and "vfab split kv" in res.output and "--force" in res.output
    assert [r.owner for r, _ in stateful.ranges("kv")] == ["a"]


def test_forced_route_keeps_the_mirrors(run, stateful):
    res = run("route", "kv", "0-0xff", "--to", "b", "--no-wait", "--force")
    assert res.exit_code == 0, res.output
    assert "kept mirrors m" in res.output and "no state moved" in res.output
    recs = [(r.range, r.owner, r.mirrors) for r, _ in stateful.ranges("kv")]
    assert recs == [(Range(0, 0xFF), "b", ["m"]), (Range(0x100, 0xFFFFFF), "a", ["m"])]


def test_hosts_lists_each_hosts_source_guard_and_host_set_changes_it(run, registry):
    """'vfab hosts' shows where each MAC attaches and what it may send from (registered addresses, or a DHCP
    host's live lease); 'vfab host set' changes it (checked, compare-and-swap) and says what it set."""
    import json
    import time

    a, b = "02:5d:00:20:00:01", "02:5d:00:20:00:02"
    registry.put_host(schema.Host(mac=a, dpid=1, port=3, name="vfh3", ips=["10.0.0.3"]))
    registry.put_host(schema.Host(mac=b, dpid=2, port=4, name="vfh4", dhcp=True))
    registry.put(schema.binding_key(b), schema.Binding(mac=b, ip="192.168.77.40", until=time.time() + 300,
                                                       service="dh", shard="s1").to_json())
    res = run("hosts")
    assert res.exit_code == 0, res.output
    row_a = next(ln for ln in res.output.splitlines() if a in ln)
    row_b = next(ln for ln in res.output.splitlines() if b in ln)
    assert "addresses" in row_a and "10.0.0.3" in row_a, res.output
    assert "dhcp" in row_b and "192.168.77.40 (lease from dh/s1" in row_b, res.output
    res = run("host", "set", a, "--ip", "10.0.0.7", "--ip", "10.0.0.8", "--no-wait")
    assert res.exit_code == 0 and "source guard addresses; addresses 10.0.0.7, 10.0.0.8" in res.output, res.output
    res = run("host", "set", a.upper(), "--dhcp", "--no-ips", "--no-wait")
    assert res.exit_code == 0 and "source guard dhcp; addresses - + its DHCP lease" in res.output, res.output
    got = {h["mac"]: h for h in json.loads(run("hosts", "--json").output)}
    assert (got[a]["guard"], got[a]["ips"], got[a]["binding"]) == ("dhcp", [], None)
    assert got[b]["binding"]["ip"] == "192.168.77.40"
    for args, needle in ((("host", "set", a, "--ip", "10.0.0.300"), "'10.0.0.300' in 'ips' is not an IPv4"),
                         (("host", "set", a), "nothing to change"),
                         (("host", "set", a, "--ip", "10.0.0.1", "--no-ips"), "contradict"),
                         (("host", "set", "02:5d:zz", "--dhcp"), "is not a MAC address")):
        res = run(*args)
        assert res.exit_code == 2 and needle in res.output, (args, res.output)
    res = run("host", "set", "02:5d:00:99:99:99", "--dhcp")
    assert res.exit_code == 1 and "is not a registered host" in res.output, res.output


@pytest.mark.parametrize("args, needle", [
    (["up", "--hosts", "0"], "0 hosts: the multi-host testbed builds 1 to 16 hosts"),
    (["up", "--hosts", "17"], "17 hosts: the multi-host testbed builds 1 to 16 hosts"),
    (["up", "--hosts", "x"], "'x' is not a valid integer"),
    (["up", "--hosts", "4", "--etcd-members", "2"], "an etcd cluster of 2 members: give 1, 3 or 5"),
    (["up", "--hosts", "2", "--etcd-members", "3"], "3 etcd members on 2 hosts: one member per host"),
    (["up", "--hosts", "3", "--topo", "single,2"], "give one of them"),
    (["up", "--hosts", "3", "--ports", "9"], "--ports"),
    (["up", "--etcd-members", "2"], "use 1, 3 or 5"),
])
def test_up_refuses_a_bad_fabric_size_before_starting_anything(args, needle):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_member_count_of_a_hosts_testbed():
    from vfab.testbed.hosts import check_size

    assert [check_size(n, None) for n in (1, 2, 3, 4, 16)] == [1, 1, 3, 3, 3]   # one member per host, 3 by default
    assert check_size(5, 5) == 5 and check_size(3, 1) == 1
