"""The helper's own work per get, without the kernel: CPU-ns per single-key get through mc-helper's protocol core.

``services/memcached-helper/dpdk/mch_corebench.c`` drives the core as the throughput bench's load does (single-key
gets of 1,000 keys from 256 clients, 64-byte values, multi-gets of ~195 keys, memcached's answer fed in 64 KB
reads) and adds the frame work around it (the request's UDP checksum checked, each reply copied with its checksum
summed); it times its process CPU, not memcached's answers it writes.  The count is deterministic, so two builds
compare within ~2 % where ``bench/helper_throughput.py``'s rounds (the kernel's af_packet path, ~70 % of a capped
helper's CPU, and the machine's noise) spread 0.65-1.06.  With ``--base REV`` the same driver is also built against
that revision's core (mc_proto.c, mc_batch.c and their headers, mch_csum.h) and the two run alternately, side by
side; a round's figure is the best of the driver's own repeats, a build's the median over rounds.

Run: ``/opt/vfab-venv/bin/python bench/helper_core.py [--smoke] [--rounds 5] [--base REV] [--gets N]``.
Results: bench/results/helper_core[-smoke].json.  Needs gcc (no DPDK, not root).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import parser, write  # noqa: E402

REPO = os.path.dirname(HERE)
DPDK_DIR = os.path.join(REPO, "services", "memcached-helper", "dpdk")
CORE = ("mc_proto.c", "mc_batch.c")
HEADERS = ("mc_proto.h", "mc_batch.h", "mch_csum.h")
DRIVER = "mch_corebench.c"
# as meson builds mc-helper (buildtype=release, b_lto=true)
CFLAGS = ("-std=gnu11", "-O3", "-flto", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror")


def build(src_dir: str, out: str) -> str:
    """gcc this tree's driver with the core in src_dir (the driver is copied there: a quoted #include looks
    beside the including file first); returns the binary's path."""
    shutil.copy(os.path.join(DPDK_DIR, DRIVER), os.path.join(src_dir, DRIVER))
    cmd = ["gcc", *CFLAGS, "-o", out, *(os.path.join(src_dir, f) for f in (DRIVER, *CORE))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"helper_core: building {out} failed:\n{' '.join(cmd)}\n{res.stderr[-3000:]}")
    return out


def sources(rev: str | None, into: str) -> str:
    """The core's files into a new folder: as they are in this tree (rev None) or at git revision rev."""
    os.makedirs(into)
    for f in (*CORE, *HEADERS):
        if rev is None:
            shutil.copy(os.path.join(DPDK_DIR, f), os.path.join(into, f))
            continue
        rel = os.path.relpath(os.path.join(DPDK_DIR, f), REPO)
        res = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{rel}"], capture_output=True, timeout=60)
        if res.returncode != 0:
            raise SystemExit(f"helper_core: --base {rev}: no {rel} there ({res.stderr.decode().strip()})")
        with open(os.path.join(into, f), "wb") as fh:
            fh.write(res.stdout)
    return into


def run_once(binary: str, gets: int, repeats: int) -> dict:
    res = subprocess.run([binary, "--gets", str(gets), "--rounds", str(repeats)], capture_output=True, text=True,
                         timeout=600)
    m = re.search(r"^ns_per_get ([0-9.]+)$", res.stdout, re.M)
    k = re.search(r"([0-9.]+) keys per multi-get", res.stdout)
    if res.returncode != 0 or not m:
        raise SystemExit(f"helper_core: {binary} exit {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return {"ns_per_get": float(m.group(1)), "keys_per_multiget": float(k.group(1)) if k else None}


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="alternated rounds per build (default 5; smoke 1)")
    ap.add_argument("--gets", type=int, default=None, help="gets per timed repeat (default 2,000,000; smoke 100,000)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats inside one run; the best counts (3)")
    ap.add_argument("--base", default=None, help="also build the core of this git revision and compare (e.g. HEAD~3)")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.smoke else 5)
    gets = args.gets or (100_000 if args.smoke else 2_000_000)
    if shutil.which("gcc") is None:
        print("helper_core: needs gcc (scripts/bootstrap.sh installs it)", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="vfab-corebench-")
    try:
        builds = {"tree": build(sources(None, os.path.join(work, "tree")), os.path.join(work, "corebench-tree"))}
        if args.base:
            builds["base"] = build(sources(args.base, os.path.join(work, "base")), os.path.join(work, "corebench-base"))
        per = {name: [] for name in builds}
        for r in range(rounds):
            order = list(builds) if r % 2 == 0 else list(reversed(builds))
            for name in order:
                row = run_once(builds[name], gets, args.repeats)
                per[name].append(row["ns_per_get"])
                print(f"round {r + 1}: {name:>4} {row['ns_per_get']:6.1f} ns per get "
                      f"({row['keys_per_multiget']} keys per multi-get)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {name: {"ns_per_get_median": round(statistics.median(v), 1), "ns_per_get_rounds": v}
               for name, v in per.items()}
    print(f"helper core, {rounds} round(s) of {gets} gets: this tree {results['tree']['ns_per_get_median']} ns per get")
    if args.base:
        ratio = results["tree"]["ns_per_get_median"] / results["base"]["ns_per_get_median"]
        results["tree_over_base"] = round(ratio, 3)
        print(f"  {args.base}: {results['base']['ns_per_get_median']} ns per get; this tree / base = {ratio:.3f}")
    write("helper_core", {"rounds": rounds, "gets": gets, "repeats": args.repeats, "base": args.base,
                          "cflags": " ".join(CFLAGS), "smoke": args.smoke}, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
