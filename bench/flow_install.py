"""Time to compile and install N ranges, and to remove them again.

For each N, on a one-switch fabric (``single,2``, two endpoints on vfh1 and vfh2):

1. N ranges covering the whole key space (equal sizes, owners alternating
   between the two endpoints) and the two endpoint records are written to etcd
   while the service record does not exist yet, so the controller compiles
   nothing for them (``compile_fabric`` walks known services only).  The puts
   go in transactions of at most 128 operations (etcd's default limit).
2. The service record (``services/NAME`` plus ``service-ids/ID``) is written in
   ONE transaction; install time = from just before that write to
   ``Registry.wait_applied`` returning (the controller reloads its state,
   compiles the fabric, diffs and commits one bundle).
3. In-process, on the same etcd snapshot: ``FabricState.from_items`` and
   ``compile_fabric`` times, route flows (sum of ``to_masks`` over the ranges)
   and the total flows the switch should hold.
4. The service's ranges are deleted with one delete-range; removal time =
   from that write to ``wait_applied``.

Run: ``/opt/vfab-venv/bin/python bench/flow_install.py [--smoke]`` (root).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import not_root, parser, write  # noqa: E402
from vfab.fabric.compiler import compile_fabric  # noqa: E402
from vfab.fabric.flows import FlowSpec, Kind  # noqa: E402
from vfab.fabric.state import FabricState  # noqa: E402
from vfab.testbed.fabric import Testbed  # noqa: E402
from vfab.vid import codec  # noqa: E402
from vfab.vid.registry import schema  # noqa: E402
from vfab.vid.ranges import Range, to_masks  # noqa: E402

TXN_OPS = 128          # etcd --max-txn-ops default
APPLY_TIMEOUT = 300.0


def equal_ranges(n: int) -> list[Range]:
    size = (codec.KEY_MAX + 1) // n
    return [Range(i * size, codec.KEY_MAX if i == n - 1 else (i + 1) * size - 1) for i in range(n)]


def aligned_ranges(n: int) -> list[Range]:
    """n ranges of one power-of-two block each where possible (one flow per range); the last takes the rest."""
    size = 1 << ((codec.KEY_MAX + 1) // n).bit_length() - 1
    out = [Range(i * size, (i + 1) * size - 1) for i in range(n - 1)]
    out.append(Range((n - 1) * size, codec.KEY_MAX))
    return out


def free_sid(reg) -> int:
    _, ids = reg.get_prefix(schema.ROOT + "service-ids/")
    used = {int(k.rsplit("/", 1)[1]) for k in ids}
    return next(i for i in range(100, codec.SERVICE_MAX + 1) if i not in used)


def switch_flows(switch: str) -> int:
    out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-aggregate", switch],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"flow_count=(\d+)", out)
    return int(m.group(1)) if m else -1


def service_flows_on_switch(switch: str, sid: int) -> int:
    """Flows on ``switch`` whose cookie names a VID route of service ``sid`` (its table-1 routes)."""
    cookie = (int(Kind.VID_ROUTE) << 56) | (sid << 40)
    out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-aggregate", switch,
                          f"cookie={cookie:#x}/0xffffff0000000000"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"flow_count=(\d+)", out)
    return int(m.group(1)) if m else -1


def until_switch_holds(switch: str, sid: int, want: int, t0: float, t_applied: float,
                       timeout: float = APPLY_TIMEOUT) -> tuple[float, int]:
    """(seconds since t0 until the switch held ``want`` flows of the service, what it held at wait_applied).

    If it already held them when wait_applied returned, that is the time (an ovs-ofctl call costs ~20 ms).
    """
    at_applied = service_flows_on_switch(switch, sid)
    if at_applied == want:
        return t_applied, at_applied
    have = at_applied
    while have != want:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{switch} holds {have} flows of service {sid}, {want} wanted, after {timeout:.0f} s")
        time.sleep(0.05)
        have = service_flows_on_switch(switch, sid)
    return time.monotonic() - t0, at_applied


def ofctl_flow(f: FlowSpec, with_actions: bool = True) -> str:
    """A FlowSpec in ovs-ofctl syntax (for the OVS-side floor)."""
    parts = [f"table={f.table}", f"priority={f.priority}"]
    if with_actions:
        parts.append(f"cookie={f.cookie:#x}")
    for name, value, mask in f.match:
        if name in ("eth_dst", "eth_src"):
            text = codec.int_to_mac(value) + (f"/{codec.int_to_mac(mask)}" if mask is not None else "")
            parts.append(f"{'dl_dst' if name == 'eth_dst' else 'dl_src'}={text}")
        else:
            parts.append(f"{name}={value}" + (f"/{mask:#x}" if mask is not None else ""))
    if not with_actions:
        return ",".join(parts)
    acts = []
    for a in f.actions:
        if a[0] == "set_eth_dst":
            acts.append(f"set_field:{codec.int_to_mac(a[1])}->eth_dst")
        elif a[0] in ("output", "group"):
            acts.append(f"{a[0]}:{a[1]}")
        elif a[0] == "goto":
            acts.append(f"goto_table:{a[1]}")
        else:  # normal, flood, controller
            acts.append(a[0])
    return ",".join(parts) + ",actions=" + (",".join(acts) or "drop")


def encode_cost(flows: list[FlowSpec], sample: int = 20000) -> float:
    """Seconds per flow the controller spends encoding one bundled ADD flow mod (in-process)."""
    from vfab.controller import ofmsg
    from vfab.fabric.flows import gc_paused

    part = flows[:sample]
    with gc_paused():  # as the controller encodes
        t0 = time.perf_counter()
        for _ in ofmsg.bundled_adds(1, 3, part, 1):
            pass
        return (time.perf_counter() - t0) / max(1, len(part))


def ovs_floor(tb: Testbed, name: str, sid: int, flows: list[FlowSpec]) -> dict:
    """The same flows with ovs-ofctl --bundle (controller dead): OVS's own share of install and removal."""
    add_path = os.path.join(tb.workdir, f"{name}.flows")
    del_path = os.path.join(tb.workdir, f"{name}.matches")
    with open(add_path, "w") as fh:
        fh.writelines(ofctl_flow(f) + "\n" for f in flows)
    with open(del_path, "w") as fh:
        fh.writelines(ofctl_flow(f, with_actions=False) + "\n" for f in flows)
    t0 = time.monotonic()
    subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "--bundle", "add-flows", "vfbs1", add_path],
                   check=True, capture_output=True, text=True)
    t_add = time.monotonic() - t0
    have = service_flows_on_switch("vfbs1", sid)
    t0 = time.monotonic()
    with open(del_path) as fh:  # del-flows takes a file only as '-' (stdin); a path would be parsed as a flow
        subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "--bundle", "--strict", "del-flows", "vfbs1", "-"],
                       check=True, capture_output=True, text=True, stdin=fh)
    t_del = time.monotonic() - t0
    left = service_flows_on_switch("vfbs1", sid)
    out = {"flows": len(flows), "ofctl_bundle_add_ms": round(t_add * 1e3, 1),
           "ofctl_bundle_del_strict_ms": round(t_del * 1e3, 1)}
    if have != len(flows) or left != 0:
        out["warning"] = f"ovs-ofctl floor: {have}/{len(flows)} flows after add, {left} after delete"
    return out


def commit_log(logpath: str, rev: int, until: int | None = None) -> tuple[list[tuple[str, float]], list[float]]:
    """(plan summary, bundle ms) of each commit the controller logged for revisions ``rev`` <= r < ``until``,
    and the ms it logged for planning those rounds.

    A round is labelled with the newest revision in the controller's mirror, which can be one of its own
    later counter writes: hence a range of revisions, not ``rev`` alone.
    """
    commit = re.compile(r"switch [0-9a-f]+: revision (\d+): (.*) in ([\d.]+) ms$")
    plan = re.compile(r"vfab.controller INFO revision (\d+): planned \d+ commit\(s\) in ([\d.]+) ms$")
    commits, plans = [], []
    with open(logpath, errors="replace") as fh:
        for line in fh:
            line = line.rstrip("\n")
            m = commit.search(line)
            if m and rev <= int(m.group(1)) < (until or 1 << 62):
                commits.append((m.group(2), float(m.group(3))))
            m = plan.search(line)
            if m and rev <= int(m.group(1)) < (until or 1 << 62):
                plans.append(float(m.group(2)))
    return commits, plans


def settle(tb: Testbed) -> None:
    tb.registry.wait_applied(tb.registry.state_revision(), timeout=APPLY_TIMEOUT)


def run_one(tb: Testbed, n: int, layout: str, compile_reps: int) -> tuple[dict, list[FlowSpec]]:
    reg = tb.registry
    name = f"fi-{layout[0]}{n}"
    sid = free_sid(reg)
    ranges = equal_ranges(n) if layout == "equal" else aligned_ranges(n)
    route_flows = sum(len(to_masks(r)) for r in ranges)
    # Endpoints and ranges first, with no service record: the controller ignores them.
    hosts = sorted(tb.hosts)[:2]
    for ep_name, host in zip(("a", "b"), hosts):
        ep = schema.Endpoint(service=name, name=ep_name, mac=tb.hosts[host]["mac"], rx="ovs", host=host)
        reg.put(schema.endpoint_key(name, ep_name), ep.to_json())
    puts = {schema.range_key(name, r.lo): schema.RangeRec(lo=r.lo, hi=r.hi, owner="ab"[i % 2], epoch=1).to_json()
            for i, r in enumerate(ranges)}
    keys = list(puts)
    t0 = time.monotonic()
    for i in range(0, len(keys), TXN_OPS):
        ok, _ = reg.txn([], {k: puts[k] for k in keys[i:i + TXN_OPS]})
        if not ok:
            raise RuntimeError(f"range batch {i // TXN_OPS} of {name} was refused")
    t_write = time.monotonic() - t0
    settle(tb)  # the controller has digested the (ignored) ranges: the switch is quiet
    before = switch_flows("vfbs1")

    # -- in-process compile of the state the install creates (before it: no competing for CPU) --
    svc = schema.Service(name=name, id=sid)
    _, items = reg.get_prefix(schema.ROOT)
    raw = {k: v for k, (v, _) in items.items()}
    raw[schema.service_key(name)] = svc.to_json().encode()   # what the controller will see after the install
    raw[schema.service_id_key(sid)] = name.encode()
    t_state, t_compile = [], []
    for _ in range(compile_reps):
        c0 = time.perf_counter()
        st = FabricState.from_items(raw)
        c1 = time.perf_counter()
        cfg = compile_fabric(st)
        c2 = time.perf_counter()
        t_state.append(c1 - c0)
        t_compile.append(c2 - c1)
    total_flows = sum(len(c.flows) for c in cfg.values())
    # everything the switch holds for the service (routes + the endpoints' admits), and its VID-route flows
    # alone (table-1 routes: what service_flows_on_switch counts on the switch by cookie)
    svc_all = sum(1 for c in cfg.values() for f in c.flows.values() if (f.cookie >> 40) & 0xFFFF == sid)
    mine = [f for c in cfg.values() for f in c.flows.values()
            if f.cookie >> 56 == Kind.VID_ROUTE and (f.cookie >> 40) & 0xFFFF == sid]
    svc_flows = len(mine)
    per_flow = encode_cost(mine)

    # -- install: ONE write that makes the service known ------------------------
    t0 = time.monotonic()
    w0 = time.time()
    ok, rev = reg.txn([reg.cmp_mod(schema.service_key(name), 0), reg.cmp_mod(schema.service_id_key(sid), 0)],
                      {schema.service_key(name): svc.to_json(), schema.service_id_key(sid): name})
    t_put = time.monotonic() - t0
    if not ok:
        raise RuntimeError(f"service {name} or id {sid} already exists")
    reg.wait_applied(rev, timeout=APPLY_TIMEOUT)
    t_install = time.monotonic() - t0
    ctl_at = max(a.at for a in reg.applied().values()) - w0
    t_install_sw, at_applied_in = until_switch_holds("vfbs1", sid, svc_flows, t0, t_install)
    after = switch_flows("vfbs1")
    want_flows = after - before

    # -- removal: one delete-range of the service's ranges ------------------------
    t0 = time.monotonic()
    w0 = time.time()
    rev_del = reg.delete_prefix(schema.range_prefix(name))
    reg.wait_applied(rev_del, timeout=APPLY_TIMEOUT)
    t_remove = time.monotonic() - t0
    ctl_at_del = max(a.at for a in reg.applied().values()) - w0
    t_remove_sw, at_applied_out = until_switch_holds("vfbs1", sid, 0, t0, t_remove)
    removed = switch_flows("vfbs1")

    # Tidy up (untimed): the service goes entirely.
    rev_tidy = reg.delete_prefix(schema.endpoint_prefix(name))
    (log_in, plan_in), (log_out, plan_out) = (commit_log(tb.controller.logpath, rev, rev_del),
                                              commit_log(tb.controller.logpath, rev_del, rev_tidy))
    reg.delete(schema.service_id_key(sid))
    # state_revision() cannot see deletions: wait for the last delete's own revision.
    reg.wait_applied(reg.delete(schema.service_key(name)), timeout=APPLY_TIMEOUT)
    row = {
        "ranges": n, "layout": layout, "route_flows": route_flows, "service_flows": svc_all,
        "switch_flows_total": total_flows, "installed_delta": after - before, "removed_delta": after - removed,
        "etcd_range_write_ms": round(t_write * 1e3, 1),
        "state_ms": round(statistics.median(t_state) * 1e3, 2),
        "compile_ms": round(statistics.median(t_compile) * 1e3, 2),
        "service_put_ms": round(t_put * 1e3, 2), "sid": sid, "name": name,
        "encode_us_per_flow": round(per_flow * 1e6, 1),
        "encode_ms_estimate": round(per_flow * svc_flows * 1e3, 1),
        "install_ms": round(t_install * 1e3, 1), "install_ctl_stamp_ms": round(ctl_at * 1e3, 1),
        "install_on_switch_ms": round(t_install_sw * 1e3, 1), "service_flows_at_install_applied": at_applied_in,
        "remove_ms": round(t_remove * 1e3, 1), "remove_ctl_stamp_ms": round(ctl_at_del * 1e3, 1),
        "remove_on_switch_ms": round(t_remove_sw * 1e3, 1), "service_flows_at_remove_applied": at_applied_out,
        "install_bundle": [{"plan": p, "ms": ms} for p, ms in log_in],
        "remove_bundle": [{"plan": p, "ms": ms} for p, ms in log_out],
        "install_plan_ms": plan_in, "remove_plan_ms": plan_out,
    }
    problems = []
    if want_flows != svc_all:
        problems.append(f"the switch gained {want_flows} flows, the compiler wants {svc_all} for the service")
    if at_applied_in != svc_flows:
        problems.append(f"install reported applied with {at_applied_in}/{svc_flows} service flows on the switch")
    if at_applied_out != 0:
        problems.append(f"removal reported applied with {at_applied_out} service flows still on the switch")
    if len(log_in) != 1 or len(log_out) != 1:
        problems.append(f"the controller used {len(log_in)} bundle(s) to install and {len(log_out)} to remove "
                        "(one each expected)")
    if problems:
        row["warning"] = "; ".join(problems)
    return row, mine


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None, help="numbers of ranges, comma separated (default 1000,10000; "
                                                     "smoke 100,1000)")
    ap.add_argument("--layouts", default="aligned,equal", help="'equal' (N equal ranges: several masks each) and/or "
                                                       "'aligned' (one power-of-two block each), comma separated")
    ap.add_argument("--poll", type=float, default=1.0, help="controller counter-poll period (s)")
    ap.add_argument("--compile-reps", type=int, default=3)
    ap.add_argument("--no-floor", action="store_true", help="skip the ovs-ofctl --bundle floor")
    args = ap.parse_args()
    if not_root("flow_install", "Open vSwitch, network namespaces"):
        return 2
    sizes = [int(x) for x in (args.sizes or ("100,1000" if args.smoke else "1000,10000")).split(",")]
    layouts = args.layouts.split(",")
    for lay in layouts:
        if lay not in ("equal", "aligned"):
            ap.error(f"layout {lay!r} is unknown: use equal or aligned")
    tb = Testbed("single,2", poll=args.poll)
    rows = []
    floors: list = []
    try:
        t0 = time.monotonic()
        tb.start()
        print(f"fabric single,2 up in {time.monotonic() - t0:.1f} s; controller poll {args.poll} s", flush=True)
        for layout in layouts:
            for n in sizes:
                t1 = time.monotonic()
                row, flows = run_one(tb, n, layout, args.compile_reps)
                rows.append(row)
                floors.append((row, flows))
                print(f"  {layout} N={n}: done in {time.monotonic() - t1:.1f} s "
                      f"(install bundle {row['install_bundle']}, removal {row['remove_bundle']})", flush=True)
                if "warning" in row:
                    print("  WARNING:", row["warning"], flush=True)
        ctl_log = tb.controller.logpath
        with open(ctl_log, errors="replace") as fh:
            ctl_problems = [ln.strip() for ln in fh if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln]
        if not args.no_floor:
            # OVS's own share: the same flows through ovs-ofctl --bundle, the controller dead.
            tb.kill_controller()
            for row, flows in floors:
                row["ovs_floor"] = ovs_floor(tb, row["name"], row["sid"], flows)
                print(f"  floor {row['layout']} N={row['ranges']}: {row['ovs_floor']}", flush=True)
        floors.clear()
    finally:
        tb.stop()

    print()
    print("N ranges, flows, compile, install (etcd write -> applied), removal; times in ms")
    print(f"{'layout':>7} {'N':>6} {'route':>7} {'svc flows':>9} {'state':>7} {'compile':>8} {'install':>8} "
          f"{'on sw':>8} {'plan':>8} {'bundle':>8} {'encode':>8} {'removal':>8} {'on sw':>8} {'plan':>8} "
          f"{'bundle':>8} {'ovs add':>8} {'ovs del':>8}")
    for r in rows:
        b_in = sum(b["ms"] for b in r["install_bundle"])
        b_out = sum(b["ms"] for b in r["remove_bundle"])
        print(f"{r['layout']:>7} {r['ranges']:>6} {r['route_flows']:>7} {r['service_flows']:>9} {r['state_ms']:>7.1f} "
              f"{r['compile_ms']:>8.1f} {r['install_ms']:>8.1f} {r['install_on_switch_ms']:>8.1f} "
              f"{sum(r['install_plan_ms']):>8.1f} {b_in:>8.1f} {r['encode_ms_estimate']:>8.1f} {r['remove_ms']:>8.1f} "
              f"{r['remove_on_switch_ms']:>8.1f} {sum(r['remove_plan_ms']):>8.1f} {b_out:>8.1f} "
              f"{r.get('ovs_floor', {}).get('ofctl_bundle_add_ms', float('nan')):>8.1f} "
              f"{r.get('ovs_floor', {}).get('ofctl_bundle_del_strict_ms', float('nan')):>8.1f}")
    print("route = sum of to_masks over the ranges (table-1 flows); svc flows = everything the switch holds for "
          "the service (routes + one port-security admit per endpoint port in table 0); state = FabricState.from_items, "
          "compile = compile_fabric (in-process, same snapshot); install/removal = etcd write -> wait_applied; "
          "on sw = until ovs-ofctl dump-aggregate shows the final count; plan = the controller's reconcile round before "
          "its commits (parse the etcd mirror, compile, diff, order), as it logged it; bundle = commit time it logged "
          "(encode + send + commit reply); encode = bundle-add + flow-mod bytes (controller/ofmsg.py) for that many flows "
          "(in-process, sampled); ovs add/del = the same flows via 'ovs-ofctl --bundle add-flows' / "
          "'--bundle --strict del-flows' with the controller dead (OVS's own share, ~20 ms of it ovs-ofctl start-up)")
    if ctl_problems:
        print(f"controller logged {len(ctl_problems)} warnings/errors, e.g.:")
        for ln in ctl_problems[:5]:
            print("   ", ln[:200])
    params = {"smoke": args.smoke, "topo": "single,2", "sizes": sizes, "layouts": layouts, "poll": args.poll,
              "txn_ops": TXN_OPS, "compile_reps": args.compile_reps}
    write("flow_install", params, {"rows": rows, "controller_problems": ctl_problems[:20]}, args.out)
    return 1 if any("warning" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
