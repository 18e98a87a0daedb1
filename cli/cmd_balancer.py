"""``vfab balancer run|status``: the balancer of DESIGN.md §4 as an operator process, and what it decided.

``run`` observes the named services every period (switch counters and load reports from etcd,
memcached ``stats``, helpers' stats files, sdhcp shards), lets the policy
(``vfab.controller.balancer``) decide and applies the decisions like an operator: helpers through the
range map, splits and merges through the owners (as 'vfab split' / 'vfab merge').  ``status`` shows
the decisions with their reasons and what the model saw.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import click

from vfab.cli.cmd_metrics import metrics_options, start_metrics
from vfab.cli.common import NameType, errors, pass_ctx, table
from vfab.controller.balancer import BalancerConfig, BalancerConfigError
from vfab.controller.balancer_run import Memcached, Runner, ServiceSources
from vfab.vid.registry import schema


@click.group("balancer")
def balancer() -> None:
    """Run the balancer (burst → helpers on, calm → off, load → split, idle → merge) or see its decisions."""


def _pairs(values: tuple[str, ...], what: str, need_value: bool) -> dict[str, str]:
    out = {}
    for v in values:
        name, eq, val = v.partition("=")
        if not name or (need_value and not eq):
            raise click.BadParameter(f"{v!r}: write {what}", param_hint=what.split("=")[0])
        out[name] = val
    return out


@balancer.command("run")
@click.argument("services", nargs=-1, required=True, type=NameType("service"))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="JSON file of balancer settings (see 'vfab balancer run --help-settings').")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE",
              help="One setting (wins over --config), e.g. --set split_rate=500.")
@click.option("--memcached", "mcs", multiple=True, metavar="SERVICE/EP=HOST:PORT[@NETNS]",
              help="Where endpoint EP of SERVICE (a memcached) answers 'stats'; NETNS e.g. $(vfab netns vfh1).")
@click.option("--helper", "helpers", multiple=True, metavar="SERVICE/NAME[=STATSFILE]",
              help="A helper endpoint the balancer may switch in for SERVICE, and its stats file.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop after this long (default: until SIGINT/SIGTERM).")
@click.option("--help-settings", is_flag=True, help="List the settings with their defaults and exit.")
@metrics_options
@pass_ctx
@errors
def run(c, services, config_file, sets, mcs, helpers, duration, help_settings, **exporter) -> None:
    """Balance SERVICES until stopped; decisions go to etcd ('vfab balancer status SERVICE').

    Example: vfab balancer run dh --set split_rate=100 --set merge_rate=20
    """
    if help_settings:
        click.echo(json.dumps(BalancerConfig().to_dict(), indent=2, sort_keys=True))
        return
    data = {}
    if config_file:
        with open(config_file) as fh:
            try:
                data = json.load(fh)
            except ValueError as exc:
                raise click.BadParameter(f"{config_file} is not JSON: {exc}", param_hint="--config") from None
    for name, val in _pairs(sets, "NAME=VALUE", True).items():
        try:
            data[name] = json.loads(val)
        except ValueError:
            raise click.BadParameter(f"{name}={val}: the value must be a number", param_hint="--set") from None
    try:
        cfg = BalancerConfig.from_dict(data)
    except BalancerConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config/--set") from None
    srcs = {s: ServiceSources(s) for s in services}
    for key, val in _pairs(mcs, "SERVICE/EP=HOST:PORT", True).items():
        svc, _, ep = key.partition("/")
        if svc not in srcs or not ep:
            raise click.BadParameter(f"{key}: write SERVICE/EP with SERVICE one of {', '.join(srcs)}",
                                     param_hint="--memcached")
        try:
            srcs[svc].memcached[ep] = Memcached.parse(val)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--memcached") from None
    for key, val in _pairs(helpers, "SERVICE/NAME", False).items():
        svc, _, h = key.partition("/")
        if svc not in srcs or not h:
            raise click.BadParameter(f"{key}: write SERVICE/NAME with SERVICE one of {', '.join(srcs)}",
                                     param_hint="--helper")
        srcs[svc].helpers[h] = val
    reg = c.registry
    for s in services:
        reg.service(s)   # NotFound names the known services
    runner = Runner(reg, list(srcs.values()), cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"balancer: running for {', '.join(services)} every {cfg.period:g} s", err=True)
    exp = start_metrics(exporter, "balancer", "-".join(services), reg.endpoint)
    try:
        runner.run(stop, duration)
    finally:
        if exp is not None:
            exp.close()


@balancer.command("status")
@click.argument("service", type=NameType("service"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--last", default=10, show_default=True, type=click.IntRange(min=1), help="Decisions to show.")
@pass_ctx
@errors
def status(c, service: str, as_json: bool, last: int) -> None:
    """The balancer's last decisions for SERVICE (why, and how they ended) and what its model saw."""
    reg = c.registry
    reg.service(service)
    got = reg.get(schema.balancer_key(service))
    if got is None:
        raise click.ClickException(f"no balancer has run for {service!r}: start one with "
                                   f"'vfab balancer run {service}'")
    rec = schema.BalancerStatus.from_json(got[0], schema.balancer_key(service))
    if as_json:
        click.echo(json.dumps({"at": rec.at, "runner": rec.runner, "decisions": rec.decisions[-last:],
                               "view": rec.view, "problems": rec.problems}, indent=2, sort_keys=True))
        return
    age = time.time() - rec.at
    click.echo(f"balancer {rec.runner}: last round {age:.1f} s ago" + (" (stopped?)" if age > 30 else ""))
    rows = []
    for d in rec.decisions[-last:]:
        rngs = ", ".join(f"{lo:#08x}-{hi:#08x}" for lo, hi in d.get("ranges", []))
        who = d.get("peer") or ",".join(d.get("helpers", []))
        rows.append([time.strftime("%H:%M:%S", time.localtime(d.get("at", 0))), d.get("action", "?"), rngs,
                     d.get("owner", ""), who, d.get("result", ""), d.get("reason", "")])
    c.console.print(table(f"balancer decisions: {service}", ["at", "action", "ranges", "owner", "to / helpers",
                                                              "result", "why"], rows))
    for owner, seen in sorted(rec.view.get("owners", {}).items()):
        if "p99_us" in seen:
            click.echo(f"{owner}: rho {seen.get('rho')}, {seen.get('service_us')} µs/request, predicted p99 "
                       f"{seen.get('p99_us')} µs (alone {seen.get('p99_direct_us')} µs), helped ranges "
                       f"{seen.get('helped')}")
    for p in rec.problems:
        click.echo(f"problem: {p}", err=True)


COMMANDS = [balancer]
