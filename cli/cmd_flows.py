"""``vfab flows``: what each switch should hold (compiled from etcd) or holds (dumped from OVS)."""

from __future__ import annotations

import subprocess

import click

from vfab.cli.common import errors, pass_ctx, table
from vfab.fabric.compiler import compile_fabric
from vfab.fabric.flows import Kind, split_cookie
from vfab.fabric.state import FabricState
from vfab.vid import codec
from vfab.vid.registry import schema


def _fmt_match(m) -> str:
    parts = []
    for name, value, mask in m:
        if name in ("eth_dst", "eth_src"):
            text = codec.int_to_mac(value) + (f"/{codec.int_to_mac(mask)}" if mask is not None else "")
        else:
            text = f"{value:#x}/{mask:#x}" if mask is not None else str(value)
        parts.append(f"{name}={text}")
    return ",".join(parts) or "*"


def _fmt_actions(acts) -> str:
    out = []
    for a in acts:
        if a[0] == "set_eth_dst":
            out.append(f"set_eth_dst:{codec.int_to_mac(a[1])}")
        else:
            out.append(":".join(str(x) for x in a))
    return ",".join(out) or "drop"


@click.command("flows")
@click.option("--switch", "switch", metavar="NAME|DPID", help="Only this switch (name or hex dpid).")
@click.option("--installed", is_flag=True,
              help="Dump what the switch holds now (ovs-ofctl, with counters) instead of what it should hold.")
@pass_ctx
@errors
def flows(c, switch: str | None, installed: bool) -> None:
    """Show the flow tables of the fabric's switches."""
    reg = c.registry
    rev, items = reg.get_prefix(schema.ROOT)
    st = FabricState.from_items({k: v for k, (v, _) in items.items()})
    names = {dpid: s.name for dpid, s in st.switches.items()}
    chosen = sorted(st.switches)
    if switch:
        chosen = [d for d in chosen if names[d] == switch or f"{d:x}" == switch.lower().lstrip("0x")
                  or f"{d:016x}" == switch.lower()]
        if not chosen:
            known = ", ".join(f"{names[d]} ({d:x})" for d in sorted(names)) or "none registered"
            raise click.BadParameter(f"no switch {switch!r} (known: {known})", param_hint="--switch")
    if installed:
        for d in chosen:
            proc = subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "dump-flows", names[d]],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise click.ClickException(f"cannot dump {names[d]}: {proc.stderr.strip()} "
                                           "(--installed needs the switch on this machine)")
            click.echo(f"== {names[d]} ({d:016x})\n{proc.stdout}")
        return
    configs = compile_fabric(st)
    applied = reg.applied()
    for d in chosen:
        a = applied.get(d)
        state = f"applied revision {a.revision}" if a else "not yet applied by a controller"
        rows = []
        for f in sorted(configs[d].flows.values(), key=lambda f: (f.table, -f.priority, f.match)):
            kind, sid, lo, epoch = split_cookie(f.cookie)
            what = Kind(kind).name.lower() + (f" svc {sid} lo {lo:#x} e{epoch}" if kind == Kind.VID_ROUTE else "")
            rows.append([f.table, f.priority, _fmt_match(f.match), _fmt_actions(f.actions), what])
        c.console.print(table(f"{names[d]} ({d:016x}) — {len(rows)} flows, {len(configs[d].groups)} groups; "
                              f"{state}; etcd at {rev}", ["table", "prio", "match", "actions", "for"], rows))


COMMANDS = [flows]
