"""Run every benchmark in turn (``--smoke`` for the short CI run that proves they work)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = ["etcd_client.py", "etcd_leader_loss.py", "reroute.py", "reroute_busy.py", "own_flows.py", "flow_install.py", "routing_overhead.py", "filtered_receive.py", "kvs_throughput.py",
           "kvs_ops.py", "kvs_pause.py",
           "kvs_apply.py",
           "store_sync.py",
           "helper_batching.py",
           "helper_activation.py",
           "helper_failover.py",
           "helper_throughput.py",
           "helper_core.py",
           "helper_idle.py",
           "helper_burst.py",
           "sdhcp_lease.py",
           "sdhcp_failover.py",
           "sdhcp_ops.py",
           "sdhcp_path.py",
           "tunnel_rtt.py",
           "cutover_hosts.py",
           "scale.py"]


def main() -> int:
    extra = sys.argv[1:]
    failed = []
    for name in BENCHES:
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            print(f"== {name}: missing", flush=True)
            failed.append(name)
            continue
        print(f"== {name} {' '.join(extra)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, path, *extra])
        print(f"== {name}: exit {rc} in {time.monotonic() - t0:.1f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
