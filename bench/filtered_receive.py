"""Filtered receives: OVS rewrite vs BPF vs promiscuous with many requesters (the paper's Fig. 10).

Fabric ``single,1+N``: the server sits on vfh1, requesters on vfh2..vfh(N+1),
all on one switch.  Service ``fr`` (prefix layout): keys 0..0x7fffff are owned
by endpoint ``srv`` on vfh1; what happens to keys 0x800000..0xffffff depends on
the scenario.  Besides its real requests every requester sends ``--strays``
frames per request to random VIDs of that upper half: frames the server does
not own.  Scenarios (same load for all three backends):

``shared``   the upper half is owned by a second endpoint, ``ghost``, announced
             on the *same* interface as ``srv`` (vfh1's MAC) with rx=bpf, so the
             switch delivers its frames to vfh1's port with the VID intact: two
             endpoints behind one port, each socket must keep only its own
             frames.  The switch does one output per stray, so this is the
             cleanest measure of the receive side (the paper's switch was
             hardware; here it shares the 2 cores).
``flood``    the upper half has no owner and the miss policy is ``flood``, the
             paper's learning baseline (DESIGN.md §3): strays go to every port,
             the server's included.  Honest, but each stray costs ovs-vswitchd
             one output per port, so here the software switch is the bottleneck.
``drop``     no owner, miss policy drop (vfab's default): the switch discards
             strays; the server's port carries only its own frames and backends
             differ by their bare cost.

Backends:

``ovs``      endpoint rx=ovs: the switch rewrites owned VIDs to the server's
             MAC; the socket's kernel filter keeps PACKET_HOST frames only, so
             strays (still VIDs) die in the kernel.
``bpf``      endpoint rx=bpf: VIDs arrive intact; a libpcap-compiled filter of
             the owned blocks drops strays in the kernel.
``promisc``  endpoint rx=promisc: every frame reaches userspace, RawPort drops
             strays there (``counters['filtered']``).

Load: one client process (so the server does not share a GIL with it) drives N
raw sockets, one per requester host, closed loop with one outstanding request
per requester (N concurrent pending requests; a request unanswered after
``--timeout`` is counted and replaced).  Request VIDs are pregenerated, as the
paper's workloads were.  The server is one thread of this process: recv,
reply to the sender's MAC, repeat.

Per backend and N it reports: requests served per second; server-thread CPU
per served request (``pthread_getcpuclockid``: user+system time of that thread
alone) and its busy fraction; frames the server looked at and discarded in
userspace (RawPort ``filtered``); client-observed RTT median/p99; and the CPU
ovs-vswitchd spent per served request (note: for veths the kernel's socket
filter runs in the *sender's* context, so a stray the server's BPF filter
drops is paid for by ovs-vswitchd's system time, not by the server).
Backends run interleaved (ovs, bpf, promisc, then reversed, ``--reps`` times)
and each cell's runs are pooled (per-run values are kept in the JSON to show
the spread); ratios are against ``ovs`` in the same scenario and N.

Run: ``/opt/vfab-venv/bin/python bench/filtered_receive.py [--smoke]`` (root).
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import struct
import subprocess
import sys
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid import api, codec  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.frame import ETH_LEN, Frame, FrameType  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.state.sched import proc_stat  # noqa: E402
from vfab.vid.transport import RawPort  # noqa: E402

log = logging.getLogger("bench.filtered_receive")
SERVICE, OWNER, GHOST, SERVER = "fr", "srv", "ghost", "vfh1"
SCENARIOS = {"shared": ("drop", GHOST), "flood": ("flood", ""), "drop": ("drop", "")}  # miss policy, STRAY owner
HALF = (codec.KEY_MAX + 1) // 2
OWNED, STRAY = Range(0, HALF - 1), Range(HALF, codec.KEY_MAX)
BACKENDS = ["ovs", "bpf", "promisc"]
PAYLOAD = bytes(32)
SEQ_OFF = ETH_LEN + 8  # version, type, flags, reserved, channel, length, then seq
POOL = 4096


# -- client driver (a separate process) ---------------------------------------------------
def driver(cfg: dict) -> None:
    """Closed-loop requesters on many ports; talks to the parent over stdin/stdout."""
    rnd = random.Random(cfg["seed"])
    sid, layout = cfg["sid"], cfg["layout"]

    def vids(rng: Range) -> list[bytes]:
        return [codec.encode(sid, rnd.randint(rng.lo, rng.hi), layout=layout).packed for _ in range(POOL)]

    owned, stray = vids(Range(*cfg["owned"])), vids(Range(*cfg["stray"]))
    ports = [RawPort(c["iface"], rx="ovs", netns=c["netns"]) for c in cfg["clients"]]
    n = len(ports)
    templates = [bytearray(Frame(dst=owned[0], src=p.mac, type=FrameType.REQUEST, payload=PAYLOAD).serialize())
                 for p in ports]
    seqs = [0] * n
    sent_at = [0.0] * n
    strays_per = cfg["strays"]
    whole, frac = int(strays_per), strays_per - int(strays_per)
    timeout = cfg["timeout"]
    counters = {"requests": 0, "replies": 0, "timeouts": 0, "strays": 0, "tx_dropped": 0, "unexpected": 0}
    rtts: list[int] = []  # microseconds, requests sent inside the window
    pick = 0

    def send(i: int, now: float) -> None:
        nonlocal pick
        pick += 1
        buf = templates[i]
        seqs[i] = (seqs[i] + 1) & 0xFFFFFFFF
        buf[0:6] = owned[pick % POOL]
        struct.pack_into("!I", buf, SEQ_OFF, seqs[i])
        sent_at[i] = now
        if not ports[i].send(buf):
            counters["tx_dropped"] += 1
        counters["requests"] += 1
        k = whole + (1 if frac and rnd.random() < frac else 0)
        for _ in range(k):
            buf[0:6] = stray[(pick * 7 + _) % POOL]
            ports[i].send(buf)  # same seq: a stray answered by mistake would not match anyway
            counters["strays"] += 1

    poller = select.poll()
    by_fd = {}
    for i, p in enumerate(ports):
        poller.register(p.fileno(), select.POLLIN)
        by_fd[p.fileno()] = i
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    t_start, t_end = float(line[1]), float(line[2])
    cpu0 = None
    now = time.monotonic()
    for i in range(n):
        send(i, now)
    next_check = now + timeout / 4
    while now < t_end:
        if cpu0 is None and now >= t_start:
            cpu0 = time.process_time()
            counters = {k: 0 for k in counters}
        for fd, _ in poller.poll(10):
            i = by_fd[fd]
            port = ports[i]
            while True:
                f = port.recv(0)
                if f is None:
                    break
                if f.type is FrameType.REPLY and f.seq == seqs[i]:
                    t = time.monotonic()
                    if sent_at[i] >= t_start:
                        rtts.append(int((t - sent_at[i]) * 1e6))
                    counters["replies"] += 1
                    send(i, t)
                else:
                    counters["unexpected"] += 1
        now = time.monotonic()
        if now >= next_check:
            next_check = now + timeout / 4
            for i in range(n):
                if now - sent_at[i] > timeout:
                    counters["timeouts"] += 1
                    send(i, now)
    cpu = time.process_time() - (cpu0 if cpu0 is not None else 0.0)
    for p in ports:
        p.close()
    print(json.dumps({"counters": counters, "rtt_us": rtts, "cpu_s": cpu}), flush=True)


# -- server side ------------------------------------------------------------------------
class EchoServer(threading.Thread):
    """One thread: recv a REQUEST, reply to its sender; counts served requests."""

    def __init__(self, port: RawPort):
        super().__init__(name=f"server-{port.rx}", daemon=True)
        self.port = port
        self.served = 0
        self.stopping = False
        self.ready = threading.Event()
        self.clock = None

    def run(self) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        self.ready.set()
        port, mac = self.port, self.port.mac
        reply = FrameType.REPLY
        while not self.stopping:
            f = port.recv(0.05)
            if f is None or f.type is not FrameType.REQUEST:
                continue
            port.send(Frame(dst=f.src, src=mac, type=reply, payload=f.payload, seq=f.seq))
            self.served += 1

    def snapshot(self) -> dict:
        return {"t": time.monotonic(), "served": self.served, "cpu": time.clock_gettime(self.clock),
                "filtered": self.port.counters["filtered"], "rx": self.port.counters["rx"]}


def ovs_cpu() -> float:
    """User+system CPU seconds of ovs-vswitchd (all threads)."""
    try:
        with open("/var/run/openvswitch/ovs-vswitchd.pid") as fh:
            st = proc_stat(int(fh.read().strip()))
    except (OSError, ValueError):
        return float("nan")
    return st.cpu_s if st is not None else float("nan")


def run_cell(tb: Testbed, cfg: dict, server: EchoServer, warm: float, measure: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--driver", json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"client driver did not start (exit {proc.poll()})")
        t0 = time.monotonic()
        t_start, t_end = t0 + warm, t0 + warm + measure
        proc.stdin.write(f"go {t_start} {t_end}\n")
        proc.stdin.flush()
        time.sleep(max(t_start - time.monotonic(), 0))
        s0, o0 = server.snapshot(), ovs_cpu()
        time.sleep(max(t_end - time.monotonic(), 0))
        s1, o1 = server.snapshot(), ovs_cpu()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"client driver exited {proc.returncode}")
    res = json.loads(out.strip().splitlines()[-1])
    return {"wall": s1["t"] - s0["t"], "served": s1["served"] - s0["served"], "cpu": s1["cpu"] - s0["cpu"],
            "filtered": s1["filtered"] - s0["filtered"], "rx": s1["rx"] - s0["rx"], "ovs_cpu": o1 - o0,
            "client_cpu": res["cpu_s"], "rtt_us": res["rtt_us"], "client": res["counters"]}


def pool(runs: list[dict]) -> dict:
    wall = sum(r["wall"] for r in runs)
    served = sum(r["served"] for r in runs)
    cpu = sum(r["cpu"] for r in runs)
    rtt = summary([x / 1e6 for r in runs for x in r["rtt_us"]])
    client = {k: sum(r["client"][k] for r in runs) for k in runs[0]["client"]}
    return {"served_per_s": round(served / wall, 1),
            "server_cpu_us_per_req": round(cpu / max(served, 1) * 1e6, 2),
            "server_busy": round(cpu / wall, 3),
            "filtered_userspace": sum(r["filtered"] for r in runs),
            "filtered_per_req": round(sum(r["filtered"] for r in runs) / max(served, 1), 3),
            "ovs_cpu_us_per_req": round(sum(r["ovs_cpu"] for r in runs) / max(served, 1) * 1e6, 2),
            "client_cpu_us_per_req": round(sum(r["client_cpu"] for r in runs) / max(served, 1) * 1e6, 2),
            "rtt_median_ms": rtt.get("median_ms"), "rtt_p99_ms": rtt.get("p99_ms"), "rtt_n": rtt.get("n"),
            "served": served, "seconds": round(wall, 2), "client": client,
            "per_run_served_per_s": [round(r["served"] / r["wall"]) for r in runs],
            "per_run_server_cpu_us_per_req": [round(r["cpu"] / max(r["served"], 1) * 1e6, 1) for r in runs]}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--driver":
        driver(json.loads(sys.argv[2]))
        return 0
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--requesters", default=None, help="comma-separated N (default 8,16,32; smoke 2)")
    ap.add_argument("--strays", type=float, default=2.0, help="stray frames per request (default 2)")
    ap.add_argument("--measure", type=float, default=None, help="s measured per run (default 2; smoke 1)")
    ap.add_argument("--warmup", type=float, default=None, help="s of load before measuring (default 0.75; smoke 0.5)")
    ap.add_argument("--reps", type=int, default=None, help="runs per cell, order alternating (default 4; smoke 1)")
    ap.add_argument("--timeout", type=float, default=0.2, help="s before a requester gives up on a reply")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ns = [int(x) for x in (args.requesters or ("2" if args.smoke else "8,16,32")).split(",")]
    measure = args.measure or (1.0 if args.smoke else 2.0)
    warm = args.warmup or (0.5 if args.smoke else 0.75)
    reps = args.reps or (1 if args.smoke else 4)
    # (scenario, N): shared at every N; flood and the drop baseline at the largest.
    cells = [("shared", n) for n in ns] + [("flood", max(ns)), ("drop", max(ns))]
    topo = f"single,{1 + max(ns)}"
    params = {"smoke": args.smoke, "topo": topo, "requesters": ns, "strays_per_request": args.strays,
              "measure_s": measure, "warmup_s": warm, "reps": reps, "timeout_s": args.timeout,
              "owned": [OWNED.lo, OWNED.hi], "stray": [STRAY.lo, STRAY.hi], "frame_bytes": 14 + 16 + len(PAYLOAD),
              "ctl_poll_s": 600}

    tb = Testbed(topo, poll=600)
    results: dict = {}
    server: EchoServer | None = None
    try:
        t_all = time.monotonic()
        tb.start()
        print(f"testbed {topo} up in {time.monotonic() - t_all:.1f} s", flush=True)
        reg, h = tb.registry, tb.hosts
        svc = reg.create_service(SERVICE, layout="prefix")
        reg.assign(SERVICE, OWNED, OWNER)
        blocks = api.service_blocks(svc, OWNED)
        ep = schema.Endpoint(service=SERVICE, name=OWNER, mac=h[SERVER]["mac"], rx="ovs", host=SERVER)
        # The ghost shares the server's port on purpose (so the switch delivers frames the
        # server does not own, VID intact): the vfab rule against sharing is what is measured away.
        lease = reg.announce(ep, ttl=10, allow_shared=True)
        reg.announce(schema.Endpoint(service=SERVICE, name=GHOST, mac=h[SERVER]["mac"], rx="bpf", host=SERVER),
                     ttl=10, allow_shared=True)
        clients = [{"iface": h[f"vfh{i + 2}"]["iface"], "netns": tb.netns(f"vfh{i + 2}")} for i in range(max(ns))]
        runs: dict[tuple, list] = {}
        rewrites: dict[str, bool] = {}
        for scenario, n in cells:
            miss, stray_owner = SCENARIOS[scenario]
            reg.set_miss_policy(miss)
            reg.assign(SERVICE, STRAY, stray_owner)
            for rep in range(reps):
                for backend in (BACKENDS if rep % 2 == 0 else BACKENDS[::-1]):
                    ep.rx = backend
                    reg.put(schema.endpoint_key(SERVICE, OWNER), ep.to_json(), lease=lease)
                    reg.wait_applied(reg.state_revision(), timeout=30)
                    rewrites[backend] = any("priority=1000" in f and "eth_dst" in f.split("actions=")[1]
                                            for f in tb.dump_flows("vfbs1"))
                    port = RawPort(h[SERVER]["iface"], rx=backend, blocks=blocks, netns=tb.netns(SERVER))
                    server = EchoServer(port)
                    server.start()
                    server.ready.wait(5)
                    cfg = {"sid": svc.id, "layout": svc.layout, "owned": [OWNED.lo, OWNED.hi],
                           "stray": [STRAY.lo, STRAY.hi], "strays": args.strays, "timeout": args.timeout,
                           "seed": args.seed + rep, "clients": clients[:n]}
                    try:
                        r = run_cell(tb, cfg, server, warm, measure)
                    finally:
                        server.stopping = True
                        server.join(timeout=2)
                        port.close()
                        server = None
                    runs.setdefault((scenario, n, backend), []).append(r)
                    print(f"[{time.monotonic() - t_all:5.1f} s] "
                          f"{scenario} N={n} {backend:<7} rep {rep}: {r['served'] / r['wall']:8.0f} req/s, "
                          f"server {r['cpu'] / max(r['served'], 1) * 1e6:6.1f} us/req, "
                          f"filtered {r['filtered']}, ovs {r['ovs_cpu'] / max(r['served'], 1) * 1e6:6.1f} us/req",
                          flush=True)
        for scenario, n in cells:
            cell = {b: pool(runs[(scenario, n, b)]) for b in BACKENDS}
            base = cell["ovs"]
            for b in BACKENDS:
                c = cell[b]
                c["ratio_vs_ovs"] = {
                    k: round(c[k] / base[k], 3) if base[k] else None
                    for k in ("served_per_s", "server_cpu_us_per_req", "rtt_median_ms", "rtt_p99_ms",
                              "ovs_cpu_us_per_req")}
            results[f"{scenario}/N={n}"] = cell
        results["switch_rewrites_vid"] = rewrites
        results["wall_s"] = round(time.monotonic() - t_all, 1)
    finally:
        if server is not None:
            server.stopping = True
        tb.stop()

    print(f"\n{'cell':<14} {'rx':<8} {'req/s':>8} {'x ovs':>6} {'srv us/req':>10} {'x ovs':>6} {'busy':>5} "
          f"{'filt/req':>8} {'ovs us/req':>10} {'rtt med':>8} {'rtt p99':>8} {'x ovs p99':>9}")
    for cell, per in results.items():
        if not isinstance(per, dict) or "ovs" not in per or not isinstance(per["ovs"], dict):
            continue
        for b in BACKENDS:
            c = per[b]
            ratio = c["ratio_vs_ovs"]
            print(f"{cell:<14} {b:<8} {c['served_per_s']:>8.0f} {ratio['served_per_s']:>6.2f} "
                  f"{c['server_cpu_us_per_req']:>10.1f} {ratio['server_cpu_us_per_req']:>6.2f} {c['server_busy']:>5.2f} "
                  f"{c['filtered_per_req']:>8.2f} {c['ovs_cpu_us_per_req']:>10.1f} {c['rtt_median_ms']:>8.3f} "
                  f"{c['rtt_p99_ms']:>8.3f} {ratio['rtt_p99_ms']:>9.2f}")
    write("filtered_receive", params, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
