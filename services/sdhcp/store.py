"""Durable leases of one sdhcp shard: SQLite in WAL mode, one transaction per batch, fsync'd (``synchronous=FULL``)
unless the batch acknowledges nothing (``Store.begin``).

Two kinds of rows, each stored under the VID key that decides who owns it (the
state layer copies, replicates and drops records by that key):

``lease``  one per client MAC (``chaddr``), under the MAC's key (the front
           door's key function, ``vfab.vid.mackey``: the store records which, and
           ``rekey`` moves every row to another): the address the client holds or
           last held, state (offered, bound, released, none), expiry, client id.
``addr``   one per address ever handed out, under the address's **row key**
           (``blocks.py``: its home key, ``pool.py``, unless the service's block table
           anchors it elsewhere): the MAC holding it, state (held, declined, free)
           and, for a declined address, until when.

An address is handed out only by the shard owning its row key, and only with
its ``addr`` row written in the same transaction as the client's ``lease``
row; so ``lease(c).ip == a`` implies ``addr(a).holder == c`` and no two
clients ever hold one address (the backend keeps this, see ``backend.py``).

State record (what a split, mirror or replication ships; this module owns it)::

    common  length u16 (whole record) | kind u8 (1 lease, 2 addr) | format u8 (1)
            | pool fingerprint u32 (config.py) | version u64
    lease   chaddr u64 | ip u32 (0: none) | state u8 | expires ms u64 | client id length u8 | client id
    addr    ip u32 | holder chaddr u64 (0: none) | state u8 | until ms u64 [| row key u32]

An address record of kind 3 carries the row key it was written under (a mirror or a copy that has not seen
the newest block table yet still files it where its owner did); kind 2, without it, is read as before (the
row key the receiver's table gives).

Applying a record is version-gated per row (a newer version wins; with a copy's
generation it also wins over any row of an earlier generation), so snapshot
chunks and live replication may arrive in any order and any number of times.
A record of another pool (fingerprint) is refused: the shards were started
with different ``pool``/``mask``/``server`` options.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from dataclasses import dataclass
from typing import Iterator

from vfab.services.sdhcp.blocks import Blocks
from vfab.services.sdhcp.config import Config, parse_opts
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.pool import Pool
from vfab.vid import mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BackendError
from vfab.vid.state.sqlstore import SqliteStore


HEAD = struct.Struct("!HBBIQ")
LEASE = struct.Struct("!QIBQB")
ADDR = struct.Struct("!IQBQ")
ROWKEY = struct.Struct("!I")
KIND_LEASE, KIND_ADDR, KIND_ADDR_KEYED = 1, 2, 3
FORMAT = 1
MAX_CLIENT_ID = 255

# lease states
NONE, OFFERED, BOUND, RELEASED = 0, 1, 2, 3
LEASE_STATES = {NONE: "none", OFFERED: "offered", BOUND: "bound", RELEASED: "released"}
# addr states
FREE, HELD, DECLINED = 0, 1, 2
ADDR_STATES = {FREE: "free", HELD: "held", DECLINED: "declined"}

DROP_CHUNK = 2000
HINT_MS = 1000            # how long a first_free search hint is trusted (see Store.first_free)
HINTS_MAX = 4096          # hints kept (one per segment searched); all are forgotten past this

SCHEMA = """
CREATE TABLE IF NOT EXISTS lease (chaddr INTEGER PRIMARY KEY, vkey INTEGER NOT NULL, ip INTEGER NOT NULL,
                                  state INTEGER NOT NULL, expires INTEGER NOT NULL, client_id BLOB NOT NULL,
                                  version INTEGER NOT NULL, gen INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS lease_vkey_gen ON lease (vkey, gen);
CREATE TABLE IF NOT EXISTS addr (ip INTEGER PRIMARY KEY, vkey INTEGER NOT NULL, holder INTEGER NOT NULL,
                                 state INTEGER NOT NULL, until INTEGER NOT NULL, version INTEGER NOT NULL,
                                 gen INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS addr_vkey_gen ON addr (vkey, gen);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value);
"""


# Store._first_free: is address ? taken (held by another client than ?, or declined until after ?); the first
# address after a taken one in [?, ?) that is not taken itself.  Built once (not per DISCOVER).
_TAKEN = "(({t}.state=%d AND {t}.holder!=?) OR ({t}.state=%d AND {t}.until>?))" % (HELD, DECLINED)
_TAKEN_AT = f"SELECT 1 FROM addr a WHERE a.ip=? AND {_TAKEN.format(t='a')}"
_FIRST_GAP = (f"SELECT a.ip + 1 FROM addr a WHERE a.ip >= ? AND a.ip < ? AND {_TAKEN.format(t='a')} AND NOT EXISTS "
              f"(SELECT 1 FROM addr b WHERE b.ip = a.ip + 1 AND {_TAKEN.format(t='b')}) ORDER BY a.ip LIMIT 1")


# A row each (Store.lease, Store.addr) and the upserts (Store.put_lease, Store.put_addr): the native lane
# (lane.py) prepares these very statements, with the same parameters.
SQL_LEASE = "SELECT ip, state, expires, client_id, version FROM lease WHERE chaddr=?"
SQL_ADDR = "SELECT holder, state, until, version FROM addr WHERE ip=?"
SQL_PUT_LEASE = ("INSERT INTO lease (chaddr, vkey, ip, state, expires, client_id, version) VALUES (?,?,?,?,?,?,?) "
                 "ON CONFLICT(chaddr) DO UPDATE SET ip=excluded.ip, state=excluded.state, "
                 "expires=excluded.expires, client_id=excluded.client_id, version=excluded.version")
SQL_PUT_ADDR = ("INSERT INTO addr (ip, vkey, holder, state, until, version) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(ip) DO UPDATE SET holder=excluded.holder, state=excluded.state, "
                "until=excluded.until, version=excluded.version")
LANE_SQL = (SQL_LEASE, SQL_ADDR, _TAKEN_AT, _FIRST_GAP, SQL_PUT_LEASE, SQL_PUT_ADDR)


class StoreError(DhcpError, BackendError):
    """The lease store could not read or write, or refused records; the message names the cause and the fix."""


@dataclass(frozen=True)
class Lease:
    chaddr: int
    ip: int = 0
    state: int = NONE
    expires: int = 0          # ms since the epoch
    client_id: bytes = b""
    version: int = 0

    def active(self, now: int) -> bool:
        return self.ip != 0 and self.state in (OFFERED, BOUND) and self.expires > now


@dataclass(frozen=True)
class Addr:
    ip: int
    holder: int = 0
    state: int = FREE
    until: int = 0            # ms since the epoch (declined: until then)
    version: int = 0


def pack_lease(fp: int, row: Lease) -> bytes:
    body = LEASE.pack(row.chaddr, row.ip, row.state, row.expires, len(row.client_id)) + row.client_id
    return HEAD.pack(HEAD.size + len(body), KIND_LEASE, FORMAT, fp, row.version) + body


def pack_addr(fp: int, row: Addr, rowkey: int) -> bytes:
    body = ADDR.pack(row.ip, row.holder, row.state, row.until) + ROWKEY.pack(rowkey)
    return HEAD.pack(HEAD.size + len(body), KIND_ADDR_KEYED, FORMAT, fp, row.version) + body


def unpack(blob: bytes) -> Iterator[tuple[int, Lease | Addr, int | None]]:
    """(fingerprint, row, row key or None) of every record in a blob; StoreError on anything malformed."""
    off, end = 0, len(blob)
    while off < end:
        if off + HEAD.size > end:
            raise StoreError(f"truncated sdhcp state record at byte {off}")
        length, kind, fmt, fp, version = HEAD.unpack_from(blob, off)
        if fmt != FORMAT:
            raise StoreError(f"sdhcp state record of format {fmt} at byte {off}: this shard reads format {FORMAT}; "
                             "run the same vfab release on every shard")
        if length < HEAD.size or off + length > end:
            raise StoreError(f"truncated sdhcp state record at byte {off}: it claims {length} B, {end - off} B are left")
        body = blob[off + HEAD.size:off + length]
        if kind == KIND_LEASE and len(body) >= LEASE.size:
            chaddr, ip, state, expires, clen = LEASE.unpack_from(body)
            if len(body) != LEASE.size + clen or state not in LEASE_STATES or chaddr >> 48:
                raise StoreError(f"malformed lease record at byte {off}")
            row: Lease | Addr = Lease(chaddr, ip, state, expires, bytes(body[LEASE.size:]), version)
            rowkey = None
        elif (kind == KIND_ADDR and len(body) == ADDR.size) or \
                (kind == KIND_ADDR_KEYED and len(body) == ADDR.size + ROWKEY.size):
            ip, holder, state, until = ADDR.unpack_from(body)
            rowkey = ROWKEY.unpack_from(body, ADDR.size)[0] if kind == KIND_ADDR_KEYED else None
            if state not in ADDR_STATES or holder >> 48 or (rowkey is not None and rowkey > KEY_MAX):
                raise StoreError(f"malformed address record at byte {off}")
            row = Addr(ip, holder, state, until, version)
        else:
            raise StoreError(f"unknown or malformed sdhcp state record (kind {kind}, {len(body)} B) at byte {off}")
        yield fp, row, rowkey
        off += length


class Store(SqliteStore):
    """One SQLite database per shard; each thread gets its own connection (``SqliteStore``).

    ``config`` None: use the configuration this store was created with (a restarted shard).
    A store refuses a configuration of another pool (``Config.fingerprint``): its rows were placed by the
    old pool's home keys.

    ``key_fn`` (``vfab.vid.mackey``): the key function of the service's front door, under which lease rows are
    keyed.  None: the one the store was written with (``mackey.LEGACY`` for a store older than the choice).
    A store written under another one keeps its rows' keys (``key_fn`` then says the service's, ``stored_key_fn``
    the rows') until :meth:`rekey` moves them: the shard does that at start when it may (``server.open_server``).
    """

    Error = StoreError
    WHAT = "lease store"

    def __init__(self, path: str, config: Config | None = None, key_fn: str | None = None):
        super().__init__(path)
        self._exec_script(SCHEMA)
        row = self._exec("SELECT value FROM meta WHERE name='config'").fetchone()
        stored = parse_opts(json.loads(row[0])) if row else None
        if config is None and stored is None:
            raise StoreError(f"{path} holds no pool configuration and none was given: start the shard with "
                             "--opt pool=FIRST-LAST --opt mask=N --opt server=ADDR")
        if config is not None and stored is not None and config.fingerprint != stored.fingerprint:
            raise StoreError(f"{path} holds the leases of {stored.describe()}, not {config.describe()}: "
                             "start this shard with the pool, mask and server it was created with, or "
                             "give it another --data directory")
        self.config = config or stored
        if row is None or json.loads(row[0]) != self.config.to_opts():
            self._exec("INSERT INTO meta (name, value) VALUES ('config', ?) ON CONFLICT(name) DO UPDATE "
                       "SET value=excluded.value", (json.dumps(self.config.to_opts(), sort_keys=True),))
        self.pool = Pool(int(self.config.first), self.config.size)
        # The service's block table (blocks.py), set by the shard's block agent; empty: every address at its home key
        self.blocks = Blocks(self.pool)
        row = self._exec("SELECT value FROM meta WHERE name='key_fn'").fetchone()
        if row is None:
            empty = self._exec("SELECT 1 FROM lease LIMIT 1").fetchone() is None
            row = (key_fn or mackey.LEGACY,) if empty else (mackey.LEGACY,)
            self._set_key_fn(row[0])
        self.stored_key_fn: str = mackey.check(row[0])
        self.key_fn: str = mackey.check(key_fn or self.stored_key_fn)
        self.key = mackey.keyer(self.stored_key_fn)   # chaddr -> the key its lease row is stored under
        self.grow_wal()
        self.fp = self.config.fingerprint
        # (lo, hi) of a first_free search -> (ip, ms): at ms every address in [lo, ip) was taken
        self._hints: dict[tuple[int, int], tuple[int, int]] = {}
        # Counts the writes after which an address may have become free (or reclaimable): whatever a caller
        # concluded from "everything is taken" holds only while this has not moved (the backend's full-pool mark).
        self.freed = 0
        # The shard's native lane (lane.py), once it has one: it writes this store too, under ``writer_lock``.
        self.lane = None

    def _set_key_fn(self, fn: str) -> None:
        self._exec("INSERT INTO meta (name, value) VALUES ('key_fn', ?) ON CONFLICT(name) DO UPDATE "
                   "SET value=excluded.value", (fn,))

    def rekey(self) -> int:
        """Store every lease row under its key by ``key_fn`` (from ``stored_key_fn``), in one fsync'd
        transaction with the recorded key function; how many rows.  Only for a shard that holds every key (or
        none): rows whose new key another shard owns would be dropped as not held (``keep_only``)."""
        if self.key_fn == self.stored_key_fn:
            return 0
        new = mackey.keyer(self.key_fn)

        def run(db: sqlite3.Connection) -> int:
            db.create_function("vfab_mac_key", 1, new, deterministic=True)
            n = db.execute("UPDATE lease SET vkey = vfab_mac_key(chaddr)").rowcount
            db.execute("UPDATE meta SET value=? WHERE name='key_fn'", (self.key_fn,))
            return n

        n = self._txn(run, durable=True)
        self.stored_key_fn, self.key = self.key_fn, new
        return n

    def _may_free(self) -> None:
        """An address may have become free: forget the search hints (the native lane's too), move ``freed``."""
        self._hints.clear()
        self.freed += 1
        if self.lane is not None:
            self.lane.forget()

    # -- the data path: one transaction per batch (SqliteStore.begin/commit) -------------------
    def rollback(self) -> None:
        self._may_free()  # the batch's grants are undone: addresses below a hint may be free again
        super().rollback()

    def lease(self, chaddr: int) -> Lease | None:
        row = self._exec(SQL_LEASE, (chaddr,)).fetchone()
        return Lease(chaddr, row[0], row[1], row[2], bytes(row[3]), row[4]) if row else None

    def addr(self, ip: int) -> Addr | None:
        row = self._exec(SQL_ADDR, (ip,)).fetchone()
        return Addr(ip, *row) if row else None

    def reclaimable(self, lo: int, hi: int, now: int) -> Iterator[tuple[Addr, Lease | None]]:
        """Held addresses in [lo, hi] whose holder's lease no longer holds them (no lease, another address,
        ended or expired at ``now``), lowest first, each with that lease when it still names the address.

        One query, the lease found by its key: reading every row of the segment into Python to test it cost
        ~20 ms per DISCOVER on a full pool of 4,000 addresses."""
        rows = self._exec(
            "SELECT a.ip, a.holder, a.state, a.until, a.version, l.chaddr, l.ip, l.state, l.expires, l.client_id, "
            "l.version FROM addr a LEFT JOIN lease l ON l.chaddr = a.holder WHERE a.ip BETWEEN ? AND ? AND a.state = ? "
            "AND (l.chaddr IS NULL OR l.ip != a.ip OR l.state NOT IN (?, ?) OR l.expires <= ?) ORDER BY a.ip",
            (lo, hi, HELD, OFFERED, BOUND, now))
        for r in rows:
            lease = Lease(r[5], r[6], r[7], r[8], bytes(r[9]), r[10]) if r[5] is not None and r[6] == r[0] else None
            yield Addr(*r[:5]), lease

    def first_free(self, lo: int, hi: int, chaddr: int, now: int) -> int | None:
        """The lowest address in [lo, hi] that ``chaddr`` may take as free (no row, free, declined long
        enough ago, or held by ``chaddr`` itself); None if every one is taken.

        One query walking the taken rows upward in SQLite until the first gap: clients whose keys are close
        share their first slot (perfdhcp's consecutive MACs all do), and the n-th of them passes n taken
        addresses; reading those as Python rows made a DISCOVER cost ~1.2 ms at n ~ 500.  Even in SQLite that
        walk made a burst of n such DISCOVERs O(n²) (~20% of a shard's time under 1,000 perfdhcp clients,
        py-spy), so the search remembers where it ended (a **hint**: every address of [lo, ip) was taken)
        and the next search of the same segment starts there.  A hint is forgotten whenever an address may
        have become free (an address row written free or declined, records applied or dropped, a rolled back
        batch) and trusted for ``HINT_MS`` only (a declined address whose hold ran out meanwhile, or one
        below the hint held by ``chaddr`` itself, is found again after that); a search from a hint that
        finds nothing searches the whole segment.  A hint only decides where to look: the address returned
        is always checked free by the query itself."""
        hint = self._hints.get((lo, hi))
        since = now
        if hint is not None and lo < hint[0] <= hi and 0 <= now - hint[1] < HINT_MS:
            ip = self._first_free(hint[0], hi, chaddr, now)
            since = hint[1]
            if ip is None:
                ip, since = self._first_free(lo, hi, chaddr, now), now
        else:
            ip = self._first_free(lo, hi, chaddr, now)
        if ip is not None:
            if len(self._hints) >= HINTS_MAX:
                self._hints.clear()
            self._hints[(lo, hi)] = (ip, since)
        return ip

    def _first_free(self, lo: int, hi: int, chaddr: int, now: int) -> int | None:
        if self._exec(_TAKEN_AT, (lo, chaddr, now)).fetchone() is None:
            return lo
        row = self._exec(_FIRST_GAP, (lo, hi, chaddr, now, chaddr, now)).fetchone()
        return row[0] if row else None

    def put_lease(self, row: Lease) -> tuple[Lease, bytes]:
        """Write ``row`` (inside the open transaction) as the next version of its client's lease."""
        new = Lease(row.chaddr, row.ip, row.state, row.expires, row.client_id[:MAX_CLIENT_ID], row.version + 1)
        if new.state not in (OFFERED, BOUND):
            self._may_free()  # a lease ended: its address may be reclaimed
        self._exec(SQL_PUT_LEASE, (new.chaddr, self.key(new.chaddr), new.ip, new.state, new.expires, new.client_id, new.version))
        return new, pack_lease(self.fp, new)

    def put_addr(self, row: Addr) -> tuple[Addr, bytes]:
        """Write ``row`` (inside the open transaction) as the next version of its address."""
        new = Addr(row.ip, row.holder, row.state, row.until, row.version + 1)
        if new.state != HELD:
            self._may_free()  # an address may have become free below a hint
        k = self.blocks.rowkey(new.ip)
        self._exec(SQL_PUT_ADDR, (new.ip, k, new.holder, new.state, new.until, new.version))
        return new, pack_addr(self.fp, new, k)

    # -- blocks (blocks.py, agent.py) ----------------------------------------------------------
    def rowless(self, lo: int, hi: int, limit: int) -> list[int]:
        """Up to ``limit`` addresses of [lo, hi] with no row here (never handed out by this shard), highest
        first: the ones a shard may lend (no copy of a row of them exists anywhere)."""
        out: list[int] = []
        nxt = hi
        for (ip,) in self._exec("SELECT ip FROM addr WHERE ip BETWEEN ? AND ? ORDER BY ip DESC", (lo, hi)):
            while nxt > ip and len(out) < limit:
                out.append(nxt)
                nxt -= 1
            nxt = ip - 1
            if len(out) >= limit:
                return out
        while nxt >= lo and len(out) < limit:
            out.append(nxt)
            nxt -= 1
        return out

    def taken(self, lo: int, hi: int, now: int) -> int:
        """Addresses of [lo, hi] not free at ``now``: held (offered, bound, or kept for a client whose lease
        ended: reclaimable only by this shard) or declined until after ``now``."""
        return self._exec("SELECT count(*) FROM addr WHERE ip BETWEEN ? AND ? AND (state=? OR (state=? AND until>?))",
                          (lo, hi, HELD, DECLINED, now)).fetchone()[0]

    # -- what the shard holds (status) -----------------------------------------------------
    def usage(self, ranges: list[Range], now: int) -> dict[str, int]:
        """Leases and addresses in ``ranges``: bound (unexpired), offered, known clients, held/declined addresses."""
        out = {"bound": 0, "offered": 0, "clients": 0, "held": 0, "declined": 0}
        for r in ranges:
            for state, n in self._exec("SELECT state, count(*) FROM lease WHERE vkey BETWEEN ? AND ? AND ip != 0 "
                                       "AND expires > ? GROUP BY state", (r.lo, r.hi, now)):
                if state == BOUND:
                    out["bound"] += n
                elif state == OFFERED:
                    out["offered"] += n
            out["clients"] += self.count(r)
            for state, n in self._exec("SELECT state, count(*) FROM addr WHERE vkey BETWEEN ? AND ? GROUP BY state",
                                       (r.lo, r.hi)):
                if state == HELD:
                    out["held"] += n
                elif state == DECLINED:
                    out["declined"] += n
        return out

    def bound(self, ranges: list[Range], now: int) -> list[tuple[int, int, int]]:
        """(chaddr, address, lease end ms) of every bound lease in ``ranges`` that has not ended by ``now``."""
        out = []
        for r in ranges:
            out += self._exec("SELECT chaddr, ip, expires FROM lease WHERE vkey BETWEEN ? AND ? AND state = ? "
                              "AND ip != 0 AND expires > ?", (r.lo, r.hi, BOUND, now)).fetchall()
        return out

    # -- state transfer ---------------------------------------------------------------------
    def count(self, rng: Range) -> int:
        """Clients known in ``rng`` (lease rows): the unit of progress and of load reports."""
        return self._exec("SELECT count(*) FROM lease WHERE vkey BETWEEN ? AND ?", (rng.lo, rng.hi)).fetchone()[0]

    def median_key(self, rng: Range, n: int) -> int:
        """The key of the middle one of ``n`` (its ``count``) lease rows in ``rng``: half of the range's clients
        have a key below it (the balancer's split point by records, ``split_median``)."""
        row = self._exec("SELECT vkey FROM lease WHERE vkey BETWEEN ? AND ? ORDER BY vkey LIMIT 1 OFFSET ?",
                         (rng.lo, rng.hi, n // 2)).fetchone()
        return row[0] if row else rng.lo + (rng.hi - rng.lo + 1) // 2

    def snapshot(self, rng: Range, chunk_bytes: int = 256 * 1024) -> Iterator[tuple[bytes, int]]:
        """(blob, lease records in it) chunks of every lease and address row in ``rng``, from one read."""
        db = self.db
        db.execute("BEGIN")
        try:
            blob: list[bytes] = []
            size = n = 0
            queries = (
                ("SELECT chaddr, ip, state, expires, client_id, version FROM lease WHERE vkey BETWEEN ? AND ?",
                 lambda r: pack_lease(self.fp, Lease(r[0], r[1], r[2], r[3], bytes(r[4]), r[5])), 1),
                ("SELECT ip, holder, state, until, version, vkey FROM addr WHERE vkey BETWEEN ? AND ?",
                 lambda r: pack_addr(self.fp, Addr(*r[:5]), r[5]), 0),
            )
            for sql, pack, weight in queries:
                for r in db.execute(sql, (rng.lo, rng.hi)):
                    rec = pack(r)
                    blob.append(rec)
                    size += len(rec)
                    n += weight
                    if size >= chunk_bytes:
                        yield b"".join(blob), n
                        blob, size, n = [], 0, 0
            if blob:
                yield b"".join(blob), n
        finally:
            db.execute("COMMIT")

    def apply(self, blobs: list[bytes], durable: bool = True, gen: int | None = None) -> int:
        """Apply record blobs in one transaction (fsync'd unless ``durable=False``); how many rows won."""
        leases, addrs = [], []
        for blob in blobs:
            for fp, row, rowkey in unpack(blob):
                if fp != self.fp:
                    raise StoreError(f"records of another pool (fingerprint {fp:08x}) reached a shard of "
                                     f"{self.config.describe()} (fingerprint {self.fp:08x}): start every shard of "
                                     "the service with the same --opt pool, mask and server")
                if isinstance(row, Lease):
                    leases.append(row)
                else:
                    if row.ip not in self.pool:
                        raise StoreError(f"address record for {row.ip:#x} outside the pool of "
                                         f"{self.config.describe()}")
                    addrs.append((row, self.blocks.rowkey(row.ip) if rowkey is None else rowkey))
        g = gen or 0
        self._may_free()  # rows arrive from another shard: any address may have changed
        newer = "excluded.version > {t}.version" + (" OR {t}.gen < excluded.gen" if gen else "")

        def run(db: sqlite3.Connection) -> int:
            before = db.total_changes
            db.executemany(
                "INSERT INTO lease (chaddr, vkey, ip, state, expires, client_id, version, gen) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(chaddr) DO UPDATE SET ip=excluded.ip, state=excluded.state, "
                "expires=excluded.expires, client_id=excluded.client_id, version=excluded.version, gen=excluded.gen "
                "WHERE " + newer.format(t="lease"),
                [(r.chaddr, self.key(r.chaddr), r.ip, r.state, r.expires, r.client_id, r.version, g) for r in leases])
            db.executemany(
                "INSERT INTO addr (ip, vkey, holder, state, until, version, gen) VALUES (?,?,?,?,?,?,?) "
                "ON CONFLICT(ip) DO UPDATE SET vkey=excluded.vkey, holder=excluded.holder, state=excluded.state, "
                "until=excluded.until, version=excluded.version, gen=excluded.gen WHERE " + newer.format(t="addr"),
                [(r.ip, k, r.holder, r.state, r.until, r.version, g) for r, k in addrs])
            return db.total_changes - before

        return self._txn(run, durable)

    def drop(self, rng: Range, limit: int | None = None, below_gen: int | None = None) -> int:
        """Forget the rows of ``rng`` (about ``limit`` of them: fewer means none are left); with ``below_gen``
        only rows of earlier copy generations.  Unsynced: a drop lost to a crash is redone by ``keep_only``."""
        extra, args = ("", ()) if below_gen is None else (" AND gen < ?", (below_gen,))
        self._may_free()  # dropped rows free their addresses
        total = 0
        for table, key in (("lease", "chaddr"), ("addr", "ip")):
            while limit is None or total < limit:
                step = DROP_CHUNK if limit is None else min(DROP_CHUNK, limit - total)
                n = self._txn(lambda db, table=table, key=key, step=step: db.execute(
                    f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} WHERE vkey BETWEEN ? AND ?"
                    f"{extra} LIMIT ?)", (rng.lo, rng.hi, *args, step)).rowcount, durable=False)
                total += n
                if n < step:
                    break
        return total
