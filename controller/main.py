"""Run the route controller: ``python -m vfab.controller --etcd HOST:PORT --port 6653``."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vfab-controller", description=__doc__)
    ap.add_argument("--etcd", default=os.environ.get("VFAB_ETCD", "127.0.0.1:2379"), help="etcd HOST:PORT")
    ap.add_argument("--listen", default="127.0.0.1", help="OpenFlow listen address")
    ap.add_argument("--port", type=int, default=6653, help="OpenFlow TCP port")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between counter polls")
    ap.add_argument("--settle-ms", type=float, default=5.0,
                    help="pause between switches when a route moves (OVS datapath revalidation lag)")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    os.environ["VFAB_ETCD"] = args.etcd
    os.environ["VFAB_POLL"] = str(args.poll)
    os.environ["VFAB_SETTLE_MS"] = str(args.settle_ms)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("os_ken", "urllib3", "etcd3gw"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from os_ken.lib import hub

    hub.patch()
    from os_ken import cfg
    from os_ken.base.app_manager import AppManager

    cfg.CONF(args=[f"--ofp-listen-host={args.listen}", f"--ofp-tcp-listen-port={args.port}"],
             project="os_ken")
    logging.getLogger("vfab.controller").info("listening on %s:%d, etcd %s", args.listen, args.port, args.etcd)
    AppManager.run_apps(["vfab.controller.app"])


if __name__ == "__main__":
    main()
