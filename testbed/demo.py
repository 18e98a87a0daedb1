"""The first demo (``make demo``): an echo service on a two-switch Mininet fabric.

Three echo servers own a third of the key space each; three clients send
requests to random VIDs.  While they run, ranges are reassigned live with
``vfab route``; the per-range packet counters (read from the switches by the
controller) show the traffic following each range to its new owner, and the
clients report how many requests were lost or duplicated (none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

from rich.console import Console
from rich.table import Table

from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import wait_for
from vfab.vid import codec
from vfab.vid.registry import schema

THIRD = (codec.KEY_MAX + 1) // 3
RANGES = {"s1": (0, THIRD - 1), "s2": (THIRD, 2 * THIRD - 1), "s3": (2 * THIRD, codec.KEY_MAX)}
SERVERS = {"s1": ("vfh1", "ovs"), "s2": ("vfh4", "ovs"), "s3": ("vfh5", "bpf")}
CLIENTS = {"c1": "vfh2", "c2": "vfh3", "c3": "vfh6"}
DURATION, RATE = 16, 150
MOVES = [(4, "s1", "s2"), (8, "s3", "s1"), (12, "s1", "s1")]  # (at s, range of, to)
console = Console(highlight=False)


def say(text: str) -> None:
    console.print(f"[bold cyan]==>[/] {text}")


def counters_by_range(tb: Testbed, sid: int) -> dict[int, int]:
    """Packets per range lo, counted on the switch of the range's owner (each packet once)."""
    _, items = tb.registry.get_prefix(schema.folder("counters"))
    per_switch = {}
    for key, (raw, _) in items.items():
        per_switch[int(key.rsplit("/", 1)[1], 16)] = schema.Counters.from_json(raw, key).counters
    eps = {e.name: e for e in tb.registry.endpoints("echo")}
    hosts = {h["mac"]: h for h in tb.hosts.values()}
    out = {}
    for rec, _ in tb.registry.ranges("echo"):
        ep = eps.get(rec.owner)
        dpid = hosts[ep.mac]["dpid"] if ep else None
        out[rec.lo] = per_switch.get(dpid, {}).get(f"{sid}/{rec.lo:06x}", [0])[0]
    return out


def show(tb: Testbed, sid: int, last: dict, t: float) -> dict:
    now = counters_by_range(tb, sid)
    table = Table(title=f"t={t:4.1f} s  range map of 'echo'", title_justify="left")
    for col in ("range", "owner", "epoch", "packets at the owner's switch since the last table"):
        table.add_column(col)
    for rec, _ in tb.registry.ranges("echo"):
        delta = now.get(rec.lo, 0) - last.get(rec.lo, 0)
        table.add_row(f"{rec.lo:#08x}-{rec.hi:#08x}", rec.owner, str(rec.epoch), str(max(delta, 0)))
    console.print(table)
    return now


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("the demo needs root (network namespaces, Open vSwitch): run it with sudo")
    say("starting the fabric: local etcd, Open vSwitch (userspace), the os-ken controller, "
        "Mininet line,2,3 (vfbs1 - vfbs2, hosts vfh1-3 | vfh4-6)")
    t0 = time.monotonic()
    tb = Testbed("line,2,3", poll=0.5)
    tb.start()
    try:
        say(f"fabric up in {time.monotonic() - t0:.1f} s; etcd at {tb.etcd_endpoint}")
        svc = tb.registry.create_service("echo")
        say(f"service 'echo' registered with id {svc.id}: its VIDs are {codec.encode(svc.id, 0)} .. "
            f"{codec.encode(svc.id, codec.KEY_MAX)}")
        procs = {}
        for name, (host, rx) in SERVERS.items():
            lo, hi = RANGES[name]
            out = os.path.join(tb.workdir, f"{name}.out")
            procs[name] = tb.run_on(host, name, ["-m", "vfab.services.echo", "server", "--etcd", tb.etcd_endpoint,
                                                 "--service", "echo", "--name", name, "--iface",
                                                 tb.hosts[host]["iface"], "--rx", rx, "--listen", f"{lo}-{hi}"],
                                    stdout=open(out, "wb"))
            wait_for(lambda: b"ready" in open(out, "rb").read(), 20, f"server {name}")
            say(f"echo server {name} on {host} (receive backend {rx}) owns {lo:#08x}-{hi:#08x}")
        tb.wait_revision(tb.registry.state_revision())
        outs = {}
        for name, host in CLIENTS.items():
            outs[name] = os.path.join(tb.workdir, f"{name}.json")
            procs[name] = tb.run_on(host, name, ["-m", "vfab.services.echo", "client", "--etcd", tb.etcd_endpoint,
                                                 "--service", "echo", "--iface", tb.hosts[host]["iface"],
                                                 "--count", "0", "--duration", str(DURATION), "--rate", str(RATE),
                                                 "--timeout", "1", "--out", outs[name]])
        say(f"clients {', '.join(f'{c} on {h}' for c, h in CLIENTS.items())} send {RATE} requests/s each "
            f"to random VIDs for {DURATION} s")
        start = time.monotonic()
        last = counters_by_range(tb, svc.id)
        moves = list(MOVES)
        env = dict(os.environ, VFAB_ETCD=tb.etcd_endpoint)
        while time.monotonic() - start < DURATION:
            time.sleep(1.0)
            t = time.monotonic() - start
            last = show(tb, svc.id, last, t)
            if moves and t >= moves[0][0]:
                _, of, to = moves.pop(0)
                lo, hi = RANGES[of]
                cmd = ["vfab", "route", "echo", f"{lo:#x}-{hi:#x}", "--to", to]
                say("live cut-over: " + " ".join(cmd))
                res = subprocess.run([sys.executable, "-m", "vfab.cli", *cmd[1:]], env=env,
                                     capture_output=True, text=True)
                console.print("    " + (res.stdout or res.stderr).strip())
        for name in CLIENTS:
            procs[name].popen.wait(30)
        total = lost = dups = 0
        by_server = Counter()
        for name in CLIENTS:
            results = json.load(open(outs[name]))
            total += len(results)
            lost += sum(1 for r in results if r["reply_from"] is None)
            dups += sum(1 for r in results if r["dup_count"])
            by_server.update(r["reply_from"] for r in results if r["reply_from"])
        say(f"clients sent {total} requests: {lost} lost, {dups} duplicated; replies by server: "
            + ", ".join(f"{k} {v}" for k, v in sorted(by_server.items())))
        say("the fabric's flows are in 'vfab flows'; tearing down")
    finally:
        tb.stop()
    say("done: every namespace, switch and process the demo started is gone")


if __name__ == "__main__":
    main()
