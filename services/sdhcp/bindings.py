"""Bindings: the addresses a shard leased to DHCP hosts, published for the fabric's source guard.

A host registered with ``dhcp: true`` gets its addresses from DHCP; a source-guarded front door (memcached's
udp door) takes its requests only from the addresses its ``Binding`` records give, so a tenant cannot make a
service answer to someone else's address.  The shard that acknowledges such a host's lease writes
``/vfab/v1/bindings/<mac>`` (address, lease end, service, shard), each write compared with what it read, and never
over another shard's binding that ends later (a write that comes late, from a shard that lost the client's range
meanwhile, would undo the newer lease); the host's RELEASE or DECLINE deletes it (only the version this shard
wrote); the controller ignores a binding once its lease ended and turns the others into
flows.  Every shard of the service also clears its service's bindings that ended over ``GC_S`` ago, and
every ``RECONCILE_S`` (and at start) publishes again what its own leases say and etcd lacks: a binding lost
with a shard killed before it wrote, or while etcd was away, comes back without waiting for the client's
next renewal (a mirror taking a dead shard's range over does the same for that range).

Off the loop's thread: the backend hands each committed batch's events to :meth:`Binder.offer`; a thread
writes them at most every ``PASS_S`` in etcd transactions of up to ``BATCH`` puts, the newest event of a MAC
winning.  A write that fails is retried every ``RETRY_S`` (said once in the log, and when it works again);
the clients are served meanwhile (only their source guard lags).  Which MACs are DHCP hosts comes from the
host records, kept current by a watch of their own: a burst of clients costs no etcd read, and a host an
operator marks ``dhcp`` gets its binding at once when this shard holds its lease (no wait for a renewal).
Events that come before the host records are read wait for them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable
from ipaddress import IPv4Address

from vfab.vid.codec import int_to_mac, mac_to_int
from vfab.vid.errors import RegistryError, VidError
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.sdhcp.bindings")

PASS_S = 0.05      # s between two writes (the events of that time go in one transaction)
BATCH = 64         # puts per etcd transaction (etcd allows 128 operations)
RETRY_S = 1.0      # s between tries while etcd fails
HOSTS_IDLE = 10.0  # s a watch of the host records may stay silent before it is renewed
GC_S = 60.0        # s after its end a binding of this service is deleted
RECONCILE_S = 30.0  # s between two comparisons of this shard's bound leases with the published bindings
CAS_TRIES = 5      # reads and compare-and-writes of one transaction's bindings while others write them too
WRITTEN_MAX = 65536  # versions of its own bindings a shard remembers (forgotten: deleted by the lease's end only)


class Binder:
    """Publishes one shard's bindings; ``offer`` from the loop's thread, the rest on its own thread."""

    def __init__(self, etcd: str, service: str, shard: str, clock=time.time, leases=lambda: []):
        """``leases()`` (called on this thread): (chaddr, address, lease end ms) of the shard's bound leases in
        the ranges it owns now."""
        self.etcd, self.service, self.shard, self.clock, self.leases = etcd, service, shard, clock, leases
        self.counters: collections.Counter = collections.Counter()
        self._pending: dict[int, tuple[int | None, float]] = {}   # chaddr -> (address or None, until unix s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written: dict[int, int] = {}      # chaddr -> mod revision of the binding this shard wrote
        self._dhcp: set[int] = set()            # MACs of hosts registered with dhcp: true (the watch's)
        self._hosts_ready = False               # the host records were read (else events wait)
        self._marked: set[int] = set()          # hosts marked dhcp since: their leases are looked up
        # told the DHCP hosts' MACs whenever they change, before their leases are looked up (the native lane
        # then queues binding events for these MACs only)
        self.on_hosts: Callable[[set[int]], None] = lambda macs: None
        self._gc_at = time.monotonic()
        self._reconcile_at = -1e9
        self._failing = ""
        self._thread = threading.Thread(target=self._run, name="bindings", daemon=True)

    # -- the loop's side -------------------------------------------------------------------------------
    def offer(self, events: list[tuple[int, int | None, int]]) -> None:
        """(chaddr, address or None, until ms) of a committed batch, in order."""
        with self._lock:
            for chaddr, ip, until_ms in events:
                self._pending[chaddr] = (ip, until_ms / 1000)
        self._wake.set()

    def start(self) -> "Binder":
        threading.Thread(target=self._watch_hosts, name="bindings-hosts", daemon=True).start()
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Write what is pending (for up to ``timeout`` s), then stop."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        reg = Registry(self.etcd)
        try:
            while True:
                due = self._reconcile_at + RECONCILE_S - time.monotonic()
                self._wake.wait(max(0.0, due) if not self._stop.is_set() else 0)
                if self._stop.is_set() and (not self._pending or not self._hosts_ready):
                    return
                self._stop.wait(PASS_S)
                self._wake.clear()
                try:
                    with self._lock:
                        marked, self._marked = self._marked, set()
                    if marked:
                        try:
                            self.reconcile(reg, only=marked)
                        except BaseException:
                            with self._lock:
                                self._marked |= marked   # looked up again at the next pass
                            raise
                    if time.monotonic() - self._reconcile_at >= RECONCILE_S and not self._stop.is_set():
                        self.reconcile(reg)
                    self.write(reg)
                    if time.monotonic() - self._gc_at >= GC_S:
                        self.collect(reg)
                except Exception as exc:  # noqa: BLE001 - etcd away (RegistryError) or a bug: kept, retried, said
                    self.counters["failed"] += 1
                    if not self._failing:
                        log.warning("%s: bindings not published (the source guard of the DHCP hosts leased "
                                    "meanwhile lags): %s; retrying every %.0f s", self.shard, exc, RETRY_S,
                                    exc_info=not isinstance(exc, RegistryError))
                    self._failing = str(exc)
                    if self._stop.wait(RETRY_S):
                        return
                    self._wake.set()
                    continue
                if self._failing:
                    log.info("%s: bindings published again", self.shard)
                    self._failing = ""
        finally:
            reg.close()

    @staticmethod
    def _dhcp_host(key: str, raw: bytes | None) -> tuple[int, bool] | None:
        """(MAC, marked dhcp) of a host record (None: gone), or None for a key that names no MAC."""
        try:
            mac = mac_to_int(key.rsplit("/", 1)[1])
        except VidError:
            return None
        if raw is None:
            return mac, False
        try:
            return mac, schema.Host.from_json(raw, key).dhcp
        except RegistryError:
            return mac, False

    def load_hosts(self, reg: Registry) -> int:
        """Read every host record (the DHCP hosts' MACs); the etcd revision read."""
        rev, items = reg.get_prefix(schema.folder("hosts"))
        self._reset_hosts(items)
        return rev

    def _reset_hosts(self, items: dict) -> None:
        dhcp = set()
        for key, (raw, _) in items.items():
            got = self._dhcp_host(key, raw)
            if got is not None and got[1]:
                dhcp.add(got[0])
        with self._lock:
            self.on_hosts(set(dhcp))
            self._marked |= dhcp - self._dhcp
            self._dhcp, self._hosts_ready = dhcp, True
        self._wake.set()

    def _host_events(self, batch: list) -> None:
        with self._lock:
            dhcp = set(self._dhcp)
            for ev in batch:
                got = self._dhcp_host(ev.key, ev.value)
                if got is not None:
                    (dhcp.add if got[1] else dhcp.discard)(got[0])
            if dhcp != self._dhcp:
                self.on_hosts(set(dhcp))
            self._marked |= dhcp - self._dhcp
            self._dhcp = dhcp
        self._wake.set()

    def _watch_hosts(self) -> None:
        """Keep the DHCP hosts current: read them, then follow their changes; on any failure read again."""
        reg = Registry(self.etcd)
        try:
            reg.follow(schema.folder("hosts"), lambda items, rev: self._reset_hosts(items), self._host_events,
                       self._stop, idle=HOSTS_IDLE, retry=RETRY_S)
        finally:
            reg.close()

    def write(self, reg: Registry) -> None:
        """One pass: every pending event of a DHCP host written (puts batched, each delete on its own)."""
        with self._lock:
            if not self._hosts_ready:
                return            # which MACs are DHCP hosts is not known yet: the events wait
            events, self._pending = self._pending, {}
            dhcp = set(self._dhcp)
        if not events:
            return
        try:
            puts = {}
            for chaddr, (ip, until) in events.items():
                if chaddr not in dhcp:
                    self.counters["not_dhcp_hosts"] += 1
                elif ip is not None:
                    mac = int_to_mac(chaddr)
                    puts[chaddr] = (schema.binding_key(mac), schema.Binding(
                        mac=mac, ip=str(IPv4Address(ip)), until=round(until, 3), service=self.service,
                        shard=self.shard))
            items = list(puts.items())
            for i in range(0, len(items), BATCH):
                part = dict(items[i:i + BATCH])
                self._put(reg, part)
                for chaddr in part:
                    del events[chaddr]
            for chaddr, (ip, _) in list(events.items()):
                if ip is None and chaddr in self._written:
                    key = schema.binding_key(int_to_mac(chaddr))
                    ok, _ = reg.txn([reg.cmp_mod(key, self._written.pop(chaddr))], {}, [key])
                    self.counters["deleted" if ok else "deleted_by_others"] += 1
                del events[chaddr]
        except BaseException:
            with self._lock:   # what was not written goes back, unless a newer event came meanwhile
                for chaddr, ev in events.items():
                    self._pending.setdefault(chaddr, ev)
            raise

    def _newer_elsewhere(self, have: schema.Binding | None, until: float) -> bool:
        """Is etcd's binding ``have`` another shard's later lease than ours (ending at ``until``)?  Then ours is
        late: its shard lost the client's range meanwhile, and the lease that range's owner gave since (a
        renewal, or a new address) ends later, the service's shards giving the same lease time."""
        return have is not None and have.shard != self.shard and have.until > until

    @staticmethod
    def _read(raw: bytes) -> schema.Binding | None:
        try:
            return schema.Binding.from_json(raw)
        except RegistryError:
            return None           # unreadable: ours replaces it

    def _put(self, reg: Registry, part: dict[int, tuple[str, schema.Binding]]) -> None:
        """Write one transaction's bindings, each only over what was read of it (a compare on its mod
        revision), none over another shard's later one; read again if another writer came in between."""
        for _ in range(CAS_TRIES):
            _, have = reg.get_many([key for key, _ in part.values()])
            cmps, puts, late = [], {}, []
            for chaddr, (key, b) in part.items():
                old = have.get(key)
                if old is not None and self._newer_elsewhere(self._read(old[0]), b.until):
                    late.append(chaddr)
                    continue
                cmps.append(reg.cmp_mod(key, old[1] if old else 0))
                puts[key] = b.to_json()
            ok, rev = reg.txn(cmps, puts) if puts else (True, 0)
            if not ok:
                self.counters["raced"] += 1
                continue
            if len(self._written) > WRITTEN_MAX:
                self._written.clear()
            for chaddr, (key, _) in part.items():
                if key in puts:
                    self._written[chaddr] = rev
                else:
                    self._written.pop(chaddr, None)
            self.counters["published"] += len(puts)
            self.counters["superseded"] += len(late)
            if late:
                log.info("%s: %d binding(s) not written: another shard's later lease of the same host is "
                         "in etcd (this shard lost those clients' ranges)", self.shard, len(late))
            return
        raise RegistryError(f"the bindings of {len(part)} host(s) kept changing under this shard's writes "
                            f"({CAS_TRIES} tries)")

    def reconcile(self, reg: Registry, only: set[int] | None = None) -> int:
        """Queue every bound lease of a DHCP host (of ``only``, if given) whose binding etcd lacks or holds with
        another address or an earlier end (a newer event of that MAC wins); how many."""
        if only is None:
            self._reconcile_at = time.monotonic()
        with self._lock:
            dhcp = set(self._dhcp) if only is None else only & self._dhcp
        leases = [x for x in self.leases() if x[0] in dhcp] if dhcp else []
        if not leases:
            return 0
        _, items = reg.get_prefix(schema.folder("bindings"))
        have = {mac_to_int(b.mac): b for _, b, _ in schema.records(items, schema.Binding)}
        missing = []
        for chaddr, ip, until_ms in leases:
            b = have.get(chaddr)
            if self._newer_elsewhere(b, until_ms / 1000):
                continue      # another shard's later lease: ours is the older
            if b is None or b.ip != str(IPv4Address(ip)) or b.until < until_ms / 1000 - 1:
                missing.append((chaddr, ip, until_ms))
        with self._lock:
            for chaddr, ip, until_ms in missing:
                self._pending.setdefault(chaddr, (ip, until_ms / 1000))
        self.counters["reconciled"] += len(missing)
        if missing:
            log.info("%s: %d binding(s) missing or stale in etcd, published again", self.shard, len(missing))
        return len(missing)

    def collect(self, reg: Registry, now: float | None = None) -> int:
        """Delete this service's bindings that ended over ``GC_S`` ago (each only as read); how many."""
        self._gc_at = time.monotonic()
        now = self.clock() if now is None else now
        _, items = reg.get_prefix(schema.folder("bindings"))
        gone = 0
        for key, b, rev in schema.records(items, schema.Binding):
            if b.service == self.service and b.until < now - GC_S:
                ok, _ = reg.txn([reg.cmp_mod(key, rev)], {}, [key])
                gone += ok
        self.counters["collected"] += gone
        return gone
