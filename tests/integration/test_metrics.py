"""Metrics on the real fabric: the processes register their exporters in etcd, and what they expose moves with
the traffic and the operations (an elastic-KVS endpoint's request counter by exactly the requests it was sent,
the controller's per-range packet counter by as many frames, a split's cut-over and phases); every exposition
passes ``promtool check metrics``; ``vfab top --once`` shows the split's new owner."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from vfab.cli.main import cli
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.testbed import kvs
from vfab.testbed.etcd import free_port
from vfab.testbed.procs import wait_for
from vfab.vid import metrics
from vfab.vid.ranges import Range
from vfab.vid.state import ctl as statectl

SERVICE = "kvsmet"
HALF = Range(0x800000, 0xFFFFFF)
N = 300


def scrape(addr: str) -> tuple[str, dict]:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def total(samples: dict, name: str, **labels) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.fixture
def servers(testbed):
    testbed.registry.create_service(SERVICE)
    procs = [kvs.start_server(testbed, "vfh1", "ma", SERVICE, "0-0xffffff"),
             kvs.start_server(testbed, "vfh4", "mb", SERVICE)]
    testbed.wait_revision(testbed.registry.state_revision())
    yield procs
    for proc in procs:
        testbed.sup.stop(proc)
        assert "Traceback" not in open(proc.logpath).read(), f"{proc.name} raised:\n{proc.tail(40)}"


def test_metrics_move_with_traffic_and_a_split(testbed, servers):
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: 'make bootstrap' installs Debian's prometheus package")
    reg = testbed.registry
    found = wait_for(lambda: (lambda t: t if {"ma", "mb"} <= {x.name for x in t} and
                              any(x.process == "controller" for x in t) else None)(metrics.targets(reg)),
                     10, "the exporters registered in etcd")
    addr = {t.name: t.addr for t in found if t.process == "endpoint"}
    ctl = next(t.addr for t in found if t.process == "controller")
    for a in (addr["ma"], addr["mb"], ctl):
        text, _ = scrape(a)
        res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, f"{a}: {res.stdout}{res.stderr}"

    _, kv0 = scrape(addr["ma"])
    req0 = total(kv0, "vfab_endpoint_requests_total", service=SERVICE, endpoint="ma")
    _, c0 = scrape(ctl)
    pk0 = total(c0, "vfab_range_packets_total", service=SERVICE)
    cut0 = total(c0, "vfab_cutover_duration_seconds_count")

    with kvs.client(testbed, "vfh2", SERVICE) as cl:
        done = kvs.pipeline(cl, [(Op.PUT, f"m{i}".encode(), b"v" * 64) for i in range(N)], window=16)
        sent, retries = cl.counters["sent"], cl.counters["retries"]
    assert sum(1 for p in done if p.reply is not None and p.reply.status is Status.OK) == N

    def moved():
        _, kv = scrape(addr["ma"])
        return total(kv, "vfab_endpoint_requests_total", service=SERVICE, endpoint="ma") - req0
    served = wait_for(lambda: moved() >= sent - retries and moved(), 5, "the request counter to move")
    assert sent - retries <= served <= sent, (served, sent, retries)

    # the controller polls the switches' counters every second (poll=1.0): the request frames show up there
    def packets():
        _, c = scrape(ctl)
        return total(c, "vfab_range_packets_total", service=SERVICE) - pk0
    got = wait_for(lambda: packets() >= sent - retries and packets(), 10, "the range's packets in the controller")
    assert sent - retries <= got <= sent * 1.1 + 5, (got, sent)
    print(f"scrape: client sent {sent} ({retries} retries), endpoint counted {served:.0f}, controller's range "
          f"packets {got:.0f}")

    op = statectl.wait(reg, SERVICE, statectl.split(reg, SERVICE, HALF, "mb").op, timeout=60)
    assert op.phase == "done", op

    def split_seen():
        _, kv = scrape(addr["ma"])
        return total(kv, "vfab_state_ops_total", service=SERVICE, op="split", outcome="done") and kv
    kv = wait_for(split_seen, 5, "the split in the source's metrics")
    assert total(kv, "vfab_state_op_phase_duration_seconds_count", op="split", phase="flip") >= 1
    assert total(kv, "vfab_state_op_duration_seconds_count", op="split") >= 1
    _, c = wait_for(lambda: (lambda r: r if total(r[1], "vfab_cutover_duration_seconds_count") > cut0 else None)(
        scrape(ctl)), 10, "the split's cut-over in the controller's histogram")
    assert total(c, "vfab_service_ranges", service=SERVICE, state="served") == 2
    assert total(c, "vfab_etcd_request_duration_seconds_count") > 0

    res = CliRunner().invoke(cli, ["--etcd", reg.endpoint, "top", "--once"])
    assert res.exit_code == 0, res.output
    assert "800000-ffffff  mb" in res.output and "000000-7fffff  ma" in res.output


def _query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    doc = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _scalar(base: str, promql: str) -> float | None:
    got = _query(base, promql)
    return float(got[0]["value"][1]) if got else None


@pytest.fixture
def prometheus(testbed, tmp_path):
    """Debian's Prometheus server on loopback, scraping the targets 'vfab metrics targets --out' wrote (every
    second), with the shipped rules loaded."""
    if shutil.which("prometheus") is None:
        pytest.fail("the prometheus server is missing: 'make bootstrap' installs Debian's prometheus package")
    targets = tmp_path / "targets.json"
    cfg = tmp_path / "prometheus.yml"
    rules = pathlib.Path(__file__).resolve().parents[2] / "docs" / "prometheus" / "vfab-rules.yml"
    cfg.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                   f"rule_files: [{rules}]\n"
                   f"scrape_configs:\n  - job_name: vfab\n    file_sd_configs: [{{files: [{targets}], "
                   f"refresh_interval: 1s}}]\n")
    port = free_port()
    proc = testbed.sup.start("prometheus", ["prometheus", f"--config.file={cfg}",
                                            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                            f"--web.listen-address=127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return urllib.request.urlopen(f"{base}/-/ready", timeout=1).status == 200
        except OSError:
            return not proc.alive()
    wait_for(ready, 30, "prometheus to be ready")
    assert proc.alive(), proc.tail()

    def refresh() -> int:
        res = CliRunner().invoke(cli, ["--etcd", testbed.registry.endpoint, "metrics", "targets", "--out",
                                       str(targets)])
        assert res.exit_code == 0, res.output
        return len(json.loads(targets.read_text()))
    yield base, refresh
    testbed.sup.stop(proc)


def test_a_real_prometheus_scrapes_the_fabric(testbed, prometheus):
    """Through Prometheus' HTTP API: every target up, the per-range packet count matching what the load sent
    (within 10 %), the split's cut-over in the histogram, the rules loaded and healthy, none firing for the
    service; then its owner of a range without mirror stopped: VfabOwnerDownNoMirror fires."""
    base, refresh = prometheus
    reg = testbed.registry
    service = "kvsprom"
    reg.create_service(service)
    procs = [kvs.start_server(testbed, "vfh1", "pa", service, "0-0xffffff"),
             kvs.start_server(testbed, "vfh4", "pb", service)]
    try:
        testbed.wait_revision(reg.state_revision())
        n = refresh()
        assert n >= 3   # the controller and both endpoints
        wait_for(lambda: _scalar(base, 'count(up{job="vfab"} == 1)') == n, 20, f"Prometheus to scrape all {n}")
        assert _query(base, 'up{job="vfab"} == 0') == []
        wait_for(lambda: _scalar(base, f'sum(vfab_service_ranges{{service="{service}",state="served"}})') == 1, 10,
                 "the range map in Prometheus")
        before = _scalar(base, f'sum(vfab_range_packets_total{{service="{service}"}})') or 0.0
        cuts = _scalar(base, "sum(vfab_cutover_duration_seconds_count)") or 0.0
        proc, out = kvs.start_load(testbed, "vfh2", "promload", service, duration=6, clients=4, keys=200)
        sent = kvs.finish_load(testbed, proc, out, wait=60)["counters"]["sent"]
        assert sent > 500

        def counted():
            return (_scalar(base, f'sum(vfab_range_packets_total{{service="{service}"}})') or 0.0) - before
        got = wait_for(lambda: counted() >= 0.9 * sent and counted(), 15, "the load's packets in Prometheus")
        assert abs(got - sent) <= 0.1 * sent, (got, sent)
        print(f"prometheus: the load sent {sent} requests, Prometheus counted {got:.0f} packets for the service")

        op = statectl.wait(reg, service, statectl.split(reg, service, HALF, "pb").op, timeout=60)
        assert op.phase == "done", op
        wait_for(lambda: (_scalar(base, "sum(vfab_cutover_duration_seconds_count)") or 0.0) > cuts, 15,
                 "the split's cut-over in Prometheus")
        wait_for(lambda: _scalar(base, f'sum(vfab_state_ops_total{{service="{service}",op="split",outcome="done"}})')
                 == 1, 10, "the split's outcome in Prometheus")
        groups = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5).read())["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) >= 9 and all(r["health"] == "ok" for r in rules), rules

        def alerts(state: str = "firing") -> set[str]:
            got = json.loads(urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=5).read())["data"]["alerts"]
            return {a["labels"]["alertname"] for a in got
                    if a["state"] == state and a["labels"].get("service") in (service, None)}
        assert not {"VfabRangeNoLiveOwner", "VfabOwnerDownNoMirror", "VfabSwitchBehind"} & alerts(), alerts()
        # pb owns the upper half now, with no mirror: stopped, it leaves etcd and the critical alert fires
        testbed.sup.stop(procs[1])
        wait_for(lambda: "VfabOwnerDownNoMirror" in alerts(), 30, "VfabOwnerDownNoMirror to fire in Prometheus")
        assert _scalar(base, f'sum(vfab_service_ranges{{service="{service}",state="lost"}})') == 1
    finally:
        for p in procs:
            testbed.sup.stop(p)


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def test_vfab_top_in_a_terminal_follows_a_split(testbed, tmp_path):
    """``vfab top`` in tmux: the running split's progress bar shows, then the range's new owner; q quits."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: 'make bootstrap' installs it")
    reg = testbed.registry
    service = "kvstop"
    reg.create_service(service)
    procs = [kvs.start_server(testbed, "vfh1", "ta", service, "0-0xffffff"),
             kvs.start_server(testbed, "vfh4", "tb", service)]
    session = f"vfab-top-{os.getpid()}"
    try:
        testbed.wait_revision(reg.state_revision())
        assert kvs.preload(testbed, "vfh2", service, 1500, value_size=256) == 1500
        vfab = shutil.which("vfab", path=os.path.dirname(sys.executable)) or "vfab"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "60",
                        f"{vfab} --etcd {reg.endpoint} top --interval 0.2"], check=True)
        wait_for(lambda: "000000-ffffff  ta" in _pane(session), 10, "vfab top's first frame")
        started = statectl.split(reg, service, HALF, "tb", throttle=1000)   # ~0.75 s of copy: seen running
        wait_for(lambda: "split ta -> tb" in _pane(session) and "%" in _pane(session), 10,
                 "the split's progress bar in vfab top")
        op = statectl.wait(reg, service, started.op, timeout=60)
        assert op.phase == "done", op
        wait_for(lambda: "800000-ffffff  tb" in _pane(session), 10, "the new owner in vfab top")
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        wait_for(lambda: subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode
                 != 0, 5, "vfab top to quit on q")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        for p in procs:
            testbed.sup.stop(p)
