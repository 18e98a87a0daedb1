"""One benchmark on two checkouts side by side: this tree and a base (e.g. main), alternating, with ratios.

Each round runs the benchmark once with the base checkout's interpreter in the base
tree and once with this tree's (the order alternates between rounds, so drift hits
both alike), each writing its own results file; then the numbers that matter for
that benchmark are put side by side, per round and as the median ratio (this / base).

Run (root, as the benchmark needs)::

    /opt/vfab-venv-BRANCH/bin/python bench/ab.py --base /work/main --base-python /opt/vfab-venv/bin/python \\
        --bench kvs_throughput --rounds 2 -- --clients 1,4 --duration 6

Known benchmarks (what is compared): kvs_throughput (req/s and median ms per client count), kvs_ops (wall s
per operation, the load's p99 ms in its window).  ``--smoke`` runs one round of the benchmark's own smoke.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, write  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _throughput(doc: dict) -> dict[str, float]:
    out = {}
    for p in doc["results"]["points"]:
        out[f"{p['clients']} clients req/s"] = p["elastic"]["req_per_s"]
        out[f"{p['clients']} clients median ms"] = p["elastic"]["median_ms"]
    return out


def _ops(doc: dict) -> dict[str, float]:
    out = {}
    for c in doc["results"]["configs"]:
        for o in c["ops"]:
            name = f"{c['keys']} {c['placement']} {o['op']}"
            out[f"{name} wall s"] = o["wall_s"]
            if o.get("load", {}).get("p99_ms") is not None:
                out[f"{name} load p99 ms"] = o["load"]["p99_ms"]
    return out


METRICS = {"kvs_throughput": _throughput, "kvs_ops": _ops}


def check_tree(python: str, tree: str) -> None:
    """Refuse an interpreter whose ``vfab`` is another checkout's (an editable install follows the last
    ``make bootstrap`` run with that venv, from whichever tree): the comparison would be of the wrong code."""
    where = subprocess.run([python, "-c", "import os, vfab; print(os.path.realpath(vfab.__path__[0]))"],
                           capture_output=True, text=True, cwd="/")
    got = where.stdout.strip()
    if where.returncode != 0 or os.path.dirname(got) != os.path.realpath(tree):
        raise SystemExit(f"ab: {python} imports vfab from {got or where.stderr.strip()[-300:]}, not from {tree}: "
                         f"re-install it from that tree ('make -C {tree} bootstrap VENV=<its venv>') or name "
                         "the interpreter that has it")


def run_one(tree: str, python: str, bench: str, extra: list[str], out: str) -> dict:
    cmd = [python, os.path.join(tree, "bench", f"{bench}.py"), *extra, "--out", out]
    print(f"  $ (cd {tree} && {' '.join(cmd)})", flush=True)
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{bench} in {tree} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(out) as fh:
        return json.load(fh)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the base checkout (e.g. /work/main)")
    ap.add_argument("--base-python", required=True, help="the interpreter whose vfab is the base checkout's")
    ap.add_argument("--bench", required=True, choices=sorted(METRICS), help="the benchmark to compare")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each tree once per round (default 2)")
    ap.add_argument("extra", nargs="*", help="the benchmark's own arguments (after --)")
    args = ap.parse_args()
    extra = list(args.extra) + (["--smoke"] if args.smoke else [])
    rounds = 1 if args.smoke else args.rounds
    trees = {"base": (os.path.abspath(args.base), args.base_python), "this": (HERE, sys.executable)}
    for tree, python in trees.values():
        check_tree(python, tree)
    got: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    work = tempfile.mkdtemp(prefix="vfab-ab-")
    for r in range(rounds):
        for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
            tree, python = trees[side]
            doc = run_one(tree, python, args.bench, extra, os.path.join(work, f"{side}-{r}.json"))
            got[side].append(METRICS[args.bench](doc))
    names = list(got["this"][0])
    table = {}
    print(f"\n{args.bench}: this tree ({HERE}) / base ({trees['base'][0]}), {rounds} round(s), alternating")
    print(f"{'metric':<34} {'base':>24} {'this':>24} {'ratio (median)':>15}")
    for n in names:
        b = [g.get(n) for g in got["base"]]
        t = [g.get(n) for g in got["this"]]
        ratios = [x / y for x, y in zip(t, b) if x is not None and y]
        med = round(statistics.median(ratios), 3) if ratios else None
        table[n] = {"base": b, "this": t, "ratios": [round(x, 3) for x in ratios], "median_ratio": med}
        print(f"{n:<34} {', '.join(f'{x:g}' for x in b if x is not None):>24} "
              f"{', '.join(f'{x:g}' for x in t if x is not None):>24} {med if med is not None else '-':>15}")
    write(f"ab-{args.bench}", {"smoke": args.smoke, "base": trees["base"][0], "this": HERE, "rounds": rounds,
                               "bench_args": extra}, {"metrics": table}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
