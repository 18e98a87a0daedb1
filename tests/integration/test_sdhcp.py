"""sdhcp on real OVS + os-ken + etcd in Mininet (``line,2,3``), served to unmodified udhcpc, dhclient, dhcpcd.

Service ``dh`` (kind sdhcp: a dhcp4 front door) has three shards: ``s1`` on vfh1
owns the lower half of the key space, ``s2`` on vfh4 the upper half, mirrored
on ``s3`` (vfh6), which also takes a split later.  Each client host gets a MAC
whose low 24 bits (the key) put it where the test wants it (Mininet's own MACs
are 00:..:0N, all in one slot of the pool) and runs one real client with its
own hook script::

    vfh2  udhcpc   02:5d:00:20:00:02  key 0x200002 -> s1
    vfh3  dhclient 02:5d:00:60:00:03  key 0x600003 -> s1, then s3 (split)
    vfh5  dhcpcd   02:5d:00:a0:00:05  key 0xa00005 -> s2, then s1 (move)

Every DHCP frame reaches a shard only through the front door; replies come
from the VID of the client's key; ARP for the server address is answered by the
key's owner.  T1 is 5 s so dhclient and dhcpcd renew by themselves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from ipaddress import IPv4Address

import pytest

from tests.unit.test_dhcp_clients import DHCPCD_CONF, HOOK, children, stop
from tests.integration.conftest import frames_seen, guard_drops
from vfab.services.sdhcp import ipudp
from vfab.services.sdhcp.wire import Message, MessageType, Opt
from vfab.testbed.procs import wait_for
from vfab.vid import codec
from vfab.vid.netns import netns
from vfab.vid.ranges import Range
from vfab.vid.registry import schema
from vfab.vid.state import ctl as statectl

SVC = "dh"
SERVER = IPv4Address("192.168.77.1")
OPTS = {"pool": "192.168.77.10-192.168.77.250", "mask": "24", "server": str(SERVER), "router": "192.168.77.254",
        "dns": "192.168.77.53", "lease": "60", "t1": "5", "t2": "50"}
SHARDS = {"s1": ("vfh1", "0-0x7fffff"), "s2": ("vfh4", "0x800000-0xffffff"), "s3": ("vfh6", None)}
CLIENTS = {"udhcpc": ("vfh2", "02:5d:00:20:00:02"), "dhclient": ("vfh3", "02:5d:00:60:00:03"),
           "dhcpcd": ("vfh5", "02:5d:00:a0:00:05")}
UPPER_S1 = Range(0x400000, 0x7FFFFF)
WAIT = 20.0


def sh(tb, host: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(tb.host(host).pid), "-n", *cmd], capture_output=True, text=True,
                          check=check)


class RealClient:
    """One unmodified DHCP client in a fabric host, with its own hook, lease, pid and state files."""

    def __init__(self, tb, kind: str, host: str, workdir: str):
        self.tb, self.kind, self.host = tb, kind, host
        self.iface = tb.hosts[host]["iface"]
        self.dir = os.path.join(workdir, kind)
        os.makedirs(self.dir, exist_ok=True)
        self.script = os.path.join(self.dir, "hook.sh")
        with open(self.script, "w") as fh:
            fh.write(HOOK.format(dir=self.dir, client=kind))
        os.chmod(self.script, 0o755)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        d = self.dir
        if self.kind == "udhcpc":
            return ["busybox", "udhcpc", "-f", "-i", self.iface, "-s", self.script, "-p", f"{d}/pid", "-t", "5",
                    "-T", "2"]
        if self.kind == "dhclient":
            with open(f"{d}/dhclient.conf", "w"):
                pass
            return ["dhclient", "-4", "-d", "-v", *self.files(), self.iface]
        with open(f"{d}/dhcpcd.conf", "w") as fh:
            fh.write(DHCPCD_CONF)
        inner = (f"mount -t tmpfs vfd-run /run && mkdir -p /run/dhcpcd && mount -t tmpfs vfd-lib /var/lib/dhcpcd && "
                 f"exec dhcpcd -B -4 -f {d}/dhcpcd.conf -c {self.script} {self.iface}")
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]

    def files(self) -> list[str]:
        d = self.dir
        return ["-sf", self.script, "-lf", f"{d}/leases", "-pf", f"{d}/pid", "-cf", f"{d}/dhclient.conf",
                "-df", f"{d}/duid"]

    def start(self) -> None:
        log = open(os.path.join(self.dir, "client.log"), "a")
        self.proc = subprocess.Popen(["nsenter", "-t", str(self.tb.host(self.host).pid), "-n", *self.command()],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.tb.track(self.proc.pid, f"{self.kind}@{self.host}")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.tb.untrack(self.proc.pid)
            self.proc = None

    def events(self) -> list[str]:
        path = os.path.join(self.dir, "events")
        return open(path).read().split() if os.path.exists(path) else []

    def addrs(self) -> list[IPv4Address]:
        out = json.loads(sh(self.tb, self.host, "ip", "-j", "-4", "addr", "show", "dev", self.iface).stdout)
        info = out[0].get("addr_info", []) if out else []   # -4 lists no interface without an IPv4 address
        return [IPv4Address(a["local"]) for a in info if a["local"].startswith("192.168.77.")]

    def address(self, timeout: float = WAIT) -> IPv4Address:
        got = wait_for(lambda: self.addrs(), timeout, f"{self.kind} on {self.host} to configure an address")
        assert len(got) == 1, got
        return got[0]

    def wait_event(self, names: tuple[str, ...], after: int, timeout: float = WAIT) -> str:
        def seen():
            new = [e for e in self.events()[after:] if e in names]
            return new[0] if new else None
        return wait_for(seen, timeout, f"{self.kind}: one of {names} after event #{after} "
                                       f"(log: {self.output()[-600:]})")

    def output(self) -> str:
        try:
            return open(os.path.join(self.dir, "client.log")).read()
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.kind == "udhcpc":  # a signal while its hook runs is lost: wait for the hook to finish
            wait_for(lambda: not children(self.proc.pid), 5, "udhcpc's hook to finish")
        os.kill(self.proc.pid, sig)


def stats(tb, shard: str) -> dict:
    return statectl.command(tb.registry, SVC, shard, "STATS", {}).body["sdhcp"]


def counters(tb, shard: str) -> dict:
    return stats(tb, shard)["counters"]


def run_op(tb, start) -> None:
    op = statectl.wait(tb.registry, SVC, start().op, timeout=60)
    assert op.phase == "done", op


@pytest.fixture(scope="module")
def dh(testbed, tmp_path_factory):
    reg = testbed.registry
    workdir = str(tmp_path_factory.mktemp("sdhcp"))
    reg.create_service(SVC, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}], opts=OPTS)   # the shards read the pool
    for kind, (host, mac) in CLIENTS.items():
        iface = testbed.hosts[host]["iface"]
        for cmd in (("down",), ("address", mac), ("up",)):
            sh(testbed, host, "ip", "link", "set", "dev", iface, *cmd)
        info = testbed.hosts[host]
        reg.put_host(schema.Host(mac=mac, dpid=info["dpid"], port=info["port"], name=host))
    procs = {}
    for name, (host, listen) in SHARDS.items():
        out = os.path.join(workdir, f"{name}.out")
        args = ["-m", "vfab.services.sdhcp", "server", "--etcd", testbed.etcd_endpoint, "--service", SVC,
                "--name", name, "--iface", testbed.hosts[host]["iface"], "--data", os.path.join(workdir, "data"),
                *(["--listen", listen] if listen else [])]
        procs[name] = testbed.run_on(host, f"sdhcp-{name}", args, stdout=open(out, "wb"))
        wait_for(lambda: b"ready" in open(out, "rb").read() or not procs[name].alive(), 20, f"shard {name}")
        assert procs[name].alive(), procs[name].tail()
    run_op(testbed, lambda: statectl.mirror(reg, SVC, "s2", "s3"))
    testbed.wait_revision(reg.state_revision())
    clients = {kind: RealClient(testbed, kind, host, workdir) for kind, (host, _) in CLIENTS.items()}
    yield {"clients": clients, "procs": procs, "workdir": workdir, "addr": {}}
    for c in clients.values():
        c.stop()
    for name, p in procs.items():
        assert p.alive(), f"shard {name} died:\n{p.tail(40)}"
        log = open(p.logpath).read()
        assert "Traceback" not in log, log[-3000:]


def test_unmodified_clients_lease_through_the_front_door(testbed, dh):
    t0 = time.monotonic()
    for c in dh["clients"].values():
        c.start()
    for kind, c in dh["clients"].items():
        dh["addr"][kind] = c.address()
        c.wait_event(("bound", "BOUND"), 0)
    took = time.monotonic() - t0
    addrs = dh["addr"]
    assert len(set(addrs.values())) == 3, addrs
    first = int(IPv4Address(OPTS["pool"].split("-")[0]))
    for kind, (_, mac) in CLIENTS.items():
        # each got its first choice: the address whose home key is the nearest at or below its own key
        key = codec.mac_to_int(mac) & codec.KEY_MAX
        assert int(addrs[kind]) == first + (key * 241 >> 24), (kind, addrs[kind])
    s1, s2, s3 = (stats(testbed, s) for s in ("s1", "s2", "s3"))
    assert (s1["bound"], s2["bound"], s3["bound"]) == (2, 1, 0), (s1, s2, s3)
    assert s3["mirrored"]["bound"] == 1, "dhcpcd's lease is on s2's mirror (written there before the ACK)"
    # s1's range has no mirror: its native lane answers udhcpc's and dhclient's DISCOVERs and REQUESTs itself
    # (any the loop got instead, while its lease lapsed on a loaded machine or just after a frame it handed
    # over, it served the same way); s2's is mirrored on s3, so its loop served dhcpcd (the records go to the
    # mirror before the ACK)
    wait_for(lambda: stats(testbed, "s1")["native"]["granted"] == ["0x0-0x7fffff"], WAIT, "s1's lane granted")
    assert s1["native"]["offers"] + s1["native"]["acks"] >= 1, s1["native"]
    assert s2["native"]["offers"] == 0 and s2["native"]["acks"] == 0 and s2["native"]["granted"] == [], s2["native"]
    assert s2["counters"]["acks"] >= 1
    print(f"3 clients leased in {took:.1f} s: {addrs}")


def test_renew_release_and_obtain_again(testbed, dh):
    cl, addrs = dh["clients"], dh["addr"]
    # renew: udhcpc on SIGUSR1, dhcpcd on SIGUSR1, dhclient by itself at T1 (5 s)
    marks = {k: len(c.events()) for k, c in cl.items()}
    cl["udhcpc"].signal(signal.SIGUSR1)
    cl["dhcpcd"].signal(signal.SIGUSR1)
    for kind, c in cl.items():
        c.wait_event(("renew", "RENEW"), marks[kind])
        assert c.addrs() == [addrs[kind]]
    assert counters(testbed, "s1")["renewing"] >= 2 and counters(testbed, "s2")["renewing"] >= 1
    assert counters(testbed, "s1")["arp_replies"] >= 1, "the clients resolved the server address at s1"
    assert stats(testbed, "s1")["native"]["arp_replies"] >= 1, "s1's native lane answered their ARP"

    # rebind: dhcpcd on SIGHUP broadcasts a REQUEST with ciaddr (REBINDING, RFC 2131 §4.4.5)
    before = counters(testbed, "s2").get("rebinding", 0)
    mark = len(cl["dhcpcd"].events())
    cl["dhcpcd"].signal(signal.SIGHUP)
    cl["dhcpcd"].wait_event(("RENEW", "REBIND"), mark)
    assert counters(testbed, "s2")["rebinding"] == before + 1
    assert cl["dhcpcd"].addrs() == [addrs["dhcpcd"]]

    # release: udhcpc on SIGUSR2, dhclient -r, dhcpcd on SIGALRM (it releases and exits)
    released = {s: counters(testbed, s).get("releases", 0) for s in ("s1", "s2")}
    marks = {k: len(c.events()) for k, c in cl.items()}
    cl["udhcpc"].signal(signal.SIGUSR2)
    d = cl["dhclient"]
    sh(testbed, d.host, "dhclient", "-4", "-r", *d.files(), d.iface)
    d.proc.wait(10)
    d.stop()
    cl["dhcpcd"].signal(signal.SIGALRM)
    cl["dhcpcd"].proc.wait(10)
    cl["dhcpcd"].stop()
    wait_for(lambda: counters(testbed, "s1").get("releases", 0) >= released["s1"] + 2
             and counters(testbed, "s2").get("releases", 0) >= released["s2"] + 1, WAIT, "three RELEASEs")
    assert stats(testbed, "s1")["bound"] == 0 and stats(testbed, "s2")["bound"] == 0

    # and back: each gets its address again (the lease row remembers it)
    cl["udhcpc"].signal(signal.SIGUSR1)
    d.start()
    cl["dhcpcd"].start()
    for kind, c in cl.items():
        c.wait_event(("bound", "BOUND", "REBOOT"), marks[kind])
        assert c.address() == addrs[kind], kind


def test_split_and_move_take_the_leases_along(testbed, dh):
    """dhclient's key goes to s3 by a split of s1, dhcpcd's to s1 by a move of s2: each renews at its new
    shard with the same address; dhclient restarted afterwards INIT-REBOOTs at s3."""
    cl, addrs, reg = dh["clients"], dh["addr"], testbed.registry
    run_op(testbed, lambda: statectl.split(reg, SVC, UPPER_S1, "s3"))
    run_op(testbed, lambda: statectl.move(reg, SVC, "s2", "s1"))
    owners = {r.owner for r, _ in reg.ranges(SVC)}
    assert owners == {"s1", "s3"}, reg.ranges(SVC)
    before = {s: counters(testbed, s) for s in ("s1", "s3")}
    marks = {k: len(c.events()) for k, c in cl.items()}
    cl["dhcpcd"].signal(signal.SIGUSR1)
    cl["udhcpc"].signal(signal.SIGUSR1)
    for kind, c in cl.items():
        c.wait_event(("renew", "RENEW"), marks[kind])
        assert c.addrs() == [addrs[kind]], kind
    after = {s: counters(testbed, s) for s in ("s1", "s3")}
    assert after["s3"].get("renewing", 0) > before["s3"].get("renewing", 0), "dhclient renewed at s3"
    assert after["s1"].get("renewing", 0) >= before["s1"].get("renewing", 0) + 2, "udhcpc and dhcpcd at s1"
    assert after["s1"].get("naks", 0) == before["s1"].get("naks", 0) and after["s3"].get("naks", 0) == 0
    s1, s3 = stats(testbed, "s1"), stats(testbed, "s3")
    assert (s1["bound"], s3["bound"]) == (2, 1), (s1, s3)

    d = cl["dhclient"]
    d.stop()
    mark = len(d.events())
    d.start()
    assert d.wait_event(("REBOOT", "BOUND"), mark) == "REBOOT"
    assert d.addrs() == [addrs["dhclient"]]
    assert counters(testbed, "s3").get("init_reboot", 0) >= 1
    assert len(set(addrs.values())) == 3


def frame(src: bytes, dhcp: bytes, dst_ip: str = "255.255.255.255", src_port: int = 68) -> bytes:
    return ipudp.Datagram(b"\xff" * 6, src, IPv4Address(0), IPv4Address(dst_ip), src_port, 67, dhcp).serialize()


def test_bad_input_is_dropped_and_counted_and_service_goes_on(testbed, dh):
    cl, addrs = dh["clients"], dh["addr"]
    host, mac_s = CLIENTS["udhcpc"]
    mac = codec.mac_to_int(mac_s).to_bytes(6, "big")
    victim = codec.mac_to_int(CLIENTS["dhcpcd"][1]).to_bytes(6, "big")
    before = counters(testbed, "s1")                      # the owner of the sender's key (0x200002)
    good = Message(op=1, xid=1, chaddr=mac, options={Opt.MSG_TYPE: bytes([MessageType.DISCOVER])}).serialize()
    bad = [
        frame(mac, b"\x01\x01\x06" + bytes(60)),                                      # truncated DHCP
        frame(mac, good[:240] + bytes([53, 1, 1]) + b"\x33" * 20),                    # no end option
        frame(mac, bytes([2]) + good[1:]),                                            # op 2 (BOOTREPLY)
        (lambda f: f[:-1] + bytes([f[-1] ^ 0x5A]))(frame(mac, good)),                 # bad UDP checksum
        frame(mac, Message(op=1, xid=2, chaddr=victim, ciaddr=addrs["dhcpcd"],        # forged RELEASE
                           options={Opt.MSG_TYPE: bytes([MessageType.RELEASE]),
                                    Opt.SERVER_ID: SERVER.packed}).serialize(), dst_ip=str(SERVER)),
    ]
    spoofs = [frame(mac, Message(op=1, xid=100 + i, chaddr=bytes([2, 0x66, 0, i, 0, 1]),      # pool exhaustion
                                 options={Opt.MSG_TYPE: bytes([MessageType.DISCOVER])}).serialize())
              for i in range(64)]
    with netns(testbed.netns(host)):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((testbed.hosts[host]["iface"], 0))
        for f in bad + spoofs:
            s.send(f)
    finally:
        s.close()
    wait_for(lambda: counters(testbed, "s1").get("spoofed", 0) >= before.get("spoofed", 0) + 65, WAIT,
             "the 65 spoofed requests counted at s1")
    after = counters(testbed, "s1")
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("malformed", "wrong_op", "bad_frames", "spoofed",
                                                           "offers", "releases")}
    assert grew["malformed"] >= 2 and grew["wrong_op"] >= 1 and grew["bad_frames"] >= 1, grew
    assert grew["offers"] == 0 and grew["releases"] == 0, grew
    # still serving, and the victim still holds its lease: it renews with the same address
    marks = {k: len(c.events()) for k, c in cl.items()}
    for kind in ("udhcpc", "dhcpcd"):
        cl[kind].signal(signal.SIGUSR1)
    for kind in ("udhcpc", "dhcpcd"):
        cl[kind].wait_event(("renew", "RENEW"), marks[kind])
        assert cl[kind].addrs() == [addrs[kind]]
    assert stats(testbed, "s1")["bound"] == 2
    # and the operator sees it per shard
    from click.testing import CliRunner

    from vfab.cli.main import cli
    res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, "sdhcp", "status", SVC, "--json"])
    assert res.exit_code == 0, res.output
    shown = {s["shard"]: s for s in json.loads(res.output)}
    assert (shown["s1"]["bound"], shown["s3"]["bound"], shown["s1"]["slice"] + shown["s3"]["slice"]) == (2, 1, 241)
    assert shown["s1"]["counters"]["spoofed"] >= 65 and shown["s2"]["owns"] == []
    res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, "sdhcp", "status", SVC])
    print(res.output)


def test_a_rogue_dhcp_server_reaches_no_client(testbed, dh):
    """A tenant on a client host answers DHCP itself (OFFERs and ACKs, 67 -> 68, broadcast and unicast to
    another client's MAC): before the guard they reached every client through the switches' plain-Ethernet
    flows.  Now the switches drop them at the tenant's port and count them; the real clients renew as before."""
    host, mac_s = CLIENTS["udhcpc"]
    rogue = codec.mac_to_int(mac_s).to_bytes(6, "big")
    victim_host, victim_s = CLIENTS["dhclient"]
    victim = codec.mac_to_int(victim_s).to_bytes(6, "big")
    sid = testbed.registry.service(SVC).id
    before = guard_drops(testbed, sid)
    answers = []
    for i, (dst, kind) in enumerate([(b"\xff" * 6, MessageType.OFFER), (victim, MessageType.ACK)] * 25):
        msg = Message(op=2, xid=0x5000 + i, chaddr=victim, yiaddr=IPv4Address("192.168.77.99"),
                      options={Opt.MSG_TYPE: bytes([kind]), Opt.SERVER_ID: IPv4Address("192.168.77.66").packed,
                               Opt.LEASE_TIME: (3600).to_bytes(4, "big")})
        answers.append(ipudp.Datagram(dst, rogue, IPv4Address("192.168.77.66"), IPv4Address("255.255.255.255"),
                                      67, 68, msg.serialize()).serialize())
    got = frames_seen(testbed, host, answers, victim_host)
    assert got == 0, f"{got} of the rogue server's {len(answers)} answers reached the dhclient host"
    wait_for(lambda: guard_drops(testbed, sid) >= before + len(answers), WAIT,
             f"the switches to count the {len(answers)} rogue answers (guard/{sid})")
    from click.testing import CliRunner

    from vfab.cli.main import cli
    res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, "services"])
    row = next(ln for ln in res.output.splitlines() if ln.strip("│ ").startswith(SVC + " "))
    assert "dhcp4" in row and str(guard_drops(testbed, sid)) in row, res.output
    # the real clients are still answered by the shards
    cl, addrs = dh["clients"], dh["addr"]
    mark = len(cl["udhcpc"].events())
    cl["udhcpc"].signal(signal.SIGUSR1)
    cl["udhcpc"].wait_event(("renew", "RENEW"), mark)
    assert cl["udhcpc"].addrs() == [addrs["udhcpc"]]


def test_a_rogue_servers_answers_to_a_relay_reach_no_relay(testbed, dh):
    """A tenant answers as a DHCP server to a relay (BOOTREPLY, 67 -> 67, to the relay's MAC and broadcast):
    the dhcp4 door takes every datagram to port 67 from a host port into the service (as it would a relay's
    request), so none reaches the would-be relay; the shard owning the sender's key drops them as the wrong
    op and counts them."""
    host, mac_s = CLIENTS["udhcpc"]
    rogue = codec.mac_to_int(mac_s).to_bytes(6, "big")
    relay_host, relay_s = CLIENTS["dhclient"]
    relay = codec.mac_to_int(relay_s).to_bytes(6, "big")
    before = counters(testbed, "s1")                      # the owner of the sender's key (0x200002)
    answers = []
    for i, dst in enumerate([relay, b"\xff" * 6] * 10):
        msg = Message(op=2, xid=0x6000 + i, chaddr=bytes([2, 0x77, 0, 0, 0, i]), yiaddr=IPv4Address("192.168.77.98"),
                      giaddr=IPv4Address("192.168.77.3"),
                      options={Opt.MSG_TYPE: bytes([MessageType.ACK]), Opt.SERVER_ID: IPv4Address("192.168.77.66").packed,
                               Opt.LEASE_TIME: (3600).to_bytes(4, "big")})
        answers.append(ipudp.Datagram(dst, rogue, IPv4Address("192.168.77.66"), IPv4Address("192.168.77.3"),
                                      67, 67, msg.serialize()).serialize())
    got = frames_seen(testbed, host, answers, relay_host)
    assert got == 0, f"{got} of the rogue server's {len(answers)} answers to a relay reached the relay's host"
    wait_for(lambda: counters(testbed, "s1").get("wrong_op", 0) >= before.get("wrong_op", 0) + len(answers), WAIT,
             f"s1 to drop the {len(answers)} answers as the wrong op")


def test_a_dhcp_hosts_leased_address_is_its_only_way_through_a_source_guarded_door(testbed, dh):
    """A host whose address comes from DHCP cannot be registered with it, so a tenant there could send
    requests to a udp door (memcached's) from another client's address and have the answers reflected to
    it.  Registered with ``dhcp``, the host reaches such a door only from the address its lease binds: the
    shard holding the lease publishes the binding (at once when the host is marked, again at each ACK), the
    switches take its requests from that address (nothing from any other address, nothing after its
    RELEASE, nothing once the binding's lease ended) and count the rest as spoofed."""
    reg = testbed.registry
    host, mac_s = CLIENTS["udhcpc"]
    sink_host, sink_mac = CLIENTS["dhclient"]       # a port standing for the door's server (rx=ovs)
    door_ip = IPv4Address("192.168.77.200")
    reg.create_service("gd", frontdoors=[{"kind": "udp", "ip": str(door_ip), "port": 9999}])
    sid = reg.service("gd").id
    lease = reg.lease(60)   # revoked at the end (no keepalive: the test is shorter)
    reg.announce(schema.Endpoint(service="gd", name="sink", mac=sink_mac, rx="ovs", host=sink_host), lease=lease)
    reg.assign("gd", Range(0, codec.KEY_MAX), "sink")
    from click.testing import CliRunner

    from vfab.cli.main import cli

    def vfab(*args: str) -> str:
        res = CliRunner().invoke(cli, ["--etcd", testbed.etcd_endpoint, *args])
        assert res.exit_code == 0, res.output
        return res.output

    assert "applied on all switches" in vfab("host", "set", mac_s, "--dhcp")
    cl = dh["clients"]["udhcpc"]
    leased = cl.address()
    src = codec.mac_to_int(mac_s).to_bytes(6, "big")
    dst = codec.mac_to_int(testbed.hosts[sink_host]["mac"]).to_bytes(6, "big")

    def through(ip: IPv4Address, n: int = 10) -> int:
        """How many of ``n`` datagrams from ``ip`` on the udhcpc host reach the door's server."""
        frames = [ipudp.Datagram(dst, src, ip, door_ip, 41000 + i, 9999, b"ping %d" % i).serialize()
                  for i in range(n)]

        def ours(f: bytes) -> bool:
            try:
                dg = ipudp.parse(f, verify=False)
            except Exception:  # noqa: BLE001 - anything else on the sink's port is not ours
                return False
            return dg.dst_ip == door_ip and dg.dst_port == 9999 and 41000 <= dg.src_port < 41000 + n
        return frames_seen(testbed, host, frames, sink_host, seen=ours)

    def binding():
        got = reg.get(schema.binding_key(mac_s))
        return schema.Binding.from_json(got[0]) if got else None

    try:
        spoofed0 = guard_drops(testbed, sid, "spoofed")
        b = wait_for(binding, 5, "the shard to publish the lease of the host just marked dhcp")
        assert (b.ip, b.service, b.shard) == (str(leased), SVC, "s1") and b.until > time.time() + 30, b
        mark = len(cl.events())
        cl.signal(signal.SIGUSR1)                                # renew: the ACK binds again, to a later end
        cl.wait_event(("renew", "RENEW"), mark)
        wait_for(lambda: binding().until > b.until, WAIT, "the shard to publish the renewed lease's end")
        testbed.wait_revision(reg.state_revision())
        assert through(leased) == 10
        assert through(IPv4Address("192.168.77.222")) == 0       # another address: spoofed
        assert stats(testbed, "s1")["bindings"]["published"] >= 1
        row = next(ln for ln in vfab("hosts").splitlines() if mac_s in ln)
        assert "dhcp" in row and f"{leased} (lease from {SVC}/s1" in row, row
        cl.signal(signal.SIGUSR2)                                # RELEASE: the binding goes
        wait_for(lambda: binding() is None, WAIT, "the shard to delete the released binding")
        testbed.wait_revision(reg.state_revision())
        assert through(leased) == 0
        wait_for(lambda: guard_drops(testbed, sid, "spoofed") >= spoofed0 + 20, WAIT,
                 "the switches to count the 20 requests from addresses not bound (spoofed/<gd>)")
        # a binding whose lease ends guards no more, with no etcd write: the controller plans that round
        ends = time.time() + 2.0
        reg.put(schema.binding_key(mac_s), schema.Binding(mac=mac_s, ip=str(leased), until=ends, service=SVC,
                                                          shard="s1").to_json())
        testbed.wait_revision(reg.state_revision())
        assert through(leased) == 10
        time.sleep(max(0.0, ends - time.time()))
        wait_for(lambda: through(leased, 3) == 0, WAIT, "the controller to take the ended binding's flow away")
        reg.delete(schema.binding_key(mac_s))
    finally:
        vfab("host", "set", mac_s, "--no-dhcp")
        reg.revoke(lease)
        reg.delete_service("gd")
        testbed.wait_revision(reg.state_revision())
    mark = len(cl.events())
    cl.signal(signal.SIGUSR1)                                    # it leases again, unguarded as before
    cl.wait_event(("bound", "BOUND"), mark)
    assert cl.address() == leased
