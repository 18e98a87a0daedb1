"""memcached's CPU per get and throughput: clients straight to memcached vs through the PostMan helper (mc-helper).

One topology (services/memcached-helper/topo.py): 3 client namespaces on a Linux bridge, memcached
(Debian's, ``-t 1``) in its own namespace, mc-helper (DPDK net_af_packet, lcore 1) in another, reaching
memcached over TCP on a veth.  memcached and the clients are pinned to CPU 0, the helper polls on CPU 1 (it
sleeps when idle, ``--idle-us 20``).  Clients are unmodified memcached UDP clients: the same sockets send to
10.77.0.1:11211 either way; only their neighbour entry for that address moves (the front door's job).

For each offered load (open loop, gets of 1 key, 32-byte keys, 64-byte values, uniform over the keys) the
direct path and the helper path (two settings: the defaults, and 1 connection with T <= 1 ms) are measured
back to back:
  memcached CPU per get   (utime + stime of the memcached process, /proc, over the run) / gets answered
  helper CPU per get      the same for mc-helper (includes its polling)
  answered, lost, p50/p99 latency at the clients; keys per multi-get and the final S/T of the helper
  bytes per get on memcached's link (direct: its client-facing veth; helper: the TCP leg)
Then a closed-loop run of memaslap (memcaslap --udp, 90 % get / 10 % set, 32 connections) each way gives
throughput and memcached CPU per request at saturation of the client.

Run: ``/opt/vfab-venv/bin/python bench/helper_batching.py [--smoke] [--rates 20000,40000] [--duration 5]``
(root; ``--smoke`` finishes in under a minute).  Results: bench/results/helper_batching[-smoke].json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import parser, write  # noqa: E402

HELPER_DIR = os.path.join(os.path.dirname(HERE), "services", "memcached-helper")
PREFIX = "bench-key-padded-to-32-bytes-"   # + up to 5 digits: 30-34 bytes
VALUE = 64
NS = 3
# helper settings compared: the defaults (2 connections, T <= 200 us) and one that trades latency for
# larger multi-gets (1 connection, T <= 1 ms)
CONFIGS = {"default": (), "1conn_tmax1ms": ("--conns", "1", "--t-max", "1000")}


def helper_pkg():
    """vfab.services.memcached_helper (loaded from its folder until setup.py maps it)."""
    try:
        import vfab.services.memcached_helper as pkg
    except ImportError:
        spec = importlib.util.spec_from_file_location("vfab.services.memcached_helper",
                                                      os.path.join(HELPER_DIR, "__init__.py"),
                                                      submodule_search_locations=[HELPER_DIR])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pkg
        spec.loader.exec_module(pkg)
    return pkg


def link_bytes(t, ns: str, dev: str) -> int:
    s = json.loads(t.ns(ns, "ip", "-j", "-s", "link", "show", dev))[0]["stats64"]
    return s["rx"]["bytes"] + s["tx"]["bytes"]


def open_loop(t, topo, mode: str, rate: int, duration: float, keys: int, clients: int, config: str) -> dict:
    t.steer(mode)
    time.sleep(0.2)
    dev_ns, dev = (t.ns_mc, t.if_mc) if mode == "direct" else (t.ns_mc, t.if_mc_leg)
    mc_pid, h_pid = t.memcached.pid, t.helper.pid if t.helper else None

    def helper_cpu() -> float:
        return topo.proc_cpu_s(h_pid) if h_pid else 0.0
    st0, cpu0, hcpu0, b0 = t.stats(), topo.proc_cpu_s(mc_pid), helper_cpu(), link_bytes(t, dev_ns, dev)
    args = ("load", "--server", t.server(), "--clients", str(clients), "--duration", str(duration),
            "--rate", str(rate / NS), "--keys", str(keys), "--prefix", PREFIX, "--value-size", str(VALUE),
            "--drain", "0.5")
    res = t.run_clients([(i, args) for i in range(NS)], timeout=duration + 60)
    time.sleep(0.1)
    st1, cpu1, hcpu1, b1 = t.stats(), topo.proc_cpu_s(mc_pid), helper_cpu(), link_bytes(t, dev_ns, dev)
    answered = sum(r["answered"] for r in res)
    sent = sum(r["sent"] for r in res)
    out = {
        "mode": mode, "config": config if mode == "helper" else "-", "offered_per_s": rate, "sent": sent,
        "answered": answered,
        "lost": sum(r["lost"] for r in res), "wrong": sum(r["wrong"] for r in res),
        "missed": sum(r["missed"] for r in res),
        "answered_per_s": round(sum(r["rate"] for r in res), 1),
        "p50_us": round(sum(r.get("p50_us", 0) for r in res) / NS, 1),
        "p99_us": max(r.get("p99_us", 0) for r in res),
        "memcached_cpu_us_per_get": round((cpu1 - cpu0) / max(answered, 1) * 1e6, 3),
        "memcached_cpu_pct": round((cpu1 - cpu0) / duration * 100, 1),
        "helpee_link_bytes_per_get": round((b1 - b0) / max(answered, 1), 1),
        "sources": sorted({s for r in res for s in r["sources"]}),
    }
    if mode == "helper":
        cmds = st1["b_cmds"] - st0["b_cmds"]
        keys_ = st1["b_keys"] - st0["b_keys"]
        out.update({
            "helper_cpu_us_per_get": round((hcpu1 - hcpu0) / max(answered, 1) * 1e6, 3),
            "helper_cpu_pct": round((hcpu1 - hcpu0) / duration * 100, 1),
            "multigets": cmds, "keys_per_multiget": round(keys_ / max(cmds, 1), 2),
            "hist_keys": {str(1 << b): st1[f"hist_keys_{1 << b}"] - st0[f"hist_keys_{1 << b}"] for b in range(9)},
            "S_bytes_end": st1["batch_S_bytes"], "T_us_end": round(st1["batch_T_ns"] / 1e3, 1),
            "closed_by_size": st1["close_size"] - st0["close_size"],
            "closed_by_time": st1["close_time"] - st0["close_time"],
            "helper_rx_frames": st1["rx_frames"] - st0["rx_frames"],
            "helper_drops": {k: st1[k] - st0[k] for k in st1
                             if k.startswith(("drop_", "tx_drop", "tx_nombuf", "net_", "rej_"))
                             and k != "net_ok" and st1[k] - st0[k]},
        })
    return out


def report(row: dict) -> dict:
    extra = (f"  helper {row['helper_cpu_us_per_get']} us/get, {row['keys_per_multiget']} keys/multi-get, "
             f"S {row['S_bytes_end']} B T {row['T_us_end']} us") if row["mode"] == "helper" else ""
    print(f"{row['offered_per_s']:>6}/s {row['mode']:>6} {row['config']:>13}: memcached "
          f"{row['memcached_cpu_us_per_get']:.2f} us/get ({row['memcached_cpu_pct']}% CPU), answered "
          f"{row['answered_per_s']}/s, lost {row['lost']}, p50 {row['p50_us']} us p99 {row['p99_us']} us, "
          f"{row['helpee_link_bytes_per_get']} B/get on memcached's link{extra}", flush=True)
    return row


def memaslap(t, topo, mode: str, duration: float) -> dict:
    t.steer(mode)
    time.sleep(0.2)
    mc_pid = t.memcached.pid
    cpu0 = topo.proc_cpu_s(mc_pid)
    cmd = ["ip", "netns", "exec", t.ns_c[0], "taskset", "-c", "0", "memcaslap", "-s", t.server(), "--udp", "-t",
           f"{int(duration)}s", "-T", "1", "-c", "32", "-X", str(VALUE)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    cpu1 = topo.proc_cpu_s(mc_pid)
    got = {k.strip(): v.strip() for k, sep, v in (ln.partition(":") for ln in out.stdout.splitlines()) if sep}
    ops = int(got.get("cmd_get", 0)) + int(got.get("cmd_set", 0))
    tps = next((ln.split("TPS:")[1].split()[0] for ln in out.stdout.splitlines() if "TPS:" in ln), "0")
    if out.returncode != 0 or not ops:
        print(f"memaslap {mode} failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}", flush=True)
    return {"mode": mode, "rc": out.returncode, "ops": ops, "tps": int(tps),
            "udp_timeout": int(got.get("udp_timeout", -1)),
            "packet_drop": int(got.get("packet_drop", -1)), "verify_failed": int(got.get("verify_failed", -1)),
            "memcached_cpu_us_per_op": round((cpu1 - cpu0) / max(ops, 1) * 1e6, 3)}


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rates", default=None, help="offered gets/s, comma-separated (default 20000,40000)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (default 5; smoke 2)")
    ap.add_argument("--clients", type=int, default=16, help="client sockets per namespace (3 namespaces)")
    ap.add_argument("--keys", type=int, default=10000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("helper_batching: needs root (network namespaces, DPDK af_packet)", file=sys.stderr)
        return 1
    rates = [int(r) for r in (args.rates or ("8000" if args.smoke else "20000,40000")).split(",")]
    duration = args.duration or (2.0 if args.smoke else 5.0)
    keys = 2000 if args.smoke else args.keys
    helper_pkg()
    from vfab.services.memcached_helper import topo
    work = tempfile.mkdtemp(prefix="vfab-bench-mch-")
    binary = topo.build_helper(os.path.join(work, "build"))
    t = topo.HelperTopo(os.path.join(work, "run"), clients=NS, pin="0")
    rows, slap = [], []
    t.create()
    try:
        t.start_memcached()
        t.preload(keys, prefix=PREFIX, value_size=VALUE)
        rc = 0
        for rate in rates:
            rows.append(report(open_loop(t, topo, "direct", rate, duration, keys, args.clients, "-")))
            for config, extra in CONFIGS.items():
                t.start_helper(binary, "1", ("--idle-us", "20", *extra))
                rows.append(report(open_loop(t, topo, "helper", rate, duration, keys, args.clients, config)))
                rc |= t.stop_helper() or 0
        t.start_helper(binary, "1", ("--idle-us", "20"))
        for mode in ("direct", "helper"):
            r = memaslap(t, topo, mode, duration)
            slap.append(r)
            print(f"memaslap {mode:>6}: {r['tps']} ops/s, memcached {r['memcached_cpu_us_per_op']:.2f} us/op, "
                  f"timeouts {r['udp_timeout']}, drops {r['packet_drop']}", flush=True)
        rc |= t.stop_helper() or 0
    finally:
        t.destroy()
    summary = {}
    for rate in rates:
        d = next(r for r in rows if r["offered_per_s"] == rate and r["mode"] == "direct")
        for config in CONFIGS:
            h = next(r for r in rows if r["offered_per_s"] == rate and r["config"] == config)
            ratio = round(d["memcached_cpu_us_per_get"] / max(h["memcached_cpu_us_per_get"], 1e-9), 2)
            summary[f"{rate}/{config}"] = {
                "memcached_cpu_ratio_direct_over_helper": ratio, "keys_per_multiget": h["keys_per_multiget"],
                "p99_us_direct_vs_helper": [d["p99_us"], h["p99_us"]],
                "memcached_plus_helper_cpu_us_per_get": round(h["memcached_cpu_us_per_get"]
                                                              + h["helper_cpu_us_per_get"], 3)}
            print(f"{rate}/s {config}: memcached needs {ratio}x less CPU per get through the helper "
                  f"({h['keys_per_multiget']} keys per multi-get)")
    s0, s1 = slap
    summary["memaslap"] = {"tps_helper_over_direct": round(s1["tps"] / max(s0["tps"], 1), 2),
                           "memcached_cpu_ratio_direct_over_helper":
                           round(s0["memcached_cpu_us_per_op"] / max(s1["memcached_cpu_us_per_op"], 1e-9), 2)}
    params = {"smoke": args.smoke, "rates": rates, "duration_s": duration, "namespaces": NS,
              "clients_per_ns": args.clients, "keys": keys, "key_bytes": len(PREFIX) + len(str(keys - 1)),
              "value_bytes": VALUE, "memcached": "-t 1, pinned to CPU 0 with the clients",
              "helper": "lcore 1, --idle-us 20", "helper_configs": {k: " ".join(v) or "defaults"
                                                                     for k, v in CONFIGS.items()},
              "helper_exit": rc}
    write("helper_batching", params, {"open_loop": rows, "memaslap": slap, "summary": summary}, args.out)
    bad = [r for r in rows if r["wrong"] or (r["mode"] == "helper" and r["sources"] != [t.server()])]
    return 1 if bad or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
