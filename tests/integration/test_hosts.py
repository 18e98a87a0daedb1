"""Several hosts on this machine, made of the real parts: a namespace + its own Open vSwitch each, an underlay,
Geneve tunnels built by the node agent ('vfab node join' under ip netns exec), one etcd (issue 45)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys

import pytest

from vfab.fabric import tunnels
from vfab.testbed.hosts import INT, UNDERLAY_NS, HostsTestbed, in_ns
from vfab.testbed.procs import wait_for
from vfab.vid import frame
from vfab.vid.netns import netns
from vfab.vid.registry import nodes, schema

VID = bytes.fromhex("0e0045000003")   # a service VID (class 0, service 0x0045, key 3)


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    bed = HostsTestbed(3, workdir=str(tmp_path_factory.mktemp("hosts")), ttl=2)
    bed.start()
    try:
        bed.ports = {h: bed.add_port(h) for h in ("host1", "host2", "host3")}
        yield bed
    finally:
        agent_logs = [h.agent.logpath for h in bed.hosts.values() if h.agent is not None]
        bed.stop()
        for path in agent_logs:
            with open(path) as fh:
                text = fh.read()
            assert "Traceback" not in text, f"a node agent raised:\n{text[-3000:]}"


def rx_socket(port_ns: str) -> socket.socket:
    with netns(f"/var/run/netns/{port_ns}"):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(frame.ETH_TYPE))
        s.bind(("eth0", 0))
    s.settimeout(0.2)
    return s


def send_frames(port_ns: str, payload: bytes, count: int = 1) -> None:
    with netns(f"/var/run/netns/{port_ns}"):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    with s:
        s.bind(("eth0", 0))
        data = frame.Frame(dst=VID, src=bytes.fromhex("02fb00010001"), type=frame.FrameType.REQUEST,
                           payload=payload).serialize()
        for _ in range(count):
            s.send(data)


def received(sock: socket.socket, payload: bytes, timeout: float = 3.0) -> bool:
    """True once a vfab frame to VID carrying ``payload`` arrives on ``sock`` within ``timeout``."""
    def got() -> bool:
        try:
            while True:
                try:
                    f = frame.parse(sock.recv(65536))
                except frame.FrameError:
                    continue
                if f.dst == VID and f.payload == payload:
                    return True
        except (socket.timeout, BlockingIOError):
            return False

    try:
        return bool(wait_for(got, timeout, "the frame"))
    except TimeoutError:
        return False


def route_vid(tb: HostsTestbed, src: str, dst: str) -> None:
    """By hand, what two-level routing will compile: on ``src`` the VID goes into the tunnel to ``dst``; on
    ``dst`` what comes out of the tunnel from ``src`` goes to ``dst``'s port."""
    s_port = tb.hosts[src].ports[tb.ports[src]]["ofport"]
    d_port = tb.hosts[dst].ports[tb.ports[dst]]["ofport"]
    tb.hosts[src].ovs.ofctl("add-flow", INT, f"priority=100,in_port={s_port},dl_type=0x88b5,dl_dst="
                            f"{VID.hex(':')},actions=output:{tb.tunnel_port(src, dst)}")
    tb.hosts[dst].ovs.ofctl("add-flow", INT, f"priority=100,in_port={tb.tunnel_port(dst, src)},dl_type=0x88b5,"
                            f"actions=output:{d_port}")


def test_agents_mesh_and_register(tb):
    # one etcd member in each host, on the control network; each host's processes list their own first
    assert [h.member.endpoint for h in tb.hosts.values()] == ["172.16.46.1:2379", "172.16.46.2:2379",
                                                             "172.16.46.3:2379"]
    assert tb.etcd_endpoint("host2").split(",")[0] == "172.16.46.2:2379"
    assert f"--etcd {tb.etcd_endpoint('host3')} " in " ".join(tb.join_command("host3"))
    res = tb.node_in_ns("host2", "status", "--json")   # vfab on a host: its own member by default
    assert res.returncode == 0 and json.loads(res.stdout)["etcd"]["using"] == "172.16.46.2:2379", res.stderr
    found = nodes.nodes(tb.registry)
    assert set(found) == {"host1", "host2", "host3"}
    for name, rec in found.items():
        h = tb.hosts[name]
        assert rec.tunnel_ip == h.tunnel_ip and rec.dpid == h.dpid and rec.bridge == INT
        assert set(rec.peers) == set(found) - {name}
        assert tb.peers(name) == set(found) - {name}
        # each peer's tunnel: Geneve, the fabric's key, from this host's address to the peer's
        for t in tunnels.current(INT, rundir=h.rundir).values():
            assert (t.encap, t.key, t.local_ip) == ("geneve", tunnels.FABRIC_VNI, h.tunnel_ip)
            assert t.remote_ip == tb.hosts[t.peer].tunnel_ip
        # the agent gave OVS each peer's next hop (OVS only snoops ARP replies, and the kernel of a host that
        # was asked first never sends a request: without it the first frame into that tunnel is lost)
        neigh = h.ovs.appctl("tnl/neigh/show")
        for peer in set(found) - {name}:
            assert tb.hosts[peer].tunnel_ip in neigh, f"{name} has no next hop for {peer}:\n{neigh}"
    # the ports added after the join reach the records (the agent looks every 2 s)
    wait_for(lambda: all(tb.ports[n] in nodes.nodes(tb.registry)[n].ports for n in found), 10,
             "the ports in the node records")


def test_vid_frame_crosses_from_host1_to_host3(tb):
    route_vid(tb, "host1", "host3")
    rx3, rx2 = rx_socket(tb.ports["host3"]), rx_socket(tb.ports["host2"])
    try:
        for size in (16, 1400, frame.MAX_PAYLOAD):   # a full 1500-byte frame too: the underlay's MTU is 9000
            payload = os.urandom(size)
            send_frames(tb.ports["host1"], payload)
            assert received(rx3, payload), f"a {size}-byte VID frame from host1 did not reach host3's port"
        assert not received(rx2, payload, timeout=0.3), "host2 got a frame routed to host3"
    finally:
        rx3.close()
        rx2.close()
    # it went through the tunnel: host3's switch counted it on its tunnel port from host1
    stats = tb.hosts["host3"].ovs.ofctl("dump-ports", INT, str(tb.tunnel_port("host3", "host1")))
    assert "rx pkts=0" not in stats.replace("  ", " "), stats


def geneve(inner: bytes) -> bytes:
    """A Geneve packet's UDP payload: no options, Ethernet inside, the fabric's VNI."""
    return struct.pack("!BBHI", 0, 0, 0x6558, tunnels.FABRIC_VNI << 8) + inner


def test_tunnel_packet_from_a_stranger_is_dropped_and_counted(tb):
    route_vid(tb, "host1", "host3")
    before = tb.refused("host3")
    stranger = "172.16.45.200"
    in_ns(UNDERLAY_NS, "ip", "addr", "replace", f"{stranger}/24", "dev", "vfubr")
    rx3 = rx_socket(tb.ports["host3"])
    try:
        with netns(f"/var/run/netns/{UNDERLAY_NS}"):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        payload = b"forged by a stranger"
        inner = frame.Frame(dst=VID, src=bytes.fromhex("020000000099"), type=frame.FrameType.REQUEST,
                            payload=payload).serialize()
        with u:
            u.bind((stranger, 0))
            for _ in range(3):
                u.sendto(geneve(inner), (tb.hosts["host3"].tunnel_ip, tunnels.UDP_PORTS["geneve"]))
        assert not received(rx3, payload, timeout=0.5), "a stranger's tunnel packet was delivered"
        wait_for(lambda: tb.refused("host3") >= before + 3, 5, "the filter's drop counter")
        # the agent publishes the count in its node record ('vfab node list' shows it)
        wait_for(lambda: nodes.nodes(tb.registry)["host3"].refused >= before + 3, 10, "the refused count")
        # the fabric's own traffic is untouched
        good = os.urandom(32)
        send_frames(tb.ports["host1"], good)
        assert received(rx3, good)
    finally:
        rx3.close()
        in_ns(UNDERLAY_NS, "ip", "addr", "del", f"{stranger}/24", "dev", "vfubr", check=False)


def _join_fails(tb, host: str, *args: str) -> subprocess.CompletedProcess:
    res = tb.node_in_ns(host, "node", "join", "--etcd", tb.etcd.endpoint, "--bridge", INT, "--state-dir",
                        os.path.join(tb.workdir, "refused-state"), *args)
    assert res.returncode != 0, f"join {args} was accepted:\n{res.stdout}{res.stderr}"
    return res


def test_bad_joins_are_refused_and_change_nothing(tb):
    before = {n: (r.tunnel_ip, sorted(r.peers), r.agent) for n, r in nodes.nodes(tb.registry).items()}
    res = _join_fails(tb, "host2", "--tunnel-ip", "172.16.45.77", "--name", "extra")
    assert "is not an address of this machine" in res.stderr and "172.16.45.2" in res.stderr, res.stderr
    res = _join_fails(tb, "host2", "--tunnel-ip", "172.16.45.2", "--name", "extra")
    assert "tunnel address 172.16.45.2 is already taken by node 'host2'" in res.stderr, res.stderr
    res = _join_fails(tb, "host2", "--tunnel-ip", "172.16.45.2", "--name", "host1")
    assert "node name 'host1' is taken by a live node" in res.stderr, res.stderr
    res = _join_fails(tb, "host2", "--tunnel-ip", "300.1.2.3", "--name", "extra")
    assert res.returncode == 2 and "is not an IPv4 address" in res.stderr, res.stderr
    res = _join_fails(tb, "host2", "--tunnel-ip", "127.0.0.1", "--name", "extra")
    assert res.returncode == 2 and "cannot carry tunnels" in res.stderr, res.stderr
    in_ns(tb.hosts["host2"].ns, "ip", "addr", "add", "10.45.0.2/32", "dev", "lo")
    res = _join_fails(tb, "host2", "--tunnel-ip", "10.45.0.2", "--name", "extra")
    assert "sits on lo, which is not an Open vSwitch bridge" in res.stderr, res.stderr
    res = _join_fails(tb, "host2", "--tunnel-ip", "172.16.45.2", "--name", "extra", "--etcd", "not a url")
    assert res.returncode == 2 and "is not an etcd client URL" in res.stderr, res.stderr
    after = {n: (r.tunnel_ip, sorted(r.peers), r.agent) for n, r in nodes.nodes(tb.registry).items()}
    assert after == before
    for n in before:
        assert tb.peers(n) == set(before) - {n}


def echo_server(tb, host: str, name: str, *listen: str):
    """An echo endpoint on ``host``'s port (the process runs on the host, under its host name)."""
    args = [sys.executable, "-m", "vfab.services.echo", "server", "--service", "drain", "--name", name, "--netns",
            tb.port_ns(tb.ports[host]), "--iface", "eth0", "--create", "--ttl", "2"]
    for rng in listen:
        args += ["--listen", rng]
    proc = tb.run_on(host, f"echo-{name}", args)
    wait_for(lambda: any(e.name == name for e in tb.registry.endpoints("drain")) if tb.registry.get(
        schema.service_key("drain")) else False, 20, f"endpoint {name}")
    return proc


def owners(tb) -> set[str]:
    return {r.owner for r, _ in tb.registry.ranges("drain")}


def leave(tb, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfab.cli", "--etcd", tb.etcd.endpoint, "node", "leave", *args],
                          capture_output=True, text=True, timeout=120)


def test_leave_drains_the_nodes_ranges_to_another_node_first(tb):
    e3 = echo_server(tb, "host3", "e3", "0-0xffffff")
    try:
        wait_for(lambda: owners(tb) == {"e3"}, 10, "e3 to own every key")
        assert {e.name: e.host for e in tb.registry.endpoints("drain")} == {"e3": "host3"}
        # no other node runs an endpoint of the service: refused, nothing changed
        res = leave(tb, "--name", "host3")
        assert res.returncode == 1, res.stdout + res.stderr
        assert "node host3 cannot be drained: drain/e3 owns 1 range(s) and no endpoint of drain runs on another " \
               "node" in res.stderr and "--no-drain" in res.stderr, res.stderr
        assert "host3" in nodes.nodes(tb.registry) and owners(tb) == {"e3"}
        # an endpoint on host2: host3's ranges go to it first, then host3 leaves
        e2 = echo_server(tb, "host2", "e2")
        try:
            res = leave(tb, "--name", "host3")
            assert res.returncode == 0, res.stdout + res.stderr
            assert "draining node host3 (1/1): drain: e3 -> e2, 1 range(s) reassigned" in res.stderr, res.stderr
            assert "node host3 drained (1 range(s) of 1 endpoint(s) moved to other nodes) and left" in res.stdout
            assert owners(tb) == {"e2"}
            wait_for(lambda: "host3" not in tb.peers("host1"), 10, "host1 to drop its tunnel to host3")
        finally:
            tb.sup.stop(e2)
    finally:
        tb.sup.stop(e3)
        tb.registry.delete_service("drain")
    assert tb.hosts["host3"].agent.popen.wait(10) == 0
    tb.hosts["host3"].agent = None
    tb.start_agent("host3")
    tb.wait_mesh()


def test_leave_removes_the_node_everywhere_and_it_can_join_again(tb):
    agent = tb.hosts["host3"].agent
    res = subprocess.run([sys.executable, "-m", "vfab.cli", "--etcd", tb.etcd.endpoint, "node", "leave", "--name",
                          "host3"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "node host3: no endpoint on it owns a range: nothing to drain" in res.stderr
    assert "node host3 drained (0 range(s) of 0 endpoint(s) moved to other nodes) and left" in res.stdout
    wait_for(lambda: "host3" not in tb.peers("host1") and "host3" not in tb.peers("host2"), 10,
             "the others to drop their tunnels to host3")
    assert agent.popen.wait(10) == 0, agent.tail()     # its agent took its tunnels down and ended
    assert tb.peers("host3") == set()
    assert "left the fabric" in agent.tail()
    tb.hosts["host3"].agent = None
    tb.start_agent("host3")
    tb.wait_mesh()
    res = subprocess.run([sys.executable, "-m", "vfab.cli", "--etcd", tb.etcd.endpoint, "node", "leave", "--name",
                          "nosuch"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "node 'nosuch' is not registered (nodes: host1, host2, host3)" in res.stderr


def test_a_stopped_agent_leaves_its_tunnels_and_a_restarted_one_rejoins(tb):
    """Stopping the agent (SIGTERM) is not leaving: the host's tunnels stay (its data plane keeps forwarding),
    the others drop theirs only when its lease ends, and the agent started again rejoins."""
    own = tb.peers("host1")
    assert own == {"host2", "host3"}
    tb.stop_agent("host1")
    wait_for(lambda: "host1" not in nodes.nodes(tb.registry), 10, "host1's lease to end")
    assert tb.peers("host1") == own                      # its own tunnels were left in place
    wait_for(lambda: "host1" not in tb.peers("host2"), 10, "host2 to drop its tunnel to host1")
    tb.start_agent("host1")
    tb.wait_mesh()


def test_killed_host_is_dropped_then_rejoins(tb):
    member = tb.hosts["host2"].member
    tb.kill_host("host2")
    assert member is not None and not member.alive()      # its etcd member died with it; the other two serve
    wait_for(lambda: "host2" not in nodes.nodes(tb.registry), 10, "host2's lease to end")
    wait_for(lambda: "host2" not in tb.peers("host1") and "host2" not in tb.peers("host3"), 10,
             "the others to drop their tunnels to host2")
    tb.restart_host("host2")
    tb.wait_mesh()
    said = tb.registry.members.survey()                   # the member is back on its data, in the same cluster
    assert all(st.ok for st in said) and len({st.cluster_id for st in said}) == 1, said
    # its port came back with its switch (same database): frames reach it again
    route_vid(tb, "host1", "host2")
    rx2 = rx_socket(tb.ports["host2"])
    try:
        payload = os.urandom(24)
        send_frames(tb.ports["host1"], payload)
        assert received(rx2, payload)
    finally:
        rx2.close()
        route_vid(tb, "host1", "host3")


def test_partitioned_host_is_dropped_and_comes_back_when_healed(tb):
    route_vid(tb, "host1", "host3")
    tb.partition("host3")
    try:
        wait_for(lambda: "host3" not in nodes.nodes(tb.registry), 10, "host3's lease to end")
        wait_for(lambda: "host3" not in tb.peers("host1"), 10, "host1 to drop its tunnel to host3")
        rx3 = rx_socket(tb.ports["host3"])
        try:
            payload = os.urandom(20)
            send_frames(tb.ports["host1"], payload)
            assert not received(rx3, payload, timeout=0.5)
        finally:
            rx3.close()
    finally:
        tb.heal("host3")
    tb.wait_mesh()
    route_vid(tb, "host1", "host3")   # host1's tunnel port to host3 is a new one (a new port number)
    rx3 = rx_socket(tb.ports["host3"])
    try:
        payload = os.urandom(20)
        send_frames(tb.ports["host1"], payload)
        assert received(rx3, payload)
    finally:
        rx3.close()
    assert "registering again" in tb.hosts["host3"].agent.tail(50)


def test_an_etcd_list_with_a_dead_member_is_used_with_a_warning(tb):
    """A member list with dead members (one refusing, one whose address answers nobody) works through the live
    ones, naming the dead in a warning; a list with no live member is refused clearly.  Nothing else changes."""
    dead = "127.0.0.1:1,172.16.46.9:2379"
    own = tb.etcd_endpoint("host1")
    res = tb.node_in_ns("host1", "--etcd", f"{dead},{own}", "node", "list", "--json")
    assert res.returncode == 0, res.stderr
    assert set(json.loads(res.stdout)) == {"host1", "host2", "host3"}
    for member in dead.split(","):
        assert f"etcd: member {member} (listed in" in res.stderr and "does not answer" in res.stderr, res.stderr
    # an agent started on such a list joins and meshes as the others
    tb.stop_agent("host1")
    h = tb.hosts["host1"]
    h.agent = tb.sup.start("host1-agent", tb.join_command("host1", "--etcd", f"{dead},{own}"))
    tb.wait_mesh()
    wait_for(lambda: "does not answer" in h.agent.tail(50), 10, "the agent's warning about the dead members")
    # no live member at all: refused, saying which members and what to do
    res = tb.node_in_ns("host1", "--etcd", dead, "node", "list")
    assert res.returncode == 1 and "no etcd member of 127.0.0.1:1,172.16.46.9:2379 answers" in res.stderr, res.stderr
    tb.stop_agent("host1")
    tb.start_agent("host1")
    tb.wait_mesh()
