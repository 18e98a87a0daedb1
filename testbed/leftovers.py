"""Run records: what each testbed run created, so that a later run can remove what a dead one left.

A testbed that is stopped (``stop()``, SIGINT, SIGTERM, SIGHUP) removes what it
created itself.  One that cannot (SIGKILL, OOM killer, power loss) leaves
processes, OVS bridges and veths behind, and the next Mininet build fails with
"RTNETLINK answers: File exists".  So each run keeps a record, one JSON file
per run in ``STATE_DIR`` (on disk, so that it outlives a power loss), and adds
each resource to it *before* creating it (a process right after its spawn):

- ``owner``: the run's PID with its start time (``/proc/PID/stat`` field 22)
  and the boot id, so a reused PID or a reboot is never taken for the owner;
- ``procs``: each child process (etcd, controller, services, Mininet shells)
  with its start time;
- ``bridges``, ``nodes`` (Mininet nodes: their links are named ``NODE-ethN``),
  ``links``, ``netns``: names, all with the project's prefix ``vf``;
- ``dirs``: directories the run created (its temporary workdir, etcd data);
- ``ovs``: whether the run started Open vSwitch, and the daemons' identities.

``sweep()`` (run by every new testbed while it holds the testbed lock) looks at
every record whose owner is gone, stops the recorded processes that are still
the same processes (by PID and start time; never by name), deletes the recorded
bridges, links, namespaces and directories that still exist, logs one line per
thing removed and deletes the record.  A record whose owner is alive is never
touched.  ``python -m vfab.testbed.leftovers`` runs a sweep on its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field

from vfab.testbed.lock import acquire_lock, release_lock
from vfab.vid.state.sched import proc_stat

log = logging.getLogger("vfab.testbed.leftovers")
STATE_DIR = os.environ.get("VFAB_TESTBED_STATE_DIR", "/var/lib/vfab/testbed")
NAME_PREFIX = "vf"          # every bridge, link and namespace the project creates
OVS_RUNDIR = "/var/run/openvswitch"
OVS_DAEMONS = ("ovsdb-server", "ovs-vswitchd")
STOP_GRACE = 5.0


# -- process identity -----------------------------------------------------------
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if there is no such process."""
    st = proc_stat(pid)
    return st.start if st is not None else None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return ""


def identity(pid: int, name: str = "") -> dict:
    """What identifies process ``pid`` from now on: PID + start time (+ name and command line, for reports)."""
    return {"pid": pid, "start": start_time(pid), "name": name, "cmd": cmdline(pid)}


def same_process(ident: dict, boot: str | None = None) -> bool:
    """True if ``ident`` still names a live (not zombie) process: same boot, same PID, same start time."""
    if boot is not None and boot != boot_id():
        return False
    st = proc_stat(ident["pid"])
    return st is not None and ident.get("start") is not None and st.start == ident["start"] and st.state != "Z"


def ovs_identities() -> list[dict]:
    """The running OVS daemons (from their pidfiles) as process identities."""
    out = []
    for daemon in OVS_DAEMONS:
        try:
            with open(os.path.join(OVS_RUNDIR, f"{daemon}.pid")) as fh:
                pid = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if start_time(pid) is not None:
            out.append(identity(pid, daemon))
    return out


# -- the record ----------------------------------------------------------------
class RunRecord:
    """This run's record file; every ``add*`` rewrites it atomically before returning."""

    def __init__(self, path: str, data: dict):
        self.path = path
        self.data = data
        self._mutex = threading.Lock()

    @classmethod
    def create(cls, state_dir: str | None = None, **info) -> "RunRecord":
        state_dir = state_dir or STATE_DIR
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        pid = os.getpid()
        path = os.path.join(state_dir, f"{pid}-{uuid.uuid4().hex[:8]}.json")
        data = {"version": 1, "boot_id": boot_id(), "owner": identity(pid, "owner"),
                "created": time.strftime("%Y-%m-%d %H:%M:%S"), **info,
                "procs": [], "bridges": [], "nodes": [], "links": [], "netns": [], "dirs": [], "ovs": None}
        rec = cls(path, data)
        rec.write()
        return rec

    def write(self, sync: bool = True) -> None:
        """Replace the file atomically; ``sync`` also forces it to disk (what must outlive a power loss)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def add(self, key: str, *items: str) -> None:
        with self._mutex:
            for item in items:
                if item not in self.data[key]:
                    self.data[key].append(item)
            self.write()

    # Processes do not outlive a power loss: their entries need not wait for the disk.
    def add_proc(self, pid: int, name: str) -> None:
        self.add_procs([(pid, name)])

    def add_procs(self, procs: list[tuple[int, str]]) -> None:
        """Several (pid, name) in one rewrite (each rewrite dumps the whole record: a client farm's 245
        processes one at a time cost 0.15 CPU-s)."""
        with self._mutex:
            self.data["procs"] += [identity(pid, name) for pid, name in procs]
            self.write(sync=False)

    def drop_proc(self, pid: int) -> None:
        self.drop_procs([pid])

    def drop_procs(self, pids: list[int]) -> None:
        gone = set(pids)
        with self._mutex:
            self.data["procs"] = [p for p in self.data["procs"] if p["pid"] not in gone]
            self.write(sync=False)

    def set(self, key: str, value) -> None:
        with self._mutex:
            self.data[key] = value
            self.write()

    def remove(self) -> None:
        for path in (self.path, f"{self.path}.tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def owner_alive(data: dict) -> bool:
    return same_process(data["owner"], data.get("boot_id"))


# -- removal -------------------------------------------------------------------
@dataclass
class Swept:
    """What ``sweep`` did: one line per thing removed, the records it cleared, an OVS left running."""

    removed: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    ovs_orphaned: bool = False


def list_bridges() -> list[str] | None:
    """OVS bridges (``ovs-vsctl list-br``); None when Open vSwitch is not running."""
    proc = subprocess.run(["ovs-vsctl", "--timeout=5", "list-br"], capture_output=True, text=True)
    return proc.stdout.split() if proc.returncode == 0 else None


def list_links() -> list[str]:
    """Network interfaces of the root namespace (``ip -o link``), without their ``@peer``."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def list_netns() -> list[str]:
    """Named network namespaces (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _mount_points() -> list[str]:
    try:
        with open("/proc/self/mountinfo") as fh:
            # field 5 is the mount point, with spaces etc. escaped as octal
            return [line.split()[4].encode().decode("unicode_escape") for line in fh if line.strip()]
    except OSError:
        return []


def _ours(name: str) -> bool:
    return name.startswith(NAME_PREFIX) and "/" not in name


def _gone(ident: dict) -> bool:
    return not same_process(ident)


def _stop_signal(ident: dict) -> int:
    # Mininet's shells are interactive bash, which ignores SIGTERM; Mininet stops them with SIGHUP.
    return signal.SIGHUP if ident.get("name", "").startswith("mininet:") else signal.SIGTERM


def _stop_procs(idents: list[dict], say, settle: float = 0.0) -> None:
    t0 = time.monotonic()
    while settle and any(same_process(p) for p in idents) and time.monotonic() - t0 < settle:
        time.sleep(0.05)  # our own teardown: let what was just told to stop finish on its own
    live = [p for p in idents if same_process(p)]
    for p in live:
        sig = _stop_signal(p)
        try:
            os.kill(p["pid"], sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    while any(not _gone(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in live:
        sig, how = _stop_signal(p), ""
        if not _gone(p):
            how = f" (killed: it ignored {signal.Signals(sig).name})"
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            t0 = time.monotonic()
            while not _gone(p) and time.monotonic() - t0 < 5:
                time.sleep(0.05)
        say(f"process {p['pid']} ({p.get('name') or '?'}: {p.get('cmd', '')[:120]}){how}")


def _run(cmd: list[str]) -> str | None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def clean(data: dict, label: str, *, dirs: bool = True, settle: float = 0.0) -> list[str]:
    """Remove what record ``data`` lists and still exists; one log line per thing removed (returned too).

    Processes are matched by PID and start time only, names and directories
    only if the record lists them (and names only with the project's prefix).
    """
    removed: list[str] = []

    def say(what: str) -> None:
        removed.append(what)
        log.warning("%s: removed %s", label, what)

    def failed(what: str, err: str) -> None:
        log.warning("%s: could not remove %s: %s", label, what, err)

    same_boot = data.get("boot_id") == boot_id()
    if same_boot:
        _stop_procs(list(reversed(data.get("procs", []))), say, settle)
    bridges = set(data.get("bridges", []))
    present = list_bridges() if bridges else []
    if present is None:
        log.warning("%s: Open vSwitch is not running: cannot check bridges %s", label, ", ".join(sorted(bridges)))
    for br in sorted(bridges & set(present or [])):
        if not _ours(br):
            log.warning("%s: bridge %r lacks the prefix %r; left alone", label, br, NAME_PREFIX)
            continue
        err = _run(["ovs-vsctl", "--timeout=10", "--if-exists", "del-br", br])
        say(f"OVS bridge {br}") if err is None else failed(f"OVS bridge {br}", err)
    nodes = [n for n in data.get("nodes", []) if _ours(n)]
    pattern = re.compile(r"^(%s)-eth\d+$" % "|".join(map(re.escape, nodes))) if nodes else None
    names = set(data.get("links", []))
    for name in list_links() if names or nodes else []:
        if _ours(name) and (name in names or (pattern is not None and pattern.match(name))):
            # A veth's peer goes with it; it may already be gone when its pair was listed first.
            err = _run(["ip", "link", "del", name])
            if err is None:
                say(f"link {name}")
            elif name in list_links():
                failed(f"link {name}", err)
    wanted_ns = {n for n in data.get("netns", []) if _ours(n)}
    for ns in sorted(wanted_ns & set(list_netns() if wanted_ns else [])):
        err = _run(["ip", "netns", "del", ns])
        say(f"network namespace {ns}") if err is None else failed(f"network namespace {ns}", err)
    if dirs:
        for d in data.get("dirs", []):
            real = os.path.realpath(d)
            if not os.path.isabs(d) or real.count("/") < 2 or not os.path.isdir(real):
                continue
            inside = [m for m in _mount_points() if m == real or m.startswith(real + "/")]
            if inside:  # never delete through a mount (a test's tmpfs, a bind mount)
                log.warning("%s: directory %s has mounts in it (%s); left alone", label, real, ", ".join(inside))
                continue
            shutil.rmtree(real, ignore_errors=True)
            say(f"directory {real}") if not os.path.exists(real) else failed(f"directory {real}", "rmtree")
    return removed


def _load(path: str) -> dict | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
        data["owner"]["pid"]  # noqa: B018 - shape check
        return data
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("run record %s is unreadable (%s); left alone", path, exc)
        return None


def sweep(state_dir: str | None = None, exclude: str | None = None) -> Swept:
    """Clear every record in ``state_dir`` whose owner is gone; records of live runs are not touched.

    Call it holding the testbed lock.  ``exclude`` is the caller's own record.
    ``ovs_orphaned`` is True when a dead run had started Open vSwitch and the
    same daemons still run: the caller should take over stopping them.
    """
    state_dir = state_dir or STATE_DIR
    out = Swept()
    try:
        entries = sorted(os.listdir(state_dir))
    except FileNotFoundError:
        return out
    for entry in entries:
        path = os.path.join(state_dir, entry)
        if not entry.endswith(".json") or path == exclude:
            continue
        data = _load(path)
        if data is None:
            continue
        owner = data["owner"]
        if owner_alive(data):
            log.debug("run record %s: owner pid %s is alive; not touched", path, owner["pid"])
            out.live.append(path)
            continue
        label = f"dead testbed run (pid {owner['pid']}, started {data.get('created', '?')})"
        log.warning("%s left a run record %s: removing what it left behind", label, path)
        removed = clean(data, label)
        ovs_state = data.get("ovs") or {}
        if ovs_state.get("started") and ovs_state.get("pids") and all(
                same_process(p, data.get("boot_id")) for p in ovs_state["pids"]):
            out.ovs_orphaned = True
            log.warning("%s had started Open vSwitch (pids %s), still running: the new testbed takes it over",
                        label, ", ".join(str(p["pid"]) for p in ovs_state["pids"]))
        for p in (path, f"{path}.tmp"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        log.warning("%s: %d leftovers removed, record deleted", label, len(removed))
        out.removed += removed
        out.records.append(path)
    return out


def main() -> int:
    """Sweep now, without starting a testbed (waits for a running testbed to finish first)."""

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    acquire_lock()
    try:
        swept = sweep()
    finally:
        release_lock()
    if swept.ovs_orphaned:
        log.warning("Open vSwitch started by a dead run is still running; 'ovs-ctl stop' if nothing needs it")
    log.info("%d dead run(s) cleared, %d leftovers removed; %d live run(s) not touched",
             len(swept.records), len(swept.removed), len(swept.live))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
