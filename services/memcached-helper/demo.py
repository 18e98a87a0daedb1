"""``make demo-helpers``: PostMan helpers switched in front of an unmodified memcached on a real fabric.

A ``line,2,3`` fabric (OVS userspace, os-ken, etcd, Mininet); memcached on vfh1 owns service ``mc`` (its
UDP front door keys clients by address); helpers h1 (vfh2) and h2 (vfh5, across the trunk) run mc-helper on
DPDK.  Clients on vfh3, vfh4, vfh6 (each standing for 4 client machines) send memcached UDP gets to vfh1's
address and never change anything.  The demo prints, phase by phase:

1. a burst straight at memcached: its CPU per get, latency, losses;
2. the helpers switched in by one decision ``{service, range, helpers}`` applied through
   ``control.apply_decision`` — the call the balancer (controller/balancer.py) makes when it sees a burst;
   here it is made by hand — and how long the switches took;
3. the same burst through the helpers: memcached's CPU per get, keys per multi-get, S and T;
4. ``kill -9`` of h1 under the burst: its clients move to h2 with no reconnect; the longest pause;
5. helpers off, everything torn down.

``python -m vfab.services.memcached_helper.demo [--rate 4000] [--seconds 3]`` (root; builds nothing: run
``make helper`` first, ``make demo-helpers`` does both).
"""

from __future__ import annotations

import argparse
import logging
import sys
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


def burst(mc: McFabric, bind: dict, rate: int, seconds: float, timeline: bool = False, during=None) -> dict:
    """Open-loop gets from every client host at ``rate``/s each; memcached's CPU per answered get."""
    cpu0 = mc.memcached_cpu_s()
    extra = ["--timeline", "0.05", "--gap-min", "0.04"] if timeline else []
    procs = [mc.client(h, "load", "--clients", "32", "--rate", str(rate), "--duration", str(seconds), "--keys",
                       str(KEYS), "--bind", bind[h], "--drain", "1.0", *extra) for h in CLIENTS]
    side = during() if during else None
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


def helper_line(mc: McFabric, before: dict, after: dict) -> str:
    out = []
    for n in sorted(after):
        d = {k: after[n].get(k, 0) - before.get(n, {}).get(k, 0) for k in after[n]}
        s = control.summary(d)
        s_now = control.summary(after[n])
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s["hist"].items(), key=lambda kv: int(kv[0])))
        out.append(f"  {n}: {s['gets']:,} gets in {s['batches']:,} multi-gets = {s['keys_per_batch']} keys each "
                   f"(histogram by keys {hist}); now S={s_now['S_bytes']} B, T={s_now['T_us']} µs")
    return "\n".join(out)


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
        say(f"clients: {len(CLIENTS)} hosts x 4 addresses x 8 sockets, open loop, {args.rate:,}/s per host")
        say()
        say(f"1. burst straight at memcached ({args.seconds:.0f} s)")
        direct = burst(mc, bind, args.rate, args.seconds)
        say(line("direct", direct))
        say()
        decision = {"service": "mc", "range": None, "helpers": sorted(HELPERS)}
        say(f"2. decision {decision} -> control.apply_decision (the balancer's hook)")
        t0 = time.monotonic()
        changes = control.apply_decision(tb.registry, decision)
        took = tb.wait_revision(max(c.revision for c in changes))
        say(f"  written in {(time.monotonic() - t0 - took) * 1e3:.1f} ms, on every switch {took * 1e3:.1f} ms "
            "later; clients changed nothing")
        say()
        say(f"3. the same burst through the helpers ({args.seconds:.0f} s)")
        before = {n: mc.stats(n) for n in HELPERS}
        helped = burst(mc, bind, args.rate, args.seconds)
        after = {n: mc.stats(n) for n in HELPERS}
        say(line("through 2 helpers", helped))
        say(helper_line(mc, before, after))
        say(f"  memcached CPU per get: {direct['cpu_us']:.2f} -> {helped['cpu_us']:.2f} µs "
            f"({direct['cpu_us'] / helped['cpu_us']:.1f}x less)")
        res = CliRunner().invoke(_cli(), ["--etcd", tb.etcd_endpoint, "helpers", "mc"])
        say(res.output.rstrip())
        say()
        say("4. kill -9 of h1's mc-helper under the burst")
        box: dict = {}

        def kill_later():
            time.sleep(min(2.0, args.seconds / 2))
            box["t_kill"] = mc.kill_helper("h1")
            box["t_gone"] = mc.endpoint_gone("h1", 5.0)
            return box
        failed = burst(mc, bind, args.rate, max(args.seconds, 4.0), timeline=True, during=_thread(kill_later))
        t_kill = box["t_kill"]
        pause = max((g[2] for r in failed["res"] for g in r["gaps"] if g[1] <= t_kill + 0.05 and g[1] + g[2] >= t_kill),
                    default=0.0)
        say(line("h1 killed, h2 left", failed))
        say(f"  h1's endpoint left etcd {(box['t_gone'] - t_kill) * 1e3:.0f} ms after the kill (its agent revoked "
            f"the lease); longest pause of any client {pause * 1e3:.0f} ms (PostMan: 400 ms to reconnect)")
        say(f"  live helpers now: {', '.join(control.live_helpers(tb.registry, 'mc'))}")
        say()
        say("5. helpers off")
        changes = control.apply_decision(tb.registry, {"service": "mc", "helpers": []})
        if changes:
            tb.wait_revision(max(c.revision for c in changes))
        calm = burst(mc, bind, args.rate // 4, 1.5)
        say(line("direct again (calm)", calm))
        mc.helpers.pop("h1", None)
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
    import threading

    def start():
        t = threading.Thread(target=fn, daemon=True)
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
