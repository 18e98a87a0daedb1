"""memcached's load as a leased ``Usage`` report in etcd, read on memcached's own host (issue 45, 5).

The balancer may run on any host; memcached's ``stats`` answer only where memcached runs (in the testbed,
inside its host's network namespace).  So a reporter beside memcached — its agent (``agent.py memcached``)
or ``vfab balancer report`` for a memcached started otherwise — reads ``stats`` over local TCP every
``every`` s and writes ``/vfab/v1/usage/<service>/<endpoint>``:

* ``cpu``: ``rusage_user + rusage_system`` per second, ``served``: ``cmd_get + cmd_set`` per second, both over
  the last read's interval (``window``), ``cores``: ``threads``;
* written when a number moved by more than ``CHANGE`` (10 %, and at least ``MIN_STEP`` requests/s) since
  the last write, or the last write is ``heartbeat`` s old: a burst's onset goes out at the next read, a
  steady or idle memcached costs etcd one write per heartbeat;
* under the endpoint's lease (the agent's), so the report goes when memcached's endpoint goes;
* ``error`` when ``stats`` could not be read (said once per heartbeat).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

from vfab.vid.errors import RegistryError, VfabError
from vfab.vid.netns import netns
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.mc.usage")
CHANGE = 0.10      # relative move of cpu or served that is written at once
MIN_STEP = 50.0    # requests/s: smaller moves wait for the heartbeat (an idle memcached's noise)


@dataclass(frozen=True)
class Memcached:
    """Where a memcached answers ``stats``: HOST:PORT, optionally inside a network namespace (its host's)."""

    host: str
    port: int
    netns: str = ""

    @classmethod
    def parse(cls, text: str) -> "Memcached":
        addr, _, ns = text.partition("@")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"memcached address {text!r} is malformed: write HOST:PORT[@NETNS-PATH], "
                             "e.g. 10.0.0.1:11211@/proc/1234/ns/net")
        return cls(host, int(port), ns)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class StatsConn:
    """One TCP connection to memcached kept for its ``stats`` (a reporter reads them every 0.1 s or faster: no
    connect and close each time); opened again after any failure."""

    def __init__(self, where: Memcached, timeout: float = 1.0):
        self.where, self.timeout = where, timeout
        self.sock: socket.socket | None = None

    def stats(self) -> dict[str, str]:
        if self.sock is None:
            with netns(self.where.netns or None):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect((self.where.host, self.where.port))
            except OSError:
                sock.close()
                raise
            self.sock = sock
        try:
            return _ask(self.sock)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def memcached_stats(where: Memcached, timeout: float = 1.0) -> dict[str, str]:
    """memcached's ``stats`` (``STAT name value`` lines up to ``END``) over a fresh TCP connection."""
    conn = StatsConn(where, timeout)
    try:
        return conn.stats()
    finally:
        conn.close()


def _ask(sock: socket.socket) -> dict[str, str]:
    sock.sendall(b"stats\r\n")
    buf = b""
    while not buf.endswith(b"END\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("memcached closed the connection before END")
        buf += chunk
        if len(buf) > 1 << 20:
            raise OSError("stats answer larger than 1 MB: not memcached?")
    out = {}
    for line in buf.decode("ascii", "replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "STAT":
            out[parts[1]] = parts[2]
    return out


class UsageMeter:
    """Successive ``stats`` reads → the next ``Usage`` to write, or None when nothing moved enough."""

    def __init__(self, source: str, every: float, heartbeat: float):
        self.source, self.every, self.heartbeat = source, every, heartbeat
        self.prev: tuple[float, float, float] | None = None   # (t, cpu s, requests) of the last read
        self.sent: schema.Usage | None = None

    def read(self, t: float, st: dict[str, str]) -> schema.Usage | None:
        cpu_s = float(st["rusage_user"]) + float(st["rusage_system"])
        reqs = float(st["cmd_get"]) + float(st.get("cmd_set", 0))
        cores = max(float(st.get("threads", 1)), 1.0)
        prev, self.prev = self.prev, (t, cpu_s, reqs)
        if prev is None or t <= prev[0] or reqs < prev[2] or cpu_s < prev[1]:
            return None   # the first read, or memcached restarted: no rate yet
        dt = t - prev[0]
        rec = schema.Usage(at=t, cpu=(cpu_s - prev[1]) / dt, served=(reqs - prev[2]) / dt, cores=cores,
                           window=dt, every=self.heartbeat, source=self.source)
        return rec if self.due(rec) else None

    def failed(self, t: float, why: str) -> schema.Usage | None:
        self.prev = None
        rec = schema.Usage(at=t, every=self.heartbeat, source=self.source, error=why)
        return rec if self.sent is None or not self.sent.error or t - self.sent.at >= self.heartbeat else None

    def due(self, rec: schema.Usage) -> bool:
        last = self.sent
        if last is None or last.error or rec.at - last.at >= self.heartbeat:
            return True
        return moved(last.served, rec.served, MIN_STEP) or moved(last.cpu, rec.cpu, MIN_STEP * 1e-5)


def moved(before: float, now: float, floor: float) -> bool:
    return abs(now - before) > max(CHANGE * max(before, now), floor)


class UsageReporter:
    """Reads memcached every ``every`` s (call ``tick`` as often as you like) and writes its Usage when due."""

    def __init__(self, reg: Registry, service: str, endpoint: str, where: Memcached, every: float = 0.1,
                 heartbeat: float = 0.5, clock=time.time):
        if not 0.005 <= every <= heartbeat:
            raise ValueError(f"usage report period {every} s must be 0.005 s or more and at most the heartbeat "
                             f"({heartbeat} s)")
        self.reg, self.where, self.clock = reg, where, clock
        self.key = schema.usage_key(service, endpoint)
        self.meter = UsageMeter(f"memcached {where}", every, heartbeat)
        self.conn = StatsConn(where, timeout=min(1.0, heartbeat))
        self.every = every
        self.next = 0.0
        self.writes = 0

    def tick(self, lease: int | None) -> schema.Usage | None:
        """Read and maybe write (under ``lease``); the record written, if one was."""
        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + self.every
        t = self.clock()
        try:
            rec = self.meter.read(t, self.conn.stats())
        except (OSError, KeyError, ValueError, VfabError) as exc:
            rec = self.meter.failed(t, f"stats of {self.meter.source}: {exc}")
        if rec is None:
            return None
        try:
            self.reg.put(self.key, rec.to_json(), lease=lease, repeat=True)
        except RegistryError as exc:   # the lease gone (the endpoint is being announced again) or etcd away
            log.warning("%s: not written: %s", self.key, exc)
            return None
        self.meter.sent = rec
        self.writes += 1
        return rec

    def close(self) -> None:
        self.conn.close()

    def clear(self) -> None:
        try:
            self.reg.delete(self.key)
        except RegistryError as exc:
            log.warning("%s: not deleted: %s", self.key, exc)
