"""The registry: vfab's view of etcd (its v3 API through the JSON gateway every member serves).

Every write that changes a range is one etcd transaction comparing the
mod-revisions (hence epochs) of all ranges it touches, so two operators can
never both win.  Key names come from ``schema`` only.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from prometheus_client import Counter, Histogram

from vfab.vid.registry import schema
from vfab.vid.codec import KEY_MAX, SERVICE_MAX, Layout
from vfab.vid.errors import Compacted, Conflict, MemberDown, NotFound, RegistryError, VidError
from vfab.vid.ranges import Range
from vfab.vid.registry.members import DEFAULT_ENDPOINT, HASLEADER, PROBE, Members

log = logging.getLogger("vfab.registry")
BACKOFF = 0.05   # s between tries while every member says "no leader" (an election takes ~1-2 election timeouts)
CONNECT = 1.0    # s to connect to one of several members before trying the next (a host that is off)
# one encoder for every request: json.dumps with separators builds a new one per call (~0.2 ms of a cold
# keepalive thread's 1 ms)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode

# What etcd looks like from this process (vfab.vid.metrics serves them): ``op`` is the gateway path without
# /v3/ ("kv/range", "kv/txn", "lease/keepalive", ...), ``reason`` the error's class (bounded by both).
REQUEST_SECONDS = Histogram("vfab_etcd_request_duration_seconds", "etcd requests of this process, failing over "
                            "between members included", ["op"],
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
REQUEST_ERRORS = Counter("vfab_etcd_request_errors_total", "etcd requests of this process that failed, by the "
                         "error's kind", ["op", "reason"])
WATCH_BREAKS = Counter("vfab_etcd_watch_breaks_total", "watches of this process that broke and were resumed or "
                       "read again", ["reason"])


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def until_beat(period: float, now: float | None = None) -> float:
    """Seconds to the next whole multiple of ``period`` on the wall clock, in (0, period].

    Lease keepalives wait for it, so every process with the same period sends at the same instants and
    etcd wakes once for all of them (load reports do not: see vfab.vid.state.housekeeper): 4 leases kept alive 3 times a
    second added 0.028 CPU-s per second to an idle etcd at phases spread over the period, 0.011 on these
    beats (bench/etcd_client.py).  The wall clock lines up processes on other hosts too (NTP); a step of
    it moves one wait, never past one period.
    """
    now = time.time() if now is None else now
    return period - (now % period) or period


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


class _Http:
    """One HTTP/1.1 keep-alive connection to the gateway, reading no more of HTTP than etcd's gateway
    speaks: a status line, headers (Content-Length, chunked Transfer-Encoding, Connection), a body.

    A lease keepalive sent every 1/3 s (each shard sends 3 a second) cost the sending thread 0.73 ms of
    CPU through ``http.client`` (its header parsing goes through ``email``, and every wake-up finds that
    code cold), 0.48 ms through this (bench/etcd_client.py, 2026-11-29).  Failures raise what
    ``http.client`` raises: OSError (timeouts, resets) or an ``http.client.HTTPException``.
    """

    MAX_HEAD = 65536   # bytes of status line and headers

    def __init__(self, host: str, port: int, timeout: float | None,
                 slow: Callable[[float], str | None] | None = None):
        """``slow(waited)``: asked each ``PROBE`` s an answer is late; a reason ends the wait (TimeoutError)."""
        self.sock = socket.create_connection((host, port), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._slow = slow
        if slow is not None:
            self.sock.settimeout(PROBE)
        self._host = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n{HASLEADER}: true\r\n".encode()
        self._buf = bytearray()
        self._pos = 0
        self._sent = 0.0

    def close(self) -> None:
        self.sock.close()

    def stale(self) -> bool:
        """True when the member closed the connection (EOF reads as ready) or sent what nobody asked for."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        """(status, body, whether the member closes the connection after it)."""
        self._sent = time.monotonic()
        self.sock.sendall(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self._host, len(body), body))
        self._buf.clear()
        self._pos = 0
        while True:
            version, status, fields = self._head()
            if status >= 200:
                break   # 1xx: an interim answer, the real one follows
        conn = fields.get(b"connection", b"").lower()
        close = conn == b"close" or (version == b"HTTP/1.0" and conn != b"keep-alive")
        if status in (204, 304):
            data = b""
        elif b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            data = self._chunked()
        elif b"content-length" in fields:
            try:
                length = int(fields[b"content-length"])
            except ValueError:
                raise http.client.HTTPException(f"bad Content-Length {fields[b'content-length']!r}") from None
            data = self._exactly(length)
        else:
            data, close = self._to_eof(), True
        if self._pos != len(self._buf):
            close = True   # bytes past the answer: nothing may read them as the next one's
        return status, data, close

    def _fill(self) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        while True:
            try:
                got = self.sock.recv(65536)
                break
            except TimeoutError:
                why = self._slow(time.monotonic() - self._sent) if self._slow is not None else "timed out"
                if why is not None:
                    raise TimeoutError(why) from None
        if not got:
            raise http.client.RemoteDisconnected("the member closed the connection in the middle of its answer")
        self._buf += got

    def _until(self, mark: bytes, limit: int) -> bytes:
        """The bytes up to ``mark`` (taken, with the mark); at most ``limit`` of them."""
        while True:
            end = self._buf.find(mark, self._pos)
            if 0 <= end <= self._pos + limit:
                out = bytes(self._buf[self._pos:end])
                self._pos = end + len(mark)
                return out
            if len(self._buf) - self._pos > limit:
                raise http.client.LineTooLong(f"more than {limit} bytes without {mark!r}")
            self._fill()

    def _head(self) -> tuple[bytes, int, dict[bytes, bytes]]:
        lines = self._until(b"\r\n\r\n", self.MAX_HEAD).split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
            raise http.client.BadStatusLine(lines[0][:80].decode(errors="replace"))
        fields: dict[bytes, bytes] = {}
        for field in lines[1:]:
            name, sep, value = field.partition(b":")
            if not sep:
                raise http.client.HTTPException(f"malformed header {field[:80]!r}")
            fields[name.strip().lower()] = value.strip()
        return parts[0], int(parts[1]), fields

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) - self._pos < n:
            self._fill()
        data = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        return data

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self._until(b"\r\n", 1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise http.client.HTTPException(f"bad chunk size {line[:40]!r}") from None
            if size == 0:
                while self._until(b"\r\n", self.MAX_HEAD):   # trailers, up to the empty line
                    pass
                return bytes(out)
            out += self._exactly(size)
            if self._until(b"\r\n", 2):
                raise http.client.HTTPException("a chunk longer than its size")

    def _to_eof(self) -> bytes:
        while True:
            try:
                self._fill()
            except http.client.RemoteDisconnected:
                break
        data = bytes(self._buf[self._pos:])
        self._pos = len(self._buf)
        return data


class _NotSent(Exception):
    """No connection to the member could be made: nothing was sent (the request may go to another member)."""


class _Gateway:
    """POSTs to etcd's JSON gateway over HTTP/1.1 keep-alive connections (``_Http``), one per thread, to the
    member the process uses now (``Members.current``).

    A request costs one round trip and a JSON encode/decode.  A connection the member closed meanwhile is
    noticed before it is used again (it reads as ready); a request that fails once sent is never repeated
    here, because a transaction may have been applied: the caller (:meth:`Registry._post`) decides.
    """

    HEADERS = {"Content-Type": "application/json", HASLEADER: "true"}

    def __init__(self, members: Members, timeout: float):
        self.members, self.timeout = members, timeout
        self._local = threading.local()

    def connect(self, member: str, timeout: float | None) -> http.client.HTTPConnection:
        """A connection of ``http.client``'s, for a watch stream (read a line at a time as events come)."""
        host, _, port = member.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _conn(self, member: str) -> _Http:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and (local.pid != os.getpid() or local.member != member or conn.stale()):
            conn.close()   # closed by the member (EOF reads as ready), inherited across a fork, or another member
            conn = local.conn = None
        if conn is None:
            host, _, port = member.rpartition(":")

            def slow(waited: float) -> str | None:
                return self.members.abandon(member, local.pending, waited, self.timeout)

            several = len(self.members.all) > 1   # one member: nowhere else to go, no probing, no hurry
            try:
                conn = _Http(host, int(port), min(self.timeout, CONNECT) if several else self.timeout,
                             slow=slow if several else None)
            except OSError as exc:
                raise _NotSent(exc.__class__.__name__) from None
            local.conn, local.member, local.pid = conn, member, os.getpid()
        return conn

    def post(self, member: str, path: str, body: bytes, safe: bool = False) -> tuple[int, bytes]:
        """(HTTP status, body) from ``member``; _NotSent, or OSError and http.client.HTTPException once sent.
        After a failure the connection is dropped: an answer that comes late must not be read as the next
        request's."""
        conn = self._conn(member)
        self._local.pending = {"term": self.members.term, "safe": safe}
        try:
            status, data, close = conn.post(path, body)
        except BaseException:
            self.close()
            raise
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


# Requests repeated on another member when their answer was lost: they change nothing (etcd's own client
# retries the same kinds by itself).  Puts, deletes, transactions and lease grants are not repeated: one
# may have been applied, and the caller is told so.
SAFE = frozenset({"/kv/range", "/lease/keepalive", "/lease/timetolive", "/maintenance/status"})
# etcd errors after which a safe request is asked again (of the next member): it was not served
_RETRY = ("leader changed", "request timed out", "too many requests", "server stopped")


class _Behind(Compacted):
    """The member a watch resumed on has not reached the revision resumed from: read the keys again (they are
    right whatever the member's reason), as after a compaction."""


def _no_leader(status: int, text: str) -> bool:
    return status == 503 and "no leader" in text


@dataclass
class Event:
    key: str
    value: bytes | None  # None = deleted
    revision: int


class Registry:
    """A connection to the etcd that holds a fabric's truth."""

    def __init__(self, endpoint: str | Sequence[str] = DEFAULT_ENDPOINT, timeout: float = 5.0):
        """``endpoint``: the cluster's members, ``HOST:PORT[,HOST:PORT...]`` or a list (see ``members``);
        ``timeout``: s a request may take, failing over between members included."""
        self.members = Members.of(endpoint)
        self.endpoint = self.members.text   # the whole list: ``Registry(reg.endpoint)`` reaches the same cluster
        self.timeout = timeout
        self._gw = _Gateway(self.members, timeout)
        self._keepalives: list[threading.Event] = []

    @property
    def member(self) -> str:
        """The member this process talks to now."""
        return self.members.current()

    # -- raw access -------------------------------------------------------
    def _unreachable(self, why: dict[str, str], what: str = "", leaderless: set[str] = frozenset()) -> RegistryError:
        if leaderless:
            down = f"; {', '.join(why)} refuse connections" if why else ""
            return RegistryError(f"the etcd cluster {self.endpoint} has had no leader for {self.timeout:.0f} s "
                                 f"({', '.join(sorted(leaderless))} answer without one{down}): is a majority of its "
                                 "members down?")
        if len(self.members.all) == 1:
            return RegistryError(f"etcd at {self.endpoint} is unreachable ({why[self.endpoint]}){what}: start it "
                                 "with 'vfab up' or point --etcd at a running member")
        each = ", ".join(f"{m}: {w}" for m, w in why.items())
        return RegistryError(f"no etcd member of {self.endpoint} answers ({each}){what}: start them, or point "
                             "--etcd at running members")

    def _post(self, path: str, body: dict, safe: bool | None = None) -> dict:
        t0 = time.perf_counter()
        op = path[1:]
        try:
            out = self._request(path, body, safe)
        except RegistryError as exc:
            REQUEST_ERRORS.labels(op, type(exc).__name__).inc()
            raise
        REQUEST_SECONDS.labels(op).observe(time.perf_counter() - t0)
        return out

    def _request(self, path: str, body: dict, safe: bool | None = None) -> dict:
        """One request, to the member in use, moving on to the others as ``members`` describes: at once when
        nothing was sent, every BACKOFF s while members have no leader, and, for SAFE requests only, when an
        answer was lost; within ``timeout`` s."""
        safe = path in SAFE if safe is None else safe
        raw = _ENCODE(body).encode()
        deadline = time.monotonic() + self.timeout
        refused: dict[str, str] = {}
        leaderless: set[str] = set()
        while True:
            member = self.members.current()
            try:
                status, data = self._gw.post(member, "/v3" + path, raw, safe)
            except _NotSent as exc:
                refused[member] = str(exc)
                self.members.failed(member, f"refuses connections ({exc})")
                if len(refused) >= len(self.members.all) or time.monotonic() > deadline:
                    raise self._unreachable(refused, leaderless=leaderless) from None
                continue
            except (OSError, http.client.HTTPException) as exc:
                why = str(exc) if isinstance(exc, TimeoutError) and str(exc) else exc.__class__.__name__
                now = self.members.failed(member, f"lost a request ({why})")
                if not safe:
                    raise RegistryError(f"etcd member {member} lost a request ({why}): it may or may not have "
                                        f"been applied; read back before repeating it (now using {now})") from None
                if len(self.members.all) == 1 or time.monotonic() > deadline:
                    raise self._unreachable({member: why}) from None
                continue
            if status != 200:
                text = data[:200].decode(errors="replace")
                if len(self.members.all) == 1:   # nowhere else to go: the caller is told at once, as ever
                    raise RegistryError(f"etcd at {member} answered {status}: {text}")
                if _no_leader(status, text):
                    leaderless.add(member)
                    if time.monotonic() > deadline:
                        raise self._unreachable(refused, leaderless=leaderless)
                    self.members.failed(member, "has no leader", election=True)
                    time.sleep(BACKOFF)
                    continue
                if safe and any(e in text for e in _RETRY) and time.monotonic() < deadline:
                    self.members.failed(member, f"answered {status}: {text[:80]}")
                    continue
                raise RegistryError(f"etcd at {member} answered {status}: {text}")
            try:
                out = json.loads(data)
            except ValueError:
                raise RegistryError(f"etcd at {member} answered with what is not JSON: {data[:200]!r}") from None
            self.members.answered(member, out.get("header") or {})
            return out

    def get_prefix(self, prefix: str = schema.ROOT) -> tuple[int, dict[str, tuple[bytes, int]]]:
        """(revision, {key: (value, mod_revision)}) under a prefix, consistently."""
        out = self._post("/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        items = {}
        for kv in out.get("kvs", []):
            items[_unb64(kv["key"]).decode()] = (_unb64(kv.get("value", "")), int(kv["mod_revision"]))
        return int(out["header"]["revision"]), items

    def get(self, key: str) -> tuple[bytes, int] | None:
        out = self._post("/kv/range", {"key": _b64(key)})
        kvs = out.get("kvs", [])
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def lease_of(self, key: str) -> int | None:
        """The lease ``key`` is attached to (None: no such key, or none)."""
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return int(kvs[0].get("lease", 0)) or None if kvs else None

    def get_many(self, keys: list[str]) -> tuple[int, dict[str, tuple[bytes, int]]]:
        """(revision, {key: (value, mod_revision)}) of ``keys`` read at one revision (one transaction; at most
        etcd's --max-txn-ops keys, 128 by default); keys that do not exist are left out."""
        body = {"compare": [], "success": [{"request_range": {"key": _b64(k)}} for k in keys], "failure": []}
        out = self._post("/kv/txn", body, safe=True)   # reads only
        items = {}
        for resp in out.get("responses", []):
            for kv in resp.get("response_range", {}).get("kvs", []):
                items[_unb64(kv["key"]).decode()] = (_unb64(kv.get("value", "")), int(kv["mod_revision"]))
        return int(out["header"]["revision"]), items

    def put(self, key: str, value: str | bytes, lease: int | None = None, repeat: bool = False) -> int:
        """``repeat``: the key is this process's alone (a report, a record of its own), so a put whose answer
        was lost with a member is sent again to the next one rather than reported as maybe applied."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._post("/kv/put", body, safe=repeat or None)["header"]["revision"])

    def delete(self, key: str) -> int:
        return int(self._post("/kv/deleterange", {"key": _b64(key)})["header"]["revision"])

    def delete_prefix(self, prefix: str) -> int:
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        return int(self._post("/kv/deleterange", body)["header"]["revision"])

    def txn(self, compares: list[dict], puts: dict[str, str], deletes: list[str] = (),
            lease: int | None = None) -> tuple[bool, int]:
        """Puts (under ``lease`` if given) and deletes if every compare holds; (succeeded, revision)."""
        extra = {"lease": str(lease)} if lease else {}
        success = [{"request_put": {"key": _b64(k), "value": _b64(v), **extra}} for k, v in puts.items()]
        success += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        out = self._post("/kv/txn", {"compare": compares, "success": success, "failure": []})
        return bool(out.get("succeeded")), int(out["header"]["revision"])

    @staticmethod
    def cmp_mod(key: str, mod_revision: int) -> dict:
        """Compare: key's mod_revision equals (0 = key must not exist)."""
        if mod_revision == 0:
            return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}

    @staticmethod
    def cmp_created(key: str, create_revision: int) -> dict:
        """Compare: key exists and was created at ``create_revision`` (an election key's holder: a fence)."""
        return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(create_revision)}

    def watch_batches(self, prefix: str, start_revision: int,
                      idle: float | None = None) -> tuple[Iterator[list[Event]], Callable[[], None]]:
        """Events under prefix from start_revision on, one list per etcd watch response.

        Call the second item to stop (from the consuming thread: closing the stream while another
        thread reads it blocks both).  With ``idle`` the iterator simply ends after ``idle`` s without
        events, so a consumer can check its own stop flag or deadline and watch again from the next
        revision.

        etcd never splits the events of one revision across watch responses, so
        every revision in a list is complete once the list is taken; a consumer
        acting on single events could see half a transaction (e.g. the first
        hundreds of the keys one delete-range removed).
        """
        body = json.dumps({"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                              "start_revision": start_revision}})
        refused: dict[str, str] = {}
        while True:   # a connection of its own: the stream holds it until cancelled
            member = self.members.current()
            try:
                conn = self._gw.connect(member, self.timeout)
            except OSError as exc:
                refused[member] = exc.__class__.__name__
                self.members.failed(member, f"refuses connections ({refused[member]})")
                if len(refused) >= len(self.members.all):
                    raise self._unreachable(refused, ": cannot watch") from None
                continue
            try:
                conn.request("POST", "/v3/watch", body, _Gateway.HEADERS)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self.members.failed(member, f"dropped a new watch ({exc.__class__.__name__})")
                raise MemberDown(f"etcd member {member} dropped the watch on {prefix} as it began") from None
            if resp.status != 200:
                text = resp.read(200).decode(errors="replace")
                conn.close()
                if _no_leader(resp.status, text):
                    self.members.failed(member, "has no leader", election=True)
                    raise MemberDown(f"etcd member {member} has no leader to watch {prefix} with")
                raise RegistryError(f"etcd at {member} refused a watch: {resp.status} {text}")
            break
        conn.sock.settimeout(idle)   # None: wait for events as long as it takes
        stopped = threading.Event()
        cluster = self.members.cluster_id

        def broke(why: str) -> MemberDown:
            now = self.members.failed(member, f"broke the watch on {prefix} ({why})")
            return MemberDown(f"etcd member {member} broke the watch on {prefix} ({why}); now using {now}")

        def gen() -> Iterator[list[Event]]:
            try:
                while True:
                    line = resp.readline()
                    if not line:
                        if len(self.members.all) > 1 and not stopped.is_set():
                            raise broke("it ended the stream: it stopped or died")
                        return   # the member ended the stream: the consumer watches again
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    result = msg.get("result")
                    if result is None:
                        error = str(msg.get("error", msg))
                        if "no leader" in error:
                            raise broke("no leader")
                        raise RegistryError(f"etcd watch on {prefix} failed: {error[:200]}")
                    if result.get("created"):
                        head = result.get("header") or {}
                        self.members.answered(member, head)
                        if cluster and self.members.cluster_id != cluster:
                            raise RegistryError(f"etcd at {member} is a new cluster (re-created): {prefix} must be "
                                                "read again")
                        if int(head.get("revision", 0)) < start_revision - 1:
                            raise _Behind(f"etcd at {member} is at revision {head.get('revision')}, before "
                                          f"{start_revision - 1} already seen (a member catching up, or a store "
                                          f"created anew): {prefix} is read again")
                    if result.get("canceled"):
                        if int(result.get("compact_revision") or 0) > 0:
                            raise Compacted(f"etcd compacted {prefix} past revision {start_revision} (to "
                                            f"{result['compact_revision']}): read it again")
                        reason = result.get("cancel_reason") or "no reason given"
                        if "no leader" in reason:
                            raise broke("no leader")
                        raise RegistryError(f"etcd cancelled the watch on {prefix}: {reason}")
                    batch = []
                    for ev in result.get("events", []):
                        kv = ev["kv"]
                        value = None if ev.get("type") == "DELETE" else _unb64(kv.get("value", ""))
                        batch.append(Event(_unb64(kv["key"]).decode(), value, int(kv["mod_revision"])))
                    if batch:
                        yield batch
            except TimeoutError:
                if idle is not None:
                    return  # no event for `idle` s: the consumer watches again from its next revision
                raise RegistryError(f"etcd watch on {prefix} broke: TimeoutError") from None
            except (OSError, http.client.HTTPException, AttributeError, ValueError) as exc:
                if not stopped.is_set():  # not our own cancel(): the stream broke
                    raise broke(exc.__class__.__name__) from None

        def cancel() -> None:
            stopped.set()
            resp.close()
            conn.close()

        return gen(), cancel

    def follow(self, prefix: str, reset: Callable[[dict, int], None], apply: Callable[[list[Event]], None],
               stop: threading.Event, idle: float | None = None, retry: float = 1.0, resume: bool = True,
               errors: tuple = (RegistryError,), on_error: Callable[[Exception, bool], None] | None = None) -> None:
        """Keep a copy of the keys under ``prefix`` current until ``stop`` is set (the calling thread's loop).

        ``reset(items, revision)`` gets every key (``get_prefix``'s items) at the start and again after any
        failure (events may have been compacted away meanwhile), and at once, with no ``on_error``, when a
        watch resumed from a revision etcd has compacted away (a quiet prefix's last event can be older
        than the history etcd keeps: ``testbed/etcd.py``); ``apply(batch)`` gets each watch response
        whole (one or more complete etcd revisions, see :meth:`watch_batches`).  With ``idle`` the watch is
        renewed after ``idle`` s without events, so ``stop`` is looked at that often.  A watch that ends by
        itself is resumed from the next revision, or read again from scratch with ``resume=False``.  On one
        of ``errors`` (raised by etcd, or by ``reset``/``apply``): ``on_error(exc, first)`` (``first``:
        not right after another failure), then a retry after ``retry`` s.  When the member in use fails under
        the watch (``MemberDown``: it died or lost its leader), the watch resumes from the revision after the
        last one applied, on the member the client moved to: no event is missed or applied twice.
        """
        rev, failing, downs = 0, False, 0
        while not stop.is_set():
            try:
                if rev == 0:
                    got, items = self.get_prefix(prefix)
                    reset(items, got)
                    rev, failing = got, False
                batches, cancel = self.watch_batches(prefix, rev + 1, idle=idle)
                try:
                    for batch in batches:
                        apply(batch)
                        rev, downs = max(rev, max(ev.revision for ev in batch)), 0
                        if stop.is_set():
                            break
                finally:
                    cancel()
                if not resume:
                    rev = 0
                continue
            except MemberDown as exc:
                WATCH_BREAKS.labels("member_down").inc()
                downs += 1   # said once per failure, not once per try while an election lasts
                log.log(logging.WARNING if downs == 1 else logging.DEBUG, "%s: watching %s again from revision %d",
                        exc, prefix, rev + 1)
                if downs > 1:   # the members fail one after another (an election): not in a tight loop
                    stop.wait(BACKOFF if downs < 100 else 1.0)
                continue
            except Compacted as exc:
                WATCH_BREAKS.labels("compacted").inc()
                log.debug("%s; reading %s again", exc, prefix)
                rev = 0
                continue
            except errors as exc:
                WATCH_BREAKS.labels("error").inc()
                if on_error is not None and not stop.is_set():
                    on_error(exc, not failing)
                rev, failing = 0, True
            stop.wait(retry)

    def lease(self, ttl: int) -> int:
        out = self._post("/lease/grant", {"TTL": ttl})
        return int(out["ID"])

    def keepalive_once(self, lease_id: int) -> int:
        """Refresh a lease once; its remaining TTL in s, 0 when etcd no longer has it (expired: the gateway
        answers with no TTL)."""
        try:
            out = self._post("/lease/keepalive", {"ID": str(lease_id)})
        except RegistryError as exc:
            if "lease not found" in str(exc):
                return 0
            raise
        return int((out.get("result") or {}).get("TTL", 0) or 0)

    def keepalive(self, lease_id: int, ttl: int) -> threading.Event:
        """Refresh a lease every ttl/3 s in a thread until the returned event is set, or etcd says the lease
        is gone (it expired: its owner was stopped or starved past the TTL; to be registered again, an owner
        keeps its lease with ``vfab.vid.state.lease.EndpointLease``, as ``vfab.vid.api.announce`` does)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(until_beat(max(ttl / 3.0, 0.2))):
                try:
                    left = self.keepalive_once(lease_id)
                except RegistryError as exc:
                    log.warning("lease %x: keepalive failed: %s", lease_id, exc)
                    continue
                if left <= 0:   # etcd answers a lease it no longer has with no TTL (or "lease not found")
                    log.warning("lease %x: gone from etcd (expired); no longer kept alive", lease_id)
                    return

        threading.Thread(target=loop, name=f"lease-{lease_id:x}", daemon=True).start()
        self._keepalives.append(stop)
        return stop

    def revoke(self, lease_id: int) -> None:
        self._post("/lease/revoke", {"ID": str(lease_id)})

    def close(self) -> None:
        for stop in self._keepalives:
            stop.set()
        self._gw.close()

    # -- services ---------------------------------------------------------
    def services(self) -> list[schema.Service]:
        _, items = self.get_prefix(schema.folder("services"))
        return sorted((schema.Service.from_json(v, k) for k, (v, _) in items.items()), key=lambda s: s.id)

    def service(self, name: str) -> schema.Service:
        schema.check_name("service", name)
        got = self.get(schema.service_key(name))
        if got is None:
            known = ", ".join(s.name for s in self.services()) or "none yet"
            raise NotFound(f"service {name!r} does not exist (known: {known}); create it with 'vfab service add {name}'")
        return schema.Service.from_json(got[0], schema.service_key(name))

    def create_service(self, name: str, layout: str = "prefix", sid: int | None = None, kind: str = "",
                       frontdoors: list | None = None, opts: dict | None = None) -> schema.Service:
        """Register a service with a fresh id and one unassigned range over all keys; an existing service of
        that name is returned as it is (the caller compares, see 'vfab service add').

        ``kind`` names its plug-in (``vfab.vid.plugin``), ``frontdoors`` the table-0 classifiers it gets,
        ``opts`` the kind's options its endpoints read at start.
        """
        schema.check_name("service", name)
        Layout.parse(layout)
        for _ in range(20):
            got = self.get(schema.service_key(name))
            if got is not None:
                return schema.Service.from_json(got[0], schema.service_key(name))
            _, ids = self.get_prefix(schema.folder("service-ids"))
            used = {int(k.rsplit("/", 1)[1]) for k in ids}
            if sid is None:
                free = next((i for i in range(1, SERVICE_MAX + 1) if i not in used), None)
                if free is None:
                    raise RegistryError(f"no free service id: all {SERVICE_MAX} are in use")
            else:
                free = sid
            svc = schema.Service(name=name, id=free, layout=layout, kind=kind, frontdoors=list(frontdoors or []),
                                 opts=dict(opts or {}))
            full = schema.RangeRec(lo=0, hi=KEY_MAX, state="unassigned")
            ok, _ = self.txn(
                [self.cmp_mod(schema.service_key(name), 0), self.cmp_mod(schema.service_id_key(free), 0)],
                {schema.service_key(name): svc.to_json(), schema.service_id_key(free): name,
                 schema.range_key(name, 0): full.to_json()},
            )
            if ok:
                log.info("service %s: created with id %d (%s layout)", name, free, layout)
                return svc
            if sid is not None:
                raise Conflict(f"service id {sid} is taken: omit the id to get a free one")
        raise Conflict(f"could not create service {name!r}: too many concurrent creations, retry")

    def delete_service(self, name: str) -> None:
        svc = self.service(name)
        self.delete_prefix(schema.range_prefix(name))
        self.delete_prefix(schema.endpoint_prefix(name))
        self.delete(schema.holds_key(name))
        self.delete_prefix(schema.sdhcp_prefix(name))   # an sdhcp pool's block table and wants
        self.delete(schema.service_id_key(svc.id))
        self.delete(schema.service_key(name))

    # -- endpoints --------------------------------------------------------
    def announce(self, ep: schema.Endpoint, ttl: int = 3, allow_shared: bool = False, lease: int | None = None) -> int:
        """Register a live endpoint under a lease kept alive by a thread; returns the lease id.

        An ``rx=ovs`` endpoint receives every frame the switch rewrites to its
        interface's MAC, whatever service it was for; so an interface carrying
        one may carry no other endpoint (Conflict).  ``bpf``/``promisc``
        endpoints filter on the VID and can share an interface.  ``allow_shared``
        skips the check, for a process that itself answers for all the endpoints
        on its port (the benchmarks' raw echo threads).
        """
        self.service(ep.service)
        _, items = self.get_prefix(schema.folder("endpoints")) if not allow_shared else (0, {})
        for key, (raw, _) in items.items():
            other = schema.Endpoint.from_json(raw, key)
            if other.mac == ep.mac and (other.service, other.name) != (ep.service, ep.name) \
                    and "ovs" in (other.rx, ep.rx):
                raise Conflict(
                    f"interface {ep.mac} already carries endpoint {other.service}/{other.name} (rx={other.rx}): "
                    "an rx=ovs endpoint needs its interface to itself, because the switch rewrites its VIDs to "
                    "the interface MAC; use rx=bpf for both, or another interface")
        if lease is None:  # else the caller keeps its own lease alive
            lease = self.lease(ttl)
            self.keepalive(lease, ttl)
        self.put(schema.endpoint_key(ep.service, ep.name), ep.to_json(), lease=lease)
        log.info("endpoint %s/%s: announced at %s (rx=%s, lease %x)", ep.service, ep.name, ep.mac, ep.rx, lease)
        return lease

    def endpoints(self, service: str) -> list[schema.Endpoint]:
        _, items = self.get_prefix(schema.endpoint_prefix(service))
        return sorted((schema.Endpoint.from_json(v, k) for k, (v, _) in items.items()), key=lambda e: e.name)

    # -- ranges -----------------------------------------------------------
    def ranges(self, service: str) -> list[tuple[schema.RangeRec, int]]:
        """(record, mod_revision) for each range of a service, by lo."""
        _, items = self.get_prefix(schema.range_prefix(service))
        if not items:
            self.service(service)  # NotFound naming the known services; else the map is empty
        recs = [(schema.RangeRec.from_json(v, k), mod) for k, (v, mod) in items.items()]
        return sorted(recs, key=lambda rm: rm[0].lo)

    def owner_of(self, service: str, key: int) -> schema.RangeRec:
        for rec, _ in self.ranges(service):
            if rec.lo <= key <= rec.hi:
                return rec
        raise NotFound(f"key {key:#x} of service {service!r} is in no range: the range map has a gap")

    def assign(self, service: str, rng: Range, owner: str, *, expect_epoch: int | None = None,
               mirrors: list | None = None, helpers: list | None = None, state: str = "active",
               weights: dict | None = None, fence: Sequence[dict] = ()) -> int:
        """Give ``rng`` of ``service`` to ``owner`` in one transaction; returns the etcd revision.

        Ranges that overlap ``rng`` are cut; the parts outside keep their owner.
        ``expect_epoch`` (optimistic concurrency between operators): the highest epoch
        among the overlapped ranges must equal it, else Conflict.  ``fence``: more compares for the same
        transaction (an elected writer's ``cmp_created``): if one fails, Conflict and nothing is written.
        """
        if owner:
            schema.check_name("endpoint", owner)
        current = self.ranges(service)
        hit = [(r, m) for r, m in current if r.range.overlaps(rng)]
        if not hit:
            raise NotFound(f"range {rng} of service {service!r} overlaps no range: the range map is empty")
        top = max(r.epoch for r, _ in hit)
        if expect_epoch is not None and top != expect_epoch:
            raise Conflict(
                f"range {rng} of {service!r} is at epoch {top}, not {expect_epoch}: somebody changed it; "
                "re-read it with 'vfab ranges' and retry"
            )
        puts: dict[str, str] = {}
        deletes: list[str] = []
        for r, _ in hit:
            for piece in r.range.subtract(rng):
                rec = schema.RangeRec(lo=piece.lo, hi=piece.hi, owner=r.owner, mirrors=r.mirrors,
                                      helpers=r.helpers, epoch=top + 1, state=r.state, weights=r.weights)
                puts[schema.range_key(service, piece.lo)] = rec.to_json()
            deletes.append(schema.range_key(service, r.lo))
        new = schema.RangeRec(lo=rng.lo, hi=rng.hi, owner=owner, mirrors=list(mirrors or []),
                              helpers=list(helpers or []), epoch=top + 1,
                              state=state if owner else "unassigned", weights=dict(weights or {}))
        puts[schema.range_key(service, rng.lo)] = new.to_json()
        deletes = [k for k in deletes if k not in puts]
        ok, rev = self.txn([*(self.cmp_mod(schema.range_key(service, r.lo), m) for r, m in hit), *fence], puts,
                           deletes)
        if not ok:
            raise Conflict(
                f"range {rng} of {service!r} changed while this reassignment was prepared "
                "(another operator won" + (", or the writer's fence no longer holds" if fence else "") +
                "); re-read it with 'vfab ranges' and retry"
            )
        log.info("service %s: range %s -> %s (epoch %d, revision %d)", service, rng, owner or "-", top + 1, rev)
        return rev

    def fence(self, service: str, rng: Range, name: str, mode: str) -> schema.RangeRec | None:
        """A peer giving up its copy of ``rng`` (the source fell silent) makes sure the operation can no
        longer commit behind its back.

        If etcd already gives the range to ``name`` (its owner after a split or move, a mirror after a
        mirror: ``mode`` "split" or "mirror"), that record is returned: the operation committed, keep the
        copy.  Otherwise every range overlapping ``rng`` is written back unchanged but for its epoch + 1,
        in one transaction comparing their mod-revisions, and None is returned: the source's flip (which
        expects the epoch it read at its start) now loses.  Conflict if they changed meanwhile (ask again).
        """
        hit = [(r, m) for r, m in self.ranges(service) if r.range.overlaps(rng)]
        at = next((r for r, _ in hit if rng.lo in r.range), None)
        if at is not None and (at.owner == name if mode == "split" else name in at.mirrors):
            return at
        if not hit:
            return None
        puts = {schema.range_key(service, r.lo): replace(r, epoch=r.epoch + 1).to_json() for r, _ in hit}
        ok, rev = self.txn([self.cmp_mod(schema.range_key(service, r.lo), m) for r, m in hit], puts)
        if not ok:
            raise Conflict(f"range {rng} of {service!r} changed while {name} fenced it; asking again")
        log.info("service %s: %s gave up its copy of %s: epoch of %s raised (revision %d)", service, name, rng,
                 ", ".join(str(r.range) for r, _ in hit), rev)
        return None

    def coalesce(self, service: str) -> int | None:
        """Join neighbouring ranges with the same owner, mirrors, helpers and state; one txn.

        Returns the revision, or None when nothing was joined (or somebody raced us).
        """
        current = self.ranges(service)
        runs: list[list[tuple[schema.RangeRec, int]]] = []
        for rec, mod in current:
            last = runs[-1][-1][0] if runs else None
            if last is not None and last.hi + 1 == rec.lo and (last.owner, last.mirrors, last.helpers, last.state, last.weights) \
                    == (rec.owner, rec.mirrors, rec.helpers, rec.state, rec.weights):
                runs[-1].append((rec, mod))
            else:
                runs.append([(rec, mod)])
        joins = [run for run in runs if len(run) > 1]
        if not joins:
            return None
        compares, puts, deletes = [], {}, []
        for run in joins:
            first = run[0][0]
            new = schema.RangeRec(lo=first.lo, hi=run[-1][0].hi, owner=first.owner, mirrors=first.mirrors,
                                  helpers=first.helpers, epoch=max(r.epoch for r, _ in run) + 1, state=first.state,
                                  weights=first.weights)
            puts[schema.range_key(service, first.lo)] = new.to_json()
            for rec, mod in run:
                compares.append(self.cmp_mod(schema.range_key(service, rec.lo), mod))
                if rec.lo != first.lo:
                    deletes.append(schema.range_key(service, rec.lo))
        ok, rev = self.txn(compares, puts, deletes)
        if ok:
            log.info("service %s: joined %d runs of ranges", service, len(joins))
        return rev if ok else None

    def ops(self, service: str) -> list[schema.OpRec]:
        """Every operation record of a service (running and recently finished), oldest first."""
        _, items = self.get_prefix(schema.op_prefix(service))
        return sorted((schema.OpRec.from_json(v, k) for k, (v, _) in items.items()), key=lambda o: o.started)

    def op(self, service: str, op_id: str) -> tuple[schema.OpRec | None, int]:
        """(record or None, etcd revision of the read)."""
        out = self._post("/kv/range", {"key": _b64(schema.op_key(service, op_id))})
        kvs = out.get("kvs", [])
        rev = int(out["header"]["revision"])
        if not kvs:
            return None, rev
        return schema.OpRec.from_json(_unb64(kvs[0].get("value", "")), schema.op_key(service, op_id)), rev

    def holds(self, service: str) -> tuple[schema.Holds, int]:
        """(the service's helper holds, the record's mod revision: 0 when there is none)."""
        got = self.get(schema.holds_key(service))
        if got is None:
            return schema.Holds(), 0
        return schema.Holds.from_json(got[0], schema.holds_key(service)), got[1]

    def loads(self, service: str) -> dict[str, schema.Load]:
        _, items = self.get_prefix(schema.load_prefix(service))
        return {k.rsplit("/", 1)[1]: schema.Load.from_json(v, k) for k, (v, _) in items.items()}

    # -- topology ---------------------------------------------------------
    def put_switch(self, sw: schema.Switch) -> int:
        return self.put(schema.switch_key(sw.dpid), sw.to_json())

    def put_link(self, link: schema.Link) -> int:
        return self.put(schema.link_key(link.dpid, link.port), link.to_json())

    def put_host(self, host: schema.Host) -> int:
        return self.put(schema.host_key(host.mac), host.to_json())

    def set_miss_policy(self, policy: str) -> int:
        if policy not in schema.MISS_POLICIES:
            raise VidError(f"miss policy {policy!r} is unknown: use one of {', '.join(schema.MISS_POLICIES)}")
        return self.put(schema.MISS_KEY, policy)

    def applied(self) -> dict[int, schema.Applied]:
        _, items = self.get_prefix(schema.folder("applied"))
        recs = (schema.Applied.from_json(v, k) for k, (v, _) in items.items())
        return {a.dpid: a for a in recs}

    def switches(self) -> list[schema.Switch]:
        _, items = self.get_prefix(schema.folder("switches"))
        return sorted((schema.Switch.from_json(v, k) for k, (v, _) in items.items()), key=lambda s: s.dpid)

    def state_revision(self) -> int:
        """Newest mod-revision among the keys the controller compiles from (not its own reports)."""
        _, items = self.get_prefix(schema.ROOT)
        return max((mod for k, (_, mod) in items.items() if schema.parse_key(k)[0] not in schema.PASSIVE),
                   default=0)

    def wait_applied(self, revision: int, timeout: float = 10.0, dpids: list[int] | None = None) -> float:
        """Block until every switch's controller reports having applied ``revision``."""
        t0 = time.monotonic()
        want = set(dpids) if dpids is not None else {s.dpid for s in self.switches()}
        while True:
            applied = self.applied()
            behind = sorted(d for d in want if d not in applied or applied[d].revision < revision)
            if not behind:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise RegistryError(
                    f"switches {', '.join(f'{d:#x}' for d in behind)} have not applied revision {revision} "
                    f"after {timeout:.0f} s: is the controller running ('vfab status')?"
                )
            time.sleep(0.002)
