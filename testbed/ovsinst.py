"""One Open vSwitch of its own inside a network namespace: an emulated host's ovsdb-server + ovs-vswitchd.

As OVS's own test suite and ``ovs-sim`` run many "hypervisors" on one machine: a run directory per instance
(``OVS_RUNDIR`` = ``OVS_DBDIR`` = ``OVS_LOGDIR``, its database, sockets, pidfiles and logs there), the
daemons started inside the instance's namespace (the netdev datapath's ``ovs-netdev`` tap and the bridges'
internal ports are devices of that namespace: two instances in one namespace collide on them).  The
daemons run in the foreground under the testbed's ``Supervisor`` (stopped by PID); ``ip netns exec`` execs
them, so the supervised PID is the daemon's.  The database outlives the daemons: ``kill()`` then ``start()``
is a host's crash and reboot with its configuration kept.
"""

from __future__ import annotations

import os
import subprocess

from vfab.fabric import ovs
from vfab.testbed.procs import Proc, Supervisor, wait_for

SCHEMA = "/usr/share/openvswitch/vswitch.ovsschema"


class OvsInstance:
    def __init__(self, name: str, netns: str | None, rundir: str, sup: Supervisor, sandbox: bool = False):
        self.name = name          # for process names and messages
        self.netns = netns        # namespace name (ip netns); None: this one's (a sandbox only)
        self.sandbox = sandbox
        if netns is None and not sandbox:
            raise ovs.OvsError(f"{name}: an instance with a datapath needs a namespace of its own (its devices "
                               "would collide with another's): give netns, or sandbox=True")
        self.rundir = rundir
        self.sup = sup
        self.db_proc: Proc | None = None
        self.sw_proc: Proc | None = None

    @property
    def env(self) -> dict:
        return {"OVS_RUNDIR": self.rundir, "OVS_DBDIR": self.rundir, "OVS_LOGDIR": self.rundir}

    @property
    def db(self) -> str:
        return os.path.join(self.rundir, "conf.db")

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (self.sw_proc, self.db_proc) if p is not None]

    def alive(self) -> bool:
        return all(p.alive() for p in (self.db_proc, self.sw_proc) if p is not None) and self.sw_proc is not None

    def start(self, timeout: float = 20.0) -> None:
        os.makedirs(self.rundir, exist_ok=True)
        if not os.path.exists(self.db):
            subprocess.run(["ovsdb-tool", "create", self.db, SCHEMA], check=True, capture_output=True)
        sock = os.path.join(self.rundir, "db.sock")
        if os.path.exists(sock):   # a crashed server's: the wait below is for the new one's
            os.unlink(sock)
        ns = ["ip", "netns", "exec", self.netns] if self.netns else []
        dummy = ["--enable-dummy=override"] if self.sandbox else []
        self.db_proc = self.sup.start(f"{self.name}-ovsdb", [
            *ns, "ovsdb-server", self.db, f"--remote=punix:{sock}", "--pidfile", "--log-file", "-vconsole:emer"],
            env=self.env)
        wait_for(lambda: os.path.exists(sock) or not self.db_proc.alive(), timeout, f"{self.name}'s ovsdb-server")
        if not self.db_proc.alive():
            raise ovs.OvsError(f"{self.name}: ovsdb-server exited at start:\n{self.db_proc.tail()}")
        ovs.vsctl("--no-wait", "init", rundir=self.rundir)
        self.sw_proc = self.sup.start(f"{self.name}-vswitchd", [
            *ns, "ovs-vswitchd", f"unix:{sock}", *dummy, "--pidfile", "--log-file", "-vconsole:emer"], env=self.env)
        pidfile = os.path.join(self.rundir, "ovs-vswitchd.pid")
        wait_for(lambda: os.path.exists(pidfile) or not self.sw_proc.alive(), timeout, f"{self.name}'s ovs-vswitchd")
        if not self.sw_proc.alive():
            raise ovs.OvsError(f"{self.name}: ovs-vswitchd exited at start:\n{self.sw_proc.tail()}")
        ovs.vsctl("show", rundir=self.rundir)   # waits until the daemon answers through the database

    def kill(self) -> None:
        """Crash both daemons (SIGKILL): the host's switch is gone, its database file stays."""
        for p in self.procs:
            self.sup.kill9(p)
        self.db_proc = self.sw_proc = None
        for f in ("ovs-vswitchd.pid", "ovsdb-server.pid"):
            try:
                os.unlink(os.path.join(self.rundir, f))
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        for p in self.procs:
            self.sup.stop(p)
        self.db_proc = self.sw_proc = None

    def vsctl(self, *args: str) -> str:
        return ovs.vsctl(*args, rundir=self.rundir)

    def ofctl(self, *args: str, stdin: str | None = None) -> str:
        return ovs.ofctl(*args, stdin=stdin, rundir=self.rundir)

    def appctl(self, *args: str) -> str:
        proc = subprocess.run(["ovs-appctl", "-t", "ovs-vswitchd", *args], capture_output=True, text=True,
                              env=dict(os.environ, **self.env))
        if proc.returncode != 0:
            raise ovs.OvsError(f"{self.name}: ovs-appctl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout
