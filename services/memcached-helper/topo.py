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
import uuid

from vfab.testbed.procs import Proc, Supervisor, wait_for

SVC_IP = "10.77.0.1"
SVC_PORT = 11211
LEG_MC = "10.78.0.1"
LEG_HELPER = "10.78.0.2"
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


class HelperTopo:
    def __init__(self, workdir: str, clients: int = 2, tag: str | None = None, pin: str | None = None):
        """``pin``: CPU list for memcached and the clients (taskset), e.g. "0" with the helper on lcore 1, so
        the polling helper does not compete with them for one core."""
        self.tag = tag or uuid.uuid4().hex[:5]
        self.pin = ["taskset", "-c", pin] if pin else []
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.sup = Supervisor(os.path.join(workdir, "logs"))
        t = self.tag
        self.ns_sw, self.ns_mc, self.ns_h = f"vfm-{t}-sw", f"vfm-{t}-mc", f"vfm-{t}-h"
        self.ns_c = [f"vfm-{t}-c{i}" for i in range(clients)]
        self.br = f"vfm{t}br"
        self.if_c = [f"vfm{t}c{i}" for i in range(clients)]
        self.if_mc, self.if_h = f"vfm{t}m", f"vfm{t}h"
        self.if_mc_leg, self.if_h_leg = f"vfm{t}mk", f"vfm{t}hk"
        self.client_ips = [f"10.77.0.{11 + i}" for i in range(clients)]
        self.made: list[str] = []
        self.memcached: Proc | None = None
        self.helper: Proc | None = None
        self.helper_prefix = f"vfm{t}"
        self.stats_path = os.path.join(workdir, "helper.stats")
        self.mac_mc = self.mac_h = ""

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

    def mac(self, ns: str, dev: str) -> str:
        return json.loads(self.ns(ns, "ip", "-j", "link", "show", dev))[0]["address"]

    def create(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ethtool") is None:
            raise TopoError("the helper topology needs root, iproute2 and ethtool (scripts/bootstrap.sh)")
        t = self.tag
        try:
            for name in (self.ns_sw, self.ns_mc, self.ns_h, *self.ns_c):
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
            self._veth(self.if_h, self.ns_h, f"vfm{t}ph", self.ns_sw)
            self._port(f"vfm{t}ph")
            self._veth(self.if_mc_leg, self.ns_mc, self.if_h_leg, self.ns_h)
            self.ns(self.ns_mc, "ip", "addr", "add", f"{LEG_MC}/24", "dev", self.if_mc_leg)
            self.ns(self.ns_h, "ip", "addr", "add", f"{LEG_HELPER}/24", "dev", self.if_h_leg)
            self.mac_mc = self.mac(self.ns_mc, self.if_mc)
            self.mac_h = self.mac(self.ns_h, self.if_h)
        except Exception:
            self.destroy()
            raise

    def steer(self, mode: str) -> None:
        """Clients' frames for the service address go to memcached ("direct") or to the helper ("helper")."""
        mac = {"direct": self.mac_mc, "helper": self.mac_h}[mode]
        for i, ns in enumerate(self.ns_c):
            self.ns(ns, "ip", "neigh", "replace", SVC_IP, "lladdr", mac, "dev", self.if_c[i], "nud", "permanent")

    def destroy(self) -> None:
        if self.helper is not None:
            self.stop_helper()
        self.sup.stop_all()
        for name in reversed(self.made):
            sh("ip", "netns", "del", name, check=False)
        self.made.clear()
        shutil.rmtree(f"/var/run/dpdk/{self.helper_prefix}", ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this topology still present (should be none after destroy)."""
        names = sh("ip", "netns", "list", check=False)
        return [n.split()[0] for n in names.splitlines() if n.startswith(f"vfm-{self.tag}-")]

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

    def helper_cmd(self, binary: str, lcores: str = "1", args: tuple[str, ...] = (), mem_mb: int = 64) -> list[str]:
        nq = len(parse_lcores(lcores))
        # 4096 frames per ring (default 512): a burst of clients must not overrun the kernel's rx ring
        vdev = f"net_af_packet0,iface={self.if_h},framecnt=4096" + (f",qpairs={nq}" if nq > 1 else "")
        return ["ip", "netns", "exec", self.ns_h, binary, "-l", lcores, "--no-huge", "--no-pci", "-m", str(mem_mb),
                f"--file-prefix={self.helper_prefix}", f"--vdev={vdev}", "--log-level=user1,info", "--",
                "--service", f"{SVC_IP}:{SVC_PORT}", "--memcached", f"{LEG_MC}:{SVC_PORT}",
                "--stats-file", self.stats_path, "--stats-ms", "50", *args]

    def start_helper(self, binary: str, lcores: str = "1", args: tuple[str, ...] = (),
                     env: dict | None = None) -> Proc:
        if os.path.exists(self.stats_path):
            os.unlink(self.stats_path)
        self.helper = self.sup.start("helper", self.helper_cmd(binary, lcores, args), env=env)

        def up() -> bool:
            if not self.helper.alive():
                raise TopoError(f"mc-helper exited ({self.helper.popen.returncode}):\n{self.helper.tail(40)}")
            st = self.stats()
            return bool(st) and st.get("conns_up") == st.get("conns")
        wait_for(up, 20, f"mc-helper's connections to memcached up (stats {self.stats_path})")
        return self.helper

    def stop_helper(self, sig: int = signal.SIGTERM) -> int | None:
        """Stop the helper by PID; its exit code (0 after a clean SIGTERM)."""
        proc, self.helper = self.helper, None
        rc = self.sup.stop(proc, sig=sig, grace=10) if proc else None
        shutil.rmtree(f"/var/run/dpdk/{self.helper_prefix}", ignore_errors=True)
        return rc

    def stats(self) -> dict[str, int]:
        try:
            with open(self.stats_path) as fh:
                return {k: int(v) for k, v in (line.split() for line in fh if line.strip())}
        except FileNotFoundError:
            return {}

    def wait_stats(self, pred, timeout: float, what: str) -> dict[str, int]:
        box: dict = {}

        def ok() -> bool:
            box["st"] = self.stats()
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
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

