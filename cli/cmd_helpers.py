"""``vfab helpers``: PostMan helpers in front of a service — what they do, and switching them in and out by hand.

``vfab helpers SERVICE`` shows the service's ranges with the helpers on each (live or dead, bucket weight and
the share of the range's clients it gives)
and every helper with what its agent last reported from mc-helper's stats (S, T, batches, keys per
batch); ``vfab helpers on|off SERVICE [RANGE]`` writes ``RangeRec.helpers`` like an operator (or the
balancer) would, through ``vfab.services.memcached_helper.control``, and holds the range (the balancer leaves
it alone) until ``vfab helpers auto SERVICE [RANGE]``.
"""

from __future__ import annotations

import json
import time

import click

from vfab.cli.common import RANGE, NameType, errors, pass_ctx, table
from vfab.services.memcached_helper import control
from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema


class _StatusByDefault(click.Group):
    """``vfab helpers SERVICE`` is ``vfab helpers status SERVICE``."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["status", *args]
        return super().parse_args(ctx, args)


@click.group("helpers", cls=_StatusByDefault)
def helpers() -> None:
    """PostMan helpers of a service: 'vfab helpers SERVICE' (status), 'vfab helpers on|off SERVICE [RANGE]'.

    A helper is an endpoint of the service announced by its agent
    (python -m vfab.services.memcached_helper.agent helper ...). Switched on
    for a range, the range's clients reach a select group of the live helpers
    (bucket weights from the range record: the balancer's ∝ spare capacity,
    or --weight; one client always hashes to one helper while the set is
    stable) with no change on the client; a helper that dies leaves the group.

    'on' and 'off' by hand are an override: the balancer leaves the range's
    helpers as set until 'vfab helpers auto SERVICE [RANGE]' hands the range
    back to it (--no-hold: a one-off change it may reverse).
    """


def _fmt_helpers(r: dict) -> str:
    total = sum(h["weight"] for h in r["helpers"])
    return ", ".join(f"{h['name']}" + (f" w{h['weight']} ({100 * h['weight'] / total:.0f}%)" if h["live"]
                                       else " (DOWN)" if h.get("down") else " (DEAD)")
                     for h in r["helpers"]) or "-"


def _fmt_held(held: list) -> str:
    """Who sets a range's helpers: the balancer, or an operator's 'on'/'off' since when (the held parts named
    when only some of the range is held)."""
    if not held:
        return "balancer"
    out = []
    for h in held:
        part = f" {h['lo']:#08x}-{h['hi']:#08x}" if len(held) > 1 else ""
        out.append(f"hand: {h['what']} at {time.strftime('%H:%M:%S', time.localtime(h['at']))}{part}")
    return "; ".join(out)


def _n(v, fmt="{}") -> str:
    return "-" if v is None else fmt.format(v)


@helpers.command("status")
@click.argument("service", type=NameType("service"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors
def status(c, service: str, as_json: bool) -> None:
    """Ranges of SERVICE with their helpers, and each helper's S, T and batches (from its stats)."""
    rep = control.report(c.registry, service)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
        return
    c.console.print(table(f"{service}: ranges and helpers (bucket weight, share of the range's clients)",
                          ["lo", "hi", "owner", "helpers", "served by", "epoch", "set by"],
                          [[f"{r['lo']:#08x}", f"{r['hi']:#08x}", r["owner"] or "-", _fmt_helpers(r), r["path"],
                            r["epoch"], _fmt_held(r["held"])] for r in rep["ranges"]]))
    rows = []
    for h in rep["helpers"]:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(h.get("hist", {}).items(), key=lambda kv: int(kv[0])))
        rows.append([h["name"], "live" if h["live"] else ("DOWN" if h["down"] else "DEAD"), h["host"] or "-",
                     h["ranges"],
                     _n(h.get("S_bytes")), _n(h.get("T_us")), _n(h.get("batches")), _n(h.get("keys_per_batch")),
                     _n(h.get("gets")), _n(h.get("drops")),
                     f"{h['conns_up']}/{h['conns']}" if h["live"] else "-", hist or "-", _n(h["age_s"])])
    c.console.print(table(f"{service}: helpers", ["name", "state", "host", "ranges", "S B", "T µs", "batches",
                                                  "keys/batch", "gets", "drops", "conns", "keys/batch histogram",
                                                  "age s"], rows))
    for h in rep["helpers"]:
        if h["down"]:
            click.echo(f"{h['name']} does not serve (withdrawn by its agent): {h['down']}")
    if rep["holds_error"]:
        click.echo(f"helper holds: {rep['holds_error']}", err=True)
    if not rep["helpers"]:
        click.echo(f"no helper of {service} is up: start one with 'python -m vfab.services.memcached_helper.agent "
                   f"helper --service {service} --name NAME --iface IFACE ...'")


def _apply(c, service: str, changes: list, wait: bool, timeout: float) -> None:
    if not changes:
        click.echo(f"{service}: nothing to change")
        return
    for ch in changes:
        wts = ""
        if ch.weights_after:
            wts = " weights " + ",".join(f"{h}={ch.weights_after.get(h, schema.WEIGHT_DEFAULT)}" for h in ch.after)
        click.echo(f"{service} {ch.rng} (owner {ch.owner}): helpers {','.join(ch.before) or '-'} -> "
                   f"{','.join(ch.after) or '-'}{wts}")
    rev = max(ch.revision for ch in changes)
    msg = f"etcd revision {rev}"
    if wait:
        took = c.registry.wait_applied(rev, timeout=timeout)
        msg += f"; applied on all switches in {took * 1e3:.1f} ms"
    click.echo(msg)


def _common(fn):
    for dec in reversed([
        click.argument("service", type=NameType("service")),
        click.argument("keys", metavar="[RANGE]", type=RANGE, required=False),
        click.option("--helper", "names", multiple=True, type=NameType("endpoint"), metavar="NAME",
                     help="Only this helper (repeatable)."),
        click.option("--wait/--no-wait", default=True, show_default=True,
                     help="Wait until every switch has applied the change."),
        click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait."),
        click.option("--hold/--no-hold", default=True, show_default=True,
                     help="Hold RANGE: the balancer leaves its helpers as set until 'vfab helpers auto'."),
        pass_ctx, errors,
    ]):
        fn = dec(fn)
    return fn


def _weights(values: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for v in values:
        name, eq, w = v.partition("=")
        if not name or not eq or not w.strip().isdigit():
            raise click.BadParameter(f"{v!r}: write NAME=WEIGHT with WEIGHT an integer 1..65535, e.g. h1=60",
                                     param_hint="--weight")
        out[name] = int(w)
    return out


@helpers.command("on")
@_common
@click.option("--weight", "weights", multiple=True, metavar="NAME=WEIGHT",
              help="Bucket weight of a helper (1..65535, repeatable; others weigh 100): its share of the clients "
                   "is its weight over the sum.")
def on(c, service: str, keys, names: tuple[str, ...], wait: bool, timeout: float, hold: bool,
       weights: tuple[str, ...]) -> None:
    """Send RANGE of SERVICE (default: all its ranges) through helpers (default: every live helper).

    The range's helpers (and weights) are replaced by the ones given; each
    range is one epoch-checked transaction (another writer makes it fail, not
    vanish). The range is then held: the balancer leaves its helpers on until
    'vfab helpers auto'.

    Example: vfab helpers on mc --helper h1 --helper h2 --weight h1=60 --weight h2=30
    """
    chosen = list(names) or control.live_helpers(c.registry, service)
    if not chosen:
        raise click.ClickException(f"no live helper of {service!r}: start one with 'python -m "
                                   f"vfab.services.memcached_helper.agent helper --service {service} ...'")
    _apply(c, service, control.set_helpers(c.registry, service, keys, chosen, weights=_weights(weights)), wait,
           timeout)
    _hold(c, service, keys, "on", hold)


@helpers.command("off")
@_common
def off(c, service: str, keys, names: tuple[str, ...], wait: bool, timeout: float, hold: bool) -> None:
    """Take helpers out of RANGE of SERVICE (default: all ranges; --helper: only those, dead ones too).

    The range is then held: the balancer does not switch its helpers on
    again, even in a burst, until 'vfab helpers auto'.

    Example: vfab helpers off mc
    """
    _apply(c, service, control.set_helpers(c.registry, service, keys, None, remove=list(names) or None),
           wait, timeout)
    _hold(c, service, keys, "off", hold)


def _hold(c, service: str, keys, what: str, hold: bool) -> None:
    where = str(keys) if keys else "every range"
    if not hold:
        click.echo(f"{service} {where}: not held (--no-hold): the balancer may change its helpers again")
        return
    try:
        control.hold(c.registry, service, keys, what)
    except RegistryError as exc:
        raise click.ClickException(
            f"{service} {where}: the helpers were set as shown above, but holding them failed: {exc}; "
            f"the balancer may change them again: run this command again once etcd answers (it is "
            f"idempotent), or 'vfab helpers {service}' to see where things stand") from None
    click.echo(f"{service} {where}: held ({what} by hand): the balancer leaves its helpers alone until "
               f"'vfab helpers auto {service}{' ' + str(keys) if keys else ''}'")


@helpers.command("auto")
@click.argument("service", type=NameType("service"))
@click.argument("keys", metavar="[RANGE]", type=RANGE, required=False)
@pass_ctx
@errors
def auto(c, service: str, keys) -> None:
    """Hand RANGE of SERVICE (default: every held range) back to the balancer.

    Undoes the hold that 'vfab helpers on|off' by hand put on it; the
    helpers stay as they are until the balancer decides otherwise.

    Example: vfab helpers auto mc
    """
    freed = control.release(c.registry, service, keys)
    if not freed:
        click.echo(f"{service}: {'no part of ' + str(keys) if keys else 'no range'} was held: nothing to hand back")
        return
    click.echo(f"{service}: {', '.join(map(str, freed))} back to the balancer")


COMMANDS = [helpers]
