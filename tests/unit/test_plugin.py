"""The service plug-in contract: what a kind declares, how it reaches etcd and the CLI."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from vfab.cli.main import cli
from vfab.services.elastic_kvs import proto
from vfab.vid import plugin
from vfab.vid.errors import VidError
from vfab.vid.plugin import ServicePlugin


def test_builtin_kinds_declare_everything_in_one_place():
    kinds = plugin.load()
    assert {"echo", "elastic-kvs"} <= set(kinds)
    kvs = kinds["elastic-kvs"]
    assert kvs.stateful and not kinds["echo"].stateful
    assert kvs.resolve("wire") is proto
    payload = proto.Request(proto.Op.GET, 1, 2, b"user:1").serialize()
    assert kvs.resolve("key_of")(payload) == proto.vkey(b"user:1")
    assert kvs.resolve("cli").name == "kvs"
    assert callable(kvs.resolve("backend"))


def test_front_doors_are_filled_from_the_options():
    p = ServicePlugin(kind="memcached-t", summary="t", wire="vfab.services.elastic_kvs.proto",
                      frontdoors=({"kind": "udp", "ip": "{ip}", "port": "{port}", "key": "ip_src"},),
                      options={"ip": "service address", "port": "UDP port"})
    assert p.service_frontdoors({"ip": "10.0.0.100", "port": "11211"}) == [
        {"kind": "udp", "ip": "10.0.0.100", "port": 11211, "key": "ip_src"}]
    with pytest.raises(VidError, match="needs --opt port=... \\(UDP port\\)"):
        p.service_frontdoors({"ip": "10.0.0.100"})
    with pytest.raises(VidError, match="takes no option colour"):
        p.service_frontdoors({"ip": "1.2.3.4", "port": "1", "colour": "red"})


def test_unknown_kind_says_which_exist():
    with pytest.raises(VidError, match="unknown: one of .*elastic-kvs"):
        plugin.get("elastic-kv")


def test_service_add_records_the_kind(registry):
    runner = CliRunner()
    res = runner.invoke(cli, ["--etcd", registry.endpoint, "service", "add", "kv", "--kind", "elastic-kvs"])
    assert res.exit_code == 0, res.output
    assert "kind elastic-kvs" in res.output and registry.service("kv").kind == "elastic-kvs"
    res = runner.invoke(cli, ["--etcd", registry.endpoint, "service", "add", "kv2", "--kind", "nosuch"])
    assert res.exit_code == 2 and "unknown: one of" in res.output
    res = runner.invoke(cli, ["--etcd", registry.endpoint, "service", "add", "kv3", "--opt", "a=b"])
    assert res.exit_code == 2 and "options need a --kind" in res.output
    res = runner.invoke(cli, ["--etcd", registry.endpoint, "services"])
    assert res.exit_code == 0 and "elastic-kvs" in res.output
