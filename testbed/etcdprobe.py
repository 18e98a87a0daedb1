"""A process that writes and watches through vfab's etcd client and says what happened, one JSON line each.

Run inside an emulated host (``HostsTestbed.run_on``) to see what a vfab process on that host sees when
the etcd cluster is cut in two (``tests/integration/test_etcd_partition.py``)::

    python -m vfab.testbed.etcdprobe --etcd LIST --name p1 --prefix /vfabtest/probe/

- every ``--period`` s it puts ``PREFIX NAME/SEQ`` and prints ``{"op": "put", "seq", "ok": true, "rev"}``, or
  ``"ok": false`` with the client's ``error`` and ``sure``: true when the client says it was not applied
  (refused, no leader), false when it may have been (an answer lost with a member);
- it follows ``PREFIX`` (``Registry.follow``): ``{"op": "reset", "rev", "keys"}`` when it reads the prefix
  whole, ``{"op": "events", "revs", "keys"}`` for each watch response, ``{"op": "error", "error"}`` when the
  watch fails; the client's own log lines (a member without leader, a watch broken and resumed) go to
  stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry

MAYBE = "may or may not have been applied"
_out = threading.Lock()


def say(**rec) -> None:
    rec["t"] = round(time.time(), 4)
    with _out:
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()


def writer(reg: Registry, prefix: str, name: str, period: float, stop: threading.Event) -> None:
    seq = 0
    while not stop.is_set():
        seq += 1
        try:
            rev = reg.put(f"{prefix}{name}/{seq:06d}", name)
            say(op="put", seq=seq, ok=True, rev=rev)
        except RegistryError as exc:
            say(op="put", seq=seq, ok=False, sure=MAYBE not in str(exc), error=str(exc))
        stop.wait(period)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="etcdprobe")
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--prefix", default="/vfabtest/probe/")
    ap.add_argument("--period", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=5.0,
                    help="s a request may take, failing over included (the client's default)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    reg = Registry(args.etcd, timeout=args.timeout)

    def reset(items: dict, rev: int) -> None:
        say(op="reset", rev=rev, keys={k: mod for k, (_, mod) in items.items()})

    def apply(batch) -> None:
        say(op="events", revs=[ev.revision for ev in batch], keys=[ev.key for ev in batch])

    def on_error(exc: Exception, first: bool) -> None:
        say(op="error", error=str(exc))

    watch = threading.Thread(target=reg.follow, args=(args.prefix, reset, apply, stop),
                             kwargs={"idle": 1.0, "on_error": on_error, "retry": 0.2}, daemon=True)
    watch.start()
    say(op="start", etcd=args.etcd)
    writer(reg, args.prefix, args.name, args.period, stop)
    watch.join(5)
    say(op="stop")


if __name__ == "__main__":
    main()
