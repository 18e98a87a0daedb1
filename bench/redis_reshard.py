"""Redis Cluster resharding under client load: the baseline for elastic-KVS moving a key range.

The same data elastic-KVS moves (``keys`` keys of ``value_size`` bytes, ``round(share*keys)``
of them changing owner) moved by Redis Cluster (Debian's redis-server 7.0) from one master
to another while clients run, measured in the same run.

Setup (``measure``): two cluster nodes A and B on 127.0.0.1 (masters, no replicas) in a temp
dir, with the durability elastic-KVS gives (``appendonly yes``, ``appendfsync always``: every
write is fsync'd before it is acknowledged, MIGRATE's included); A gets all 16384 slots (CLUSTER ADDSLOTSRANGE), B none;
CLUSTER MEET; wait for cluster_state:ok on both.  Keys have ordinary names (``key:N``, no
hash tags), so CRC16 spreads them over the slots as an application's keys would be; the
names are picked so that exactly ``round(share*keys)`` hash below slot ``share*16384``
(these move) and the rest above (these stay).  All keys are loaded into A.

The move is driven from Python, command for command what ``redis-cli --cluster reshard``
does per slot (clusterManagerMoveSlot), for every slot holding a moving key: B ``CLUSTER
SETSLOT s IMPORTING A``, A ``CLUSTER SETSLOT s MIGRATING B``, ``CLUSTER GETKEYSINSLOT s 100``
+ ``MIGRATE ... KEYS`` (100 keys, redis-cli's default pipeline) until the slot is empty,
then ``CLUSTER SETSLOT s NODE B`` on B, then on A.  ``move_s`` runs from the first SETSLOT
to the last SETSLOT NODE.  Empty slots are not moved (Redis's best case; redis-cli would).

Meanwhile ``clients`` threads, each with its own connection per node, run a closed loop of
GET/SET (``write_ratio`` SETs) on random loaded keys, routing like a cluster client but
counting what such a client hides: each keeps a slot map, sends to the owner, and on
``MOVED`` (updates that one slot), ``ASK`` (ASKING + retry at the target) or ``TRYAGAIN``
(retry after 1 ms) counts a redirect and follows it; anything else (exceptions, timeouts,
wrong values) is an error.  Latency is per logical operation, redirects included.  Clients
run ``warmup_s`` before the move and ``tail_s`` after it; the move driver shares their
Python process (GIL).

Run: ``/opt/vfab-venv/bin/python bench/redis_reshard.py [--smoke]``.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402
from redis.exceptions import AskError, MovedError, TryAgainError  # noqa: E402

from bench.common import parser, summary, write  # noqa: E402

SLOTS = 16384
BATCH = 100              # keys per GETKEYSINSLOT/MIGRATE, redis-cli's default --cluster-pipeline
MIGRATE_TIMEOUT_MS = 60000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(tmp: str) -> tuple[subprocess.Popen, int, int]:
    port, bus = free_port(), free_port()
    log = open(os.path.join(tmp, f"redis-{port}.log"), "w")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--cluster-port", str(bus), "--cluster-enabled", "yes",
         "--cluster-config-file", os.path.join(tmp, f"nodes-{port}.conf"), "--appendonly", "yes",
         "--appendfsync", "always", "--appenddirname", f"aof-{port}", "--save", "",
         "--bind", "127.0.0.1", "--daemonize", "no", "--dir", tmp, "--protected-mode", "no"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    log.close()
    return proc, port, bus


def wait_for(what: str, cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except (redis.ConnectionError, redis.ResponseError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"redis_reshard: {what} not reached within {timeout} s")


def pick_keys(keys: int, share: float) -> tuple[list[bytes], list[bytes]]:
    """``round(share*keys)`` names hashing into slots < share*16384 (moving), the rest above (staying)."""
    n_move = round(share * keys)
    bound = round(share * SLOTS)
    if n_move and not bound or keys - n_move and bound >= SLOTS:
        raise ValueError(f"share {share} leaves no slots for the moving or the staying keys")
    moving: list[bytes] = []
    staying: list[bytes] = []
    i = 0
    while len(moving) < n_move or len(staying) < keys - n_move:
        k, i = b"key:%d" % i, i + 1
        side, want = (moving, n_move) if key_slot(k) < bound else (staying, keys - n_move)
        if len(side) < want:
            side.append(k)
    return moving, staying


class Client(threading.Thread):
    """Closed-loop GET/SET with its own slot map and per-node connections; counts what a real client hides."""

    def __init__(self, slot_map: list[str], keys: list[bytes], values: dict[bytes, bytes], write_ratio: float,
                 seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.map = list(slot_map)                   # slot -> "host:port"
        self.conns: dict[str, redis.Connection] = {}
        self.keys, self.values, self.write_ratio = keys, values, write_ratio
        self.rng = random.Random(seed)
        self.stop = stop
        self.ops: list[tuple[float, float]] = []    # (start, latency s)
        self.redirects: list[tuple[float, str]] = []
        self.errors: list[str] = []

    def conn(self, node: str) -> redis.Connection:
        if node not in self.conns:
            host, port = node.rsplit(":", 1)
            self.conns[node] = redis.Connection(host=host, port=int(port), socket_timeout=5.0)
        return self.conns[node]

    def call(self, node: str, asking: bool, *cmd):
        c = self.conn(node)
        try:
            if asking:
                c.send_command("ASKING")
                c.read_response()
            c.send_command(*cmd)
            return c.read_response()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            c.disconnect()
            raise

    def op(self, key: bytes, cmd: tuple) -> object:
        slot = key_slot(key)
        node, asking = self.map[slot], False
        for _ in range(20):
            try:
                return self.call(node, asking, *cmd)
            except (MovedError, AskError) as e:   # redis-py parses "-MOVED slot host:port" / "-ASK ..." into these
                self.redirects.append((time.monotonic(), "moved" if isinstance(e, MovedError) else "ask"))
                node, asking = f"{e.host}:{e.port}", not isinstance(e, MovedError)
                if not asking:
                    self.map[e.slot_id] = node
            except TryAgainError:
                self.redirects.append((time.monotonic(), "tryagain"))
                time.sleep(0.001)
        raise RuntimeError(f"more than 20 redirects for {key!r}")

    def run(self) -> None:
        while not self.stop.is_set():
            key = self.rng.choice(self.keys)
            write_op = self.rng.random() < self.write_ratio
            t = time.monotonic()
            try:
                if write_op:
                    ok = self.op(key, ("SET", key, self.values[key])) == b"OK"
                else:
                    ok = self.op(key, ("GET", key)) == self.values[key]
                if not ok:
                    self.errors.append(f"wrong reply for {key!r}")
            except Exception as e:  # noqa: BLE001 - every failure a client would see is counted
                self.errors.append(f"{type(e).__name__}: {e}")
            self.ops.append((t, time.monotonic() - t))
        for c in self.conns.values():
            c.disconnect()


def move_slots(a: redis.Redis, b: redis.Redis, a_id: str, b_id: str, b_port: int, slots: list[int]) -> int:
    """redis-cli's clusterManagerMoveSlot for each slot, A -> B; returns the keys migrated."""
    moved = 0
    for s in slots:
        b.execute_command("CLUSTER", "SETSLOT", s, "IMPORTING", a_id)
        a.execute_command("CLUSTER", "SETSLOT", s, "MIGRATING", b_id)
        while True:
            batch = a.execute_command("CLUSTER", "GETKEYSINSLOT", s, BATCH)
            if not batch:
                break
            a.execute_command("MIGRATE", "127.0.0.1", b_port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *batch)
            moved += len(batch)
        b.execute_command("CLUSTER", "SETSLOT", s, "NODE", b_id)   # target first, as the SETSLOT docs say
        a.execute_command("CLUSTER", "SETSLOT", s, "NODE", b_id)
    return moved


def measure(keys: int, value_size: int = 1024, share: float = 1.0, workdir: str | None = None, clients: int = 4,
            *, write_ratio: float = 0.5, warmup_s: float = 0.3, tail_s: float = 0.3, seed: int = 1) -> dict:
    """Move ``round(share*keys)`` of ``keys`` keys from Redis node A to B under ``clients`` clients; see the module doc."""
    if not shutil.which("redis-server"):
        raise RuntimeError("redis_reshard: redis-server not found; apt-get install -y redis-server")
    tmp = tempfile.mkdtemp(prefix="redis-reshard-", dir=workdir)
    nodes: list[tuple[subprocess.Popen, int, int]] = []     # (process, port, cluster bus port)
    stop = threading.Event()
    threads: list[Client] = []
    try:
        for _ in range(2):
            nodes.append(start_node(tmp))
        (_, pa, _), (_, pb, bus_b) = nodes
        a, b = (redis.Redis(host="127.0.0.1", port=p, socket_timeout=30) for p in (pa, pb))
        wait_for("redis-server up", lambda: a.ping() and b.ping())
        a_id, b_id = (r.execute_command("CLUSTER", "MYID").decode() for r in (a, b))
        a.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1)
        a.execute_command("CLUSTER", "MEET", "127.0.0.1", pb, bus_b)
        wait_for("cluster_state:ok", lambda: all(
            r.cluster("info")["cluster_state"] == "ok" and int(r.cluster("info")["cluster_known_nodes"]) == 2
            for r in (a, b)))

        moving, staying = pick_keys(keys, share)
        rng = random.Random(seed)
        values = {k: rng.randbytes(value_size) for k in moving + staying}
        pipe = a.pipeline(transaction=False)
        for i, (k, v) in enumerate(values.items()):
            pipe.set(k, v)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        assert a.dbsize() == keys and b.dbsize() == 0, (a.dbsize(), b.dbsize())
        slots = sorted({key_slot(k) for k in moving})

        assert a.execute_command("CLUSTER", "SLOTS")[0][:2] == [0, SLOTS - 1]
        slot_map = [f"127.0.0.1:{pa}"] * SLOTS       # what CLUSTER SLOTS says now: every slot on A
        threads = [Client(slot_map, list(values), values, write_ratio, seed + i, stop) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(warmup_s)
        t0 = time.monotonic()
        n = move_slots(a, b, a_id, b_id, pb, slots)
        t1 = time.monotonic()
        time.sleep(tail_s)
        stop.set()
        for t in threads:
            t.join(10)
        if n != len(moving) or b.dbsize() != len(moving) or a.dbsize() != len(staying):
            raise RuntimeError(f"redis_reshard: moved {n} keys, B holds {b.dbsize()}, A {a.dbsize()}; "
                               f"expected {len(moving)} / {len(staying)}")

        during = [lat for t in threads for (s, lat) in t.ops if t0 <= s <= t1]
        before = [lat for t in threads for (s, lat) in t.ops if s < t0]
        red = [kind for t in threads for (_, kind) in t.redirects]
        red_move = [kind for t in threads for (s, kind) in t.redirects if s <= t1]
        errors = [e for t in threads for e in t.errors]
        sd, sb = summary(during), summary(before)
        return {"keys": keys, "value_size": value_size, "share": share, "clients": clients,
                "durability": "appendonly yes, appendfsync always", "keys_moved": n, "slots_moved": len(slots), "move_s": round(t1 - t0, 4),
                "redirects": {k: red.count(k) for k in ("moved", "ask", "tryagain")},
                "redirects_during_move": {k: red_move.count(k) for k in ("moved", "ask", "tryagain")},
                "errors": len(errors), "error_samples": sorted(set(errors))[:5],
                "client_ops": len(during), "client_ops_total": sum(len(t.ops) for t in threads),
                "client_median_ms": sd.get("median_ms", 0.0), "client_p99_ms": sd.get("p99_ms", 0.0),
                "client_max_ms": sd.get("max_ms", 0.0),
                "before_median_ms": sb.get("median_ms", 0.0), "before_p99_ms": sb.get("p99_ms", 0.0),
                "write_ratio": write_ratio, "warmup_s": warmup_s, "tail_s": tail_s}
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for p, _, _ in nodes:
            p.terminate()
        for p, _, _ in nodes:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--keys", default=None, help="key counts, comma separated (default 1000,10000; smoke 200)")
    ap.add_argument("--value-size", type=int, default=1024)
    ap.add_argument("--share", type=float, default=1.0, help="share of the keys that moves")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None, help="repetitions under load (default 3; smoke 1)")
    ap.add_argument("--idle-reps", type=int, default=None, help="extra runs without clients (default 1; smoke 0)")
    args = ap.parse_args()
    sizes = [int(x) for x in (args.keys or ("200" if args.smoke else "1000,10000")).split(",")]
    reps = args.reps if args.reps is not None else (1 if args.smoke else 3)
    idle = args.idle_reps if args.idle_reps is not None else (0 if args.smoke else 1)
    rows = []
    for n in sizes:
        for rep, clients in enumerate([args.clients] * reps + [0] * idle):
            r = measure(n, args.value_size, args.share, clients=clients, seed=1 + rep)
            rows.append(dict(r, rep=rep))
            print(f"  keys={n} clients={clients} rep {rep}: moved {r['keys_moved']} in {r['move_s']:.3f} s, "
                  f"redirects {r['redirects']}, errors {r['errors']}", flush=True)

    print(f"\nRedis Cluster resharding A -> B, values {args.value_size} B, share {args.share}; times in ms")
    print(f"{'keys':>6} {'moved':>6} {'slots':>6} {'clients':>7} {'move':>8} {'MOVED':>6} {'ASK':>6} {'TRYAG':>6} "
          f"{'errors':>6} {'ops':>7} {'median':>7} {'p99':>7} {'max':>7} {'idle p99':>8}")
    for r in rows:
        d = r["redirects"]
        print(f"{r['keys']:>6} {r['keys_moved']:>6} {r['slots_moved']:>6} {r['clients']:>7} {r['move_s'] * 1e3:>8.1f} "
              f"{d['moved']:>6} {d['ask']:>6} {d['tryagain']:>6} {r['errors']:>6} {r['client_ops']:>7} "
              f"{r['client_median_ms']:>7.3f} {r['client_p99_ms']:>7.3f} {r['client_max_ms']:>7.1f} "
              f"{r['before_p99_ms']:>8.3f}")
    print("move = first SETSLOT to last SETSLOT NODE; MOVED/ASK/TRYAGAIN = redirects the clients saw (warm-up, move "
          "and tail); ops/median/p99/max = client operations started during the move; idle p99 = before the move")
    params = {"smoke": args.smoke, "keys": sizes, "value_size": args.value_size, "share": args.share,
              "clients": args.clients, "reps": reps, "idle_reps": idle, "batch": BATCH,
              "driver": "python, redis-cli's per-slot steps",
              "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()}
    write("redis_reshard", params, {"rows": rows}, args.out)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
