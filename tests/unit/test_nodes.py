"""Fabric nodes in a real etcd (vfab.vid.registry.nodes), 'vfab node' at the CLI edge, and the testbed's
control-network relay (vfab.testbed.ctlnet)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from click.testing import CliRunner

from vfab.cli.cmd_node import parse_endpoints
from vfab.cli.main import cli
from vfab.testbed.procs import free_port, wait_for
from vfab.vid.errors import Conflict, NotFound
from vfab.vid.registry import Registry, nodes, schema


@pytest.fixture
def reg(tmp_path):
    from vfab.testbed.etcd import LocalEtcd, free_port

    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port())
    etcd.start(timeout=20)
    r = Registry(etcd.endpoint)
    try:
        yield r
    finally:
        r.close()
        etcd.stop()


def rec(name: str, ip: str, **kw) -> schema.Node:
    return schema.Node(name=name, tunnel_ip=ip, dpid=0xFB01, bridge="br-vfab", **kw)


def test_join_refuses_a_taken_name_or_address_and_leave_frees_both(reg):
    lease = reg.lease(30)
    nodes.join(reg, rec("h1", "10.1.0.1"), lease)
    other = reg.lease(30)
    with pytest.raises(Conflict, match=r"node name 'h1' is taken by a live node: node h1 at 10\.1\.0\.1.*lease ends"):
        nodes.join(reg, rec("h1", "10.1.0.2"), other)
    with pytest.raises(Conflict, match=r"tunnel address 10\.1\.0\.1 is already taken by node 'h1'"):
        nodes.join(reg, rec("h2", "10.1.0.1"), other)
    assert set(nodes.nodes(reg)) == {"h1"}                     # nothing half-written by the refusals
    assert reg.get(schema.node_ip_key("10.1.0.2")) is None
    nodes.join(reg, rec("h2", "10.1.0.2"), other)
    left = nodes.leave(reg, "h1")
    assert left.tunnel_ip == "10.1.0.1"
    assert reg.get(schema.node_ip_key("10.1.0.1")) is None
    nodes.join(reg, rec("h3", "10.1.0.1"), reg.lease(30))       # the address is free again
    with pytest.raises(NotFound, match=r"node 'h1' is not registered \(nodes: h2, h3\)"):
        nodes.leave(reg, "h1")


def test_retake_only_under_the_same_lease_and_update_only_while_held(reg):
    lease = reg.lease(30)
    nodes.join(reg, rec("h1", "10.1.0.1"), lease)
    nodes.join(reg, rec("h1", "10.1.0.1", peers=["h2"]), lease, retake=True)   # a restarted agent, same lease
    assert nodes.nodes(reg)["h1"].peers == ["h2"]
    with pytest.raises(Conflict, match="taken by a live node"):
        nodes.join(reg, rec("h1", "10.1.0.1"), reg.lease(30), retake=True)      # someone else's lease
    assert nodes.update(reg, rec("h1", "10.1.0.1", ports={"p1": 1}), lease)
    assert nodes.nodes(reg)["h1"].ports == {"p1": 1}
    nodes.leave(reg, "h1")
    assert not nodes.update(reg, rec("h1", "10.1.0.1"), lease)                  # it left: no resurrection
    assert nodes.nodes(reg) == {}


def test_an_ended_lease_frees_the_name(reg):
    lease = reg.lease(2)
    nodes.join(reg, rec("h1", "10.1.0.1"), lease)
    wait_for(lambda: not nodes.nodes(reg), 10, "the lease to end")
    nodes.join(reg, rec("h1", "10.1.0.7"), reg.lease(30))
    assert nodes.nodes(reg)["h1"].tunnel_ip == "10.1.0.7"


def test_cli_node_list(reg):
    lease = reg.lease(30)
    nodes.join(reg, rec("h1", "10.1.0.1", peers=["h2"], refused=4), lease)
    nodes.join(reg, rec("h2", "10.1.0.2"), lease)
    res = CliRunner().invoke(cli, ["node", "list", "--etcd", f"http://{reg.endpoint}"])
    assert res.exit_code == 0, res.output
    assert "h1" in res.output and "10.1.0.1" in res.output and "1/1" in res.output
    assert "0/1 (no tunnel to h1)" in res.output
    res = CliRunner().invoke(cli, ["--etcd", reg.endpoint, "node", "list", "--json"])
    data = json.loads(res.output)
    assert data["h1"]["refused"] == 4 and data["h2"]["peers"] == []


def test_cli_refuses_bad_input_before_touching_anything():
    r = CliRunner().invoke(cli, ["node", "join", "--tunnel-ip", "10.0.0.300", "--etcd", "127.0.0.1:1"])
    assert r.exit_code == 2 and "is not an IPv4 address" in r.output
    r = CliRunner().invoke(cli, ["node", "join", "--tunnel-ip", "0.0.0.0", "--etcd", "127.0.0.1:1"])
    assert r.exit_code == 2 and "cannot carry tunnels" in r.output
    r = CliRunner().invoke(cli, ["node", "join", "--tunnel-ip", "10.0.0.1", "--name", "No Way"])
    assert r.exit_code == 2 and "node name" in r.output
    r = CliRunner().invoke(cli, ["node", "list", "--etcd", "127.0.0.1:2379,,"])
    assert r.exit_code == 2 and "is not an etcd client URL" in r.output
    assert parse_endpoints("http://10.0.0.1:2379, 10.0.0.2:2379/,10.0.0.1:2379") == ["10.0.0.1:2379",
                                                                                   "10.0.0.2:2379"]
    with pytest.raises(Exception, match="is not an etcd client URL"):
        parse_endpoints("10.0.0.1:99999")


def test_control_network_reaches_root_loopback_from_a_namespace_until_cut(ns):
    from vfab.testbed import ctlnet
    from vfab.testbed.ctlnet import ControlNet
    from vfab.vid.netns import netns

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]

    def echo() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                while data := c.recv(65536):
                    c.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    net = ControlNet()
    path = f"/var/run/netns/{ns.name}"

    def talk(payload: bytes) -> bytes:
        with netns(path):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        with s:
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            return got

    try:
        with netns(path):   # nothing listens in the namespace before the relay does
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2)
        net.forward(path, port, ("127.0.0.1", port), tags=("h",))
        big = bytes(range(256)) * 4096                     # 1 MiB: the relay's buffering under back-pressure
        assert talk(b"hello") == b"hello"
        assert talk(big) == big
        net.cut("h")
        with pytest.raises(OSError):
            talk(b"x")
        net.heal("h")
        assert talk(b"again") == b"again"
        # onward to an address nobody answers for (ARP goes unanswered inside the namespace): the client's
        # connection is closed after CONNECT s, and the relay keeps serving the others meanwhile
        ns.sh("ip", "addr", "add", "10.99.0.1/24", "dev", ns.a)
        void_port = free_port()
        net.forward(path, void_port, ("10.99.0.2", 9), target_ns=path, tags=("void",))
        with netns(path):
            void = socket.create_connection(("127.0.0.1", void_port), timeout=5)
        with void:
            t0 = time.monotonic()
            assert talk(b"meanwhile") == b"meanwhile"
            void.settimeout(ctlnet.CONNECT + 3)
            assert void.recv(10) == b""
            assert ctlnet.CONNECT - 0.5 < time.monotonic() - t0 < ctlnet.CONNECT + 2
    finally:
        net.close()
        srv.close()


def test_cli_node_unit_writes_a_systemd_unit(tmp_path):
    out = tmp_path / "vfab-node.service"
    r = CliRunner().invoke(cli, ["node", "unit", "--etcd", "http://10.0.0.1:2379,10.0.0.2:2379", "--tunnel-ip",
                                 "10.0.1.2", "--name", "m2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    exec_line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    assert exec_line.endswith("node join --etcd 10.0.0.1:2379,10.0.0.2:2379 --tunnel-ip 10.0.1.2 --name m2 "
                              "--bridge br-vfab --ttl 5")
    assert "Restart=on-failure" in text and "[Install]" in text
    r = CliRunner().invoke(cli, ["node", "unit", "--etcd", "10.0.0.1:2379", "--tunnel-ip", "10.0.1.256"])
    assert r.exit_code == 2 and "is not an IPv4 address" in r.output


def test_a_relay_whose_target_namespace_is_gone_refuses_and_keeps_serving(ns):
    """A host torn down (or killed) while its relay still listens: a connection to it is closed, and the
    relay's thread lives on for the others (it died on the namespace's absence, in a testbed's teardown)."""
    from vfab.testbed.ctlnet import ControlNet
    from vfab.vid.netns import netns

    net = ControlNet()
    path = f"/var/run/netns/{ns.name}"
    try:
        gone_port = free_port()
        net.forward(None, gone_port, ("127.0.0.1", 9), target_ns="/var/run/netns/vfnx-never-made", tags=("gone",))
        with socket.create_connection(("127.0.0.1", gone_port), timeout=5) as c:
            c.settimeout(5)
            assert c.recv(10) == b""
        assert net.thread.is_alive()
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        net.forward(path, port, ("127.0.0.1", port), tags=("h",))
        with netns(path):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        with s, srv:
            peer, _ = srv.accept()
            with peer:
                s.sendall(b"ok")
                peer.settimeout(5)
                assert peer.recv(2) == b"ok"
    finally:
        net.close()
