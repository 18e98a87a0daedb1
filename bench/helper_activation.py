"""Burst onset → PostMan helpers carrying the traffic, on the real fabric, and the clients' p99 with and without.

One ``line,2,3`` fabric (OVS userspace, os-ken, etcd, Mininet): memcached on vfh1 owns service ``mc`` (UDP
front door keyed by the client address), helpers h1 (vfh2) and h2 (vfh5) run mc-helper on DPDK; clients on
vfh3, vfh4, vfh6 (4 addresses each, 16 sockets per host) are unmodified memcached UDP clients
(``services/memcached-helper/mcudp.py load``, open loop) that never change anything.

Three variants of the same burst (``--rate`` gets/s per client host for ``--seconds``), side by side:

* ``direct``: no balancer; the burst goes to memcached all along.
* ``balancer``: ``vfab balancer run mc`` (its own process, ``--period`` s) watches memcached's ``stats`` and
  switches the helpers on by itself (rate trigger; controller/balancer.py says why the p99 model cannot on
  this testbed).  Repeated ``--repeat`` times; helpers are switched off and the balancer restarted between.
* ``balancer_1obs``: the same with ``burst_window`` 0: one observation above ``rate_on`` decides (quicker,
  and a single noisy sample could switch helpers on: the default needs two).
* ``by hand``: the same decision written to etcd at a known moment during the burst (what the balancer's
  ``apply`` writes): the re-route alone, the part that replaces PostMan's client reconnection.

What is measured, and how (wall clock of this machine, every process on it):

* **onset**: the moment the burst's first request is sent (``t0_wall`` of the earliest client process);
* **decision**: the ``at`` of the balancer's ``helpers_on`` decision (it reads memcached's stats every period,
  needs the rate above ``rate_on`` for ``burst_window`` s, then writes the range record);
* **carrying**: the bench reads memcached's UDP ``InDatagrams`` (``/proc/<memcached>/net/snmp``, its
  namespace) every ~2 ms; with helpers on, no client datagram reaches memcached any more (they reach it as
  multi-gets on the helpers' TCP connections), so "carrying" is the first sample after the *last* increase of
  that counter during the burst: from then on every client request goes through a helper.  Cross-checked with
  the helpers' own received-datagram counters (stats file every 10 ms).
* **p99**: the clients' own latency percentile over the whole burst, and lost requests (sent, never answered).

PostMan (paper 000): its clients reconnect to helpers in 550-750 ms (600-1,000 connections), triggered when
p99 > 500 µs.  Goal here: helpers carrying the traffic < 100 ms after the onset.

Run: ``/opt/vfab-venv/bin/python bench/helper_activation.py [--smoke] [--repeat 5] [--rate 3000]`` (root;
``--smoke``: one repetition of short bursts).  Results: bench/results/helper_activation[-smoke].json.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import not_root, parser, write  # noqa: E402
from bench.helper_common import (FABRIC_CLIENTS, FABRIC_HELPER_OPTS, FABRIC_HELPERS, FABRIC_KEYS,  # noqa: E402
                                 helper_fabric)

CLIENTS, HELPERS, KEYS, HELPER_OPTS = FABRIC_CLIENTS, FABRIC_HELPERS, FABRIC_KEYS, FABRIC_HELPER_OPTS
VARIANTS = ("direct", "balancer", "balancer_1obs", "by_hand")


class UdpWatch:
    """Samples memcached's UDP InDatagrams every ``every`` s in a thread: [(wall time, count)]."""

    def __init__(self, mc, every: float = 0.002):
        self.mc, self.every = mc, every
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), self.mc.memcached_udp_in()))
            time.sleep(self.every)

    def __enter__(self) -> "UdpWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def last_increase(self, t_from: float, t_to: float) -> float | None:
        """Time of the first sample after the last increase within [t_from, t_to] (None: it never stopped)."""
        window = [s for s in self.samples if t_from <= s[0] <= t_to]
        last = None
        for (_, a), (t, b) in zip(window, window[1:]):
            if b > a:
                last = t
        if last is None:
            return None
        after = [t for t, _ in window if t > last]
        return after[0] if after else None

    def period(self) -> float:
        ts = [t for t, _ in self.samples]
        return statistics.median(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 2 else float("nan")


def helper_first_rx(mc, names, t_from: float, t_to: float, poll: list) -> float | None:
    """Earliest stats-file time (mtime) at which a helper's rx_dgrams grew, from ``poll`` [(t, {name: rx})]."""
    base = poll[0][1] if poll else {}
    for t, rx in poll:
        if t_from <= t <= t_to and any(rx.get(n, 0) > base.get(n, 0) for n in names):
            return t
    return None


START_AHEAD = 0.4   # s: every client process is up (namespace entered, sockets bound) before the common start


def burst(mc, bind: dict, rate: int, seconds: float) -> list:
    """The client hosts' processes, all sending from one instant (``--start-at``): started one after another
    they ramped the burst up over 40-140 ms, and the balancer's reaction was mostly that ramp."""
    start = time.time() + START_AHEAD
    return [mc.client(h, "load", "--clients", "16", "--rate", str(rate), "--duration", str(seconds), "--keys",
                      str(KEYS), "--drain", "1.0", "--bind", bind[h], "--timeline", "0.05", "--gap-min", "1",
                      "--start-at", f"{start:.6f}")
            for h in CLIENTS]


def summarise(res: list) -> dict:
    return {"sent": sum(r["sent"] for r in res), "answered": sum(r["answered"] for r in res),
            "lost": sum(r["lost"] for r in res), "wrong": sum(r["wrong"] for r in res),
            "p50_us": max(r.get("p50_us", 0) for r in res), "p99_us": max(r.get("p99_us", 0) for r in res),
            "onset": min(r["t0_wall"] for r in res) if all("t0_wall" in r for r in res) else None,
            # the client hosts' processes start one after another: the last starts this long after the onset
            "start_spread_ms": round((max(r["t0_wall"] for r in res) - min(r["t0_wall"] for r in res)) * 1e3, 1)
            if all("t0_wall" in r for r in res) else None}


def watch_helpers(mc, stop: threading.Event, out: list) -> None:
    """(stats file mtime, {helper: rx_dgrams}) whenever a helper's stats file changes."""
    seen = {}
    while not stop.is_set():
        for n, run in mc.helpers.items():
            try:
                m = os.stat(run.stats_file).st_mtime
            except OSError:
                continue
            if seen.get(n) != m:
                seen[n] = m
                out.append((m, {k: mc.stats(k).get("rx_dgrams", 0) for k in mc.helpers}))
        time.sleep(0.002)


def one(mc, tb, bind, args, variant: str, settings: dict) -> dict:
    from vfab.services.memcached_helper import control, topo
    from vfab.vid.registry import schema
    reg = tb.registry
    control.set_helpers(reg, mc.service, None, None)
    tb.wait_revision(reg.state_revision())
    reg.delete(schema.balancer_key(mc.service))    # the last balancer's record: a new one publishes its own
    bal = None
    if variant.startswith("balancer"):
        if variant == "balancer_1obs":
            settings = dict(settings, burst_window=0.0)
        bal = mc.start_balancer(settings)
        bal_cpu0, bal_t0 = topo.proc_cpu_s(bal.pid), time.monotonic()
        # memcached's agent: where its usage report is read and written (what the balancer read itself before)
        agent_cpu0 = topo.proc_cpu_s(mc.memcached.agent.pid)
        time.sleep(max(0.5, 3 * settings["period"]))   # start_balancer saw its first round: a few more
    hpoll: list = []
    stop = threading.Event()
    hthread = threading.Thread(target=watch_helpers, args=(mc, stop, hpoll), daemon=True)
    hthread.start()
    row: dict = {"variant": variant}
    try:
        with UdpWatch(mc) as w:
            n0 = len(mc.decisions())
            procs = burst(mc, bind, args.rate, args.seconds)
            t_decided = None
            if variant == "by_hand":
                time.sleep(args.seconds / 3)
                t_decided = time.time()
                changes = control.apply_decision(reg, {"service": mc.service, "helpers": sorted(HELPERS)})
                row["applied_s"] = tb.wait_revision(max(c.revision for c in changes))
            res = [topo.finish(p, args.seconds + 60) for p in procs]
            time.sleep(0.05)
        stop.set()
        hthread.join()
        s = summarise(res)
        row.update(s)
        onset = s["onset"]
        if variant.startswith("balancer"):
            ds = mc.decisions()[n0:]
            on = next((d for d in ds if d["action"] == "helpers_on"), None)
            t_decided = on["at"] if on else None
            row["reason"] = on["reason"] if on else None
            row["weights"] = dict(zip(on["helpers"], on["weights"])) if on else None
        t_end = onset + args.seconds if onset else time.time()
        carry = w.last_increase(t_decided, t_end) if t_decided else None
        first_rx = helper_first_rx(mc, HELPERS, onset, t_end, hpoll) if onset else None
        row.update({
            "udp_sample_ms": round(w.period() * 1e3, 2),
            "onset_to_decision_ms": round((t_decided - onset) * 1e3, 1)
            if t_decided and variant.startswith("balancer") else None,
            "decision_to_carrying_ms": round((carry - t_decided) * 1e3, 1) if carry and t_decided else None,
            "onset_to_carrying_ms": round((carry - onset) * 1e3, 1)
            if carry and variant.startswith("balancer") else None,
            "helper_first_rx_after_decision_ms": round((first_rx - t_decided) * 1e3, 1)
            if first_rx and t_decided else None,
            "memcached_udp_datagrams_after_carrying":
            (w.samples[-1][1] - next(c for t, c in w.samples if t >= carry)) if carry else None})
    finally:
        if bal is not None:
            # the balancer's own CPU, polling every period (a share of one core over the variant)
            row["balancer_cpu_share"] = round((topo.proc_cpu_s(bal.pid) - bal_cpu0) / (time.monotonic() - bal_t0), 3)
            row["memcached_agent_cpu_share"] = round((topo.proc_cpu_s(mc.memcached.agent.pid) - agent_cpu0)
                                                     / (time.monotonic() - bal_t0), 3)
            tb.sup.stop(bal)
    print(f"  {variant:<9} onset->decision {row.get('onset_to_decision_ms')} ms, decision->carrying "
          f"{row.get('decision_to_carrying_ms')} ms, onset->carrying {row.get('onset_to_carrying_ms')} ms; "
          f"p99 {row['p99_us']:,.0f} µs, lost {row['lost']}/{row['sent']}, wrong {row['wrong']}; clients started "
          f"over {row.get('start_spread_ms')} ms" + (f"; balancer CPU {row['balancer_cpu_share']:.1%} of a core"
                                                     if "balancer_cpu_share" in row else ""), flush=True)
    return row


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="bursts per variant (default 5; --smoke: 1)")
    ap.add_argument("--rate", type=int, default=3000, help="gets/s per client host during the burst (3 hosts)")
    ap.add_argument("--seconds", type=float, default=None, help="burst length (default 3; --smoke 2)")
    ap.add_argument("--period", type=float, default=0.02, help="the balancer's period in s (default 0.02)")
    ap.add_argument("--burst-window", type=float, default=None,
                    help="s the rate must stay above rate_on (default: one period, i.e. two observations)")
    ap.add_argument("--binary", default=None, help="mc-helper (default: the one 'make helper' built, else built now)")
    args = ap.parse_args()
    if not_root("helper_activation", "network namespaces, Open vSwitch, DPDK af_packet"):
        return 1
    repeat = 1 if args.smoke else args.repeat
    args.seconds = args.seconds or (2.0 if args.smoke else 3.0)
    settings = {"period": args.period, "stale_after": max(1.0, args.period * 4), "min_interval": 0.2,
                "burst_window": args.period if args.burst_window is None else args.burst_window, "calm_window": 1.0, "min_on": 1.0, "min_off": 0.5,
                "rate_on": int(args.rate * len(CLIENTS) * 0.5), "rate_off": int(args.rate * len(CLIENTS) * 0.2),
                "helper_capacity": args.rate * len(CLIENTS)}
    # memcached's usage report read as often as the balancer's period (issue 45: the balancer reads it from etcd)
    with helper_fabric(args.binary, stats_ms=10, report_every=args.period) as (tb, mc, bind):
        rows: list[dict] = []
        for i in range(repeat):
            print(f"round {i + 1}/{repeat}", flush=True)
            for variant in VARIANTS:
                rows.append(one(mc, tb, bind, args, variant, settings))

    def med(variant: str, key: str):
        vals = [r[key] for r in rows if r["variant"] == variant and r.get(key) is not None]
        return round(statistics.median(vals), 1) if vals else None

    def worst(variant: str, key: str):
        vals = [r[key] for r in rows if r["variant"] == variant and r.get(key) is not None]
        return max(vals) if vals else None
    missing = [r for r in rows if r["variant"] != "direct" and r.get("decision_to_carrying_ms") is None]
    summary = {
        "onset_to_carrying_ms": {v: {"median": med(v, "onset_to_carrying_ms"), "max": worst(v, "onset_to_carrying_ms")}
                                 for v in ("balancer", "balancer_1obs")},
        "onset_to_carrying_goal_ms": 100,
        "onset_to_decision_ms": {v: {"median": med(v, "onset_to_decision_ms"), "max": worst(v, "onset_to_decision_ms")}
                                 for v in ("balancer", "balancer_1obs")},
        "decision_to_carrying_ms": {v: med(v, "decision_to_carrying_ms") for v in VARIANTS[1:]},
        "decision_to_carrying_ms_by_hand_max": worst("by_hand", "decision_to_carrying_ms"),
        "postman_reconnect_ms": [550, 750],
        "p99_us": {v: med(v, "p99_us") for v in VARIANTS},
        "lost": {v: sum(r["lost"] for r in rows if r["variant"] == v) for v in VARIANTS},
        "wrong": sum(r["wrong"] for r in rows),
        "rounds_without_carrying": len(missing),
        "balancer_cpu_share": {v: med(v, "balancer_cpu_share") for v in ("balancer", "balancer_1obs")},
        "memcached_agent_cpu_share": {v: med(v, "memcached_agent_cpu_share") for v in ("balancer", "balancer_1obs")}}
    p99d, p99b = summary["p99_us"]["direct"], summary["p99_us"]["balancer"]
    if p99d and p99b:
        summary["p99_direct_over_balancer"] = round(p99d / p99b, 2)
    oc = summary["onset_to_carrying_ms"]["balancer"]["median"]
    rec = summary["decision_to_carrying_ms"]["by_hand"]
    if oc:
        summary["postman_reconnect_over_onset_to_carrying"] = round(550 / oc, 1)
    if rec:
        summary["postman_reconnect_over_reroute"] = round(550 / rec, 1)
    print(f"onset -> helpers carrying: median {oc} ms (max {summary['onset_to_carrying_ms']['balancer']['max']}; "
          f"one observation: {summary['onset_to_carrying_ms']['balancer_1obs']['median']} ms; goal < 100); the "
          f"re-route alone (decision -> carrying, by hand) {rec} ms vs PostMan's 550-750 ms reconnect")
    params = {"smoke": args.smoke, "repeat": repeat, "rate_per_host": args.rate, "hosts": len(CLIENTS),
              "burst_s": args.seconds, "balancer": settings, "helper_opts": " ".join(HELPER_OPTS),
              "clients": "3 hosts x 4 addresses x 16 sockets, open loop, single-key gets"}
    write("helper_activation", params, {"rounds": rows, "summary": summary}, args.out)
    return 1 if summary["wrong"] or missing else 0


if __name__ == "__main__":
    sys.exit(main())
