"""A small topology for running the helper for real: client namespaces, a Linux bridge, memcached, one helper.

::

    vfm-T-c0 ... vfm-T-cN            vfm-T-sw                 vfm-T-mc
    10.77.0.11+i  --veth--  [ bridge vfmTbr ]  --veth--  10.77.0.1  memcached -U 11211 -p 11211
                                   |                        10.78.0.1
                                 veth                          |  veth (the helper's TCP leg)
                                   |                           |
                            vfm-T-h: vfmTh (DPDK net_af_packet, no IP)   vfmThk 10.78.0.2

Clients send memcached UDP to 10.77.0.1:11211.  ``steer("direct")`` points their neighbour entry for that
address at memcached's MAC, ``steer("helper")`` at the helper's port MAC: that stands in for the fabric's
front door, which rewrites the destination MAC of the service's UDP to a helper (DESIGN.md §3).  Clients
are unmodified memcached UDP clients (``mcudp.py``, memcaslap): same address, same sockets either way.

``helpers=N`` adds helper namespaces ``vfm-T-h1`` ... like the first, each with its own port on the bridge
and its own TCP leg to memcached (10.78.i.2 -> 10.78.i.1); ``steer("helper", [0, 1])`` spreads the client
namespaces over them in turn, as the front door's select group spreads client addresses.
``start_twemproxy()`` runs twemproxy (Debian's ``nutcracker``, TCP only) in the first helper's namespace
instead of mc-helper: its port gets 10.77.0.3 and clients reach it over TCP on 22122.

``PairTopo`` is the throughput rig: one generator namespace wired straight to the helper's port (no bridge),
memcached on the helper's TCP leg as above.

Everything is named ``vfm-<tag>-*`` / ``vfm<tag>*`` and removed by ``destroy()``; processes are stopped by
PID.  Needs root, iproute2 and ethtool.  (A harness: it belongs next to ``vfab.testbed`` in time.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from vfab.services.memcached_helper import control
from vfab.testbed.procs import Proc, Supervisor, wait_for
from vfab.vid.state.sched import proc_stat

SVC_IP = "10.77.0.1"
SVC_PORT = 11211
LEG_MC = "10.78.0.1"
LEG_HELPER = "10.78.0.2"
PROXY_IP = "10.77.0.3"      # twemproxy's listening address (on the first helper's port)
PROXY_PORT = 22122
HERE = os.path.dirname(os.path.abspath(__file__))
MCUDP = os.path.join(HERE, "mcudp.py")
DPDK_DIR = os.path.join(HERE, "dpdk")


class TopoError(RuntimeError):
    pass


def sh(*cmd: str, check: bool = True) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise TopoError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def build_helper(build_dir: str) -> str:
    """``make -C dpdk helper BUILD=build_dir``; returns the binary's path."""
    res = subprocess.run(["make", "-C", DPDK_DIR, f"BUILD={build_dir}", "helper"], capture_output=True, text=True,
                         timeout=600)
    if res.returncode != 0:
        raise TopoError(f"building mc-helper failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return os.path.join(build_dir, "meson", "mc-helper")


def build_blast(build_dir: str) -> str:
    """``make -C dpdk blast BUILD=build_dir``: the raw get generator (mch_blast.c); returns its path."""
    res = subprocess.run(["make", "-C", DPDK_DIR, f"BUILD={build_dir}", "blast"], capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0:
        raise TopoError(f"building mch_blast failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return os.path.join(build_dir, "mch_blast")


class HelperTopo:
    def __init__(self, workdir: str, clients: int = 2, tag: str | None = None, pin: str | None = None,
                 helpers: int = 1):
        """``pin``: CPU list for memcached and the clients (taskset), e.g. "0" with the helper on lcore 1, so
        the polling helper does not compete with them for one core.  ``helpers``: helper namespaces."""
        if not 1 <= helpers <= 8:
            raise TopoError(f"helpers={helpers}: the topology holds 1 to 8 helper namespaces")
        self.tag = tag or uuid.uuid4().hex[:5]
        self.pin = ["taskset", "-c", pin] if pin else []
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.sup = Supervisor(os.path.join(workdir, "logs"))
        t = self.tag
        sfx = [""] + [str(i) for i in range(1, helpers)]   # helper 0 keeps the historical names
        self.ns_sw, self.ns_mc = f"vfm-{t}-sw", f"vfm-{t}-mc"
        self.ns_hs = [f"vfm-{t}-h{x}" for x in sfx]
        self.if_hs = [f"vfm{t}h{x}" for x in sfx]
        self.if_mc_legs = [f"vfm{t}mk{x}" for x in sfx]
        self.if_h_legs = [f"vfm{t}hk{x}" for x in sfx]
        self.leg_mc = [f"10.78.{i}.1" for i in range(helpers)]
        self.leg_helper = [f"10.78.{i}.2" for i in range(helpers)]
        self.ns_h, self.if_h, self.if_mc_leg, self.if_h_leg = self.ns_hs[0], self.if_hs[0], self.if_mc_legs[0], \
            self.if_h_legs[0]
        self.ns_c = [f"vfm-{t}-c{i}" for i in range(clients)]
        self.br = f"vfm{t}br"
        self.if_c = [f"vfm{t}c{i}" for i in range(clients)]
        self.if_mc = f"vfm{t}m"
        self.client_ips = [f"10.77.0.{11 + i}" for i in range(clients)]
        self.made: list[str] = []
        self.memcached: Proc | None = None
        self.helpers: list[Proc | None] = [None] * helpers
        self.twemproxy: Proc | None = None
        self.helper_prefixes = [f"vfm{t}{'h' + x if x else ''}" for x in sfx]
        self.helper_prefix = self.helper_prefixes[0]
        # on a memory file system (control.stats_dir): rewritten every 50 ms, on a disk each would be a write
        self.stats_dir = os.path.join(control.stats_dir(), f"vfab-mch-{t}-{os.getpid()}")
        os.makedirs(self.stats_dir, exist_ok=True)
        self.stats_paths = [os.path.join(self.stats_dir, f"helper{x}.stats") for x in sfx]
        self.stats_path = self.stats_paths[0]
        self.mac_mc = ""
        self.mac_hs: list[str] = [""] * helpers

    @property
    def helper(self) -> Proc | None:
        """The first helper's process (None when it is not running)."""
        return self.helpers[0]

    @helper.setter
    def helper(self, proc: Proc | None) -> None:
        self.helpers[0] = proc

    @property
    def mac_h(self) -> str:
        return self.mac_hs[0]

    # ------------------------------------------------------------------ namespaces

    def ns(self, ns: str, *cmd: str, check: bool = True) -> str:
        return sh("ip", "netns", "exec", ns, *cmd, check=check)

    def _netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.made.append(name)
        self.ns(name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self.ns(name, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        self.ns(name, "ip", "link", "set", "lo", "up")

    def _veth(self, a: str, ns_a: str, b: str, ns_b: str) -> None:
        sh("ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
        for dev, ns in ((a, ns_a), (b, ns_b)):
            self.ns(ns, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1", check=False)
            self.ns(ns, "ip", "link", "set", dev, "up")

    def _port(self, dev: str) -> None:
        """Put the switch-side end of a veth into the bridge."""
        self.ns(self.ns_sw, "ip", "link", "set", dev, "master", self.br)
        self.ns(self.ns_sw, "ip", "link", "set", dev, "up")

    def link(self, ns: str, dev: str) -> dict[str, int]:
        """The interface's counters (``ip -s link``: rx/tx bytes and packets, drops), as rx_bytes, tx_packets..."""
        st = json.loads(self.ns(ns, "ip", "-j", "-s", "link", "show", dev))[0]["stats64"]
        return {f"{d}_{k}": v for d in ("rx", "tx") for k, v in st[d].items() if isinstance(v, int)}

    def mac(self, ns: str, dev: str) -> str:
        return json.loads(self.ns(ns, "ip", "-j", "link", "show", dev))[0]["address"]

    @staticmethod
    def _require() -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ethtool") is None:
            raise TopoError("the helper topology needs root, iproute2 and ethtool (scripts/bootstrap.sh)")

    def create(self) -> None:
        self._require()
        t = self.tag
        try:
            for name in (self.ns_sw, self.ns_mc, *self.ns_hs, *self.ns_c):
                self._netns(name)
            # br_netfilter (if loaded) would drop frames with bad IPv4 headers before they reach the helper;
            # a switch does not look at them (OVS does not), so the bad-input tests need them delivered
            for knob in ("iptables", "ip6tables", "arptables"):
                self.ns(self.ns_sw, "sysctl", "-qw", f"net.bridge.bridge-nf-call-{knob}=0", check=False)
            self.ns(self.ns_sw, "ip", "link", "add", self.br, "type", "bridge")
            self.ns(self.ns_sw, "ip", "link", "set", self.br, "up")
            for i, ns in enumerate(self.ns_c):
                self._veth(self.if_c[i], ns, f"vfm{t}p{i}", self.ns_sw)
                self._port(f"vfm{t}p{i}")
                self.ns(ns, "ip", "addr", "add", f"{self.client_ips[i]}/24", "dev", self.if_c[i])
                # the helper reads this port through AF_PACKET: the kernel must finish UDP checksums
                self.ns(ns, "ethtool", "-K", self.if_c[i], "tx", "off")
            self._veth(self.if_mc, self.ns_mc, f"vfm{t}pm", self.ns_sw)
            self._port(f"vfm{t}pm")
            self.ns(self.ns_mc, "ip", "addr", "add", f"{SVC_IP}/24", "dev", self.if_mc)
            for i, ns in enumerate(self.ns_hs):
                port = f"vfm{t}p{self.if_hs[i][len(f'vfm{t}'):]}"     # vfmTph, vfmTph1, ...
                self._veth(self.if_hs[i], ns, port, self.ns_sw)
                self._port(port)
                self._leg(i)
                self.mac_hs[i] = self.mac(ns, self.if_hs[i])
            self.mac_mc = self.mac(self.ns_mc, self.if_mc)
        except Exception:
            self.destroy()
            raise

    def _leg(self, i: int) -> None:
        """Helper i's TCP leg to memcached: its own veth and /24 (10.78.i.0)."""
        self._veth(self.if_mc_legs[i], self.ns_mc, self.if_h_legs[i], self.ns_hs[i])
        self.ns(self.ns_mc, "ip", "addr", "add", f"{self.leg_mc[i]}/24", "dev", self.if_mc_legs[i])
        self.ns(self.ns_hs[i], "ip", "addr", "add", f"{self.leg_helper[i]}/24", "dev", self.if_h_legs[i])

    def steer(self, mode: str, helpers: list[int] | None = None) -> None:
        """Clients' frames for the service address go to memcached ("direct") or to the helpers ("helper"):
        client namespace i to helper ``helpers[i % len(helpers)]`` (default: all to helper 0)."""
        if mode not in ("direct", "helper"):
            raise TopoError(f"steer({mode!r}): mode is 'direct' or 'helper'")
        order = helpers or [0]
        for i, ns in enumerate(self.ns_c):
            mac = self.mac_mc if mode == "direct" else self.mac_hs[order[i % len(order)]]
            self.ns(ns, "ip", "neigh", "replace", SVC_IP, "lladdr", mac, "dev", self.if_c[i], "nud", "permanent")

    def destroy(self) -> None:
        for i, proc in enumerate(self.helpers):
            if proc is not None:
                self.stop_helper(index=i)
        self.sup.stop_all()
        for name in reversed(self.made):
            sh("ip", "netns", "del", name, check=False)
        self.made.clear()
        for prefix in self.helper_prefixes:
            control.remove_runtime(prefix)
        shutil.rmtree(self.stats_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this topology, and its stats directory, still present (should be none after destroy)."""
        names = sh("ip", "netns", "list", check=False)
        return [n.split()[0] for n in names.splitlines() if n.startswith(f"vfm-{self.tag}-")] + \
            ([self.stats_dir] if os.path.exists(self.stats_dir) else [])

    # ------------------------------------------------------------------ daemons

    def start_memcached(self, threads: int = 1, mem_mb: int = 64, extra: tuple[str, ...] = ()) -> Proc:
        cmd = ["ip", "netns", "exec", self.ns_mc, *self.pin, "memcached", "-U", str(SVC_PORT), "-p", str(SVC_PORT),
               "-t", str(threads), "-m", str(mem_mb), "-c", "4096", "-u", "root", *extra]
        self.memcached = self.sup.start("memcached", cmd)
        wait_for(lambda: self._listening(), 10, f"memcached listening on {SVC_IP}:{SVC_PORT} in {self.ns_mc}")
        return self.memcached

    def _listening(self) -> bool:
        if self.memcached is not None and not self.memcached.alive():
            raise TopoError(f"memcached exited:\n{self.memcached.tail()}")
        out = self.ns(self.ns_mc, "ss", "-ltnH", f"sport = :{SVC_PORT}", check=False)
        return bool(out.strip())

    def helper_cmd(self, binary: str, lcores: str = "1", args: tuple[str, ...] = (), mem_mb: int = 64,
                   index: int = 0) -> list[str]:
        nq = len(parse_lcores(lcores))
        from vfab.services.memcached_helper.control import af_packet_vdev
        vdev, _ = af_packet_vdev(self.if_hs[index], nq)
        return ["ip", "netns", "exec", self.ns_hs[index], binary, "-l", lcores, "--no-huge", "--no-pci", "-m",
                str(mem_mb), f"--file-prefix={self.helper_prefixes[index]}", f"--vdev={vdev}",
                "--log-level=user1,info", "--", "--service", f"{SVC_IP}:{SVC_PORT}", "--memcached",
                f"{self.leg_mc[index]}:{SVC_PORT}", "--stats-file", self.stats_paths[index], "--stats-ms", "50",
                *args]

    def start_helper(self, binary: str, lcores: str = "1", args: tuple[str, ...] = (),
                     env: dict | None = None, index: int = 0) -> Proc:
        """mc-helper in helper namespace ``index``; returns once its TCP connections are up."""
        if os.path.exists(self.stats_paths[index]):
            os.unlink(self.stats_paths[index])
        name = "helper" if index == 0 else f"helper{index}"
        proc = self.helpers[index] = self.sup.start(name, self.helper_cmd(binary, lcores, args, index=index),
                                                    env=env)

        def up() -> bool:
            if not proc.alive():
                raise TopoError(f"mc-helper exited ({proc.popen.returncode}):\n{proc.tail(40)}")
            st = self.stats(index)
            return bool(st) and st.get("conns_up") == st.get("conns")
        wait_for(up, 20, f"mc-helper's connections to memcached up (stats {self.stats_paths[index]})")
        return proc

    def stop_helper(self, sig: int = signal.SIGTERM, index: int = 0) -> int | None:
        """Stop helper ``index`` by PID; its exit code (0 after a clean SIGTERM)."""
        proc, self.helpers[index] = self.helpers[index], None
        rc = self.sup.stop(proc, sig=sig, grace=10) if proc else None
        control.remove_runtime(self.helper_prefixes[index])
        return rc

    def start_twemproxy(self, cpus: str = "1", extra_conf: str = "") -> Proc:
        """twemproxy (nutcracker) in the first helper's namespace, listening on PROXY_IP:PROXY_PORT (TCP) and
        forwarding to memcached over that namespace's leg.  The first helper must not be running (same port)."""
        if self.helpers[0] is not None:
            raise TopoError("twemproxy takes the first helper's port: stop mc-helper first")
        binary = shutil.which("nutcracker") or "/usr/sbin/nutcracker"
        if not os.path.exists(binary):
            raise TopoError("twemproxy not found: install Debian's nutcracker (scripts/bootstrap.sh)")
        conf = os.path.join(self.workdir, "twemproxy.yml")
        with open(conf, "w") as fh:
            fh.write(f"vfm:\n  listen: {PROXY_IP}:{PROXY_PORT}\n  hash: fnv1a_64\n  distribution: ketama\n"
                     f"  timeout: 2000\n  redis: false\n  server_connections: 1\n{extra_conf}"
                     f"  servers:\n   - {self.leg_mc[0]}:{SVC_PORT}:1\n")
        self.ns(self.ns_h, "ip", "addr", "replace", f"{PROXY_IP}/24", "dev", self.if_h)
        self.twemproxy = self.sup.start("twemproxy", ["ip", "netns", "exec", self.ns_h, "taskset", "-c", cpus, binary,
                                                      "-c", conf, "-s", "22222", "-a", "127.0.0.1", "-v", "4"])

        def up() -> bool:
            if not self.twemproxy.alive():
                raise TopoError(f"nutcracker exited ({self.twemproxy.popen.returncode}):\n{self.twemproxy.tail()}")
            return bool(self.ns(self.ns_h, "ss", "-ltnH", f"sport = :{PROXY_PORT}", check=False).strip())
        wait_for(up, 10, f"twemproxy listening on {PROXY_IP}:{PROXY_PORT} in {self.ns_h}")
        return self.twemproxy

    def stop_twemproxy(self) -> int | None:
        proc, self.twemproxy = self.twemproxy, None
        rc = self.sup.stop(proc) if proc else None
        self.ns(self.ns_h, "ip", "addr", "del", f"{PROXY_IP}/24", "dev", self.if_h, check=False)
        return rc

    def proxy(self) -> str:
        return f"{PROXY_IP}:{PROXY_PORT}"

    def stats(self, index: int = 0) -> dict[str, int]:
        """Helper ``index``'s counters as of this call: while it runs, a stats file it wrote after the call
        (the file is rewritten every 50 ms, so a read right after some traffic could miss its last counts)."""
        proc = self.helpers[index]
        if proc is not None and proc.alive():
            return control.read_stats_after(self.stats_paths[index], time.time_ns())
        return control.read_stats(self.stats_paths[index])

    def wait_stats(self, pred, timeout: float, what: str, index: int = 0) -> dict[str, int]:
        box: dict = {}

        def ok() -> bool:
            box["st"] = self.stats(index)
            return bool(box["st"]) and pred(box["st"])
        try:
            wait_for(ok, timeout, what)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last stats: {box.get('st')}") from None
        return box["st"]

    def memcached_stats(self) -> dict[str, str]:
        """memcached's own ``stats`` over TCP on the helper leg (from the helper's namespace)."""
        code = ("import socket,sys;s=socket.create_connection((sys.argv[1],int(sys.argv[2])),5);"
                "s.sendall(b'stats\\r\\n');b=b''\nwhile not b.endswith(b'END\\r\\n'): b+=s.recv(65536)\n"
                "sys.stdout.write(b.decode())")
        out = self.ns(self.ns_h, sys.executable, "-c", code, LEG_MC, str(SVC_PORT))
        return {p[1]: p[2] for p in (line.split() for line in out.splitlines()) if len(p) == 3 and p[0] == "STAT"}

    # ------------------------------------------------------------------ clients

    def client_cmd(self, i: int, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns_c[i], *self.pin, sys.executable, MCUDP, *args]

    def spawn_client(self, i: int, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.client_cmd(i, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run_client(self, i: int, *args: str, timeout: float = 120) -> dict:
        return finish(self.spawn_client(i, *args), timeout)

    def run_clients(self, args_per_client: list[tuple[int, tuple[str, ...]]], timeout: float = 120) -> list[dict]:
        """Several client processes at once (namespace index, arguments); their JSON results in order."""
        procs = [self.spawn_client(i, *args) for i, args in args_per_client]
        return [finish(p, timeout) for p in procs]

    def preload(self, keys: int, prefix: str = "k", value_size: int = 64) -> dict:
        cmd = ["ip", "netns", "exec", self.ns_h, sys.executable, MCUDP, "preload", "--tcp", f"{LEG_MC}:{SVC_PORT}",
               "--keys", str(keys), "--prefix", prefix, "--value-size", str(value_size)]
        return finish(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), 120)

    def store(self, items: list[tuple[bytes, int, bytes]]) -> dict:
        """Store (key, flags, value) items in memcached over TCP, from the helper's namespace."""
        path = os.path.join(self.workdir, f"items-{uuid.uuid4().hex[:6]}.json")
        with open(path, "w") as fh:
            json.dump([[k.hex(), f, v.hex()] for k, f, v in items], fh)
        cmd = ["ip", "netns", "exec", self.ns_h, sys.executable, MCUDP, "store", "--tcp", f"{LEG_MC}:{SVC_PORT}",
               "--items", path]
        return finish(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), 120)

    def run_script(self, i: int, script: list[dict], timeout: float = 2.0) -> list[dict]:
        """Scripted requests from client namespace i (see mcudp.py run); their raw results."""
        path = os.path.join(self.workdir, f"script-{uuid.uuid4().hex[:6]}.json")
        with open(path, "w") as fh:
            json.dump(script, fh)
        return self.run_client(i, "run", "--server", self.server(), "--script", path, "--timeout", str(timeout),
                               timeout=60 + 3 * timeout * len(script))["results"]

    def server(self) -> str:
        return f"{SVC_IP}:{SVC_PORT}"


class PairTopo(HelperTopo):
    """The throughput rig::

        vfm-T-c0  vfmTc0 --veth-- vfmTh  vfm-T-h (the device under test: mc-helper or testpmd)
                                          vfmThk 10.78.0.2 --veth-- 10.78.0.1 vfm-T-mc (memcached)

    No bridge and no other port: a generator in vfm-T-c0 (``dpdk/mch_blast.c``) sends straight to the device
    under test, and what it sends back is counted on vfmTc0 (rx_packets).
    """

    def __init__(self, workdir: str, tag: str | None = None, pin: str | None = None):
        super().__init__(workdir, clients=1, tag=tag, pin=pin, helpers=1)

    def create(self) -> None:
        self._require()
        try:
            for name in (self.ns_mc, self.ns_h, self.ns_c[0]):
                self._netns(name)
            self._veth(self.if_c[0], self.ns_c[0], self.if_h, self.ns_h)
            self._leg(0)
            self.mac_hs[0] = self.mac(self.ns_h, self.if_h)
        except Exception:
            self.destroy()
            raise

    def steer(self, mode: str, helpers: list[int] | None = None) -> None:
        raise TopoError("PairTopo has no front door to steer: the generator is wired to the helper's port")


def finish(p: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise TopoError(f"client timed out after {timeout} s: {err[-2000:]}") from None
    if p.returncode != 0:
        raise TopoError(f"client failed ({p.returncode}): {err[-3000:]}")
    return json.loads(out)


def parse_lcores(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat); OSError if it is gone."""
    st = proc_stat(pid)
    if st is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return st.cpu_s

