"""``vfab sdhcp status SERVICE``: each shard's ranges, pool use, leases, counters and rates.
``vfab sdhcp rekey SERVICE``: switch the service's front door to another key function (``vfab.vid.mackey``).

Asks every live shard of the service for its STATS over its control socket
(the same socket 'vfab split' talks to), so the numbers are the shard's own,
read at once.  Rates come from two places:

* **req/s**: the shard's load report in etcd (requests per second it served
  in its ranges over the last second: what the balancer splits and merges on);
* **offers/acks/naks per s** and **dropped/s**: the difference of two STATS
  answers ``--interval`` seconds apart (0 skips them and answers at once).

A shard that stopped answering (killed, stalled) is listed with the error;
owners that are gone from etcd show as ``(down)`` in ``vfab ranges``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import click

from vfab.cli.cmd_state import load_by_range
from vfab.cli.common import NameType, errors, pass_ctx, table
from vfab.vid import mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import StateError
from vfab.vid.registry import schema
from vfab.vid.state import ctl

DROPS = ("malformed", "wrong_op", "bad_chaddr", "wrong_type", "spoofed", "relayed_dropped", "bad_frames")
RATED = ("offers", "acks", "naks")
WARN_FREE = 0.1    # warn when a shard's free addresses are at most this share of its slice ...
WARN_MIN = 16      # ... or this many


@click.group("sdhcp")
def sdhcp() -> None:
    """Inspect an sdhcp (DHCP) service: shards, pool use, leases, rates."""


def _ask(reg, service: str, shard: str) -> dict:
    body = ctl.command(reg, service, shard, "STATS", {}, timeout=3.0).body
    return {**(body.get("sdhcp") or {}), "loop": body.get("counters", {})}


def dropped(counters: dict) -> int:
    return sum(counters.get(d, 0) for d in DROPS)


def shard_stats(reg, service: str, interval: float = 0.0) -> list[dict]:
    """One entry per live shard: name, owned and mirrored ranges, its STATS (or the error asking it),
    ``req_s`` from its load report, and with ``interval`` > 0 ``rates`` (per second over that interval)."""
    ranges = reg.ranges(service)
    loads = load_by_range(reg, service)
    out = []
    for ep in sorted(reg.endpoints(service), key=lambda e: e.name):
        if not ep.ctl:
            continue
        mine = [r for r, _ in ranges if r.owner == ep.name]
        entry: dict = {"shard": ep.name, "owns": [f"{r.lo:#08x}-{r.hi:#08x}" for r in mine],
                       "mirrors": [f"{r.lo:#08x}-{r.hi:#08x}" for r, _ in ranges if ep.name in r.mirrors]}
        reported = [loads[(ep.name, r.lo)][1] for r in mine if (ep.name, r.lo) in loads]
        entry["req_s"] = round(sum(reported), 1) if reported else None
        try:
            entry.update(_ask(reg, service, ep.name))
            entry["_t"] = time.monotonic()
        except StateError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    if interval > 0 and any("error" not in e for e in out):
        time.sleep(interval)
        for e in out:
            if "error" in e:
                continue
            try:
                now = _ask(reg, service, e["shard"])
            except StateError as exc:
                e["error"] = f"second STATS: {exc}"
                continue
            dt = time.monotonic() - e["_t"]
            was, new = e.get("counters", {}), now.get("counters", {})
            e["rates"] = {k: round((new.get(k, 0) - was.get(k, 0)) / dt, 1) for k in RATED}
            e["rates"]["dropped"] = round((dropped(new) - dropped(was)) / dt, 1)
            e.update({k: v for k, v in now.items() if k != "loop"})
    for e in out:
        e.pop("_t", None)
        if "slice" in e:
            e["pool_use"] = round(100.0 * e.get("held", 0) / e["slice"], 1) if e["slice"] else 0.0
            why = running_out(e)
            if why:
                e["warning"] = why
    return out


def running_out(e: dict) -> str | None:
    """Why shard ``e`` (a ``shard_stats`` entry) is about to refuse new clients, or None.  Before it does: its
    slice's free addresses are at most ``WARN_FREE`` of it (at least ``WARN_MIN``); or it did already."""
    if not e.get("owns"):
        return None
    size, free = e["slice"], e["slice"] - e.get("held", 0) - e.get("declined", 0)
    refused = e.get("counters", {}).get("pool_exhausted", 0)
    if size == 0:
        return "owns keys but no address of the pool (its ranges are narrower than the pool's spacing): " \
               "its new clients get no OFFER; merge its ranges into a neighbour's"
    if refused:
        return (f"refused {refused} DISCOVERs: its slice of {size} addresses was full ({free} free now) and no "
                f"other shard had addresses to lend it then; grow the pool")
    if free <= max(WARN_MIN, WARN_FREE * size):
        return (f"{free} of its {size} addresses free ({e['pool_use']:g}% in use): it asks the other shards for "
                f"addresses (blocks); once the whole pool is in use new clients are refused: grow the pool")
    return None


def _slice(s: dict) -> str:
    """The slice column: the addresses the shard may hand out, and the blocks lent to it (blocks.py, anchored
    in its ranges) with (+) their addresses; the rest of its slice is its home slice."""
    if not s.get("blocks"):
        return f"{s.get('slice', 0)}"
    return f"{s['slice']} ({s['blocks']} +{s['borrowed']})"


def _rate(x) -> str:
    return "-" if x is None else f"{x:g}"


def native_share(s: dict) -> str:
    """The share of a shard's OFFERs and ACKs its native lane sent, "off" without a lane, "failed" if it stopped."""
    n = s.get("native")
    if not n:
        return "off"
    if n.get("failed"):
        return "failed"
    k = s.get("counters", {})
    total = k.get("offers", 0) + k.get("acks", 0)
    return f"{round(100.0 * (n.get('offers', 0) + n.get('acks', 0)) / total):g}%" if total else "-"


def need_sdhcp(reg, service: str) -> None:
    """SERVICE must exist (NotFound names it) and be of kind sdhcp: else bad input (exit 2), naming its kind,
    the sdhcp services there are, and what shows a service of another kind."""
    kind = reg.service(service).kind
    if kind == "sdhcp":
        return
    dhcp = ", ".join(s.name for s in reg.services() if s.kind == "sdhcp") or "none"
    raise click.BadParameter(
        f"service {service!r} is of kind {kind or '(none declared)'}, not sdhcp (sdhcp services: {dhcp}): "
        f"'vfab ranges {service}' shows its ranges, owners, keys and requests/s ('vfab status': every service)",
        param_hint="SERVICE")


@sdhcp.command("status")
@click.argument("service", type=NameType("service"))
@click.option("--interval", type=click.FloatRange(0, 60), default=1.0, show_default=True,
              help="Seconds between the two STATS reads the DHCP rates come from; 0: no rates, answer at once.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors
def status(c, service: str, interval: float, as_json: bool) -> None:
    """Per shard of SERVICE: owned (or mirrored) ranges; its slice of the pool (the addresses it may hand
    out now) with, in brackets, its blocks (address blocks other shards lent it, anchored in its ranges)
    and "+" their addresses (the rest of its slice is its home slice: the addresses whose home keys it owns
    and did not lend; the last row counts the blocks of the service's table) and pool use (addresses held
    in it); bound and offered leases; declined addresses; requests/s
    (its load report, what the balancer sees); offers, ACKs, NAKs and dropped input per second (over
    --interval); totals since start, "no address" being the DISCOVERs left unanswered because the shard's
    slice was full (the shard's log says when it fills); "native", the share of its OFFERs and ACKs that its
    native lane sent ("off": started with --no-native or without the lane's library).  A last row adds the
    shards up.

    Example: vfab sdhcp status dhcp --interval 2
    """
    reg = c.registry
    need_sdhcp(reg, service)
    shards = shard_stats(reg, service, interval)
    if as_json:
        click.echo(json.dumps(shards, indent=2, sort_keys=True))
        return
    rows = []
    tot = {"slice": 0, "held": 0, "bound": 0, "offered": 0, "declined": 0, "req_s": 0.0, "dropped": 0}
    tot_rates = {k: 0.0 for k in (*RATED, "dropped")}
    for s in shards:
        owns = ",".join(s["owns"]) or ("mirror " + ",".join(s["mirrors"]) if s["mirrors"] else "-")
        if "error" in s:
            rows.append([s["shard"], owns, *["?"] * 9, s["error"]])
            continue
        k = s.get("counters", {})
        r = s.get("rates")
        for name in ("slice", "held", "bound", "offered", "declined"):
            tot[name] += s.get(name, 0)
        tot["req_s"] += s["req_s"] or 0.0
        tot["dropped"] += dropped(k)
        for name in tot_rates:
            tot_rates[name] += (r or {}).get(name, 0.0)
        rows.append([s["shard"], owns, _slice(s), f"{s.get('held', 0)} ({s.get('pool_use', 0.0):g}%)",
                     s.get("bound", 0), s.get("offered", 0), s.get("declined", 0), _rate(s["req_s"]),
                     "/".join(_rate(r[n]) for n in RATED) if r else "-", _rate(r["dropped"]) if r else "-",
                     native_share(s), f"{k.get('offers', 0)}/{k.get('acks', 0)}/{k.get('naks', 0)}/{k.get('releases', 0)}/"
                     f"{dropped(k)}/{k.get('pool_exhausted', 0)}"])
    if len(rows) > 1:
        use = round(100.0 * tot["held"] / tot["slice"], 1) if tot["slice"] else 0.0
        tb = next((s.get("table_blocks") for s in shards if "table_blocks" in s), 0)
        rows.append(["all", "", f"{tot['slice']}" + (f" ({tb} blocks)" if tb else ""),
                     f"{tot['held']} ({use:g}%)", tot["bound"], tot["offered"],
                     tot["declined"], _rate(round(tot["req_s"], 1)),
                     "/".join(_rate(round(tot_rates[n], 1)) for n in RATED) if interval > 0 else "-",
                     _rate(round(tot_rates["dropped"], 1)) if interval > 0 else "-", "", ""])
    pool = next((s["pool"] for s in shards if "pool" in s), "")
    c.console.print(table(f"sdhcp {service}" + (f": {pool}" if pool else ""),
                          ["shard", "owns", "slice", "in use", "bound", "offered", "declined", "req/s",
                           "offers/acks/naks per s", "dropped/s", "native",
                           "offers/acks/naks/releases/dropped/no address"], rows))
    for s in shards:
        if s.get("warning"):
            click.echo(f"warning: shard {s['shard']} {s['warning']}")


@sdhcp.command("rekey")
@click.argument("service", type=NameType("service"))
@click.option("--to", "to", type=click.Choice(mackey.FUNCTIONS), default=mackey.HASH, show_default=True,
              help="Key function of the client MAC: mac-hash spreads sequentially numbered MACs over every shard; "
                   "mac-low24 is the MAC's low 24 bits (services created before mac-hash).")
@pass_ctx
@errors
def rekey(c, service: str, to: str) -> None:
    """Switch SERVICE's dhcp4 front door to key function --to.  A lease row lives at the shard owning its
    client's key, so this needs one shard owning every key (merge first: 'vfab merge'); the switch and the
    record change in one etcd transaction that fails if any range changed meanwhile.  Then restart that shard
    (and its mirrors): at start each stores its leases under the new keys, and clients keep their addresses.

    Example: vfab merge dhcp 0x800000-0xffffff --to s1 && vfab sdhcp rekey dhcp && (restart s1)
    """
    reg = c.registry
    svc = reg.service(service)
    got = reg.get(schema.service_key(service))
    ranges = reg.ranges(service)
    now = mackey.of_service(svc)
    if not any(isinstance(d, dict) and d.get("kind") == "dhcp4" for d in svc.frontdoors):
        raise click.ClickException(f"service {service!r} has no dhcp4 front door: only an sdhcp service is re-keyed")
    if now == to:
        click.echo(f"service {service} already keys clients by {to}")
        return
    owners = {r.owner for r, _ in ranges}
    if len(owners) != 1 or sum(r.hi - r.lo + 1 for r, _ in ranges) != KEY_MAX + 1 or "" in owners:
        held = ", ".join(f"{r.lo:#x}-{r.hi:#x} {r.owner or '(none)'}" for r, _ in ranges) or "no range"
        raise click.ClickException(
            f"service {service!r} is split ({held}): leases live at the owner of their client's key, and a new key "
            f"function moves most clients to another key.  Merge every range onto one shard first ('vfab merge "
            f"{service} LO-HI --to SHARD'), then run this again")
    doors = [dict(d, key=to) if isinstance(d, dict) and d.get("kind") == "dhcp4" else d for d in svc.frontdoors]
    compares = [reg.cmp_mod(schema.service_key(service), got[1])]
    compares += [reg.cmp_mod(schema.range_key(service, r.lo), mod) for r, mod in ranges]
    ok, _ = reg.txn(compares, {schema.service_key(service): replace(svc, frontdoors=doors).to_json()})
    if not ok:
        raise click.ClickException(f"service {service!r} or its ranges changed meanwhile: run this again")
    shard = next(iter(owners))
    click.echo(f"service {service} keys clients by {to} now (was {now}); restart shard {shard}"
               + (" and its mirrors " + ", ".join(sorted({m for r, _ in ranges for m in r.mirrors}))
                  if any(r.mirrors for r, _ in ranges) else "")
               + ": it re-keys its leases at start; until then it serves every key as before")
