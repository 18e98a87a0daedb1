"""Hosts and their source guard: ``hosts`` (list), ``host set`` (the addresses a host may send from)."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from vfab.cli.common import errors, pass_ctx, table
from vfab.vid import codec
from vfab.vid.errors import VidError
from vfab.vid.registry import schema


class MacType(click.ParamType):
    name = "MAC"

    def convert(self, value, param, ctx):
        try:
            return codec.int_to_mac(codec.mac_to_int(value))
        except (ValueError, VidError):
            self.fail(f"{value!r} is not a MAC address (six hex bytes, e.g. 02:5d:00:20:00:02)", param, ctx)


def _by_mac(reg, folder: str, rec_type) -> dict[str, object]:
    """MAC -> record of every well-formed record in ``folder``."""
    return {rec.mac: rec for _, rec, _ in schema.records(reg.get_prefix(schema.folder(folder))[1], rec_type)}


def guard_of(host: schema.Host, binding: schema.Binding | None, now: float) -> tuple[str, list[str]]:
    """(how the host is guarded, the addresses it may send requests to a udp door from, described)."""
    addrs = list(host.ips)
    if host.dhcp and binding is not None and binding.until > now:
        addrs.append(f"{binding.ip} (lease from {binding.service}/{binding.shard or '?'}, "
                     f"{binding.until - now:.0f} s left)")
    if host.dhcp:
        return "dhcp", addrs
    return ("addresses" if host.ips else "none"), addrs


@click.command("hosts")
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
@pass_ctx
@errors
def hosts(c, as_json: bool) -> None:
    """List the registered hosts: where each MAC attaches and how its source address is guarded.

    A host may send requests to a source-guarded front door (the udp kind: memcached's) only from its
    registered addresses ("addresses"); a DHCP host ("dhcp") from the address its sdhcp lease binds while the
    lease lasts, and from none before; "none": not guarded.  Change it with 'vfab host set'."""
    reg = c.registry
    found = _by_mac(reg, "hosts", schema.Host)
    bound = _by_mac(reg, "bindings", schema.Binding)
    now = time.time()
    rows, out = [], []
    for mac in sorted(found):
        h, b = found[mac], bound.get(mac)
        guard, addrs = guard_of(h, b, now)
        out.append({"mac": mac, "name": h.name, "dpid": h.dpid, "port": h.port, "guard": guard, "ips": h.ips,
                    "binding": json.loads(b.to_json()) if b is not None and h.dhcp else None})
        rows.append([mac, h.name or "-", f"{h.dpid:#x}", h.port, guard, ", ".join(addrs) or "-"])
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c.console.print(table("hosts", ["mac", "name", "switch", "port", "source guard", "may send from"], rows))


@click.group("host")
def host() -> None:
    """Change a registered host's source guard ('vfab hosts' lists them)."""


@host.command("set")
@click.argument("mac", type=MacType())
@click.option("--ip", "ips", multiple=True, metavar="IPV4",
              help="An address the host may send from (repeatable); replaces the registered ones.")
@click.option("--no-ips", is_flag=True, help="Forget the registered addresses.")
@click.option("--dhcp/--no-dhcp", default=None,
              help="Its addresses come from DHCP: guarded by its sdhcp lease's binding (none before it).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until every switch has applied the change.")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait.")
@pass_ctx
@errors
def host_set(c, mac: str, ips: tuple[str, ...], no_ips: bool, dhcp: bool | None, wait: bool,
             timeout: float) -> None:
    """Set how host MAC's source address is guarded at source-guarded front doors.

    Examples: vfab host set 02:5d:00:20:00:02 --ip 10.0.0.7 --ip 10.0.0.8;
    vfab host set 02:5d:00:20:00:02 --dhcp --no-ips"""
    if ips and no_ips:
        raise click.UsageError("--ip and --no-ips contradict each other: give the addresses, or --no-ips alone")
    if not ips and not no_ips and dhcp is None:
        raise click.UsageError("nothing to change: give --ip IPV4 (repeatable), --no-ips, --dhcp or --no-dhcp")
    reg = c.registry
    got = reg.get(schema.host_key(mac))
    if got is None:
        raise click.ClickException(f"{mac} is not a registered host ('vfab hosts' lists them; a host is registered "
                                   "where it attaches: 'vfab up' registers its Mininet hosts)")
    old = schema.Host.from_json(got[0], schema.host_key(mac))
    try:
        new = dataclasses.replace(old, ips=[] if no_ips else list(ips) if ips else list(old.ips),
                                  dhcp=old.dhcp if dhcp is None else dhcp)
    except VidError as exc:
        raise click.BadParameter(str(exc), param_hint="--ip") from None
    ok, rev = reg.txn([reg.cmp_mod(schema.host_key(mac), got[1])], {schema.host_key(mac): new.to_json()})
    if not ok:
        raise click.ClickException(f"host {mac} changed while this ran: look again with 'vfab hosts' and retry")
    guard, _ = guard_of(new, None, time.time())
    msg = (f"host {mac}: source guard {guard}; addresses {', '.join(new.ips) or '-'}"
           f"{' + its DHCP lease' if new.dhcp else ''} (etcd revision {rev})")
    if wait:
        took = reg.wait_applied(rev, timeout=timeout)
        msg += f"; applied on all switches in {took * 1e3:.1f} ms"
    click.echo(msg)


COMMANDS = [hosts, host]
