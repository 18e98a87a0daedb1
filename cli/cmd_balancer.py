"""``vfab balancer run|status|report``: the balancer of DESIGN.md §4 as an operator process, and what it decided.

``run`` observes the named services through etcd only (switch counters, endpoints' load and usage reports,
helpers' status records; issue 45), lets the policy (``vfab.controller.balancer``) decide and applies the
decisions like an operator: helpers through the range map, splits and merges through the owners (as
'vfab split' / 'vfab merge').  Several may run, on any hosts: one is active per service (an etcd election),
the others stand by.  ``status`` shows who is active since when, the decisions with their reasons and what
the model saw.  ``report`` writes a memcached's usage report from its host, for a memcached not started by
its vfab agent (which reports by itself).
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
from vfab.controller.balancer_run import Runner
from vfab.controller.leader import holder
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


ETCD_ONLY = ("the balancer reads etcd only (issue 45): memcached's load comes from the usage report its agent "
             "writes (or 'vfab balancer report' on memcached's host), helpers are the endpoints whose agent "
             "writes a helper status; drop this option")


def _gone(ctx, param, value):
    if value:
        raise click.BadParameter(ETCD_ONLY, param_hint=f"--{param.name}")
    return value


@balancer.command("run")
@click.argument("services", nargs=-1, required=True, type=NameType("service"))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="JSON file of balancer settings (see 'vfab balancer run --help-settings').")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE",
              help="One setting (wins over --config), e.g. --set split_rate=500.")
@click.option("--ttl", type=click.IntRange(1, 60), default=2, show_default=True,
              help="s of the lease under which the active balancer holds its election: a killed one is "
                   "replaced by a standby after about this long.")
@click.option("--memcached", multiple=True, hidden=True, callback=_gone, expose_value=False)
@click.option("--helper", multiple=True, hidden=True, callback=_gone, expose_value=False)
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop after this long (default: until SIGINT/SIGTERM).")
@click.option("--help-settings", is_flag=True, help="List the settings with their defaults and exit.")
@metrics_options
@pass_ctx
@errors
def run(c, services, config_file, sets, ttl, duration, help_settings, **exporter) -> None:
    """Balance SERVICES until stopped; decisions go to etcd ('vfab balancer status SERVICE').

    Run it on any host, as many times as you like: one runner is active per service, the others take over
    when it stops or dies.

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
    reg = c.registry
    for s in services:
        reg.service(s)   # NotFound names the known services
    runner = Runner(reg, list(services), cfg, ttl=ttl)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"balancer {runner.runner}: running for {', '.join(services)} every {cfg.period:g} s (active "
               "where it wins the election, standing by elsewhere)", err=True)
    exp = start_metrics(exporter, "balancer", "-".join(services), reg.endpoint)
    try:
        runner.run(stop, duration)
    finally:
        if exp is not None:
            exp.close()


@balancer.command("report")
@click.argument("endpoint", metavar="SERVICE/ENDPOINT")
@click.option("--memcached", "where", required=True, metavar="HOST:PORT[@NETNS]",
              help="Where this host's memcached answers 'stats' (a local address).")
@click.option("--every", type=click.FloatRange(0.005, 60), default=0.1, show_default=True,
              help="s between reads of its stats.")
@click.option("--heartbeat", type=click.FloatRange(0.01, 60), default=0.5, show_default=True,
              help="s between writes when its numbers do not move.")
@click.option("--ttl", type=click.IntRange(1, 60), default=2, show_default=True,
              help="s of the report's lease: it leaves etcd this long after the reporter dies.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop after this long (default: until SIGINT/SIGTERM).")
@pass_ctx
@errors
def report(c, endpoint, where, every, heartbeat, ttl, duration) -> None:
    """Write a memcached's usage report (CPU, requests/s) to etcd for the balancer, from memcached's host.

    Only for a memcached that its vfab agent does not run (the agent reports by itself).

    Example: vfab balancer report mc/mc0 --memcached 127.0.0.1:11211
    """
    from vfab.services.memcached_helper.usage import Memcached, UsageReporter

    svc, _, ep = endpoint.partition("/")
    if not svc or not ep:
        raise click.BadParameter(f"{endpoint!r}: write SERVICE/ENDPOINT, e.g. mc/mc0", param_hint="SERVICE/ENDPOINT")
    if every > heartbeat:
        raise click.BadParameter(f"--every {every} is longer than --heartbeat {heartbeat}: make it shorter",
                                 param_hint="--every")
    try:
        mc = Memcached.parse(where)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--memcached") from None
    reg = c.registry
    reg.service(svc)
    rep = UsageReporter(reg, svc, ep, mc, every=every, heartbeat=heartbeat)
    lease = reg.lease(ttl)
    reg.keepalive(lease, ttl)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    end = None if duration is None else time.monotonic() + duration
    click.echo(f"reporting memcached {mc} as {endpoint} every {every:g} s (heartbeat {heartbeat:g} s)", err=True)
    try:
        while not stop.wait(every) and (end is None or time.monotonic() < end):
            rep.tick(lease)
    finally:
        rep.close()
        reg.revoke(lease)


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
    lead = holder(reg, schema.leader_key("balancer", service))
    if as_json:
        click.echo(json.dumps({"at": rec.at, "runner": rec.runner, "decisions": rec.decisions[-last:],
                               "view": rec.view, "problems": rec.problems,
                               "active": {"who": lead.who, "since": lead.since} if lead else None},
                              indent=2, sort_keys=True))
        return
    if lead is None:
        click.echo("active balancer: none (no runner holds the election: start one with 'vfab balancer run "
                   f"{service}')")
    else:
        click.echo(f"active balancer: {lead.who} since {time.strftime('%H:%M:%S', time.localtime(lead.since))} "
                   f"({time.time() - lead.since:.1f} s)")
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
    for ep, u in sorted(rec.view.get("usage", {}).items()):
        click.echo(f"{ep}: usage report {u.get('served')} requests/s, CPU {u.get('cpu')} s/s, {u.get('age_s')} s old"
                   + ("" if u.get("used", True) else " (not used: stale or failed)"))
    for p in rec.problems:
        click.echo(f"problem: {p}", err=True)


COMMANDS = [balancer]
