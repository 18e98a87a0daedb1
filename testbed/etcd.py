"""A private etcd on loopback, for tests and for ``vfab up``: one member (the default), or a cluster.

Each member is a child process owned by this object: it is started with a
fresh data dir and explicit ports, and stopped by its own PID (never by
name, so another etcd on the machine is never touched)::

    etcd = LocalEtcd(tmpdir, free_port(), free_port())
    etcd.start(timeout=10)
    Registry(etcd.endpoint)  # "127.0.0.1:PORT"
    etcd.stop()

    cluster = LocalEtcd(tmpdir, members=3)   # 3 members, each with its own ports and data dir
    cluster.start()
    Registry(cluster.endpoint)  # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
    cluster.leader().kill9()    # the one the status API names; start() brings it back

A member can sit elsewhere than on this namespace's loopback: ``Placement`` gives it an address (and ports)
and a command prefix that runs it there (``ip netns exec NS``), which the multi-host testbed uses to put one
member in each emulated host; ``via`` is where this process reaches its client port when it cannot reach the
address itself (a relay, ``testbed.ctlnet``): ``endpoint`` lists those.

Starting one makes SIGTERM/SIGHUP unwind the process like SIGINT
(``procs.unwind_on_signals``), so a killed test run still stops its member.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from vfab.testbed.procs import free_port  # noqa: F401  (re-exported for tests)
from vfab.testbed.procs import unwind_on_signals
from vfab.vid.errors import RegistryError
from vfab.vid.registry import members as etcd_members

log = logging.getLogger("vfab.testbed.etcd")
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """Where one member runs: the address it listens on and a command prefix that puts it there."""

    ip: str = HOST
    wrap: tuple[str, ...] = ()     # e.g. ("ip", "netns", "exec", "vfab-h1"): the member runs inside that netns
    client_port: int = 0           # 0: a free one
    peer_port: int = 0
    via: str = ""                  # HOST:PORT this process reaches the client port at ("": ip:client_port)


class EtcdMember:
    """One etcd member process (``LocalEtcd`` builds them; see its docstring for the timing settings)."""

    def __init__(self, name: str, data_dir: Path, client_port: int, peer_port: int, *, cluster: str = "",
                 place: Placement = Placement(), binary: str = "etcd", heartbeat_ms: int = 50,
                 election_ms: int = 500, history: str = "1h", log_path: Path | None = None,
                 member_dir: Path | None = None, pre_vote: bool = True):
        self.name, self.data_dir = name, Path(data_dir)
        self.client_port, self.peer_port = client_port, peer_port
        self.place, self.binary = place, binary
        self.heartbeat_ms, self.election_ms, self.history = heartbeat_ms, election_ms, history
        self.pre_vote = pre_vote
        self.cluster = cluster or f"{name}={self.peer_url}"
        self.log_path = log_path or self.data_dir / "etcd.log"
        self.member_dir = member_dir or self.data_dir / "member-data"
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self.on_spawn: Callable[[int], None] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.place.ip}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def reach(self) -> str:
        """HOST:PORT where this process reaches the member's client port (its own address, or a relay)."""
        return self.place.via or self.endpoint

    @property
    def peer_url(self) -> str:
        return f"http://{self.place.ip}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [
            *self.place.wrap,
            self.binary, "--name", self.name, "--data-dir", str(self.member_dir),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.cluster, "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            f"--pre-vote={'true' if self.pre_vote else 'false'}",
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", self.history,
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.reach}/health", timeout=0.5) as resp:
                return resp.status == 200 and json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def status(self) -> etcd_members.Status:
        return etcd_members.status(self.reach, timeout=1.0)

    def spawn(self) -> None:
        if self.alive():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if self.on_spawn is not None:
            self.on_spawn(self.proc.pid)
        log.info("etcd %s: started pid %d on %s", self.name, self.proc.pid, self.endpoint)

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        """SIGTERM the member (``stop`` waits for it): a cluster's members are all told at once, or the last
        ones would wait for a quorum that is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the member by its PID: SIGTERM, then SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.info("etcd %s: pid %d still running %.0f s after SIGTERM, killing it", self.name, proc.pid,
                         timeout)
                proc.kill()
                proc.wait(timeout)
        self._close_log()

    def kill9(self) -> None:
        """SIGKILL the member by its PID (a crash); ``LocalEtcd.start`` brings it back on the same data and ports."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
            log.info("etcd %s: killed pid %d (SIGKILL)", self.name, proc.pid)
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return " | ".join(text[-lines:]) or "empty log"


class LocalEtcd:
    """One etcd member on 127.0.0.1 (``members=1``, the default), or a cluster of ``members`` (3 or 5).

    ``heartbeat_ms``/``election_ms`` default to 50/500, half etcd's own 100/1000: leases can then be as
    short as 1 s (etcd's minimum TTL is 1.5 election timeouts, rounded up to whole seconds), and a
    cluster elects a new leader 0.5-0.9 s after its leader's kill -9 instead of 0.9-1.6 s
    (bench/etcd_leader_loss.py).  etcd's tuning guide asks for a heartbeat near the members' round
    trip (here loopback, well under 1 ms) and an election timeout of at least 10 heartbeats; the limit
    here is a member starved of CPU past the election timeout, which would start an election nobody
    needed: none seen in the bench's windows on this shared 2-core machine (docs/architecture.md,
    "etcd cluster", gives the reasoning for real hosts).

    ``history`` is how long etcd keeps old revisions (``--auto-compaction-mode periodic``, etcd's
    duration syntax; ``"0"`` keeps them all, etcd's own default).  Every endpoint's load report is a put
    each second, and without compaction each one stays in the database (~190 bytes per revision here):
    4 shards add ~65 MB a day, and at etcd's 2 GiB quota it raises its NOSPACE alarm and refuses every
    write, the fabric's range changes and re-registrations included.  A watch resumed from a revision
    older than ``history`` is cancelled by etcd, and ``Registry.follow`` reads its prefix again.

    ``pre_vote`` (etcd's ``--pre-vote``, off by default in etcd 3.4, on from 3.5): a member asks whether it could
    win before it starts an election.  Without it, a member cut off from the others keeps starting elections,
    raising its raft term, and when it comes back that term deposes the leader the majority kept: measured in
    the multi-host testbed, a healed host's member made the majority's leader step down and left the cluster
    without a leader for 2.3 s (tests/integration/test_etcd_partition.py, docs/measurements.md, eleventh session, i45h).

    ``client_port``/``peer_port`` are the first member's (0: a free one); the others get free ports.
    ``members`` may also be a list of ``Placement`` (one per member) for members outside loopback.
    """

    def __init__(self, data_dir: str | os.PathLike, client_port: int = 0, peer_port: int = 0, *,
                 members: int | Sequence[Placement] = 1, name: str = "vfab", binary: str = "etcd",
                 heartbeat_ms: int = 50, election_ms: int = 500, history: str = "1h", pre_vote: bool = True):
        places = [Placement()] * members if isinstance(members, int) else list(members)
        if not 1 <= len(places) <= etcd_members.MAX_MEMBERS:
            raise RegistryError(f"an etcd cluster of {len(places)} members: give 1 (one member), or 3 or 5 "
                                f"(at most {etcd_members.MAX_MEMBERS})")
        if len(places) == 2:
            log.warning("an etcd cluster of 2 members stops when either dies (a majority is 2): use 3")
        single = len(places) == 1
        self.data_dir = Path(data_dir)
        self.name = name
        self.binary = binary
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.history = history
        ports = [(client_port or places[0].client_port or free_port(), peer_port or places[0].peer_port or free_port())]
        ports += [(p.client_port or free_port(), p.peer_port or free_port()) for p in places[1:]]
        names = [name] if single else [f"{name}{i}" for i in range(1, len(places) + 1)]
        cluster = ",".join(f"{n}=http://{p.ip}:{pp}" for n, p, (_, pp) in zip(names, places, ports))
        self.members: list[EtcdMember] = []
        for n, place, (cp, pp) in zip(names, places, ports):
            where = self.data_dir if single else self.data_dir / n
            self.members.append(EtcdMember(n, where, cp, pp, cluster=cluster, place=place, binary=binary,
                                           heartbeat_ms=self.heartbeat_ms, election_ms=self.election_ms,
                                           history=history, pre_vote=pre_vote))
        self.on_spawn: Callable[[int], None] | None = None  # called with each member's PID right after its spawn

    # -- the first member (what a single-member etcd's callers read) ------------------------------------
    @property
    def client_port(self) -> int:
        return self.members[0].client_port

    @property
    def peer_port(self) -> int:
        return self.members[0].peer_port

    @property
    def client_url(self) -> str:
        return self.members[0].client_url

    @property
    def log_path(self) -> Path:
        return self.members[0].log_path

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.members[0].proc

    @property
    def pid(self) -> int | None:
        return self.members[0].pid

    def command(self) -> list[str]:
        return self.members[0].command()

    # -- the whole ------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``HOST:PORT[,HOST:PORT...]`` of every member as this process reaches it, as
        ``vfab.vid.registry.Registry`` and ``--etcd`` take it."""
        return ",".join(m.reach for m in self.members)

    def member(self, name: str) -> EtcdMember:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(f"no etcd member {name!r} (members: {', '.join(m.name for m in self.members)})")

    def healthy(self) -> bool:
        return all(m.healthy() for m in self.members if m.alive())

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        """The member the live members agree leads (status API); RegistryError if none does within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            live = [m for m in self.members if m.alive()]
            said = {m.name: m.status() for m in live}
            ids = {s.leader_id for s in said.values() if s.ok}
            if len(ids) == 1 and 0 not in ids:
                lead = next((m for m in live if said[m.name].member_id in ids), None)
                if lead is not None:
                    return lead
            if time.monotonic() > deadline:
                raise RegistryError(f"the etcd members agree on no leader after {timeout:.0f} s: "
                                    + "; ".join(f"{n}: leader {s.leader_id:x} {s.error}" for n, s in said.items()))
            time.sleep(0.05)

    def make_leader(self, member: EtcdMember, timeout: float = 10.0) -> None:
        """Hand the leadership to ``member`` (etcd's transfer-leadership, asked of the leader)."""
        target = member.status().member_id
        lead = self.leader(timeout)
        if lead is not member:
            req = urllib.request.Request(f"http://{lead.reach}/v3/maintenance/transfer-leadership",
                                         data=json.dumps({"targetID": str(target)}).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
        deadline = time.monotonic() + timeout
        while self.leader(timeout) is not member:
            if time.monotonic() > deadline:
                raise RegistryError(f"etcd {member.name} did not become the leader within {timeout:.0f} s")
            time.sleep(0.05)

    def start(self, timeout: float = 15.0) -> "LocalEtcd":
        """Start every member not running and wait until each answers /health; RegistryError if one does not."""
        if shutil.which(self.binary) is None:
            raise RegistryError(f"etcd binary {self.binary!r} not found on PATH: install etcd (3.4+)")
        unwind_on_signals()
        for m in self.members:
            if not m.alive():
                m.on_spawn = self.on_spawn
                m.spawn()
        deadline = time.monotonic() + timeout
        waiting = list(self.members)
        while waiting:
            for m in list(waiting):
                code = m.exited()
                if code is not None:
                    self.stop()
                    raise RegistryError(
                        f"etcd {m.name} on {m.endpoint} (peer port {m.peer_port}) exited with code {code} "
                        f"while starting: {m.log_tail()} (a port clash? pick other ports)")
                if m.healthy():
                    waiting.remove(m)
            if waiting and time.monotonic() > deadline:
                self.stop()
                raise RegistryError(f"etcd {', '.join(m.name for m in waiting)} not healthy after {timeout:.0f} s: "
                                    + " / ".join(m.log_tail() for m in waiting))
            if waiting:
                time.sleep(0.05)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every member by its PID: SIGTERM, then SIGKILL after ``timeout`` (a cluster's: after 1 s; a
        leader told to stop first hands its leadership to a peer, and waits for up to its request timeout,
        ~7 s, when every peer is stopping too)."""
        for m in self.members:
            m.terminate()
        for m in self.members:
            m.stop(timeout if len(self.members) == 1 else min(timeout, 1.0))

    def kill9(self, member: EtcdMember | None = None) -> None:
        """SIGKILL one member (default: all) by its PID; ``start`` brings it back on the same data and ports."""
        for m in [member] if member is not None else self.members:
            m.kill9()

    def log_tail(self, lines: int = 5) -> str:
        return " / ".join(f"{m.name}: {m.log_tail(lines)}" for m in self.members)

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
