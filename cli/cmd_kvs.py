"""``vfab kvs get|put|del``: one elastic-KVS request from a fabric host (DESIGN.md §6).

The request goes to the key's VID on the host's interface; the fabric delivers
it to whichever server owns the key now, so this works during splits and moves.
"""

from __future__ import annotations

import binascii
import sys

import click

from vfab.cli.common import NameType, errors, pass_ctx, read_state
from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError

META = "vfab.kvs"


@click.group("kvs")
@click.option("--host", metavar="HOST",
              help="Send from this host of the fabric 'vfab up' started (e.g. vfh2): its interface and netns.")
@click.option("--iface", metavar="IF", help="Send from this interface instead (a host outside 'vfab up').")
@click.option("--netns", metavar="PATH",
              help="With --iface: the network namespace holding it (e.g. /proc/PID/ns/net).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS", default=0.5,
              show_default=True,
              help="Seconds per attempt before a retry (retries back off; 8 retries).")
@click.pass_context
def kvs(ctx: click.Context, host: str | None, iface: str | None, netns: str | None, timeout: float) -> None:
    """Get, put or delete one key of an elastic-KVS service.

    Give exactly one of --host (a host of 'vfab up') or --iface (with --netns
    if it lives in another network namespace). Opening the raw socket needs root.

    Example: vfab kvs --host vfh2 put kvs user:1 alice
    """
    ctx.meta[META] = {"host": host, "iface": iface, "netns": netns, "timeout": timeout}


def _target() -> tuple[str, str | None, float]:
    """(iface, netns, timeout) from the group's options; exit 2 unless exactly one of --host/--iface."""
    o = click.get_current_context().meta[META]
    if bool(o["host"]) == bool(o["iface"]):
        raise click.UsageError("give exactly one of --host HOST (a host of 'vfab up', e.g. vfh2) or --iface IF "
                               "(with --netns PATH for another namespace), before the subcommand: "
                               "vfab kvs --host vfh2 get SERVICE KEY")
    if o["iface"]:
        return o["iface"], o["netns"], o["timeout"]
    if o["netns"]:
        raise click.UsageError("--netns goes with --iface; with --host the host's namespace is used")
    state = read_state()
    if not state:
        raise click.ClickException("no fabric is up: 'vfab up' first, or name an interface with --iface")
    hosts = state.get("hosts", {})
    if o["host"] not in hosts:
        raise click.BadParameter(f"no host {o['host']!r} (hosts: {', '.join(hosts) or 'none'})", param_hint="--host")
    h = hosts[o["host"]]
    return h["iface"], h.get("netns") or f"/proc/{h['pid']}/ns/net", o["timeout"]


def _bytes(text: str, hexed: bool, what: str) -> bytes:
    if not hexed:
        return text.encode("utf-8", "surrogateescape")
    try:
        return binascii.unhexlify("".join(text.split()))
    except (binascii.Error, ValueError) as exc:
        raise click.BadParameter(f"{text[:40]!r} is not hex ({exc}): give pairs of hex digits, or drop --hex",
                                 param_hint=what) from None


def _check(key: bytes, value: bytes | None = None) -> None:
    """Validate before opening the client: bad input is exit 2 with proto's message."""
    try:
        proto.check_key(key)
        if value is not None:
            proto.check_value(value)
    except KvsError as exc:
        raise click.UsageError(str(exc)) from None


def _show(key: bytes) -> str:
    try:
        return repr(key.decode("utf-8"))
    except UnicodeDecodeError:
        return key.hex()


def _client(c, service: str):
    from vfab.services.elastic_kvs.client import KvsClient

    iface, netns, timeout = _target()
    reg = c.registry
    reg.service(service)  # NotFound (exit 1) before opening a raw socket
    return KvsClient(reg, service, iface, netns=netns, timeout=timeout)


def _do(c, service: str, fn):
    """Run ``fn(client)``; a timeout or a refusal by the server is exit 1."""
    with _client(c, service) as cl:
        try:
            return fn(cl)
        except KvsError as exc:  # KvsTimeout included: input was checked before
            raise click.ClickException(str(exc)) from None


@kvs.command("get")
@click.argument("service", type=NameType("service"))
@click.argument("key")
@click.option("--hex", "hexed", is_flag=True, help="KEY is hex, and the value is printed as hex.")
@pass_ctx
@errors
def get(c, service: str, key: str, hexed: bool) -> None:
    """Print KEY's value (raw bytes) to stdout; exit 1 with 'not found' if there is none."""
    k = _bytes(key, hexed, "KEY")
    _check(k)
    value = _do(c, service, lambda cl: cl.get(k))
    if value is None:
        click.echo(f"{service} key {_show(k)}: not found", err=True)
        click.get_current_context().exit(1)
    if hexed:
        click.echo(value.hex())
        return
    sys.stdout.flush()
    out = sys.stdout.buffer
    out.write(value)
    if out.isatty() and not value.endswith(b"\n"):
        out.write(b"\n")
    out.flush()


@kvs.command("put", help=f"""Store VALUE under KEY; VALUE '-' reads it from stdin (at most {proto.MAX_VALUE} B).

    Prints the key's new version once the write is durable (and on every mirror).
    """)
@click.argument("service", type=NameType("service"))
@click.argument("key")
@click.argument("value")
@click.option("--hex", "hexed", is_flag=True, help="KEY and VALUE are hex.")
@pass_ctx
@errors
def put(c, service: str, key: str, value: str, hexed: bool) -> None:
    k = _bytes(key, hexed, "KEY")
    if value == "-":
        raw = sys.stdin.buffer.read()
        v = _bytes(raw.decode("ascii", "replace"), True, "VALUE") if hexed else raw
    else:
        v = _bytes(value, hexed, "VALUE")
    _check(k, v)
    version = _do(c, service, lambda cl: cl.put(k, v))
    click.echo(f"stored (version {version})")


@kvs.command("del")
@click.argument("service", type=NameType("service"))
@click.argument("key")
@click.option("--hex", "hexed", is_flag=True, help="KEY is hex.")
@pass_ctx
@errors
def delete(c, service: str, key: str, hexed: bool) -> None:
    """Delete KEY; exit 1 with 'not found' if there was none."""
    k = _bytes(key, hexed, "KEY")
    _check(k)
    if not _do(c, service, lambda cl: cl.delete(k)):
        click.echo(f"{service} key {_show(k)}: not found", err=True)
        click.get_current_context().exit(1)
    click.echo("deleted")


COMMANDS = [kvs]
