"""elastic-KVS: a mirrored owner paused with writes in flight, repeated (issue 42), and the history checker's verdict.

Each repetition (testbed/kvs_pause.py): SIGSTOP the owner with a client's PUT of a
hot key waiting in its socket, the mirror takes the range over and acknowledges
it, 24 more writes of the key are acknowledged, SIGCONT; the key is read for
0.3 s; the roles swap.  Reports violations (must be 0), the takeover time and
what the old owner did with the requests it held (forwarded / dropped).

Run: ``/opt/vfab-venv/bin/python bench/kvs_pause.py [--repetitions 20] [--smoke]`` (root).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import not_root, parser, summary, write  # noqa: E402
from vfab.testbed import kvs_pause  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--repetitions", type=int, default=None, help="pauses in one testbed run (default 20; smoke 2)")
    args = ap.parse_args()
    if not_root("kvs_pause", "network namespaces, Open vSwitch"):
        return 1
    reps = args.repetitions or (2 if args.smoke else 20)
    with Testbed("line,2,3") as tb:
        out = kvs_pause.run(tb, "kvs-pause", reps, say=lambda line: print(line, flush=True))
    rep = out["report"]
    takeover = summary([r["takeover_s"] for r in out["reps"]])
    held = {k: sum(r["held"][k] for r in out["reps"]) for k in ("fenced", "forwarded", "fenced_dropped")}
    print(f"\n{len(out['reps'])} repetitions, {rep['ops']} operations, {rep['acked_puts']} acknowledged puts: "
          f"{len(rep['violations'])} violation(s), {len(rep['failed'])} failed operation(s)")
    print(f"takeover after SIGSTOP: median {takeover['median_ms']:.0f} ms, max {takeover['max_ms']:.0f} ms; requests the "
          f"old owners held: {held['fenced']} fenced, {held['forwarded']} forwarded, {held['fenced_dropped']} dropped")
    for v in rep["violations"][:10]:
        print("  " + v)
    write("kvs_pause", {"smoke": args.smoke, "repetitions": reps, "writes": kvs_pause.WRITES, "ttl_s": kvs_pause.TTL,
                        "topo": "line,2,3"},
          {"violations": len(rep["violations"]), "violation_examples": rep["violations"][:10],
           "ops": rep["ops"], "acked_puts": rep["acked_puts"], "failed": len(rep["failed"]),
           "takeover_ms": takeover, "held": held, "reps": out["reps"], "raised": out["raised"]}, args.out)
    return 1 if rep["violations"] or out["raised"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
