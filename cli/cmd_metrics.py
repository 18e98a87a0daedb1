"""``vfab metrics targets``: every registered Prometheus exporter of the fabric, or a ``file_sd`` file of them.

Each long-running vfab process (controller, elastic-KVS and sdhcp endpoints, helper agents, the balancer)
serves ``/metrics`` and registers its address in etcd (``vfab.vid.metrics``).  A Prometheus scrape config
points a ``file_sd_configs`` entry at the file this writes (re-run it, e.g. from cron or a systemd timer, as
processes come and go; Prometheus re-reads the file when it changes)::

    scrape_configs:
      - job_name: vfab
        file_sd_configs: [{files: [/etc/prometheus/vfab-targets.json]}]
        scrape_interval: 5s
    rule_files: [/path/to/vfab/deploy/prometheus/vfab-rules.yml]
"""

from __future__ import annotations

import argparse
import json

import click

from vfab.cli.common import errors, pass_ctx, table
from vfab.vid import metrics


def metrics_options(fn):
    """``--metrics-port``, ``--metrics-host``, ``--no-metrics`` on a command that runs a process."""
    fn = click.option("--no-metrics", is_flag=True, help="No /metrics, and no metrics kept on hot paths.")(fn)
    fn = click.option("--metrics-host", default="127.0.0.1", show_default=True, metavar="ADDR",
                      help="Address /metrics listens on (the host's control address for a remote Prometheus).")(fn)
    return click.option("--metrics-port", default=0, show_default=True, type=click.IntRange(0, 65535),
                        metavar="PORT", help="Port of /metrics (0: any free port; registered in etcd).")(fn)


def start_metrics(opts: dict, process: str, name: str, etcd: str) -> metrics.Exporter | None:
    """Start the exporter of a process run by a command with ``metrics_options``."""
    exp = metrics.start(argparse.Namespace(**opts), process, name[:63], etcd=etcd)
    if exp is not None:
        click.echo(f"metrics on http://{exp.addr}/metrics", err=True)
    return exp


@click.group("metrics")
def metrics_group() -> None:
    """Find the fabric's Prometheus exporters (see docs/operations.md, "Metrics and alerts")."""


@metrics_group.command("targets")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None, metavar="FILE",
              help="Write a Prometheus file_sd JSON file (atomically) instead of listing.")
@click.option("--json", "as_json", is_flag=True, help="Print the file_sd JSON instead of a table.")
@pass_ctx
@errors
def targets(c, out: str | None, as_json: bool) -> None:
    """List every process's /metrics address registered in etcd, or write them for Prometheus' file_sd."""
    found = metrics.targets(c.registry)
    groups = metrics.file_sd(found)
    if out:
        metrics.write_file_sd(out, groups)
        click.echo(f"{out}: {len(found)} target(s)")
        return
    if as_json:
        click.echo(json.dumps(groups, indent=2, sort_keys=True))
        return
    rows = [[t.process, t.name, t.service or "-", t.host, str(t.pid), f"http://{t.addr}/metrics"] for t in found]
    c.console.print(table("metrics targets", ["process", "name", "service", "host", "pid", "url"], rows))
    if not found:
        click.echo("no target registered: are the fabric's processes running (with metrics on)?", err=True)


COMMANDS = [metrics_group]
