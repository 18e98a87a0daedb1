"""Fabric life cycle and health: ``up``, ``down``, ``status``, ``exec``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import click

from vfab.cli.cmd_state import fmt_rate, fmt_ranges, load_by_range, op_json, ops_of, range_load
from vfab.cli.common import STATE_DIR, STATE_FILE, errors, pass_ctx, read_state, table
from vfab.services.memcached_helper import control as helper_control
from vfab.testbed.hosts import MAX_HOSTS, check_size
from vfab.testbed.net import TopoError, TopoSpec
from vfab.vid.registry import schema
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import RegistryError
from vfab.vid.ranges import Range


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _topo(ctx, param, value):
    try:
        TopoSpec.parse(value)
    except Exception as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.command("up")
@click.option("--topo", default="line,2,3", show_default=True, callback=_topo,
              help="Mininet fabric: single,N | line,S,H | tree,S,H (S switches, H hosts each).")
@click.option("--timeout", type=float, default=90, show_default=True, help="Seconds to wait for it.")
@click.option("--etcd-members", type=click.IntRange(1, 9), default=None,
              help="etcd members to run on this machine: 1, or a cluster of 3 or 5 (each its own ports and "
                   "data dir; the fabric then survives the death of any one). Default: 1; with --hosts, one "
                   "on each of the first 3 hosts (1 below 3 hosts).")
@click.option("--hosts", type=int, default=None,
              help=f"Instead of the Mininet fabric: N emulated hosts (1 to {MAX_HOSTS}), each a network namespace "
                   "with its own Open vSwitch, node agent and (first 3) etcd member, joined by Geneve tunnels.")
@click.option("--ports", type=click.IntRange(0, 8), default=1, show_default=True,
              help="With --hosts: ports per host (namespaces vfnNpK to run services and clients in).")
@click.pass_context
def up(ctx, topo: str, timeout: float, etcd_members: int | None, hosts: int | None, ports: int) -> None:
    """Start a local fabric: etcd, Open vSwitch, the controller and a Mininet net; or, with --hosts N,
    N emulated hosts with an etcd cluster and node agents.

    Everything runs in the background until 'vfab down'. Hosts are named vfh1,
    vfh2, ...; run programs in them with 'vfab exec HOST -- CMD'.
    """
    from click.core import ParameterSource

    if hosts is not None:
        if ctx.get_parameter_source("topo") is not ParameterSource.DEFAULT:
            raise click.UsageError("--topo builds the one-machine Mininet fabric and --hosts N builds N emulated "
                                   "hosts: give one of them")
        try:
            check_size(hosts, etcd_members)
        except TopoError as exc:
            raise click.BadParameter(str(exc), param_hint="--hosts/--etcd-members") from None
    elif etcd_members is not None and etcd_members % 2 == 0:
        raise click.BadParameter(f"{etcd_members} members tolerate no more failures than {etcd_members - 1}: "
                                 "use 1, 3 or 5", param_hint="--etcd-members")
    state = read_state()
    if state and _alive(state["pid"]):
        raise click.ClickException(f"a fabric is already up (pid {state['pid']}, etcd {state['etcd']}): "
                                   "'vfab down' first")
    if os.geteuid() != 0:
        raise click.ClickException("vfab up needs root (network namespaces, Open vSwitch): run it with sudo")
    os.makedirs(STATE_DIR, exist_ok=True)
    log = open(os.path.join(STATE_DIR, "fabric.log"), "ab")
    cmd = [sys.executable, "-m", "vfab.testbed.daemon", "--topo", topo, "--state-file", STATE_FILE]
    if etcd_members is not None:
        cmd += ["--etcd-members", str(etcd_members)]
    if hosts is not None:
        cmd += ["--hosts", str(hosts), "--ports", str(ports)]
    from vfab.testbed.lock import LOCK_FD_ENV

    held = os.environ.get(LOCK_FD_ENV, "")   # a caller holding the testbed lock hands it down
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                            pass_fds=(int(held),) if held.isdigit() else ())
    t0 = time.monotonic()
    what = f"{hosts} hosts" if hosts is not None else topo
    with click.progressbar(length=int(timeout), label=f"starting fabric {what}", show_eta=False) as bar:
        while read_state() is None:
            if proc.poll() is not None:
                raise click.ClickException(f"the fabric did not start (exit {proc.returncode}); "
                                           f"see {STATE_DIR}/fabric.log")
            if time.monotonic() - t0 > timeout:
                os.kill(proc.pid, signal.SIGTERM)
                raise click.ClickException(f"the fabric did not come up in {timeout:.0f} s; "
                                           f"see {STATE_DIR}/fabric.log")
            time.sleep(0.2)
            bar.update(int(time.monotonic() - t0) - bar.pos)
    state = read_state()
    if state.get("kind") == "hosts":
        click.echo(describe_hosts(state, time.monotonic() - t0))
        return
    click.echo(f"fabric up in {time.monotonic() - t0:.1f} s: etcd {state['etcd']}, "
               f"{len(state['switches'])} switches, hosts {', '.join(state['hosts'])}")


def describe_hosts(state: dict, took: float) -> str:
    """How to reach a multi-host fabric 'vfab up --hosts N' started."""
    nodes = state["nodes"]
    members = state["etcd_members"]
    first = next(iter(nodes))
    lines = [f"fabric up in {took:.1f} s: {len(nodes)} hosts ({', '.join(nodes)}), etcd cluster of {len(members)} "
             f"(members on {', '.join(m['host'] for m in members.values())}), node agents joined",
             f"  from this machine: vfab ... (etcd {state['etcd']}, relayed onto the control network: the "
             "default while the fabric is up)",
             f"  on a host:         vfab exec {first} -- vfab node list   (each host lists its own member first, "
             f"e.g. {nodes[first]['etcd']})"]
    if state["hosts"]:
        ports = ", ".join(f"{p} ({h['node']})" for p, h in state["hosts"].items())
        lines.append(f"  ports:             {ports}: vfab exec PORT -- CMD")
    lines.append("  stop it with:      vfab down")
    return "\n".join(lines)


@click.command("down")
@click.option("--timeout", type=float, default=60, show_default=True, help="Seconds to wait for it.")
def down(timeout: float) -> None:
    """Stop the fabric 'vfab up' started (by its PID) and remove what it created."""
    state = read_state()
    if not state or not _alive(state["pid"]):
        click.echo("no fabric is up")
        return
    os.kill(state["pid"], signal.SIGTERM)
    t0 = time.monotonic()
    while _alive(state["pid"]) and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    if _alive(state["pid"]):
        raise click.ClickException(f"fabric pid {state['pid']} still running after {timeout:.0f} s")
    click.echo(f"fabric down ({time.monotonic() - t0:.1f} s)")


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("host")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, required=True)
def exec_(host: str, cmd: tuple[str, ...]) -> None:
    """Run CMD inside Mininet host HOST of the fabric 'vfab up' started."""
    state = read_state()
    if not state:
        raise click.ClickException("no fabric is up: 'vfab up' first")
    where = {**state.get("nodes", {}), **state["hosts"]}
    if host not in where:
        raise click.BadParameter(f"no host {host!r} (hosts: {', '.join(where)})", param_hint="HOST")
    h = where[host]
    if "netns" in h:   # 'vfab up --hosts N': a host (its Open vSwitch's run directory set) or a port
        if "ovs_rundir" in h:
            os.environ["OVS_RUNDIR"] = h["ovs_rundir"]
            os.environ["VFAB_ETCD"] = h["etcd"]
        os.execvp("ip", ["ip", "netns", "exec", os.path.basename(h["netns"]), *cmd])
    os.execvp("mnexec", ["mnexec", "-a", str(h["pid"]), *cmd])


@click.command("netns")
@click.argument("host")
def netns(host: str) -> None:
    """Print the network-namespace path of fabric host HOST (for a service's --netns)."""
    state = read_state()
    if not state:
        raise click.ClickException("no fabric is up: 'vfab up' first")
    where = {**state.get("nodes", {}), **state["hosts"]}
    if host not in where:
        raise click.BadParameter(f"no host {host!r} (hosts: {', '.join(where)})", param_hint="HOST")
    click.echo(where[host].get("netns") or f"/proc/{where[host]['pid']}/ns/net")


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors
def status(c, as_json: bool) -> None:
    """Health of the fabric: etcd, controller, switches, services, ranges (keys, req/s) and state operations."""
    state = read_state()
    reg = c.registry
    try:
        rev, _ = reg.get_prefix(schema.folder("switches"))
    except RegistryError as exc:
        raise click.ClickException(str(exc)) from None
    applied = reg.applied()
    switches = reg.switches()
    services = []
    for s in reg.services():
        rs = [r for r, _ in reg.ranges(s.name)]
        eps = reg.endpoints(s.name)
        loads = load_by_range(reg, s.name)
        live_helpers = helper_control.live_helpers(reg, s.name)
        try:   # helpers set by hand ('vfab helpers on|off'); unreadable: the balancer holds every range
            held = [h for h, _, _ in reg.holds(s.name)[0].ranges()]
        except RegistryError:
            held = [Range(0, KEY_MAX)]
        services.append({"name": s.name, "id": s.id, "ranges": len(rs),
                         "unassigned": sum(1 for r in rs if not r.owner),
                         "endpoints": [e.name for e in eps],
                         "orphaned": sorted({r.owner for r in rs if r.owner and r.owner not in {e.name for e in eps}}),
                         "helpers": live_helpers,   # live PostMan helpers ('vfab helpers SERVICE' for more)
                         # per range: the owner's report (keys, req/s; null without one); state operations
                         "range_map": [{"lo": r.lo, "hi": r.hi, "owner": r.owner, "mirrors": list(r.mirrors),
                                        "helpers": [h if h in live_helpers else f"{h} (DEAD)" for h in r.helpers],
                                        "helpers_held": any(h.overlaps(r.range) for h in held),
                                        "state": r.state, "epoch": r.epoch,
                                        "keys": load[0] if (load := range_load(loads, r)) else None,
                                        "req_s": load[1] if load else None} for r in rs],
                         "ops": [op_json(op) for op in ops_of(reg, s.name)]})
    members = reg.members.survey() if len(reg.members.all) > 1 else []
    out = {
        "etcd": {"endpoint": reg.endpoint, "revision": rev, "using": reg.member,
                 "members": [{"member": m.member, "leader": m.is_leader, "raft_term": m.raft_term,
                              "revision": m.revision, "error": m.error} for m in members]},
        "controller": None,
        "switches": [{"name": s.name, "dpid": f"{s.dpid:016x}",
                      "applied": applied[s.dpid].revision if s.dpid in applied else None,
                      "flows": applied[s.dpid].flows if s.dpid in applied else None,
                      "age_s": round(time.time() - applied[s.dpid].at, 1) if s.dpid in applied else None}
                     for s in switches],
        "services": services,
    }
    if state and state.get("controller"):
        out["controller"] = {"pid": state["controller"]["pid"], "alive": _alive(state["controller"]["pid"]),
                             "port": state["controller"]["port"]}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    ctl = out["controller"]
    click.echo(f"etcd {reg.endpoint} at revision {rev}; controller: "
               + (f"pid {ctl['pid']} {'running' if ctl['alive'] else 'DOWN'}" if ctl else
                  f"none ('vfab up --hosts': {len(state['nodes'])} hosts, see 'vfab node list')"
                  if state and state.get("kind") == "hosts" else "not started by 'vfab up'"))
    if members:
        c.console.print(table(f"etcd members (using {reg.member})", ["member", "role", "raft term", "revision"],
                              [[m.member, "leader" if m.is_leader else ("DOWN: " + m.error if m.error else "follower"),
                                m.raft_term or "-", m.revision or "-"] for m in members]))
    c.console.print(table("switches", ["name", "dpid", "applied revision", "flows"],
                          [[s["name"], s["dpid"], s["applied"] or "-", s["flows"] or "-"] for s in out["switches"]]))
    c.console.print(table("services", ["name", "id", "ranges", "unassigned", "endpoints", "owners down", "helpers"],
                          [[s["name"], s["id"], s["ranges"], s["unassigned"], ", ".join(s["endpoints"]) or "-",
                            ", ".join(s["orphaned"]) or "-", ", ".join(s["helpers"]) or "-"] for s in services]))
    for s in services:
        c.console.print(table(f"{s['name']}: ranges", ["lo", "hi", "owner", "mirrors", "helpers", "keys", "req/s"],
                              [[f"{r['lo']:#08x}", f"{r['hi']:#08x}", r["owner"] or "-", ",".join(r["mirrors"]) or "-",
                                (", ".join(r["helpers"]) or "-") + (" (held by hand)" if r["helpers_held"] else ""),
                                "-" if r["keys"] is None else r["keys"], fmt_rate(r["req_s"])]
                               for r in s["range_map"]]))
        if s["ops"]:
            c.console.print(table(f"{s['name']}: state operations (running, and the last 3 per endpoint)",
                                  ["id", "op", "source -> peer", "ranges", "phase", "done/total", "error / notes"],
                                  [[o["id"] or "-", o["op"], f"{o['source']} -> {o['peer']}", fmt_ranges(o["ranges"]),
                                    o["phase"], f"{o['done']}/{o['total']}",
                                    "; ".join([o["error"], *o["notes"]]).strip("; ") or "-"] for o in s["ops"]]))


COMMANDS = [up, down, exec_, netns, status]
