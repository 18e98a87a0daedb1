"""elastic-KVS's store: a copy's records applied and its snapshot packed, native part vs Python, side by side.

One store is filled with N keys of 1 KB; its snapshot (128 KB chunks, as a copy sends them) is packed by each
path and applied by each path into a fresh store (what a split's peer does), then, after the rows are
dropped, into the reused space (a merge back).  The paths alternate within each round; CPU seconds are the
process's own (``time.process_time``), wall seconds around the same work; commit seconds are what the
store counts for its commits and checkpoints (``disk_seconds``).  No network, no OVS: the store alone.

Run: ``/opt/vfab-venv/bin/python bench/kvs_apply.py [--keys 100000] [--rounds 3] [--smoke]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, write  # noqa: E402
from vfab.services.elastic_kvs import session  # noqa: E402
from vfab.services.elastic_kvs import store as store_mod  # noqa: E402
from vfab.services.elastic_kvs.store import Store  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402

FULL = Range(0, 0xFFFFFF)
CHUNK = 128 * 1024   # vid-lib/state/runner.py CHUNK_BYTES
PATHS = ("native", "python")


def use(path: str) -> None:
    """Make the store take ``path`` (the library stays loaded; the Python path is chosen per call)."""
    store_mod.native_lib = _real if path == "native" else (lambda: None)


_real = store_mod.native_lib


def timed(fn) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=None, help="keys of 1 KB (default 100000; smoke 2000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, each path once per round (default 3; smoke 1)")
    args = ap.parse_args()
    n = args.keys or (2000 if args.smoke else 100000)
    rounds = args.rounds or (1 if args.smoke else 3)
    if _real() is None:
        print(f"kvs_apply: the native part is not built ({store_mod.NATIVE_PATH}); run 'make bootstrap'",
              file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="vfab-bench-apply-")
    try:
        src = Store(os.path.join(work, "src.db"))
        value = os.urandom(1000)
        for i in range(0, n, 2000):
            src.begin(durable=False)
            for j in range(i, min(n, i + 2000)):
                # each row with its writer's completion record, as a client's PUT leaves it (session.py)
                done = session.serialize({1: session.Entry(0, 0, {j + 1: 1})})
                src.write(b"key:%08d" % j, value, 1, done, row=None)
            src.commit()
        src.sync()
        samples = {p: {k: [] for k in ("pack_cpu_s", "fresh_wall_s", "fresh_cpu_s", "fresh_commit_s",
                                          "reused_wall_s", "reused_cpu_s")} for p in PATHS}
        for r in range(rounds):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                use(path)
                blobs: list[bytes] = []
                _w, cpu = timed(lambda: blobs.extend(b for b, _n in src.snapshot(FULL, CHUNK)))
                samples[path]["pack_cpu_s"].append(cpu)
                dst = Store(os.path.join(work, f"dst-{path}-{r}.db"))
                gen = dst.begin_copy()
                d0 = dst.disk_seconds()

                def copy(g: int) -> None:
                    for b in blobs:
                        dst.apply([b], durable=False, gen=g)
                    dst.sync()

                wall, cpu = timed(lambda: copy(gen))
                samples[path]["fresh_wall_s"].append(wall)
                samples[path]["fresh_cpu_s"].append(cpu)
                samples[path]["fresh_commit_s"].append(dst.disk_seconds() - d0)
                if dst.count(FULL) != n:
                    raise RuntimeError(f"{path}: the copy holds {dst.count(FULL)} of {n} keys")
                dst.drop(FULL)
                wall, cpu = timed(lambda: copy(dst.begin_copy()))
                samples[path]["reused_wall_s"].append(wall)
                samples[path]["reused_cpu_s"].append(cpu)
                dst.close()
                print(f"  round {r + 1} {path:6s}: pack {samples[path]['pack_cpu_s'][-1]:.3f} CPU-s, "
                      f"apply fresh {samples[path]['fresh_wall_s'][-1]:.3f} s "
                      f"({samples[path]['fresh_cpu_s'][-1]:.3f} CPU-s, commits "
                      f"{samples[path]['fresh_commit_s'][-1]:.3f} s), reused {samples[path]['reused_wall_s'][-1]:.3f} s "
                      f"({samples[path]['reused_cpu_s'][-1]:.3f} CPU-s)", flush=True)
        src.close()
    finally:
        use("native")
        shutil.rmtree(work, ignore_errors=True)
    med = {p: {k: round(statistics.median(v), 4) for k, v in s.items()} for p, s in samples.items()}
    ratio = {k: round(med["native"][k] / med["python"][k], 3) for k in med["native"] if med["python"][k]}
    print(f"\nelastic-KVS store, {n} keys of 1 KB, {rounds} round(s), medians (s):")
    print(f"  {'':22s} {'native':>8s} {'python':>8s} {'ratio':>6s}")
    for k in med["native"]:
        print(f"  {k:22s} {med['native'][k]:8.3f} {med['python'][k]:8.3f} {ratio.get(k, 0):6.2f}")
    write("kvs_apply", {"keys": n, "rounds": rounds, "chunk_bytes": CHUNK, "smoke": args.smoke},
                 {"median": med, "native_over_python": ratio, "samples": samples}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
