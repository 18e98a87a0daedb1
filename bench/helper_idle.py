"""What an idle or switched-off helper costs (issue 43): mc-helper's CPU with no traffic, and the latency of a
sparse get that has to wake it, for three ways of waiting, side by side in one run.

One topology (services/memcached-helper/topo.py): one client namespace, memcached, one helper on lcore 1.
Per setting, the helper is started, left alone for ``--idle`` s (its CPU over that time: utime + stime of the
process, all its threads, /proc/PID/stat), then one client sends ``--sparse`` gets a second for ``--idle`` s
through it (open loop: each get finds the helper idle again; p50 and p99 at the client, and the helper's CPU
meanwhile):

  busy-poll    ``--idle-us 0``: never sleeps (the helper's default before issue 43)
  fixed-50us   ``--idle-us 50 --idle-max-us 50``: sleeps 50 us at a time (what the tests and the fabric used)
  backoff      the default since issue 43: ``--idle-us 20`` doubling per idle sleep up to ``--idle-max-us 2000``

Run: ``/opt/vfab-venv/bin/python bench/helper_idle.py [--smoke] [--idle 3] [--sparse 20]`` (root).
Results: bench/results/helper_idle[-smoke].json (CPU in cores: CPU-s per s).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import not_root, parser, write  # noqa: E402
from bench.helper_common import helper_pkg, quiet_machine  # noqa: E402

SETTINGS = {"busy-poll": ("--idle-us", "0"), "fixed-50us": ("--idle-us", "50", "--idle-max-us", "50"),
            "backoff": ()}
PREFIX = "k"


def measure(t, topo, binary: str, name: str, idle: float, sparse: int) -> dict:
    proc = t.start_helper(binary, "1", SETTINGS[name])
    try:
        t.steer("helper")
        time.sleep(0.5)   # start-up done
        c0, w0 = topo.proc_cpu_s(proc.pid), time.monotonic()
        time.sleep(idle)
        idle_cores = (topo.proc_cpu_s(proc.pid) - c0) / (time.monotonic() - w0)
        c0, w0 = topo.proc_cpu_s(proc.pid), time.monotonic()
        r = t.run_client(0, "load", "--server", t.server(), "--clients", "1", "--duration", str(idle), "--rate",
                         str(sparse), "--keys", "200", "--prefix", PREFIX, "--value-size", "64", "--drain", "0.5")
        sparse_cores = (topo.proc_cpu_s(proc.pid) - c0) / (time.monotonic() - w0)
    finally:
        t.steer("direct")
        rc = t.stop_helper()
    row = {"setting": name, "options": " ".join(SETTINGS[name]) or "defaults", "idle_cores": round(idle_cores, 4),
           "sparse_cores": round(sparse_cores, 4), "sparse_per_s": sparse, "answered": r["answered"],
           "sent": r["sent"], "wrong": r["wrong"], "p50_us": r.get("p50_us"), "p99_us": r.get("p99_us"),
           "helper_exit": rc}
    print(f"{name:>10}: idle {row['idle_cores']:.4f} core; {sparse} gets/s: {row['sparse_cores']:.4f} core, "
          f"p50 {row['p50_us']} us p99 {row['p99_us']} us, answered {row['answered']}/{row['sent']}", flush=True)
    return row


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--idle", type=float, default=None, help="seconds of each phase (default 3; smoke 1)")
    ap.add_argument("--sparse", type=int, default=20, help="gets a second in the sparse phase (default 20)")
    args = ap.parse_args()
    if not_root("helper_idle", "network namespaces, DPDK af_packet"):
        return 1
    idle = args.idle or (1.0 if args.smoke else 3.0)
    helper_pkg()
    from vfab.services.memcached_helper import topo
    work = tempfile.mkdtemp(prefix="vfab-bench-idle-")
    binary = topo.build_helper(os.path.join(work, "build"))
    t = topo.HelperTopo(os.path.join(work, "run"), clients=1, pin="0")
    rows = []
    with quiet_machine("helper_idle"):
        t.create()
        try:
            t.start_memcached()
            t.preload(200, prefix=PREFIX, value_size=64)
            rows = [measure(t, topo, binary, name, idle, args.sparse) for name in SETTINGS]
        finally:
            t.destroy()
    by = {r["setting"]: r for r in rows}
    ratios = {"busy_over_backoff_idle": round(by["busy-poll"]["idle_cores"] / max(by["backoff"]["idle_cores"], 1e-6), 1),
              "fixed_over_backoff_idle": round(by["fixed-50us"]["idle_cores"] / max(by["backoff"]["idle_cores"], 1e-6),
                                               1)}
    print(f"an idle helper costs {by['backoff']['idle_cores']:.4f} core with back-off: "
          f"{ratios['busy_over_backoff_idle']}x less than busy polling, {ratios['fixed_over_backoff_idle']}x less "
          f"than 50 us sleeps")
    write("helper_idle", {"smoke": args.smoke, "idle_s": idle, "sparse_per_s": args.sparse,
                          "helper": "lcore 1, 1 client namespace, memcached and client on CPU 0"},
          {"rows": rows, "ratios": ratios}, args.out)
    shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in rows if r["wrong"] or r["helper_exit"] or r["answered"] < 0.9 * r["sent"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
