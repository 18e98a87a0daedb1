"""The balancer reading memcached itself (a base checkout) vs reading etcd only (this tree), side by side.

No fabric: a real etcd member and a real memcached on loopback, so it needs neither root nor the testbed
lock.  Each round runs both, alternating which goes first:

* **base**: the base checkout's ``vfab balancer run mc --memcached mc/m=127.0.0.1:PORT --helper mc/h1``
  (it polls memcached's ``stats`` every period itself);
* **this**: this tree's ``vfab balancer run mc`` (etcd only) beside ``vfab balancer report mc/m --memcached
  127.0.0.1:PORT --every PERIOD`` (the reporter that runs on memcached's host; in the fabric it is memcached's
  agent's loop).

Both use the same settings (rate trigger, ``--period`` s, one period of burst window, as
bench/helper_activation.py).  Per variant: the CPU of the balancer (and of the reporter) over ``--idle`` s
without load and over the burst; the **reaction**: from the burst's first request (pipelined TCP gets from
this process, well above ``rate_on``) to the ``at`` of the balancer's ``helpers_on`` decision, both on this
machine's clock.  Between variants the helpers are switched off and the balancer's record removed.

Run: ``/opt/vfab-venv-BRANCH/bin/python bench/balancer_source.py --base /work/main --base-python
/opt/vfab-venv/bin/python [--rounds 5] [--period 0.02]`` (``--smoke``: one short round).  Results:
bench/results/balancer_source[-smoke].json.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import parser, write  # noqa: E402


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Burst:
    """Pipelined gets (32 a write) over one TCP connection until stopped; ``t0`` the first one's wall time."""

    def __init__(self, port: int):
        self.port, self.stop, self.t0, self.gets = port, threading.Event(), None, 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        req = b"get k1\r\n" * 32
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            self.t0 = time.time()
            while not self.stop.is_set():
                s.sendall(req)
                got = b""
                while got.count(b"END\r\n") < 32:
                    got += s.recv(65536)
                self.gets += 32
                time.sleep(0.001)   # ~20-30 K gets/s: a burst, not a CPU hog

    def __enter__(self) -> "Burst":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="/work/main", help="the base checkout (default /work/main)")
    ap.add_argument("--base-python", default="/opt/vfab-venv/bin/python", help="its interpreter")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each variant once per round (default 5)")
    ap.add_argument("--period", type=float, default=0.02, help="the balancer's period in s (default 0.02)")
    ap.add_argument("--idle", type=float, default=3.0, help="s of CPU measured without load (default 3)")
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    idle = 1.0 if args.smoke else args.idle

    from vfab.testbed.etcd import LocalEtcd, free_port
    from vfab.testbed.procs import wait_for
    from vfab.vid.codec import KEY_MAX
    from vfab.vid.ranges import Range
    from vfab.vid.registry import Registry, schema

    work = tempfile.mkdtemp(prefix="vfab-bench-balsrc-")
    etcd = LocalEtcd(os.path.join(work, "etcd"), free_port(), free_port())
    etcd.start(timeout=20)
    port = free_port()
    mcd = subprocess.Popen([shutil.which("memcached") or "/usr/bin/memcached", "-l", "127.0.0.1", "-p", str(port),
                            "-U", "0", "-t", "1", "-u", "nobody"])
    procs: list[subprocess.Popen] = []
    reg = Registry(etcd.endpoint)
    settings = {"period": args.period, "stale_after": max(1.0, args.period * 4), "min_interval": 0.2,
                "burst_window": args.period, "calm_window": 0.5, "min_on": 0.5, "min_off": 0.3,
                "rate_on": 3000, "rate_off": 1000, "helper_capacity": 100000}
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    trees = {"base": (os.path.abspath(args.base), args.base_python), "this": (os.path.dirname(HERE), sys.executable)}
    if args.smoke:   # proves this tree's bench runs: the base (a checkout from before the etcd-only balancer,
        # whose 'balancer run' takes --memcached) may be anything on the machine, or a newer main that refuses it
        print("balancer_source: smoke run of this tree only", flush=True)
        del trees["base"]
    elif not (os.path.isdir(args.base) and os.access(args.base_python, os.X_OK)):
        print(f"balancer_source: no base checkout at {args.base} with {args.base_python}: give --base and "
              "--base-python (e.g. a worktree of main and its venv)", file=sys.stderr)
        return 2

    def start(tree: str, python: str, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(work, f"{name}.log"), "ab")
        p = subprocess.Popen([python, "-m", "vfab.cli", "--etcd", etcd.endpoint, *cmd], cwd=tree, stdout=log,
                             stderr=subprocess.STDOUT)
        log.close()
        procs.append(p)
        return p

    def stop(p: subprocess.Popen) -> None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        procs.remove(p)

    def decisions() -> list[dict]:
        got = reg.get(schema.balancer_key("mc"))
        return schema.BalancerStatus.from_json(got[0]).decisions if got else []

    rows: list[dict] = []
    try:
        reg.delete_prefix("/vfab/")
        reg.create_service("mc")
        for i, name in enumerate(("m", "h1")):
            reg.announce(schema.Endpoint(service="mc", name=name, mac=f"02:00:00:00:00:0{i + 1}"), ttl=3600)
        reg.assign("mc", Range(0, KEY_MAX), "m")
        hs = schema.HelperStatus(at=time.time(), serves="127.0.0.1:1", pid=1, stats={"rx_dgrams": 0})
        stop_h = threading.Event()

        def helper_reports() -> None:   # what a helper's agent writes every second
            while not stop_h.wait(1.0):
                reg.put(schema.helper_key("mc", "h1"), schema.HelperStatus(**{**hs.__dict__, "at": time.time()})
                        .to_json())
        reg.put(schema.helper_key("mc", "h1"), hs.to_json())
        threading.Thread(target=helper_reports, daemon=True).start()
        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return True
            except OSError:
                return False
        wait_for(up, 10, "memcached")
        for r in range(rounds):
            for side in [t for t in (("base", "this") if r % 2 == 0 else ("this", "base")) if t in trees]:
                tree, python = trees[side]
                reg.delete(schema.balancer_key("mc"))
                rec = reg.ranges("mc")[0][0]
                if rec.helpers:
                    reg.assign("mc", Range(0, KEY_MAX), "m", expect_epoch=rec.epoch)
                rep = None
                if side == "base":
                    bal = start(tree, python, ["balancer", "run", "mc", "--memcached", f"mc/m=127.0.0.1:{port}",
                                               "--helper", "mc/h1", *sets], f"{side}-{r}")
                else:
                    rep = start(tree, python, ["balancer", "report", "mc/m", "--memcached", f"127.0.0.1:{port}",
                                               "--every", str(args.period)], f"{side}-{r}-report")
                    bal = start(tree, python, ["balancer", "run", "mc", *sets], f"{side}-{r}")
                wait_for(lambda: reg.get(schema.balancer_key("mc")) is not None, 20, f"{side}'s balancer")
                time.sleep(1.0)   # both read memcached a while (the reporter's first read gives no rate)
                c0 = {"bal": cpu_s(bal.pid), "rep": cpu_s(rep.pid) if rep else 0.0}
                t = time.monotonic()
                time.sleep(idle)
                dt = time.monotonic() - t
                row = {"variant": side, "round": r,
                       "idle_balancer_cpu_share": round((cpu_s(bal.pid) - c0["bal"]) / dt, 4),
                       "idle_reporter_cpu_share": round((cpu_s(rep.pid) - c0["rep"]) / dt, 4) if rep else None}
                c0 = {"bal": cpu_s(bal.pid), "rep": cpu_s(rep.pid) if rep else 0.0}
                t = time.monotonic()
                with Burst(port) as b:
                    wait_for(lambda: any(d["action"] == "helpers_on" for d in decisions()), 10,
                             f"{side}'s helpers_on")
                    on = next(d for d in decisions() if d["action"] == "helpers_on")
                    time.sleep(1.0)
                dt = time.monotonic() - t
                row.update({"reaction_ms": round((on["at"] - b.t0) * 1e3, 1),
                            "burst_gets_per_s": round(b.gets / dt),
                            "burst_balancer_cpu_share": round((cpu_s(bal.pid) - c0["bal"]) / dt, 4),
                            "burst_reporter_cpu_share": round((cpu_s(rep.pid) - c0["rep"]) / dt, 4) if rep else None,
                            "reason": on["reason"]})
                stop(bal)
                if rep:
                    stop(rep)
                rows.append(row)
                print(f"round {r + 1} {side}: reaction {row['reaction_ms']} ms; balancer CPU idle "
                      f"{row['idle_balancer_cpu_share']:.1%}, burst {row['burst_balancer_cpu_share']:.1%}"
                      + (f"; reporter idle {row['idle_reporter_cpu_share']:.1%}, burst "
                         f"{row['burst_reporter_cpu_share']:.1%}" if rep else "")
                      + f"; {row['burst_gets_per_s']} gets/s", flush=True)
        stop_h.set()
    finally:
        for p in list(procs):
            stop(p)
        mcd.terminate()
        mcd.wait(5)
        reg.close()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(side: str, key: str):
        vals = [r[key] for r in rows if r["variant"] == side and r.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    def worst(side: str, key: str):
        vals = [r[key] for r in rows if r["variant"] == side and r.get(key) is not None]
        return max(vals) if vals else None
    summary = {side: {"reaction_ms_median": med(side, "reaction_ms"), "reaction_ms_max": worst(side, "reaction_ms"),
                      "idle_balancer_cpu_share": med(side, "idle_balancer_cpu_share"),
                      "burst_balancer_cpu_share": med(side, "burst_balancer_cpu_share"),
                      "idle_reporter_cpu_share": med(side, "idle_reporter_cpu_share"),
                      "burst_reporter_cpu_share": med(side, "burst_reporter_cpu_share")} for side in trees}
    b, t = summary.get("base") or {k: None for k in summary["this"]}, summary["this"]
    if b["reaction_ms_median"] and t["reaction_ms_median"]:
        summary["reaction_this_over_base"] = round(t["reaction_ms_median"] / b["reaction_ms_median"], 2)
    for k in ("idle", "burst"):
        if b[f"{k}_balancer_cpu_share"]:
            summary[f"{k}_cpu_this_over_base"] = round(
                (t[f"{k}_balancer_cpu_share"] + (t[f"{k}_reporter_cpu_share"] or 0)) / b[f"{k}_balancer_cpu_share"], 2)
    print(f"reaction (burst -> helpers_on): base median {b['reaction_ms_median']} ms, this {t['reaction_ms_median']} "
          f"ms; balancer CPU idle {b['idle_balancer_cpu_share']} vs {t['idle_balancer_cpu_share']} (+ reporter "
          f"{t['idle_reporter_cpu_share']}), burst {b['burst_balancer_cpu_share']} vs {t['burst_balancer_cpu_share']} "
          f"(+ reporter {t['burst_reporter_cpu_share']})")
    write("balancer_source", {"smoke": args.smoke, "rounds": rounds, "base": trees.get("base", ("",))[0], "settings": settings,
                              "idle_s": idle}, {"rounds": rows, "summary": summary}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
