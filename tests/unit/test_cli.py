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
