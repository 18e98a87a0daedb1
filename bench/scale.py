"""The control plane at scale (issue 45, "Scale"): 64 switches, 1,000 services x 100 ranges in etcd.

In one run, side by side:

1. **Flows per switch** (pure, every node): each node's route table as the two-level compiler makes it
   (``bench/scale_model.py``), against what "every range on every switch" costs (the blocks of all
   ranges), for the placements and nodes-per-service asked (``--per-service``); and the full recompile's
   time per node.  Beside it, the route agent's whole-switch compiler (``fabric/nodecompile.py``, issue 45's
   route agent: also local ports, host MACs elsewhere, tunnels) on the same records, cold and warm.
2. **The real part**, under the testbed lock: one etcd member holding the fabric's records (services,
   endpoints, host records, nodes, every range), ``--switches`` OVS sandboxes (ovs-vswitchd with dummy
   datapaths: real flow tables, bundles and OpenFlow channels, no traffic; ``testbed/ovsinst.py``) and a
   route agent per emulated node (``bench/scale_agent.py``: its own etcd watch, its own channel).  Each
   switch gets its table as one bundle; then ``--changes`` range moves, each one etcd write, timed from
   the write to the last bundle answered on the switches that need it (the agents find which; the bench
   checks they are exactly those the model says), and the cost per agent; then ``--restarts`` agents
   restarted: read etcd, parse, recompile, dump the switch, diff, commit (nothing to add or remove: no
   duplicated or dropped flow), and once on an emptied switch.  Flows on the switches are read back and
   must equal the model's count.  etcd's, the switches' and this process's CPU and memory are read.
3. **The model** for hosts this machine cannot give each a CPU: on its own host an agent gets the event
   after etcd's delivery to one watcher (the first agent's here), spends its own CPU (its thread's, measured
   per agent and change) and waits for its switch's bundle (a move's bundle timed on one switch with the
   machine to itself, before the agents start); the fabric's latency is the slowest of N such agents
   (``scale_model.fabric_latency``), for N = the nodes asked and for 1,000 (OVN's 1,000-hypervisor sync:
   11.4 s).  It leaves out etcd's own cost of serving N watchers (measured here for 64 in one process).

Run: ``/opt/vfab-venv/bin/python bench/scale.py [--smoke] [--switches 64]`` (root: the testbed lock).
"""

from __future__ import annotations

import collections
import gc
import os
import random
import resource
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import scale_model as model  # noqa: E402
from bench.common import CLK_TCK, not_root, parser, summary, write  # noqa: E402
from bench.scale_agent import LOCAL_PORT, Agent, RouteView, Shared, full_reconcile  # noqa: E402
from vfab.controller.reconcile import diff  # noqa: E402
from vfab.fabric.flows import Kind, SwitchConfig, split_cookie  # noqa: E402
from vfab.fabric.nodecompile import compile_node  # noqa: E402
from vfab.testbed.etcd import LocalEtcd  # noqa: E402
from vfab.testbed.fabric import acquire_lock, release_lock  # noqa: E402
from vfab.testbed.ofsock import SockDatapath  # noqa: E402
from vfab.testbed.ovsinst import OvsInstance  # noqa: E402
from vfab.fabric import tunnels  # noqa: E402
from vfab.testbed.procs import Supervisor, free_port, wait_for  # noqa: E402
from vfab.vid.codec import int_to_mac  # noqa: E402
from vfab.vid.ranges import Range, to_masks  # noqa: E402
from vfab.vid.registry import Registry, schema  # noqa: E402

TXN_OPS = 128            # etcd's --max-txn-ops default
BRIDGE = "vfsc"          # the sandboxes' bridge (the project's "vf" prefix)
MAC_BASE = 0x02_45_00_00_00_00


def endpoint_name(k: int) -> str:
    return f"e{k}"


def endpoint_mac(sid: int, k: int) -> str:
    return int_to_mac(MAC_BASE | sid << 8 | k)


def records(w: model.Workload) -> dict[str, str]:
    """Every etcd record of the workload: nodes, services, an endpoint per (service, node) with its host
    record on that node's switch, and the ranges owned by those endpoints."""
    out = {}
    for j in range(1, w.nodes + 1):
        name = model.node_name(j)
        out[schema.node_key(name)] = schema.Node(name=name, tunnel_ip=tunnel_ip(j), dpid=j, bridge=BRIDGE).to_json()
    for sid, ranges in w.owned.items():
        svc = f"s{sid}"
        out[schema.service_key(svc)] = schema.Service(name=svc, id=sid).to_json()
        out[schema.service_id_key(sid)] = svc
        where = w.service_nodes(sid)
        for k, node in enumerate(where):
            mac = endpoint_mac(sid, k)
            out[schema.endpoint_key(svc, endpoint_name(k))] = schema.Endpoint(
                service=svc, name=endpoint_name(k), mac=mac, host=node).to_json()
            out[schema.host_key(mac)] = schema.Host(mac=mac, dpid=int(node[1:]), port=LOCAL_PORT).to_json()
        for r in ranges:
            out[schema.range_key(svc, r.lo)] = range_record(w, sid, r).to_json()
    return out


def tunnel_ip(j: int) -> str:
    return f"10.45.{j // 250}.{j % 250 + 1}"


def range_record(w: model.Workload, sid: int, r) -> schema.RangeRec:
    return schema.RangeRec(lo=r.lo, hi=r.hi, owner=endpoint_name(w.service_nodes(sid).index(r.node)), epoch=r.epoch)


def tunnel_ports(nodes: int) -> dict[str, dict[str, int]]:
    return {model.node_name(j): model.tunnel_ports(nodes, model.node_name(j)) for j in range(1, nodes + 1)}


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds so far, resident KiB) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return (int(f[11]) + int(f[12])) / CLK_TCK, rss


def self_usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, proc_usage(os.getpid())[1]


# -- 1. flows per switch (pure) ----------------------------------------------------------------------
def flows_per_switch(args) -> dict:
    out = {}
    main_w = None
    for per in args.per_service_list:
        for placement in model.PLACEMENTS:
            w = model.Workload(args.services, args.ranges, args.nodes, per_service=per, placement=placement)
            all_nodes = placement == "aligned" and per == args.per_service
            names = [model.node_name(j) for j in range(1, args.nodes + 1)][:None if all_nodes else args.sample]
            counts, times = [], []
            for me in names:
                t0 = time.perf_counter()
                counts.append(len(model.node_flows(w, me)))
                times.append(time.perf_counter() - t0)
            row = {"nodes_compiled": len(names), "flows_max": max(counts), "flows_median": sorted(counts)[len(counts) // 2],
                   "compile_median_ms": round(sorted(times)[len(times) // 2] * 1e3, 1),
                   "compile_max_ms": round(max(times) * 1e3, 1)}
            out[f"{placement}/{per}"] = row
            print(f"flows per switch, {placement}, {per} nodes per service: {row}", flush=True)
            if all_nodes:
                main_w, main_counts = w, dict(zip(names, counts))
                out["main"] = {"placement": placement, "per_service": per, **row}
    every = sum(len(to_masks(Range(r.lo, r.hi))) for rs in main_w.owned.values() for r in rs)
    out["every_range_everywhere"] = every
    out["ratio_every_to_two_level"] = round(every / out["main"]["flows_max"], 1)
    out["ranges_total"] = main_w.total_ranges
    return out, main_w, main_counts


def whole_node(args, w: model.Workload) -> dict:
    """The route agent's whole-switch compiler (``fabric/nodecompile.py``: local ports, port security, front
    doors, host MACs elsewhere, tunnels, and the routes) on the same records: a restart's compile (cold) and
    the next one (warm: the parse cache and the previous compile's memory), and what the switch holds."""
    items = {k: v.encode() for k, v in records(w).items()}
    out = {}
    for j in range(1, args.compile_nodes + 1):
        me, cache = model.node_name(j), {}
        ports = model.tunnel_ports(w.nodes, me)
        t0 = time.perf_counter()
        cold = compile_node(items, me, 1, tunnel_ports=ports, cache=cache)
        t1 = time.perf_counter()
        warm = compile_node(items, me, 2, cold.memory, tunnel_ports=ports, cache=cache)
        t2 = time.perf_counter()
        if warm.error:
            raise RuntimeError(f"nodecompile failed on {me}: {warm.error}")
        kinds = collections.Counter(Kind(split_cookie(f.cookie)[0]).name.lower() for f in warm.config.flows.values())
        out[me] = {"cold_ms": round((t1 - t0) * 1e3, 1), "warm_ms": round((t2 - t1) * 1e3, 1),
                   "flows": len(warm.config.flows), "by_kind": dict(kinds.most_common()),
                   "per_change": per_change(args, w, dict(items), me, warm, cache)}
        print(f"nodecompile {me}: {out[me]}", flush=True)
    return out


def per_change(args, w: model.Workload, items: dict[str, bytes], me: str, warm, cache: dict) -> dict:
    """``--route-changes`` range moves, each compiled for node ``me`` twice side by side: whole (what the route
    agent did per change before) and incremental (``changed``: the moved range's key); CPU time of each, and
    how many gave other flows or waits than the whole compile (must be 0)."""
    rnd = random.Random(args.seed + 3)
    ports = model.tunnel_ports(w.nodes, me)
    whole = inc = warm
    t_whole, t_inc, mismatches = [], [], 0
    for revision in range(3, 3 + args.route_changes):
        sid, index, to = model.pick_change(w, rnd)
        w = model.move(w, sid, index, to)
        r = w.owned[sid][index]
        key = schema.range_key(f"s{sid}", r.lo)
        items[key] = range_record(w, sid, r).to_json().encode()
        t0 = time.process_time()
        whole = compile_node(items, me, revision, whole.memory, tunnel_ports=ports, cache=cache)
        t1 = time.process_time()
        inc = compile_node(items, me, revision, inc.memory, tunnel_ports=ports, cache=cache, changed={key})
        t2 = time.process_time()
        t_whole.append(t1 - t0)
        t_inc.append(t2 - t1)
        mismatches += whole.config.flows != inc.config.flows or whole.waiting != inc.waiting
    res = {"whole_cpu": summary(t_whole), "incremental_cpu": summary(t_inc), "mismatches": mismatches}
    if t_inc:
        res["ratio_median"] = round(res["whole_cpu"]["median_ms"] / max(1e-3, res["incremental_cpu"]["median_ms"]), 1)
    return res


# -- 2. the real part --------------------------------------------------------------------------------
def write_records(reg: Registry, recs: dict[str, str]) -> float:
    keys = list(recs)
    t0 = time.monotonic()
    for i in range(0, len(keys), TXN_OPS):
        ok, _ = reg.txn([], {k: recs[k] for k in keys[i:i + TXN_OPS]})
        if not ok:
            raise RuntimeError(f"etcd refused batch {i // TXN_OPS} of the workload's records")
    return time.monotonic() - t0


def start_switches(n: int, work: str, sup: Supervisor) -> tuple[list[OvsInstance], list[float]]:
    switches, took = [], []
    for i in range(1, n + 1):
        t0 = time.monotonic()
        inst = OvsInstance(f"vfsc{i}", None, os.path.join(work, f"ovs{i}"), sup, sandbox=True)
        switches.append(inst)
        inst.start()
        inst.vsctl("add-br", f"{BRIDGE}{i}", "--", "set", "bridge", f"{BRIDGE}{i}", "protocols=OpenFlow14",
                   "fail-mode=secure", f"other-config:datapath-id={i:016x}")
        mgmt = os.path.join(inst.rundir, f"{BRIDGE}{i}.mgmt")
        wait_for(lambda: os.path.exists(mgmt), 10, f"{inst.name}'s management socket")
        took.append(time.monotonic() - t0)
    return switches, took


def switch_usage(switches: list[OvsInstance]) -> tuple[float, int]:
    cpu, rss = 0.0, 0
    for inst in switches:
        for p in inst.procs:
            c, r = proc_usage(p.pid)
            cpu, rss = cpu + c, rss + r
    return cpu, rss


def run_changes(args, w: model.Workload, agents: list[Agent], reg: Registry) -> tuple[dict, model.Workload]:
    rnd = random.Random(args.seed)
    emulated = {a.view.me: a for a in agents}
    latency, per_switch, delivery_first, delivery_last, cost = [], [], [], [], []
    needed_model, mismatches = [], []
    for _ in range(args.changes):
        sid, index, to = model.pick_change(w, rnd)
        after = model.move(w, sid, index, to)
        need = model.needed(w, after, sid)
        r = after.owned[sid][index]
        t0 = time.monotonic()
        rev = reg.put(schema.range_key(f"s{sid}", r.lo), range_record(after, sid, r).to_json())
        wait_for(lambda: all(a.seen >= rev or a.error for a in agents), 30, f"every agent to apply revision {rev}",
                 interval=0.001)
        errors = [f"{a.view.me}: {a.error}" for a in agents if a.error]
        if errors:
            raise RuntimeError("agents failed: " + "; ".join(errors))
        rows = {a.view.me: next(d for d in reversed(a.done) if d[0] == rev) for a in agents}
        did = {me for me, d in rows.items() if d[3] > 0}
        want = {me for me in need if me in emulated}
        if did != want:
            mismatches.append({"service": sid, "range": index, "agents": sorted(did), "model": sorted(want)})
        needed_model.append(len(need))
        if did:
            latency.append(max(rows[me][2] for me in did) - t0)
            per_switch += [rows[me][2] - t0 for me in did]
        got = [d[1] - t0 for d in rows.values()]
        delivery_first.append(min(got))
        delivery_last.append(max(got))
        cost += [(d[4], rows[me][5]) for me, d in rows.items() if me in did]
        w = after
    res = {"changes": args.changes, "switches_emulated": len(agents),
           "switches_needing_it_model": summary_counts(needed_model),
           "commit_on_all_needing_ms": summary(latency), "commit_per_switch_ms": summary(per_switch),
           "etcd_delivery_first_ms": summary(delivery_first), "etcd_delivery_last_ms": summary(delivery_last),
           "agent_cpu_ms": summary([c for c, _ in cost]), "agent_bundle_wall_ms": summary([b for _, b in cost]),
           "mismatches": mismatches}
    res["agent_cost"] = cost
    res["delivery_first"] = delivery_first
    return res, w


def the_model(args, change: dict, solo: list[float]) -> dict:
    """Per host: etcd's delivery to one watcher, that agent's own CPU (its thread's), and a bundle's round trip
    on a switch that has the machine to itself; the fabric's: the slowest of N hosts."""
    cost, first = change.pop("agent_cost"), change.pop("delivery_first")
    if not cost or not solo:
        return {}
    samples = [first[i % len(first)] + c + solo[i % len(solo)] for i, (c, _b) in enumerate(cost)]
    return {f"{n}_nodes": model.fabric_latency(samples, n) for n in (args.nodes, 1000)}


def solo_bundles(args, w: model.Workload, chan: SockDatapath) -> list[float]:
    """One switch's bundle round trip for a range move's plan while nothing else runs (the agents are not
    started yet): a move and its undo, alternately, on node 1's switch (left as it was)."""
    rnd = random.Random(args.seed + 1)
    took = []
    for _ in range(args.solo):
        sid, index, to = model.pick_change(w, rnd)
        before = {f.key: f for f in model.service_flows(w, sid, "n1")}
        after = {f.key: f for f in model.service_flows(model.move(w, sid, index, to), sid, "n1")}
        for want, have in ((after, before), (before, after)):
            plan = diff(SwitchConfig(1, want), have, {}, by_cookie=False)
            if not plan:
                continue
            t0 = time.monotonic()
            chan.conn.commit(plan)
            took.append(time.monotonic() - t0)
    return took


def summary_counts(xs: list[int]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "min": s[0], "median": s[len(s) // 2], "max": s[-1]}


def run_restarts(args, agents: list[Agent], channels: list[SockDatapath], work_dpid, endpoint: str) -> list[dict]:
    out = []
    picks = sorted({0, len(agents) // 2, len(agents) - 1})[:args.restarts]
    for n, i in enumerate(picks):
        agent = agents[i]
        me = agent.view.me
        agent.stop()
        channels[i].close()
        chan = channels[i] = SockDatapath(work_dpid(i), i + 1)
        if n == 0:   # the switch lost its table too (a host rebooted): the agent installs everything
            flows, _ = chan.conn.dump()
            chan.conn.commit(diff(SwitchConfig(i + 1), flows, {}))
        t, view, flows, revision = full_reconcile(me, chan.conn, endpoint, tunnel_ports(args.nodes))
        t["node"], t["switch_emptied_first"] = me, n == 0
        t = {k: round(v * 1e3, 1) if k.endswith("_s") else v for k, v in t.items()}
        t = {(k[:-2] + "_ms" if k.endswith("_s") else k): v for k, v in t.items()}
        out.append(t)
        print(f"restart of {me}'s agent: {t}", flush=True)
        agents[i] = Agent(view, chan.conn, endpoint, flows)
        agents[i].start(revision)
    return out


def real(args, w: model.Workload, expect: dict[str, int]) -> dict:
    res: dict = {}
    work = tempfile.mkdtemp(prefix="vfab-scale-")
    sup = Supervisor(os.path.join(work, "logs"))
    etcd = LocalEtcd(os.path.join(work, "etcd"), history="0")
    switches: list[OvsInstance] = []
    agents: list[Agent] = []
    channels: list[SockDatapath] = []
    acquire_lock()
    try:
        etcd.start()
        endpoint = etcd.endpoint
        reg = Registry(endpoint)
        recs = records(w)
        res["etcd_records"] = len(recs)
        res["etcd_write_s"] = round(write_records(reg, recs), 2)
        print(f"etcd: {len(recs)} records written in {res['etcd_write_s']} s", flush=True)
        e_cpu0, e_rss0 = proc_usage(etcd.pid)
        t0 = time.monotonic()
        switches, took = start_switches(args.switches, work, sup)
        res["switch_start_s"] = {"total": round(time.monotonic() - t0, 2), **summary(took)}
        c0, _ = switch_usage(switches)
        time.sleep(args.idle)
        c1, rss = switch_usage(switches)
        res["switches_idle"] = {"cpu_percent_all": round((c1 - c0) / args.idle * 100, 1),
                                "rss_mib_all": round(rss / 1024, 1), "rss_mib_each": round(rss / 1024 / len(switches), 1)}
        print(f"{len(switches)} sandboxes up: {res['switch_start_s']}, idle {res['switches_idle']}", flush=True)
        t0 = time.monotonic()
        revision, raw = reg.get_prefix(schema.ROOT)
        t1 = time.monotonic()
        shared = Shared.load({k: v for k, (v, _m) in raw.items()}, revision, tunnel_ports(args.nodes))
        res["first_read"] = {"etcd_get_s": round(t1 - t0, 3), "parse_s": round(time.monotonic() - t1, 3)}
        del raw
        installs, counts = [], {}
        for i, inst in enumerate(switches):
            me = model.node_name(i + 1)
            chan = SockDatapath(os.path.join(inst.rundir, f"{BRIDGE}{i + 1}.mgmt"), i + 1)
            channels.append(chan)
            view = RouteView(me, shared)
            t0 = time.monotonic()
            want = view.all_flows()
            chan.conn.commit(diff(SwitchConfig(i + 1, want.flows), {}, {}))
            installs.append(time.monotonic() - t0)
            counts[me] = len(want.flows)
            agents.append(Agent(view, chan.conn, endpoint, want.flows))
        res["first_install_ms"] = summary(installs)
        solo = solo_bundles(args, w, channels[0])
        res["bundle_alone_ms"] = summary(solo)
        for a in agents:
            a.start(revision)
        bad = {me: (n, expect[me]) for me, n in counts.items() if n != expect[me]}
        if bad:
            raise RuntimeError(f"agents compiled other flow counts from etcd than the model: {bad}")
        # The 64 agents' views, flows and the shared records are one heap here (~600 MiB): a full collection
        # over it took 300 ms of one agent's thread (run 2), a pause an agent holding one view would not
        # see. Frozen, collections scan only what the changes make.
        gc.collect()
        gc.freeze()
        s_cpu0, _ = switch_usage(switches)
        b_cpu0, _ = self_usage()
        e_cpu1, _ = proc_usage(etcd.pid)
        t0 = time.monotonic()
        res["change"], w = run_changes(args, w, agents, reg)
        res["model"] = the_model(args, res["change"], solo)
        span = time.monotonic() - t0
        e_cpu2, e_rss = proc_usage(etcd.pid)
        b_cpu1, b_rss = self_usage()
        s_cpu1, _ = switch_usage(switches)
        res["cpu_during_changes"] = {"seconds": round(span, 2), "etcd_cpu_s": round(e_cpu2 - e_cpu1, 2),
                                     "agents_cpu_s": round(b_cpu1 - b_cpu0, 2),
                                     "switches_cpu_s": round(s_cpu1 - s_cpu0, 2)}
        print(f"changes: {res['change']}", flush=True)
        res["restart"] = run_restarts(args, agents, channels,
                                      lambda i: os.path.join(switches[i].rundir, f"{BRIDGE}{i + 1}.mgmt"), endpoint)
        read_back = {}
        for i in sorted({0, len(channels) - 1}):
            flows, _ = channels[i].conn.dump()
            read_back[model.node_name(i + 1)] = len(flows)
        want_now = {me: len(model.node_flows(w, me)) for me in read_back}
        res["flows_on_switches"] = {"read": read_back, "model": want_now}
        if read_back != want_now:
            raise RuntimeError(f"switches hold other flow counts than the model says: {read_back} vs {want_now}")
        if args.route_agents:
            res["route_agents"] = route_agents(args, w, switches, agents, channels, endpoint, reg, sup)
        b_cpu, b_rss = self_usage()
        res["etcd"] = {"cpu_s_loading": round(e_cpu0, 2), "rss_mib_loaded": round(e_rss0 / 1024, 1),
                       "rss_mib_end": round(e_rss / 1024, 1), "db_mib": round(etcd_db_bytes(etcd) / 2**20, 1)}
        res["bench_process"] = {"cpu_s_total": round(b_cpu, 1), "rss_mib": round(b_rss / 1024, 1)}
        return res
    finally:
        for a in agents:
            a.signal_stop()
        for a in agents:
            a.stop()
        for c in channels:
            c.close()
        for inst in switches:
            inst.stop()
        sup.stop_all()
        etcd.stop()
        release_lock()
        shutil.rmtree(work, ignore_errors=True)


def route_agents(args, w: model.Workload, switches: list[OvsInstance], agents: list[Agent],
                 channels: list[SockDatapath], endpoint: str, reg: Registry, sup: Supervisor) -> dict:
    """The route agent as a process (``python -m vfab.controller --node``, issue 45's control plane: os-ken,
    ``fabric/nodecompile.py``, an election per node, applied reports) on the first ``--route-agents``
    switches, in place of the bench's agents there: its start (a restarted agent: read, compile, reconcile,
    report) and ``--route-changes`` range moves, each timed from the etcd write until every one of them
    reported the revision applied (``applied/``; by default right after its bundle: ``--no-datapath-wait``,
    since a sandbox's datapath forwards nothing and revalidates on a 500 ms timer).  ``--route-compare``:
    first the same with agents that compile their whole switch on every change (``--node-whole-compile``,
    the agent before the incremental compile), then the incremental ones, and their ratios."""
    k = args.route_agents
    for i in range(k):
        agents[i].signal_stop()
    ports = []
    for i in range(k):
        agents[i].stop()
        channels[i].close()
        inst = switches[i]
        tports = []
        for j in range(1, w.nodes + 1):   # a tunnel port per other node, named as the node agent names them
            if j != i + 1:
                name = tunnels.port_name(tunnel_ip(j))
                tports += ["--", "add-port", f"{BRIDGE}{i + 1}", name, "--", "set", "interface", name,
                           f"ofport_request={model.TUNNEL_BASE + j}"]
        inst.vsctl(*tports)
        ports.append(free_port())
        inst.vsctl("set-controller", f"{BRIDGE}{i + 1}", f"tcp:127.0.0.1:{ports[i]}")
    modes = ("whole", "incremental") if args.route_compare else ("incremental",)
    out: dict = {"agents": k, "datapath_wait": args.route_datapath_wait}
    for mode in modes:
        out[mode], w = route_pass(args, w, switches, endpoint, reg, sup, ports, whole=mode == "whole")
    if args.route_compare:
        whole, inc = out["whole"], out["incremental"]
        out["ratio_whole_over_incremental"] = {
            "change_applied_on_all_median": round(whole["change_applied_on_all_ms"]["median_ms"]
                                                  / max(1e-3, inc["change_applied_on_all_ms"]["median_ms"]), 1),
            # None: the incremental agents' CPU stayed below the clock tick (10 ms per process) over the changes
            "agent_cpu_per_change": round(whole["agent_cpu_s_per_change"] / inc["agent_cpu_s_per_change"], 1)
            if inc["agent_cpu_s_per_change"] else None}
        print(f"route agents, whole / incremental: {out['ratio_whole_over_incremental']}", flush=True)
    return out


def route_pass(args, w: model.Workload, switches: list[OvsInstance], endpoint: str, reg: Registry,
               sup: Supervisor, ports: list[int], whole: bool) -> tuple[dict, model.Workload]:
    """One set of route agents (``whole``: compiling the whole switch per change) started, timed, stopped."""
    k = args.route_agents
    procs, out = [], {"mode": "whole" if whole else "incremental"}
    for i in range(k):   # the last pass's reports go: this pass's start is timed to its own reports
        reg.delete(schema.applied_key(i + 1))
    revision = reg.state_revision()
    for i in range(k):
        inst, me = switches[i], model.node_name(i + 1)
        procs.append(sup.start(f"route-{me}-{out['mode']}", [
            sys.executable, "-m", "vfab.controller", "--etcd", endpoint, "--node", me, "--listen", "127.0.0.1",
            "--port", str(ports[i]), "--ovs-rundir", inst.rundir,
            *([] if args.route_datapath_wait else ["--no-datapath-wait"]),
            *(["--node-whole-compile"] if whole else [])]))
    dpids = list(range(1, k + 1))
    t0 = time.monotonic()
    reg.wait_applied(revision, timeout=args.route_timeout, dpids=dpids)
    out["start_to_applied_s"] = round(time.monotonic() - t0, 2)
    print(f"{k} route agents ({out['mode']}) up and applied in {out['start_to_applied_s']} s", flush=True)
    rnd = random.Random(args.seed + 2 + whole)
    took, cpu0 = [], sum(proc_usage(p.pid)[0] for p in procs)
    for _ in range(args.route_changes):
        sid, index, to = model.pick_change(w, rnd)
        w = model.move(w, sid, index, to)
        r = w.owned[sid][index]
        t1 = time.monotonic()
        rev = reg.put(schema.range_key(f"s{sid}", r.lo), range_record(w, sid, r).to_json())
        reg.wait_applied(rev, timeout=args.route_timeout, dpids=dpids)
        took.append(time.monotonic() - t1)
    usage = [proc_usage(p.pid) for p in procs]
    out["change_applied_on_all_ms"] = summary(took)
    out["agent_cpu_s_per_change"] = round((sum(c for c, _ in usage) - cpu0) / max(1, args.route_changes) / k, 4)
    out["agent_rss_mib"] = round(max(r for _, r in usage) / 1024, 1)
    out["flows"], out["differ_from_a_whole_compile"] = {}, {}
    # The nodes without an agent here report every move applied (their agents would): the agents release the
    # moves they held for them, and a whole compile without memory is then what each switch must hold.
    head = reg.state_revision()
    ok, _ = reg.txn([], {schema.applied_key(j): schema.Applied(dpid=j, revision=head, flows=0).to_json()
                         for j in range(k + 1, w.nodes + 1)})
    if not ok:
        raise RuntimeError("etcd refused the other nodes' applied reports")
    sid = next(iter(w.owned))   # a range written again unchanged: a round on every agent after those reports
    rev = reg.put(schema.range_key(f"s{sid}", w.owned[sid][0].lo), range_record(w, sid, w.owned[sid][0]).to_json())
    reg.wait_applied(rev, timeout=args.route_timeout, dpids=dpids)
    _, raw = reg.get_prefix(schema.ROOT)
    items = {key: value for key, (value, _mod) in raw.items()}
    for i in range(k):
        me = model.node_name(i + 1)
        chan = SockDatapath(os.path.join(switches[i].rundir, f"{BRIDGE}{i + 1}.mgmt"), i + 1)
        flows, groups = chan.conn.dump()
        chan.close()
        out["flows"][me] = len(flows)
        want = compile_node(items, me, 0, tunnel_ports=model.tunnel_ports(w.nodes, me)).config
        plan = diff(want, flows, groups)   # what a whole compile would still change on the switch
        out["differ_from_a_whole_compile"][me] = plan.summary() if plan else ""
    print(f"route agents ({out['mode']}): {out}", flush=True)
    for p in procs:
        sup.stop(p)
    return out, w


def capacity(args, w: model.Workload) -> dict:
    """How many sandboxes this machine holds: ``--capacity`` of them started, each given node 1's table
    (~6,000 flows) in one bundle, then their resident memory and idle CPU; no etcd, no agents."""
    work = tempfile.mkdtemp(prefix="vfab-scale-cap-")
    sup = Supervisor(os.path.join(work, "logs"))
    switches: list[OvsInstance] = []
    table = SwitchConfig(0, {f.key: f for f in model.node_flows(w, "n1")})
    acquire_lock()
    try:
        t0 = time.monotonic()
        switches, took = start_switches(args.capacity, work, sup)
        started = time.monotonic() - t0
        for i, inst in enumerate(switches):
            chan = SockDatapath(os.path.join(inst.rundir, f"{BRIDGE}{i + 1}.mgmt"), i + 1)
            chan.conn.commit(diff(SwitchConfig(i + 1, table.flows), {}, {}))
            chan.close()
        c0, _ = switch_usage(switches)
        time.sleep(args.idle)
        c1, rss = switch_usage(switches)
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
        out = {"sandboxes": len(switches), "flows_each": len(table.flows), "start_s": round(started, 1),
               "start_each_ms": summary(took), "rss_mib_all": round(rss / 1024, 1),
               "rss_mib_each": round(rss / 1024 / len(switches), 1),
               "idle_cpu_percent_all": round((c1 - c0) / args.idle * 100, 1),
               "machine_mem_available_mib": round(avail / 1024)}
        print(f"capacity: {out}", flush=True)
        return out
    finally:
        for inst in switches:
            inst.stop()
        sup.stop_all()
        release_lock()
        shutil.rmtree(work, ignore_errors=True)


def etcd_db_bytes(etcd: LocalEtcd) -> int:
    total = 0
    for root, _dirs, files in os.walk(etcd.data_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f == "db")
    return total


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--switches", type=int, default=64, help="OVS sandboxes to run here (one agent each)")
    ap.add_argument("--nodes", type=int, default=64, help="nodes of the fabric (the model compiles all of them)")
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--ranges", type=int, default=100, help="ranges per service")
    ap.add_argument("--per-service", type=int, default=4, help="nodes each service's ranges are spread over")
    ap.add_argument("--changes", type=int, default=100, help="range moves to time")
    ap.add_argument("--restarts", type=int, default=3, help="agents to restart (at most 3)")
    ap.add_argument("--sample", type=int, default=8, help="nodes compiled for the other placements' rows")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds the idle switches' CPU is read over")
    ap.add_argument("--solo", type=int, default=20, help="range moves timed on one switch alone, for the model")
    ap.add_argument("--compile-nodes", type=int, default=2, help="nodes compiled whole by nodecompile (cold, warm)")
    ap.add_argument("--route-agents", type=int, default=4, help="switches given a route agent process (0: none)")
    ap.add_argument("--route-compare", action="store_true",
                    help="time route agents that compile their whole switch per change first, then the "
                         "incremental ones (ratios in the results)")
    ap.add_argument("--route-changes", type=int, default=10, help="range moves timed with the route agents")
    ap.add_argument("--route-datapath-wait", action="store_true",
                    help="let the route agents report after a revalidation pass (a sandbox's dummy datapath runs one "
                         "every 500 ms: that timer, not the control plane, is then measured)")
    ap.add_argument("--route-timeout", type=float, default=120.0, help="s to wait for the route agents' reports")
    ap.add_argument("--capacity", type=int, default=0,
                    help="only start this many sandboxes with a node's table each and read their memory and idle CPU")
    ap.add_argument("--seed", type=int, default=45)
    args = ap.parse_args()
    if args.smoke:
        args.switches, args.nodes, args.services, args.changes = 3, 8, 20, 6
        args.restarts, args.sample, args.idle, args.solo, args.compile_nodes = 1, 4, 0.5, 3, 1
        args.route_agents, args.route_changes, args.route_compare = 1, 3, True
    if not 1 <= args.switches <= args.nodes:
        ap.error(f"--switches {args.switches}: give 1..{args.nodes} (the fabric's nodes, --nodes)")
    if not 0 <= args.route_agents <= args.switches:
        ap.error(f"--route-agents {args.route_agents}: give 0..{args.switches} (the switches run here)")
    if args.per_service < 2:
        ap.error("--per-service must be at least 2: a range change moves a range between its service's nodes")
    args.per_service_list = sorted({1, 2, args.per_service})
    if not_root("scale", "the testbed lock in /run"):
        return 2
    params = {k: v for k, v in vars(args).items() if k not in ("out", "per_service_list")}
    if args.capacity:
        w = model.Workload(args.services, args.ranges, args.nodes, per_service=args.per_service)
        write("scale-capacity", params, capacity(args, w), args.out)
        return 0
    flows, w, expect = flows_per_switch(args)
    results = {"flows_per_switch": flows, "nodecompile": whole_node(args, w), "real": real(args, w, expect)}
    write("scale", params, results, args.out)
    compiled_apart = sum(n["per_change"]["mismatches"] for n in results["nodecompile"].values())
    compiled_apart += sum(bool(d) for mode in ("whole", "incremental")
                          for d in results["real"].get("route_agents", {}).get(mode, {})
                          .get("differ_from_a_whole_compile", {}).values())
    return 1 if results["real"]["change"]["mismatches"] or compiled_apart else 0


if __name__ == "__main__":
    sys.exit(main())
