"""The control plane per host (issue 45, option (a)): a route agent on every emulated host programs only its
own switch from etcd; ranges cross hosts through the Geneve tunnels; a move between hosts under load loses no
frame; a route agent killed -9 leaves its switch forwarding, the other hosts apply the next change, and it
catches up when restarted.  Real parts: HostsTestbed(3) (a namespace + Open vSwitch each, node agents,
tunnels), etcd, the os-ken route agents (``python -m vfab.controller --node HOST``)."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import threading
import time

import pytest

from vfab.fabric import tunnels
from vfab.testbed.hosts import INT, HostsTestbed
from vfab.testbed.procs import wait_for
from vfab.vid import codec, frame
from vfab.vid.netns import netns
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

SID = 0x45
SERVICE = "xh"
KEY = 0x1234
RATE = 1000   # frames/s from the client during a move


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    bed = HostsTestbed(3, workdir=str(tmp_path_factory.mktemp("routeagents")), ttl=2)
    bed.start()
    try:
        bed.ports = {h: bed.add_port(h) for h in ("host1", "host2", "host3")}
        reg = bed.registry
        reg.create_service(SERVICE, sid=SID)
        for h, port in bed.ports.items():
            info = bed.hosts[h].ports[port]
            reg.put_host(schema.Host(mac=info["mac"], dpid=bed.hosts[h].dpid, port=info["ofport"], name=port))
        for h in ("host2", "host3"):   # the servers: one endpoint on host2's port, one on host3's
            reg.announce(schema.Endpoint(service=SERVICE, name=f"s{h[-1]}", mac=bed.hosts[h].ports[bed.ports[h]]["mac"]),
                         ttl=10)
        bed.start_route_agents()
        yield bed
    finally:
        logs = [p.logpath for h in bed.hosts.values() for p in h.procs if p.name.endswith("-route-6653")]
        bed.stop()
        for path in logs:
            with open(path) as fh:
                text = fh.read()
            assert "Traceback" not in text, f"a route agent raised ({path}):\n{text[-3000:]}"


def dpids(tb: HostsTestbed, hosts=("host1", "host2", "host3")) -> list[int]:
    return [tb.hosts[h].dpid for h in hosts]


def assign(tb: HostsTestbed, owner: str, hosts=("host1", "host2", "host3"), timeout: float = 15.0) -> int:
    rev = tb.registry.assign(SERVICE, Range(0, codec.KEY_MAX), owner)
    tb.registry.wait_applied(rev, timeout=timeout, dpids=dpids(tb, hosts))
    return rev


def vid(key: int = KEY) -> bytes:
    return codec.encode(SID, key).packed


class Stream:
    """Sequenced frames to ``vid()`` from host1's port; receivers on host2's and host3's ports record each
    sequence number they get (a frame rewritten to their MAC, rx=ovs)."""

    def __init__(self, tb: HostsTestbed):
        self.tb = tb
        self.stop = threading.Event()       # the receivers
        self.stop_tx = threading.Event()    # the sender (first: the frames in flight still land)
        self.sent = 0
        self.got: dict[str, list[int]] = {"host2": [], "host3": []}
        self.threads = [threading.Thread(target=self._rx, args=(h,), daemon=True) for h in self.got]
        self.threads.append(threading.Thread(target=self._tx, daemon=True))
        self.ready = threading.Barrier(3)

    def _sock(self, host: str, proto: int) -> socket.socket:
        with netns(f"/var/run/netns/{self.tb.ports[host]}"):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, proto)
        s.bind(("eth0", 0))
        return s

    def _rx(self, host: str) -> None:
        with self._sock(host, socket.htons(frame.ETH_TYPE)) as s:
            s.settimeout(0.1)
            self.ready.wait()
            while not self.stop.is_set():
                try:
                    data, addr = s.recvfrom(2048)
                except socket.timeout:
                    continue
                if addr[2] == socket.PACKET_OUTGOING:
                    continue
                try:
                    f = frame.parse(data)
                except frame.FrameError:
                    continue
                if f.payload == b"xhost":
                    self.got[host].append(f.seq)

    def _tx(self) -> None:
        src = bytes.fromhex(self.tb.hosts["host1"].ports[self.tb.ports["host1"]]["mac"].replace(":", ""))
        with self._sock("host1", 0) as s:
            self.ready.wait()
            nxt = time.monotonic()
            while not self.stop_tx.is_set():
                s.send(frame.pack(vid(), src, frame.FrameType.REQUEST, b"xhost", seq=self.sent))
                self.sent += 1
                nxt += 1.0 / RATE
                time.sleep(max(0.0, nxt - time.monotonic()))

    def __enter__(self) -> "Stream":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_tx.set()
        self.stop.set()
        for t in self.threads:
            t.join(5)

    def wait_at(self, host: str, n: int = 20, timeout: float = 10.0) -> None:
        start = len(self.got[host])
        wait_for(lambda: len(self.got[host]) >= start + n, timeout, f"{n} frames at {host}")

    def finish(self) -> tuple[int, list[int], list[int]]:
        """Stop sending, let the last frames land; (sent, lost seqs, seqs delivered twice)."""
        self.stop_tx.set()       # only the sender: the receivers run on until the frames in flight landed
        self.threads[-1].join(5)
        time.sleep(0.5)   # frames in flight (the receive loops still run)
        self.__exit__()
        got = self.got["host2"] + self.got["host3"]
        return self.sent, sorted(set(range(self.sent)) - set(got)), sorted({s for s in got if got.count(s) > 1})


def remote_flows(tb: HostsTestbed, host: str) -> list[str]:
    out = tb.hosts[host].ovs.ofctl("dump-flows", INT, "table=1").splitlines()
    return [line for line in out if "cookie=0xa" in line]   # Kind.REMOTE (10) in the cookie's top byte


def test_each_host_compiles_its_own_switch_and_a_client_on_host1_reaches_host3(tb):
    assign(tb, "s3")
    # host1 holds no flow per remote range: the whole key space is one prefix into the tunnel to host3, and its
    # twin for stragglers that came from host3 (back through IN_PORT)
    t13 = tb.tunnel_port("host1", "host3")
    flows = remote_flows(tb, "host1")
    plain = [f for f in flows if "in_port=" not in f]
    back = [f for f in flows if "in_port=" in f]
    assert len(plain) == len(back) == 1, flows
    assert f"output:{t13}" in plain[0] and f"in_port={t13}" in back[0] and "actions=IN_PORT" in back[0], flows
    with Stream(tb) as st:
        st.wait_at("host3")
        assert not st.got["host2"]
    # it crossed the tunnel: host3's switch counted frames in on its tunnel port from host1
    stats = tb.hosts["host3"].ovs.ofctl("dump-ports", INT, str(tb.tunnel_port("host3", "host1")))
    assert "rx pkts=0," not in stats.replace(" ", ""), stats


def test_move_from_host3_to_host2_under_load_loses_no_frame(tb):
    assign(tb, "s3")
    with Stream(tb) as st:
        st.wait_at("host3", 200)
        rev = assign(tb, "s2")
        st.wait_at("host2", 200)
        sent, lost, twice = st.finish()
    assert sent > 400 and not lost and not twice, f"{sent} sent, lost {lost[:20]}, twice {twice[:20]}"
    assert st.got["host2"] and st.got["host3"]
    # the order: host1 and host3 held the range until host2 (the new owner's host) reported the move applied
    for h in ("host1", "host3"):
        with open(tb.route_agent(h).logpath) as fh:
            held = [int(m) for m in re.findall(r"holding moved ranges until host2 reports revision (\d+)", fh.read())]
        assert any(r >= rev for r in held), (h, rev, held)


def test_kill9_of_a_route_agent_keeps_traffic_and_the_others_apply(tb):
    assign(tb, "s2")
    before = tb.registry.applied()[tb.hosts["host1"].dpid]
    tb.kill_route_agent("host1")
    with Stream(tb) as st:
        st.wait_at("host2", 100)         # host1's switch keeps forwarding with its agent dead
        rev = assign(tb, "s3", hosts=("host2", "host3"))    # the others apply the next change
        st.wait_at("host3", 200)         # host1 still sends to host2, whose switch passes it on to host3
        assert tb.registry.applied()[tb.hosts["host1"].dpid].revision == before.revision
        sent, lost, twice = st.finish()
    assert not lost and not twice, f"{sent} sent, lost {lost[:20]}"
    tb.start_route_agent("host1")
    tb.registry.wait_applied(rev, timeout=20, dpids=dpids(tb, ("host1",)))
    # reconciled without duplicating or dropping: the switch holds exactly what the agent compiled
    rec = tb.registry.applied()[tb.hosts["host1"].dpid]
    dumped = [line for line in tb.hosts["host1"].ovs.ofctl("dump-flows", INT).splitlines() if "cookie=" in line]
    assert len(dumped) == rec.flows, (len(dumped), rec.flows)
    t13 = tb.tunnel_port("host1", "host3")
    assert all(f"output:{t13}" in f for f in remote_flows(tb, "host1") if "in_port=" not in f)
    assert tunnels.port_name(tb.hosts["host3"].tunnel_ip) in tb.hosts["host1"].ovs.vsctl("list-ports", INT)


# -- fencing ------------------------------------------------------------------------------------------------
OF14 = 5
ROLE_MASTER = 2


def _of_read(s: socket.socket, xid: int | None, *more: int) -> tuple[int, bytes]:
    """(message type, body) of the next message answering ``xid`` or one of ``more`` (None: the next message;
    echo requests and others skipped), within 5 s."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        head = b""
        while len(head) < 8:
            head += s.recv(8 - len(head))
        _, mtype, length, rxid = struct.unpack("!BBHI", head)
        body = b""
        while len(body) < length - 8:
            body += s.recv(length - 8 - len(body))
        if xid is None or rxid == xid or rxid in more:
            return mtype, body
    raise TimeoutError(f"no answer to xid {xid} in 5 s")


def _of_connect(ns: str, port: int) -> socket.socket:
    with netns(f"/var/run/netns/{ns}"):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(struct.pack("!BBHI", OF14, 0, 8, 1))     # hello (the switch's carries an xid of its own)
    assert _of_read(s, None)[0] == 0
    return s


def _role(s: socket.socket, xid: int, gen: int) -> tuple[int, int]:
    """Role request MASTER with ``gen``: (reply type, error code or role)."""
    s.sendall(struct.pack("!BBHIIIQ", OF14, 24, 24, xid, ROLE_MASTER, 0, gen))
    mtype, body = _of_read(s, xid)
    return mtype, struct.unpack_from("!HH", body)[1] if mtype == 1 else struct.unpack_from("!I", body)[0]


def _write(s: socket.socket, xid: int, priority: int) -> tuple[int, int]:
    """A flow-mod, then a barrier: (1, error code) if the switch refused it, (21, 0) if it took it."""
    from vfab.controller import ofmsg
    from vfab.fabric.flows import FlowSpec, match

    s.sendall(ofmsg.flow_add(FlowSpec(0, priority, match(eth_type=0x88B5), (), 0xFE), xid))
    s.sendall(struct.pack("!BBHI", OF14, 20, 8, xid + 1))   # barrier
    mtype, body = _of_read(s, xid, xid + 1)     # an error for the flow-mod comes before the barrier's reply
    if mtype == 1:
        return 1, struct.unpack_from("!HH", body)[1]
    return mtype, 0


def test_open_vswitch_refuses_a_stale_masters_writes(tb):
    """The mechanism the route agents' fencing rests on, on this machine's Open vSwitch: after a MASTER with a
    newer generation_id, the older one's flow-mods are refused (OFPBRC_IS_SLAVE) and so is its role request
    (OFPRRFC_STALE); the newer one writes.  A scratch bridge of host3's own Open vSwitch, listening for two
    controllers."""
    h = tb.hosts["host3"]
    br, port = "vfnfence", 6690
    h.ovs.vsctl("add-br", br, "--", "set", "bridge", br, "datapath_type=netdev", "fail_mode=secure",
                "protocols=OpenFlow14", "--", "set-controller", br, f"ptcp:{port}:127.0.0.1")
    try:
        wait_for(lambda: in_ns_listening(h.ns, port), 10, "the bridge's OpenFlow listener")
        old, new = _of_connect(h.ns, port), _of_connect(h.ns, port)
        with old, new:
            assert _role(old, 10, 100) == (25, ROLE_MASTER)
            assert _write(old, 11, 7) == (21, 0)                      # the master writes
            assert _role(new, 20, 101) == (25, ROLE_MASTER)           # a newer election's winner
            assert _write(old, 12, 8) == (1, 10)                      # OFPBRC_IS_SLAVE: the old one is fenced
            assert _role(old, 14, 100) == (1, 0)                      # OFPRRFC_STALE: and cannot claim it back
            assert _write(new, 21, 9) == (21, 0)
        flows = h.ovs.ofctl("dump-flows", br)
        assert "priority=7" in flows and "priority=9" in flows and "priority=8" not in flows, flows
    finally:
        h.ovs.vsctl("--if-exists", "del-br", br)


def in_ns_listening(ns: str, port: int) -> bool:
    from vfab.testbed.hosts import in_ns

    return f"127.0.0.1:{port}" in in_ns(ns, "ss", "-ltn")


def test_a_paused_route_agent_is_fenced_and_a_standby_takes_over(tb):
    """host2's agent is SIGSTOPped; a standby agent (started earlier, waiting) wins the election, claims
    MASTER with the newer generation and applies the next range change; the paused one, resumed, never
    changes the switch again (the switch refuses it, or it sees its lease gone first and stands down)."""
    assign(tb, "s2")
    active = tb.route_agent("host2")
    standby = tb.start_route_agent("host2", 6654)
    try:
        wait_for(lambda: "standby" in open(standby.logpath).read(), 20, "the second agent standing by")
        os.kill(active.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: "active route agent" in open(standby.logpath).read(), 10, "the standby taking over")
        took = time.monotonic() - t0
        rev = assign(tb, "s3")                 # applied on host2 by the standby
        # host2 reported the revision while still holding the range (its report is its own part done); it turns
        # once host3 has reported: then its route points into the tunnel to host3
        t23 = tb.tunnel_port("host2", "host3")
        wait_for(lambda: any(f"output:{t23}" in f for f in remote_flows(tb, "host2")), 10, "host2 turning to host3")
        flows_then = tb.hosts["host2"].ovs.ofctl("dump-flows", INT, "--no-stats")
        os.kill(active.pid, signal.SIGCONT)
        wait_for(lambda: "standing down" in open(active.logpath).read() or "as a SLAVE" in open(active.logpath).read(),
                 10, "the resumed agent learning it no longer leads")
        time.sleep(1.0)                        # give it every chance to write
        assert tb.hosts["host2"].ovs.ofctl("dump-flows", INT, "--no-stats") == flows_then
        assert tb.registry.applied()[tb.hosts["host2"].dpid].revision >= rev
        assert took < 3.0, took
    finally:
        tb.kill_route_agent("host2", 6654)
        os.kill(active.pid, signal.SIGCONT)
    # the resumed agent campaigns again and, once the standby is gone, leads and applies the next change
    assign(tb, "s2", timeout=20)
