"""vfab.vid.metrics and the processes' metrics: names by Prometheus' conventions, the exporter's registration in
a real etcd, the file_sd output, ``promtool check metrics`` on a real exposition, and the collectors' families
built from what the processes keep (controller counters, range states, the helper's histogram)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from vfab.cli.main import cli
from vfab.controller import ctlmetrics
from vfab.services.memcached_helper import helpermetrics
from vfab.vid import metrics
from vfab.vid.registry import schema
from vfab.vid.state import loopmetrics


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("name,kind,labels", [
    ("vfab_endpoint_requests_total", "counter", ["service", "endpoint"]),
    ("vfab_cutover_duration_seconds", "histogram", ["switch"]),
    ("vfab_helper_batch_keys", "histogram", []),
    ("vfab_switch_flows", "gauge", ["switch"]),
])
def test_good_names_pass(name, kind, labels):
    metrics.check_name(name, kind, labels)


@pytest.mark.parametrize("name,kind,labels,needle", [
    ("endpoint_requests_total", "counter", [], "vfab_"),
    ("vfab_requests", "counter", [], "_total"),
    ("vfab_flows_total", "gauge", [], "only counters"),
    ("vfab_cutover", "histogram", [], "unit"),
    ("vfab_cutover_ms", "gauge", [], "base units"),
    ("vfab_requests_total", "counter", ["key"], "bounded labels"),
    ("vfab_Requests_total", "counter", [], "snake_case"),
])
def test_bad_names_are_refused(name, kind, labels, needle):
    with pytest.raises(ValueError, match=needle):
        metrics.check_name(name, kind, labels)


def _families(collector) -> list:
    reg = CollectorRegistry()
    reg.register(collector)
    return list(reg.collect())


def fake_controller():
    svc = schema.Service(name="kvs", id=7)
    items = {schema.service_key("kvs"): svc.to_json().encode(),
             schema.endpoint_key("kvs", "a"): b"{}", schema.endpoint_key("kvs", "m"): b"{}",
             schema.range_key("kvs", 0): schema.RangeRec(lo=0, hi=9, owner="a").to_json().encode(),
             schema.range_key("kvs", 10): schema.RangeRec(lo=10, hi=19, owner="gone", mirrors=["m"]).to_json().encode(),
             schema.range_key("kvs", 20): schema.RangeRec(lo=20, hi=29, owner="gone").to_json().encode(),
             schema.range_key("kvs", 30): schema.RangeRec(lo=30, hi=0xFFFFFF, state="unassigned").to_json().encode()}
    reporter = SimpleNamespace(last={1: {"7/000000": [5, 500], "7/00000a": [1, 64], "deny/3": [2, 120],
                                         "guard/7": [4, 200]}}, reported={1: 40, 2: 38})
    return SimpleNamespace(items=items, reporter=reporter, installed={1: ({"f1": 1, "f2": 2}, {}), 2: ({}, {5: 1})},
                           conns={1: None, 2: None}, state_revision=40)


def test_controller_collector_families_and_values():
    fams = {f.name: f for f in _families(ctlmetrics.ControllerCollector(fake_controller()))}
    for f in fams.values():
        metrics.check_name(f.name + ("_total" if f.type == "counter" else ""), f.type,
                           sorted({k for s in f.samples for k in s.labels}))
    pk = {(s.labels["service"], s.labels["range"]): s.value for s in fams["vfab_range_packets"].samples
          if s.name.endswith("_total")}
    assert pk == {("kvs", "000000"): 5, ("kvs", "00000a"): 1}
    drops = {s.labels["reason"]: s.value for s in fams["vfab_switch_dropped_packets"].samples
             if s.name.endswith("_total")}
    assert drops == {"deny": 2, "vid_miss": 0, "guard": 4, "spoofed": 0}
    flows = {s.labels["switch"]: s.value for s in fams["vfab_switch_flows"].samples}
    assert flows == {"0000000000000001": 2, "0000000000000002": 0}
    states = {s.labels["state"]: s.value for s in fams["vfab_service_ranges"].samples}
    assert states == {"served": 1, "owner_down": 1, "lost": 1, "unassigned": 1}
    assert fams["vfab_controller_state_revision"].samples[0].value == 40
    applied = {s.labels["switch"]: s.value for s in fams["vfab_switch_applied_revision"].samples}
    assert applied == {"0000000000000001": 40, "0000000000000002": 38}


def test_helper_histogram_buckets_are_cumulative_with_the_c_programs_bounds():
    stats = {"hist_keys_1": 3, "hist_keys_2": 0, "hist_keys_4": 5, "hist_keys_8": 1, "hist_keys_256": 2,
             "b_keys": 700, "b_cmds": 11, "batch_S_bytes": 1400, "batch_T_ns": 20000, "rx_dgrams": 99}
    assert helpermetrics.batch_histogram(stats) == [("1", 3), ("3", 3), ("7", 8), ("15", 9), ("+Inf", 11)]
    fams = {f.name: f for f in helpermetrics.families("mc", "h1", stats, serving=True)}
    assert fams["vfab_helper_up"].samples[0].value == 1
    assert fams["vfab_helper_batch_interval_seconds"].samples[0].value == pytest.approx(20e-6)
    counts = [s.value for s in fams["vfab_helper_batch_keys"].samples if s.name.endswith("_count")]
    assert counts == [11]
    down = helpermetrics.families("mc", "h1", {}, serving=False)
    assert [f.name for f in down] == ["vfab_helper_up"] and down[0].samples[0].value == 0


def test_loop_collector_reads_counters_keys_and_the_running_phase():
    op = SimpleNamespace(rec=SimpleNamespace(op="split", phase="copy"), phase_since=time.monotonic() - 3.0)
    loop = SimpleNamespace(service=SimpleNamespace(name="kvs"), name="a", counters={"held": 4, "stall_max_ms": 9},
                           housekeeper=SimpleNamespace(_counts={(0, 9): (None, 123, 0.0, None)}), op=op)
    fams = {f.name: f for f in _families(loopmetrics.LoopCollector(loop))}
    events = {s.labels["event"]: s.value for s in fams["vfab_endpoint_events"].samples if s.name.endswith("_total")}
    assert events == {"held": 4}            # the *_max_ms are no counts
    assert fams["vfab_range_keys"].samples[0].labels["range"] == "000000"
    assert fams["vfab_range_keys"].samples[0].value == 123
    age = fams["vfab_state_op_phase_age_seconds"].samples[0]
    assert age.labels["phase"] == "copy" and 2.9 < age.value < 10


def test_loop_hooks_count_requests_and_batch_times_read_at_scrape():
    hooks = loopmetrics.LoopMetrics("kvs", "a")
    for n, took in ((3, 0.0004), (1, 0.0004), (5, 0.003), (2, 99.0)):
        hooks.batch(n, took)
    loop = SimpleNamespace(service=SimpleNamespace(name="kvs"), name="a", counters={}, op=None, metrics=hooks,
                           housekeeper=SimpleNamespace(_counts={}))
    fams = {f.name: f for f in _families(loopmetrics.LoopCollector(loop))}
    for f in fams.values():
        metrics.check_name(f.name + ("_total" if f.type == "counter" else ""), f.type,
                           sorted({k for s in f.samples for k in s.labels}))
    req = [s.value for s in fams["vfab_endpoint_requests"].samples if s.name.endswith("_total")]
    assert req == [11]
    buckets = {s.labels["le"]: s.value for s in fams["vfab_endpoint_batch_duration_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.00025"] == 0 and buckets["0.0005"] == 2 and buckets["0.0025"] == 2
    assert buckets["0.005"] == 3 and buckets["30.0"] == 3 and buckets["+Inf"] == 4
    count = [s.value for s in fams["vfab_endpoint_batch_duration_seconds"].samples if s.name.endswith("_count")]
    assert count == [4]


def test_loop_collector_reads_an_sdhcp_shards_stats_on_its_loop():
    stats = {"bound": 90, "offered": 3, "slice": 100, "counters": {"offers": 120, "acks": 95, "naks": 2}}
    calls = []

    def call(fn, timeout=10.0):
        calls.append(timeout)
        return fn()

    loop = SimpleNamespace(service=SimpleNamespace(name="dh"), name="s1", counters={}, op=None, lane=None,
                           housekeeper=SimpleNamespace(_counts={}), call=call,
                           _control=lambda env: env.reply("OK", "s1", sdhcp=stats) if env.type == "STATS" else None)
    fams = {f.name: f for f in _families(loopmetrics.LoopCollector(loop))}
    assert calls == [1.0]   # asked on the loop's thread, bounded
    assert fams["vfab_sdhcp_leases_active"].samples[0].value == 90
    assert fams["vfab_sdhcp_pool_addresses"].samples[0].value == 100
    msgs = {s.labels["type"]: s.value for s in fams["vfab_sdhcp_messages"].samples if s.name.endswith("_total")}
    assert msgs["offers"] == 120 and msgs["acks"] == 95 and msgs["naks"] == 2 and msgs["declines"] == 0


def test_node_collector():
    assert _families(ctlmetrics.NodeCollector(lambda: None)) == []
    rec = schema.Node(name="h1", tunnel_ip="172.16.45.1", dpid=1, bridge="br-int", peers=["h2", "h3"], refused=7)
    fams = {f.name: f for f in _families(ctlmetrics.NodeCollector(lambda: rec))}
    assert fams["vfab_node_peers"].samples[0].value == 2
    assert [s.value for s in fams["vfab_node_refused_packets"].samples if s.name.endswith("_total")] == [7]


def test_helpee_cpu_per_request():
    ctlmetrics.helpee_cpu("mc", "m1", None, 100.0)   # not measured yet: nothing
    assert metrics.REGISTRY.get_sample_value("vfab_helpee_cpu_per_request_seconds",
                                             {"service": "mc", "endpoint": "m1"}) is None
    ctlmetrics.helpee_cpu("mc", "m1", 0.5, 100000.0)
    assert metrics.REGISTRY.get_sample_value("vfab_helpee_cpu_per_request_seconds",
                                             {"service": "mc", "endpoint": "m1"}) == pytest.approx(5e-6)


def test_declared_families_follow_the_conventions():
    """Every vfab_ family in the process registry (etcd client, state loop, controller, balancer)."""
    found = metrics.vfab_families()
    names = {n for n, _, _ in found}
    for needed in ("vfab_etcd_request_duration_seconds", "vfab_state_op_phase_duration_seconds", "vfab_cutover_duration_seconds",
                   "vfab_balancer_decisions_total"):
        assert needed in names
    for name, kind, labels in found:
        metrics.check_name(name, kind, labels)


def test_file_sd_groups():
    t = schema.MetricsTarget(process="endpoint", name="kvs-a", addr="127.0.0.1:9001", service="kvs", host="h1")
    c = schema.MetricsTarget(process="controller", name="h1-6653", addr="10.0.0.1:9002", host="h1")
    assert metrics.file_sd([t, c]) == [
        {"targets": ["127.0.0.1:9001"], "labels": {"vfab_process": "endpoint", "vfab_name": "kvs-a",
                                                    "vfab_host": "h1", "vfab_service": "kvs"}},
        {"targets": ["10.0.0.1:9002"], "labels": {"vfab_process": "controller", "vfab_name": "h1-6653",
                                                   "vfab_host": "h1"}}]


@pytest.mark.parametrize("kw,needle", [
    (dict(process="router", name="x", addr="127.0.0.1:1"), "unknown"),
    (dict(process="endpoint", name="x", addr="127.0.0.1"), "HOST:PORT"),
    (dict(process="endpoint", name="X!", addr="127.0.0.1:1"), "invalid"),
])
def test_bad_targets_are_refused(kw, needle):
    with pytest.raises(Exception, match=needle):
        schema.MetricsTarget(**kw)


def test_exporter_registers_in_etcd_serves_and_leaves(registry, tmp_path):
    exp = metrics.Exporter("endpoint", "kvs-a", port=0, service="kvs")
    try:
        exp.register(registry.endpoint, ttl=2)
        found = metrics.targets(registry)
        assert [(t.process, t.name, t.addr, t.service) for t in found] == [("endpoint", "kvs-a", exp.addr, "kvs")]
        assert registry.lease_of(schema.metrics_key("endpoint", "kvs-a", "kvs"))   # leased: it goes with the process
        body = urllib.request.urlopen(f"http://{exp.addr}/metrics", timeout=5).read().decode()
        assert "vfab_etcd_request_duration_seconds_bucket" in body
        if shutil.which("promtool") is None:
            pytest.fail("promtool is missing: 'make bootstrap' installs Debian's prometheus package")
        res = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stdout + res.stderr
        out = tmp_path / "targets.json"
        res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "metrics", "targets", "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text()) == metrics.file_sd(found)
    finally:
        exp.close()
    wait_until(lambda: not metrics.targets(registry))   # revoked with the lease
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{exp.addr}/metrics", timeout=2)


def test_etcd_requests_are_timed_and_errors_counted(registry):
    def value(name, **labels):
        got = metrics.REGISTRY.get_sample_value(name, labels)
        return got or 0.0

    before = value("vfab_etcd_request_duration_seconds_count", op="kv/put")
    for i in range(5):
        registry.put(f"/vfab/v1/config/x{i}", "1")
    assert value("vfab_etcd_request_duration_seconds_count", op="kv/put") == before + 5
    from vfab.vid.registry import Registry
    dead = Registry("127.0.0.1:1", timeout=0.5)
    errs = value("vfab_etcd_request_errors_total", op="kv/range", reason="RegistryError")
    with pytest.raises(Exception):
        dead.get("/vfab/v1/x")
    assert value("vfab_etcd_request_errors_total", op="kv/range", reason="RegistryError") == errs + 1


def test_endpoints_of_two_services_with_one_name_are_two_targets(registry):
    exps = [metrics.Exporter("endpoint", "s1", service=svc) for svc in ("kvs", "dh")]
    try:
        for e in exps:
            e.register(registry.endpoint, ttl=2)
        assert sorted((t.service, t.name) for t in metrics.targets(registry)) == [("dh", "s1"), ("kvs", "s1")]
    finally:
        for e in exps:
            e.close()


def test_exporter_port_in_use_is_a_clear_error():
    first = metrics.Exporter("agent", "one", port=0)
    try:
        with pytest.raises(Exception, match="give another --metrics-port"):
            metrics.Exporter("agent", "two", port=first.port)
    finally:
        first.close()
