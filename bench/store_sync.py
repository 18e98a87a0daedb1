"""Durable commits of a fresh store: its write-ahead log grown ahead (``SqliteStore.grow_wal``) or growing.

Every store of a stateful service (elastic-KVS, sdhcp) syncs its SQLite WAL before it answers a write.  A
new or restarted store starts with an empty WAL (SQLite deletes it when the last connection closes), so
until its first checkpoint each sync also allocates blocks and commits the file system's journal.  The
stores now write the WAL's full size (zeros) when they open; this measures what that saves on the
commits that follow, the way a shard's first clients meet them (sdhcp's 245-udhcpc phase: ~60 ACKs per
shard, all before the first checkpoint).

Each sample is a fresh elastic-KVS store (``services/elastic-kvs/store.py``, the real class) in a
directory on the data file system (``--dir``, default /var/tmp), then ``--commits`` durable commits of one
key each (one put, ``synchronous=FULL``: SQLite fsyncs the WAL in the commit).  Ways, in rounds (order
reversed every other round, so drift hits both alike):

- ``grown``    the store as it is (WAL grown to its full size when opened);
- ``growing``  the same with ``grow_wal`` skipped (what every store did before).

Per way: the commit's wall time (median, p99) and the machine's busy CPU per commit (``/proc/stat``, both
cores: the journal thread and the block layer count, not only this process), and the ratio grown/growing.
The store's opening (growing the WAL: writing ~1.3 MB and one sync) is outside the timed commits and
reported apart.

Run: ``/opt/vfab-venv/bin/python bench/store_sync.py [--commits 80] [--stores 10] [--rounds 3] [--smoke]``.
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

from bench.common import cpu_busy_s, parser, summary, write  # noqa: E402
from vfab.services.elastic_kvs import session  # noqa: E402
from vfab.services.elastic_kvs.store import Store  # noqa: E402

WAYS = ("grown", "growing")
TICK = 1.0 / os.sysconf("SC_CLK_TCK")   # s: /proc/stat's resolution
MIN_TICKS = 5                           # of them per way and round before a CPU ratio means anything


def one_store(directory: str, way: str, commits: int) -> tuple[list[float], float, float]:
    """(commit wall times, machine busy CPU-s over the commits, s to open the store)."""
    path = os.path.join(directory, f"s-{way}.sqlite")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    t0 = time.perf_counter()
    if way == "growing":
        saved = Store.grow_wal
        Store.grow_wal = lambda self: None
        try:
            s = Store(path)
        finally:
            Store.grow_wal = saved
    else:
        s = Store(path)
    opened = time.perf_counter() - t0
    lat = []
    try:
        busy0 = cpu_busy_s()
        for i in range(commits):
            t = time.perf_counter()
            s.begin()
            # a new key each commit, with its completion record as the backend writes it (client 7, seq i + 1)
            done = session.add(b"", 7, i + 1, i + 1, int(time.time()) + 60, session.result_of(1, False), time.time())
            s.write(f"key-{i}".encode(), b"v" * 100, 1, done)
            s.commit()
            lat.append(time.perf_counter() - t)
        busy = cpu_busy_s() - busy0
    finally:
        s.close()
    return lat, busy, opened


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=80, help="durable commits per fresh store (default 80)")
    ap.add_argument("--stores", type=int, default=10, help="fresh stores per way and round (default 10)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="file system to measure on (default /var/tmp)")
    args = ap.parse_args()
    if args.smoke:
        args.commits, args.stores, args.rounds = 20, 2, 1
    work = tempfile.mkdtemp(prefix="vfab-bench-sync-", dir=args.dir)
    res = {w: {"lat": [], "busy": 0.0, "commits": 0, "open": []} for w in WAYS}
    rounds = []
    try:
        for r in range(args.rounds):
            per = {}
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                lat_r, busy_r = [], 0.0
                for _ in range(args.stores):
                    lat, busy, opened = one_store(work, way, args.commits)
                    lat_r += lat
                    busy_r += busy
                    res[way]["open"].append(opened)
                res[way]["lat"] += lat_r
                res[way]["busy"] += busy_r
                res[way]["commits"] += len(lat_r)
                per[way] = {"median_ms": round(statistics.median(lat_r) * 1e3, 3),
                            "busy_ms_per_commit": round(busy_r / len(lat_r) * 1e3, 3), "busy_s": busy_r}
                print(f"round {r + 1} {way:8s} commit median {per[way]['median_ms']} ms, machine CPU "
                      f"{per[way]['busy_ms_per_commit']} ms per commit", flush=True)
            rounds.append(per)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {}
    for way in WAYS:
        d = res[way]
        out[way] = {"commit": summary(d["lat"]), "busy_ms_per_commit": round(d["busy"] / d["commits"] * 1e3, 3),
                    "open": summary(d["open"])}
    # a round's CPU ratio only where both ways' busy CPU is well above /proc/stat's resolution (a smoke run's
    # 40 commits are not: it printed 0.0x)
    cpu = [p["grown"]["busy_ms_per_commit"] / p["growing"]["busy_ms_per_commit"] for p in rounds
           if min(p["grown"]["busy_s"], p["growing"]["busy_s"]) >= MIN_TICKS * TICK]
    out["ratio_grown_to_growing"] = {
        "commit_median": round(statistics.median(p["grown"]["median_ms"] / p["growing"]["median_ms"]
                                                 for p in rounds), 2),
        "busy_per_commit": round(statistics.median(cpu), 2) if cpu else None}
    cpu_text = (f"{out['ratio_grown_to_growing']['busy_per_commit']}x" if cpu else
                f"- (under {MIN_TICKS} of /proc/stat's {TICK * 1e3:.0f} ms ticks per way and round: too few commits)")
    print(f"grown/growing (median of the rounds' ratios): commit time {out['ratio_grown_to_growing']['commit_median']}x,"
          f" machine CPU per commit {cpu_text}; opening a store "
          f"{out['grown']['open']['median_ms']} ms grown, {out['growing']['open']['median_ms']} ms growing")
    write("store_sync", {"commits": args.commits, "stores": args.stores, "rounds": args.rounds, "dir": args.dir,
                         "smoke": args.smoke}, out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
