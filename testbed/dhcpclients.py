"""Many real DHCP clients behind one fabric port, the servers they are measured against, and a wire capture.

Mininet makes one namespace per host and one switch port per namespace; 245
(or 1,000) of them make the build and teardown slow and the flow tables large
for nothing the benchmarks need.  :class:`ClientFarm` gives each client its own
named namespace ``vfx<tag><i>`` with one macvlan device of the same name, a
child of a testbed host's interface (mode ``private``: children never hear
each other, only the fabric).  So every client has its own MAC, its own
kernel stack (its address is configured, unicast renewals and ARP work) and
runs an unmodified client, while the fabric sees one host port sourcing many
MACs: each is registered on that port (port security admits a port's
registered MACs only; the dhcp4 front door keys on the frame's source).  The
namespaces are written into the testbed's run record before they exist, so a
run that dies is swept by the next testbed.

The lower device already has transmit checksum offload off (the testbed does
that); a macvlan's own ``tx-checksum-ip-generic`` is fixed on but harmless:
the kernel completes the checksum when the frame reaches the lower device.

:class:`Capture` reads every DHCP frame that crosses a host's interface (the
macvlans' frames cross their lower device both ways) with kernel receive
timestamps, so the same clock times every server from the clients' side:
the first DISCOVER, each client's ACK, the addresses the ACKs carried.

ISC ``perfdhcp`` (``kea-admin``) always poses as a relay agent for DHCPv4: it
sends from UDP port 67 with ``giaddr`` set to its own address and ``hops`` 1,
from its interface's MAC, with ``chaddr`` running up from its ``-b mac=``
template (sequentially, not at random).  A server answers it at
giaddr:67.  :func:`perfdhcp` runs one in a farm namespace and parses its report.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address

from vfab.services.sdhcp import wire
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.wire import MessageType
from vfab.testbed.nsgate import GateProc, HeldStart
from vfab.vid import codec
from vfab.vid.netns import netns
from vfab.vid.registry import schema

NETNS_DIR = "/run/netns"
ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
PACKET_OUTGOING = 4

# One line per event: "<event> <ip> <unix time>"; udhcpc passes the event as $1 and the rest in the environment.
UDHCPC_HOOK = """#!/bin/busybox sh
# vfab client farm: record each event; configure the address when asked to (ADDR=1). busybox's shell and its
# $EPOCHREALTIME, not a 'date' process per event (0.4 of the 2.5 CPU-s a burst of 245 clients used here).
f="{dir}/$interface"
case "$1" in
  bound|renew)
    [ "{addr}" = 1 ] && ip addr replace "$ip/$subnet" dev "$interface"
    echo "$1 $ip $EPOCHREALTIME" >> "$f" ;;
  deconfig)
    [ "{addr}" = 1 ] && ip -4 addr flush dev "$interface"
    echo "$1 - $EPOCHREALTIME" >> "$f" ;;
  *) echo "$1 - $EPOCHREALTIME" >> "$f" ;;
esac
exit 0
"""

# dhclient and dhcpcd name events in $reason and pass the address as $new_ip_address: recorded in the udhcpc
# hook's words (bound, renew, deconfig) so the same readers work; dhcpcd sets its address itself.
HOOK = """#!/bin/sh
# vfab client farm ({client}): record each event like the udhcpc hook
f="{dir}/$interface"
t=$(date +%s.%N)
case "$reason" in
  BOUND|REBOOT) ev=bound ;;
  RENEW|REBIND) ev=renew ;;
  EXPIRE|FAIL|RELEASE|STOP|STOPPED|NAK|DEPARTED|NOCARRIER) ev=deconfig ;;
  *) echo "$reason - $t" >> "$f"; exit 0 ;;
esac
if [ "$ev" = deconfig ]; then
  [ "{client}" = dhclient ] && ip -4 addr flush dev "$interface"
  echo "deconfig - $t" >> "$f"
else
  [ "{client}" = dhclient ] && ip addr replace "$new_ip_address/$new_subnet_mask" dev "$interface"
  echo "$ev $new_ip_address $t" >> "$f"
fi
exit 0
"""

# Like Debian's /etc/dhcpcd.conf, minus IPv6 and its hooks.
DHCPCD_CONF = """duid
vendorclassid
option domain_name_servers, domain_name, domain_search, host_name
option rapid_commit
require dhcp_server_identifier
nodelay
ipv4only
"""


def quiet_ipv6() -> None:
    """No IPv6 in the calling thread's network namespace (its interfaces, and any added later).  Every client
    interface brought up with it sends duplicate-address probes, MLD reports and router solicitations (the
    last again and again, backing off, for as long as it lives): 245 of them put ~640 IPv6 megaflows, each an
    upcall, into the switch in the 10 s around a bench phase, on the CPU the servers under test share."""
    for which in ("default", "all"):
        with open(f"/proc/sys/net/ipv6/conf/{which}/disable_ipv6", "w") as fh:
            fh.write("1")


def _ip_batch(lines: list[str], netns_pid: int | None = None) -> None:
    cmd = ["ip", "-batch", "-"]
    if netns_pid is not None:
        cmd = ["nsenter", "-t", str(netns_pid), "-n", *cmd]
    res = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:600]}")


class ClientFarm:
    """``len(macs)`` client namespaces ``vfx<tag><i>``, each with a macvlan child of ``host``'s interface."""

    def __init__(self, tb, host: str, tag: str, macs: list[bytes], workdir: str):
        if len(tag) > 3 or not tag.isalnum():
            raise ValueError(f"tag {tag!r}: 1-3 letters or digits (interface names are at most 15 characters)")
        self.tb, self.host, self.tag, self.macs = tb, host, tag, list(macs)
        self.lower = tb.hosts[host]["iface"]
        self.names = [f"vfx{tag}{i}" for i in range(len(macs))]
        self.dir = os.path.join(workdir, f"farm-{tag}")
        self.procs: dict[int, subprocess.Popen | GateProc] = {}
        self.gates: list[HeldStart] = []   # held starts (their exit readers), until stop_all
        self.created = False

    # -- life cycle ---------------------------------------------------------
    def create(self) -> "ClientFarm":
        """Namespaces, macvlans (up, with their MACs), the MACs registered on the host's port."""
        os.makedirs(self.dir, exist_ok=True)
        self.tb.record.add("netns", *self.names)
        self.created = True
        _ip_batch([f"netns add {n}" for n in self.names])
        pid = self.tb.host(self.host).pid
        lines = []
        for n, mac in zip(self.names, self.macs):
            lines += [f"link add link {self.lower} name {n} address {codec.int_to_mac(int.from_bytes(mac, 'big'))} "
                      "type macvlan mode private", f"link set {n} netns {n}"]
        _ip_batch(lines, pid)
        for n in self.names:
            with netns(os.path.join(NETNS_DIR, n)):
                quiet_ipv6()
                _ip_batch(["link set lo up", f"link set {n} up"])
        info = self.tb.hosts[self.host]
        for n, mac in zip(self.names, self.macs):
            self.tb.registry.put_host(schema.Host(mac=codec.int_to_mac(int.from_bytes(mac, "big")),
                                                  dpid=info["dpid"], port=info["port"], name=n))
        return self

    def remove(self) -> None:
        self.stop_all()
        if self.created:
            existing = set(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else set()
            gone = [n for n in self.names if n in existing]
            if gone:
                _ip_batch([f"netns del {n}" for n in gone])
            self.created = False

    def __enter__(self) -> "ClientFarm":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()

    def ns(self, i: int) -> str:
        return os.path.join(NETNS_DIR, self.names[i])

    def sh(self, i: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", f"--net={self.ns(i)}", *cmd], capture_output=True, text=True, check=check)

    # -- udhcpc ---------------------------------------------------------------
    def hook(self, configure: bool) -> str:
        return _script(os.path.join(self.dir, f"hook{int(configure)}.sh"),
                       UDHCPC_HOOK.format(dir=self.dir, addr=int(configure)))

    def start_udhcpc(self, which: list[int] | None = None, once: bool = True, configure: bool = False,
                     extra: tuple[str, ...] = ()) -> None:
        """One busybox udhcpc per client (``once``: exit after the lease, or when none came after 5 tries)."""
        hook = self.hook(configure)
        started = []
        try:   # recorded together (one rewrite of the run record, not one per client: 245 cost 0.15 CPU-s)
            for i in range(len(self.names)) if which is None else which:
                p = subprocess.Popen(["nsenter", f"--net={self.ns(i)}", *self._udhcpc(i, hook, once, extra)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                started.append((p.pid, f"udhcpc@{self.names[i]}"))
                self.procs[i] = p
        finally:
            self.tb.track_many(started)

    def hold_udhcpc(self, which: list[int] | None = None, once: bool = True, configure: bool = False,
                    extra: tuple[str, ...] = ()) -> HeldStart:
        """``start_udhcpc``, held at a gate in their namespaces (``nsgate``): the clients start together
        at the returned gate's ``release()``, like hosts that boot at the same moment."""
        hook = self.hook(configure)
        idx = list(range(len(self.names)) if which is None else which)
        with open(os.path.join(self.dir, "nsgate.log"), "ab") as err:
            gate = HeldStart([(self.ns(i), self._udhcpc(i, hook, once, extra)) for i in idx], stderr=err)
        self.gates.append(gate)
        self.tb.track_many([(p.pid, f"udhcpc@{self.names[i]}") for i, p in zip(idx, gate.procs)])
        self.procs.update(zip(idx, gate.procs))
        return gate

    def _udhcpc(self, i: int, hook: str, once: bool, extra: tuple[str, ...]) -> list[str]:
        return ["busybox", "udhcpc", "-f", "-i", self.names[i], "-s", hook, "-t", "5", "-T", "2",
                *(("-q", "-n") if once else ("-A", "2")), *extra]

    def start_dhclient(self, i: int) -> None:
        """ISC dhclient for client ``i`` (foreground, its own lease, pid and DUID files; the hook sets the
        address).  It renews at T1."""
        n, d = self.names[i], self.dir
        hook = self._hook("dhclient")
        conf = os.path.join(d, "dhclient.conf")
        open(conf, "a").close()
        files = ["-sf", hook, "-lf", f"{d}/{n}.leases", "-pf", f"{d}/{n}.pid", "-cf", conf, "-df", f"{d}/{n}.duid"]
        self._spawn(i, "dhclient", ["dhclient", "-4", "-d", *files, n])

    def start_dhcpcd(self, i: int) -> None:
        """dhcpcd for client ``i``, in a mount namespace of its own with tmpfs ``/run`` and ``/var/lib/dhcpcd``
        (dhcpcd instances find each other through ``/run/dhcpcd``); it sets its address itself, after
        probing it with ARP (RFC 5227, about 5 s)."""
        n, d = self.names[i], self.dir
        conf = os.path.join(d, "dhcpcd.conf")
        with open(conf, "w") as fh:
            fh.write(DHCPCD_CONF)
        inner = ("mount -t tmpfs vfd-run /run && mkdir -p /run/dhcpcd && mount -t tmpfs vfd-lib /var/lib/dhcpcd && "
                 f"exec dhcpcd -B -4 -f {conf} -c {self._hook('dhcpcd')} {n}")
        self._spawn(i, "dhcpcd", ["unshare", "-m", "--propagation", "private", "sh", "-c", inner])

    def _hook(self, client: str) -> str:
        return _script(os.path.join(self.dir, f"hook-{client}.sh"), HOOK.format(dir=self.dir, client=client))

    def _spawn(self, i: int, what: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.dir, f"{self.names[i]}.{what}.log"), "ab")
        p = subprocess.Popen(["nsenter", f"--net={self.ns(i)}", *cmd], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        log.close()
        self.tb.track(p.pid, f"{what}@{self.names[i]}")
        self.procs[i] = p

    def wait_exit(self, timeout: float) -> int:
        """Wait until every client process ended (or ``timeout``); the number still running."""
        deadline = time.monotonic() + timeout
        for i, p in list(self.procs.items()):
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        left, ended = 0, []
        for i, p in list(self.procs.items()):
            if p.poll() is None:
                left += 1
            else:
                ended.append(p.pid)
                del self.procs[i]
        self.tb.untrack_many(ended)
        self.gates = [g for g in self.gates if any(p.poll() is None for p in g.procs)]
        return left

    def signal(self, sig: int, which: list[int] | None = None) -> int:
        sent = 0
        for i, p in self.procs.items():
            if (which is None or i in which) and p.poll() is None:
                os.kill(p.pid, sig)
                sent += 1
        return sent

    def stop_all(self) -> None:
        """SIGTERM to each client's process group (its own session: dhcpcd's helpers, a running hook), then
        SIGKILL to what is left after 5 s."""
        for p in self.procs.values():
            _signal_group(p, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(5)
            _signal_group(p, signal.SIGKILL)   # helpers that outlived the leader
        self.tb.untrack_many([p.pid for p in self.procs.values()])
        self.procs.clear()
        for gate in self.gates:
            gate.abandon()
        self.gates.clear()

    def events(self, i: int) -> list[tuple[str, str, float]]:
        """(event, address or '-', unix time) as the client's hook recorded them."""
        try:
            with open(os.path.join(self.dir, self.names[i])) as fh:
                rows = [ln.split() for ln in fh]
        except FileNotFoundError:
            return []
        return [(r[0], r[1], float(r[2])) for r in rows if len(r) == 3]

    def clear_events(self) -> None:
        for n in self.names:
            try:
                os.unlink(os.path.join(self.dir, n))
            except FileNotFoundError:
                pass

    def addresses(self) -> dict[int, str]:
        """Each client's address now, by its hook (the last bound/renew not followed by a deconfig)."""
        out = {}
        for i in range(len(self.names)):
            cur = None
            for ev, ip, _ in self.events(i):
                if ev in ("bound", "renew"):
                    cur = ip
                elif ev in ("deconfig", "leasefail", "nak"):
                    cur = None if ev == "deconfig" else cur
            if cur is not None:
                out[i] = cur
        return out

    def configured(self, i: int) -> list[str]:
        """The IPv4 addresses on client ``i``'s interface (the kernel's view)."""
        out = json.loads(self.sh(i, "ip", "-j", "-4", "addr", "show", "dev", self.names[i]).stdout or "[]")
        return [a["local"] for a in (out[0].get("addr_info", []) if out else [])]


def _script(path: str, text: str) -> str:
    """An executable script at ``path``; rewritten only when its text changed, and then by a rename (a client
    running the old one keeps it: writing into a script being executed fails with ETXTBSY)."""
    try:
        with open(path) as fh:
            if fh.read() == text:
                return path
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def _signal_group(p: subprocess.Popen | GateProc, sig: int) -> None:
    """``sig`` to the process group ``p`` leads (started with ``start_new_session``: it is ours alone)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def held_twice(farm: ClientFarm, until: float | None = None) -> list[str]:
    """Addresses two clients held at the same time, from the clients' own event logs.

    A client holds an address from its ``bound``/``renew`` until its next
    ``deconfig`` or a bound/renew with another address (or ``until``, default now)."""
    end = until or time.time()
    spans: dict[str, list[tuple[float, float, int]]] = {}
    for i in range(len(farm.names)):
        cur, since = None, 0.0
        for ev, ip, t in farm.events(i) + [("end", "-", end)]:
            if ev in ("bound", "renew") and ip == cur:
                continue
            if cur is not None and (ev in ("bound", "renew", "deconfig", "end")):
                spans.setdefault(cur, []).append((since, t, i))
                cur = None
            if ev in ("bound", "renew"):
                cur, since = ip, t
    bad = []
    for ip, lst in spans.items():
        lst.sort()
        for (a0, a1, ai), (b0, b1, bi) in zip(lst, lst[1:]):
            if ai != bi and b0 < a1:
                bad.append(f"{ip}: {farm.names[ai]} {a0:.3f}-{a1:.3f} and {farm.names[bi]} from {b0:.3f}")
    return bad


# -- the wire -----------------------------------------------------------------------------------
@dataclass
class Seen:
    t: float              # kernel receive time (unix)
    out: bool             # sent by this side (a client or relay behind the port)
    type: MessageType
    chaddr: bytes
    xid: int
    yiaddr: IPv4Address


class Capture:
    """Every DHCP message crossing a testbed host's interface, with kernel timestamps (a thread)."""

    def __init__(self, tb, host: str):
        with netns(tb.netns(host)):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((tb.hosts[host]["iface"], ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.settimeout(0.1)
        self.frames: list[tuple[float, bool, bytes]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"capture-{host}")
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                data, anc, _, addr = self.sock.recvmsg(2048, 64)
            except socket.timeout:
                continue
            except OSError:
                return
            if len(data) < 42 or data[12:14] != b"\x08\x00" or data[23] != 17:
                continue
            t = time.time()
            for level, kind, val in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", val[:16])
                    t = sec + nsec / 1e9
            self.frames.append((t, addr[2] == PACKET_OUTGOING, data))

    def mark(self) -> int:
        return len(self.frames)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(2)
        self.sock.close()

    def messages(self, since: int = 0) -> list[Seen]:
        out = []
        for t, outgoing, data in self.frames[since:]:
            ihl = (data[14] & 0x0F) * 4
            udp = 14 + ihl
            sport, dport = struct.unpack_from("!HH", data, udp)
            if 67 not in (sport, dport) and 68 not in (sport, dport):
                continue
            try:
                m = wire.parse(bytes(data[udp + 8:]))
            except DhcpError:
                continue
            if m.msg_type is None:
                continue
            out.append(Seen(t, outgoing, m.msg_type, bytes(m.chaddr), m.xid, m.yiaddr))
        return out


def dora(seen: list[Seen], chaddrs: set[bytes] | None = None) -> dict:
    """From the clients' side: time from the first DISCOVER to the last ACK, leases, latencies, addresses.

    ``start_spread_s``: from the first DISCOVER to the last client's first one (how long the clients took to
    start, which the server barely changes); ``tail_s``: from that one to the last ACK (``time_s`` minus the
    spread: the part that waits on the server).

    A client's latency runs from its first DISCOVER to its first ACK.  ``addresses``: chaddr → the address
    of its last ACK.  ``held_twice``: addresses ACKed to more than one chaddr.  ``unleased``: for up to 10
    clients with no ACK, what crossed the port for them (where a lease got stuck).  ``turnaround``: the
    server's part, seen from the port: from each DISCOVER to the first OFFER with its xid after it, and from
    each REQUEST to the first ACK or NAK with its xid after it (a retransmission starts a new wait; a reply
    answers every wait of its xid before it)."""
    first: dict[bytes, float] = {}
    waiting: dict[tuple[bytes, int, bool], list[float]] = collections.defaultdict(list)   # (chaddr, xid, request?)
    turn: dict[str, list[float]] = {"offer": [], "ack": []}
    acked: dict[bytes, float] = {}
    addr: dict[bytes, IPv4Address] = {}
    per: dict[bytes, collections.Counter] = collections.defaultdict(collections.Counter)
    discovers = requests = naks = offers = 0
    for s in sorted(seen, key=lambda s: s.t):
        if chaddrs is not None and s.chaddr not in chaddrs:
            continue
        per[s.chaddr][f"{'out' if s.out else 'in'} {s.type.name}"] += 1
        if s.out and s.type in (MessageType.DISCOVER, MessageType.REQUEST):
            waiting[(s.chaddr, s.xid, s.type is MessageType.REQUEST)].append(s.t)
        elif not s.out and s.type in (MessageType.OFFER, MessageType.ACK, MessageType.NAK):
            asked = waiting.pop((s.chaddr, s.xid, s.type is not MessageType.OFFER), [])
            turn["offer" if s.type is MessageType.OFFER else "ack"] += [s.t - t for t in asked]
        if s.out and s.type is MessageType.DISCOVER:
            discovers += 1
            first.setdefault(s.chaddr, s.t)
        elif s.out and s.type is MessageType.REQUEST:
            requests += 1
        elif not s.out and s.type is MessageType.OFFER:
            offers += 1
        elif not s.out and s.type is MessageType.ACK and s.chaddr in first:
            acked.setdefault(s.chaddr, s.t)
            addr[s.chaddr] = s.yiaddr
        elif not s.out and s.type is MessageType.NAK:
            naks += 1
    lat = [acked[c] - first[c] for c in acked]
    t0 = min(first.values()) if first else None
    took = (max(acked.values()) - t0) if acked else None
    spread = (max(first.values()) - t0) if first else None
    holders: dict[IPv4Address, set] = {}
    for c, a in addr.items():
        holders.setdefault(a, set()).add(c)
    return {"clients": len(first), "leased": len(acked), "time_s": round(took, 3) if took else None,
            "leases_per_s": round(len(acked) / took, 1) if took else 0.0, "latencies": lat, "turnaround": turn,
            "start_spread_s": round(spread, 3) if spread is not None else None,
            "tail_s": round(took - spread, 3) if took and spread is not None else None,
            "discovers": discovers, "offers": offers, "requests": requests, "naks": naks,
            "unleased": {c.hex(): dict(per[c]) for c in sorted(set(first) - set(acked))[:10]},
            "distinct_addresses": len(holders), "addresses": addr,
            "held_twice": sorted(str(a) for a, cs in holders.items() if len(cs) > 1)}


# -- perfdhcp ---------------------------------------------------------------------------------------
@dataclass
class PerfRun:
    popen: subprocess.Popen
    out: str
    report: dict = field(default_factory=dict)


def relay_mac(q: int, key_fn: str, parts: int = 4, first: int = 0x025E00000001) -> bytes:
    """A relay's MAC whose key (``vfab.vid.mackey`` ``key_fn``) lies in part ``q`` of ``parts`` equal parts of the
    key space: the first of a sequence from ``first``.  The dhcp4 door steers a relayed frame by the relay's MAC,
    so relay q's frames enter at part q's shard."""
    from vfab.vid import mackey

    mac = first
    while mackey.key(mac, key_fn) * parts >> 24 != q:
        mac += 1
    return mac.to_bytes(6, "big")


def perfdhcp_stride(per: int) -> int:
    """How far apart to put the first chaddrs of perfdhcp instances of ``per`` clients each: perfdhcp adds a
    client's number to its base's last bytes without a carry out of them, so each base is aligned."""
    return 1 << max(8, (per - 1).bit_length())


def perfdhcp(farm: ClientFarm, i: int, clients: int, base_mac: bytes, rate: int | None, wait_us: int = 500000,
             avalanche: bool = False, tb=None) -> PerfRun:
    """Start perfdhcp in farm namespace ``i``: ``clients`` DORAs from chaddr ``base_mac`` upwards."""
    out = os.path.join(farm.dir, f"perfdhcp-{farm.names[i]}-{int(time.time() * 1e3)}.txt")
    mac = ":".join(f"{b:02x}" for b in base_mac)
    cmd = ["nsenter", f"--net={farm.ns(i)}", "perfdhcp", "-4", "-R", str(clients), "-b", f"mac={mac}",
           "-W", str(wait_us), "-l", farm.names[i]]
    cmd += ["--scenario", "avalanche"] if avalanche else ["-n", str(clients), "-r", str(rate)]
    p = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    farm.tb.track(p.pid, f"perfdhcp@{farm.names[i]}")
    return PerfRun(p, out)


def finish_perfdhcp(farm: ClientFarm, run: PerfRun, timeout: float) -> dict:
    try:
        run.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        run.popen.send_signal(signal.SIGINT)   # it prints its report on SIGINT
        try:
            run.popen.wait(5)
        except subprocess.TimeoutExpired:
            run.popen.kill()
            run.popen.wait(5)
    farm.tb.untrack(run.popen.pid)
    text = open(run.out).read()
    run.report = parse_perfdhcp(text)
    run.report["exit"] = run.popen.returncode
    return run.report


def parse_perfdhcp(text: str) -> dict:
    """perfdhcp's report: per exchange ("DISCOVER-OFFER", "REQUEST-ACK") its counters and delays (ms), and the rate."""
    rep: dict = {}
    section = None
    for line in text.splitlines():
        if "Statistics for:" in line:
            section = line.split("Statistics for:")[1].strip(" *")
            rep[section] = {}
            continue
        m = re.match(r"\s*Rate:\s+([0-9.]+)", line)
        if m:
            rep["rate"] = float(m.group(1))
            continue
        m = re.match(r"\s*([a-z][a-z ]+?):\s+([0-9.]+)", line)
        if m and section:
            rep[section][m.group(1).strip()] = float(m.group(2))
    return rep


# -- peers: Kea and dnsmasq in a testbed host --------------------------------------------------------
def kea_config(iface: str, server: str, prefix: int, first: str, last: str, lease: int, leases: str) -> dict:
    """kea-dhcp4 with memfile (each lease written before the reply, never fsync'd) and raw sockets."""
    net = IPv4Address(int(IPv4Address(server)) & ~((1 << (32 - prefix)) - 1))
    return {"Dhcp4": {
        "interfaces-config": {"interfaces": [f"{iface}/{server}"], "dhcp-socket-type": "raw"},
        "lease-database": {"type": "memfile", "persist": True, "name": leases, "lfc-interval": 0},
        "valid-lifetime": lease, "renew-timer": lease // 2, "rebind-timer": lease * 7 // 8,
        "subnet4": [{"subnet": f"{net}/{prefix}", "pools": [{"pool": f"{first} - {last}"}], "interface": iface}],
        "loggers": [{"name": "kea-dhcp4", "output_options": [{"output": "stdout"}], "severity": "WARN"}]}}


def start_kea(tb, host: str, workdir: str, server: str, prefix: int, first: str, last: str, lease: int):
    d = os.path.join(workdir, "kea")
    os.makedirs(d, exist_ok=True)
    conf = os.path.join(d, "kea-dhcp4.json")
    with open(conf, "w") as fh:
        json.dump(kea_config(tb.hosts[host]["iface"], server, prefix, first, last, lease,
                             os.path.join(d, "leases.csv")), fh, indent=1)
    env = {"KEA_PIDFILE_DIR": d, "KEA_LOCKFILE_DIR": d, "KEA_LOGGER_DESTINATION": "stdout"}
    return tb.sup.start("kea-dhcp4", ["nsenter", "-t", str(tb.host(host).pid), "-n", "kea-dhcp4", "-c", conf],
                        env=env)


def start_dnsmasq(tb, host: str, workdir: str, first: str, last: str, prefix: int, lease: int):
    """dnsmasq as a DHCP server only (no DNS, no ping before an offer); it fsyncs its lease file per change."""
    d = os.path.join(workdir, "dnsmasq")
    os.makedirs(d, exist_ok=True)
    mask = str(IPv4Address((0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF))
    cmd = ["nsenter", "-t", str(tb.host(host).pid), "-n", "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null",
           "--port=0", "--no-ping", "--dhcp-authoritative", f"--interface={tb.hosts[host]['iface']}",
           "--bind-interfaces", f"--dhcp-range={first},{last},{mask},{max(lease, 120)}",
           f"--dhcp-leasefile={d}/leases", f"--pid-file={d}/pid", "--dhcp-lease-max=100000", "--user=root",
           "--log-facility=-"]
    return tb.sup.start("dnsmasq", cmd)


def host_address(tb, host: str, cidr: str, add: bool = True) -> None:
    """Add (or remove) an address on a testbed host's interface (the peers need one in the pool's subnet)."""
    subprocess.run(["nsenter", "-t", str(tb.host(host).pid), "-n", "ip", "addr", "add" if add else "del", cidr,
                    "dev", tb.hosts[host]["iface"]], check=add, capture_output=True)
