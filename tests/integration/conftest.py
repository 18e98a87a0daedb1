"""Integration fixtures: a real fabric (etcd + OVS userspace + os-ken controller + Mininet)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from vfab.testbed import kvs
from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import wait_for

ECHO = ["-m", "vfab.services.echo"]


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    tb = Testbed("line,2,3", workdir=str(tmp_path_factory.mktemp("fabric")), poll=1.0)
    tb.start()
    yield tb
    for sw in tb.switches:
        try:
            flows = "\n".join(tb.dump_flows(sw))
            with open(os.path.join(tb.workdir, f"flows-{sw}.txt"), "w") as fh:
                fh.write(flows)
        except subprocess.CalledProcessError:
            pass
    ctl_log = tb.controller.logpath if tb.controller else None
    tb.stop()
    if ctl_log:
        with open(ctl_log) as fh:
            text = fh.read()
        assert "Traceback" not in text, f"controller raised:\n{text[-3000:]}"


@pytest.fixture
def servers(testbed):
    """``servers(service, [(host, name, listen[, data]), ...])`` creates the service and starts an elastic-KVS
    server per spec, waiting until the controller has applied them; stops them after the test (waking any the
    test left SIGSTOPped) and fails it if one raised."""
    started = []

    def start(service: str, specs: list):
        testbed.registry.create_service(service)
        for host, name, listen, *data in specs:
            started.append(kvs.start_server(testbed, host, name, service, listen, data=data[0] if data else None))
        testbed.wait_revision(testbed.registry.state_revision())
        return started

    yield start
    for proc in started:
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)
        testbed.sup.stop(proc)
        assert "Traceback" not in open(proc.logpath).read(), f"{proc.name} raised:\n{proc.tail(40)}"


def start_server(tb: Testbed, host: str, name: str, service: str = "echo", rx: str = "ovs",
                 listen: list[str] = ()):
    out = os.path.join(tb.workdir, f"{name}.out")
    fh = open(out, "wb")
    args = [*ECHO, "server", "--etcd", tb.etcd_endpoint, "--service", service, "--name", name,
            "--iface", tb.hosts[host]["iface"], "--rx", rx]
    for rng in listen:
        args += ["--listen", rng]
    proc = tb.run_on(host, name, args, stdout=fh)
    wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 20, f"server {name} ready")
    assert proc.alive(), f"server {name} died:\n{proc.tail()}"
    return proc


def start_sdhcp_shard(tb: Testbed, host: str, service: str, name: str, data: str, out: str, opts: dict,
                      nth: int = 1, listen: str = "0-0xffffff"):
    """An sdhcp shard on ``host`` owning ``listen``, its store in ``data``; returns once it said ``ready``
    for the ``nth`` time into ``out`` (appended: a restart on the same data is the next one)."""
    pairs = [a for k, v in opts.items() for a in ("--opt", f"{k}={v}")]
    args = ["-m", "vfab.services.sdhcp", "server", "--etcd", tb.etcd_endpoint, "--service", service, "--name", name,
            "--iface", tb.hosts[host]["iface"], "--data", data, "--listen", listen, *pairs]
    proc = tb.run_on(host, f"sdhcp-{name}", args, stdout=open(out, "ab"))
    wait_for(lambda: open(out, "rb").read().count(b"ready") >= nth or not proc.alive(), 30, f"shard {name} ready")
    assert proc.alive(), proc.tail()
    return proc


def stop_sdhcp_shard(tb: Testbed, service: str, proc, sims=()) -> None:
    """The end of a start_sdhcp_shard test: its client simulators closed, the shard stopped, the service gone
    from etcd and from the switches."""
    for s in sims:
        s.close()
    tb.sup.stop(proc)
    tb.registry.delete_service(service)
    tb.wait_revision(tb.registry.state_revision())


def client_args(tb: Testbed, host: str, out: str, service: str = "echo", **opts) -> list[str]:
    args = [*ECHO, "client", "--etcd", tb.etcd_endpoint, "--service", service,
            "--iface", tb.hosts[host]["iface"], "--out", out]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def run_client(tb: Testbed, host: str, name: str, wait: float = 120, **opts) -> list[dict]:
    out = os.path.join(tb.workdir, f"{name}.json")
    proc = tb.run_on(host, name, client_args(tb, host, out, **opts))
    proc.popen.wait(wait)
    assert proc.popen.returncode == 0, f"client {name} failed:\n{proc.tail()}"
    tb.sup.stop(proc)
    with open(out) as fh:
        return json.load(fh)


def guard_drops(tb: Testbed, service_id: int, what: str = "guard") -> int:
    """Packets the switches dropped as a service's answers from a port without a server (``what`` "guard"),
    or as its front-door requests from an address the host is not registered with ("spoofed")."""
    from vfab.cli.cmd_ranges import fabric_counters
    return fabric_counters(tb.registry).get(f"{what}/{service_id}", [0, 0])[0]


def frames_seen(tb: Testbed, sender: str, frames: list[bytes], watcher: str, listen: float = 1.5,
                seen=None) -> int:
    """Send raw ``frames`` from host ``sender``'s port; how many frames host ``watcher``'s port receives
    within ``listen`` s that ``seen(frame)`` accepts (default: those with the sent frames' Ethernet sources)."""
    from vfab.vid.netns import netns

    sources = {f[6:12] for f in frames}
    if seen is None:
        def seen(f: bytes) -> bool:
            return f[6:12] in sources
    with netns(tb.netns(watcher)):
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    with netns(tb.netns(sender)):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        cap.bind((tb.hosts[watcher]["iface"], 0))
        cap.settimeout(0.2)
        s.bind((tb.hosts[sender]["iface"], 0))
        for f in frames:
            s.send(f)
        got, t_end = 0, time.monotonic() + listen
        while time.monotonic() < t_end:
            try:
                f = cap.recv(4096)
            except socket.timeout:
                continue
            got += bool(seen(f))
        return got
    finally:
        s.close()
        cap.close()
