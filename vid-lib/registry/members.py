"""The members of one etcd cluster as a vfab process sees them: which one it talks to, and why it moved on.

Every vfab process takes the cluster as a list (``--etcd HOST:PORT,HOST:PORT,...``; ``http://HOST:PORT``
items too) and talks to one member at a time: the first listed that answers (list the member on the
process's own host first).  It moves to the next member when the one in use

- refuses or drops the connection (the member died: nothing was sent, or the answer was lost),
- answers "no leader" (an election is under way: every member says so until one wins), or
- leaves a request unanswered while a status probe shows it lost its leader.  A follower forwards a
  write to the leader; when the leader dies that write is lost, and the follower would only say so
  after its request timeout (5 s + 2 election timeouts).  So an answer that is late by ``PROBE`` s makes
  the client ask the member's status: no leader, or a raft term newer than the one of the client's
  last answer, means the request will not be answered.

One :class:`Members` per list per process (``Members.of``): every :class:`~vfab.vid.registry.Registry`
on the same list shares it, so all of a process's threads move together and each switch is logged
once, naming the member left, why, and the member now used.  Every answer's header carries the
cluster id and raft term: a list that mixes two clusters is refused when the second one answers.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from vfab.vid.errors import RegistryError

log = logging.getLogger("vfab.registry")
DEFAULT_ENDPOINT = "127.0.0.1:2379"
MAX_MEMBERS = 9            # etcd advises 3, 5 or 7 members; a longer list is a typo (or not one cluster)
PROBE = 0.1                # s an answer may take before the member's status is asked (then again each PROBE)
STATUS_TIMEOUT = 0.3       # s for one status probe
HASLEADER = "Grpc-Metadata-hasleader"   # etcd then answers "no leader" at once instead of waiting


def parse(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``HOST:PORT`` of each member of ``spec`` (a comma-separated string or a list), in order.

    RegistryError says which item is wrong and how to write it."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    if not any(items):
        raise RegistryError(f"the etcd endpoint list {spec!r} is empty: give HOST:PORT[,HOST:PORT...], "
                            f"e.g. {DEFAULT_ENDPOINT}")
    out: list[str] = []
    for n, item in enumerate(items, 1):
        where = f"etcd endpoint {item!r}" + (f" (item {n} of {len(items)} in {spec!r})" if len(items) > 1 else "")
        if not item:
            raise RegistryError(f"{where} is empty: remove the extra comma")
        if item.startswith("https://"):
            raise RegistryError(f"{where}: TLS is not supported by vfab's etcd client; give the member's "
                                "plain-HTTP client URL (http://HOST:PORT)")
        bare = item.removeprefix("http://").rstrip("/")
        host, _, port = bare.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in bare or "," in host:
            raise RegistryError(f"{where} is malformed: write HOST:PORT or http://HOST:PORT, e.g. {DEFAULT_ENDPOINT}")
        if bare in out:
            raise RegistryError(f"{where} is listed twice: name each member once")
        out.append(bare)
    if len(out) > MAX_MEMBERS:
        raise RegistryError(f"{len(out)} etcd endpoints given, at most {MAX_MEMBERS}: list the members of one "
                            "cluster (etcd runs 3, 5 or 7)")
    return tuple(out)


def arg(text: str) -> str:
    """argparse's ``type=`` for a ``--etcd`` option: the list as given, or a usage error saying what is wrong."""
    import argparse

    try:
        parse(text)
    except RegistryError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass
class Status:
    """One member's answer to /v3/maintenance/status (``error`` set when it gave none)."""

    member: str
    member_id: int = 0
    leader_id: int = 0
    raft_term: int = 0
    revision: int = 0
    cluster_id: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def is_leader(self) -> bool:
        return self.ok and self.member_id == self.leader_id != 0


def status(member: str, timeout: float = STATUS_TIMEOUT) -> Status:
    """Ask one member for its status (no leader needed: a member in an election answers with leader 0)."""
    host, _, port = member.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v3/maintenance/status", b"{}", {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return Status(member, error=f"answered {resp.status}: {data[:120].decode(errors='replace')}")
        out = json.loads(data)
        head = out.get("header", {})
        return Status(member, member_id=int(head.get("member_id", 0)), leader_id=int(out.get("leader", 0)),
                      raft_term=int(head.get("raft_term", 0)), revision=int(head.get("revision", 0)),
                      cluster_id=int(head.get("cluster_id", 0)))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Status(member, error=exc.__class__.__name__)
    finally:
        conn.close()


class Members:
    """The member list of one cluster and the member this process uses now (thread-safe, shared)."""

    _known: dict[tuple[str, ...], "Members"] = {}
    _known_lock = threading.Lock()

    @classmethod
    def of(cls, spec: str | Sequence[str]) -> "Members":
        members = parse(spec)
        with cls._known_lock:
            got = cls._known.get(members)
            if got is None:
                got = cls._known[members] = cls(members)
            return got

    def __init__(self, members: tuple[str, ...]):
        self.all = members
        self.text = ",".join(members)
        self._at = 0
        self._lock = threading.Lock()
        self.term = 0                    # newest raft term any answer carried (0: none yet)
        self.cluster_id = 0
        self._cluster_from = ""
        self._announced = False
        self._leaderless_since = 0.0     # monotonic time of the first "no leader" of an election, or 0

    def current(self) -> str:
        member = self.all[self._at]
        if not self._announced:
            self._announced = True
            if len(self.all) > 1:
                log.info("etcd: using member %s (1 of %d: %s)", member, len(self.all), self.text)
                threading.Thread(target=self.warn_dead, name="etcd-members", daemon=True).start()
        return member

    def failed(self, member: str, why: str, election: bool = False) -> str:
        """``member`` failed (``why``); move on to the next member unless another thread did; the one to use now."""
        with self._lock:
            if self.all[self._at] == member and len(self.all) > 1:
                self._at = (self._at + 1) % len(self.all)
                nxt = self.all[self._at]
                if election:
                    if not self._leaderless_since:
                        self._leaderless_since = time.monotonic()
                        log.warning("etcd: member %s has no leader (an election is under way); trying %s, and "
                                    "the other members in turn until one has", member, nxt)
                    else:
                        log.debug("etcd: member %s has no leader yet; trying %s", member, nxt)
                else:
                    log.warning("etcd: member %s %s; switching to %s (%d of %d)", member, why, nxt, self._at + 1,
                                len(self.all))
            elif election and not self._leaderless_since:
                self._leaderless_since = time.monotonic()
                log.warning("etcd: member %s has no leader (an election is under way); waiting for one", member)
            return self.all[self._at]

    def answered(self, member: str, header: dict) -> None:
        """Note an answer's header: its raft term, and the cluster id (RegistryError: not the same cluster)."""
        term = int(header.get("raft_term", 0) or 0)
        cid = int(header.get("cluster_id", 0) or 0)
        if self._leaderless_since:
            with self._lock:
                since, self._leaderless_since = self._leaderless_since, 0.0
            if since:
                log.warning("etcd: member %s answers with a leader again, %.2f s after the first 'no leader' "
                            "(raft term %d)", member, time.monotonic() - since, term)
        if term > self.term:
            self.term = term
        if cid and self.cluster_id != cid:
            if self.cluster_id and member != self._cluster_from:
                first = status(self._cluster_from)
                if first.ok and first.cluster_id == self.cluster_id:
                    raise RegistryError(f"etcd members {self._cluster_from} and {member} belong to different "
                                        f"clusters (ids {self.cluster_id:x} and {cid:x}): list the members of one "
                                        "cluster only")
            if self.cluster_id:
                log.warning("etcd: member %s now belongs to cluster %x, not %x: the cluster was created anew "
                            "(its revisions start again)", member, cid, self.cluster_id)
            self.cluster_id, self._cluster_from = cid, member
            self.term = term

    def abandon(self, member: str, pending: dict, waited: float, limit: float) -> str | None:
        """Why a request unanswered for ``waited`` s will not be answered, or None to keep waiting.

        ``pending``: ``term``, the newest raft term this process knew when it sent the request; ``safe``,
        whether it may be sent again; ``base``, the member's term at the first probe (filled in here).  Only
        the member's own word gives up on a request, never a slow status answer (a loaded machine): it has
        no leader, or its term moved on while the request was pending.  A request that may be sent again
        is also given up on when the member's term is already newer than any this process had seen (its
        knowledge is stale, or the request went to the dead leader): a second copy costs nothing.
        """
        if waited >= limit:
            return f"did not answer within {limit:.1f} s"
        st = status(member)
        if not st.ok:
            return None
        if st.leader_id == 0:
            return "lost its leader (an election is under way) while the request was pending"
        if not pending.get("base"):
            pending["base"] = st.raft_term
            if pending.get("safe") and pending.get("term") and st.raft_term > pending["term"]:
                return (f"has had a new leader since this process's last answer (raft term {pending['term']} -> "
                        f"{st.raft_term}): asking again")
            return None
        if st.raft_term > pending["base"]:
            return f"has a new leader (raft term {pending['base']} -> {st.raft_term}) since the request was sent"
        return None

    def survey(self, timeout: float = STATUS_TIMEOUT) -> list[Status]:
        """The status of every member, asked at once."""
        out: list[Status | None] = [None] * len(self.all)

        def ask(i: int) -> None:
            out[i] = status(self.all[i], timeout)

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(self.all))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 1.0)
        return [s or Status(m, error="no answer") for m, s in zip(self.all, out)]

    def warn_dead(self) -> list[str]:
        """Log a warning naming each member that does not answer, and an error when the members that do are
        not one cluster (done once, in the background, at first use); the members that did not answer."""
        said = self.survey()
        dead = [s for s in said if not s.ok]
        for s in dead:
            log.warning("etcd: member %s (listed in %s) does not answer (%s): working with the others; start it "
                        "again or drop it from --etcd", s.member, self.text, s.error)
        clusters: dict[int, list[str]] = {}
        for s in said:
            if s.ok:
                clusters.setdefault(s.cluster_id, []).append(s.member)
        if len(clusters) > 1:
            log.error("etcd: the members listed in %s are not one cluster (%s): list the members of one cluster "
                      "only", self.text, "; ".join(f"cluster {c:x}: {', '.join(m)}" for c, m in clusters.items()))
        return [s.member for s in dead]
