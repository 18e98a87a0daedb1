"""What kill -9 of the etcd leader costs a vfab process: write unavailability and a state operation's flip.

Starts a 3-member etcd cluster on loopback (``vfab.testbed.etcd.LocalEtcd(members=3)``) for each timing
setting (``--settings HEARTBEAT/ELECTION`` in ms; default etcd's own 100/1000, which the goal names, and
50/500, the testbed's single member) and runs ``--rounds`` rounds on it.  In a round:

- **no failure**: a writer (``Registry.put`` every 10 ms, through the member list) runs ``--window`` s;
  the longest gap between two of its writes, and a flip done meanwhile;
- **leader killed**: the writer again, and the leader is killed -9: the time from the kill to the
  writer's next write taken (*write unavailability*), to the surviving members agreeing on a new
  leader (*election*, asked of each every 20 ms by a separate observer), and a flip started at the
  instant of the kill, against the flip without failure.  The member then comes back.

The *flip* is a state operation's etcd step (``vfab.vid.state.machine._assign``, the machine's own
code, performed here with a Registry): an epoch-compared transaction giving a range to a peer, and,
when etcd's answer is lost, the range map read back to decide whether it committed.  A whole split
under a leader kill runs in tests/integration/test_etcd_leader_loss.py.

Rounds alternate where the client sits: on the leader (listed first: its connection dies and the client
moves on at once) or on a follower (its write was forwarded to the dead leader and is lost: the client
sees it by asking the member's status when the answer is late).  It also counts elections nobody
caused (raft term moves during the no-failure windows): the price of too short an election timeout
on this shared 2-core machine.

Run: ``/opt/vfab-venv/bin/python bench/etcd_leader_loss.py [--rounds 6] [--settings 100/1000,50/500]
[--window 2] [--smoke]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, summary, write  # noqa: E402
from vfab.testbed.etcd import LocalEtcd  # noqa: E402
from vfab.vid.errors import Conflict, RegistryError  # noqa: E402
from vfab.vid.ranges import Range  # noqa: E402
from vfab.vid.registry import Registry  # noqa: E402
from vfab.vid.state import machine as m  # noqa: E402

SERVICE = "bench-ll"
HALF = Range(0x800000, 0xFFFFFF)


class Writer:
    """Puts a key every ``period`` s; remembers when each put returned."""

    def __init__(self, endpoint: str, period: float = 0.01):
        self.reg = Registry(endpoint)
        self.period = period
        self.done: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reg.put("/bench/ll/w", "x")
                self.done.append(time.monotonic())
            except RegistryError:
                self.failed += 1
            self._stop.wait(self.period)

    def __enter__(self) -> "Writer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.done, self.done[1:])), default=0.0)

    def first_after(self, t: float) -> float | None:
        return next((x - t for x in self.done if x > t), None)


def flip(reg: Registry, owner: str) -> tuple[float, str]:
    """Give HALF to ``owner`` the way a state operation's flip does (the machine's ``_assign``); (seconds,
    how it ended: committed, committed-read-back, or lost)."""
    t0 = time.monotonic()
    rec = next(r for r, _ in reg.ranges(SERVICE) if HALF.lo in r.range)
    gen = m._assign(m.Assign(HALF, owner, rec.epoch, [], []))
    action, how = gen.send(None), "committed"
    try:
        while True:
            if isinstance(action, m.Assign):
                try:
                    value = reg.assign(SERVICE, action.rng, action.owner, expect_epoch=action.expect_epoch)
                except Conflict as exc:
                    value = m.Failure("conflict", str(exc))
                except RegistryError as exc:
                    value, how = m.Failure("etcd", str(exc)), "committed-read-back"
            else:
                value = [r for r, _ in reg.ranges(SERVICE)]
            action = gen.send(m.Result(time.monotonic(), value))
    except StopIteration:
        return time.monotonic() - t0, how
    except m._Abort as exc:
        return time.monotonic() - t0, f"lost: {exc.why}"


def new_leader_after(etcd: LocalEtcd, dead, dead_id: int, t_kill: float, timeout: float = 10.0) -> float | None:
    """Seconds from the kill until the live members agree on a leader other than ``dead`` (id ``dead_id``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = [mem.status() for mem in etcd.members if mem is not dead and mem.alive()]
        ids = {s.leader_id for s in said if s.ok}
        if len(ids) == 1 and not ids & {0, dead_id} and all(s.ok for s in said):
            return time.monotonic() - t_kill
        time.sleep(0.02)
    return None


def terms(etcd: LocalEtcd) -> int:
    return max((mem.status().raft_term for mem in etcd.members if mem.alive()), default=0)


def one_setting(heartbeat: int, election: int, rounds: int, window: float, workdir: str,
                pre_vote: bool = True) -> dict:
    for attempt in range(3):   # a free port can be taken between probing and binding: new ports, new data
        etcd = LocalEtcd(os.path.join(workdir, f"etcd-{heartbeat}-{election}-{attempt}"), members=3,
                         heartbeat_ms=heartbeat, election_ms=election, pre_vote=pre_vote)
        try:
            etcd.start(timeout=30)
            break
        except RegistryError as exc:
            print(f"  the cluster did not start ({exc}); again with other ports", flush=True)
    else:
        raise RuntimeError("the etcd cluster did not start 3 times: see the messages above")
    out: dict = {"heartbeat_ms": heartbeat, "election_ms": election, "pre_vote": pre_vote, "rounds": []}
    try:
        reg = Registry(etcd.endpoint)
        reg.create_service(SERVICE)
        reg.assign(SERVICE, Range(0, 0xFFFFFF), "a")
        spurious = 0
        for i in range(rounds):
            on = "leader" if i % 2 == 0 else "follower"
            lead = etcd.leader()
            others = [mem for mem in etcd.members if mem is not lead]
            first = lead if on == "leader" else others[0]
            order = ",".join([first.endpoint] + [mem.endpoint for mem in etcd.members if mem is not first])
            client = Registry(order)
            # no failure
            t_before = terms(etcd)
            with Writer(order) as calm:
                time.sleep(window / 2)
                calm_flip, _ = flip(client, "b" if i % 2 == 0 else "a")
                time.sleep(window / 2)
            spurious += terms(etcd) - t_before
            # the leader killed
            lead_id = lead.status().member_id
            with Writer(order) as hit:
                time.sleep(0.3)
                t_kill = time.monotonic()
                lead.kill9()
                flipped: dict = {}
                th = threading.Thread(target=lambda: flipped.update(
                    zip(("s", "how"), flip(client, "a" if i % 2 == 0 else "b"))), daemon=True)
                th.start()
                elected = new_leader_after(etcd, lead, lead_id, t_kill)
                th.join(15)
                time.sleep(0.3)
            row = {"client_on": on, "write_unavailable_s": hit.first_after(t_kill), "election_s": elected,
                   "flip_s": flipped.get("s"), "flip_ended": flipped.get("how"), "flip_no_failure_s": calm_flip,
                   "max_gap_no_failure_s": calm.max_gap(), "failed_writes": hit.failed}
            out["rounds"].append(row)
            print(f"  {heartbeat}/{election} ms round {i + 1} (client on the {on}): writes back "
                  f"{row['write_unavailable_s']:.3f} s after the kill, election {elected or 0:.3f} s, flip "
                  f"{row['flip_s'] or 0:.3f} s ({row['flip_ended']}) vs {calm_flip:.3f} s without failure",
                  flush=True)
            etcd.start()
            etcd.leader()
        out["spurious_elections"] = spurious
        for key in ("write_unavailable_s", "election_s", "flip_s", "flip_no_failure_s", "max_gap_no_failure_s"):
            out[key] = summary([r[key] for r in out["rounds"] if r[key] is not None])
        for on in ("leader", "follower"):
            out[f"write_unavailable_client_on_{on}"] = summary(
                [r["write_unavailable_s"] for r in out["rounds"] if r["client_on"] == on and r["write_unavailable_s"]])
        reg.close()
    finally:
        etcd.stop()
    return out


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="leader kills per setting (alternating client side)")
    ap.add_argument("--settings", default="100/1000,50/500",
                    help="HEARTBEAT/ELECTION ms pairs, comma-separated; /nopv after one runs it without etcd's "
                         "--pre-vote (on by default), e.g. 50/500,50/500/nopv")
    ap.add_argument("--window", type=float, default=2.0, help="seconds of the no-failure window per round")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.settings, args.window = 1, "100/1000", 0.5
    settings = []
    for item in args.settings.split(","):
        hb, _, rest = item.partition("/")
        el, _, flag = rest.partition("/")
        if not (hb.isdigit() and el.isdigit()) or int(el) < 5 * int(hb) or flag not in ("", "nopv"):
            ap.error(f"setting {item!r}: write HEARTBEAT/ELECTION in ms, the election at least 5 heartbeats "
                     "(etcd advises 10), optionally /nopv")
        settings.append((int(hb), int(el), flag != "nopv"))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="vfab-bench-ll-") as workdir:
        for hb, el, pv in settings:
            print(f"etcd cluster of 3, heartbeat {hb} ms, election timeout {el} ms, pre-vote {'on' if pv else 'off'}:",
                  flush=True)
            results[f"{hb}/{el}" + ("" if pv else "/nopv")] = one_setting(hb, el, args.rounds, args.window, workdir, pv)
    print("\nsetting    write unavailable (median/max)  election (median)  flip killed / calm (median)  "
          "spurious elections")
    for name, r in results.items():
        w, e, f, c = r["write_unavailable_s"], r["election_s"], r["flip_s"], r["flip_no_failure_s"]
        print(f"{name:10} {w.get('median_ms', 0):8.0f} / {w.get('max_ms', 0):5.0f} ms {e.get('median_ms', 0):12.0f} ms "
              f"{f.get('median_ms', 0):12.0f} / {c.get('median_ms', 0):6.1f} ms {r['spurious_elections']:12d}")
    write("etcd_leader_loss", {"rounds": args.rounds, "settings": args.settings, "window": args.window,
                               "smoke": args.smoke, "goal_ms": 1500}, results, args.out)


if __name__ == "__main__":
    main()
