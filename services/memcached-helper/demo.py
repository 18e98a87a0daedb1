"""``make demo-helpers``: the balancer switching PostMan helpers in front of an unmodified memcached, live.

A ``line,2,3`` fabric (OVS userspace, os-ken, etcd, Mininet); memcached on vfh1 owns service ``mc`` (its
UDP front door keys clients by address); helpers h1 (vfh2) and h2 (vfh5, across the trunk) run mc-helper on
DPDK.  Clients on vfh3, vfh4, vfh6 (each standing for 4 client machines) send memcached UDP gets to vfh1's
address and never change anything.  The demo prints, phase by phase:

1. a burst straight at memcached, no balancer: its CPU per get, latency, losses;
2. ``vfab balancer run mc`` starts (its own process, reading etcd only: memcached's usage report, which its
   agent writes from ``stats`` every 0.1 s, and the helpers' status records); the same burst again: the balancer's decisions appear live, with their reasons and when they
   came after the burst began — helpers on (which, with what bucket weights), and off again after the calm
   window once the burst is over; memcached's CPU per get while the helpers carried the burst;
3. a burst during which h1's mc-helper is killed (``kill -9``) once the balancer has switched the helpers on:
   its clients move to h2 with no reconnect; the longest pause;
4. ``vfab balancer status mc`` and ``vfab helpers mc``; everything torn down.

The balancer's trigger here is memcached's request rate (``rate_on``/``rate_off``, scaled to ``--rate``):
this testbed cannot drive memcached near saturation, where the p99 model of controller/balancer.py decides
(its docstring has the numbers).

``python -m vfab.services.memcached_helper.demo [--rate 4000] [--seconds 3]`` (root; builds nothing: run
``make helper`` first, ``make demo-helpers`` does both).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from click.testing import CliRunner

from vfab.testbed.fabric import Testbed
from vfab.services.memcached_helper import agent, control, topo
from vfab.services.memcached_helper.onfabric import McFabric

CLIENTS = ("vfh3", "vfh4", "vfh6")
HELPERS = {"h1": "vfh2", "h2": "vfh5"}
KEYS = 5000
HELPER_OPTS = ("--idle-us", "50", "--conns", "1", "--t-max", "1000")


def say(text: str = "") -> None:
    print(text, flush=True)


def settings(rate: int) -> dict:
    """The balancer's settings for a burst of ``rate`` gets/s per client host (3 hosts)."""
    total = rate * len(CLIENTS)
    return {"period": 0.02, "stale_after": 1.0, "min_interval": 0.5, "burst_window": 0.02, "calm_window": 1.5,
            "min_on": 2.0, "min_off": 1.0, "rate_on": int(total * 0.5), "rate_off": int(total * 0.2),
            "helper_capacity": int(total * 0.7)}


def burst(mc: McFabric, bind: dict, rate: int, seconds: float, timeline: bool = False, during=None) -> dict:
    """Open-loop gets from every client host at ``rate``/s each; memcached's CPU per answered get."""
    cpu0 = mc.memcached_cpu_s()
    extra = ["--timeline", "0.05", "--gap-min", "0.04"] if timeline else []
    start = time.time() + 0.4   # every client host sends from this instant: a burst's onset, not a ramp
    procs = [mc.client(h, "load", "--clients", "32", "--rate", str(rate), "--duration", str(seconds), "--keys",
                       str(KEYS), "--bind", bind[h], "--drain", "1.0", "--start-at", f"{start:.6f}", *extra)
             for h in CLIENTS]
    side = during(start) if during else None
    res = [topo.finish(p, seconds + 60) for p in procs]
    cpu = mc.memcached_cpu_s() - cpu0
    answered = sum(r["answered"] for r in res)
    lat = sorted(r.get("p99_us", 0) for r in res)
    return {"res": res, "sent": sum(r["sent"] for r in res), "answered": answered,
            "lost": sum(r["lost"] for r in res), "wrong": sum(r["wrong"] for r in res),
            "rate": sum(r["rate"] for r in res), "cpu_us": cpu / answered * 1e6 if answered else float("nan"),
            "p50_us": sorted(r.get("p50_us", 0) for r in res)[1], "p99_us": lat[-1], "side": side}


def line(name: str, b: dict) -> str:
    return (f"  {name:<22} {b['rate']:>8,.0f} gets/s answered  memcached {b['cpu_us']:5.2f} CPU-µs/get  "
            f"p50 {b['p50_us']:>7,.0f} µs  p99 {b['p99_us']:>8,.0f} µs  lost {b['lost']}/{b['sent']}  "
            f"wrong {b['wrong']}")


def helper_line(before: dict, after: dict) -> str:
    out = []
    for n in sorted(after):
        d = {k: after[n].get(k, 0) - before.get(n, {}).get(k, 0) for k in after[n]}
        s = control.summary(d)
        s_now = control.summary(after[n])
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s["hist"].items(), key=lambda kv: int(kv[0])))
        out.append(f"  {n}: {s['gets']:,} gets in {s['batches']:,} multi-gets = {s['keys_per_batch']} keys each "
                   f"(histogram by keys {hist}); now S={s_now['S_bytes']} B, T={s_now['T_us']} µs")
    return "\n".join(out)


class Decisions:
    """Prints the balancer's decisions as they appear in etcd, timed from ``t0``; keeps them."""

    def __init__(self, mc: McFabric):
        self.mc, self.seen, self.t0 = mc, 0, time.time()
        self.stop = threading.Event()
        self.got: list[dict] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            ds = self.mc.decisions()
            for d in ds[self.seen:]:
                self.got.append(d)
                who = ""
                if d["action"] == "helpers_on":
                    who = " -> " + ", ".join(f"{h} (weight {w})" for h, w in zip(d["helpers"], d["weights"]))
                say(f"  [{d['at'] - self.t0:+6.2f} s] balancer: {d['action']}{who}: {d['reason']} "
                    f"[{d.get('result', '?')}]")
            self.seen = len(ds)
            self.stop.wait(0.05)

    def wait(self, action: str, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = [d for d in self.got if d["action"] == action]
            if hit:
                return hit[-1]
            time.sleep(0.05)
        return None

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def run(args: argparse.Namespace) -> int:
    binary = args.binary or agent.DEFAULT_BINARY
    tb = Testbed("line,2,3", poll=1.0)
    say("vfab PostMan helpers demo: starting a line,2,3 fabric (OVS userspace, os-ken, etcd, Mininet) ...")
    tb.start()
    try:
        mc = McFabric(tb, "mc", "vfh1", binary=binary)
        mc.start_memcached()
        mc.preload("vfh3", KEYS)
        say(f"memcached on vfh1 answers {mc.addr} (service mc, front door udp key=ip_src); {KEYS} keys loaded")
        for name, host in HELPERS.items():
            run_ = mc.start_helper(name, host, extra=HELPER_OPTS)
            say(f"helper {name} on {host}: mc-helper pid {run_.pid} (DPDK net_af_packet on "
                f"{tb.hosts[host]['iface']}), announced with a lease")
        bind = {h: ",".join(mc.client_addresses(h, 4)) for h in CLIENTS}
        say(f"clients: {len(CLIENTS)} hosts x 4 addresses x 32 sockets, open loop, {args.rate:,}/s per host")
        say()
        say(f"1. burst straight at memcached, no balancer ({args.seconds:.0f} s)")
        direct = burst(mc, bind, args.rate, args.seconds)
        say(line("direct", direct))
        say()
        cfg = settings(args.rate)
        say(f"2. 'vfab balancer run mc' ({' '.join(f'{k}={v}' for k, v in cfg.items())})")
        bal = mc.start_balancer(cfg)   # returns once its first round is published (raises if it exited)
        time.sleep(1.0)
        live = Decisions(mc)
        say(f"  the same burst again ({args.seconds + 2:.0f} s); the balancer's decisions, timed from the burst's "
            "start:")
        box: dict = {}

        def measure_helped(start: float):
            live.t0 = start           # the burst's first request: decisions are timed from here
            time.sleep(max(0.0, start - time.time()))
            on = live.wait("helpers_on", args.seconds)
            if on is None:
                return box
            time.sleep(0.3)
            box["before"] = {n: mc.stats(n) for n in HELPERS}
            box["cpu0"], box["udp0"] = mc.memcached_cpu_s(), mc.memcached_udp_in()
            time.sleep(max(0.5, args.seconds + 2 - (time.time() - live.t0) - 0.3))
            box["after"] = {n: mc.stats(n) for n in HELPERS}
            box["cpu1"], box["udp1"] = mc.memcached_cpu_s(), mc.memcached_udp_in()
            return box
        helped = burst(mc, bind, args.rate, args.seconds + 2, during=_thread(measure_helped))
        t_end = time.time()
        say(line("with the balancer", helped))
        if "after" in box:
            gets = sum(box["after"][n].get("rx_get", 0) - box["before"][n].get("rx_get", 0) for n in HELPERS)
            gets += box["udp1"] - box["udp0"]
            cpu_us = (box["cpu1"] - box["cpu0"]) / gets * 1e6 if gets else float("nan")
            say(helper_line(box["before"], box["after"]))
            say(f"  memcached CPU per get while the helpers carried the burst: {cpu_us:.2f} µs "
                f"(direct: {direct['cpu_us']:.2f} µs, {direct['cpu_us'] / cpu_us:.1f}x less)")
        off = live.wait("helpers_off", 15)
        if off:
            say(f"  helpers went off {off['at'] - t_end:.2f} s after the burst's last request")
        say()
        say("3. a burst again; kill -9 of h1's mc-helper once the balancer has switched the helpers on")

        def kill_later(start: float):
            live.t0 = start
            time.sleep(max(0.0, start - time.time()))
            on = live.wait("helpers_on", max(args.seconds, 4.0))
            if on is None:
                return box
            time.sleep(1.0)
            box["t_kill"] = mc.kill_helper("h1")
            box["t_gone"] = mc.endpoint_gone("h1", 5.0)
            return box
        box.clear()
        n_before = len(live.got)
        failed = burst(mc, bind, args.rate, max(args.seconds, 4.0) + 1, timeline=True, during=_thread(kill_later))
        say(line("h1 killed, h2 left", failed))
        if "t_kill" in box:
            t_kill = box["t_kill"]
            pause = max((g[2] for r in failed["res"] for g in r["gaps"] if g[1] <= t_kill + 0.05
                         and g[1] + g[2] >= t_kill), default=0.0)
            say(f"  h1's endpoint left etcd {(box['t_gone'] - t_kill) * 1e3:.0f} ms after the kill (its agent revoked "
                f"the lease); longest pause of any client {pause * 1e3:.0f} ms (PostMan: 400 ms to reconnect)")
            mc.helpers.pop("h1", None)
        elif len(live.got) == n_before:
            say("  (the balancer did not switch the helpers on this time: no kill)")
        say(f"  live helpers now: {', '.join(control.live_helpers(tb.registry, 'mc'))}")
        live.wait("helpers_off", 15)
        live.close()
        tb.sup.stop(bal)
        say()
        say("4. what the balancer decided, and the helpers")
        for cmd in (["balancer", "status", "mc"], ["helpers", "mc"]):
            res = CliRunner().invoke(_cli(), ["--etcd", tb.etcd_endpoint, *cmd])
            say(res.output.rstrip())
    finally:
        say("tearing down ...")
        tb.stop()
    say("done")
    return 0


def _cli():
    from vfab.cli.main import cli
    return cli


def _thread(fn):
    """Run ``fn`` in a thread; ``burst`` calls the returned starter after its clients are started."""
    def start(at: float):
        t = threading.Thread(target=fn, args=(at,), daemon=True)
        t.start()
        return t
    return start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfab.services.memcached_helper.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=4000, help="gets/s per client host (3 hosts; default 4000)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each burst (default 3)")
    p.add_argument("--binary", default=None, help=f"mc-helper (default {agent.DEFAULT_BINARY}: 'make helper')")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
