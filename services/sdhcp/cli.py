"""``vfab sdhcp status SERVICE``: each shard's ranges, slice of the pool, leases and counters.

Asks every live shard of the service for its STATS over its control socket
(the same socket 'vfab split' talks to), so the numbers are the shard's own,
read at once.
"""

from __future__ import annotations

import json

import click

from vfab.cli.common import NameType, errors, pass_ctx, table
from vfab.vid.errors import StateError
from vfab.vid.state import ctl

DROPS = ("malformed", "wrong_op", "bad_chaddr", "wrong_type", "spoofed", "relayed_dropped", "bad_frames")


@click.group("sdhcp")
def sdhcp() -> None:
    """Inspect an sdhcp (DHCP) service: shards, pool use, leases."""


def shard_stats(reg, service: str) -> list[dict]:
    """One entry per live shard: name, owned ranges, and its STATS (or the error asking it)."""
    ranges = reg.ranges(service)
    out = []
    for ep in sorted(reg.endpoints(service), key=lambda e: e.name):
        if not ep.ctl:
            continue
        owned = [f"{r.lo:#08x}-{r.hi:#08x}" for r, _ in ranges if r.owner == ep.name]
        mirrors = [f"{r.lo:#08x}-{r.hi:#08x}" for r, _ in ranges if ep.name in r.mirrors]
        entry = {"shard": ep.name, "owns": owned, "mirrors": mirrors}
        try:
            body = ctl.command(reg, service, ep.name, "STATS", {}, timeout=3.0).body
            entry.update(body.get("sdhcp") or {})
            entry["loop"] = body.get("counters", {})
        except StateError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    return out


@sdhcp.command("status")
@click.argument("service", type=NameType("service"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors
def status(c, service: str, as_json: bool) -> None:
    """Per shard of SERVICE: owned ranges, its slice of the pool (addresses it may hand out), bound and
    offered leases, held and declined addresses, DHCP counters and dropped input."""
    reg = c.registry
    reg.service(service)  # NotFound names the service
    shards = shard_stats(reg, service)
    if as_json:
        click.echo(json.dumps(shards, indent=2, sort_keys=True))
        return
    rows = []
    for s in shards:
        if "error" in s:
            rows.append([s["shard"], ",".join(s["owns"]) or "-", "?", "?", "?", "?", "?", s["error"]])
            continue
        k = s.get("counters", {})
        dropped = sum(k.get(d, 0) for d in DROPS)
        rows.append([s["shard"], ",".join(s["owns"]) or ("mirror" if s["mirrors"] else "-"), s.get("slice", 0),
                     s.get("bound", 0), s.get("offered", 0), f"{s.get('held', 0)}/{s.get('declined', 0)}",
                     f"{k.get('offers', 0)}/{k.get('acks', 0)}/{k.get('naks', 0)}/{k.get('releases', 0)}",
                     dropped])
    c.console.print(table(f"sdhcp {service}" + (f": {shards[0]['pool']}" if shards and "pool" in shards[0] else ""),
                          ["shard", "owns", "slice", "bound", "offered", "held/declined",
                           "offers/acks/naks/releases", "dropped"], rows))
