"""What ``vfab top`` shows: one frame of a fabric, built from one read of etcd (pure; no terminal here).

:func:`frame` takes every key under ``/vfab/v1/`` with its mod revision (``Registry.get_prefix``'s answer)
and the wall clock, and returns the lines to print: switches (the revision each holds against the newest that
changed what the controller compiles, flows, groups) and fabric nodes; per service its ranges (owner, mirrors,
helpers, records and requests/s from the endpoints' load reports); running state operations with a progress
bar; helpers with S, T and keys per batch; the balancer's latest decisions.  Records it cannot parse are
skipped (one bad record must not hide the others).
"""

from __future__ import annotations

import time
from collections import defaultdict

from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema

BAR = 24          # characters of a progress bar
DECISIONS = 5     # latest balancer decisions shown per service
OP_SHOWN = 10.0   # s a finished operation stays on screen


def bar(done: int, total: int, width: int = BAR) -> str:
    """``[#####.....]  50%`` for done of total (an empty total reads as 0 %)."""
    frac = min(1.0, done / total) if total > 0 else 0.0
    full = int(round(frac * width))
    return f"[{'#' * full}{'.' * (width - full)}] {frac * 100:3.0f}%"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate / 1000:.1f}k" if rate >= 10000 else f"{rate:.0f}"


def _parse(items: dict[str, tuple[bytes, int]]) -> dict:
    """Records by folder: {folder: [(parts, record, mod revision)]}, skipping what does not parse."""
    types = {"services": schema.Service, "endpoints": schema.Endpoint, "ranges": schema.RangeRec,
             "switches": schema.Switch, "applied": schema.Applied, "ops": schema.OpRec, "load": schema.Load,
             "balancer": schema.BalancerStatus, "helpers": schema.HelperStatus, "nodes": schema.Node,
             "metrics": schema.MetricsTarget}
    out: dict[str, list] = defaultdict(list)
    for key, (raw, mod) in items.items():
        parsed = schema.parse_key(key)
        if parsed is None or parsed[0] not in types:
            continue
        try:
            out[parsed[0]].append((parsed[1], types[parsed[0]].from_json(raw, key), mod))
        except RegistryError:
            continue
    return out


def frame(items: dict[str, tuple[bytes, int]], revision: int, now: float | None = None,
          where: str = "") -> list[str]:
    now = time.time() if now is None else now
    recs = _parse(items)
    state_rev = max((mod for k, (_, mod) in items.items()
                     if (p := schema.parse_key(k)) is not None and p[0] not in schema.PASSIVE), default=0)
    lines = [f"vfab top  {time.strftime('%H:%M:%S', time.localtime(now))}  etcd {where} revision {revision}  "
             f"(state revision {state_rev})   q: quit"]
    lines += _switches(recs, state_rev, now)
    lines += _services(recs)
    lines += _ops(recs, now)
    lines += _helpers(recs, now)
    lines += _balancer(recs, now)
    targets = recs.get("metrics", [])
    kinds = defaultdict(int)
    for _, t, _ in targets:
        kinds[t.process] += 1
    lines.append("")
    lines.append("METRICS  " + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "no exporter registered")
                 + "  ('vfab metrics targets')")
    return lines


def _switches(recs: dict, state_rev: int, now: float) -> list[str]:
    applied = {a.dpid: a for _, a, _ in recs.get("applied", [])}
    switches = sorted((s for _, s, _ in recs.get("switches", [])), key=lambda s: s.dpid)
    out = ["", "SWITCHES"]
    if not switches:
        out.append("  none registered")
    for s in switches:
        a = applied.get(s.dpid)
        if a is None:
            out.append(f"  {s.dpid:016x} {s.name:<12} not applied yet (is the controller running?)")
            continue
        behind = "" if a.revision >= state_rev else f"  BEHIND by {state_rev - a.revision} revision(s)"
        path = "datapath" if a.datapath else "tables"
        out.append(f"  {s.dpid:016x} {s.name:<12} revision {a.revision:<7} flows {a.flows:<6} groups {a.groups:<4} "
                   f"{path} {now - a.at:5.1f} s ago{behind}")
    nodes = sorted((n for _, n, _ in recs.get("nodes", [])), key=lambda n: n.name)
    if nodes:
        out.append("NODES")
        for n in nodes:
            out.append(f"  {n.name:<14} {n.tunnel_ip:<15} dpid {n.dpid:016x} {n.encap} peers "
                       f"{', '.join(n.peers) or '-'}  agent {n.agent or '?'}")
    return out


def _services(recs: dict) -> list[str]:
    live = defaultdict(set)
    for parts, e, _ in recs.get("endpoints", []):
        live[e.service].add(e.name)
    loads: dict[tuple[str, str, int], tuple[int, float]] = {}
    for parts, ld, _ in recs.get("load", []):
        if len(parts) != 2:
            continue
        service, ep = parts
        for row in ld.ranges:
            if len(row) >= 4:
                loads[(service, ep, int(row[0]))] = (int(row[2]), float(row[3]))
    ranges = defaultdict(list)
    for parts, r, _ in recs.get("ranges", []):
        if parts:
            ranges[parts[0]].append(r)
    out = ["", "SERVICES"]
    services = sorted((s for _, s, _ in recs.get("services", [])), key=lambda s: s.id)
    if not services:
        out.append("  none")
    for svc in services:
        eps = sorted(live[svc.name])
        total = sum(loads.get((svc.name, r.owner, r.lo), (0, 0.0))[1] for r in ranges[svc.name])
        out.append(f"  {svc.name} ({svc.kind or 'no kind'}, id {svc.id})  endpoints: {', '.join(eps) or 'none'}  "
                   f"{fmt_rate(total)} req/s")
        out.append(f"    {'range':<15} {'owner':<14} {'mirrors':<16} {'helpers':<16} {'records':>8} {'req/s':>7}  state")
        for r in sorted(ranges[svc.name], key=lambda r: r.lo):
            got = loads.get((svc.name, r.owner, r.lo))
            owner = r.owner or "-"
            if r.owner and r.owner not in live[svc.name]:
                owner += " (down)"
            mirrors = ",".join(m + ("" if m in live[svc.name] else "(down)") for m in r.mirrors) or "-"
            out.append(f"    {r.lo:06x}-{r.hi:06x}  {owner:<14} {mirrors:<16} {','.join(r.helpers) or '-':<16} "
                       f"{got[0] if got else '-':>8} {fmt_rate(got[1]) if got else '-':>7}  {r.state}")
    return out


def _ops(recs: dict, now: float) -> list[str]:
    out = ["", "OPERATIONS"]
    shown = 0
    for parts, o, _ in sorted(recs.get("ops", []), key=lambda x: x[1].started):
        if o.finished and now - o.updated > OP_SHOWN:
            continue
        shown += 1
        rngs = ",".join(f"{lo:06x}-{hi:06x}" for lo, hi in o.ranges)
        took = (o.updated if o.finished else now) - o.started
        tail = f"{o.phase}" + (f": {o.error}" if o.error else "")
        out.append(f"  {parts[0] if parts else '?'} {o.op} {o.source} -> {o.peer} {rngs}  {bar(o.done, o.total)} "
                   f"{o.done}/{o.total} records  {tail}  {took:.1f} s")
    if not shown:
        out.append("  none running")
    return out


def _helpers(recs: dict, now: float) -> list[str]:
    rows = sorted(recs.get("helpers", []), key=lambda x: x[0])
    if not rows:
        return []
    out = ["", "HELPERS"]
    for parts, h, _ in rows:
        st = h.stats
        cmds = st.get("b_cmds", 0)
        per = f"{st.get('b_keys', 0) / cmds:.1f}" if cmds else "-"
        state = f"DOWN: {h.down}" if h.down else "serving"
        out.append(f"  {'/'.join(parts):<24} S {st.get('batch_S_bytes', 0)} B  T {st.get('batch_T_ns', 0) / 1e3:.0f} "
                   f"us  batches {cmds}  keys/batch {per}  {state}")
    return out


def _balancer(recs: dict, now: float) -> list[str]:
    rows = sorted(recs.get("balancer", []), key=lambda x: x[0])
    if not rows:
        return []
    out = ["", "BALANCER"]
    for parts, b, _ in rows:
        age = now - b.at
        out.append(f"  {parts[0] if parts else '?'}: {b.runner or '?'}, last round {age:.1f} s ago"
                   + ("  (stopped?)" if age > 30 else ""))
        for d in b.decisions[-DECISIONS:]:
            rngs = ",".join(f"{lo:06x}-{hi:06x}" for lo, hi in d.get("ranges", []))
            to = d.get("peer") or ",".join(d.get("helpers", []))
            at = time.strftime("%H:%M:%S", time.localtime(d.get("at", 0)))
            out.append(f"    {at} {d.get('action', '?'):<11} {rngs} {('-> ' + to) if to else ''}  "
                       f"{d.get('result', '')}  ({d.get('reason', '')})")
        for p in b.problems[:3]:
            out.append(f"    problem: {p}")
    return out
