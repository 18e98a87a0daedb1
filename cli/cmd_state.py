"""Live state operations: ``split``, ``merge``, ``move``, ``mirror``, ``cancel`` (DESIGN.md §5).

Each command asks the endpoint that must act (the range's owner, or SOURCE)
over its ZeroMQ control socket (``vfab.vid.state.ctl``), then follows the
operation's record in etcd until it ends, showing its progress; Ctrl-C while
following cancels the operation (before its flip nothing changes).

Also the helpers ``vfab ranges`` and ``vfab status`` use to show what the
stateful endpoints report: keys and requests/s per range, and operations.
"""

from __future__ import annotations

import sys
import time

import click
from rich.console import Console

from vfab.cli.common import RANGE, NameType, errors, pass_ctx
from vfab.vid.registry import schema
from vfab.vid.state import ctl as statectl
from vfab.vid.errors import RegistryError
from vfab.vid.ranges import Range
from vfab.vid.errors import StateError

CANCEL_WAIT = 30.0  # s to wait for an operation to end after a cancel (a throttled copy notices it between chunks)


# -- what endpoints report (shared with 'vfab ranges' and 'vfab status') ---------------------------
def load_by_range(reg, service: str) -> dict[tuple[str, int], tuple[int, float]]:
    """{(endpoint, lo): (keys, requests/s)} from the endpoints' Load reports; skips malformed ones."""
    try:
        loads = reg.loads(service)
    except RegistryError:  # one bad record must not hide the others
        loads = {}
        try:
            _, items = reg.get_prefix(schema.load_key(service, ""))
        except RegistryError:
            items = {}
        for key, (raw, _) in items.items():
            try:
                loads[key.rsplit("/", 1)[1]] = schema.Load.from_json(raw, key)
            except RegistryError:
                continue
    out: dict[tuple[str, int], tuple[int, float]] = {}
    for name, load in loads.items():
        for row in load.ranges if isinstance(load.ranges, list) else []:
            try:
                lo, _hi, keys, rate, *_ = row   # a 5th: the median record key (the balancer reads it)
                out[(name, int(lo))] = (int(keys), float(rate))
            except (TypeError, ValueError):
                continue
    return out


def range_load(loads: dict, rec: schema.RangeRec) -> tuple[int, float] | None:
    """The owner's (keys, requests/s) for range ``rec``, None without a report."""
    return loads.get((rec.owner, rec.lo)) if rec.owner else None


def fmt_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def op_json(rec: schema.OpRec) -> dict:
    return {"id": rec.id, "op": rec.op, "source": rec.source, "peer": rec.peer,
            "ranges": [list(r) for r in rec.ranges], "phase": rec.phase, "done": rec.done, "total": rec.total,
            "started": rec.started, "updated": rec.updated, "error": rec.error, "notes": list(rec.notes),
            "timings": dict(rec.timings)}


def ops_of(reg, service: str) -> list[schema.OpRec]:
    try:
        return reg.ops(service)
    except RegistryError:
        return []


def fmt_ranges(ranges: list) -> str:
    out = []
    for r in ranges:
        try:
            out.append(str(Range(int(r[0]), int(r[1]))))
        except (TypeError, ValueError, IndexError):
            out.append(str(r))
    return ", ".join(out) or "-"


# -- following an operation ---------------------------------------------------------------------
class Follow:
    """Progress of one operation on stderr: a live bar on a terminal, else a line per phase and ~10 %."""

    def __init__(self, label: str, tty: bool | None = None):
        self.label = label
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = time.monotonic()
        self.phase: str | None = None
        self.decile = -1
        self._bar = None
        self._task = None

    def __call__(self, rec: schema.OpRec) -> None:
        pct = min(100, 100 * rec.done // rec.total) if rec.total else (100 if rec.finished else 0)
        if self.tty:
            self._live(rec)
        elif rec.phase != self.phase or pct // 10 > self.decile:
            self.decile = pct // 10
            click.echo(f"{self.label}: {rec.phase} {rec.done}/{rec.total} keys ({pct}%), "
                       f"{time.monotonic() - self.t0:.1f} s", err=True)
        self.phase = rec.phase

    def _live(self, rec: schema.OpRec) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                                   TimeElapsedColumn)

        if self._bar is None:
            self._bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("keys"), TaskProgressColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(f"{self.label} [{rec.phase}]", total=max(rec.total, 1))
        done = rec.done if rec.total else (1 if rec.finished else 0)
        # tombstones are copied but not counted in the total: done may pass it
        self._bar.update(self._task, completed=done, total=max(rec.total, done, 1),
                         description=f"{self.label} [{rec.phase}]")

    def notice(self, text: str) -> None:
        """A line about the operation (why the wait pauses), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.console.print(f"{self.label}: {text}", markup=False, highlight=False)
        else:
            click.echo(f"{self.label}: {text}", err=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _owners(reg, service: str, ranges: list) -> str:
    """Who holds the op's ranges now, from etcd: '0x000000-0x0fffff: s2 (mirrors s3), ...'."""
    wanted = []
    for r in ranges:
        try:
            wanted.append(Range(int(r[0]), int(r[1])))
        except (TypeError, ValueError, IndexError):
            continue
    try:
        recs = [rec for rec, _ in reg.ranges(service) if any(rec.range.overlaps(w) for w in wanted)]
    except RegistryError as exc:
        return f"? (cannot read the range map: {exc})"
    parts = []
    for rec in recs:
        text = f"{rec.range}: {rec.owner or 'unassigned'}"
        if rec.mirrors:
            text += f" (mirrors {','.join(rec.mirrors)})"
        parts.append(text)
    return ", ".join(parts) or "-"


def _timings(rec: schema.OpRec) -> str:
    def s(name: str) -> str:
        v = rec.timings.get(name)
        return f"{v:.3f} s" if isinstance(v, (int, float)) else "-"

    return f"copy {s('copy_s')}, flip {s('flip_s')}, total {s('total_s')}"


def _live_stateful(reg, service: str) -> dict:
    return {e.name: e for e in reg.endpoints(service) if e.ctl}


def _check_peer(reg, service: str, peer: str, source: str | None) -> None:
    """The peer must be a live stateful endpoint (else StateError, exit 1, naming the live ones)."""
    if source is not None and peer == source:
        raise click.BadParameter(f"{peer} is the source itself: name another endpoint", param_hint="--to")
    live = _live_stateful(reg, service)
    if peer not in live:
        names = ", ".join(sorted(live)) or "none"
        raise StateError(f"peer {peer!r} is not a live stateful endpoint of {service!r} (live: {names}): "
                         "start it first, or pick one of those")


def _split_source(reg, service: str, rng: Range, peer: str, flag: str) -> str:
    """The owner that must give ``rng`` away; argument problems are exit 2."""
    try:
        owner = statectl.owner_of_range(reg, service, rng)
    except StateError as exc:
        raise click.BadParameter(str(exc), param_hint="LO-HI") from None
    recs = [r for r, _ in reg.ranges(service) if r.owner == owner]
    if not any(r.range.contains(rng) for r in recs):
        mine = ", ".join(str(r.range) for r in recs) or "none"
        raise click.BadParameter(f"{rng} spans several ranges of {owner} ({mine}): pick a range inside one of "
                                 "them ('vfab ranges')", param_hint="LO-HI")
    if owner == peer:
        raise click.BadParameter(f"{peer} already owns {rng}: nothing to do", param_hint=flag)
    return owner


def _run(c, service: str, source: str, kind: str, desc: str, send, wait: bool, timeout: float) -> None:
    """Send the command (``send()`` returns what the endpoint started), then follow the op by its id."""
    reg = c.registry
    started = send()
    if not wait:
        click.echo(f"{desc}: accepted by {started.source} as {started.op}; follow it with 'vfab status', cancel "
                   f"it with 'vfab cancel {service} {started.source}'")
        return
    click.echo(f"{desc}: accepted by {started.source} as {started.op}; following it (Ctrl-C cancels it)", err=True)
    follow = Follow(desc)
    note = ""
    try:
        rec = statectl.wait(reg, service, started.op, timeout=timeout, progress=follow, notice=follow.notice)
    except KeyboardInterrupt:
        follow.close()
        rec, note = _interrupted(reg, service, started, kind)
    finally:
        follow.close()
    _report(reg, service, desc, rec, note)


def _interrupted(reg, service: str, started, kind: str) -> tuple[schema.OpRec, str]:
    """Ctrl-C while following: cancel the op and wait (briefly) for how it ended."""
    source = started.source
    click.echo(f"interrupted: cancelling {source}'s {kind} {started.op} ...", err=True)
    try:
        statectl.cancel(reg, service, source)
    except StateError as exc:
        rec, _ = reg.op(service, started.op)
        if rec is None or not rec.finished:
            raise click.ClickException(f"the cancel failed: {exc}; the {kind} may still be running: see "
                                       f"'vfab status', retry with 'vfab cancel {service} {source}'") from None
        return rec, f" (the cancel came too late: {exc})"
    try:
        rec = statectl.wait(reg, service, started.op, timeout=CANCEL_WAIT)
    except KeyboardInterrupt:
        raise click.ClickException(f"cancel sent to {source}; stopped waiting for it: see 'vfab status'") from None
    except StateError:
        raise click.ClickException(f"cancel sent to {source}, but its {kind} is still running after "
                                   f"{CANCEL_WAIT:.0f} s (a throttled copy notices a cancel only between chunks, "
                                   "and a flip cannot be interrupted): see 'vfab status'") from None
    note = " (the cancel came too late: the flip had committed)" if rec.phase == "done" else ""
    return rec, note


def _report(reg, service: str, desc: str, rec: schema.OpRec, note: str = "") -> None:
    owners = _owners(reg, service, rec.ranges)
    if rec.phase == "done":
        click.echo(f"{desc}: done{note}; {_timings(rec)}; now {owners}")
        for n in rec.notes:
            click.echo(f"{desc}: note: {n}", err=True)
        return
    raise click.ClickException(f"{desc}: {rec.phase} ({_timings(rec)}): {rec.error or 'no reason given'}; "
                               f"now {owners}")


# -- options shared by the four operations ----------------------------------------------------------
def _op_options(fn):
    fn = click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS", default=600.0,
                      show_default=True,
                      help="Seconds to follow the operation before giving up (it keeps running; "
                           "'vfab cancel' stops it).")(fn)
    fn = click.option("--wait/--no-wait", default=True, show_default=True,
                      help="Follow the operation until it ends, with progress (Ctrl-C cancels it); "
                           "--no-wait returns once the endpoint accepted the command.")(fn)
    fn = click.option("--throttle", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="N",
                      help="Copy at most N records/s (0 = unlimited), so the transfer does not starve the "
                           "endpoints' client requests.")(fn)
    return fn


@click.command("split")
@click.argument("service", type=NameType("service"))
@click.argument("keys", metavar="LO-HI", type=RANGE)
@click.option("--to", "peer", required=True, type=NameType("endpoint"),
              help="Live stateful endpoint that takes over keys LO-HI with their state.")
@_op_options
@pass_ctx
@errors
def split(c, service: str, keys: Range, peer: str, throttle: float, wait: bool, timeout: float) -> None:
    """Give keys LO-HI of SERVICE, with their state, from their owner to endpoint --to.

    LO-HI must lie inside one range of one owner ('vfab ranges'). Clients keep
    being served throughout; nothing changes unless the flip commits.

    Example: vfab split kvs 0x800000-0xffffff --to s2 --throttle 5000
    """
    reg = c.registry
    reg.service(service)
    owner = _split_source(reg, service, keys, peer, "--to")
    _check_peer(reg, service, peer, owner)
    _run(c, service, owner, "split", f"split {service} {keys} {owner} -> {peer}",
         lambda: statectl.split(reg, service, keys, peer, throttle), wait, timeout)


@click.command("merge")
@click.argument("service", type=NameType("service"))
@click.argument("keys", metavar="LO-HI", type=RANGE)
@click.option("--into", "into", required=True, type=NameType("endpoint"),
              help="Live stateful endpoint that takes keys LO-HI back (joining them to its neighbouring ranges).")
@_op_options
@pass_ctx
@errors
def merge(c, service: str, keys: Range, into: str, throttle: float, wait: bool, timeout: float) -> None:
    """Endpoint --into takes keys LO-HI of SERVICE, with their state, back from their owner.

    The undo of a split; adjacent ranges of one owner are then joined.

    Example: vfab merge kvs 0x800000-0xffffff --into s1
    """
    reg = c.registry
    reg.service(service)
    owner = _split_source(reg, service, keys, into, "--into")
    _check_peer(reg, service, into, owner)
    _run(c, service, owner, "merge", f"merge {service} {keys} {owner} -> {into}",
         lambda: statectl.merge(reg, service, keys, into, throttle), wait, timeout)


@click.command("move")
@click.argument("service", type=NameType("service"))
@click.argument("source", type=NameType("endpoint"))
@click.option("--to", "peer", required=True, type=NameType("endpoint"),
              help="Live stateful endpoint that takes every range of SOURCE with its state.")
@_op_options
@pass_ctx
@errors
def move(c, service: str, source: str, peer: str, throttle: float, wait: bool, timeout: float) -> None:
    """Move every range SOURCE owns in SERVICE, with its state, to endpoint --to (e.g. to drain SOURCE).

    Example: vfab move kvs s1 --to s3
    """
    reg = c.registry
    reg.service(service)
    _check_peer(reg, service, peer, source)
    _run(c, service, source, "move", f"move {service} {source} -> {peer}",
         lambda: statectl.move(reg, service, source, peer, throttle), wait, timeout)


@click.command("mirror")
@click.argument("service", type=NameType("service"))
@click.argument("source", type=NameType("endpoint"))
@click.option("--to", "peer", required=True, type=NameType("endpoint"),
              help="Live stateful endpoint that becomes a synchronous mirror of every range of SOURCE.")
@_op_options
@pass_ctx
@errors
def mirror(c, service: str, source: str, peer: str, throttle: float, wait: bool, timeout: float) -> None:
    """Copy every range SOURCE owns in SERVICE to endpoint --to and keep it as a mirror.

    Every write is then on the mirror before it is acknowledged; when SOURCE's
    lease expires the first live mirror takes its ranges over.

    Example: vfab mirror kvs s1 --to s2
    """
    reg = c.registry
    reg.service(service)
    _check_peer(reg, service, peer, source)
    _run(c, service, source, "mirror", f"mirror {service} {source} -> {peer}",
         lambda: statectl.mirror(reg, service, source, peer, throttle), wait, timeout)


@click.command("cancel")
@click.argument("service", type=NameType("service"))
@click.argument("source", type=NameType("endpoint"))
@pass_ctx
@errors
def cancel(c, service: str, source: str) -> None:
    """Cancel the state operation SOURCE runs in SERVICE (split, merge, move or mirror).

    Before its flip the operation stops and nothing changes; once a range's flip
    committed it is too late for that range. Waits up to 30 s for the outcome.
    """
    reg = c.registry
    reg.service(service)
    op_id = statectl.cancel(reg, service, source)
    click.echo(f"cancel sent to {source} ({op_id})", err=True)
    try:
        rec = statectl.wait(reg, service, op_id, timeout=CANCEL_WAIT)
    except StateError:
        raise click.ClickException(f"cancel sent to {source}, but its operation did not end within "
                                   f"{CANCEL_WAIT:.0f} s (a throttled copy notices a cancel only between chunks, "
                                   "and a flip cannot be interrupted): see 'vfab status'") from None
    what = f"{rec.op} {source} -> {rec.peer}"
    if rec.phase == "cancelled":
        click.echo(f"{what}: cancelled after {rec.done}/{rec.total} keys; {rec.error or 'nothing changed'}")
        return
    if rec.phase == "done":
        raise click.ClickException(f"{what}: too late, it completed ({_timings(rec)}); now "
                                   f"{_owners(reg, service, rec.ranges)}")
    raise click.ClickException(f"{what}: {rec.phase}: {rec.error or 'no reason given'}")


COMMANDS = [split, merge, move, mirror, cancel]
