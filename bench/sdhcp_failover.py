"""Failover of a DHCP service: owner killed -> first renewal served, leases lost; sdhcp vs Kea HA (issue 9).

One fabric (``line,2,3``), the same simulated clients in both cases (N MACs
registered on vfh3's port, ``vfab.testbed.dhcpsim``: one raw socket, each client
renews by unicast to its server ``PERIOD`` s after its last ACK, retransmits
every ``RETRY`` s and rebinds by broadcast once ``T2`` s have passed since its
last ACK, exactly the same client behaviour for both servers):

* **sdhcp**: service ``dhfo`` (dhcp4 front door), shard ``p`` on vfh1 owns
  every key, mirrored on ``m`` (vfh4); ``--ttl 1``.  Leases are fsync'd and on
  the mirror before the ACK.
* **Kea HA hot-standby** (``kea-dhcp4`` 2.2 with ``libdhcp_ha.so`` and
  ``libdhcp_lease_cmds.so``, each server with its own ``kea-ctrl-agent`` as its
  HTTP channel): primary in vfh1 (10.79.0.2), standby in vfh4 (10.79.0.3), on
  the hosts' own interfaces inside their namespaces, heartbeat 1 s,
  max-response-delay 3 s, max-unacked-clients 0 (tuned down from the defaults
  10 s / 60 s as in TESTBED-NOTES), memfile leases (written before the ACK, no
  fsync), the primary waits for the standby's lease update before it ACKs.
  No front door: the service's broadcasts reach both servers by NORMAL
  forwarding, the standby stays silent until it declares its partner down.

Per case: all clients lease, renew for ``WARM`` s, the owner (sdhcp ``p``, Kea
primary) is killed with SIGKILL, and the clients go on for ``AFTER`` s.
Reported: per client the time from the kill to its first ACK (of a request sent
after the kill), min/median/max over clients, the clients never served again,
NAKed or given another address (lost), addresses held by two clients
(duplicated).  sdhcp's server identifier is one virtual address for every
shard, so the renewals go on by unicast; Kea's standby has an address of its
own, so Kea's clients wait for T2 and rebind.

Run: ``/opt/vfab-venv/bin/python bench/sdhcp_failover.py [--smoke] [--clients N]`` (root).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from ipaddress import IPv4Address

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, write  # noqa: E402
from vfab.testbed import dhcpsim  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.state import ctl as statectl  # noqa: E402

CLIENT_HOST = "vfh3"
PERIOD, RETRY, T2 = 0.5, 0.25, 3.0
NET, PREFIX = "10.79.0.0", 16
POOL = ("10.79.1.10", "10.79.1.250")
SDHCP_SERVER = IPv4Address("10.79.0.1")
KEA = {"primary": ("vfh1", "10.79.0.2"), "standby": ("vfh4", "10.79.0.3")}
AGENT_PORT = 8001
HOOKS = "/usr/lib/x86_64-linux-gnu/kea/hooks"
LEASE, KEA_T1, KEA_T2 = 60, 30, 52    # what the servers hand out; the simulated clients keep their own clock


def macs_for(n: int) -> list[bytes]:
    rnd = random.Random(77)
    return [bytes([0x02, 0x79, 0x00]) + k.to_bytes(3, "big") for k in rnd.sample(range(1, codec.KEY_MAX), n)]


def outcome(sim: dhcpsim.SimClients, leased: dict, t_kill: float) -> dict:
    took = sim.first_ack_after(t_kill)
    served = sorted(t for t in took.values() if t is not None)
    lost = [c.mac.hex() for c in sim.clients
            if took[c.mac] is None or c.naks or {a[2] for a in c.acks} != {leased.get(c.mac)}]
    holders: dict = {}
    for mac, ips in sim.addresses().items():
        for ip in ips:
            holders.setdefault(ip, set()).add(mac)
    dup = {str(ip): len(m) for ip, m in holders.items() if len(m) > 1}
    servers = sorted({str(c.acks[-1][3]) for c in sim.clients if c.acks})
    return {"clients": len(sim.clients), "leased": len(leased),
            "first_served_s": {"min": round(served[0], 3), "median": round(statistics.median(served), 3),
                               "max": round(served[-1], 3)} if served else None,
            "never_served_after_kill": sum(1 for t in took.values() if t is None), "lost": len(lost),
            "lost_clients": lost[:10], "duplicated": len(dup), "naks": sum(len(c.naks) for c in sim.clients),
            "served_by_after": servers, "requests_sent": sim.sent}


def drive(sim: dhcpsim.SimClients, kill, took_over, warm: float, after: float) -> tuple[dict, float, float | None]:
    """Lease, renew, kill at ``warm`` s; (leased, kill time, seconds until ``took_over()`` first said so)."""
    leased = sim.lease(timeout=20)
    killed: list[float] = []
    over: list[float] = []
    last_poll = [0.0]
    start = time.monotonic()

    def tick(now: float) -> None:
        if not killed and now - start >= warm:
            killed.append(time.monotonic())
            kill()
        elif killed and not over and now - last_poll[0] >= 0.05:
            last_poll[0] = now
            if took_over():
                over.append(time.monotonic() - killed[0])
    sim.renew(duration=warm + after, period=PERIOD, retry=RETRY, t2=T2, tick=tick)
    return leased, killed[0], (round(over[0], 3) if over else None)


# ---------------------------------------------------------------------------------------------- sdhcp
def run_sdhcp(tb: Testbed, macs: list[bytes], warm: float, after: float) -> dict:
    reg = tb.registry
    svc = "dhfo"
    reg.create_service(svc, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    opts = {"pool": "-".join(POOL), "mask": str(PREFIX), "server": str(SDHCP_SERVER), "lease": str(LEASE),
            "t1": str(KEA_T1), "t2": str(KEA_T2)}
    args_opts = [a for k, v in opts.items() for a in ("--opt", f"{k}={v}")]
    procs = {}
    try:
        for name, host, listen in (("p", "vfh1", "0-0xffffff"), ("m", "vfh4", None)):
            out = os.path.join(tb.workdir, f"{svc}-{name}.out")
            args = ["-m", "vfab.services.sdhcp", "server", "--etcd", tb.etcd_endpoint, "--service", svc,
                    "--name", name, "--iface", tb.hosts[host]["iface"], "--data", os.path.join(tb.workdir, svc),
                    "--ttl", "1", *args_opts, *(["--listen", listen] if listen else [])]
            procs[name] = tb.run_on(host, f"{svc}-{name}", args, stdout=open(out, "wb"))
            wait_for(lambda: b"ready" in open(out, "rb").read() or not procs[name].alive(), 30, f"shard {name}")
            if not procs[name].alive():
                raise RuntimeError(f"shard {name} died at start:\n{procs[name].tail()}")
        op = statectl.wait(reg, svc, statectl.mirror(reg, svc, "p", "m").op, timeout=60)
        if op.phase != "done":
            raise RuntimeError(f"mirror p -> m: {op}")
        tb.wait_revision(reg.state_revision())
        sid = reg.service(svc).id

        def kill() -> None:
            os.kill(procs["p"].pid, signal.SIGKILL)
            procs["p"].popen.wait(5)

        with dhcpsim.SimClients(tb, CLIENT_HOST, macs, server_mac=lambda ip, mac: codec.encode(
                sid, int.from_bytes(mac, "big") & codec.KEY_MAX).packed) as sim:
            leased, t_kill, over = drive(sim, kill, lambda: {r.owner for r, _ in reg.ranges(svc)} == {"m"}, warm,
                                         after)
            res = outcome(sim, leased, t_kill)
        res["takeover_s"] = over   # the kill -> m owns the range in etcd (polled every 50 ms)
        res["durability"] = "SQLite synchronous=FULL (fsync) per batch, on the mirror before the ACK"
        res["owner_after"] = sorted({r.owner for r, _ in reg.ranges(svc)})
        return res
    finally:
        for p in procs.values():
            tb.sup.stop(p)
        reg.delete_service(svc)
        tb.wait_revision(reg.state_revision())


# ---------------------------------------------------------------------------------------------- Kea HA
def kea_configs(d: str, tb: Testbed) -> dict:
    peers = [{"name": role, "url": f"http://{ip}:{AGENT_PORT}/", "role": role, "auto-failover": True}
             for role, (_, ip) in KEA.items()]
    out = {}
    for role, (host, ip) in KEA.items():
        iface = tb.hosts[host]["iface"]
        sock = os.path.join(d, f"{role}.sock")
        dhcp4 = {"Dhcp4": {
            "interfaces-config": {"interfaces": [iface], "dhcp-socket-type": "raw"},
            "control-socket": {"socket-type": "unix", "socket-name": sock},
            "lease-database": {"type": "memfile", "persist": True, "name": os.path.join(d, f"{role}.leases.csv"),
                               "lfc-interval": 0},
            "valid-lifetime": LEASE, "renew-timer": KEA_T1, "rebind-timer": KEA_T2,
            "multi-threading": {"enable-multi-threading": False},
            "hooks-libraries": [
                {"library": f"{HOOKS}/libdhcp_lease_cmds.so"},
                {"library": f"{HOOKS}/libdhcp_ha.so", "parameters": {"high-availability": [{
                    "this-server-name": role, "mode": "hot-standby", "heartbeat-delay": 1000,
                    "max-response-delay": 3000, "max-ack-delay": 1000, "max-unacked-clients": 0,
                    "sync-timeout": 10000, "peers": peers}]}}],
            "subnet4": [{"id": 1, "subnet": f"{NET}/{PREFIX}", "interface": iface,
                         "pools": [{"pool": f"{POOL[0]} - {POOL[1]}"}]}],
            "loggers": [{"name": "kea-dhcp4", "severity": "WARN",
                         "output_options": [{"output": os.path.join(d, f"{role}.log")}]}]}}
        agent = {"Control-agent": {"http-host": ip, "http-port": AGENT_PORT,
                                   "control-sockets": {"dhcp4": {"socket-type": "unix", "socket-name": sock}},
                                   "loggers": [{"name": "kea-ctrl-agent", "severity": "WARN", "output_options": [
                                       {"output": os.path.join(d, f"{role}-agent.log")}]}]}}
        for kind, doc in (("dhcp4", dhcp4), ("agent", agent)):
            path = os.path.join(d, f"{role}-{kind}.json")
            with open(path, "w") as fh:
                json.dump(doc, fh, indent=1)
            out[(role, kind)] = path
        out[(role, "sock")] = sock
    return out


def kea_command(sock_path: str, command: str) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(sock_path)
        s.sendall(json.dumps({"command": command}).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            try:
                return json.loads(data)
            except ValueError:
                continue
    return json.loads(data)


def ha_state(sock_path: str) -> str:
    try:
        return str(kea_command(sock_path, "ha-heartbeat").get("arguments", {}).get("state", "?"))
    except (OSError, ValueError):
        return "down"


def run_kea(tb: Testbed, macs: list[bytes], warm: float, after: float) -> dict:
    d = tempfile.mkdtemp(prefix="vfab-kea-ha-")
    env = {"KEA_PIDFILE_DIR": d, "KEA_LOCKFILE_DIR": d}
    cfg = kea_configs(d, tb)
    added = []
    procs = {}
    try:
        for role, (host, ip) in KEA.items():
            iface = tb.hosts[host]["iface"]
            tb.host(host).cmd(f"ip addr add {ip}/{PREFIX} dev {iface}")
            added.append((host, ip, iface))
        for role, (host, _) in KEA.items():
            procs[(role, "dhcp4")] = tb.sup.start(f"kea-{role}", ["kea-dhcp4", "-c", cfg[(role, "dhcp4")]],
                                                  host=tb.host(host), env=env)
            procs[(role, "agent")] = tb.sup.start(f"kea-agent-{role}", ["kea-ctrl-agent", "-c", cfg[(role, "agent")]],
                                                  host=tb.host(host), env=env)
        try:
            wait_for(lambda: ha_state(cfg[("primary", "sock")]) == "hot-standby"
                     and ha_state(cfg[("standby", "sock")]) == "hot-standby", 60, "both Kea servers in hot-standby")
        except TimeoutError:
            tails = {n: p.tail(10) for n, p in procs.items()}
            logs = {r: open(os.path.join(d, f"{r}.log")).read()[-1500:] for r in KEA
                    if os.path.exists(os.path.join(d, f"{r}.log"))}
            raise RuntimeError(f"Kea HA did not reach hot-standby: states "
                               f"{[ha_state(cfg[(r, 'sock')]) for r in KEA]}; {tails}; {logs}") from None
        # Kea takes the interface's first address as its server identifier (the Mininet host's own 10.0.0.N)
        macs_of = {IPv4Address(a): codec.mac_to_int(tb.hosts[h]["mac"]).to_bytes(6, "big")
                   for h, ip in KEA.values() for a in (ip, tb.host(h).IP())}

        def kill() -> None:
            p = procs[("primary", "dhcp4")]
            os.kill(p.pid, signal.SIGKILL)
            p.popen.wait(5)

        with dhcpsim.SimClients(tb, CLIENT_HOST, macs, server_mac=lambda ip, mac: macs_of.get(
                ip, b"\xff" * 6)) as sim:
            leased, t_kill, over = drive(sim, kill, lambda: ha_state(cfg[("standby", "sock")]) == "partner-down",
                                         warm, after)
            res = outcome(sim, leased, t_kill)
        res["takeover_s"] = over   # the kill -> the standby in partner-down (polled every 50 ms)
        res["standby_state_after"] = ha_state(cfg[("standby", "sock")])
        res["durability"] = "memfile: written before the ACK, no fsync; the standby's lease update before the ACK"
        return res
    finally:
        for p in procs.values():
            tb.sup.stop(p)
        for host, ip, iface in added:
            tb.host(host).cmd(f"ip addr del {ip}/{PREFIX} dev {iface}")
        subprocess.run(["rm", "-rf", d], check=False)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=None, help="simulated clients (default 50, smoke 8)")
    args = ap.parse_args()
    n = args.clients or (8 if args.smoke else 50)
    warm, after = (1.5, 6.0) if args.smoke else (3.0, 12.0)
    macs = macs_for(n)
    results = {}
    with Testbed("line,2,3", poll=1.0) as tb:
        dhcpsim.register(tb, CLIENT_HOST, macs)
        results["sdhcp"] = run_sdhcp(tb, macs, warm, after)
        print(f"sdhcp: {results['sdhcp']}", flush=True)
        results["kea_ha"] = run_kea(tb, macs, warm, after)
        print(f"kea HA: {results['kea_ha']}", flush=True)
    print(f"\nowner killed (SIGKILL) while {n} clients renew (unicast every {PERIOD} s after an ACK, retry "
          f"{RETRY} s, rebind after {T2} s without an ACK)")
    print(f"{'server':>8} {'takeover':>9} {'first served after the kill (s) min/med/max':>44} {'never':>6} "
          f"{'lost':>5} {'dup':>4}")
    for name, r in results.items():
        f = r["first_served_s"] or {}
        print(f"{name:>8} {r['takeover_s'] if r['takeover_s'] is not None else '-':>9} {f.get('min', '-'):>14} "
              f"{f.get('median', '-'):>14} {f.get('max', '-'):>14} {r['never_served_after_kill']:>6} {r['lost']:>5} "
              f"{r['duplicated']:>4}")
    print("takeover: sdhcp = the mirror owns the range in etcd; Kea = the standby is in partner-down")
    write("sdhcp_failover", {"smoke": args.smoke, "clients": n, "warm_s": warm, "after_s": after,
                             "client": {"period_s": PERIOD, "retry_s": RETRY, "t2_s": T2},
                             "kea_ha": {"mode": "hot-standby", "heartbeat_ms": 1000, "max_response_delay_ms": 3000,
                                        "max_unacked_clients": 0}, "sdhcp_ttl_s": 1}, results, args.out)
    bad = [k for k, r in results.items() if r["lost"] or r["duplicated"]]
    if results["sdhcp"]["lost"] or results["sdhcp"]["duplicated"]:
        print(f"sdhcp lost or duplicated leases: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
