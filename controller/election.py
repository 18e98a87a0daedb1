"""One active route agent per node: an etcd election whose revision fences the node's switch.

The agent that creates ``route-agents/<node>`` (a transaction: only if it is absent, under the agent's lease)
is the node's active agent; the revision of that transaction, which etcd never hands out twice and only
ever raises, is the ``generation_id`` it sends with its OpenFlow 1.3+ role request MASTER.  Open vSwitch then
refuses a role request with an older generation (OFPRRFC_STALE) and, having made the newest requester master,
demotes the others to SLAVE, whose flow-mods and bundles it refuses (OFPBRC_IS_SLAVE).  So an agent that was
paused past its lease (SIGSTOP, a starved VM) and wakes up still believing it leads can no longer write to
the switch: the switch, not the agent's belief, decides (Jepsen's lesson on etcd locks: fence with a
revision).

``Election.run`` campaigns, keeps the lease alive while it leads, and campaigns again when the lease is
lost (an agent that lost becomes a standby); ``on_change(generation or 0)`` tells the app.  The lease's TTL
bounds the failover: a dead agent's key goes after at most ``ttl`` s and the standby's next campaign (every
``poll`` s) wins.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema
from vfab.vid.registry.etcd import Registry

log = logging.getLogger("vfab.controller.election")


class Election:
    def __init__(self, reg: Registry, node: str, on_change: Callable[[int], None], *, ttl: int = 1,
                 poll: float = 0.1, ident: str | None = None):
        self.reg = reg
        self.node = node
        self.key = schema.route_agent_key(node)
        self.on_change = on_change
        self.ttl = ttl
        self.poll = poll
        self.ident = ident or f"{os.getpid()}@{socket.gethostname()}"
        self.generation = 0
        self.lease = 0

    def try_once(self) -> int:
        """One campaign: the generation if this agent now leads, 0 if another one does (logged once)."""
        lease = self.reg.lease(self.ttl)
        ok, rev = self.reg.txn([self.reg.cmp_mod(self.key, 0)], {self.key: self.ident}, lease=lease)
        if ok:
            self.lease = lease
            return rev
        try:
            self.reg.revoke(lease)
        except RegistryError:
            pass
        return 0

    def run(self, stop: threading.Event) -> None:
        holder = ""
        while not stop.is_set():
            try:
                gen = self.try_once()
            except RegistryError as exc:
                log.warning("node %s: election: %s; retrying", self.node, exc)
                stop.wait(self.poll * 5)
                continue
            if not gen:
                got = self.reg.get(self.key)
                who = got[0].decode(errors="replace") if got else "nobody"
                if who != holder:
                    log.info("node %s: standby: route agent %s is active; taking over when its lease (%d s) ends",
                             self.node, who, self.ttl)
                    holder = who
                stop.wait(self.poll)
                continue
            holder = ""
            self.generation = gen
            log.info("node %s: active route agent (generation %d, lease %x)", self.node, gen, self.lease)
            self.on_change(gen)
            self._keep(stop)
            self.generation = 0
            self.on_change(0)

    def _keep(self, stop: threading.Event) -> None:
        """Keep the lease while it lasts; return when it is gone (or ``stop``)."""
        last_ok = time.monotonic()
        while not stop.wait(max(self.ttl / 4.0, 0.1)):
            try:
                left = self.reg.keepalive_once(self.lease)
            except RegistryError as exc:
                if time.monotonic() - last_ok < self.ttl:
                    continue
                log.error("node %s: cannot renew the election's lease for %d s (%s): standing down", self.node,
                          self.ttl, exc)
                return
            if left <= 0:
                log.error("node %s: the election's lease %x ended (this agent was paused or starved past %d s): "
                          "another agent may lead now; standing down", self.node, self.lease, self.ttl)
                return
            last_ok = time.monotonic()
        try:
            self.reg.revoke(self.lease)   # stopping: hand over at once
        except RegistryError:
            pass
