"""vid-lib/schema.py: etcd key layout and typed JSON records."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vfab.vid.registry import schema
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import RegistryError, VidError

MAC = "02:00:00:00:00:01"

GOOD = {
    schema.Service: {"name": "echo", "id": 7, "layout": "suffix", "kind": "echo", "frontdoors": [{"kind": "dhcp4"}],
                     "opts": {"pool": "10.0.0.10-10.0.0.99"}},
    schema.Endpoint: {"service": "echo", "name": "e1", "mac": MAC, "rx": "bpf", "host": "h1", "ctl": "tcp://127.0.0.1:5555"},
    schema.RangeRec: {"lo": 0, "hi": 99, "owner": "e1", "mirrors": ["e2"], "helpers": ["e3"],
                      "epoch": 4, "state": "moving"},
    schema.Host: {"mac": MAC, "dpid": 1, "port": 3, "name": "h1", "ips": ["10.0.0.1", "10.0.0.7"], "dhcp": False},
    schema.Binding: {"mac": MAC, "ip": "10.0.0.9", "until": 1795600000.5, "service": "dhcp", "shard": "s1"},
    schema.Switch: {"dpid": 1, "name": "s1"},
    schema.Link: {"dpid": 1, "port": 10, "peer_dpid": 2, "peer_port": 11},
    schema.Applied: {"dpid": 1, "revision": 42, "flows": 17, "groups": 2, "at": 1.5, "committed": 1.25, "datapath": True},
    schema.Counters: {"at": 2.5, "counters": {"7/000000": [10, 640], "deny/3": [1, 64]}},
    schema.OpRec: {"op": "split", "source": "a", "peer": "b", "ranges": [[0, 9]], "phase": "done", "done": 3,
                   "total": 3, "started": 1.0, "updated": 2.0, "error": "", "timings": {"total_s": 0.1},
                   "id": "a.00ff", "notes": ["late COMMIT"]},
}

# (record type, field, bad value)
WRONG_TYPES = [
    (schema.Service, "id", "7"), (schema.Service, "id", True), (schema.Service, "name", 7),
    (schema.Service, "layout", 1), (schema.Service, "frontdoors", {"kind": "dhcp4"}), (schema.Service, "kind", 3),
    (schema.Counters, "counters", {"x": [1]}), (schema.Counters, "counters", {"x": [1, "2"]}),
    (schema.OpRec, "notes", "x"), (schema.OpRec, "id", 5),
    (schema.Service, "frontdoors", [{"port": 67}]), (schema.Service, "frontdoors", [{"kind": "udp", "x": 1.5}]),
    (schema.Endpoint, "mac", 12.5), (schema.Endpoint, "rx", ["ovs"]), (schema.Endpoint, "service", 5),
    (schema.Endpoint, "host", 7), (schema.Endpoint, "name", None), (schema.Endpoint, "ctl", 5),
    (schema.RangeRec, "lo", "0"), (schema.RangeRec, "hi", 99.0), (schema.RangeRec, "epoch", None),
    (schema.RangeRec, "epoch", False), (schema.RangeRec, "owner", 3),
    (schema.RangeRec, "mirrors", "e2"), (schema.RangeRec, "helpers", {"e3": 1}),
    (schema.RangeRec, "mirrors", [1]), (schema.RangeRec, "helpers", [None]),
    (schema.Host, "dpid", "1"), (schema.Host, "port", None), (schema.Host, "mac", 1.0),
    (schema.Host, "name", 3), (schema.Host, "ips", "10.0.0.1"), (schema.Host, "ips", ["10.0.0.256"]),
    (schema.Host, "dhcp", 1), (schema.Binding, "until", "1"), (schema.Binding, "ip", 167772161),
    (schema.Switch, "dpid", "0x1"), (schema.Switch, "name", None),
    (schema.Link, "dpid", "1"), (schema.Link, "port", None), (schema.Link, "peer_dpid", 2.0),
    (schema.Link, "peer_port", True),
    (schema.Applied, "revision", "42"), (schema.Applied, "flows", None), (schema.Applied, "at", "now"), (schema.Applied, "datapath", 1),
]


@pytest.mark.parametrize("rec_type", list(GOOD), ids=lambda t: t.__name__)
def test_json_round_trip(rec_type):
    rec = rec_type(**GOOD[rec_type])
    text = rec.to_json()
    assert json.loads(text) == GOOD[rec_type]
    back = rec_type.from_json(text, "/k")
    assert back == rec
    assert rec_type.from_json(text.encode()) == rec
    assert back.to_json() == text


@pytest.mark.parametrize("rec_type", list(GOOD), ids=lambda t: t.__name__)
def test_unknown_fields_rejected(rec_type):
    data = dict(GOOD[rec_type], colour="blue")
    with pytest.raises(RegistryError, match=r"at /x has unknown fields \['colour'\]: known fields are"):
        rec_type.from_json(json.dumps(data), "/x")


@pytest.mark.parametrize("rec_type", list(GOOD), ids=lambda t: t.__name__)
def test_missing_fields_rejected(rec_type):
    data = dict(GOOD[rec_type])
    data.pop(next(iter(data)))
    with pytest.raises(RegistryError, match="is invalid"):
        rec_type.from_json(json.dumps(data), "/x")


@pytest.mark.parametrize("rec_type, name, bad", WRONG_TYPES,
                         ids=[f"{t.__name__}.{n}={b!r}" for t, n, b in WRONG_TYPES])
def test_wrong_types_rejected(rec_type, name, bad):
    data = dict(GOOD[rec_type], **{name: bad})
    with pytest.raises(VidError):
        rec_type(**data)
    with pytest.raises(RegistryError, match=f"{rec_type.KIND} at /k is invalid"):
        rec_type.from_json(json.dumps(data), "/k")


@pytest.mark.parametrize("raw, what", [("{", "is not JSON"), ("[1, 2]", "is not a JSON object"),
                                       ("42", "is not a JSON object"), (b"\xff\xfe", "is not JSON")])
def test_not_json(raw, what):
    with pytest.raises(RegistryError, match=f"service at /svc {what}"):
        schema.Service.from_json(raw, "/svc")


@pytest.mark.parametrize("name", ["", "Echo", "-echo", "_x", "a b", "a/b", "x" * 64, "é"])
def test_bad_names(name):
    with pytest.raises(VidError, match="name .* is invalid: use 1-63 chars"):
        schema.check_name("service", name)
    with pytest.raises(VidError, match="invalid"):
        schema.Service(name=name, id=1)
    with pytest.raises(VidError, match="invalid"):
        schema.Endpoint(service="echo", name=name, mac=MAC)


@pytest.mark.parametrize("name", ["a", "0", "echo", "kv-1.shard_2", "x" * 63])
def test_good_names(name):
    assert schema.check_name("endpoint", name) == name


def test_bad_rx_mode():
    with pytest.raises(VidError, match="receive mode 'dpdk' is unknown: use one of ovs, bpf, promisc"):
        schema.Endpoint(service="echo", name="e1", mac=MAC, rx="dpdk")
    for rx in schema.RX_MODES:
        assert schema.Endpoint(service="echo", name="e1", mac=MAC, rx=rx).rx == rx


def test_service_options_are_names_and_strings_within_limits():
    svc = schema.Service(name="dh", id=3, kind="sdhcp", opts={"pool": "10.0.0.10-10.0.0.99", "t1": "30"})
    assert schema.Service.from_json(svc.to_json(), "/s").opts == {"pool": "10.0.0.10-10.0.0.99", "t1": "30"}
    assert schema.Service.from_json('{"name": "old", "id": 4}', "/s").opts == {}   # a record from before
    for bad in ({"Pool": "x"}, {"pool": 5}, {"": "x"}, {"p": "x" * (schema.OPT_LEN_MAX + 1)}):
        with pytest.raises(VidError, match="malformed: a name of a-z"):
            schema.Service(name="dh", id=3, opts=bad)
    with pytest.raises(VidError, match="has 33 options: the limit is 32"):
        schema.Service(name="dh", id=3, opts={f"o{i}": "" for i in range(33)})
    with pytest.raises(VidError, match="wrong type"):
        schema.Service(name="dh", id=3, opts=["pool"])


def test_value_checks():
    with pytest.raises(VidError, match="service id 0 is out of range: 1..65535"):
        schema.Service(name="echo", id=0)
    with pytest.raises(VidError, match="unknown VID layout"):
        schema.Service(name="echo", id=1, layout="middle")
    with pytest.raises(VidError, match="empty"):
        schema.RangeRec(lo=5, hi=4)
    with pytest.raises(VidError, match="out of bounds"):
        schema.RangeRec(lo=0, hi=KEY_MAX + 1)
    with pytest.raises(VidError, match="range state 'gone' is unknown"):
        schema.RangeRec(lo=0, hi=1, state="gone")
    with pytest.raises(VidError, match="malformed"):
        schema.Host(mac="nope", dpid=1, port=1)


def test_macs_are_normalised():
    assert schema.Endpoint(service="echo", name="e", mac="02-00-00-00-00-0A").mac == "02:00:00:00:00:0a"
    assert schema.Host(mac="2:0:0:0:0:a", dpid=1, port=1).mac == "02:00:00:00:00:0a"
    assert schema.host_key("02-00-00-00-00-0A") == "/vfab/v1/hosts/02:00:00:00:00:0a"


def test_range_rec_helpers():
    rec = schema.RangeRec(lo=3, hi=9)
    assert rec.range.size == 7 and rec.mirrors == [] and rec.state == "active"
    assert schema.RangeRec(lo=3, hi=9).mirrors is not rec.mirrors  # no shared default


@given(st.integers(0, KEY_MAX), st.data())
def test_range_rec_json_round_trip(lo, data):
    hi = data.draw(st.integers(lo, KEY_MAX))
    names = st.lists(st.sampled_from(["e1", "e-2", "kv.3_x", "0", "z" * 63]), max_size=3)
    rec = schema.RangeRec(lo=lo, hi=hi, owner=data.draw(st.sampled_from(["", "e1"])),
                          mirrors=data.draw(names), helpers=data.draw(names),
                          epoch=data.draw(st.integers(0, 1 << 40)),
                          state=data.draw(st.sampled_from(schema.RANGE_STATES)))
    assert schema.RangeRec.from_json(rec.to_json()) == rec


def test_keys():
    assert schema.service_key("echo") == "/vfab/v1/services/echo"
    assert schema.service_id_key(7) == "/vfab/v1/service-ids/7"
    assert schema.endpoint_key("echo", "e1") == "/vfab/v1/endpoints/echo/e1"
    assert schema.range_key("echo", 0xABC) == "/vfab/v1/ranges/echo/000abc"
    assert schema.switch_key(1) == "/vfab/v1/switches/0000000000000001"
    assert schema.link_key(1, 10) == "/vfab/v1/links/0000000000000001/10"
    assert schema.applied_key(255) == "/vfab/v1/applied/00000000000000ff"
    assert schema.counters_key(2).endswith("/counters/0000000000000002")
    # Range keys sort like their lo (the registry lists ranges in key order).
    los = [0, 9, 0x10, 0xA0, 0xFFFFFF]
    assert sorted(schema.range_key("s", lo) for lo in los) == [schema.range_key("s", lo) for lo in los]


def test_parse_key():
    assert schema.parse_key("/vfab/v1/ranges/echo/000000") == ("ranges", ["echo", "000000"])
    assert schema.parse_key("/vfab/v1/config/miss") == ("config", ["miss"])
    assert schema.parse_key("/other/v1/ranges") is None
    assert set(schema.RECORDS) == {"services", "endpoints", "ranges", "hosts", "bindings", "switches", "links",
                                   "applied"}


def test_folders_are_named_only_here():
    assert schema.folder("counters") == "/vfab/v1/counters/"
    with pytest.raises(VidError, match="unknown registry folder"):
        schema.folder("countres")
