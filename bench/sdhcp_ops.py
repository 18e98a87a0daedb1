"""Time of split, merge, mirror and move of an sdhcp shard holding N leases (paper Table IV analog, issue 9).

One fabric (``line,2,3``).  Per N and placement a fresh sdhcp service (dhcp4
front door, pool 10.64.0.10-10.79.255.250, a /12) whose shard ``a`` on vfh1 owns
every key and holds N bound leases; peer ``b`` on vfh2 ("local": same switch) or
vfh4 ("remote": across the trunk).  The operations, in order, each on N leases:

- split  the upper half of the key space (about N/2 leases) a -> b
- merge  it back b -> a
- mirror a -> b (b copies every lease; a keeps serving)
- move   a -> b (b, now a mirror, becomes the owner)

**How the leases are made.**  Not over the wire (that is ``bench/sdhcp_lease.py``'s
job): before ``a`` starts, its store is filled through the backend itself, the
code a shard runs for each request: N REQUESTs in the SELECTING state (server id
ours, requested address = a distinct pool address), 2,000 per
``handle_batch`` (one SQLite transaction, fsync'd), each ACKed and written as a
``lease`` row under the client's key and an ``addr`` row under the address's home
key, so the store holds 2N rows as a served shard would.  The range is assigned
to ``a`` in etcd before it starts (a shard keeps only the rows of ranges it holds).

Per operation: the wall time from the statectl call until ``statectl.wait``
returns, the operation record's own timings (copy, flip, etcd) and the records
moved.  Then each lease is checked to still be where its key's owner is (``vfab
sdhcp status`` counts: bound leases per shard add up to N).

Paper Table IV (elastic-KVS servers, s; the paper gives no sdhcp numbers):
mirror 1.078 local / 3.336 remote, split 1.289 / 3.782, merge 1.304 / 2.544,
move - / 3.871.  The paper's times include spawning (mirror, split) or
stopping (merge, move) a server process; ours start from running shards.

Run: ``/opt/vfab-venv/bin/python bench/sdhcp_ops.py [--smoke] [--leases 1000,10000,100000]`` (root).
"""

from __future__ import annotations

import os
import random
import sys
import time
from ipaddress import IPv4Address

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, write  # noqa: E402
from vfab.services.sdhcp import frames  # noqa: E402
from vfab.services.sdhcp.backend import open_backend  # noqa: E402
from vfab.services.sdhcp.config import parse_opts  # noqa: E402
from vfab.services.sdhcp.wire import Message, MessageType, Opt  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.testbed.procs import wait_for  # noqa: E402
from vfab.vid.codec import KEY_MAX  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.state import ctl as statectl  # noqa: E402
from vfab.vid.state.backend import Request  # noqa: E402

SERVER = IPv4Address("10.64.0.1")
OPTS = {"pool": "10.64.0.10-10.79.255.250", "mask": "12", "server": str(SERVER), "lease": "86400"}
FULL, UPPER = Range(0, KEY_MAX), Range(0x800000, KEY_MAX)
PEERS = {"local": "vfh2", "remote": "vfh4"}
OPS = ["split", "merge", "mirror", "move"]
PAPER = {"mirror": (1.078, 3.336), "split": (1.289, 3.782), "merge": (1.304, 2.544), "move": (None, 3.871)}
CHUNK = 2000


def fill(datadir: str, name: str, n: int, seed: int) -> float:
    """N bound leases in shard ``name``'s store, made by its backend (see the module doc); seconds taken."""
    config = parse_opts(OPTS)
    backend = open_backend(datadir, name, config)
    try:
        rnd = random.Random(seed)
        keys = rnd.sample(range(KEY_MAX + 1), n)
        first = backend.pool.first
        t0 = time.monotonic()
        for lo in range(0, n, CHUNK):
            reqs = []
            for j in range(lo, min(n, lo + CHUNK)):
                mac = bytes([0x02, 0x64, 0x00]) + keys[j].to_bytes(3, "big")
                ip = IPv4Address(first + j)
                msg = Message(op=1, xid=j, chaddr=mac, options={
                    Opt.MSG_TYPE: bytes([MessageType.REQUEST]), Opt.SERVER_ID: SERVER.packed,
                    Opt.REQUESTED_IP: ip.packed}).serialize()
                reqs.append(Request(frames.request(mac, msg), keys[j], mac))
            replies, _ = backend.handle_batch(reqs)
            if any(r is None for r in replies):
                raise RuntimeError(f"prefill: {sum(r is None for r in replies)} of {len(reqs)} REQUESTs not ACKed "
                                   f"({dict(backend.counters)})")
        took = time.monotonic() - t0
        if backend.store.count(FULL) != n:
            raise RuntimeError(f"prefill: {backend.store.count(FULL)} lease rows, expected {n}")
        return took
    finally:
        backend.store.close()


def start_shard(tb: Testbed, svc: str, name: str, host: str, datadir: str):
    out = os.path.join(tb.workdir, f"{svc}-{name}.out")
    opts = [a for k, v in OPTS.items() for a in ("--opt", f"{k}={v}")]
    args = ["-m", "vfab.services.sdhcp", "server", "--etcd", tb.etcd_endpoint, "--service", svc, "--name", name,
            "--iface", tb.hosts[host]["iface"], "--data", datadir, *opts]
    proc = tb.run_on(host, f"{svc}-{name}", args, stdout=open(out, "wb"))
    wait_for(lambda: b"ready" in open(out, "rb").read() or not proc.alive(), 120, f"shard {name} of {svc}")
    if not proc.alive():
        raise RuntimeError(f"shard {name} of {svc} died at start:\n{proc.tail()}")
    return proc


def run_op(tb: Testbed, svc: str, name: str) -> dict:
    reg = tb.registry
    start = {"split": lambda: statectl.split(reg, svc, UPPER, "b"),
             "merge": lambda: statectl.merge(reg, svc, UPPER, "a"),
             "mirror": lambda: statectl.mirror(reg, svc, "a", "b"),
             "move": lambda: statectl.move(reg, svc, "a", "b")}[name]
    t0 = time.monotonic()
    rec = statectl.wait(reg, svc, start().op, timeout=600)
    wall = time.monotonic() - t0
    return {"op": name, "phase": rec.phase, "error": rec.error, "records": rec.done, "total": rec.total,
            "timings": {k: round(v, 4) for k, v in rec.timings.items()}, "wall_s": round(wall, 4)}


def bound(tb: Testbed, svc: str, shard: str) -> int:
    return statectl.command(tb.registry, svc, shard, "STATS", {}).body["sdhcp"]["bound"]


def configuration(tb: Testbed, n: int, placement: str) -> dict:
    reg = tb.registry
    svc = f"dhops-{placement}-{n}"
    datadir = os.path.join(tb.workdir, f"data-{svc}")
    os.makedirs(datadir, exist_ok=True)
    fill_s = fill(datadir, "a", n, seed=n)
    reg.create_service(svc, kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    reg.assign(svc, FULL, "a")
    procs = []
    try:
        procs.append(start_shard(tb, svc, "a", "vfh1", datadir))
        procs.append(start_shard(tb, svc, "b", PEERS[placement], datadir))
        tb.wait_revision(reg.state_revision(), timeout=60)
        if bound(tb, svc, "a") != n:
            raise RuntimeError(f"{svc}: shard a serves {bound(tb, svc, 'a')} leases, expected {n}")
        ops, checks = [], {}
        for name in OPS:
            ops.append(run_op(tb, svc, name))
            checks[name] = {s: bound(tb, svc, s) for s in ("a", "b")}
        # after the split a and b share the leases, after the merge a has them all, after the move b
        ok = (sum(checks["split"].values()) == n and checks["merge"] == {"a": n, "b": 0}
              and checks["move"]["b"] == n and all(o["phase"] == "done" for o in ops))
    finally:
        for p in procs:
            tb.sup.stop(p)
        reg.delete_service(svc)
        tb.wait_revision(reg.state_revision(), timeout=60)
    for p in procs:
        if "Traceback" in open(p.logpath).read():
            print(f"WARNING: {p.name} raised:\n{p.tail(20)}", flush=True)
    return {"leases": n, "placement": placement, "peer_host": PEERS[placement], "fill_s": round(fill_s, 3),
            "fill_leases_per_s": round(n / fill_s, 1), "ops": ops, "bound_after": checks, "consistent": ok}


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--leases", default=None, help="lease counts, comma separated (default 1000,10000,100000; "
                                                   "smoke 200)")
    ap.add_argument("--placement", choices=["both", *PEERS], default="both", help="peer placement(s) to run")
    args = ap.parse_args()
    sizes = [int(x) for x in (args.leases or ("200" if args.smoke else "1000,10000,100000")).split(",")]
    placements = ["remote"] if args.smoke else [p for p in PEERS if args.placement in ("both", p)]
    configs = []
    with Testbed("line,2,3", poll=1.0) as tb:
        for n in sizes:
            for placement in placements:
                c = configuration(tb, n, placement)
                configs.append(c)
                print(f"  N={n} {placement}: prefill {c['fill_s']} s; " + ", ".join(
                    f"{o['op']} {o['wall_s']:.3f} s ({o['records']} records, {o['phase']})" for o in c["ops"])
                    + f"; bound after each: {c['bound_after']}", flush=True)
    print("\nsdhcp shard operations (a on vfh1, b local = vfh2 / remote = vfh4); times in s")
    print(f"{'leases':>7} {'place':>6} {'op':>6} {'records':>8} {'wall':>7} {'copy':>7} {'flip':>7} {'etcd':>7} "
          f"{'paper':>6}")
    for c in configs:
        for o in c["ops"]:
            t = o["timings"]
            paper = PAPER[o["op"]][0 if c["placement"] == "local" else 1]
            o["paper_s"] = paper
            print(f"{c['leases']:>7} {c['placement']:>6} {o['op']:>6} {o['records']:>8} {o['wall_s']:>7.3f} "
                  f"{t.get('copy_s', float('nan')):>7.3f} {t.get('flip_s', float('nan')):>7.3f} "
                  f"{t.get('etcd_s', float('nan')):>7.3f} {paper if paper else '-':>6}")
    print("paper Table IV (elastic-KVS, s, local/remote): mirror 1.078/3.336, split 1.289/3.782, "
          "merge 1.304/2.544, move -/3.871")
    write("sdhcp_ops", {"smoke": args.smoke, "leases": sizes, "placements": placements, "pool": OPTS["pool"],
                        "lease_fill": "backend.handle_batch, SELECTING REQUESTs, 2000 per fsync'd batch",
                        "topo": "line,2,3"}, {"configs": configs}, args.out)
    bad = [f"N={c['leases']} {c['placement']}" for c in configs if not c["consistent"]]
    if bad:
        print(f"leases not where their keys' owners are, or an operation failed: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
