"""Run the route controller: ``python -m vfab.controller --etcd HOST:PORT[,HOST:PORT...] --port 6653``.

Settings come from the defaults, then ``--config FILE`` (a JSON object of
``ControllerConfig`` settings), then the options given; ``--check`` validates
them, prints the result and exits.
"""

from __future__ import annotations

import argparse
import logging
import re
import socket
import sys

from vfab.controller.config import ConfigError, ControllerConfig
from vfab.vid import metrics


def parse_config(argv: list[str] | None = None) -> tuple[ControllerConfig, bool]:
    """(validated config, --check given); argparse exits with status 2 on a bad setting."""
    d = ControllerConfig()
    ap = argparse.ArgumentParser(prog="vfab-controller", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="FILE", help="JSON file of settings (command-line options win)")
    ap.add_argument("--etcd", help=f"etcd members HOST:PORT[,HOST:PORT...], the local one first (default {d.etcd})")
    ap.add_argument("--listen", help=f"OpenFlow listen address (default {d.listen})")
    ap.add_argument("--port", type=int, help=f"OpenFlow TCP port (default {d.port})")
    ap.add_argument("--poll", type=float, help=f"seconds between counter polls (default {d.poll})")
    ap.add_argument("--settle-ms", type=float,
                    help=f"pause between the switches of a hop-by-hop path (rx=bpf/promisc owners) when the "
                         f"datapath cannot be asked (default {d.settle_ms})")
    ap.add_argument("--no-datapath-wait", dest="datapath_wait", action="store_false", default=None,
                    help="do not ask the local ovs-vswitchd when its datapath follows the tables ('applied' "
                         "then means the tables were committed; see controller/datapath.py)")
    ap.add_argument("--datapath-timeout", type=float,
                    help=f"seconds to wait for a revalidation pass (default {d.datapath_timeout})")
    ap.add_argument("--ovs-rundir", help=f"the local ovs-vswitchd's run directory (default {d.ovs_rundir})")
    ap.add_argument("--audit-polls", type=int, help=f"counter polls between full-table audits (default {d.audit_polls})")
    ap.add_argument("--linger", type=float,
                    help=f"seconds a range's frames still reach its owner after etcd deleted the owner's endpoint "
                         f"record (its lease expired or was revoked), while nobody else serves the range: a machine "
                         f"paused past the endpoints' leases gets them all expired at once, and each registers "
                         f"again within its keep-alive period; 0 = route away at once (default {d.linger})")
    ap.add_argument("--bundle-timeout", type=float,
                    help=f"seconds to wait for a bundle commit or a table dump (default {d.bundle_timeout})")
    ap.add_argument("--node", help="run as the route agent of this fabric node: program only its own switch, "
                                   "compiled with two-level routing ('vfab node join' registered it)")
    ap.add_argument("--node-whole-compile", dest="node_whole", action="store_true", default=None,
                    help="a route agent compiles its whole switch on every change, not only the services the "
                         "change touched (the agent before the incremental compile: to compare)")
    ap.add_argument("--election-ttl", type=int,
                    help=f"a route agent's election lease in s: a standby takes over within it (default {d.election_ttl})")
    ap.add_argument("--metrics-port", type=int,
                    help=f"port of the controller's Prometheus /metrics, registered in etcd (default {d.metrics_port}: "
                         "any free port; -1: no metrics)")
    ap.add_argument("--metrics-host", help=f"address /metrics listens on (default {d.metrics_host})")
    ap.add_argument("-v", "--verbose", action="store_true", default=None, help="debug logging")
    ap.add_argument("--check", action="store_true", help="validate the settings, print them and exit")
    args = ap.parse_args(argv)
    try:
        cfg = d
        if args.config:
            try:
                with open(args.config) as fh:
                    cfg = ControllerConfig.from_json(fh.read(), where=args.config)
            except OSError as exc:
                raise ConfigError(f"cannot read {args.config}: {exc.strerror}") from None
        cfg = cfg.merged(etcd=args.etcd, listen=args.listen, port=args.port, poll=args.poll,
                         settle_ms=args.settle_ms, audit_polls=args.audit_polls,
                         datapath_wait=args.datapath_wait, datapath_timeout=args.datapath_timeout,
                         ovs_rundir=args.ovs_rundir, linger=args.linger,
                         bundle_timeout=args.bundle_timeout, node=args.node, node_whole=args.node_whole,
                         election_ttl=args.election_ttl,
                         verbose=args.verbose, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    except ConfigError as exc:
        ap.error(str(exc))
    return cfg, args.check


def main(argv: list[str] | None = None) -> None:
    cfg, check = parse_config(argv)
    if check:
        print(cfg.to_json())
        return
    logging.basicConfig(level=logging.DEBUG if cfg.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("os_ken",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from os_ken.lib import hub

    hub.patch()
    from os_ken import cfg as oscfg
    from os_ken.base.app_manager import AppManager

    from vfab.controller import app

    oscfg.CONF(args=[f"--ofp-listen-host={cfg.listen}", f"--ofp-tcp-listen-port={cfg.port}"], project="os_ken")
    app.configure(cfg)
    if cfg.metrics_port < 0:
        metrics.disable()
    else:
        host = re.sub(r"[^a-z0-9_.-]", "-", socket.gethostname().lower()).strip("-.") or "host"
        metrics.start(argparse.Namespace(metrics_port=cfg.metrics_port, metrics_host=cfg.metrics_host),
                      "controller", cfg.node or f"{host}-{cfg.port}"[:63], etcd=cfg.etcd)   # a route agent: its node
    logging.getLogger("vfab.controller").info("listening on %s:%d, etcd %s", cfg.listen, cfg.port, cfg.etcd)
    AppManager.run_apps(["vfab.controller.app"])


if __name__ == "__main__":
    main(sys.argv[1:])
