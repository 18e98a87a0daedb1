"""Helper throughput per core: mc-helper against dpdk-testpmd io-forward on the same af_packet vdev, same run.

Rig (services/memcached-helper/topo.py PairTopo): a generator namespace wired by one veth straight to the
device under test (DUT) — either mc-helper or dpdk-testpmd ``--forward-mode=io``, both ``--no-huge
--no-pci --vdev=net_af_packet0,iface=<port>,framecnt=4096``, one forwarding lcore on CPU 1 — and for the
helper, memcached (``-t 1``, CPU 0) on its TCP leg, preloaded with every key asked.  The generator
(``dpdk/mch_blast.c``, CPU 0) sends the frames a Linux memcached client sends — single-key ``get`` of 1,000
keys (64-byte values), UDP checksums, 256 source ports — as fast as it can, to the port's MAC, from a MAC
that is not its own: what comes back (helper replies, testpmd's forwarded frames) is dropped by the
generator's kernel before IP and counted on its interface.

Throughput, the unit both get: **frames out per CPU-second of the DUT** — for the helper, single-key gets
answered (one request frame in, one reply frame out, the same frame count per unit as io-forward's frame in,
frame out); CPU-second = the DUT process's user + system time (/proc; tick-based accounting, so the kernel's
packet work done in its context — its own sends into the veth — is in it) plus ksoftirqd on its CPU.
memcached is not the bottleneck: it answers multi-gets of ~100 keys on the other CPU (its CPU share is
printed, ~0.1 of a core).  Beside it, a second view: frames out per *busy* second of the DUT's CPU (/proc/stat
user + system + irq + softirq + steal of CPU 1, whatever ran there).  Here CPU 1 counts as busy 0.37-0.44 of
the time while the DUT process is held to 0.25: the rest is about CPU 1's interrupt share (0.12-0.17, also
printed), which this tick-sampled accounting does not split further by whose frames it handled.  The goal
is judged on the first view.

Why a CPU cap: on this 2-core machine one core cannot offer more than ~0.4-0.5 M frames/s (the kernel's copy
into the DUT's ring runs on the sender's core), and both DUTs keep up with that, so a busy-polling DUT's
CPU-second says nothing.  Each DUT is therefore run twice: *open* (no cap: does it keep up with what the
generator offers?) and *capped* at ``--share`` of CPU 1 (a cpu cgroup, 10 ms period): then it cannot keep up,
its ring overflows (it sends back less than offered), and frames out / CPU-second is its throughput per
core.  Counters are read over a window inside each generator run (after 0.5 s), so the DUT is in its steady
state throughout.

mc-helper runs in each of the settings ``--configs`` names: ``fabric``, the options the fabric, its tests and the
demo run helpers with (helper_common.FABRIC_HELPER_OPTS: 1 connection, T <= 1 ms, and ``--idle-us 50``: after 64
empty loops the lcore sleeps in ppoll on its TCP connections until memcached answers, the next batch is due or 50
us pass; and the agent's stats period, 100 ms, where the test rig writes its stats file every 50), and the
busy-polling settings of helper_common.HELPER_CONFIGS (its defaults, 2 connections and T <= 200 us; 1 connection
with T <= 1 ms or 3 ms): larger multi-gets cost fewer TCP sends and receives per get.  Under the
cap the busy-polling settings loop 0.6-1.2 times per frame (17-25 frames per receive burst: empty loops while
memcached answers), ``fabric`` 0.05-0.1 times (30-31 frames per burst; it slept once per ~5,000 frames), yet their
frames per CPU-second came out alike (5 rounds, 2026-11-29): the empty loops are cheap, the cost is each frame's
own work.  The goal is judged on ``fabric``, the helper as it runs.  Each round runs testpmd and every setting
once, the order reversed every other round; a setting's throughput is the median over rounds of its ratio to the
same round's testpmd (paired: the capped rounds are noisy, 0.65-1.06 in single rounds, and a round's DUTs run
within a minute of each other), the ratio of the medians beside it.

Run: ``/opt/vfab-venv/bin/python bench/helper_throughput.py [--smoke] [--rounds 5] [--duration 4]
[--share 0.25] [--configs fabric,default]`` (root).  Results: bench/results/helper_throughput[-smoke].json.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import cpu_busy_s, not_root, parser, write  # noqa: E402
from bench.helper_common import (  # noqa: E402
    FABRIC_HELPER_OPTS, HELPER_CONFIGS, CpuCap, cpu_irq_s, helper_pkg, ksoftirqd_pid, quiet_machine)

helper_agent = importlib.import_module(f"{helper_pkg().__name__}.agent")
helper_control = importlib.import_module(f"{helper_pkg().__name__}.control")

DUT_CPU = 1
KEYS, PREFIX, VALUE = 1000, "k", 64
GOAL = 0.8
JUDGED = "fabric"   # the setting the goal is judged on: the helper as the fabric runs it
# as the fabric's agent runs it: its options and its stats period (the test rig writes stats every 50 ms)
# the busy-polling settings: --idle-us 0 (mc-helper's default was busy polling until issue 43; it now backs off)
CONFIGS = {JUDGED: (*FABRIC_HELPER_OPTS, "--stats-ms", str(helper_agent.STATS_MS)),
           **{k: ("--idle-us", "0", *v) for k, v in HELPER_CONFIGS.items()}}
WARMUP, TAIL = 0.5, 0.3      # seconds of each generator run before and after the measured window


def start_testpmd(t, sup_name: str = "testpmd"):
    """testpmd io-forward on the DUT port: main lcore 0 (idle: prints stats every second), forwarding lcore 1."""
    from vfab.services.memcached_helper import topo
    prefix = f"{t.helper_prefix}tp"
    cmd = ["ip", "netns", "exec", t.ns_h, "dpdk-testpmd", "-l", f"0,{DUT_CPU}", "--no-huge", "--no-pci", "-m", "256",
           f"--file-prefix={prefix}", f"--vdev=net_af_packet0,iface={t.if_h},framecnt=4096", "--",
           "--total-num-mbufs=8192", "--forward-mode=io", "--port-topology=loop", "-a", "--stats-period", "1"]
    proc = t.sup.start(sup_name, cmd)

    def ready() -> bool:
        if not proc.alive():
            raise topo.TopoError(f"dpdk-testpmd exited ({proc.popen.returncode}):\n{proc.tail(30)}")
        return "Port statistics" in proc.tail(200)
    topo.wait_for(ready, 30, "dpdk-testpmd forwarding (its first stats report)")
    return proc, prefix


def blast(t, binary: str, duration: float) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", t.ns_c[0], "taskset", "-c", "0", binary, "--iface", t.if_c[0], "--dst-mac",
           t.mac_h, "--dst", t.server(), "--keys", str(KEYS), "--prefix", PREFIX, "--duration", str(duration)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def measure(t, topo, binary: str, dut: str, pid: int, window: float, capped: bool, cap: CpuCap | None) -> dict:
    """One generator run against the DUT (pid).  Counters are read over ``window`` seconds inside the run (after
    WARMUP, before its end), so the DUT is in its steady state throughout: frames offered and sent back, the DUT's
    CPU; frames back per DUT CPU-second."""
    mc, softirqd = t.memcached.pid, ksoftirqd_pid(DUT_CPU)
    gen = blast(t, binary, WARMUP + window + TAIL)
    time.sleep(WARMUP)

    def snap() -> tuple:
        return (time.monotonic(), t.link(t.ns_c[0], t.if_c[0]), topo.proc_cpu_s(pid) + topo.proc_cpu_s(softirqd),
                cpu_irq_s(DUT_CPU), topo.proc_cpu_s(mc), t.stats() if dut != "testpmd" else {},
                cap.throttled() if cap else 0, cpu_busy_s(DUT_CPU))
    a = snap()
    time.sleep(window)
    b = snap()
    out, err = gen.communicate(timeout=WARMUP + window + TAIL + 30)
    if gen.returncode != 0:
        raise RuntimeError(f"mch_blast failed ({gen.returncode}): {err.strip()}")
    g = json.loads(out)
    el = b[0] - a[0]
    sent, back = b[1]["tx_packets"] - a[1]["tx_packets"], b[1]["rx_packets"] - a[1]["rx_packets"]
    cpu, irq, busy = b[2] - a[2], b[3] - a[3], b[7] - a[7]
    row = {"dut": dut, "capped": capped, "window_s": round(el, 3), "offered_pps": round(sent / el),
           "returned_pps": round(back / el), "kept_up": round(back / max(sent, 1), 4),
           "dut_cpu_share": round(cpu / el, 3), "dut_cpu_irq_share": round(irq / el, 3),
           "frames_per_cpu_s": round(back / max(cpu, 1e-9)),
           "core_busy_share": round(busy / el, 3), "frames_per_core_busy_s": round(back / max(busy, 1e-9)),
           "memcached_cpu_share": round((b[4] - a[4]) / el, 3),
           "throttled_periods": b[6] - a[6], "generator": g}
    if dut != "testpmd":
        d = {k: b[5].get(k, 0) - a[5].get(k, 0) for k in ("rx_frames", "tx_frames", "w_done", "b_cmds", "b_keys",
                                                          "drop_busy", "drop_peers", "tx_drop", "tx_nombuf",
                                                          "w_abort_miss", "loops", "rx_bursts", "idle_sleeps",
                                                          "tcp_reads", "tcp_reads_empty")}
        row.update({"helper": d, "keys_per_multiget": round(d["b_keys"] / max(d["b_cmds"], 1), 1),
                    "frames_per_rx_burst": round(d["rx_frames"] / max(d["rx_bursts"], 1), 1)})
    return row


def report(r: dict) -> dict:
    extra = f", {r['keys_per_multiget']} keys/multi-get" if r["dut"] != "testpmd" else ""
    print(f"{r['dut']:>20} {'capped' if r['capped'] else 'open':>6}: offered {r['offered_pps']:>7}/s, back "
          f"{r['returned_pps']:>7}/s (kept up {r['kept_up']:.3f}), DUT CPU {r['dut_cpu_share']:.2f} of a core "
          f"(irq {r['dut_cpu_irq_share']:.2f} of it) -> {r['frames_per_cpu_s']:>7} frames/CPU-s; CPU {DUT_CPU} busy "
          f"{r['core_busy_share']:.2f} -> {r['frames_per_core_busy_s']:>7} frames/busy-s; memcached "
          f"{r['memcached_cpu_share']:.2f}{extra}", flush=True)
    return r


def run(t, topo, binary: str, gen: str, rounds: int, duration: float, share: float, configs: list[str],
        rows: list[dict]) -> int:
    """The rounds: testpmd and mc-helper in each setting, each open then capped, the order reversed every other
    round; rows appended as they come (``round`` in each).  The helpers' exit codes, or-ed."""
    rc = 0
    cap = None
    t.create()
    try:
        cap = CpuCap(t.tag, share)
        t.start_memcached()
        t.preload(KEYS, prefix=PREFIX, value_size=VALUE)
        duts = ["testpmd", *(f"helper/{c}" for c in configs)]
        for rnd in range(rounds):
            for dut in (duts if rnd % 2 == 0 else duts[::-1]):
                if dut == "testpmd":
                    proc, prefix = start_testpmd(t)
                else:
                    proc = t.start_helper(binary, str(DUT_CPU), CONFIGS[dut.split("/", 1)[1]])
                try:
                    for capped in (False, True):
                        if capped:
                            cap.add(proc.pid)
                        row = measure(t, topo, gen, dut, proc.pid, duration, capped, cap if capped else None)
                        row["round"] = rnd
                        rows.append(report(row))
                finally:
                    if dut == "testpmd":
                        t.sup.stop(proc)
                        helper_control.remove_runtime(prefix)
                    else:
                        rc |= t.stop_helper() or 0
    finally:
        if cap is not None:
            cap.remove()
        t.destroy()
    return rc


def summarize(rows: list[dict], configs: list[str]) -> dict:
    """Per setting: the median of its per-round ratios to testpmd (the goal's measure), the ratio of the medians,
    and the runs' medians; the open runs' keep-up; whether every capped run was saturated."""
    capped = [r for r in rows if r["capped"]]
    tp = {r["round"]: r["frames_per_cpu_s"] for r in capped if r["dut"] == "testpmd"}
    tp_core = {r["round"]: r["frames_per_core_busy_s"] for r in capped if r["dut"] == "testpmd"}
    tp_med = statistics.median(tp.values()) if tp else 0.0
    out: dict = {"testpmd_frames_per_cpu_s": round(tp_med), "goal": GOAL, "helper": {}}
    for c in configs:
        mine = [r for r in capped if r["dut"] == f"helper/{c}"]
        per_round = [round(r["frames_per_cpu_s"] / tp[r["round"]], 3) for r in mine if tp.get(r["round"])]
        med = statistics.median(r["frames_per_cpu_s"] for r in mine) if mine else 0.0
        paired = statistics.median(per_round) if per_round else 0.0
        per_round_core = [round(r["frames_per_core_busy_s"] / tp_core[r["round"]], 3) for r in mine
                          if tp_core.get(r["round"])]
        out["helper"][c] = {
            "options": " ".join(CONFIGS[c]) or "defaults", "gets_per_cpu_s": round(med),
            "over_testpmd": round(paired, 3), "ratio_per_round": per_round,
            "ratio_of_medians": round(med / max(tp_med, 1e-9), 3), "goal_met": paired >= GOAL,
            "over_testpmd_core_busy": round(statistics.median(per_round_core), 3) if per_round_core else 0.0,
            "ratio_per_round_core_busy": per_round_core,
            "keys_per_multiget": statistics.median(r["keys_per_multiget"] for r in mine) if mine else 0}
    opened = [r for r in rows if not r["capped"]]
    out["open_offered_pps"] = round(statistics.median(r["offered_pps"] for r in opened)) if opened else 0
    out["open_kept_up_min"] = {d: min(r["kept_up"] for r in opened if r["dut"] == d)
                               for d in dict.fromkeys(r["dut"] for r in opened)}
    out["capped_saturated"] = all(r["kept_up"] < 0.98 for r in capped)
    if JUDGED in out["helper"]:
        out["goal_met"] = out["helper"][JUDGED]["goal_met"]
    return out


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="rounds, DUT order reversed every other (default 5; "
                    "smoke 1)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds measured per generator run (default 4; smoke 1)")
    ap.add_argument("--share", type=float, default=0.25,
                    help="CPU cap of the DUT in the capped runs, fraction of one CPU (default 0.25)")
    ap.add_argument("--configs", default=None,
                    help=f"mc-helper settings, comma-separated, of {', '.join(CONFIGS)} (default all; smoke: "
                    f"{JUDGED}, the one the goal is judged on)")
    args = ap.parse_args()
    if not_root("helper_throughput", "namespaces, DPDK af_packet, a cpu cgroup"):
        return 1
    if subprocess.run(["sh", "-c", "command -v dpdk-testpmd"], capture_output=True).returncode != 0:
        print("helper_throughput: dpdk-testpmd not found: install Debian's dpdk-dev (scripts/bootstrap.sh)",
              file=sys.stderr)
        return 1
    configs = (args.configs or (JUDGED if args.smoke else ",".join(CONFIGS))).split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"helper_throughput: unknown --configs {', '.join(unknown)}: choose from {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    rounds = args.rounds or (1 if args.smoke else 5)
    duration = args.duration or (1.0 if args.smoke else 4.0)
    helper_pkg()
    from vfab.services.memcached_helper import topo
    work = tempfile.mkdtemp(prefix="vfab-bench-mcht-")
    binary = topo.build_helper(os.path.join(work, "build"))
    gen = topo.build_blast(os.path.join(work, "build"))
    t = topo.PairTopo(os.path.join(work, "run"), pin="0")
    rows: list[dict] = []
    with quiet_machine("helper_throughput"):
        rc = run(t, topo, binary, gen, rounds, duration, args.share, configs, rows)
    if rc == 0:   # a failed run keeps its folder (logs, the helper's stats) for a post-mortem
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(rows, configs)
    print(f"throughput per core (capped at {args.share} of CPU {DUT_CPU}), {rounds} round(s): testpmd io-forward "
          f"{summary['testpmd_frames_per_cpu_s']} frames/CPU-s (median)")
    for c, h in summary["helper"].items():
        print(f"  mc-helper {c:>14} ({h['options']}): {h['gets_per_cpu_s']} gets/CPU-s, {h['keys_per_multiget']} "
              f"keys/multi-get: {h['over_testpmd']:.2f} of testpmd (median of rounds {h['ratio_per_round']}; ratio "
              f"of medians {h['ratio_of_medians']:.2f}; goal {GOAL}); per busy second of CPU {DUT_CPU}: "
              f"{h['over_testpmd_core_busy']:.2f} (rounds {h['ratio_per_round_core_busy']})"
              + ("  <- the goal's setting" if c == JUDGED else ""))
    print(f"  open: offered ~{summary['open_offered_pps']}/s, kept up (least) {summary['open_kept_up_min']}")
    params = {"smoke": args.smoke, "rounds": rounds, "duration_s": duration, "share": args.share,
              "dut_cpu": DUT_CPU, "keys": KEYS, "value_bytes": VALUE, "generator": "mch_blast, CPU 0, 256 ports",
              "memcached": "-t 1, CPU 0", "helper": "lcore 1", "judged": JUDGED,
              "configs": {c: " ".join(CONFIGS[c]) for c in configs},
              "testpmd": "--forward-mode=io --port-topology=loop, forwarding lcore 1", "helper_exit": rc}
    write("helper_throughput", params, {"runs": rows, "summary": summary}, args.out)
    bad = [r for r in rows if r["returned_pps"] == 0 or (r["dut"] != "testpmd" and r["helper"]["w_abort_miss"])]
    return 1 if bad or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
