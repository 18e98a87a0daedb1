"""vfab — a layer-2 virtual-endpoint elastic services fabric.

Services are reached through VIDs (MAC addresses that name a service and a
24-bit key); the controller routes each key range to whichever endpoint owns
it now.  Start a local fabric with 'vfab up', inspect it with 'vfab status',
'vfab ranges SERVICE' and 'vfab flows', move a range with 'vfab route'.
'vfab hosts' lists the hosts and the addresses each may send requests from;
'vfab host set' changes that (its registered addresses, or DHCP).  A fabric
across machines: 'vfab node join' on each (Open vSwitch + tunnels), 'vfab node list'.

Create a service with 'vfab service add NAME --kind KIND' (its kind's settings
with --opt; 'vfab service show NAME' prints them).  Stateful services
(elastic-KVS, sdhcp) move their ranges live, state and all: 'vfab split',
'vfab merge', 'vfab move' and 'vfab mirror' (stop one with 'vfab cancel');
'vfab kvs get|put|del' sends one request from a fabric host, 'vfab sdhcp
status' shows a DHCP service's shards, pool use and leases.  'vfab helpers'
shows and switches the PostMan helpers in front of a memcached service;
'vfab balancer run' does that (and splits hot sdhcp shards) by itself.
'vfab top' watches the whole fabric live; 'vfab metrics targets' finds every
process's Prometheus /metrics.
"""

from __future__ import annotations

import logging

import click

import vfab.services.memcached_helper.plugin  # noqa: F401  (registers kind memcached)
import vfab.services.sdhcp.plugin  # noqa: F401  (registers kind sdhcp; vid-lib's BUILTIN lists echo, elastic-kvs)
from vfab.cli import (cmd_balancer, cmd_fabric, cmd_flows, cmd_helpers, cmd_hosts, cmd_metrics, cmd_node, cmd_ranges,
                      cmd_state, cmd_top)
from vfab.cli.common import Ctx, etcd_list
from vfab.vid import plugin


@click.group(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--etcd", envvar="VFAB_ETCD", metavar="HOST:PORT[,...]", callback=etcd_list,
              help="etcd members holding the fabric, comma-separated, the nearest first (default: the ones "
                   "'vfab up' started, else 127.0.0.1:2379).")
@click.option("-v", "--verbose", is_flag=True, help="Log what vfab does (to stderr).")
@click.pass_context
def cli(ctx: click.Context, etcd: str | None, verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx.obj = Ctx(etcd)


for module in (cmd_fabric, cmd_ranges, cmd_hosts, cmd_node, cmd_flows, cmd_state, cmd_balancer, cmd_helpers,
               cmd_metrics, cmd_top):
    for command in module.COMMANDS:
        cli.add_command(command)
for _plug in plugin.load().values():  # each service type brings its own command group
    if _plug.cli:
        cli.add_command(_plug.resolve("cli"))


def main() -> None:
    cli(prog_name="vfab")


if __name__ == "__main__":
    main()
