"""An endpoint's etcd lease: liveness for the fabric, authority for the endpoint itself.

The endpoint record (and its op and load records) live under the lease; when
it expires the controller stops routing to the endpoint and a mirror may take
its ranges over.  So the lease is also a *fence*: an owner may serve its
ranges only while it knows its lease is alive.  Each keepalive is sent at
``t`` and etcd then extends the lease to at least ``t + ttl``; the endpoint
counts its authority from the send time of the last keepalive that succeeded,
minus a margin, on its own monotonic clock (``valid_until``).  A process that
was stopped (SIGSTOP), starved or cut off from etcd past that point stops
serving by itself — before anyone else can take over.

When etcd answers that the lease is gone (it expired while we were away), the
lease is granted anew and every leased record is put back (``on_renewed``
callbacks), within one keepalive period of resuming; the endpoint then
re-reads its view before serving again.

The TTL bounds how soon a mirror can take over after a crash (the lease must
expire first; etcd reaps expired leases on a 0.5 s scan): with 3 s a mirror
served a killed owner's DHCP clients 3.0-3.1 s after the kill, with 2 s
1.8-2.3 s, with 1 s 0.75-1.4 s (tests/integration/test_sdhcp_failover.py).  1 s
needs an etcd whose election timeout allows it (its minimum TTL is 1.5 election
timeouts, rounded up to whole seconds: the testbed's 500 ms allows 1 s, the
default 1000 ms raises every shorter TTL to 2 s).  The margin scales with the
TTL (at most 0.5 s, a quarter of a short TTL) so that a 1 s lease still leaves
the owner 0.75 s of authority per keepalive, sent every TTL/3, on the wall clock's multiples of that
period (``until_beat``): every lease of a fabric with the same TTL is refreshed at the same instants, and
etcd wakes once for all of them (bench/etcd_client.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from vfab.vid.errors import RegistryError
from vfab.vid.registry import Registry
from vfab.vid.registry.etcd import until_beat

log = logging.getLogger("vfab.state.lease")
MARGIN = 0.5  # s of the TTL the endpoint does not count on (clock rates, request latency), at most
MIN_TTL = 1   # s; etcd may raise it (see above), which only makes the endpoint more careful than it needs


class EndpointLease:
    def __init__(self, endpoint: str, ttl: int, name: str = ""):
        if ttl < MIN_TTL:
            raise RegistryError(f"lease TTL {ttl} s is too short: use at least {MIN_TTL} s (default 3)")
        self.reg = Registry(endpoint)
        self.ttl = ttl
        self.margin = min(MARGIN, ttl / 4)
        self.name = name
        self.id = 0
        self.valid_until = 0.0           # time.monotonic() up to which we may act as owner
        self.generation = 0              # grows each time the lease is granted anew
        self.on_renewed: list[Callable[[int], None]] = []  # called with the new lease id
        # called with (valid_until, generation) each time a keepalive moves valid_until (sdhcp's native lane)
        self.on_extend: list[Callable[[float, int], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()

    @property
    def valid(self) -> bool:
        return time.monotonic() < self.valid_until

    def grant(self) -> int:
        t = time.monotonic()
        self.id = self.reg.lease(self.ttl)
        self.valid_until = t + self.ttl - self.margin
        self.generation += 1
        return self.id

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"lease-{self.name}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def revoke(self) -> None:
        """The end: no keepalive or new grant after this (one under way finishes first, then goes too)."""
        self.stop()
        with self._lock:   # a grant under way (tick) ends before, and its lease is the one revoked
            if self.id:
                try:
                    self.reg.revoke(self.id)
                except RegistryError as exc:
                    log.warning("%s: could not revoke lease %x (%s); it expires by itself", self.name, self.id,
                                exc)
        self.reg.close()

    def _run(self) -> None:
        period = max(self.ttl / 3.0, 0.2)
        while not self._stop.is_set():
            self._wake.wait(until_beat(period))   # in step with every other lease of this period
            self._wake.clear()
            if self._stop.is_set():
                return
            self.tick()

    def tick(self) -> None:
        """One keepalive; renews the lease and its records if etcd lost it."""
        t = time.monotonic()
        try:
            ttl = self.reg.keepalive_once(self.id)
        except RegistryError as exc:
            log.warning("%s: keepalive of lease %x failed: %s (authority for %.1f s more)", self.name, self.id,
                        exc, max(0.0, self.valid_until - time.monotonic()))
            return
        if ttl > 0:
            self.valid_until = max(self.valid_until, t + min(ttl, self.ttl) - self.margin)
            for fn in self.on_extend:
                fn(self.valid_until, self.generation)
            return
        if self._stop.is_set():
            return   # closing: the lease is gone because revoke() revoked it (a SIGTERM during this keepalive)
        log.warning("%s: lease %x expired (the process was stopped or cut off for more than %d s): "
                    "registering again", self.name, self.id, self.ttl)
        self.valid_until = 0.0
        try:
            with self._lock:
                if self._stop.is_set():   # revoke() ran meanwhile: registering again would outlive us
                    return
                self.grant()
                self.valid_until = 0.0  # not before every record is back and the view re-read
                for cb in list(self.on_renewed):
                    cb(self.id)
                self.valid_until = t + self.ttl - self.margin
            log.warning("%s: registered again under lease %x", self.name, self.id)
        except RegistryError as exc:
            self.valid_until = 0.0
            log.warning("%s: registering again failed: %s; retrying", self.name, exc)
