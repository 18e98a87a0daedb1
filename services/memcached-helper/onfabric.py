"""memcached, its helpers and its clients on a running ``vfab.testbed`` fabric (tests and the demo).

::

    mc = McFabric(tb, service="mc", host="vfh1")      # the service, with its udp front door at vfh1's address
    mc.start_memcached()                              # the agent announces memcached, which owns every range
    mc.start_helper("h1", "vfh2")                     # the agent starts mc-helper and announces it
    mc.client("vfh3", "load", "--clients", "16", ...) # mcudp.py in a host: an unmodified memcached UDP client
    mc.helpers_on() / mc.helpers_off()                # what 'vfab helpers on|off' writes
    mc.start_balancer({"period": 0.1, ...})           # 'vfab balancer run mc': from memcached's usage report and
                                                      # the helpers' status in etcd it switches helpers by itself

Every process is started through the testbed's supervisor or tracked by it (stopped by PID at its teardown);
each helper's stats file, logs and DPDK runtime folder are under the testbed's work folder or removed by the
agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from vfab.testbed.procs import Proc, wait_for
from vfab.vid.registry import schema

from vfab.services.memcached_helper import control, topo

HERE = os.path.dirname(os.path.abspath(__file__))
MCUDP = os.path.join(HERE, "mcudp.py")
AGENT = ["-m", "vfab.services.memcached_helper.agent"]
PORT = 11211


@dataclass
class Running:
    name: str
    host: str
    agent: Proc
    pid: int            # memcached's or mc-helper's own PID (the agent's child)
    stats_file: str = ""
    prefix: str = ""    # mc-helper's DPDK --file-prefix (its runtime folder under /var/run/dpdk)


class McFabric:
    def __init__(self, tb, service: str = "mc", host: str = "vfh1", binary: str | None = None):
        self.tb = tb
        self.service = service
        self.host = host
        self.ip = tb.host(host).IP()
        self.addr = f"{self.ip}:{PORT}"
        self.binary = binary
        self.memcached: Running | None = None
        self.helpers: dict[str, Running] = {}
        reg = tb.registry
        reg.create_service(service, kind="memcached",
                           frontdoors=[{"kind": "udp", "ip": self.ip, "port": PORT, "key": "ip_src"}])

    # -- processes -----------------------------------------------------------------------------------------------
    def _agent(self, role: str, name: str, host: str, opts: list[str], extra: list[str]) -> Running:
        tb = self.tb
        out = os.path.join(tb.workdir, f"agent-{name}.out")
        fh = open(out, "wb")
        cmd = [sys.executable, *AGENT, role, "--etcd", tb.etcd_endpoint, "--service", self.service, "--name", name,
               "--iface", tb.hosts[host]["iface"], "--netns", tb.netns(host),
               "--child-log", os.path.join(tb.workdir, "logs", f"{name}-child.log"), *opts]
        if extra:
            cmd += ["--", *extra]
        proc = tb.sup.start(f"agent-{name}", cmd, stdout=fh)
        fh.close()

        def ready() -> str | None:
            if not proc.alive():
                raise RuntimeError(f"agent {name} exited ({proc.popen.returncode}):\n{proc.tail(30)}")
            text = open(out, errors="replace").read()
            return text if "ready pid=" in text else None
        text = wait_for(ready, 40, f"{role} {name} on {host} ready")
        words = dict(w.split("=", 1) for w in text.split("ready ", 1)[1].split("\n")[0].split() if "=" in w)
        pid = int(words["pid"])
        # The agent's child (memcached / mc-helper) is stopped by the agent; tracked too, in case both die.
        tb.track(pid, f"{role}:{name}")
        return Running(name, host, proc, pid, words.get("stats", ""), words.get("prefix", ""))

    def start_memcached(self, name: str = "mc0", threads: int = 1, extra: tuple[str, ...] = (),
                        report_every: float | None = None) -> Running:
        """``report_every``: s between the agent's reads of memcached's stats for its usage report in etcd (what
        the balancer reads; the agent's default 0.1 s)."""
        opts = ["--listen", "--threads", str(threads)]
        if report_every is not None:
            opts += ["--report-every", str(report_every)]
        self.memcached = self._agent("memcached", name, self.host, opts, list(extra))
        self.tb.wait_revision(self.tb.registry.state_revision())
        return self.memcached

    def start_helper(self, name: str, host: str, lcores: str = "1", extra: tuple[str, ...] = (),
                     stats_ms: int | None = None) -> Running:
        """``stats_ms``: mc-helper's stats file period (the agent's default 100 ms; 10 is its floor).

        The stats file is the agent's own (in memory, control.stats_dir; removed when the agent stops), as in production,
        not in the testbed's directory on disk (where it stood still for 1.2 s once, right after etcd restarted,
        and the agent withdrew the running helper; whether the disk was the cause is not known: with two busy
        loops on the cores it happened under /run too)."""
        opts = ["--lcores", lcores]   # the agent's own --file-prefix, one per agent process (vfmh-NAME-PID)
        if stats_ms is not None:
            opts += ["--stats-ms", str(stats_ms)]
        if self.binary:
            opts += ["--binary", self.binary]
        run = self._agent("helper", name, host, opts, list(extra))
        if not run.stats_file:
            raise RuntimeError(f"agent {name} did not say where its stats file is (ready line without stats=)")
        self.helpers[name] = run
        return run

    def stop(self, run: Running) -> int | None:
        rc = self.tb.sup.stop(run.agent, grace=15)
        self.tb.untrack(run.pid)
        self.helpers.pop(run.name, None)
        if run.stats_file:   # its agent was killed: it could not remove them
            control.remove_stats(run.stats_file)
        if run.prefix:
            control.remove_runtime(run.prefix)
        return rc

    def kill_helper(self, name: str) -> float:
        """``kill -9`` the helper's mc-helper (not its agent); the wall-clock time of the kill."""
        run = self.helpers[name]
        t = time.time()
        os.kill(run.pid, signal.SIGKILL)
        return t

    def stats(self, name: str) -> dict[str, int]:
        return control.read_stats(self.helpers[name].stats_file)

    # -- clients -------------------------------------------------------------------------------------------------
    def client(self, host: str, cmd: str, *args: str) -> subprocess.Popen:
        """``mcudp.py CMD --server <memcached address> ARGS`` inside ``host`` (JSON on stdout: ``topo.finish``)."""
        server = [] if cmd in ("preload", "store") else ["--server", self.addr]
        return subprocess.Popen(["nsenter", f"--net={self.tb.netns(host)}", "--", sys.executable, MCUDP, cmd,
                                 *server, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def client_addresses(self, host: str, n: int) -> list[str]:
        """``n`` more IPv4 addresses on ``host``'s port (10.<100+N>.0.<i>, inside Mininet's 10/8), so one host
        stands for ``n`` client machines: the front door keys a client by its source address and OVS's
        select group hashes UDP by addresses only (not ports), so one address reaches one helper."""
        num = int(host.removeprefix("vfh"))
        ips = [f"10.{100 + num}.0.{i + 1}" for i in range(n)]
        rev = 0
        for ip in ips:   # registered too: the front door's source guard takes requests from these only
            rev = self.tb.add_address(host, ip)
        self.tb.wait_revision(rev)
        return ips

    def preload(self, host: str, keys: int, prefix: str = "k", value_size: int = 64) -> dict:
        return topo.finish(self.client(host, "preload", "--tcp", self.addr, "--keys", str(keys), "--prefix", prefix,
                                       "--value-size", str(value_size)), 120)

    # -- helpers on and off -------------------------------------------------------------------------------------
    def helpers_on(self, names: list[str] | None = None, rng=None) -> float:
        """Switch helpers in (default: every live one); seconds until every switch applied it."""
        names = names or control.live_helpers(self.tb.registry, self.service)
        changes = control.set_helpers(self.tb.registry, self.service, rng, names)
        return self.tb.wait_revision(max(c.revision for c in changes)) if changes else 0.0

    def helpers_off(self, rng=None) -> float:
        changes = control.set_helpers(self.tb.registry, self.service, rng, None)
        return self.tb.wait_revision(max(c.revision for c in changes)) if changes else 0.0

    def endpoint_gone(self, name: str, timeout: float) -> float:
        """Wait until endpoint ``name`` left etcd; the wall-clock time it was seen gone."""
        reg = self.tb.registry

        def gone() -> bool:
            return reg.get(schema.endpoint_key(self.service, name)) is None
        wait_for(gone, timeout, f"endpoint {name} to leave etcd", interval=0.005)
        return time.time()

    def memcached_cpu_s(self) -> float:
        return topo.proc_cpu_s(self.memcached.pid)

    def memcached_udp_in(self) -> int:
        """UDP datagrams memcached's host received so far (``Udp: InDatagrams`` of its namespace): the clients'
        requests that reach memcached directly; through helpers only their TCP leg reaches it."""
        with open(f"/proc/{self.memcached.pid}/net/snmp") as fh:
            rows = [ln.split() for ln in fh if ln.startswith("Udp:")]
        return int(rows[1][rows[0].index("InDatagrams")])

    # -- the balancer ----------------------------------------------------------------------------------------------
    def balancer_args(self, settings: dict) -> list[str]:
        """``vfab balancer run`` arguments for this service: ``settings`` (BalancerConfig names) as ``--set``.
        It reads everything else from etcd (memcached's usage report, the helpers' status records)."""
        args = ["balancer", "run", self.service]
        for k, v in settings.items():
            args += ["--set", f"{k}={v}"]
        return args

    def start_balancer(self, settings: dict, name: str = "balancer", standby: bool = False,
                       extra: tuple[str, ...] = ()) -> Proc:
        """``vfab balancer run`` as its own process (the testbed's supervisor stops it); its log in the workdir.
        Returns once it is the active one and has published a round; ``standby``: once it runs (another
        runner is active)."""
        out = open(os.path.join(self.tb.workdir, f"{name}.out"), "wb")
        proc = self.tb.sup.start(name, [sys.executable, "-m", "vfab.cli", "--etcd", self.tb.etcd_endpoint,
                                        "-v", *self.balancer_args(settings), *extra], stdout=out)
        out.close()
        if standby:
            wait_for(lambda: proc.alive() and "running for" in proc.tail(30), 15, f"{name} to run")
            return proc
        # Up once it has published a round of its own (runner host:pid); a balancer that refused its settings
        # exits at once, and every measurement after that would silently be of no balancer at all.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            got = self.tb.registry.get(schema.balancer_key(self.service))
            if got and schema.BalancerStatus.from_json(got[0]).runner.endswith(f":{proc.pid}"):
                return proc
            if not proc.alive():
                raise RuntimeError(f"'vfab balancer run' exited ({proc.popen.returncode}) at start:\n{proc.tail(30)}")
            time.sleep(0.02)
        raise RuntimeError(f"'vfab balancer run' (pid {proc.pid}) published no round within 15 s: see {proc.logpath}")

    def decisions(self) -> list[dict]:
        """The balancer's decisions for this service as published in etcd (oldest first)."""
        got = self.tb.registry.get(schema.balancer_key(self.service))
        return schema.BalancerStatus.from_json(got[0]).decisions if got else []

    def balancer_view(self) -> dict:
        got = self.tb.registry.get(schema.balancer_key(self.service))
        return schema.BalancerStatus.from_json(got[0]).view if got else {}
