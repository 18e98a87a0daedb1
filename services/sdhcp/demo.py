"""``make demo-sdhcp``: unmodified DHCP clients arriving in a burst at an elastic sdhcp service.

A ``line,2,3`` fabric (OVS userspace, os-ken, a local etcd, Mininet).  Service ``dhd`` (kind sdhcp, the
dhcp4 front door) starts with one shard, ``s1`` on vfh1, owning every key, and a spare, ``s2`` on vfh4;
``vfab balancer run dhd`` runs beside them as its own process.  The clients are unmodified busybox udhcpc,
ISC dhclient and dhcpcd processes, each in a namespace of its own behind vfh3 (a macvlan with its own MAC,
``testbed/dhcpclients.ClientFarm``); they configure the addresses they get and log every event.

1. **Burst**: every client starts within ``--arrive`` seconds.  The balancer sees s1 hot (its requests/s
   from s1's load report, or its lease count) and splits the upper half of the key space onto s2 by
   itself, while the clients are still arriving; the demo only watches and prints.
2. **Mirror**: a shard ``m`` starts on vfh6 and mirrors the shard owning the upper half (``vfab mirror``).
3. **kill -9** of that shard: m takes its ranges over when its etcd lease expires (1 s), and its clients'
   next renewals (unicast to the one server address; udhcpc renews at half the lease) are answered by m.
4. **Checks, from the clients' side**: every client holds a lease, no address was ever held by two
   clients (from their event logs), no client's address changed or was taken away (the leases survived
   the split and the kill), each namespace's kernel holds its client's address, and the killed shard's
   clients renewed after the kill.
5. **The clients leave**: every client process stops; with no renewals coming the shards go idle and the
   balancer merges them back by itself (both halves below ``merge_rate`` for a whole lease time, two
   renewal periods, so renewal waves never let it merge while clients are there): one shard then owns
   every key and holds every client's lease record.  Exit status 1 if a check fails.

Between the steps it prints ``vfab ranges``, ``vfab sdhcp status`` (shards, pool use, leases, rates) and
``vfab balancer status`` as an operator would see them.

``python -m vfab.services.sdhcp.demo [--udhcpc 245] [--dhclient 3] [--dhcpcd 3]`` (root); ``--smoke``
runs a small version (20 udhcpc, 1 dhclient, 1 dhcpcd, short leases) that proves the demo works.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from dataclasses import dataclass

from click.testing import CliRunner

from vfab.cli.cmd_state import load_by_range
from vfab.testbed import dhcpclients as dc
from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import wait_for
from vfab.vid import mackey
from vfab.vid.ranges import Range
from vfab.vid.registry import schema
from vfab.vid.state import ctl as statectl

SVC = "dhd"
FARM_HOST = "vfh3"
SHARDS = {"s1": "vfh1", "s2": "vfh4"}
MIRROR = ("m", "vfh6")
UPPER = Range(0x800000, 0xFFFFFF)
log = logging.getLogger("vfab.sdhcp.demo")


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Plan:
    udhcpc: int
    dhclient: int
    dhcpcd: int
    arrive: float          # s over which the clients start
    lease: int             # s; udhcpc renews at lease/2, dhclient and dhcpcd at T1 = lease/2

    @property
    def total(self) -> int:
        return self.udhcpc + self.dhclient + self.dhcpcd

    def opts(self) -> dict[str, str]:
        return {"pool": "10.79.0.10-10.79.7.250", "mask": "21", "server": "10.79.0.1", "lease": str(self.lease),
                "t1": str(self.lease // 2), "t2": str(self.lease * 7 // 8)}

    def balancer(self) -> dict[str, float]:
        """Settings that make the burst hot and the renewals after it not.

        While the clients arrive s1 serves about 2 requests per client (DISCOVER, REQUEST) over ``arrive``
        s; afterwards each client renews once per lease/2, and since they all arrived within ``arrive`` s
        the renewals come in waves of about total/arrive per s.  ``split_rate`` sits between the two, low
        (1.15 x the wave): a loaded machine starts the clients slower than planned, which spreads the burst
        and lowers its peak (1.4 x missed the split in a fresh clone's suite; this one allows a start ~20 %
        slower than before, up to ~1.7 x ``arrive``), and once s1 has split no spare is left, so no later
        wave of renewals can split anything again; one load report over it is enough (``split_window`` = 0):
        the burst's peak lasts about a second, one shard's report (per
        ``LOAD_PERIOD``, 1 s), and with half a second required the balancer's second look can come after
        the next report, below the trigger (the smoke run missed its split now and then).  No ``split_keys``:
        the clients' lease records stay after they leave, and the balancer never merges two ranges holding
        more than half of that limit (they would split again at once), so a key limit under the number of
        clients would forbid the merge at the end.  Merges need both halves nearly idle for a whole lease
        time: two renewal periods, so a wave of renewals always breaks the calm while clients are there,
        and the shards merge only once they have left."""
        wave = self.total / self.arrive
        return {"period": 0.5, "stale_after": 3, "min_interval": 1, "op_dwell": 3, "split_window": 0,
                "split_rate": round(1.15 * wave, 1), "split_keys": 0,
                "merge_rate": round(0.1 * wave, 1), "merge_window": float(self.lease)}


def client_macs(plan: Plan, seed: int = 9) -> tuple[list[bytes], list[str]]:
    """MACs numbered in sequence, as a vendor's or a test rig's are (the front door's ``mac-hash`` key spreads
    them over the key space: ``vfab.vid.mackey``), and each client's kind.  dhclient and dhcpcd alternate
    between the upper half of the key space (the shard that will be killed) and the lower half, upper first:
    each takes the next MAC of its own sequence whose key lies there."""
    kinds = ["udhcpc"] * plan.udhcpc + ["dhclient"] * plan.dhclient + ["dhcpcd"] * plan.dhcpcd
    first = 0x025A10000000 + random.Random(seed).randrange(1 << 16) * 256
    macs = [first + 1 + i for i in range(plan.udhcpc)]
    nxt = first + (1 << 20)
    for n in (plan.dhclient, plan.dhcpcd):
        for j in range(n):
            half = UPPER if j % 2 == 0 else Range(1, UPPER.lo - 1)
            while mackey.key(nxt) not in half:
                nxt += 1
            macs.append(nxt)
            nxt += 1
    return [m.to_bytes(6, "big") for m in macs], kinds


class Demo:
    def __init__(self, tb: Testbed, plan: Plan):
        self.tb, self.plan, self.reg = tb, plan, tb.registry
        self.workdir = os.path.join(tb.workdir, "sdhcp-demo")
        os.makedirs(self.workdir, exist_ok=True)
        self.procs: dict = {}
        self.failed: list[str] = []
        self.farm: dc.ClientFarm | None = None
        self.kinds: list[str] = []
        self.balancer = None
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.started: dict[int, float] = {}     # client -> when its process started (unix time)

    # -- pieces -----------------------------------------------------------------------------------------
    def clock(self) -> str:
        return f"{time.monotonic() - self.t0:.0f} s"

    def cli(self, *args: str) -> str:
        from vfab.cli.main import cli
        res = CliRunner().invoke(cli, ["--etcd", self.tb.etcd_endpoint, *args])
        return res.output.rstrip()

    def tables(self, *which: str) -> None:
        for w in which:
            if w == "ranges":
                say(self.cli("ranges", SVC))
            elif w == "status":
                say(self.cli("sdhcp", "status", SVC, "--interval", "1"))
            elif w == "balancer":
                say(self.cli("balancer", "status", SVC, "--last", "5"))

    def check(self, ok: bool, what: str) -> bool:
        say(f"  [{'ok' if ok else 'FAILED'}] {what}")
        if not ok:
            self.failed.append(what)
        return ok

    def start_shard(self, name: str, host: str, listen: str | None = None) -> None:
        out = os.path.join(self.workdir, f"{name}.out")
        args = ["-m", "vfab.services.sdhcp", "server", "--etcd", self.tb.etcd_endpoint, "--service", SVC,
                "--name", name, "--iface", self.tb.hosts[host]["iface"], "--data", os.path.join(self.workdir, "data"),
                *(["--listen", listen] if listen else [])]     # the pool: from the service record (setup)
        proc = self.tb.run_on(host, f"sdhcp-{name}", args, stdout=open(out, "wb"))
        wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 30, f"shard {name} to start")
        if not proc.alive():
            raise RuntimeError(f"shard {name} died at start:\n{proc.tail(30)}")
        self.procs[name] = proc

    def owners(self) -> list[tuple[int, int, str, list[str]]]:
        return [(r.lo, r.hi, r.owner, list(r.mirrors)) for r, _ in self.reg.ranges(SVC)]

    def owner_of(self, key: int) -> str:
        return next(o for lo, hi, o, _ in self.owners() if lo <= key <= hi)

    def balancer_status(self) -> schema.BalancerStatus | None:
        got = self.reg.get(schema.balancer_key(SVC))
        return schema.BalancerStatus.from_json(got[0]) if got else None

    def decisions(self) -> list[dict]:
        status = self.balancer_status()
        return status.decisions if status is not None else []

    def say_decisions(self, seen: int, result: bool = False) -> int:
        """Print the balancer's decisions after the first ``seen`` (with their results if asked); how many now."""
        ds = self.decisions()
        for d in ds[seen:]:
            say(f"  balancer: {d['action']} {', '.join(f'{lo:#08x}-{hi:#08x}' for lo, hi in d['ranges'])} "
                f"{d.get('owner', '')} -> {d.get('peer', '')}: {d['reason']}"
                + (f" ({d.get('result', '')})" if result else ""))
        return len(ds)

    def key(self, i: int) -> int:
        return mackey.key(self.farm.macs[i])   # the service's key function: 'vfab service add' writes mac-hash

    def line(self, t0: float, extra: str = "") -> str:
        loads = load_by_range(self.reg, SVC)
        shards = "  ".join(f"{o}:{lo:06x}-{hi:06x}" + (f"+{','.join(m)}" if m else "")
                           + (f" {loads[(o, lo)][1]:.0f}/s" if (o, lo) in loads else "")
                           for lo, hi, o, m in self.owners())
        return f"  t={time.monotonic() - t0:5.1f} s  bound {len(self.farm.addresses()):3}/{self.plan.total}  {shards}{extra}"

    # -- the story --------------------------------------------------------------------------------------
    def setup(self) -> None:
        p = self.plan
        opts = [a for k, v in p.opts().items() for a in ("--opt", f"{k}={v}")]
        say(self.cli("service", "add", SVC, "--kind", "sdhcp", *opts))
        for name, host in SHARDS.items():
            self.start_shard(name, host, "0-0xffffff" if name == "s1" else None)
        self.tb.wait_revision(self.reg.state_revision(), timeout=30)
        say(f"shards: s1 on vfh1 owns every key; s2 on vfh4 is a spare (owns nothing); {p.opts()['pool']}, "
            f"lease {p.lease} s")
        sets = p.balancer()
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        out = open(os.path.join(self.workdir, "balancer.out"), "wb")
        self.balancer = self.tb.sup.start("balancer", [sys.executable, "-m", "vfab.cli", "--etcd",
                                                       self.tb.etcd_endpoint, "balancer", "run", SVC, *args],
                                          stdout=out)
        say(f"balancer: vfab balancer run {SVC} " + " ".join(args))
        macs, self.kinds = client_macs(p)
        self.farm = dc.ClientFarm(self.tb, FARM_HOST, "d", macs, self.workdir)
        self.farm.create()
        self.tb.wait_revision(self.reg.state_revision(), timeout=60)
        say(f"clients: {p.udhcpc} udhcpc, {p.dhclient} dhclient, {p.dhcpcd} dhcpcd, each in its own namespace "
            f"(vfxd0..vfxd{p.total - 1}, macvlans of {FARM_HOST}'s port)")
        t0 = time.monotonic()
        wait_for(self.balancer_watching, 60, "the balancer to see s1's load and the spare s2 (its output: "
                 f"{os.path.join(self.workdir, 'balancer.out')})", interval=0.1)
        say(f"the balancer sees s1's load and the spare s2 ({time.monotonic() - t0:.1f} s after the clients were "
            "ready)")

    def balancer_watching(self) -> bool:
        """The balancer has published a round that saw s1's load report and s2 as a spare: a burst started
        before that (the balancer still importing on a loaded machine) could end before it looked."""
        status = self.balancer_status()
        if status is None:
            return False
        view = status.view
        return ("s2" in view.get("spares", []) and
                any(r.get("owner") == "s1" and r.get("rate") is not None for r in view.get("ranges", [])))

    def burst(self) -> None:
        p, farm = self.plan, self.farm
        say()
        say(f"1. [{self.clock()}] burst: {p.total} clients start within {p.arrive:g} s; the balancer watches s1")
        order = list(range(p.total))
        random.Random(3).shuffle(order)
        t0 = time.monotonic()
        next_line = t0 + 1.0
        for j, i in enumerate(order):
            while time.monotonic() < t0 + p.arrive * j / p.total:
                time.sleep(0.005)
            kind = self.kinds[i]
            self.started[i] = time.time()
            if kind == "udhcpc":
                farm.start_udhcpc([i], once=False, configure=True)
            elif kind == "dhclient":
                farm.start_dhclient(i)
            else:
                farm.start_dhcpcd(i)
            if time.monotonic() >= next_line:
                say(self.line(t0))
                next_line += 1.0
        seen = 0
        deadline = t0 + 60 + p.arrive

        def settled() -> bool:
            ds = self.decisions()
            return len(farm.addresses()) == p.total and (not ds or ds[-1].get("result") not in ("requested",
                                                                                                 "running"))
        while time.monotonic() < deadline:
            seen = self.say_decisions(seen)
            say(self.line(t0))
            if settled() and time.monotonic() - t0 > p.arrive + 3:
                break
            time.sleep(1.0)
        bound = farm.addresses()
        say(f"  {len(bound)}/{p.total} clients bound; time from a client's start to its lease: {self.lease_times()}")
        splits = [d for d in self.decisions() if d["action"] == "split"]
        self.check(bool(splits) and all(d.get("result") == "done" for d in splits),
                   f"the balancer split the hot shard by itself ({len(splits)} split(s): "
                   f"{'; '.join(d['reason'] for d in splits) or 'none'})")
        say()
        self.tables("ranges", "status", "balancer")

    def lease_times(self) -> str:
        """Per kind: median and longest time from the client's start to its first bound; the slow ones."""
        by: dict[str, list[float]] = {}
        slow = []
        for i, kind in enumerate(self.kinds):
            t = next((t for ev, _, t in self.farm.events(i) if ev == "bound"), None)
            if t is not None and i in self.started:
                by.setdefault(kind, []).append(t - self.started[i])
                if t - self.started[i] > 3 and kind != "dhcpcd":
                    slow.append(f"{self.farm.names[i]} ({kind}) {t - self.started[i]:.1f} s")
        text = ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f}/{max(v):.1f} s" for k, v in by.items())
        return text + " (median/longest)" + (f"; slower than 3 s: {', '.join(slow)}" if slow else "")

    def mirror_and_kill(self) -> None:
        p, farm = self.plan, self.farm
        victim = self.owner_of(UPPER.lo)
        name, host = MIRROR
        say()
        say(f"2. [{self.clock()}] mirror: shard {name} starts on {host} and mirrors {victim} (the owner of the upper half)")
        self.start_shard(name, host)
        op = statectl.wait(self.reg, SVC, statectl.mirror(self.reg, SVC, victim, name).op, timeout=60)
        self.check(op.phase == "done", f"mirror {victim} -> {name}: {op.phase} {op.error or ''}".rstrip())
        self.tb.wait_revision(self.reg.state_revision(), timeout=30)
        mine = [Range(lo, hi) for lo, hi, o, _ in self.owners() if o == victim]
        clients = [i for i in range(p.total) if any(self.key(i) in r for r in mine)]

        def on_mirror() -> int:
            body = statectl.command(self.reg, SVC, name, "STATS", {}).body["sdhcp"]
            return body.get("mirrored", {}).get("bound", 0)
        try:
            wait_for(lambda: on_mirror() >= len(clients), 10, "the mirror to hold every lease")
        except Exception:   # noqa: BLE001 - reported as a failed check below
            pass
        self.check(on_mirror() >= len(clients), f"{name} holds the {len(clients)} leases of {victim}'s clients "
                                                f"({on_mirror()} bound on the mirror)")
        say(self.cli("ranges", SVC))
        # kill -9 while the clients renew (udhcpc every lease/2 s)
        kinds = {k: sum(1 for i in clients if self.kinds[i] == k) for k in ("udhcpc", "dhclient", "dhcpcd")}
        say()
        say(f"3. [{self.clock()}] kill -9 {victim} (pid {self.procs[victim].pid}); its {len(clients)} clients "
            f"({', '.join(f'{n} {k}' for k, n in kinds.items() if n)}) must renew at {name}")
        before = {i: farm.addresses().get(i) for i in clients}
        proc = self.procs.pop(victim)
        t_kill_wall = time.time()
        t_kill = time.monotonic()
        self.tb.sup.kill9(proc)
        took = wait_for(lambda: (time.monotonic() - t_kill) if self.owner_of(UPPER.lo) == name else None, 15,
                        f"{name} to take {victim}'s ranges over")
        say(f"  {name} owns {victim}'s ranges {took:.2f} s after the kill (etcd lease 1 s, reaped on a 0.5 s scan)")

        def renewed() -> list[int]:
            return [i for i in clients if any(ev == "renew" and t > t_kill_wall for ev, _, t in farm.events(i))]

        def lapsed() -> list[int]:  # lost its address after the kill (its renewals went unanswered to its end)
            return [i for i in clients if any(ev == "deconfig" and t > t_kill_wall for ev, _, t in farm.events(i))]
        deadline = time.monotonic() + p.lease + 10
        next_line = time.monotonic()
        while time.monotonic() < deadline and len(renewed()) < len(clients):
            if time.monotonic() >= next_line:
                say(self.line(t_kill, f"  renewed at {name}: {len(renewed())}/{len(clients)}"))
                next_line += 2.0
            time.sleep(0.2)
        got = renewed()
        first = min((t for i in got for ev, _, t in farm.events(i) if ev == "renew" and t > t_kill_wall),
                    default=None)
        say(self.line(t_kill, f"  renewed at {name}: {len(got)}/{len(clients)}"))
        self.check(len(got) == len(clients),
                   f"{len(got)}/{len(clients)} of {victim}'s clients renewed at {name} after the kill"
                   + (f" (each renews every {p.lease // 2} s; the first {first - t_kill_wall:.1f} s after the "
                      "kill)" if first else ""))
        after = farm.addresses()
        gone = lapsed()
        kept = [i for i in clients if after.get(i) == before[i] and i not in gone]
        self.check(len(kept) == len(clients), f"they kept their addresses, none lapsed ({len(kept)}/{len(clients)}"
                   + (f"; lapsed: {[farm.names[i] for i in gone]}" if gone else "") + ")")
        st = statectl.command(self.reg, SVC, name, "STATS", {}).body["sdhcp"]
        self.check(st["counters"].get("naks", 0) == 0, f"{name} sent no NAK ({st['counters'].get('naks', 0)})")
        say()
        self.tables("ranges", "status")

    def verify(self) -> None:
        p, farm = self.plan, self.farm
        say()
        say(f"4. [{self.clock()}] checks from the clients' side")
        addrs = farm.addresses()
        self.check(len(addrs) == p.total, f"every client holds a lease: {len(addrs)}/{p.total}")
        twice = dc.held_twice(farm)
        self.check(not twice, "no address was ever held by two clients (from their event logs)"
                   + (f": {twice[:5]}" if twice else ""))
        self.check(len(set(addrs.values())) == len(addrs), f"{len(set(addrs.values()))} distinct addresses")
        changed = [farm.names[i] for i in range(p.total)
                   if len({ip for ev, ip, _ in farm.events(i) if ev in ("bound", "renew")}) > 1
                   or any(ev == "deconfig" for ev, _, _ in farm.events(i)[self._first_bound(i):])]
        self.check(not changed, "leases survived: no client's address changed or was taken away"
                   + (f" ({len(changed)}: {changed[:5]})" if changed else ""))
        for n in changed[:5]:  # what its hook recorded, in the time of the demo
            i = farm.names.index(n)
            say(f"    {n} ({self.kinds[i]}): " + ", ".join(f"{ev} {ip} at {t - self.t0_wall:.2f} s" for ev, ip, t in farm.events(i)))
        wrong = [farm.names[i] for i, ip in addrs.items() if farm.configured(i) != [ip]]
        self.check(not wrong, "each namespace's kernel holds exactly its client's address"
                   + (f" (not: {wrong[:5]})" if wrong else ""))
        renews = sum(1 for i in range(p.total) for ev, _, _ in farm.events(i) if ev == "renew")
        bound = {n: statectl.command(self.reg, SVC, n, "STATS", {}).body["sdhcp"]["bound"] for n in self.procs}
        self.check(sum(bound.values()) == p.total, f"the shards hold {sum(bound.values())} bound leases "
                                                   f"({bound}); {renews} renewals seen by the clients")
        say()
        self.tables("balancer")

    def leave_and_merge(self) -> None:
        p, sets = self.plan, self.plan.balancer()
        window = sets["merge_window"]
        say()
        say(f"5. [{self.clock()}] the clients leave: every client process stops; the shards go idle and the "
            f"balancer merges them back (below {sets['merge_rate']:g} requests/s for {window:g} s)")
        self.farm.stop_all()
        seen = len(self.decisions())
        t0 = time.monotonic()

        def merged() -> bool:
            ds = self.decisions()
            return len({o for _, _, o, _ in self.owners()}) == 1 and bool(ds) and ds[-1]["action"] == "merge" \
                and ds[-1].get("result") == "done"
        next_line = t0
        while time.monotonic() < t0 + window + 30 and not merged():
            seen = self.say_decisions(seen)
            if time.monotonic() >= next_line:
                say(self.line(t0))
                next_line += 2.0
            time.sleep(0.2)
        self.say_decisions(seen, result=True)
        owners = sorted({o for _, _, o, _ in self.owners()})
        self.check(merged(), f"the balancer merged the idle shards by itself, {time.monotonic() - t0:.1f} s after "
                             f"the clients left: " + (f"{owners[0]} owns every key" if len(owners) == 1
                                                                 else f"{', '.join(owners)} still share the keys"))
        if len(owners) == 1:
            held = statectl.command(self.reg, SVC, owners[0], "STATS", {}).body["sdhcp"]["clients"]
            self.check(held >= p.total, f"{owners[0]} holds every client's lease record after the merge "
                                        f"({held} for {p.total} clients)")
        say()
        self.tables("ranges", "balancer")

    def _first_bound(self, i: int) -> int:
        evs = self.farm.events(i)
        return next((j for j, (ev, _, _) in enumerate(evs) if ev == "bound"), len(evs))

    def close(self) -> None:
        if self.farm is not None:
            self.farm.remove()
        if self.balancer is not None:
            self.tb.sup.stop(self.balancer)


def run(args: argparse.Namespace) -> int:
    plan = Plan(args.udhcpc, args.dhclient, args.dhcpcd, args.arrive, args.lease)
    if args.smoke:
        plan = Plan(20, 1, 1, 2.0, 10)
    say(f"vfab sdhcp demo: starting a line,2,3 fabric (OVS userspace, os-ken, etcd, Mininet) for {plan.total} "
        "DHCP clients ...")
    t0 = time.monotonic()
    tb = Testbed("line,2,3", poll=1.0)
    tb.start()
    say(f"fabric up in {time.monotonic() - t0:.0f} s (including any wait for another run's testbed lock)")
    demo = Demo(tb, plan)
    try:
        demo.setup()
        demo.burst()
        demo.mirror_and_kill()
        demo.verify()
        demo.leave_and_merge()
    finally:
        say(f"tearing down ({time.monotonic() - t0:.0f} s) ...")
        demo.close()
        tb.stop()
    say(f"{'all checks passed' if not demo.failed else 'FAILED: ' + '; '.join(demo.failed)} "
        f"({time.monotonic() - t0:.0f} s)")
    return 1 if demo.failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.sdhcp.demo", description=__doc__.split("\n\n")[0],
                                epilog="Needs root (namespaces, Open vSwitch). 'make demo-sdhcp' runs it with "
                                       "the defaults.")
    p.add_argument("--udhcpc", type=int, default=245, help="busybox udhcpc clients (default 245, the paper's count)")
    p.add_argument("--dhclient", type=int, default=3, help="ISC dhclient clients (default 3)")
    p.add_argument("--dhcpcd", type=int, default=3, help="dhcpcd clients (default 3)")
    p.add_argument("--arrive", type=float, default=4.0, help="seconds over which the clients start (default 4)")
    p.add_argument("--lease", type=int, default=20, help="lease time in s (default 20: udhcpc renews every 10 s)")
    p.add_argument("--smoke", action="store_true", help="a small run that proves the demo works (20 udhcpc, 1 dhclient, 1 dhcpcd, lease 10 s; about 30 s)")
    args = p.parse_args(argv)
    if args.udhcpc < 1 or args.dhclient < 0 or args.dhcpcd < 0 or args.udhcpc + args.dhclient + args.dhcpcd > 1000:
        p.error("clients: --udhcpc at least 1, --dhclient/--dhcpcd at least 0, at most 1000 in all")
    if not 0.5 <= args.arrive <= 60 or not 10 <= args.lease <= 3600:
        p.error("--arrive must be 0.5..60 s and --lease 10..3600 s")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
