"""One active process per role and scope, elected through etcd, and the fence that makes it safe.

An election is one key (``schema.leader_key(role, scope)``, e.g. ``leaders/balancer/mc``) created under the
candidate's lease in a transaction that requires the key to be absent.  The winner's fencing token is the
key's create revision: every write the winner makes compares it in the same transaction
(``Registry.cmp_created``), so a winner that lost the key — paused (SIGSTOP, a long GC, a starved host) past
its lease, or cut off from etcd while the lease ran out — can no longer write anything once a successor
holds it: etcd refuses the transaction, whatever the old process still believes (Jepsen's lesson on etcd
locks: never trust a lock without a fence).

The lease is kept alive by a thread every ttl/3 s; when it is gone, the holder's next write is refused
(its key went with the lease, or a successor's key has another create revision) and it steps down.
A kill -9 of the holder leaves the key until its lease expires (``ttl`` s, plus up to 0.5 s: etcd checks
expiry every 500 ms); a standby tries again every ``retry`` s, so it takes over within about
``ttl + 0.5 + retry`` s (``tests/integration/test_balancer_ha.py`` measures it).

Several elections of one process (a balancer of several services) share one lease: one keepalive.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.election")


def whoami() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaseKeeper:
    """A lease of ``ttl`` s kept alive by a thread; ``get()`` grants a new one after the last was lost."""

    def __init__(self, reg: Registry, ttl: int):
        self.reg, self.ttl = reg, ttl
        self.id: int | None = None
        self.lost = threading.Event()   # set when etcd no longer has self.id
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def get(self) -> int:
        with self.lock:
            if self.id is None or self.lost.is_set():
                self.id = self.reg.lease(self.ttl)
                self.lost = threading.Event()
                threading.Thread(target=self._keep, args=(self.id, self.lost), name=f"lease-{self.id:x}",
                                 daemon=True).start()
            return self.id

    def _keep(self, lease: int, lost: threading.Event) -> None:
        while not self.stop.wait(max(self.ttl / 3.0, 0.2)):
            try:
                left = self.reg.keepalive_once(lease)
            except RegistryError as exc:
                log.warning("lease %x: keepalive failed: %s", lease, exc)
                continue
            if left <= 0:
                log.warning("lease %x: gone from etcd (expired: this process was paused or cut off past its "
                            "%d s TTL)", lease, self.ttl)
                lost.set()
                return

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            lease, self.id = self.id, None
        if lease is not None and not self.lost.is_set():
            try:
                self.reg.revoke(lease)   # its keys go now: a standby need not wait for the TTL
            except RegistryError as exc:
                log.warning("lease %x: not revoked (%s): its keys go when it expires", lease, exc)


class Election:
    """Campaign for ``leader_key(role, scope)``; ``fence()`` is the compare every write of the holder carries."""

    def __init__(self, reg: Registry, role: str, scope: str, keeper: LeaseKeeper, who: str | None = None):
        self.reg, self.keeper = reg, keeper
        self.key = schema.leader_key(role, scope)
        self.who = who or whoami()
        self.revision: int | None = None      # create revision of our key while we hold it
        self.since: float | None = None
        self.lease: int | None = None

    @property
    def active(self) -> bool:
        """It won and no write of it was refused since.  A lease found gone does not end it by itself: the
        holder's next write (every round writes its status) is refused by the fence if a successor won or the
        key went with the lease, and that steps it down — one authority (etcd's compare), no race between
        the keepalive thread and the round."""
        return self.revision is not None

    def campaign(self) -> bool:
        """One try: True if this process holds the key now (won, or still holds it)."""
        if self.active:
            return True
        self.revision = None
        for _ in range(2):
            lease = self.keeper.get()
            rec = schema.Leader(who=self.who, since=time.time(), lease=lease)
            try:
                ok, rev = self.reg.txn([Registry.cmp_mod(self.key, 0)], {self.key: rec.to_json()}, lease=lease)
                break
            except RegistryError as exc:   # expired before its keepalive noticed (a pause): a new one, once
                if "lease not found" not in str(exc):
                    raise
                self.keeper.lost.set()
        else:
            return False
        if not ok:
            return self._adopt(lease)
        self.revision, self.since, self.lease = rev, rec.since, lease
        log.warning("%s: %s is now the active one (revision %d)", self.key, self.who, rev)
        return True

    def _adopt(self, lease: int) -> bool:
        """The key exists: if it is ours under our live lease (a campaign whose answer was lost, yet applied),
        hold it; else another process does.  Without this, an ambiguous win left our own key, kept alive by our
        lease, in everyone's way: no runner active until this process died."""
        got = self.reg.get(self.key)
        if got is None:
            return False
        try:
            rec = schema.Leader.from_json(got[0], self.key)
        except RegistryError:
            return False
        if rec.who != self.who or rec.lease != lease:
            return False
        rev = got[1]                      # never rewritten while held: its mod revision is its create revision
        ok, _ = self.reg.txn([Registry.cmp_created(self.key, rev)], {})
        if not ok:
            return False
        self.revision, self.since, self.lease = rev, rec.since, lease
        log.warning("%s: %s holds it already (a campaign whose answer was lost had won, revision %d): active",
                    self.key, self.who, rev)
        return True

    def fence(self) -> dict:
        if self.revision is None:
            raise RegistryError(f"{self.who} does not hold {self.key}: no fence to write with")
        return Registry.cmp_created(self.key, self.revision)

    def lost(self, why: str) -> None:
        """A fenced write was refused, or the lease went: step down (campaign again later)."""
        if self.revision is not None:
            holder = self.holder()
            log.warning("%s: %s is no longer the active one (%s); now held by %s", self.key, self.who, why,
                        f"{holder.who} since {time.strftime('%H:%M:%S', time.localtime(holder.since))}"
                        if holder else "nobody")
        self.revision = None

    def holder(self) -> schema.Leader | None:
        return holder(self.reg, self.key)

    def still_mine(self) -> bool:
        """The key is still ours (a refused write was about the data, not the fence)."""
        try:
            h = self.holder()
        except RegistryError:
            return False
        return h is not None and h.who == self.who and h.lease == self.lease

    def resign(self) -> None:
        """Give the key up now (a standby need not wait for the lease): only if it is still ours."""
        if self.revision is None:
            return
        try:
            self.reg.txn([self.fence()], {}, deletes=[self.key])
        except RegistryError as exc:
            log.warning("%s: not given up (%s): it goes with the lease", self.key, exc)
        self.revision = None


def holder(reg: Registry, key: str) -> schema.Leader | None:
    """Who holds an election key now (None: nobody, or an unreadable record)."""
    got = reg.get(key)
    if got is None:
        return None
    try:
        return schema.Leader.from_json(got[0], key)
    except RegistryError:
        return None
