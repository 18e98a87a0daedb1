"""Cut-overs on a busy switch: first packet and frames lost per cut-over, by cached datapath flows.

One fabric (``line,2,3``): owner A on vfbs1 (vfh1), owner B on vfbs2 (vfh4);
two clients, vfh2 on vfbs1 and vfh5 on vfbs2, each sending a vfab REQUEST to
range R every ``--interval-ms`` (so every cut-over has one client whose
frames cross the trunk before it and one after).  A background sender on
vfh6 streams 8,000 frames/s to N distinct unknown destination MACs
(``testbed.busy``): NORMAL floods each, so each becomes one exact-match
datapath flow on every switch.  The cached-flow count is read from the switch
(``ovs-appctl upcall/show``) before every cut-over, never assumed.

Per level (N = 0, 1k, 10k, 30k, 100k destinations; ``--levels``), in one run:

- ``cutovers`` cut-overs alternating A->B and B->A through etcd (the
  controller's normal path): first frame at the new owner (any client and
  each client), the controller's "applied" report (``Applied.at``: once a whole
  revalidation pass of the datapath ended after the commit, ``datapath``),
  and every frame lost (sequence numbers seen at neither owner);
- the OVS floor: ``floor`` samples of one ``ovs-ofctl add-flow`` on the
  client's own switch steering its frames to the other owner -> first frame
  there (what any controller would get from this switch at this load).

Run: ``/opt/vfab-venv/bin/python bench/reroute_busy.py [--smoke] [--levels 0,1000,...]`` (root).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import not_root, parser, write  # noqa: E402
from bench.reroute import Receiver, Sender, ms_stats, wait_flowing, wait_switched  # noqa: E402
from vfab.testbed.busy import BusySender, datapath_state  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.frame import Frame, FrameType  # noqa: E402
from vfab.vid.ranges import Range, to_masks  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.transport import RawPort  # noqa: E402

SERVICE = "rb"
THIRD = (codec.KEY_MAX + 1) // 3
R = Range(0, THIRD - 1)
REST = Range(THIRD, codec.KEY_MAX)
RATE = 8000.0                 # background frames/s (the load)
APPLIED_WAIT = 10.0           # s for the controller's datapath-confirmed report


def applied_at(reg, rev: int, dpids: list[int], timeout: float) -> tuple[float | None, bool]:
    """(latest Applied.at over dpids once all report >= rev, all confirmed by the datapath)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = reg.applied()
        recs = [got.get(d) for d in dpids]
        if all(r is not None and r.revision >= rev for r in recs):
            return max(r.at for r in recs), all(r.datapath for r in recs)
        time.sleep(0.005)
    return None, False


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--levels", default=None, help="background destination MACs per level, comma separated "
                    "(default 0,1000,10000,30000,100000; smoke 0,2000)")
    ap.add_argument("--cutovers", type=int, default=None, help="cut-overs per level (default 60, smoke 6)")
    ap.add_argument("--floor", type=int, default=None, help="ovs-ofctl floor samples per level (default: as many as cut-overs, so both p99s rest on as many samples; smoke 4)")
    ap.add_argument("--revalidators", default="1,2", help="OVS revalidator threads to compare at each level "
                    "(other_config:n-revalidator-threads; default 1,2; smoke 1)")
    ap.add_argument("--interval-ms", type=float, default=0.5, help="per-client send interval (default 0.5)")
    args = ap.parse_args()
    if not_root("reroute_busy", "network namespaces, Open vSwitch"):
        return 2
    levels = [int(x) for x in (args.levels or ("0,2000" if args.smoke else "0,1000,10000,30000,100000")).split(",")]
    cutovers = args.cutovers or (6 if args.smoke else 60)
    floor_n = args.floor or (4 if args.smoke else cutovers)
    revalidators = [int(x) for x in (args.revalidators if not args.smoke else "1").split(",")]
    sys.setswitchinterval(0.0005)
    rows = []
    ports: list[RawPort] = []
    threads: list = []
    with Testbed("line,2,3") as tb:
        reg = tb.registry
        svc = reg.create_service(SERVICE)
        a_host, b_host, clients, bg = "vfh1", "vfh4", ["vfh2", "vfh5"], "vfh6"
        s1, s2 = tb.switches["vfbs1"], tb.switches["vfbs2"]
        for name, host in (("a", a_host), ("b", b_host)):
            reg.announce(schema.Endpoint(service=SERVICE, name=name, mac=tb.hosts[host]["mac"], rx="ovs",
                                         host=host), ttl=3600)
        reg.assign(SERVICE, REST, "b")
        applied_at(reg, reg.assign(SERVICE, R, "a"), [s1, s2], APPLIED_WAIT)

        def port(host: str) -> RawPort:
            p = RawPort(tb.hosts[host]["iface"], rx="ovs", netns=tb.netns(host))
            ports.append(p)
            return p

        rx = {"a": Receiver("a", port(a_host)), "b": Receiver("b", port(b_host))}
        cports = [port(h) for h in clients]
        srcs = [p.mac for p in cports]
        frames = [bytearray(Frame(dst=codec.encode(svc.id, R.lo + 1000 * (i + 1)).packed, src=p.mac,
                                  type=FrameType.REQUEST, payload=b"busy-bench".ljust(32, b".")).serialize())
                  for i, p in enumerate(cports)]
        tx = Sender(cports, frames, args.interval_ms / 1e3, 16000)
        threads = [rx["a"], rx["b"], tx]
        try:
            for t in threads:
                t.start()
            tx.active = len(cports)
            owner = "a"
            wait_flowing(rx[owner], srcs)
            for level in levels:
                busy = None
                if level:
                    h = tb.hosts[bg]
                    busy = BusySender(tb.netns(bg), h["iface"], bytes.fromhex(h["mac"].replace(":", "")), level,
                                      RATE).start(tb)
                    filled = busy.fill(level, timeout=max(20.0, 2.5 * level / RATE + 5))
                    print(f"level {level}: {filled} cached datapath flows", flush=True)
                try:
                    for rv in revalidators:
                        _set_revalidators(rv)
                        samples, floor = [], []
                        sent_before = list(tx.sent)
                        for k in range(cutovers):
                            wait_flowing(rx[owner], srcs)
                            time.sleep(random.uniform(0.05, 0.15))
                            flows, pass_ms = datapath_state()
                            new = "b" if owner == "a" else "a"
                            rx[new].arm()
                            sent_t0 = list(tx.sent)
                            t0 = time.time()
                            rev = reg.assign(SERVICE, R, new)
                            ok = wait_switched(rx[new], srcs)
                            at, confirmed = applied_at(reg, rev, [s1, s2], APPLIED_WAIT)
                            time.sleep(0.02)  # frames in flight land
                            old_last = max(rx[owner].last.get(s, 0.0) for s in srcs)
                            # when the last frame the old owner got was *sent*: after "applied" it took a stale
                            # path; before, it waited in a queue (a port's socket buffer) while the switch moved
                            sent = [tx.sent_time(i, rx[owner].seqs[s][-1]) for i, s in enumerate(srcs)
                                    if rx[owner].seqs.get(s)]
                            old_sent = max((t for t in sent if t is not None), default=0.0)
                            per = {clients[i]: (rx[new].first[s] - t0) * 1e3 for i, s in enumerate(srcs)
                                   if s in rx[new].first}
                            samples.append({"level": level, "flows": flows, "pass_ms": pass_ms, "dir": f"{owner}->{new}", "ok": ok,
                                            "first": min(per.values()) if per else None,
                                            "all": max(per.values()) if ok else None, "per_client": per,
                                            "applied": (at - t0) * 1e3 if at else None, "datapath": confirmed,
                                            "old_last": (old_last - t0) * 1e3,
                                            "old_last_sent": (old_sent - t0) * 1e3 if old_sent else None,
                                            "sent_at_t0": sent_t0})
                            owner = new
                        floor_from = list(tx.sent)
                        # The floor: one flow added by hand on the client's own switch (vfh2 on vfbs1) that
                        # steers its frames to the other owner; removed after each sample.
                        cookie = 0x00F1000000000001
                        vid = codec.encode(svc.id, R.lo + 1000).value
                        for k in range(floor_n):
                            wait_flowing(rx[owner], srcs[:1])
                            time.sleep(random.uniform(0.05, 0.15))
                            other = "b" if owner == "a" else "a"
                            host = tb.hosts[b_host if other == "b" else a_host]
                            out = host["port"] if host["dpid"] == s1 else _trunk(reg, s1, s2)
                            rx[other].arm()
                            t0 = time.time()
                            subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "add-flow", "vfbs1",
                                            f"cookie={cookie:#x},table=1,priority=2000,"
                                            f"dl_dst={codec.int_to_mac(vid)},actions=set_field:{host['mac']}->eth_dst,"
                                            f"output:{out}"], check=True, capture_output=True)
                            got = wait_switched(rx[other], srcs[:1])
                            floor.append({"level": level, "ok": got, "first": (rx[other].first[srcs[0]] - t0) * 1e3
                                          if got else None})
                            subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "del-flows", "vfbs1",
                                            f"cookie={cookie:#x}/-1"], check=True, capture_output=True)
                            t1 = time.time()  # what the ovs-ofctl process alone costs: a flow_mod matching nothing
                            subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "mod-flows", "vfbs1",
                                            "table=1,cookie=0x1/-1,actions=drop"], check=True, capture_output=True)
                            floor[-1]["ofctl_noop"] = (time.time() - t1) * 1e3
                            time.sleep(0.3)  # back on the controller's route before the next sample
                        lost, where, runs = _losses(tx, rx, srcs, sent_before, samples, floor_from)
                        row = _row(level, samples, floor, lost, where)
                        row["revalidators"] = rv
                        row["loss_runs"] = runs[:20]
                        row["datapath_counters"] = _dp_counters()
                        for run in runs[:5]:
                            print(f"    lost run: {run}", flush=True)
                        rows.append(row)
                        _print_row(row)
                finally:
                    if busy is not None:
                        busy.stop()
                    _set_revalidators(None)
                if busy is not None:
                    time.sleep(2.0)
        finally:
            for t in threads:
                t.stopping = True
            for t in threads:
                t.join(1)
            for p in ports:
                p.close()
    print()
    _print_table(rows)
    write("reroute_busy", {"smoke": args.smoke, "levels": levels, "revalidators": revalidators, "cutovers": cutovers, "floor": floor_n,
                           "interval_ms": args.interval_ms, "background_rate": RATE, "topo": "line,2,3",
                           "masks": len(to_masks(R))}, {"levels": rows}, args.out)
    return 1 if any(r["failed"] for r in rows) else 0


_ORIGINAL_REVALIDATORS: list = []


def _set_revalidators(n: int | None) -> None:
    """other_config:n-revalidator-threads of the local ovs-vswitchd (None: back to what it was before)."""
    key = "n-revalidator-threads"
    if not _ORIGINAL_REVALIDATORS:
        got = subprocess.run(["ovs-vsctl", "--if-exists", "get", "Open_vSwitch", ".", f"other_config:{key}"],
                             capture_output=True, text=True).stdout.strip().strip('"')
        _ORIGINAL_REVALIDATORS.append(got)
    if n is None:
        n = _ORIGINAL_REVALIDATORS[0] or None
    if n is None:
        cmd = ["ovs-vsctl", "remove", "Open_vSwitch", ".", "other_config", key]
    else:
        cmd = ["ovs-vsctl", "set", "Open_vSwitch", ".", f"other_config:{key}={n}"]
    subprocess.run(cmd, check=True, capture_output=True)
    time.sleep(1.0)  # the daemon restarts its revalidators; the cache refills


def _trunk(reg, s1: int, s2: int) -> int:
    _, links = reg.get_prefix(schema.folder("links"))
    return next(lk.port for lk in (schema.Link.from_json(v, k) for k, (v, _) in links.items())
                if lk.dpid == s1 and lk.peer_dpid == s2)


def _losses(tx, rx, srcs, sent_before, samples, floor_from: list[int]) -> tuple[int, dict, list]:
    """Frames sent during the level that reached neither owner: how many, after which cut-over each was
    sent (-1: before the first; "floor": during the floor samples), and the runs of consecutive lost
    sequence numbers per client (an outage shows as one long run)."""
    time.sleep(0.3)
    lost, where, runs = 0, {}, []
    for i, src in enumerate(srcs):
        seen = set(rx["a"].seqs.get(src, [])) | set(rx["b"].seqs.get(src, []))
        run = None
        for q in range(sent_before[i], tx.sent[i] - 50):  # the last few may still be on their way
            if q in seen:
                run = None
                continue
            lost += 1
            if q >= floor_from[i]:
                k = "floor"
            else:
                k = max((j for j, s in enumerate(samples) if s["sent_at_t0"][i] <= q), default=-1)
            where[k] = where.get(k, 0) + 1
            if run is None:
                run = {"client": i, "first_seq": q, "frames": 0, "after": k}
                runs.append(run)
            run["frames"] += 1
    return lost, where, runs


def _dp_counters() -> dict:
    """The datapath's own lookup counters (``ovs-appctl dpctl/show``: hit, missed, lost upcalls)."""
    out = subprocess.run(["ovs-appctl", "dpctl/show"], capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        if "lookups:" in line:
            for part in line.split()[1:]:
                name, _, value = part.partition(":")
                if value.isdigit():
                    got[name] = int(value)
    return got


def _row(level: int, samples: list, floor: list, lost: int, where: dict) -> dict:
    def col(rows, key):
        return [r[key] for r in rows if r.get(key) is not None]

    ok = [s for s in samples if s["ok"]]
    gap = [s["applied"] - s["all"] for s in ok if s.get("applied") is not None]
    return {"level": level, "flows_median": int(statistics.median(col(samples, "flows"))) if samples else 0,
            "flows_max": max(col(samples, "flows"), default=0), "cutovers": len(samples),
            # the datapath's revalidation pass (upcall/show's "dump duration") before each cut-over: a flow
            # follows a table change only when the pass reaches it, so the first packet waits ~half a pass
            "pass": ms_stats(col(samples, "pass_ms")),
            "first": ms_stats(col(samples, "first")), "all": ms_stats(col(samples, "all")),
            "by_direction": {d: ms_stats(col([s for s in samples if s["dir"] == d], "first"))
                             for d in ("a->b", "b->a")},
            "applied": ms_stats(col(samples, "applied")), "applied_minus_all": ms_stats(gap),
            "old_last": ms_stats(col(samples, "old_last")),
            # "applied" must mean traffic moved: no frame reached the old owner after the report (2 ms for
            # frames already on the wire when it was written)
            "old_path_after_applied": sum(1 for s in ok if s.get("applied") is not None
                                          and s["old_last"] > s["applied"] + 2.0),
            # of those, frames that were sent after the report (a stale datapath flow: "applied" was wrong)
            # rather than before it (queued in the switch while it moved)
            "old_sent_after_applied": sum(1 for s in ok if s.get("applied") is not None
                                          and s["old_last"] > s["applied"] + 2.0
                                          and (s.get("old_last_sent") or 0.0) > s["applied"]),
            "datapath_confirmed": sum(1 for s in samples if s["datapath"]),
            "floor": ms_stats(col(floor, "first")), "floor_failed": sum(1 for f in floor if not f["ok"]),
            "ofctl_noop": ms_stats(col(floor, "ofctl_noop")),
            "lost": lost, "cutovers_with_loss": len([k for k in where if k != "floor" and k >= 0]),
            "lost_during_floor": where.get("floor", 0), "lost_before_first": where.get(-1, 0),
            "failed": sum(1 for s in samples if not s["ok"])}


def _print_row(r: dict) -> None:
    f, fl = r["first"], r["floor"]
    print(f"  level {r['level']}, {r['revalidators']} revalidator(s): flows ~{r['flows_median']}, first median {f.get('median_ms')} ms p99 "
          f"{f.get('p99_ms')} ms, applied median {r['applied'].get('median_ms')} ms "
          f"({r['datapath_confirmed']}/{r['cutovers']} datapath-confirmed, old path used after it: "
          f"{r['old_path_after_applied']}, sent after it: {r['old_sent_after_applied']}), floor median {fl.get('median_ms')} ms, lost {r['lost']} "
          f"({r['cutovers_with_loss']} cut-overs), failed {r['failed']}", flush=True)


def _print_table(rows: list) -> None:
    print("cut-overs on a busy switch (line,2,3; 2 clients each every 0.5 ms; background 8,000 frames/s to N "
          "unknown MACs); ms from the etcd write")
    print(f"{'N':>7} {'rv':>2} {'flows':>7} {'pass':>5} {'first med':>9} {'first p99':>9} {'all med':>8} {'all p99':>8} "
          f"{'applied med':>11} {'old>appl':>8} {'sent>':>5} {'floor med':>9} {'floor p99':>9} {'ofctl':>6} {'lost':>5} {'w/loss':>6} "
          f"{'fail':>4}")
    nan = float("nan")
    for r in rows:
        print(f"{r['level']:>7} {r['revalidators']:>2} {r['flows_median']:>7} {r['pass'].get('median_ms', nan):>5.0f} "
              f"{r['first'].get('median_ms', nan):>9.2f} "
              f"{r['first'].get('p99_ms', nan):>9.2f} {r['all'].get('median_ms', nan):>8.2f} "
              f"{r['all'].get('p99_ms', nan):>8.2f} {r['applied'].get('median_ms', nan):>11.2f} "
              f"{r['old_path_after_applied']:>8} {r['old_sent_after_applied']:>5} {r['floor'].get('median_ms', nan):>9.2f} "
              f"{r['floor'].get('p99_ms', nan):>9.2f} {r['ofctl_noop'].get('median_ms', nan):>6.2f} {r['lost']:>5} {r['cutovers_with_loss']:>6} "
              f"{r['failed']:>4}")
    print("pass: the datapath's last revalidation pass before the cut-over (upcall/show 'dump duration', median); "
          "first/all: first frame at the new owner from any / every client; applied: the controller's report "
          "(a whole datapath revalidation pass after the commit); old>appl: cut-overs where a frame still reached "
          "the old owner after the report; sent>: of those, where that frame was sent after the report (a stale "
          "datapath flow: must be 0; the others waited in a queue of the switch); floor: one ovs-ofctl add-flow on the client's switch -> first frame; ofctl: a no-op ovs-ofctl "
          "mod-flows (the process's own share of the floor)")


if __name__ == "__main__":
    sys.exit(main())
