"""The native lane of an sdhcp shard (``native/sdhcp_lane.c``, loaded with ctypes): a thread that owns the data
socket and serves the common requests itself, handing the rest to the shard's loop in order.

Why: a request through the Python loop costs a shard ~0.4 ms of CPU on this kind of machine (every wake-up
finds the interpreter's working set cold), against ~0.06 ms for Kea; the lane serves a DISCOVER (a new
client's, or one of a client that still holds its address here), a REQUEST for the address a client holds (selecting, init-reboot, renewing, rebinding) and a
client's ARP request for the server address (before each unicast renewal) in C, on
the same SQLite store, with the same SQL (``store.LANE_SQL``), reply options (the backend's, encoded once)
and option rules (``wire.length_rule``).  What it serves and when:

* only keys of the ranges the loop grants it (:meth:`NativeLane.grant`): ranges this shard owns and is
  authoritative for, with no mirror, no copy running to a peer and no pause (their writes must reach
  peers, which is the loop's work), and only until the endpoint lease's deadline (kept moving by the
  keepalive, :meth:`extend`);
* never while a frame it handed to the loop is unfinished (:meth:`LanePort.recv_raw` counts them out and
  ``finish`` back in), so a client's requests are answered in order;
* its store writes and the Python store's write transactions take one mutex (``Store.writer_lock``);
  before any state operation pauses or copies a range, the loop revokes the grant, which waits for a pass
  under way to end.

Replies that acknowledge a lease leave after an fdatasync of the WAL (the lane's own, once per pass);
OFFERs leave at once, as the loop sends them.  ACKs to clients on fabric ports become binding events for
the shard's Binder (only the MACs it watches).  Counters: ``native`` in the shard's STATS; its requests
count in the shard's load reports (``take_rates``).

``VFAB_SDHCP_NATIVE=0`` (or ``--no-native``) serves everything in Python; a lane that cannot start says
why once and the shard serves in Python.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from ipaddress import IPv4Address

from vfab.services.sdhcp import wire
from vfab.services.sdhcp.backend import OFFER_HOLD
from vfab.services.sdhcp.blocks import HOME
from vfab.services.sdhcp.store import LANE_SQL
from vfab.vid import codec, mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import TransportError
from vfab.vid.ranges import Range

log = logging.getLogger("vfab.sdhcp.lane")

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
NATIVE_PATH = os.path.join(NATIVE_DIR, "build", "libvfab_sdhcp.so")
COUNTERS = ("rx", "offers", "acks", "selecting", "init_reboot", "renewing", "rebinding", "to_loop",
            "to_loop_dropped", "tx", "tx_dropped", "syncs", "sync_failed", "store_failed", "events_dropped", "passes",
            "arp_replies")
# the backend's counters the lane also counts (summed in STATS, so `vfab sdhcp status` shows every request)
SHARED = ("offers", "acks", "selecting", "init_reboot", "renewing", "rebinding", "arp_replies")
MAX_RANGES = 64
MAX_SEGS = 16384          # address intervals of one grant (sdhcp_lane.c)
ANCHOR_HOME = 0xFFFFFFFF  # an interval at its home keys, in C
FRAME_MAX = 2048

_libs: dict[str, ctypes.CDLL] = {}
_lib_lock = threading.Lock()


class LaneError(RuntimeError):
    """The lane cannot run here; the message says why (the shard then serves in Python)."""


def enabled() -> bool:
    return os.environ.get("VFAB_SDHCP_NATIVE", "1") != "0"


def load(path: str = NATIVE_PATH) -> ctypes.CDLL:
    """The lane's library (``make -C services/sdhcp/native``; bootstrap builds it); LaneError if missing."""
    with _lib_lock:
        lib = _libs.get(path)
        if lib is None:
            if not os.path.exists(path):
                raise LaneError(f"{path} is not built: run 'make -C {NATIVE_DIR}' (make bootstrap does)")
            try:
                lib = _declare(ctypes.CDLL(path))
            except (OSError, AttributeError) as exc:
                raise LaneError(f"{path} cannot be loaded: {exc}; rebuild it with 'make -C {NATIVE_DIR}'") from None
            _libs[path] = lib
        return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    p, u32p, u64p, i32p = c.c_void_p, c.POINTER(c.c_uint32), c.POINTER(c.c_uint64), c.POINTER(c.c_int)
    lib.lane_open.restype = p
    lib.lane_open.argtypes = [c.c_char_p, c.c_char_p, u32p, c.c_uint64, c.c_int, c.c_char_p, c.c_int, u32p, c.c_int,
                              c.POINTER(c.c_int16), c.c_char_p, c.c_int]
    for name in ("lane_close", "lane_stop", "lane_lock", "lane_unlock", "lane_forget"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [p]
    lib.lane_run.restype = c.c_int
    lib.lane_run.argtypes = [p]
    lib.lane_set.restype = c.c_int
    lib.lane_set.argtypes = [p, u32p, u32p, c.c_int, u32p, c.c_int, c.c_double, c.c_int64]
    lib.lane_extend.restype = None
    lib.lane_extend.argtypes = [p, c.c_double, c.c_int64]
    lib.lane_pop.restype = c.c_int
    lib.lane_pop.argtypes = [p, c.c_char_p, c.c_int, i32p]
    lib.lane_finish.restype = None
    lib.lane_finish.argtypes = [p, c.c_int]
    for name in ("lane_slow_fd", "lane_event_fd"):
        getattr(lib, name).restype = c.c_int
        getattr(lib, name).argtypes = [p]
    lib.lane_watch.restype = c.c_int
    lib.lane_watch.argtypes = [p, u64p, c.c_int, c.c_int]
    lib.lane_take_events.restype = c.c_int
    lib.lane_take_events.argtypes = [p, u64p, c.c_int]
    lib.lane_take_rates.restype = c.c_int
    lib.lane_take_rates.argtypes = [p, u32p, u64p, c.c_int]
    lib.lane_counters.restype = c.c_int
    lib.lane_counters.argtypes = [p, u64p, c.c_int]
    lib.lane_error.restype = None
    lib.lane_error.argtypes = [p, c.c_char_p, c.c_int]
    for name in ("lane_serve", "lane_serve_forwarded"):
        getattr(lib, name).restype = c.c_int
        getattr(lib, name).argtypes = [p, c.c_char_p, u32p, c.c_int, c.c_uint64, c.c_char_p, u32p, i32p]
    lib.lane_reply_max.restype = c.c_int
    lib.lane_burst.restype = c.c_int
    return lib


def _rules() -> ctypes.Array:
    """wire.py's option length rules, 256 x (exact or -1, step, least); step 0: a code it does not know."""
    out = (ctypes.c_int16 * (256 * 3))()
    for code in range(256):
        rule = wire.length_rule(code)
        if rule is not None:
            exact, step, least = rule
            out[3 * code:3 * code + 3] = [-1 if exact is None else exact, step, least]
    return out


def vid_base(service_id: int, layout) -> int:
    """The VID of key 0 of the service, if every key's VID is it OR the key (the lane builds reply sources so)."""
    base = int.from_bytes(codec.packed(service_id, 0, layout), "big")
    for key in (1, 0x5A5A5A, KEY_MAX):
        if int.from_bytes(codec.packed(service_id, key, layout), "big") != base | key:
            raise LaneError(f"the {layout} VID layout does not put the key in the low 24 bits")
    return base


def _live(default=None, always: bool = False):
    """A method that calls into the lane.  Other threads (the lease's keepalive moving the deadline, the
    Binder, the loop) may still call while the shard closes; ``close`` frees the lane only once no call is
    in one, and from then on a call does nothing and gives ``default`` (a keepalive that came back during
    a close once crashed the process).  The gate is not held during the call: a call may wait for the
    store's mutex, which a write transaction holds until its ``release`` (``always``: the writers'
    ``acquire`` and ``release`` are let in while the lane is being freed, so that a transaction ends and
    a call waiting for the mutex with it)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            with self._gate:
                if self.h is None or (self._freeing and not always):
                    return default() if callable(default) else default
                self._calls += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                with self._gate:
                    self._calls -= 1
                    if not self._calls:
                        self._gate.notify_all()
        return call
    return wrap


class NativeLane:
    """One shard's lane over its store and data socket (``sock_fd``), with the backend's replies' options."""

    def __init__(self, backend, sock_fd: int, vid: int, lib_path: str = NATIVE_PATH):
        self.lib = load(lib_path)
        self.backend = backend
        store, config = backend.store, backend.config
        net = config.network
        cfg = (ctypes.c_uint32 * 8)(int(config.first), config.size, int(config.server), int(net.network_address),
                                    int(net.netmask), config.lease, OFFER_HOLD, store.stored_key_fn == mackey.HASH)
        opts = wire.encode_options(backend._options.encoded)
        relays = list(config.relays)
        rel = (ctypes.c_uint32 * max(1, len(relays)))(*[int(IPv4Address(r)) for r in relays])
        err = ctypes.create_string_buffer(8192)
        self.rules = _rules()
        self._gate = threading.Condition()   # counts the calls into the lane (_live); close waits them out
        self._calls = 0
        self._freeing = False
        self.h = self.lib.lane_open(store.path.encode(), b"\0".join(s.encode() for s in LANE_SQL) + b"\0", cfg, vid,
                                    sock_fd, opts, len(opts), rel, len(relays), self.rules, err, len(err))
        if not self.h:
            raise LaneError(err.value.decode(errors="replace"))
        self._closed = False
        self._thread: threading.Thread | None = None
        self._events_thread: threading.Thread | None = None
        self.on_events = None          # called with [(chaddr, ip, until ms)] from the events thread
        self.failed = ""               # why the lane's thread stopped, if it did by itself
        self.granted: tuple = ()
        self._pop_buf = ctypes.create_string_buffer(FRAME_MAX)
        self._pkttype = ctypes.c_int()

    # -- the store's writers ------------------------------------------------------------------------------
    @_live(always=True)
    def acquire(self) -> None:
        self.lib.lane_lock(self.h)

    @_live(always=True)
    def release(self) -> None:
        self.lib.lane_unlock(self.h)

    @_live()
    def forget(self) -> None:
        self.lib.lane_forget(self.h)

    # -- what it serves ------------------------------------------------------------------------------------
    @_live()
    def grant(self, ranges: list[tuple[int, int]], valid_until: float, generation: int) -> None:
        """Serve keys of ``ranges`` until ``valid_until`` (time.monotonic) of lease ``generation``; [] revokes.
        The addresses it may hand out are those the store's block table gives the ranges (``Blocks.owned``, read
        now: grant again whenever the table changes).  Returns once no pass under the old grant is still running."""
        ranges = sorted(ranges) if len(ranges) <= MAX_RANGES else []   # more than the lane holds: none
        segs = self.backend.store.blocks.owned([Range(lo, hi) for lo, hi in ranges]) if ranges else ()
        los = (ctypes.c_uint32 * max(1, len(ranges)))(*[lo for lo, _ in ranges])
        his = (ctypes.c_uint32 * max(1, len(ranges)))(*[hi for _, hi in ranges])
        flat = (ctypes.c_uint32 * max(1, 3 * len(segs)))(*[ANCHOR_HOME if v == HOME else v for g in segs for v in g])
        if self.lib.lane_set(self.h, los, his, len(ranges), flat, len(segs), valid_until, generation) != 0:
            log.warning("native lane: %d ranges and %d address intervals are beyond its limits (%d, %d): the loop "
                        "serves every request", len(ranges), len(segs), MAX_RANGES, MAX_SEGS)
        self.granted = tuple(ranges)

    @_live()
    def extend(self, valid_until: float, generation: int) -> None:
        self.lib.lane_extend(self.h, valid_until, generation)

    # -- the loop's frames -------------------------------------------------------------------------------
    @_live(-1)
    def slow_fd(self) -> int:
        return self.lib.lane_slow_fd(self.h)

    @_live()
    def pop(self) -> tuple[bytes, int] | None:
        n = self.lib.lane_pop(self.h, self._pop_buf, FRAME_MAX, ctypes.byref(self._pkttype))
        return (self._pop_buf.raw[:n], self._pkttype.value) if n else None

    @_live()
    def finish(self, n: int) -> None:
        if n:
            self.lib.lane_finish(self.h, n)

    # -- counters, rates, events ----------------------------------------------------------------------------
    @_live(dict)
    def counters(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(COUNTERS))()
        n = self.lib.lane_counters(self.h, out, len(COUNTERS))
        return {COUNTERS[i]: out[i] for i in range(n)}

    @_live(dict)
    def take_rates(self) -> dict[int, int]:
        los, counts = (ctypes.c_uint32 * 128)(), (ctypes.c_uint64 * 128)()
        n = self.lib.lane_take_rates(self.h, los, counts, 128)
        return {los[i]: counts[i] for i in range(n)}

    @_live()
    def watch(self, macs: set[int] | None) -> None:
        """Binding events for these MACs only; None: for every MAC."""
        got = sorted(macs or ())
        arr = (ctypes.c_uint64 * max(1, len(got)))(*got)
        self.lib.lane_watch(self.h, arr, len(got), 1 if macs is None else 0)

    @_live(list)
    def take_events(self) -> list[tuple[int, int, int]]:
        buf = (ctypes.c_uint64 * (3 * 256))()
        out = []
        while True:
            n = self.lib.lane_take_events(self.h, buf, 256)
            out += [(buf[3 * i], buf[3 * i + 1], buf[3 * i + 2]) for i in range(n)]
            if n < 256:
                return out

    @_live("")
    def error(self) -> str:
        buf = ctypes.create_string_buffer(8192)
        self.lib.lane_error(self.h, buf, len(buf))
        return buf.value.decode(errors="replace")

    # -- tests and benchmarks: one pass over given frames -----------------------------------------------------
    @_live(list)
    def serve(self, frames: list[bytes], now_ms: int) -> list[bytes | None]:
        """Serve ``frames`` as one pass at ``now_ms`` (no socket, no queue, no fsync): each one's reply frame,
        or None for one the lane leaves to the loop.  LaneError if the store failed."""
        return self._serve(self.lib.lane_serve, frames, now_ms, False)

    @_live(list)
    def serve_forwarded(self, frames: list[bytes], now_ms: int) -> list[bytes | None]:
        """(the loop's thread) Serve requests other shards forwarded (vfab REQUEST frames, ``frames.wrap``), in
        order until the first the lane leaves to the loop (None from there on), ACKs after an fdatasync (C:
        ``lane_serve_forwarded`` says why frames it handed the loop need not wait).  LaneError if the store or
        the disk failed: then no reply may leave."""
        return self._serve(self.lib.lane_serve_forwarded, frames, now_ms, True)

    def _serve(self, entry, frames: list[bytes], now_ms: int, in_order: bool) -> list[bytes | None]:
        burst, rmax = self.lib.lane_burst(), self.lib.lane_reply_max()
        out: list[bytes | None] = []
        for i in range(0, len(frames), burst):
            part = frames[i:i + burst]
            lens = (ctypes.c_uint32 * len(part))(*[len(f) for f in part])
            replies = ctypes.create_string_buffer(rmax * len(part))
            rlens = (ctypes.c_uint32 * len(part))()
            verdicts = (ctypes.c_int * len(part))()
            if entry(self.h, b"".join(part), lens, len(part), now_ms, replies, rlens, verdicts) < 0:
                raise LaneError(self.error())
            raw = replies.raw
            out += [raw[j * rmax:j * rmax + rlens[j]] if verdicts[j] else None for j in range(len(part))]
            if in_order and not all(verdicts):
                return out + [None] * (len(frames) - len(out))
        return out

    # -- the threads ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sdhcp-lane", daemon=True)
        self._thread.start()
        self._events_thread = threading.Thread(target=self._events, name="sdhcp-lane-events", daemon=True)
        self._events_thread.start()

    def _run(self) -> None:
        if self.lib.lane_run(self.h) != 0:
            # the socket failed (the interface went away): the loop's port raises it, as its own socket would
            self.failed = self.error()
            self.grant([], 0.0, 0)
            log.error("native lane stopped: %s", self.failed)
            os.eventfd_write(self.slow_fd(), 1)

    def _events(self) -> None:
        fd = self.lib.lane_event_fd(self.h)
        while not self._closed:
            try:
                os.read(fd, 8)
            except OSError:
                return
            events = self.take_events()
            if events and self.on_events is not None:
                try:
                    self.on_events(events)
                except Exception:  # noqa: BLE001 - the Binder's business; never kill the thread
                    log.exception("binding events of the native lane not taken")

    def close(self) -> None:
        """Stop the threads (the socket stays open: it is the port's) and free the lane."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
        self.lib.lane_stop(self.h)
        if self._thread is not None:
            self._thread.join(5)
        if self._events_thread is not None:
            os.eventfd_write(self.lib.lane_event_fd(self.h), 1)
            self._events_thread.join(5)
        with self._gate:
            self._freeing = True          # no new call from here on ...
            while self._calls:            # ... and none still in one when it is freed
                self._gate.wait()
            self.lib.lane_close(self.h)
            self.h = None


class LanePort:
    """The shard's port as its loop sees it with a lane: frames come from the lane's queue, replies go out
    through the socket as before."""

    def __init__(self, port, lane: NativeLane):
        self.port, self.lane = port, lane
        self.taken = 0   # frames popped since the loop last finished a batch

    def __getattr__(self, name):
        return getattr(self.port, name)

    def fileno(self) -> int:
        return self.lane.slow_fd()

    def recv_raw(self, timeout: float | None = None) -> tuple[bytes, int] | None:
        got = self.lane.pop()
        if got is not None:
            self.taken += 1
        elif self.lane.failed:
            raise TransportError(f"the data port {self.port.iface} failed in the native lane: {self.lane.failed}")
        return got

    def finished(self) -> None:
        taken, self.taken = self.taken, 0
        self.lane.finish(taken)
