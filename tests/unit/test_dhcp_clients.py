"""sdhcp's wire format against unmodified DHCP clients: udhcpc (busybox), dhclient (ISC) and dhcpcd.

Each test makes a namespace pair ``vfd-<tag>c`` (client) / ``vfd-<tag>s`` (server) joined by a veth,
starts one real client in the client namespace with its own script, lease, pid and state files (so
nothing touches the host's /etc/resolv.conf or /var/lib), and plays the server with a few lines of
Python on a raw AF_PACKET socket in the server namespace, using only ``wire``, ``reply`` and
``ipudp``: every DISCOVER and REQUEST the client sends is parsed, every OFFER and ACK is built by
``reply.reply``, addressed by ``reply.destination`` and framed by ``ipudp``.  The client must take
the offer (REQUEST for the offered address), configure the address after the ACK (seen with
``ip -n NS addr``), see the options we sent (its script's environment), and renew by unicast with
ciaddr set, which we answer at ciaddr.  A NAK to a renewal makes udhcpc and dhclient start over.
Linux itself checks ipudp's checksums (it delivers our frames and counts corrupted ones).

A missing client fails naming its Debian package; not being root fails.  Processes are stopped by
PID (their own process group) and both namespaces deleted in teardown, also on failure.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Callable

import pytest

from vfab.services.sdhcp import ipudp, wire
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.reply import destination, reply, reply_limit
from vfab.services.sdhcp.wire import Message, MessageType, Opt
from vfab.testbed.dhcpclients import DHCPCD_CONF
from vfab.vid.netns import netns
from vfab.testbed.procs import wait_for

SERVER_IP = IPv4Address("192.0.2.1")
OFFERED = IPv4Address("192.0.2.77")
ROUTER, DNS = IPv4Address("192.0.2.254"), IPv4Address("192.0.2.53")
MASK = "255.255.255.0"
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
BCAST_IP, BCAST_MAC = IPv4Address("255.255.255.255"), b"\xff" * 6
UNICAST_REPLY_DELAY = 0.05  # see the renewal step
WAIT = 10.0  # seconds per step; a normal run needs < 0.1 s (dhcpcd: ~5.5 s of ARP probing after the ACK)


# ----------------------------------------------------------------------------- namespaces


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class NsPair:
    """Client namespace ``vfd-<tag>c`` with veth ``vfd<tag>c``, server namespace ``vfd-<tag>s`` with its
    peer ``vfd<tag>s`` (address SERVER_IP/24, so unicast renewals are routed and ARP is answered)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.cns, self.sns = f"vfd-{tag}c", f"vfd-{tag}s"
        self.cif, self.sif = f"vfd{tag}c", f"vfd{tag}s"

    def create(self) -> None:
        for ns in (self.cns, self.sns):
            run("ip", "netns", "add", ns)
            for knob in ("all", "default"):
                run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{knob}.disable_ipv6=1")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", self.cns, "link", "add", self.cif, "type", "veth", "peer", "name", self.sif, "netns", self.sns)
        # TESTBED-NOTES: the kernel's UDP checksums stay partial on a veth unless tx offload is off inside
        run("ip", "netns", "exec", self.cns, "ethtool", "-K", self.cif, "tx", "off")
        run("ip", "-n", self.sns, "addr", "add", f"{SERVER_IP}/24", "dev", self.sif)
        run("ip", "-n", self.cns, "link", "set", self.cif, "up")
        run("ip", "-n", self.sns, "link", "set", self.sif, "up")

    def delete(self) -> None:
        for ns in (self.cns, self.sns):
            run("ip", "netns", "del", ns, check=False)

    def client_mac(self) -> bytes:
        info = json.loads(run("ip", "-n", self.cns, "-j", "link", "show", self.cif).stdout)
        return bytes.fromhex(info[0]["address"].replace(":", ""))

    def client_addrs(self) -> list[str]:
        info = json.loads(run("ip", "-n", self.cns, "-j", "-4", "addr", "show", "dev", self.cif).stdout)
        return [f"{a['local']}/{a['prefixlen']}" for a in info[0].get("addr_info", [])] if info else []


@pytest.fixture
def pair():
    if os.geteuid() != 0:
        pytest.fail("the real-client tests need root (network namespaces, raw sockets): run them as root")
    p = NsPair()
    try:
        p.create()
        yield p
    finally:
        p.delete()
        left = run("ip", "netns", "list").stdout
        assert p.cns not in left and p.sns not in left, f"namespaces {p.cns}/{p.sns} were not removed"


# ----------------------------------------------------------------------------- the scripted server


class Responder:
    """A raw socket on the server-side veth: reads client messages, sends replies built by sdhcp."""

    def __init__(self, pair: NsPair) -> None:
        with netns(f"/var/run/netns/{pair.sns}"):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
            self.sock.bind((pair.sif, 0))
            # absorbs unicast renewals so that the kernel does not answer them with ICMP port unreachable
            self.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sink.bind(("0.0.0.0", 67))
        self.mac = self.sock.getsockname()[4]
        self.seen: list[tuple[ipudp.Datagram, Message]] = []
        self.bad: list[str] = []

    def close(self) -> None:
        self.sock.close()
        self.sink.close()

    def expect(self, what: str, match: Callable[[Message], bool], timeout: float = WAIT
               ) -> tuple[ipudp.Datagram, Message]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.sock], [], [], left)[0]:
                break
            frame, addr = self.sock.recvfrom(65536)
            if addr[2] == PACKET_OUTGOING:
                continue
            try:
                dg = ipudp.parse(frame)  # checksums verified: the client's (or its kernel's)
            except DhcpError as exc:
                self.bad.append(str(exc))
                continue
            if dg.dst_port != 67:
                continue
            msg = wire.parse(dg.payload)  # a DhcpError here fails the test: a real client's message
            self.seen.append((dg, msg))
            if match(msg):
                return dg, msg
        got = [f"{m.msg_type.name} xid={m.xid:#x}" for _, m in self.seen]
        pytest.fail(f"no {what} from the client within {timeout} s; saw {got or 'nothing'}; "
                    f"unparsable frames: {self.bad or 'none'}")

    def send(self, request: Message, answer: Message) -> ipudp.Datagram:
        dest = destination(request, answer)
        assert dest.mac is not None
        dg = ipudp.Datagram(dest.mac, self.mac, SERVER_IP, dest.ip, 67, dest.port,
                            answer.serialize(max_size=reply_limit(request)))
        self.sock.send(dg.serialize())
        return dg


# ----------------------------------------------------------------------------- clients


HOOK = """#!/bin/sh
# records each event's environment; udhcpc and dhclient also configure the address here
d={dir}
ev="${{reason:-$1}}"
env | sort > "$d/event.$ev.env.tmp" && mv "$d/event.$ev.env.tmp" "$d/event.$ev.env"  # whole or absent
echo "$ev" >> "$d/events"
case "$ev" in
  bound|renew) ip addr replace "$ip/$subnet" dev "$interface" ;;
  deconfig) ip -4 addr flush dev "$interface" ;;
  BOUND|RENEW|REBIND|REBOOT)
    [ "{client}" = dhclient ] && ip addr replace "$new_ip_address/$new_subnet_mask" dev "$interface" ;;
  EXPIRE|FAIL)
    [ "{client}" = dhclient ] && ip -4 addr flush dev "$interface" ;;
esac
exit 0
"""



@dataclass
class Client:
    name: str
    package: str  # the Debian package that provides it
    binary: str
    broadcast: bool = False  # asks for broadcast replies (udhcpc -B)

    def command(self, pair: NsPair, d: Path, script: Path) -> list[str]:
        if self.name.startswith("udhcpc"):
            cmd = ["busybox", "udhcpc", "-f", "-i", pair.cif, "-s", str(script), "-p", str(d / "pid"), "-t", "5",
                   "-T", "2"]
            return cmd + (["-B"] if self.broadcast else [])
        if self.name == "dhclient":
            (d / "dhclient.conf").write_text("")
            return ["dhclient", "-4", "-d", "-v", "-sf", str(script), "-lf", str(d / "leases"),
                    "-pf", str(d / "pid"), "-cf", str(d / "dhclient.conf"), "-df", str(d / "duid"), pair.cif]
        (d / "dhcpcd.conf").write_text(DHCPCD_CONF)
        # dhcpcd keeps its control socket in /run/dhcpcd and its DUID/leases in /var/lib/dhcpcd, shared by
        # every instance on the host: give this one private tmpfs copies in its own mount namespace
        inner = (f"mount -t tmpfs vfd-run /run && mkdir -p /run/dhcpcd && "
                 f"mount -t tmpfs vfd-lib /var/lib/dhcpcd && exec dhcpcd -B -4 -f {d / 'dhcpcd.conf'} "
                 f"-c {script} {pair.cif}")
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]

    def renew(self, proc: subprocess.Popen) -> None:
        """Make the client renew now: udhcpc and dhcpcd on SIGUSR1; dhclient has no renew-now
        (TESTBED-NOTES), it renews at T1, which the test sets short for it."""
        if self.name.startswith("udhcpc"):
            wait_for(lambda: not children(proc.pid), WAIT, "udhcpc's hook to finish", interval=0.02)
        if self.name != "dhclient":
            os.kill(proc.pid, signal.SIGUSR1)


CLIENTS = [
    Client("udhcpc", "busybox", "busybox"),
    Client("udhcpc-broadcast", "busybox", "busybox", broadcast=True),
    Client("dhclient", "isc-dhcp-client", "dhclient"),
    Client("dhcpcd", "dhcpcd-base", "dhcpcd"),
]


def require(client: Client) -> None:
    path = next((p for p in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]
                 if os.access(os.path.join(p, client.binary), os.X_OK)), None)
    if path is None:
        pytest.fail(f"{client.binary} is not installed: the Debian package {client.package} provides it "
                    "(make bootstrap installs it)")
    if client.binary == "busybox" and "udhcpc" not in run("busybox", "--list").stdout.split():
        pytest.fail("this busybox has no udhcpc applet: install the Debian package busybox")
    if client.binary == "dhclient" and "dhclient (enforce)" in apparmor_profiles():
        pytest.fail("AppArmor confines dhclient (profile /etc/apparmor.d/sbin.dhclient), which allows only "
                    "dhclient-script as hook and leases under /var/lib/dhcp: run 'aa-complain /etc/apparmor.d/sbin.dhclient' on this test host")


def apparmor_profiles() -> str:
    try:
        return Path("/sys/kernel/security/apparmor/profiles").read_text()
    except OSError:
        return ""


def stop(proc: subprocess.Popen) -> None:
    """Stop the client and whatever it forked: its own process group, which we created, by its id."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=3)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 3
    while live := alive_in_group(proc.pid):  # helpers that outlived the leader (dhcpcd privsep)
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            pytest.fail(f"processes {live} of group {proc.pid} did not exit after SIGKILL")
        time.sleep(0.02)


def alive_in_group(pgid: int) -> list[int]:
    """Members of a process group that are not yet dead (zombies wait for init to reap them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def children(pid: int) -> list[str]:
    """PIDs of the client's children (its hook script while it runs)."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def event_env(d: Path, event: str) -> Path | None:
    """The hook's environment for an event (udhcpc names events in lower case, the others upper)."""
    for name in (event, event.upper()):
        if (d / f"event.{name}.env").exists():
            return d / f"event.{name}.env"
    return None


class Running:
    """One real client started in the pair's client namespace, with the scripted server beside it."""

    def __init__(self, client: Client, pair: NsPair, d: Path) -> None:
        require(client)
        self.client, self.pair, self.dir = client, pair, d
        self.mac = pair.client_mac()
        script = d / "hook.sh"
        script.write_text(HOOK.format(dir=d, client=client.name))
        script.chmod(0o755)
        self.log = open(d / "client.log", "w")
        self.responder = Responder(pair)
        self.proc = subprocess.Popen(["ip", "netns", "exec", pair.cns, *client.command(pair, d, script)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def close(self) -> None:
        stop(self.proc)
        self.log.close()
        self.responder.close()

    def output(self) -> str:
        return (self.dir / "client.log").read_text()[-4000:]

    def discover(self) -> Message:
        """The client's DISCOVER, checked field by field against what the client is."""
        frame, disc = self.responder.expect("DISCOVER", lambda m: m.msg_type is MessageType.DISCOVER)
        mac, client = self.mac, self.client
        assert disc.op == wire.BOOTREQUEST and disc.htype == 1
        assert disc.chaddr == mac, f"chaddr {disc.chaddr.hex()} is not the interface MAC {mac.hex()}"
        assert frame.eth_src == mac and frame.eth_dst == BCAST_MAC and frame.dst_ip == BCAST_IP
        assert (frame.src_port, frame.dst_port) == (68, 67)
        assert disc.param_request_list, "no parameter request list"
        assert {Opt.SUBNET_MASK, Opt.ROUTER, Opt.DNS} <= set(disc.param_request_list)
        assert disc.broadcast == client.broadcast
        if client.name.startswith("udhcpc"):
            assert disc.client_id == b"\x01" + mac  # hardware type 1 + MAC
        elif client.name == "dhcpcd":
            # RFC 4361: type 255, 4-byte IAID, DUID (here DUID-LLT, which ends in the MAC)
            assert disc.client_id[0] == 255 and disc.client_id.endswith(mac), disc.client_id.hex()
        else:
            assert disc.client_id is None  # dhclient sends none unless configured to
        assert wire.parse(disc.serialize()) == disc
        return disc

    def offer(self, disc: Message, lease: dict) -> Message:
        sent = self.responder.send(disc, reply(disc, MessageType.OFFER, SERVER_IP, OFFERED, options=lease))
        assert (sent.dst_ip, sent.eth_dst) == ((BCAST_IP, BCAST_MAC) if self.client.broadcast else (OFFERED, self.mac))
        _, req = self.responder.expect("REQUEST for the offered address",
                                       lambda m: m.msg_type is MessageType.REQUEST and m.xid == disc.xid)
        assert req.requested_ip == OFFERED and req.server_id == SERVER_IP  # SELECTING, RFC 2131 §4.3.2
        assert req.ciaddr == IPv4Address(0) and req.chaddr == self.mac and req.client_id == disc.client_id
        return req

    def ack(self, req: Message, lease: dict) -> dict[str, str]:
        self.responder.send(req, reply(req, MessageType.ACK, SERVER_IP, OFFERED, options=lease))
        wait_for(lambda: f"{OFFERED}/24" in self.pair.client_addrs(), WAIT, f"{OFFERED}/24 on {self.pair.cif}", interval=0.02)
        return read_env(wait_for(lambda: event_env(self.dir, "bound"), WAIT, "the client's bound event", interval=0.02))


    def renewal(self, t1: int) -> Message:
        """Make the client renew; its REQUEST goes unicast to the server id with ciaddr set."""
        self.client.renew(self.proc)
        frame, renew = self.responder.expect("renewing REQUEST", lambda m: m.msg_type is MessageType.REQUEST
                                             and m.ciaddr == OFFERED, timeout=WAIT + t1)
        assert frame.dst_ip == SERVER_IP and frame.eth_dst == self.responder.mac and frame.src_ip == OFFERED
        assert renew.requested_ip is None and renew.server_id is None  # RENEWING, RFC 2131 §4.3.2
        # udhcpc sends a unicast renewal from a socket bound to ciaddr:68 and connected to the server,
        # then closes it: a reply that arrives before the close() lands on that socket and is lost
        # (udhcpc recovers 3 s later by rebinding).  A real server is rarely that fast; this one is.
        time.sleep(UNICAST_REPLY_DELAY)
        return renew

    def events(self) -> list[str]:
        path = self.dir / "events"
        return path.read_text().split() if path.exists() else []


# ----------------------------------------------------------------------------- conversations


@pytest.mark.parametrize("client", CLIENTS, ids=[c.name for c in CLIENTS])
def test_real_client_leases_and_renews(client: Client, pair: NsPair, tmp_path: Path) -> None:
    run_ = Running(client, pair, tmp_path)
    # dhclient renews only at T1: make T1 short for it; the others are told to renew by a signal
    t1 = 2 if client.name == "dhclient" else 300
    lease = {Opt.LEASE_TIME: 600, Opt.RENEWAL_TIME: t1, Opt.REBINDING_TIME: 525, Opt.SUBNET_MASK: MASK,
             Opt.ROUTER: [ROUTER], Opt.DNS: [DNS]}
    try:
        disc = run_.discover()
        req = run_.offer(disc, lease)
        check_env(client, run_.ack(req, lease), lease_time=600)

        # renewal: unicast to the server id with ciaddr set; our ACK goes back unicast to ciaddr
        renew = run_.renewal(t1)
        longer = lease | {Opt.LEASE_TIME: 1200, Opt.RENEWAL_TIME: 600, Opt.REBINDING_TIME: 1050}
        sent = run_.responder.send(renew, reply(renew, MessageType.ACK, SERVER_IP, OFFERED, options=longer))
        assert (sent.dst_ip, sent.eth_dst) == (OFFERED, run_.mac)
        env = read_env(wait_for(lambda: event_env(tmp_path, "renew"), WAIT, "the client's renew event", interval=0.02))
        check_env(client, env, lease_time=1200)
        assert f"{OFFERED}/24" in pair.client_addrs()
        assert run_.proc.poll() is None, f"{client.name} exited:\n{run_.output()}"
        for _, m in run_.responder.seen:  # what the client said, for the log (pytest -rA)
            print(f"{client.name}: {m.msg_type.name} xid={m.xid:#x} ciaddr={m.ciaddr} bcast={m.broadcast} "
                  f"options={[(c, v.hex()) for c, v in m.options.items()]}")
    except BaseException:
        print(f"--- {client.name} output ---\n{run_.output()}")
        raise
    finally:
        run_.close()


NAK_CLIENTS = [c for c in CLIENTS if c.name in ("udhcpc", "dhclient")]


@pytest.mark.parametrize("client", NAK_CLIENTS, ids=[c.name for c in NAK_CLIENTS])
def test_real_client_starts_over_after_nak(client: Client, pair: NsPair, tmp_path: Path) -> None:
    """A NAK to a renewal, built by reply() and broadcast as destination() says: the client drops the
    address and starts over with a DISCOVER.  (A NAK to the first REQUEST is no test: ISC dhclient
    ignores a NAK while it holds no lease, "DHCPNAK with no active lease"; udhcpc takes it.)"""
    run_ = Running(client, pair, tmp_path)
    t1 = 2 if client.name == "dhclient" else 300
    lease = {Opt.LEASE_TIME: 600, Opt.RENEWAL_TIME: t1, Opt.REBINDING_TIME: 525, Opt.SUBNET_MASK: MASK,
             Opt.ROUTER: [ROUTER], Opt.DNS: [DNS]}
    try:
        first = run_.discover()
        run_.ack(run_.offer(first, lease), lease)
        renew = run_.renewal(t1)
        nak = reply(renew, MessageType.NAK, SERVER_IP, options={Opt.MESSAGE: "lease moved"})
        sent = run_.responder.send(renew, nak)
        assert (sent.dst_ip, sent.eth_dst, sent.dst_port) == (BCAST_IP, BCAST_MAC, 68)
        # udhcpc waits 3 s after a NAK before it starts over (busybox: "avoid excessive network traffic")
        _, again = run_.responder.expect("a new DISCOVER after the NAK",
                                         lambda m: m.msg_type is MessageType.DISCOVER)
        assert again.chaddr == run_.mac and again.xid != first.xid
        assert f"{OFFERED}/24" not in pair.client_addrs(), "the client kept the address after the NAK"
        events = run_.events()
        assert ("nak" in events and "deconfig" in events) if client.name == "udhcpc" else "EXPIRE" in events, events
        (tmp_path / "event.bound.env").unlink(missing_ok=True)
        (tmp_path / "event.BOUND.env").unlink(missing_ok=True)
        check_env(client, run_.ack(run_.offer(again, lease), lease), lease_time=600)
    except BaseException:
        print(f"--- {client.name} output ---\n{run_.output()}")
        raise
    finally:
        run_.close()


def zero_sum_offer(disc: Message, lease: dict, server_mac: bytes) -> bytes:
    """Our OFFER to ``disc`` with two bytes of padding after its END option (which every client ignores)
    set so that its UDP checksum computes to 0, as 1 in 65,535 replies' does by their xid alone."""
    answer = reply(disc, MessageType.OFFER, SERVER_IP, OFFERED, options=lease)
    dest = destination(disc, answer)
    payload = bytearray(answer.serialize(max_size=reply_limit(disc)))
    payload += bytes(2 + len(payload) % 2)   # an even length, ending in two pad bytes of our own

    def build() -> bytes:
        return ipudp.udp_frame(dest.mac, server_mac, SERVER_IP.packed, dest.ip.packed, 67, dest.port, bytes(payload))

    payload[-2:] = build()[40:42]   # the checksum added to the data makes the sum 0xFFFF: a computed 0
    frame = build()
    assert frame[40:42] == b"\0\0", "the checksum did not compute to 0"
    assert ipudp.parse(frame).payload == bytes(payload)
    return frame


ZERO_SUM_CLIENTS = [c for c in CLIENTS if c.name in ("udhcpc", "dhclient", "dhcpcd")]


@pytest.mark.parametrize("client", ZERO_SUM_CLIENTS, ids=[c.name for c in ZERO_SUM_CLIENTS])
def test_real_client_takes_a_reply_whose_udp_checksum_computes_to_zero(client: Client, pair: NsPair,
                                                                      tmp_path: Path) -> None:
    """RFC 768 sends a computed 0 as 0xFFFF, but busybox udhcpc and dhcpcd compare the field with the 0 they
    compute and drop the reply (sent so, this test fails for both; ISC dhclient takes it): a udhcpc whose
    OFFER summed so retransmitted the same xid five times and got no lease (the lease bench, 2026-11-29).
    Sent as 0 ("none"), every client takes it."""
    run_ = Running(client, pair, tmp_path)
    lease = {Opt.LEASE_TIME: 600, Opt.RENEWAL_TIME: 300, Opt.REBINDING_TIME: 525, Opt.SUBNET_MASK: MASK,
             Opt.ROUTER: [ROUTER], Opt.DNS: [DNS]}
    try:
        disc = run_.discover()
        run_.responder.sock.send(zero_sum_offer(disc, lease, run_.responder.mac))
        _, req = run_.responder.expect("REQUEST for the offered address (the client took the OFFER)",
                                       lambda m: m.msg_type is MessageType.REQUEST and m.xid == disc.xid)
        assert req.requested_ip == OFFERED and req.server_id == SERVER_IP
        check_env(client, run_.ack(req, lease), lease_time=600)
    except BaseException:
        print(f"--- {client.name} output ---\n{run_.output()}")
        raise
    finally:
        run_.close()


def check_env(client: Client, env: dict[str, str], lease_time: int) -> None:
    """The options of our ACK as the client's hook received them."""
    if client.name.startswith("udhcpc"):
        got = (env["ip"], env["subnet"], env["router"].split()[0], env["dns"].split()[0], env["lease"],
               env["serverid"])
    else:
        got = (env["new_ip_address"], env["new_subnet_mask"], env["new_routers"].split()[0],
               env["new_domain_name_servers"].split()[0], env["new_dhcp_lease_time"],
               env["new_dhcp_server_identifier"])
    assert got == (str(OFFERED), MASK, str(ROUTER), str(DNS), str(lease_time), str(SERVER_IP)), env


# ----------------------------------------------------------------------------- checksums, checked by Linux


def snmp(ns: str, proto: str) -> dict[str, int]:
    lines = [line.split() for line in run("ip", "netns", "exec", ns, "cat", "/proc/net/snmp").stdout.splitlines()
             if line.startswith(f"{proto}:")]
    return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:])}


def test_kernel_checks_ipudp_checksums(pair: NsPair) -> None:
    """Linux's UDP stack delivers ipudp frames and drops corrupted ones (counting the checksum error);
    frames built by the kernel parse with both checksums verified, odd lengths included."""
    run("ip", "-n", pair.cns, "addr", "add", f"{OFFERED}/24", "dev", pair.cif)
    responder = Responder(pair)
    with netns(f"/var/run/netns/{pair.cns}"):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind((str(OFFERED), 6868))
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.settimeout(1.0)
    try:
        mac = pair.client_mac()
        for size in (0, 1, 300, 301, 1400, 1471):
            payload = bytes((size + i) & 0xFF for i in range(size))
            frame = ipudp.Datagram(mac, responder.mac, SERVER_IP, OFFERED, 4242, 6868, payload).serialize()
            responder.sock.send(frame)
            assert rx.recvfrom(2048) == (payload, (str(SERVER_IP), 4242)), f"{size} B not delivered"
        before = snmp(pair.cns, "Udp")["InCsumErrors"], snmp(pair.cns, "Ip")["InHdrErrors"]
        good = ipudp.Datagram(mac, responder.mac, SERVER_IP, OFFERED, 4242, 6868, b"corrupt me").serialize()
        bad_udp = good[:-1] + bytes((good[-1] ^ 1,))
        bad_ip = good[:24] + bytes((good[24] ^ 1,)) + good[25:]
        for frame in (bad_udp, bad_ip):
            responder.sock.send(frame)
        rx.settimeout(0.3)
        with pytest.raises(socket.timeout):
            rx.recvfrom(2048)
        after = snmp(pair.cns, "Udp")["InCsumErrors"], snmp(pair.cns, "Ip")["InHdrErrors"]
        assert after[0] == before[0] + 1 and after[1] == before[1] + 1, (before, after)

        for size in (1, 300, 301):  # the other way: the kernel builds, ipudp verifies
            tx.sendto(bytes(i & 0xFF for i in range(size)), (str(SERVER_IP), 67))
        got = []
        responder.sock.settimeout(WAIT)
        while len(got) < 3:
            frame, addr = responder.sock.recvfrom(65536)
            if addr[2] == PACKET_OUTGOING:  # our own frames from above, corrupted ones included
                continue
            try:
                d = ipudp.parse(frame)
            except DhcpError as exc:
                pytest.fail(f"a kernel-built frame did not verify: {exc}")
            if d.dst_port == 67:
                got.append(len(d.payload))
        assert got == [1, 300, 301]
    finally:
        rx.close()
        tx.close()
        responder.close()


def test_missing_client_fails_naming_its_package() -> None:
    with pytest.raises(pytest.fail.Exception, match="the Debian package isc-dhcp-client provides it"):
        require(Client("dhclient", "isc-dhcp-client", "vfd-no-such-dhclient"))
