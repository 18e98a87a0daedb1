"""Time to lease 245 real udhcpc clients and 1,000 perfdhcp clients: sdhcp (1, 2, 4 shards) vs Kea vs dnsmasq.

One fabric and one run; every server sees the same clients, through the same
ports, in the same namespaces.  The fabric is one switch with 6 hosts
(``single,6``, ``--topo``), so every server's frames take one pass through
the switch.  Until 2026-11-29 it was ``line,2,3`` (vfh4-6 behind a second
switch, ``--topo line,2,3``): three of the four shards sat behind the link
between the switches and Kea did not, and each crossing is a second pass
through OVS's userspace datapath on the same two cores that run the clients
and servers, which a hardware switch would not charge the hosts (a profile of
the 245-udhcpc phase: ovs-vswitchd 119 ms of CPU beside 4 shards, 72 ms beside
Kea; docs/measurements.md, 2026-11-29, sixth session).

* **245 udhcpc** (busybox 1.35, unmodified): one process per client, each in
  its own namespace ``vfxu<i>`` with a macvlan child of vfh3's interface and
  its own MAC (random low 24 bits, so the keys spread over every shard), all
  registered on vfh3's port (``testbed/dhcpclients.py`` says why not 245
  Mininet hosts).  Started one by one from this process, as fast as it can
  (below); each exits after its lease (``-q``).
  Its hook script records the address it got (that is the clients' side).
  IPv6 is off in these namespaces (``quiet_ipv6``: otherwise each interface's
  router solicitations and MLD reports put ~640 megaflows into the switch
  around a phase).
* **245 udhcpc together** (since 2026-11-29, eighth session): 245 other
  clients (``vfxg<i>``, other MACs, same setup), forked beforehand and held in
  their namespaces by ``testbed/nsgate.py`` and released at one moment, as
  245 hosts that boot together would start (the paper's 245 nodes): after the
  release only the exec and the clients themselves run.  This phase follows
  the one-by-one phase on the same server, which then holds 245 leases.
* **1,000 perfdhcp clients** (ISC perfdhcp 2.2, ``kea-admin``): perfdhcp poses
  as a relay agent (giaddr = its address, UDP port 67, its interface's MAC,
  chaddr counting up from ``-b mac=``), so the 1,000 clients come from 4 relay
  namespaces ``vfxr<q>`` behind vfh2, each ``perfdhcp -R 250 -n 250 -r
  RATE/4 -W 500000``, relay *q*'s MAC and its clients' chaddrs in key quarter
  *q*: the dhcp4 front door steers a relayed frame by the relay's MAC, so one
  relay per quarter lets 4 shards each take their own relay's traffic (with
  one relay for all, every frame would enter at one shard and be forwarded).
  sdhcp serves them as trusted relays (``--opt relays=...``).  Runs at each
  total rate of ``--rates`` (500, 2,000 and 4,000/s), then as an **avalanche**
  (``--scenario avalanche``: every client at once, retransmitting until leased),
  fresh chaddrs per run.  Since 2026-12-07 (issue 44) the chaddrs are **numbered
  in sequence** across the 4 relays, as perfdhcp, vendors and Docker number
  MACs (``seq_base``), and the relays' MACs are picked so that each relay's
  *key* is in its quarter: the service's dhcp4 door keys by ``--keys``
  (``mac-hash``, what ``vfab service add`` writes; ``mac-low24``, the old key,
  puts every sequential chaddr in one quarter: one shard serves them all).  A
  relay's frames enter at its quarter's shard, which forwards each request
  whose client key another shard owns.  Each sdhcp run reports the ACKs per
  shard and their largest/smallest over the mean (``shard_acks``,
  ``shard_load_max_over_mean``); ``--servers`` may add ``sdhcp4low24`` (4
  shards under the old key, side by side).
* **A flood on a full pool**: then as many new perfdhcp clients as the pool
  has addresses left plus 1,000 (``FLOOD_BEYOND``), at 2,000/s, the same 4
  relays: every server fills its pool and then answers nothing; what it costs
  is the CPU per flood client (``--no-flood`` skips it).

* **A pool exactly as large as the clients** (``--exact``, since 2026-12-07, issue 44's address blocks): no
  udhcpc or flood phase; each perfdhcp phase (every rate and the avalanche) on a fresh server whose pool has
  exactly ``--perf`` addresses. A phase fails the bench unless every client is leased and every address used
  once; with 4 shards, a shard whose home slice is short borrows addresses from the others (blocks through
  etcd), and each shard's lends and ``borrow_ms_max`` are kept in the results (``shards_<phase>``).

Each server runs 3 times from scratch (no leases), in rounds (every server
once per round, the order reversed every other round, so a slow spell of the
shared machine weighs on all of them); the medians are printed last, and the
time ratio to Kea is the median of the rounds' ratios, with a 95 % bootstrap
interval of that median from 3 rounds on; every run's numbers are in the
results file.

Servers, one after the other:

* **sdhcp** with 1 shard (vfh1), 2 (vfh1, vfh4) and 4 (vfh1, vfh4, vfh5,
  vfh6), equal key ranges.  Durability: each batch of requests is
  one SQLite transaction; no ACK or NAK of a batch holding a REQUEST, RELEASE
  or DECLINE leaves before an fsync of the WAL that began after the batch
  committed (group commit: the shard's loop serves the next batches while that
  fsync runs, and one fsync covers all of them; its native lane runs the fsync
  itself and then serves, in one batch, what came meanwhile), a batch of only
  DISCOVERs (OFFERs: no lease yet) needs none; no mirrors here (with mirrors, every lease is also
  on each mirror's disk before the ACK).  sdhcp has no setting that skips the fsync
  before an ACK, so there is no row at Kea's durability.
* **Kea** (kea-dhcp4 2.2) in vfh1, memfile lease file (each lease written
  before the reply, never fsync'd: survives kill -9, not power loss), raw
  sockets.
* **dnsmasq** (2.90) in vfh1, ``--no-ping``, lease file in a temp dir
  (rewritten and fsync'd on every change, before the reply).

Measured on the wire (``Capture``: kernel timestamps on vfh3's and vfh2's
interfaces, which every client frame crosses both ways): time from the first
DISCOVER to the last ACK, split into the clients' start spread (to the last
client's first DISCOVER) and the tail after it, clients leased (an ACK seen), leases/s, each
client's first-DISCOVER-to-ACK latency (median, p99); the server's
turnaround (each DISCOVER to its OFFER, each REQUEST to its ACK or NAK, seen
at the same interfaces, so the switch's pass each way counts in it); perfdhcp's own drop
counts and mean delays; distinct addresses, and any address ACKed to two
clients (udhcpc: from the clients' hook records; perfdhcp: from the ACKs the
relays received); the CPU time (user + system, and system alone) the
server's processes used during the phase (all shards together), and per
leased client; the servers' CPU per second while idle, and etcd's over the
same 2 s before the first phase (4 idle shards' timers, lease keepalives and
load reports count in every phase's CPU; etcd's "idle" beside Kea is its own).  Everything shares 2 cores: the 245
udhcpc processes starting (fork, exec, a hook per event) take a good part of
their time, for every server alike.  "One by one" means this process
starts them one after the other, as fast as it can: how long that took is
printed beside that phase (``spawn_s``), a floor under its time (~0.6 s of
~0.6 s), and it stretches when the server's processes take CPU meanwhile.
Released together, the clients' DISCOVERs and REQUESTs come as a burst, and
a server that cannot take it loses frames; a client whose frame was lost
asks again after 2 s (``-T 2``), so such a round takes ~2.2 s: the frames
the server's own sockets dropped (full receive buffer, ``ss`` skmem ``d``)
are printed and kept (``server_socket_drops``).  So each phase
also reports the whole machine's busy CPU-seconds (``/proc/stat``, both cores),
the fabric's daemons' (etcd, the controller, ovs-vswitchd, which an sdhcp
shard's leases also keep busy) and this process's own (``bench_cpu_s``:
starting the clients, the capture): when both cores are busy through a phase,
its time is about that CPU work over two cores (2026-11-29, sixth session: ~1.2
busy CPU-s in the ~0.6 s of the 245 clients, for either server).

``--pin`` (since 2026-11-29, ninth session) gives the servers a core of their own, as on machines of
their own: this process and every client it starts on CPU 0, every server (each shard, Kea, dnsmasq) and
the fabric's daemons (etcd, the controller, ovs-vswitchd) on CPU 1, so what a server's processes spend no
longer slows the process starting the clients.  The clients then share one core, so the times are not
comparable with an unpinned run's, only the servers within the run.

Run: ``/opt/vfab-venv/bin/python bench/sdhcp_lease.py [--smoke] [--pin] [--rates 1000,2000] [--repeat N]
[--servers sdhcp4,kea] [--topo single,6] [--profile DIR] [--exact]`` (root; ``--smoke``: 20 udhcpc, 100 perfdhcp at 1,000/s, sdhcp with 1
and 2 shards, Kea, dnsmasq, one run each, ~35 s).
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_busy_s, parser, pin_threads, summary, write  # noqa: E402
from vfab.testbed import dhcpclients as dc  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402
from vfab.testbed.net import TopoError, TopoSpec  # noqa: E402
from vfab.vid import mackey  # noqa: E402
from vfab.vid.state import ctl as statectl  # noqa: E402
from vfab.vid.state.sched import proc_stat, run_seconds  # noqa: E402

# /19 since 2026-12-07: 490 udhcpc and 4 perfdhcp phases of 1,000 (3 rates and the avalanche) need 4,490
# addresses, more than the /20's 4,081
SERVER, PREFIX = "10.77.0.1", 19
FIRST, LAST = "10.77.0.10", "10.77.31.250"
RELAYS = [f"10.77.31.{251 + q}" for q in range(4)]
LEASE = 3600
OPTS = {"pool": f"{FIRST}-{LAST}", "mask": str(PREFIX), "server": SERVER, "lease": str(LEASE),
        "relays": ",".join(RELAYS)}
Q = 0x400000   # a quarter of the key space
SHARDS = {1: [("a", "vfh1", (0, 0xFFFFFF))],
          2: [("a", "vfh1", (0, 2 * Q - 1)), ("b", "vfh4", (2 * Q, 0xFFFFFF))],
          4: [("a", "vfh1", (0, Q - 1)), ("b", "vfh4", (Q, 2 * Q - 1)), ("c", "vfh5", (2 * Q, 3 * Q - 1)),
              ("d", "vfh6", (3 * Q, 0xFFFFFF))]}
PEER_HOST, UDHCPC_HOST, RELAY_HOST = "vfh1", "vfh3", "vfh2"
CLIENT_CPUS, SERVER_CPUS = {0}, {1}   # --pin
NOT_PHASES = ("shards", "idle_cpu_per_s", "idle_etcd_cpu_per_s")   # per-run entries that are not a phase's
TOGETHER = "udhcpc_together"
UDHCPC_PHASES = ("udhcpc", TOGETHER)   # one by one, and released together (each its own clients)
POOL_SIZE = int(ipaddress.IPv4Address(LAST)) - int(ipaddress.IPv4Address(FIRST)) + 1
FLOOD_RATE = 2000      # new clients per second in the flood phase
FLOOD_BEYOND = 1000    # flood clients beyond what is left of the pool
AVALANCHE = "avalanche"
KEY_FN = mackey.HASH   # the sdhcp services' key function (--keys)
EXACT = 0              # --exact: the pool has exactly this many addresses (each perfdhcp phase on a fresh server)


def pool_last() -> str:
    """The pool's last address: LAST, or with --exact the EXACT-th address from FIRST."""
    return str(ipaddress.IPv4Address(FIRST) + EXACT - 1) if EXACT else LAST


DURABILITY = {
    "sdhcp": "fsync of the SQLite WAL covering every batch holding a REQUEST, RELEASE or DECLINE before its "
             "ACKs/NAKs leave (group commit: one fsync for the batches committed while the last one ran); "
             "batches of only DISCOVERs (OFFERs) unsynced; no mirrors in this bench",
    "kea": "memfile: each lease written before the reply, never fsync'd (survives kill -9, not power loss)",
    "dnsmasq": "lease file rewritten and fsync'd on every change, before the reply",
}


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(user + system, system) CPU time of these processes (all their threads) so far: the total from
    ``run_seconds`` where it can be read, the system part from ``stat`` (clock ticks)."""
    total = system = 0.0
    for pid in pids:
        st = proc_stat(pid)
        if st is None:
            continue
        run = run_seconds(pid)
        total += st.cpu_s if run is None else run
        system += st.system_s
    return total, system


def cpu_used(pids: list[int], since: tuple[float, float], leased: int, clients: int | None = None) -> dict:
    """CPU used since ``since`` (a cpu_seconds reading): total, system, per leased client and per client."""
    now = cpu_seconds(pids)
    total, system = now[0] - since[0], now[1] - since[1]
    return {"server_cpu_s": round(total, 4), "server_cpu_sys_s": round(system, 3),
            "cpu_ms_per_lease": round(1000 * total / leased, 3) if leased else None,
            "cpu_ms_per_client": round(1000 * total / clients, 3) if clients else None}


def socket_drops(pids: list[int]) -> int:
    """Frames the servers' sockets dropped so far (``ss``'s skmem ``d``: a full receive buffer), summed over
    the packet and UDP sockets these processes hold, in their network namespaces."""
    spaces = {}
    for pid in pids:
        try:
            spaces.setdefault(os.stat(f"/proc/{pid}/ns/net").st_ino, pid)
        except FileNotFoundError:
            continue
    want, total = {str(p) for p in pids}, 0
    for pid in spaces.values():
        out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-H", "-0", "-u", "-a", "-m", "-p"],
                             capture_output=True, text=True).stdout
        for ln in re.sub(r"\n\s+", " ", out).splitlines():   # a socket's skmem may come on a line of its own
            if set(re.findall(r"pid=(\d+)", ln)) & want and (m := re.search(r"skmem:\(.*\bd(\d+)\)", ln)):
                total += int(m.group(1))
    return total


OVS_PIDFILE = "/run/openvswitch/ovs-vswitchd.pid"


def fabric_pids(tb: Testbed) -> dict[str, int]:
    """The fabric's own daemons, whose CPU each phase also reports: etcd, the controller, ovs-vswitchd."""
    pids = {"etcd": tb.etcd.pid if tb.etcd else None, "controller": tb.controller.pid if tb.controller else None}
    try:
        with open(OVS_PIDFILE) as fh:
            pids["ovs-vswitchd"] = int(fh.read().strip())
    except (OSError, ValueError):
        pass
    return {name: pid for name, pid in pids.items() if pid}


class MachineCpu:
    """Where a phase's CPU went: the whole machine's busy CPU-seconds (/proc/stat, both cores) and the fabric's
    daemons' (etcd, controller, ovs-vswitchd); the rest is the clients' processes, this bench and the kernel's
    work on their behalf.  The time to lease a burst here is about the machine's CPU work over its cores."""

    def __init__(self, tb: Testbed):
        self.pids = fabric_pids(tb)
        self.busy0 = cpu_busy_s()
        self.own0 = time.process_time()
        self.fabric0 = {name: cpu_seconds([pid])[0] for name, pid in self.pids.items()}

    def used(self) -> dict:
        return {"machine_busy_cpu_s": round(cpu_busy_s() - self.busy0, 3),
                "bench_cpu_s": round(time.process_time() - self.own0, 3),
                "fabric_cpu_s": {name: round(cpu_seconds([pid])[0] - self.fabric0[name], 3)
                                 for name, pid in self.pids.items()}}


def idle_cpu(pids: list[int], seconds: float = 2.0) -> float:
    """The servers' CPU seconds per second while no client asks anything."""
    c0 = cpu_seconds(pids)[0]
    time.sleep(seconds)
    return round((cpu_seconds(pids)[0] - c0) / seconds, 4)


SEQ_BASE = 0x000C01000000   # perfdhcp's chaddrs: one sequence (run r from SEQ_BASE + r * 2**16), as perfdhcp numbers them


def perf_base(run: int, q: int, per: int) -> bytes:
    """chaddr of relay q's first client in perfdhcp run ``run``: the relays' clients follow one another's
    (relay q from q * dc.perfdhcp_stride), so one run's chaddrs are numbered in sequence (with 250 a relay, 6
    numbers skipped between relays)."""
    return (SEQ_BASE + (run << 16) + q * dc.perfdhcp_stride(per)).to_bytes(6, "big")


def service_key_fn(server: str) -> str:
    return mackey.LOW24 if server.endswith("low24") else KEY_FN


def start_sdhcp(tb: Testbed, shards: int, profile: str | None = None, key_fn: str = mackey.HASH) -> tuple[str, list]:
    reg = tb.registry
    svc = f"dhlease{shards}"
    data = os.path.join(tb.workdir, f"data-{svc}")
    shutil.rmtree(data, ignore_errors=True)
    reg.create_service(svc, kind="sdhcp", frontdoors=[{"kind": "dhcp4", "key": key_fn}])
    opts = [a for k, v in {**OPTS, "pool": f"{FIRST}-{pool_last()}"}.items() for a in ("--opt", f"{k}={v}")]
    procs = []
    for name, host, (lo, hi) in SHARDS[shards]:
        out = os.path.join(tb.workdir, f"{svc}-{name}.out")
        args = ["-m", "vfab.services.sdhcp", "server", "--etcd", tb.etcd_endpoint, "--service", svc,
                "--name", name, "--iface", tb.hosts[host]["iface"], "--data", data,
                "--listen", f"{lo:#x}-{hi:#x}", *opts]
        if profile:  # cProfile writes its file when the shard exits (SIGTERM ends it cleanly)
            args = ["-m", "cProfile", "-o", os.path.join(profile, f"{svc}-{name}.prof"), *args]
        proc = tb.run_on(host, f"{svc}-{name}", args, stdout=open(out, "wb"))
        procs.append(proc)
        wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 30, f"shard {name}")
        if not proc.alive():
            raise RuntimeError(f"shard {name} died at start:\n{proc.tail()}")
    tb.wait_revision(reg.state_revision(), timeout=30)
    return svc, procs


def stop_sdhcp(tb: Testbed, svc: str, procs: list) -> dict:
    counters = {}
    for (name, _, _), p in zip(SHARDS[int(svc[7])], procs):
        try:
            body = statectl.command(tb.registry, svc, name, "STATS", {}).body["sdhcp"]
            counters[name] = {**body["counters"], "native": body.get("native", {}),   # what the lane served
                              "blocks": body.get("agent", {}), "parked": body.get("parked", 0)}
        except Exception as exc:  # noqa: BLE001 - a dead shard is reported, not fatal to the others' numbers
            counters[name] = {"error": str(exc)}
    for p in procs:
        tb.sup.stop(p)
    tb.registry.delete_service(svc)
    tb.wait_revision(tb.registry.state_revision(), timeout=30)
    return counters


def start_peer(tb: Testbed, kind: str):
    dc.host_address(tb, PEER_HOST, f"{SERVER}/{PREFIX}")
    workdir = os.path.join(tb.workdir, f"peer-{kind}")
    shutil.rmtree(workdir, ignore_errors=True)
    if kind == "kea":
        proc = dc.start_kea(tb, PEER_HOST, workdir, SERVER, PREFIX, FIRST, pool_last(), LEASE)
    else:
        proc = dc.start_dnsmasq(tb, PEER_HOST, workdir, FIRST, pool_last(), PREFIX, LEASE)
    time.sleep(1.0)  # neither says when its sockets are open; both open them within ~0.2 s here
    if not proc.alive():
        raise RuntimeError(f"{kind} exited at start:\n{proc.tail()}")
    return proc


def udhcpc_phase(tb: Testbed, farm: dc.ClientFarm, cap: dc.Capture, pids: list[int], together: bool) -> dict:
    """Every client of ``farm`` until it leased or gave up: started one by one from this process, or
    (``together``) forked and held in their namespaces beforehand and released at once."""
    farm.clear_events()
    gate = farm.hold_udhcpc(once=True) if together else None
    drops0 = socket_drops(pids)
    cpu0 = cpu_seconds(pids)
    machine = MachineCpu(tb)
    mark = cap.mark()
    t0 = time.monotonic()
    if gate is not None:
        gate.release()
    else:
        farm.start_udhcpc(once=True)
    spawn = time.monotonic() - t0   # one by one: this process starting the clients, a floor under the time
    left = farm.wait_exit(40)
    used = machine.used()
    used["server_socket_drops"] = socket_drops(pids) - drops0
    time.sleep(0.2)  # the capture thread's last frames
    res = dc.dora(cap.messages(mark), set(farm.macs))
    addrs = farm.addresses()
    held = dc.held_twice(farm)
    lat = res.pop("latencies")
    res.pop("addresses")
    turnaround(res)
    res.update(clients=len(farm.macs), dora=summary(lat), hook_leased=len(addrs), **cpu_used(pids, cpu0, res["leased"]),
               hook_distinct=len(set(addrs.values())), hook_held_twice=held, still_running=left, **used)
    if gate is None:
        res["spawn_s"] = round(spawn, 3)
    return res


def turnaround(res: dict) -> None:
    """The servers' part of the latency, seen at the clients' port (dhcpclients.dora): DISCOVER to OFFER and
    REQUEST to ACK/NAK, summarized."""
    turn = res.pop("turnaround")
    res["offer_turnaround"], res["ack_turnaround"] = summary(turn["offer"]), summary(turn["ack"])


def perf_phase(tb: Testbed, relays: dc.ClientFarm, cap: dc.Capture, n: int, rate: int | None, run: int,
               pids: list[int], shard_acks=None) -> dict:
    """``n`` perfdhcp clients from the 4 relays at ``rate`` in all (None: an avalanche); ``shard_acks``: a
    function giving each shard's ACKs so far (sdhcp), for the load per shard."""
    per = n // 4
    drops0 = socket_drops(pids)
    cpu0 = cpu_seconds(pids)
    acks0 = shard_acks() if shard_acks else None
    machine = MachineCpu(tb)
    mark = cap.mark()
    runs = [dc.perfdhcp(relays, q, per, perf_base(run, q, per), max(1, (rate or 4) // 4), avalanche=rate is None)
            for q in range(4)]
    reps = [dc.finish_perfdhcp(relays, r, timeout=per / max(1, (rate or 4 * per) // 4) + 30) for r in runs]
    used = machine.used()
    used["server_socket_drops"] = socket_drops(pids) - drops0
    if shard_acks:
        got = shard_acks()
        load = {k: got.get(k, 0) - acks0.get(k, 0) for k in got}
        mean = sum(load.values()) / len(load) if load else 0
        used["shard_acks"] = load
        used["shard_load_max_over_mean"] = round(max(load.values()) / mean, 3) if mean else None
        used["shard_load_min_over_mean"] = round(min(load.values()) / mean, 3) if mean else None
    time.sleep(0.2)
    chaddrs = {(int.from_bytes(perf_base(run, q, per), "big") + i).to_bytes(6, "big") for q in range(4)
               for i in range(per)}
    res = dc.dora(cap.messages(mark), chaddrs)
    lat = res.pop("latencies")
    res.pop("addresses")
    turnaround(res)
    drops = {k: int(sum(r.get(k, {}).get("drops", 0) for r in reps)) for k in ("DISCOVER-OFFER", "REQUEST-ACK")}
    mean = {k: round(sum(r.get(k, {}).get("avg delay", 0) for r in reps) / 4, 3)
            for k in ("DISCOVER-OFFER", "REQUEST-ACK")}
    res.update(clients=n, offered_rate=rate or "avalanche", dora=summary(lat), **cpu_used(pids, cpu0, res["leased"], n),
               perfdhcp_drops=drops, perfdhcp_mean_delay_ms=mean,
               perfdhcp_acks=int(sum(r.get("REQUEST-ACK", {}).get("received packets", 0) for r in reps)), **used)
    return res


def line(name: str, what: str, r: dict) -> str:
    d = r["dora"]
    extra = f", drops {r['perfdhcp_drops']}" if "perfdhcp_drops" in r else ""
    extra += f", server CPU {r['server_cpu_s']} s ({r['server_cpu_sys_s']} s system, {r['cpu_ms_per_lease']} ms/lease)"
    fabric = ", ".join(f"{k} {v}" for k, v in r.get("fabric_cpu_s", {}).items())
    extra += f"; machine busy {r.get('machine_busy_cpu_s')} CPU-s (fabric daemons: {fabric or 'none'})"
    if r.get("server_socket_drops"):
        extra += f"; the server's sockets dropped {r['server_socket_drops']} frames (receive buffer full)"
    return (f"{name:>9} {what:<18} {r['leased']:>4}/{r['clients']} leased in {r['time_s']} s "
            f"({r['leases_per_s']}/s), DORA median {d.get('median_ms')} ms p99 {d.get('p99_ms')} ms, "
            f"server turnaround median OFFER {r['offer_turnaround'].get('median_ms')} ms "
            f"ACK {r['ack_turnaround'].get('median_ms')} ms, "
            f"{r['distinct_addresses']} distinct{extra}; the last client started {r.get('start_spread_s')} s after "
            f"the first, its tail to the last ACK {r.get('tail_s')} s" +
            (f"; starting the clients took {r['spawn_s']} s" if "spawn_s" in r else ""))


def run_server(tb: Testbed, server: str, farms: dict[str, dc.ClientFarm], relays: dc.ClientFarm,
               cap_u: dc.Capture, cap_p: dc.Capture, n_p: int, rates: list, n_flood: int,
               profile: str | None, pin: bool = False, first_run: int = 0) -> dict:
    """One fresh server (no leases): the udhcpc clients started one by one, the other udhcpc clients released
    together, perfdhcp at each rate, then the flood that fills the pool (``n_flood`` new clients, 0: none).
    ``pin``: the server's and the fabric's threads on SERVER_CPUS before each phase (threads they start
    later inherit it)."""
    res: dict = {}
    acks = None
    if server.startswith("sdhcp"):
        svc, procs = start_sdhcp(tb, int(server[5]), profile, service_key_fn(server))
        pids = [p.pid for p in procs]

        def acks() -> dict[str, int]:
            return {name: statectl.command(tb.registry, svc, name, "STATS", {}).body["sdhcp"]["counters"].get("acks", 0)
                    for name, _, _ in SHARDS[int(server[5])]}
    else:
        peer = start_peer(tb, server)
        pids = [peer.pid]

    def pin_servers() -> None:
        if pin:
            for pid in pids + list(fabric_pids(tb).values()):
                pin_threads(pid, SERVER_CPUS)
    try:
        pin_servers()
        etcd = [tb.etcd.pid] if tb.etcd else []
        etcd0 = cpu_seconds(etcd)[0]
        res["idle_cpu_per_s"] = idle_cpu(pids)   # 2 s; etcd's over the same 2 s: what the idle servers cost it
        res["idle_etcd_cpu_per_s"] = round((cpu_seconds(etcd)[0] - etcd0) / 2.0, 4)
        for phase, farm in farms.items():
            pin_servers()
            res[phase] = udhcpc_phase(tb, farm, cap_u, pids, together=phase == TOGETHER)
            print(line(server, f"{len(farm.macs)} udhcpc" + (" together" if phase == TOGETHER else ""), res[phase]),
                  flush=True)
        for run, rate in enumerate(rates, first_run):
            pin_servers()
            r = perf_phase(tb, relays, cap_p, n_p, rate, run, pids, acks)
            res[f"perfdhcp_{rate or AVALANCHE}"] = r
            print(line(server, f"{n_p} perfdhcp@{rate or AVALANCHE}" + ("/s" if rate else ""), r) +
                  (f"; ACKs per shard {r['shard_acks']} (max/mean {r['shard_load_max_over_mean']})"
                   if "shard_acks" in r else ""), flush=True)
        if n_flood:
            pin_servers()
            r = perf_phase(tb, relays, cap_p, n_flood, FLOOD_RATE, len(rates), pids)
            res["flood"] = r
            print(line(server, f"{n_flood} flood@{FLOOD_RATE}/s", r) + f", {r['cpu_ms_per_client']} CPU-ms per client",
                  flush=True)
    finally:
        if server.startswith("sdhcp"):
            res["shards"] = stop_sdhcp(tb, svc, procs)
        else:
            tb.sup.stop(peer)
            dc.host_address(tb, PEER_HOST, f"{SERVER}/{PREFIX}", add=False)
    return res


def check(name: str, res: dict) -> list[str]:
    bad = []
    for phase, r in res.items():
        if phase in NOT_PHASES or phase.startswith("shards_"):
            continue
        if r.get("held_twice") or r.get("hook_held_twice") or r["distinct_addresses"] != r["leased"] or \
                ("hook_distinct" in r and r["hook_distinct"] != r["hook_leased"]):
            bad.append(f"{name}/{phase}: an address was given to two clients")
        if EXACT and phase.startswith("perfdhcp_") and (r["leased"] != r["clients"] or
                                                          r["distinct_addresses"] != EXACT):
            bad.append(f"{name}/{phase}: a pool of exactly {EXACT} addresses for {r['clients']} clients: "
                       f"{r['leased']} leased, {r['distinct_addresses']} distinct addresses")
        if phase in UDHCPC_PHASES and r["leased"] != r["clients"]:
            bad.append(f"{name}/{phase}: {r['clients'] - r['leased']} client(s) got no lease "
                       f"(what crossed vfh3's port for them: {r.get('unleased')})")
        if name.startswith("sdhcp") and not name.startswith(("sdhcp4low24", "sdhcp1")) and \
                phase.startswith("perfdhcp_") and (r.get("shard_load_max_over_mean") or 0) > 2:
            bad.append(f"{name}/{phase}: a shard served {r['shard_load_max_over_mean']}x the mean ACKs "
                       f"({r['shard_acks']}): the keys of sequential MACs did not spread")
    return bad


def medians(runs: list[dict]) -> dict:
    """Per phase, the median over the runs of: time, leased, leases/s, DORA median and p99, drops, CPU."""
    out: dict = {"idle_cpu_per_s": statistics.median(r["idle_cpu_per_s"] for r in runs),
                 "idle_etcd_cpu_per_s": statistics.median(r.get("idle_etcd_cpu_per_s", 0.0) for r in runs)}
    for phase in runs[0]:
        if phase in NOT_PHASES or phase.startswith("shards_"):
            continue
        rs = [r[phase] for r in runs]
        out[phase] = {"time_s": statistics.median(r["time_s"] or 0 for r in rs),
                      "leased": statistics.median(r["leased"] for r in rs),
                      "leases_per_s": statistics.median(r["leases_per_s"] for r in rs),
                      "dora_median_ms": statistics.median(r["dora"].get("median_ms", 0) for r in rs),
                      "dora_p99_ms": statistics.median(r["dora"].get("p99_ms", 0) for r in rs),
                      "offer_turnaround_ms": statistics.median(r["offer_turnaround"].get("median_ms", 0) for r in rs),
                      "ack_turnaround_ms": statistics.median(r["ack_turnaround"].get("median_ms", 0) for r in rs),
                      "ack_turnaround_p99_ms": statistics.median(r["ack_turnaround"].get("p99_ms", 0) for r in rs),
                      "drops": statistics.median(sum(r.get("perfdhcp_drops", {}).values()) for r in rs),
                      "server_cpu_s": statistics.median(r["server_cpu_s"] for r in rs),
                      "server_cpu_sys_s": statistics.median(r["server_cpu_sys_s"] for r in rs),
                      "cpu_ms_per_lease": statistics.median(r["cpu_ms_per_lease"] or 0 for r in rs),
                      "cpu_ms_per_client": statistics.median(r.get("cpu_ms_per_client") or 0 for r in rs),
                      "machine_busy_cpu_s": statistics.median(r.get("machine_busy_cpu_s") or 0 for r in rs),
                      "fabric_cpu_s": statistics.median(sum(r.get("fabric_cpu_s", {}).values()) for r in rs),
                      "start_spread_s": statistics.median(r.get("start_spread_s") or 0 for r in rs),
                      "tail_s": statistics.median(r.get("tail_s") or 0 for r in rs),
                      "shard_load_max_over_mean": statistics.median(r.get("shard_load_max_over_mean") or 0 for r in rs),
                      "times_s": [r["time_s"] for r in rs]}
        if all("spawn_s" in r for r in rs):
            out[phase]["spawn_s"] = statistics.median(r["spawn_s"] for r in rs)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _fmt(r: float | None) -> str:
    return f"{r:.2f}x" if r else "-"


def round_ratios(runs: list[dict], peer: list[dict], phase: str) -> list[float]:
    """Per round, this server's time over the peer's in the same round (both ran back to back, so a slow
    spell of the shared machine weighs on both)."""
    return [a[phase]["time_s"] / b[phase]["time_s"] for a, b in zip(runs, peer)
            if a[phase]["time_s"] and b[phase]["time_s"]]


def round_ratio(runs: list[dict], peer: list[dict], phase: str) -> float | None:
    """The median of :func:`round_ratios`."""
    got = round_ratios(runs, peer, phase)
    return round(statistics.median(got), 3) if got else None


def median_interval(xs: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float] | None:
    """A percentile-bootstrap interval (fixed seed) of the median of ``xs``: how far the median of these
    rounds could be from the machine's typical ratio.  None for fewer than 3 rounds."""
    if len(xs) < 3:
        return None
    rnd = random.Random(1)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(resamples))
    cut = int((1 - level) / 2 * resamples)
    return round(meds[cut], 3), round(meds[-1 - cut], 3)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--udhcpc", type=int, default=None, help="real udhcpc clients (default 245, smoke 20)")
    ap.add_argument("--perf", type=int, default=None, help="perfdhcp clients, a multiple of 4 (default 1000, "
                                                           "smoke 100)")
    ap.add_argument("--rates", default=None, help="perfdhcp total rates, comma-separated (default 1000,2000,4000; "
                                                 "smoke 1000)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="run each sdhcp shard under cProfile, "
                                                                  "its profile written to DIR")
    ap.add_argument("--repeat", type=int, default=None, help="fresh runs per server (default 3, smoke 1)")
    ap.add_argument("--no-flood", action="store_true", help="skip the flood phase (new clients until the pool "
                                                              "is full, then 1,000 more)")
    ap.add_argument("--topo", default="single,6", help="the fabric (default single,6: every host on one switch; "
                                                       "line,2,3 puts vfh4-6 behind a second switch)")
    ap.add_argument("--pin", action="store_true", help="this process and the clients on CPU 0, the servers and the "
                                                       "fabric's daemons on CPU 1 (servers with a core of their own)")
    ap.add_argument("--servers", default=None, help="comma-separated subset of sdhcp1,sdhcp2,sdhcp4,kea,dnsmasq, "
                                                    "and sdhcp4low24 (4 shards keyed by the MAC's low 24 bits)")
    ap.add_argument("--exact", action="store_true",
                    help="a pool exactly as large as the perfdhcp clients: each perfdhcp phase on a fresh server "
                         "whose pool has --perf addresses (no udhcpc or flood phases); every client must lease and "
                         "every address be used once (sdhcp: shards borrow address blocks from each other)")
    ap.add_argument("--keys", default=mackey.HASH, choices=mackey.FUNCTIONS,
                    help="the sdhcp services' key function (default mac-hash; sdhcp4low24 is always mac-low24)")
    args = ap.parse_args()
    need = {h for placed in SHARDS.values() for _, h, _ in placed} | {PEER_HOST, UDHCPC_HOST, RELAY_HOST}
    try:
        missing = need - {h for h, _ in TopoSpec.parse(args.topo).hosts}
    except TopoError as exc:
        ap.error(str(exc))
    if missing:
        ap.error(f"--topo {args.topo} has no host {', '.join(sorted(missing))}: this bench places servers and clients "
                 f"on {', '.join(sorted(need))} (use single,6 or line,2,3)")
    if args.pin:
        if not CLIENT_CPUS | SERVER_CPUS <= os.sched_getaffinity(0):
            ap.error(f"--pin needs CPUs {sorted(CLIENT_CPUS | SERVER_CPUS)}; this process may run on "
                     f"{sorted(os.sched_getaffinity(0))} only (run it without --pin)")
        os.sched_setaffinity(0, CLIENT_CPUS)   # before the testbed: its threads and every client inherit it
    n_u = 0 if args.exact else args.udhcpc or (20 if args.smoke else 245)
    n_p = (args.perf or (100 if args.smoke else 1000)) // 4 * 4
    global EXACT
    EXACT = n_p if args.exact else 0
    rates = [int(x) for x in (args.rates or ("1000" if args.smoke else "500,2000,4000")).split(",")]
    global KEY_FN
    KEY_FN = args.keys
    repeat = args.repeat or (1 if args.smoke else 3)
    left = POOL_SIZE - 2 * n_u - n_p * (len(rates) + 1)
    n_flood = 0 if args.no_flood or args.exact or left < 0 else (left + FLOOD_BEYOND) // 4 * 4
    servers = (args.servers or ("sdhcp1,sdhcp2,kea,dnsmasq" if args.smoke else
                                "sdhcp1,sdhcp2,sdhcp4,kea,dnsmasq")).split(",")
    rnd = random.Random(9)
    macs = [bytes([0x02, 0x5B, 0x00]) + k.to_bytes(3, "big") for k in rnd.sample(range(1, 1 << 24), 2 * n_u)]
    results: dict = {}
    bad: list[str] = []
    with Testbed(args.topo, poll=1.0) as tb:
        farms = {} if args.exact else {"udhcpc": dc.ClientFarm(tb, UDHCPC_HOST, "u", macs[:n_u], tb.workdir),
                                       TOGETHER: dc.ClientFarm(tb, UDHCPC_HOST, "g", macs[n_u:], tb.workdir)}
        relays = dc.ClientFarm(tb, RELAY_HOST, "r", [dc.relay_mac(q, KEY_FN) for q in range(4)], tb.workdir)
        caps = []
        try:
            t0 = time.monotonic()
            for farm in farms.values():
                farm.create()
            relays.create()
            for q in range(4):
                relays.sh(q, "ip", "addr", "add", f"{RELAYS[q]}/{PREFIX}", "dev", relays.names[q])
            tb.wait_revision(tb.registry.state_revision(), timeout=60)
            print(f"{2 * n_u} client namespaces and 4 relays behind vfh3/vfh2 in {time.monotonic() - t0:.1f} s",
                  flush=True)
            cap_u, cap_p = dc.Capture(tb, UDHCPC_HOST), dc.Capture(tb, RELAY_HOST)
            caps = [cap_u, cap_p]
            runs: dict[str, list] = {server: [] for server in servers}
            for rep in range(repeat):   # rounds: every server once, the order reversed every other round
                for server in (servers if rep % 2 == 0 else servers[::-1]):
                    if args.exact:   # a fresh server (an empty pool of n_p addresses) for each phase
                        res = {}
                        for i, rate in enumerate(rates + [None]):
                            got = run_server(tb, server, farms, relays, cap_u, cap_p, n_p, [rate], 0, args.profile,
                                             args.pin, first_run=i)
                            res.update({k: v for k, v in got.items() if k.startswith("perfdhcp_")})
                            res[f"shards_{rate or AVALANCHE}"] = got.get("shards")
                            for k in NOT_PHASES[1:]:
                                res.setdefault(k, got[k])
                    else:
                        res = run_server(tb, server, farms, relays, cap_u, cap_p, n_p, rates + [None], n_flood,
                                         args.profile, args.pin)
                    runs[server].append(res)
                    bad += check(f"{server}#{rep + 1}", res)
            results = {server: {"runs": runs[server], "median": medians(runs[server])} for server in servers}
        finally:
            for c in caps:
                c.stop()
            for farm in farms.values():
                farm.remove()
            relays.remove()
    phases = ([] if args.exact else [*UDHCPC_PHASES]) + [f"perfdhcp_{r}" for r in rates] + \
        [f"perfdhcp_{AVALANCHE}"] + (["flood"] if n_flood else [])
    heads = ([] if args.exact else [f"{n_u} udhcpc", f"{n_u} udhcpc together"]) + \
        [f"{n_p} perfdhcp@{r}/s" for r in rates] + \
        [f"{n_p} perfdhcp avalanche"] + \
        ([f"{n_flood} flood@{FLOOD_RATE}/s"] if n_flood else [])
    per = {k: "cpu_ms_per_client" if k == "flood" else "cpu_ms_per_lease" for k in phases}
    print(f"\nmedians of {repeat} run(s): time from the first DISCOVER to the last ACK s "
          "(leased, perfdhcp drops, server CPU ms per lease; flood: per client, the pool "
          f"having {max(left, 0)} addresses left for {n_flood} new clients)")
    print(f"{'server':<9}" + "".join(f"{h:>28}" for h in heads) + f"{'idle CPU/s':>12}{'etcd idle':>11}")
    for server, res in results.items():
        m = res["median"]
        cells = [f"{m[k]['time_s']} s ({m[k]['leased']:.0f}, {m[k]['drops']:.0f}, {m[k][per[k]]})" for k in phases]
        print(f"{server:<9}" + "".join(f"{c:>28}" for c in cells) + f"{m['idle_cpu_per_s']:>12}"
              f"{m['idle_etcd_cpu_per_s']:>11}")
    if "kea" in results:
        kea = results["kea"]["median"]
        print("ratio to Kea (time: median of the rounds' ratios; leased; CPU per lease, flood: per client)")
        for server, res in results.items():
            m = res["median"]
            for k in phases:
                m[k]["time_ratio_to_kea"] = round_ratio(res["runs"], results["kea"]["runs"], k)
                m[k]["time_ratios_to_kea"] = [round(x, 3) for x in round_ratios(res["runs"], results["kea"]["runs"], k)]
                m[k]["time_ratio_to_kea_ci95"] = median_interval(m[k]["time_ratios_to_kea"])
            cells = [f"{_fmt(m[k]['time_ratio_to_kea'])}; {_ratio(m[k]['leased'], kea[k]['leased'])}; "
                     f"{_ratio(m[k][per[k]], kea[k][per[k]])}" for k in phases]
            print(f"{server:<9}" + "".join(f"{c:>28}" for c in cells))
        print("time ratio to Kea: 95% bootstrap interval of the median over the rounds (3 rounds at least)")
        for server, res in results.items():
            if server == "kea":
                continue
            m = res["median"]
            cells = [(f"{ci[0]:.2f}-{ci[1]:.2f}x" if (ci := m[k]["time_ratio_to_kea_ci95"]) else "-") for k in phases]
            print(f"{server:<9}" + "".join(f"{c:>28}" for c in cells))
    print("server turnaround at the clients' port, medians of the rounds' medians (ms): DISCOVER to OFFER / "
          "REQUEST to ACK (REQUEST to ACK p99)")
    print(f"{'server':<9}" + "".join(f"{h:>28}" for h in heads))
    for server, res in results.items():
        m = res["median"]
        cells = [f"{m[k]['offer_turnaround_ms']} / {m[k]['ack_turnaround_ms']} ({m[k]['ack_turnaround_p99_ms']})"
                 for k in phases]
        print(f"{server:<9}" + "".join(f"{c:>28}" for c in cells))
    print("durability: " + "; ".join(f"{k}: {v}" for k, v in DURABILITY.items()))
    write("sdhcp_lease", {"udhcpc_clients": n_u, "perfdhcp_clients": n_p, "rates": rates, "repeat": repeat,
                          "key_fn": KEY_FN, "perfdhcp_chaddrs": f"in sequence from {SEQ_BASE:012x} (+ run * 65536)",
                          "flood_clients": n_flood, "flood_rate": FLOOD_RATE, "topo": args.topo, "pool_left_for_flood": max(left, 0),
                          "smoke": args.smoke, "pinned": {"clients": sorted(CLIENT_CPUS), "servers": sorted(SERVER_CPUS)}
                          if args.pin else None,
                          "pool": f"{FIRST}-{pool_last()}", "exact": bool(EXACT), "servers": servers, "durability": DURABILITY,
                          "clients": "busybox udhcpc, one process and namespace each (macvlan behind vfh3); "
                                     "perfdhcp as 4 relays behind vfh2"}, results, args.out)
    if bad:
        print("FAILED: " + "; ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
