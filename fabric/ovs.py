"""Local Open vSwitch management through ovs-vsctl (OVSDB): start it if needed, bridges, ports.

Bridges use the userspace datapath (``datapath_type=netdev``) by default: the
machines vfab is tested on have no OVS kernel module.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from vfab.vid.errors import VfabError

log = logging.getLogger("vfab.ovs")
OVS_CTL = "/usr/share/openvswitch/scripts/ovs-ctl"


class OvsError(VfabError):
    pass


def _env(rundir: str | None) -> dict | None:
    """The environment that points the OVS tools at the daemons of run directory ``rundir`` (None: this
    process's own ``$OVS_RUNDIR``, else the machine's)."""
    return None if rundir is None else dict(os.environ, OVS_RUNDIR=rundir)


def vsctl(*args: str, timeout: int = 10, rundir: str | None = None) -> str:
    if shutil.which("ovs-vsctl") is None:
        raise OvsError("ovs-vsctl is not installed: run 'make bootstrap' (Debian package openvswitch-switch)")
    proc = subprocess.run(["ovs-vsctl", f"--timeout={timeout}", *args], capture_output=True, text=True,
                          env=_env(rundir))
    if proc.returncode != 0:
        raise OvsError(f"ovs-vsctl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def running() -> bool:
    if shutil.which("ovs-vsctl") is None:
        return False
    proc = subprocess.run(["ovs-vsctl", "--timeout=2", "show"], capture_output=True, text=True)
    return proc.returncode == 0 and os.path.exists("/var/run/openvswitch/ovs-vswitchd.pid")


def ensure_running() -> bool:
    """Start ovsdb-server and ovs-vswitchd if they are not running. True if this call started them."""
    if running():
        return False
    if not os.path.exists(OVS_CTL):
        raise OvsError(f"{OVS_CTL} not found: run 'make bootstrap' (Debian package openvswitch-switch)")
    log.info("starting Open vSwitch (ovs-ctl start; userspace datapath)")
    proc = subprocess.run([OVS_CTL, "start", "--system-id=random"], capture_output=True, text=True)
    if not running():
        raise OvsError(f"Open vSwitch did not start: {proc.stdout[-400:]} {proc.stderr[-400:]}")
    return True


def stop() -> None:
    subprocess.run([OVS_CTL, "stop"], capture_output=True, text=True)


def add_bridge(name: str, dpid: int | None = None, controller: str | None = None,
               datapath: str = "netdev", fail_mode: str = "secure") -> None:
    args = ["--may-exist", "add-br", name, "--", "set", "bridge", name, f"datapath_type={datapath}",
            f"fail_mode={fail_mode}", "protocols=OpenFlow13,OpenFlow14"]
    if dpid is not None:
        args += [f"other_config:datapath-id={dpid:016x}"]
    vsctl(*args)
    if controller:
        vsctl("set-controller", name, controller)


def del_bridge(name: str) -> None:
    vsctl("--if-exists", "del-br", name)


def add_ports(bridge: str, ports: list[tuple[str, int]]) -> None:
    """Add many ports in one ovs-vsctl call (one call per port is ~100x slower)."""
    args: list[str] = []
    for name, ofport in ports:
        args += ["--", "--may-exist", "add-port", bridge, name, "--", "set", "interface", name,
                 f"ofport_request={ofport}"]
    if args:
        vsctl(*args[1:])


def bridges() -> list[str]:
    out = vsctl("list-br")
    return [b for b in out.splitlines() if b]


def ofctl(*args: str, stdin: str | None = None, timeout: int = 10, rundir: str | None = None) -> str:
    """``ovs-ofctl -O OpenFlow14 ARGS`` (a bridge name reaches its ``$OVS_RUNDIR/BRIDGE.mgmt`` socket)."""
    if shutil.which("ovs-ofctl") is None:
        raise OvsError("ovs-ofctl is not installed: run 'make bootstrap' (Debian package openvswitch-common)")
    proc = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", f"--timeout={timeout}", *args], input=stdin,
                          capture_output=True, text=True, env=_env(rundir))
    if proc.returncode != 0:
        raise OvsError(f"ovs-ofctl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def rows(table: str, *columns: str, where: list[str] = (), rundir: str | None = None) -> list[dict]:
    """The rows of an OVSDB table (``ovs-vsctl find``/``list`` as JSON) as dicts of plain Python values:
    maps become dicts, sets lists, UUIDs strings."""
    import json

    args = ["--format=json", "--data=json", f"--columns={','.join(columns)}"]
    args += ["find", table, *where] if where else ["list", table]
    data = json.loads(vsctl(*args, rundir=rundir) or '{"headings": [], "data": []}')
    return [{h: _ovsdb_value(v) for h, v in zip(data["headings"], row)} for row in data["data"]]


def _ovsdb_value(v):
    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
        kind, body = v
        if kind == "map":
            return {_ovsdb_value(k): _ovsdb_value(x) for k, x in body}
        if kind == "set":
            return [_ovsdb_value(x) for x in body]
        if kind == "uuid":
            return body
    return v


def appctl(*args: str, target: str = "ovs-vswitchd", timeout: int = 10, rundir: str | None = None) -> str:
    """``ovs-appctl -t TARGET ARGS`` (the daemon found through its pidfile in ``$OVS_RUNDIR``)."""
    proc = subprocess.run(["ovs-appctl", f"--timeout={timeout}", "-t", target, *args], capture_output=True,
                          text=True, env=_env(rundir))
    if proc.returncode != 0:
        raise OvsError(f"ovs-appctl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout
