"""The main demo (``make demo``): elastic-KVS on a two-switch Mininet fabric, reshaped live.

Three servers (a on vfh1, b on vfh4, c on vfh5); a owns every key at first and
gets 2,000 keys of 1 KB.  Three load processes (4 closed-loop clients each,
puts and gets on random keys) run while the operator CLI splits a's upper half
to b, mirrors a to c, merges the half back into a, and moves all of a to b;
``vfab ranges`` after each shows owner, mirrors, keys and request rate.  At
the end a history checker reads every key back and reports failed requests
and lost or stale writes (zero and zero in our runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rich.console import Console

from vfab.testbed import history, kvs
from vfab.testbed.fabric import Testbed

console = Console(highlight=False)
SERVICE = "kvs"
STEPS = [("split", ["split", SERVICE, "0x800000-0xffffff", "--to", "b"]),
         ("mirror", ["mirror", SERVICE, "a", "--to", "c"]),
         ("merge", ["merge", SERVICE, "0x800000-0xffffff", "--into", "a"]),
         ("move", ["move", SERVICE, "a", "--to", "b"])]


def say(text: str) -> None:
    console.print(f"[bold cyan]==>[/] {text}")


def vfab(tb: Testbed, args: list[str]) -> str:
    """What 'vfab ARGS' printed, in the order it printed it: its progress (stderr) and summary (stdout) share
    one pipe, so an operation's "done" line comes after its progress lines."""
    env = dict(os.environ, VFAB_ETCD=tb.etcd_endpoint)
    res = subprocess.run([sys.executable, "-m", "vfab.cli", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    return res.stdout.strip()


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("the demo needs root (network namespaces, Open vSwitch): run it with sudo")
    say("starting the fabric: local etcd, Open vSwitch (userspace), the os-ken controller, Mininet line,2,3")
    tb = Testbed("line,2,3", poll=0.5)
    tb.start()
    try:
        tb.registry.create_service(SERVICE)
        kvs.start_server(tb, "vfh1", "a", SERVICE, "0-0xffffff")
        kvs.start_server(tb, "vfh4", "b", SERVICE)
        kvs.start_server(tb, "vfh5", "c", SERVICE)
        tb.wait_revision(tb.registry.state_revision())
        say("elastic-KVS servers a (vfh1), b (vfh4), c (vfh5); a owns every key")
        n = kvs.preload(tb, "vfh3", SERVICE, 2000, prefix="p", value_size=1024)
        say(f"stored {n} keys of 1 KB through a client on vfh3")
        loads = [kvs.start_load(tb, h, f"demo-load-{h}", SERVICE, duration=18, clients=4, keys=300)
                 for h in ("vfh2", "vfh3", "vfh6")]
        say("3 load processes x 4 clients: puts and gets on 300 random keys, for 18 s")
        time.sleep(2.5)
        print(vfab(tb, ["ranges", SERVICE]), flush=True)
        for name, args in STEPS:
            say(f"live {name}: vfab {' '.join(args)}")
            print(vfab(tb, args), flush=True)
            time.sleep(1.5)
            print(vfab(tb, ["ranges", SERVICE]), flush=True)
        docs = [kvs.finish_load(tb, p, out) for p, out in loads]
        rows = [[-1, "PUT", f"p{i}", f"p{i}", 0.0, 0.0, "OK", 1] for i in range(2000)]
        for doc in docs:
            rows += doc["history"]
        keys = [f"k{i}" for i in range(300)] + [f"p{i}" for i in range(2000)]
        report = history.check(rows, kvs.read_back(tb, "vfh2", SERVICE, keys), time.monotonic())
        say(f"clients: {report['ops']} requests, {report['acked_puts']} acknowledged puts, "
            f"{len(report['failed'])} failed; read-back of {len(keys)} keys: "
            f"{len(report['violations'])} lost or stale writes")
        for v in report["violations"][:5]:
            console.print(f"    {v}")
        print(vfab(tb, ["status"]), flush=True)
    finally:
        tb.stop()
    say("done: every namespace, switch and process the demo started is gone")


if __name__ == "__main__":
    main()
