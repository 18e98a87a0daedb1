"""Services and ranges: ``services``, ``service add|del``, ``ranges``, ``resolve``, ``route``."""

from __future__ import annotations


import click

from vfab.cli.cmd_state import fmt_rate, load_by_range, range_load
from vfab.cli.common import KEY, RANGE, NameType, errors, pass_ctx, table
from vfab.vid import codec, plugin
from vfab.vid.errors import VidError
from vfab.vid.registry import schema


def fabric_counters(reg) -> dict[str, list[int]]:
    """Packets/bytes per counter name (controller/report.py: "<service id>/<lo>", "deny/<port>", "guard/<service
    id>", ...) summed over switches, as the controller published them."""
    _, items = reg.get_prefix(schema.folder("counters"))
    out: dict[str, list[int]] = {}
    for _, rec, _ in schema.records(items, schema.Counters):   # a malformed report is skipped
        for name, (pk, by) in rec.counters.items():
            acc = out.setdefault(name, [0, 0])
            acc[0] += pk
            acc[1] += by
    return out


@click.command("services")
@pass_ctx
@errors
def services(c) -> None:
    """List services with their id, VID layout, ranges and live endpoints.

    "answers dropped": frames that looked like the service's server answers (a front door's protocol: DHCP
    67 -> 68, UDP from the service's address and port) sent from a host port with no endpoint of the
    service (a rogue server, a forged reply), dropped by the switches since they started.  "spoofed
    dropped": requests to a udp front door from a source address the sending host is not registered with
    (reflection: the replies would go to that address), dropped likewise."""
    reg = c.registry
    counters = fabric_counters(reg)
    rows = []
    for s in reg.services():
        doors = ", ".join(str(d.get("kind")) for d in s.frontdoors) or "-"
        dropped = counters.get(f"guard/{s.id}", [0, 0])[0] if s.frontdoors else "-"
        spoofed = counters.get(f"spoofed/{s.id}", [0, 0])[0] if s.frontdoors else "-"
        rows.append([s.name, s.kind or "-", s.id, s.layout, len(reg.ranges(s.name)), doors, dropped, spoofed,
                     ", ".join(e.name for e in reg.endpoints(s.name)) or "-"])
    c.console.print(table("services", ["name", "kind", "id", "layout", "ranges", "front doors", "answers dropped",
                                       "spoofed dropped", "endpoints"], rows))


@click.group("service")
def service() -> None:
    """Create, show or delete a service (its kind and the kind's settings)."""


@service.command("add")
@click.argument("name", type=NameType("service"))
@click.option("--layout", type=click.Choice(["prefix", "suffix"]), default="prefix", show_default=True,
              help="Where the service id sits in the VID (DESIGN.md §2).")
@click.option("--id", "sid", type=click.IntRange(1, codec.SERVICE_MAX), help="Ask for this service id.")
@click.option("--kind", metavar="KIND", default="",
              help="Service type, from the plug-ins: " + ", ".join(sorted(plugin.load())) + ". It decides the "
                   "front doors the service gets.")
@click.option("--opt", "opts", multiple=True, metavar="NAME=VALUE",
              help="An option of the kind (e.g. the address of a front door, an sdhcp pool), checked by the kind "
                   "and kept in the service record, where its endpoints read it at start; repeatable.")
@pass_ctx
@errors
def service_add(c, name: str, layout: str, sid: int | None, kind: str, opts: tuple[str, ...]) -> None:
    """Register service NAME; all its keys start in one unassigned range.

    Adding a service that exists with the same settings changes nothing; with other settings it is refused
    (delete it first: 'vfab service del NAME').

    \b
    Examples:
      vfab service add kvs --kind elastic-kvs
      vfab service add dhcp --kind sdhcp --opt pool=192.168.77.10-192.168.77.250 --opt mask=24 \\
          --opt server=192.168.77.1
    """
    pairs = {}
    for text in opts:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{text!r} is not NAME=VALUE", param_hint="--opt")
        pairs[key] = value
    doors = []
    if kind:
        try:
            doors = plugin.get(kind).service_frontdoors(pairs)
        except VidError as exc:
            raise click.BadParameter(str(exc), param_hint="--kind/--opt") from None
    elif pairs:
        raise click.BadParameter("options need a --kind", param_hint="--opt")
    s = c.registry.create_service(name, layout, sid, kind=kind, frontdoors=doors, opts=pairs)
    asked = (layout, kind, doors, pairs) + ((sid,) if sid is not None else ())
    have = (s.layout, s.kind, s.frontdoors, s.opts) + ((s.id,) if sid is not None else ())
    if asked != have:
        raise click.ClickException(
            f"service {name} already exists with other settings ({describe_service(s)}): "
            f"delete it first ('vfab service del {name}', which drops its ranges and endpoint records) or "
            "add it under another name")
    click.echo(f"service {s.name}: {describe_service(s)}, "
               f"VIDs {codec.encode(s.id, 0, layout=codec.Layout(s.layout))}..")


def describe_service(s) -> str:
    opts = " ".join(f"{k}={v}" for k, v in s.opts.items())
    doors = ", ".join(str(d.get("kind")) for d in s.frontdoors)
    return (f"id {s.id}, {s.layout} layout, kind {s.kind or '-'}" + (f", front doors {doors}" if doors else "")
            + (f", options {opts}" if opts else ""))


@service.command("show")
@click.argument("name", type=NameType("service"))
@click.option("--json", "as_json", is_flag=True, help="The service record as JSON.")
@pass_ctx
@errors
def service_show(c, name: str, as_json: bool) -> None:
    """Show service NAME's record: id, layout, kind, front doors and the kind's options."""
    s = c.registry.service(name)
    if as_json:
        click.echo(s.to_json())
        return
    click.echo(f"service {s.name}: {describe_service(s)}")


@service.command("del")
@click.argument("name", type=NameType("service"))
@pass_ctx
@errors
def service_del(c, name: str) -> None:
    """Delete service NAME with its ranges and endpoint records."""
    c.registry.delete_service(name)
    click.echo(f"service {name}: deleted")


@click.command("ranges")
@click.argument("service", type=NameType("service"))
@pass_ctx
@errors
def ranges(c, service: str) -> None:
    """Show SERVICE's range map: owner, mirrors, helpers, epoch, traffic, keys and requests/s per range."""
    reg = c.registry
    svc = reg.service(service)
    live = {e.name for e in reg.endpoints(service)}
    counts = fabric_counters(reg)
    loads = load_by_range(reg, service)  # the owners' reports: (keys, req/s) per range
    rows = []
    for r, _ in reg.ranges(service):
        owner = r.owner or "-"
        if r.owner and r.owner not in live:
            owner += " (down)"
        pk = counts.get(f"{svc.id}/{r.lo:06x}", [0, 0])[0]
        load = range_load(loads, r)
        rows.append([f"{r.lo:#08x}", f"{r.hi:#08x}", owner, ",".join(r.mirrors) or "-",
                     ",".join(r.helpers) or "-", r.epoch, r.state, pk,
                     load[0] if load else "-", fmt_rate(load[1] if load else None)])
    c.console.print(table(f"ranges of {service} (id {svc.id})",
                          ["lo", "hi", "owner", "mirrors", "helpers", "epoch", "state", "packets", "keys", "req/s"],
                          rows))


@click.command("resolve")
@click.argument("service", type=NameType("service"))
@click.argument("key", type=KEY)
@pass_ctx
@errors
def resolve(c, service: str, key: int) -> None:
    """Print the VID of KEY in SERVICE and who owns it now."""
    reg = c.registry
    svc = reg.service(service)
    vid = codec.encode(svc.id, key, layout=codec.Layout(svc.layout))
    rec = reg.owner_of(service, key)
    where = "unassigned"
    if rec.owner:
        eps = {e.name: e for e in reg.endpoints(service)}
        ep = eps.get(rec.owner)
        where = f"{rec.owner} ({ep.mac})" if ep else f"{rec.owner} (down: no live endpoint)"
    click.echo(f"{service} key {key:#08x} -> VID {vid} -> {where} [range {rec.lo:#08x}-{rec.hi:#08x}, epoch {rec.epoch}]")


@click.command("route")
@click.argument("service", type=NameType("service"))
@click.argument("keys", metavar="LO-HI", type=RANGE)
@click.option("--to", "owner", required=True, type=NameType("endpoint"),
              help="Endpoint that owns the range afterwards (no state moves with it).")
@click.option("--epoch", type=int, default=None,
              help="Only if the range is still at this epoch (as 'vfab ranges' showed); else fail.")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until every switch has applied the change.")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait.")
@click.option("--force", is_flag=True,
              help="Re-point the route even if a stateful endpoint owns or takes the keys (route moves no "
                   "state: the data stays behind; use 'vfab split/move' to move it) or the ranges it joins "
                   "carry different mirrors/helpers (the first range's are kept).")
@pass_ctx
@errors
def route(c, service: str, keys, owner: str, epoch: int | None, wait: bool, timeout: float, force: bool) -> None:
    """Reassign keys LO-HI of SERVICE to endpoint --to, in one epoch-checked transaction.

    Only the route moves: no state goes with it, so for stateful services
    (elastic-KVS, sdhcp) use 'vfab split' or 'vfab move' instead; route then
    refuses unless --force. The range keeps its mirrors and helpers.

    Example: vfab route echo 0-0x7fffff --to s2
    """
    reg = c.registry
    eps = {e.name: e for e in reg.endpoints(service)}
    if owner not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise click.BadParameter(f"endpoint {owner!r} of {service!r} is not live (live: {known})",
                                 param_hint="--to")
    hit = [r for r, _ in reg.ranges(service) if r.range.overlaps(keys)]
    stateful = sorted({n for n in {owner, *(r.owner for r in hit if r.owner)} if eps.get(n) and eps[n].ctl})
    if stateful and not force:
        raise click.BadParameter(
            f"{', '.join(stateful)} {'is a stateful endpoint' if len(stateful) == 1 else 'are stateful endpoints'}"
            f" of {service!r}: 'route' moves no state, so the keys' data would stay behind; use 'vfab split "
            f"{service} {keys} --to {owner}' (or 'vfab move'), or --force to re-point the route anyway",
            param_hint="--to")
    if len({(tuple(r.mirrors), tuple(r.helpers)) for r in hit}) > 1 and not force:
        shown = "; ".join(f"{r.range}: mirrors {','.join(r.mirrors) or '-'} helpers {','.join(r.helpers) or '-'}"
                          for r in hit)
        raise click.BadParameter(f"{keys} spans ranges with different mirrors/helpers ({shown}): route a range "
                                 "inside one of them, or --force to keep the first one's", param_hint="LO-HI")
    mirrors = [m for m in (hit[0].mirrors if hit else []) if m != owner]
    helpers = list(hit[0].helpers) if hit else []
    rev = reg.assign(service, keys, owner, expect_epoch=epoch, mirrors=mirrors, helpers=helpers)
    msg = f"{service} {keys} -> {owner} (etcd revision {rev})"
    if mirrors or helpers:
        msg += f"; kept mirrors {','.join(mirrors) or '-'}, helpers {','.join(helpers) or '-'}"
    if stateful:
        click.echo(f"warning: forced: no state moved with {keys}; {owner} serves it from what it holds", err=True)
    if wait:
        took = reg.wait_applied(rev, timeout=timeout)
        msg += f"; applied on all switches in {took * 1e3:.1f} ms"
    click.echo(msg)


COMMANDS = [services, service, ranges, resolve, route]
