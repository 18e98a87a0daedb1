"""Helpers on the fabric: who is a helper, what each reports, and switching them in and out of ranges.

The one place that reads and writes the helper side of the registry, used by ``vfab helpers``, the demo,
the tests, and (through :func:`apply_decision` / :func:`apply_helpers`) the balancer.

- **A helper is an endpoint of the helpee's service** (the compiler builds a range's ``select`` group
  from ``RangeRec.helpers`` looked up among that service's endpoints) that also has a
  ``HelperStatus`` record (``/vfab/v1/helpers/<service>/<name>``) under the same lease: the agent
  (``agent.py``) writes both and both vanish together when its lease is revoked or expires.
- **Switching helpers in** writes ``RangeRec.helpers`` like an operator would: one epoch-checked
  transaction per range (``Registry.assign`` keeping owner, mirrors and state), so a concurrent
  operator or balancer makes it fail with Conflict instead of being overwritten.  The switches then
  send the range's frames to a ``select`` group with one bucket per *live* helper; a helper named
  there whose endpoint is gone simply has no bucket (and with none live the owner gets the range back).
- **Bucket weights** are ``RangeRec.weights`` (helper name -> 1..65535; a helper not named weighs
  ``schema.WEIGHT_DEFAULT``): the balancer writes them ∝ each helper's spare capacity, ``vfab helpers on
  --weight NAME=W`` by hand; the compiler puts them on the select group's buckets, so a helper's share of
  the range's clients is its weight over the sum (in OVS's hash slots: 16 or more per group).
- **Holds**: ``vfab helpers on|off`` by hand also marks its range held (``schema.Holds``,
  ``/vfab/v1/holds/<service>``), and the balancer then leaves that range's helpers alone, whatever the
  load, until ``vfab helpers auto`` releases it (:func:`hold`, :func:`release`).  Without it, the balancer
  reversed an operator's choice as soon as its own windows held again: an 'off' in a burst after
  ``burst_window`` (2 s by default), an 'on' in calm after ``calm_window`` (5 s).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import Conflict, NotFound, RegistryError, VidError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema

log = logging.getLogger("vfab.helpers")

# Numbers of mc-helper's stats file worth showing per helper (the file has many more, per lcore/connection).
SHOWN = ("uptime_ms", "conns", "conns_up", "rx_dgrams", "rx_get", "rx_gets", "rx_keys", "rx_pass", "b_cmds",
         "b_keys", "b_waiters", "b_pass", "batch_S_bytes", "batch_T_ns", "close_size", "close_time", "close_full",
         "close_order", "drop_peers", "drop_noconn", "drop_busy", "tx_nombuf", "tx_drop", "tx_frames",
         "w_done", "w_abort_miss", "w_abort_drop", "connects", "disconnects", "tcp_bytes_out", "tcp_bytes_in",
         "serving", "stalls", "probes", "relay_sent", "relay_replies", "relay_unsafe", "relay_noconn",
         "refused_big", "ord_held", "ord_expired")
DROPS = ("drop_peers", "drop_noconn", "drop_busy", "tx_nombuf", "tx_drop")


class HelperError(VidError):
    """A helper request that cannot be done as asked (says what is wrong and what to do)."""


DPDK_RUN_DIR = "/var/run/dpdk"   # DPDK's runtime files of a process, one folder per --file-prefix
# Whole large requests (issue 43): DPDK's af_packet joins its sockets' fanout with the defrag flag, so the kernel
# puts a fragmented request together and hands it over as one frame; the ring's frames and the helper's rx mbufs
# must hold it.  The PMD wants a frame (less its 32 B of tpacket header) to fit an mbuf's data room less its
# 128 B of headroom (mbufs of 65,535 B: the most a 16-bit data room holds), and reads frame i at i * framesz,
# so frames must tile their blocks exactly and blocks be whole pages: 65,408 B frames (128 x 511), 32 to a
# 2,093,056 B block (4096 x 511).  Requests of up to ~65,300 B; 1,024 such frames are 64 MB of ring per queue.
LARGE_FRAME, LARGE_BLOCK, LARGE_FRAMES, LARGE_RX_BUF = 65408, 65408 * 32, 1024, 65535


def af_packet_vdev(iface: str, queues: int, large: bool = False) -> tuple[str, tuple[str, ...]]:
    """(mc-helper's --vdev, its extra options) for an af_packet port on ``iface`` with ``queues`` queue pairs.
    Small frames: 4096 of them (default 512), so a burst of clients does not overrun the kernel's rx ring;
    ``large``: frames that hold a whole request of up to 64 KB (see LARGE_FRAME)."""
    ring = (f"framesz={LARGE_FRAME},blocksz={LARGE_BLOCK},framecnt={LARGE_FRAMES}" if large else "framecnt=4096")
    vdev = f"net_af_packet0,iface={iface},{ring}" + (f",qpairs={queues}" if queues > 1 else "")
    return vdev, (("--rx-buf", str(LARGE_RX_BUF)) if large else ())


def remove_runtime(prefix: str) -> None:
    """Remove the DPDK runtime folder of ``--file-prefix`` PREFIX: what an mc-helper (or testpmd) that did not
    exit cleanly, or whose agent was killed, leaves behind."""
    shutil.rmtree(os.path.join(DPDK_RUN_DIR, prefix), ignore_errors=True)


def stats_dir() -> str:
    """Where mc-helper's stats files go: a memory file system (``/dev/shm``, else ``/run``).  The file is
    replaced (``PATH.tmp`` renamed over it) every ``--stats-ms``; on a disk file system each replacement is a
    write to the disk (ext4 writes a file renamed over another at once), and that cost, in mc-helper's own
    stats thread, came out of a CPU-capped helper's budget: 6-9 CPU-ms a second at 20 writes a second, 300
    us each (bench/helper_throughput.py, 2026-11-29)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/run"


def read_stats(path: str) -> dict[str, int]:
    """mc-helper's stats file (``name value`` per line, replaced atomically); {} if it is not there yet."""
    out: dict[str, int] = {}
    try:
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2:
                    try:
                        out[parts[0]] = int(parts[1])
                    except ValueError:
                        continue
    except FileNotFoundError:
        return {}
    return out


def remove_stats(path: str) -> None:
    """Remove a stats file and the one mc-helper writes it through (``PATH.tmp``, renamed over it): what a
    helper killed with -9 leaves behind."""
    for name in (path, f"{path}.tmp"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def read_stats_after(path: str, t_ns: int, timeout: float = 1.0) -> dict[str, int]:
    """The stats file as mc-helper wrote it after ``t_ns`` (``time.time_ns()``): the file is rewritten every
    ``--stats-ms``, so one read right after some traffic may miss its last counts.  Waits for a newer file
    up to ``timeout`` s (a helper that stopped writing: the file as it is then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.stat(path).st_mtime_ns > t_ns:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    return read_stats(path)


def not_serving(stats: dict, memcached: str = "memcached") -> str | None:
    """Why mc-helper does not serve, from its stats file (``serving 0``: a connection to memcached is not up or
    not yet proven by its probe), in words for an operator; None while it serves (or says nothing)."""
    if stats.get("serving", 1) != 0:
        return None
    why = next((k[len("down_why_"):] for k, v in stats.items() if k.startswith("down_why_") and v), "?")
    words = {"no_answers": f"no answer from {memcached} for {stats.get('down_waited_ms', 0)} ms with commands in "
                           "flight (its host acknowledged our data: memcached stopped or starved?)",
             "unacked": f"its leg to {memcached} stalled: no answer for {stats.get('down_waited_ms', 0)} ms and "
                        f"{stats.get('down_unacked_bytes', 0)} B not acknowledged (TCP back-off "
                        f"{stats.get('down_backoff', 0)}): the link or memcached's host",
             "probe": f"{memcached} did not answer the probe after connecting within the stall bound",
             "connect": f"cannot connect to {memcached}", "closed": f"{memcached} closed the connection",
             "proto": f"{memcached}'s answer did not parse (see err_* in the stats file)"}
    return (f"{stats.get('conns_down', 0)} of {stats.get('conns', 0)} connection(s) down: "
            f"{words.get(why, why)}; reconnecting")


def summary(stats: dict) -> dict:
    """The numbers shown per helper: S (bytes), T (µs), batches, keys per batch, gets, drops, histogram."""
    hist = {k[len("hist_keys_"):]: v for k, v in stats.items() if k.startswith("hist_keys_") and v}
    b_cmds = stats.get("b_cmds", 0)
    return {"S_bytes": stats.get("batch_S_bytes", 0), "T_us": round(stats.get("batch_T_ns", 0) / 1e3, 1),
            "batches": b_cmds, "keys_per_batch": round(stats.get("b_keys", 0) / b_cmds, 2) if b_cmds else None,
            "gets": stats.get("rx_get", 0) + stats.get("rx_gets", 0), "passed": stats.get("rx_pass", 0),
            "drops": sum(stats.get(k, 0) for k in DROPS), "conns_up": stats.get("conns_up", 0),
            "conns": stats.get("conns", 0), "hist": hist}


def statuses(reg: Registry, service: str) -> dict[str, schema.HelperStatus]:
    """Live helpers of ``service`` (their agents' records) by endpoint name."""
    _, items = reg.get_prefix(schema.helper_prefix(service))
    return {k.rsplit("/", 1)[1]: schema.HelperStatus.from_json(v, k) for k, (v, _) in items.items()}


def live_helpers(reg: Registry, service: str) -> list[str]:
    """Helpers of ``service`` that are up now: a status record *and* a live endpoint (same lease)."""
    reg.service(service)  # NotFound naming the known services
    eps = {e.name for e in reg.endpoints(service)}
    return sorted(n for n in statuses(reg, service) if n in eps)


@dataclass
class Change:
    rng: Range
    owner: str
    before: list
    after: list
    revision: int = 0
    weights_before: dict | None = None
    weights_after: dict | None = None


def _pieces(reg: Registry, service: str, rng: Range | None) -> list[tuple[schema.RangeRec, Range]]:
    """(range record, the part of it to change) for every range ``rng`` touches (all ranges if None)."""
    recs = [r for r, _ in reg.ranges(service)]
    if rng is None:
        return [(r, r.range) for r in recs]
    out = []
    for r in recs:
        if r.range.overlaps(rng):
            out.append((r, Range(max(r.lo, rng.lo), min(r.hi, rng.hi))))
    if not out:
        raise NotFound(f"{rng} of {service!r} is in no range of its map")
    return out


def _check_weights(weights: dict, helpers: list[str]) -> dict[str, int]:
    out = {}
    for name, w in weights.items():
        if name not in helpers:
            raise HelperError(f"a weight is given for {name!r}, which is not among the helpers switched on "
                              f"({', '.join(helpers)}): weigh only those")
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= schema.WEIGHT_MAX:
            raise HelperError(f"weight {w!r} of {name!r} is out of range: an integer 1..{schema.WEIGHT_MAX} "
                              f"(unweighted helpers weigh {schema.WEIGHT_DEFAULT})")
        out[name] = w
    return out


def set_helpers(reg: Registry, service: str, rng: Range | None, helpers: list[str] | None, *,
                add: bool = False, remove: list[str] | None = None, retries: int = 3,
                weights: dict[str, int] | None = None) -> list[Change]:
    """Set (or with ``add``, add to; with ``remove``, take out of) the helpers of ``rng`` of ``service``.

    ``rng`` None: every range of the service.  A range only partly inside ``rng`` is cut (the part outside
    keeps its helpers).  Helpers turned *on* must be live helpers of the service (HelperError otherwise);
    names being removed need not be (a dead helper is removed like a live one).  Each range is one
    epoch-checked transaction; a race with another writer is retried ``retries`` times, then Conflict.
    ``weights``: bucket weights of some of ``helpers`` (the others weigh ``schema.WEIGHT_DEFAULT``); setting
    replaces a range's weights, adding keeps those of the helpers it had, removing drops the removed ones'.
    Returns what changed (ranges already as asked are left alone: no new epoch, no flow churn).
    """
    given = _check_weights(weights or {}, list(helpers or []))
    if helpers is not None:
        if not helpers:
            raise HelperError("no helper given: name at least one (--helper NAME), or use 'off'")
        live = live_helpers(reg, service)
        dead = [h for h in helpers if h not in live]
        if dead:
            raise HelperError(
                f"{', '.join(map(repr, dead))} {'is' if len(dead) == 1 else 'are'} not a live helper of {service!r} "
                f"(live helpers: {', '.join(live) or 'none'}): start one with 'python -m "
                f"vfab.services.memcached_helper.agent helper --service {service} --name NAME ...'")
    changes: list[Change] = []
    for attempt in range(retries + 1):
        try:
            for rec, part in _pieces(reg, service, rng):
                if helpers is None and not rec.helpers:
                    continue
                if helpers is not None and not rec.owner:
                    raise HelperError(f"range {rec.range} of {service!r} has no owner: helpers stand in front of "
                                      "an owner (assign the range first: 'vfab route')")
                if remove is not None:
                    after = [h for h in rec.helpers if h not in remove]
                    wts = {h: w for h, w in rec.weights.items() if h in after}
                elif helpers is None:
                    after, wts = [], {}
                elif add:
                    after = rec.helpers + [h for h in helpers if h not in rec.helpers]
                    wts = {**rec.weights, **given}
                else:
                    after, wts = list(helpers), dict(given)
                if after == rec.helpers and wts == rec.weights:
                    continue
                rev = reg.assign(service, part, rec.owner, expect_epoch=rec.epoch, mirrors=rec.mirrors,
                                 helpers=after, state=rec.state, weights=wts)
                changes.append(Change(part, rec.owner, list(rec.helpers), after, rev, dict(rec.weights), wts))
            break
        except Conflict:
            if attempt == retries:
                raise
            time.sleep(0.05 * (attempt + 1))
    if helpers is None or remove is not None:
        rev = reg.coalesce(service)  # ranges cut by an earlier 'on RANGE' join their neighbours again
        if rev and changes:
            changes[-1].revision = rev
    return changes


# -- holds: helpers set by hand stay as set ---------------------------------------------------------------
FULL = Range(0, KEY_MAX)


def _write_holds(reg: Registry, service: str, change, retries: int = 5) -> list:
    """Read the service's holds, ``change(rows) -> (new rows, result)``, write them back compared with what was
    read (another operator's write in between: read again); the result."""
    reg.service(service)   # NotFound names the service
    key = schema.holds_key(service)
    for _ in range(retries + 1):
        cur, mod = reg.holds(service)
        rows, result = change([list(r) for r in cur.holds])
        rows.sort()
        if rows == cur.holds:
            return result
        if rows:
            ok, _ = reg.txn([reg.cmp_mod(key, mod)], {key: schema.Holds(rows).to_json()})
        else:
            ok, _ = reg.txn([reg.cmp_mod(key, mod)], {}, [key])
        if ok:
            return result
        time.sleep(0.02)
    raise Conflict(f"the helper holds of {service!r} kept changing under this write: try again")


def _cut(rows: list, rng: Range) -> list:
    """Rows less ``rng`` (a row partly inside keeps its parts outside)."""
    out = []
    for lo, hi, what, at in rows:
        out += [[p.lo, p.hi, what, at] for p in Range(lo, hi).subtract(rng)]
    return out


def hold(reg: Registry, service: str, rng: Range | None, what: str, at: float | None = None) -> None:
    """Mark ``rng`` (None: the whole key space) of ``service`` as set by hand (``what``: "on" or "off"): the
    balancer leaves its helpers alone until :func:`release`."""
    rng = rng or FULL
    stamp = time.time() if at is None else at
    schema.Holds([[rng.lo, rng.hi, what, stamp]])   # checks what and the range, before anything is written
    _write_holds(reg, service, lambda rows: (_cut(rows, rng) + [[rng.lo, rng.hi, what, stamp]], None))


def release(reg: Registry, service: str, rng: Range | None) -> list[Range]:
    """Hand ``rng`` (None: every held range) of ``service`` back to the balancer; the parts that were held.

    A record that cannot be parsed (written by something else) holds every range for the balancer; releasing
    every range deletes it, releasing part of it is refused with what to do.  etcd's own errors pass through."""
    key = schema.holds_key(service)
    got = reg.get(key)
    try:
        if got is not None:
            schema.Holds.from_json(got[0], key)
    except RegistryError as exc:
        if rng is not None:
            raise HelperError(f"{exc}: the balancer holds every range of {service!r} meanwhile; "
                              f"'vfab helpers auto {service}' (no RANGE) deletes the record") from None
        reg.delete(key)
        log.warning("%s: deleted an unreadable helper hold record (%s)", service, exc)
        return [FULL]
    rng = rng or FULL

    def change(rows: list) -> tuple[list, list[Range]]:
        freed = [Range(max(lo, rng.lo), min(hi, rng.hi)) for lo, hi, _, _ in rows if Range(lo, hi).overlaps(rng)]
        return _cut(rows, rng), freed
    return _write_holds(reg, service, change)


def apply_decision(reg: Registry, decision: dict) -> list[Change]:
    """The hook for the balancer: apply ``{"service": S, "range": [lo, hi] | "LO-HI" | None, "helpers": [...]}``.

    ``helpers`` non-empty: those helpers serve the range (replacing the ones it had); empty or missing:
    helpers off for the range.  ``range`` None/missing: every range of the service.  ``weights``: the
    helpers' bucket weights, a list in the order of ``helpers`` (the balancer's ``Decision.weights``) or a
    {name: weight} object; missing: every helper weighs ``schema.WEIGHT_DEFAULT``.
    """
    service = decision["service"]
    raw = decision.get("range")
    if raw is None:
        rng = None
    elif isinstance(raw, str):
        rng = Range.parse(raw)
    else:
        lo, hi = raw
        rng = Range(int(lo), int(hi))
    helpers = list(decision.get("helpers") or [])
    raw_w = decision.get("weights") or {}
    if isinstance(raw_w, (list, tuple)):
        if len(raw_w) != len(helpers):
            raise HelperError(f"{len(raw_w)} weights for {len(helpers)} helpers: give one weight per helper, "
                              "in the order of 'helpers'")
        raw_w = dict(zip(helpers, raw_w))
    return set_helpers(reg, service, rng, helpers if helpers else None, weights=raw_w if helpers else None)


def apply_helpers(reg: Registry, service: str, lo: int, hi: int, helpers: list[str],
                  weights: dict[str, int] | None = None) -> int:
    """``apply_decision`` with the balancer runner's signature (``Runner.apply_helpers``); the last revision."""
    changes = set_helpers(reg, service, Range(lo, hi), list(helpers) or None, weights=weights if helpers else None)
    return max((c.revision for c in changes), default=reg.state_revision())


def report(reg: Registry, service: str) -> dict:
    """Everything ``vfab helpers SERVICE`` shows, as data: ranges with their helpers, and each helper."""
    eps = {e.name: e for e in reg.endpoints(service)}
    st = statuses(reg, service)
    now = time.time()
    ranges, named = [], set()
    try:
        holds, holds_error = reg.holds(service)[0].ranges(), ""
    except RegistryError as exc:   # shown, not fatal: the balancer holds every range meanwhile
        holds, holds_error = [(FULL, "?", 0.0)], f"{exc}: 'vfab helpers auto {service}' deletes it"
    for r, _ in reg.ranges(service):
        named.update(r.helpers)
        live = [h for h in r.helpers if h in eps and h in st]
        held = [{"lo": h.lo, "hi": h.hi, "what": what, "at": at} for h, what, at in holds if h.overlaps(r.range)]
        ranges.append({"lo": r.lo, "hi": r.hi, "owner": r.owner, "epoch": r.epoch, "held": held,
                       "helpers": [{"name": h, "live": h in live, "weight": r.weight(h) if h in live else 0,
                                    "down": h not in eps and h in st and bool(st[h].down)} for h in r.helpers],
                       "path": "helpers" if live else ("owner" if r.owner else "none")})
    helpers = []
    for name in sorted(set(st) | named):
        rec = st.get(name)
        ep = eps.get(name)
        helpers.append({"name": name, "live": rec is not None and ep is not None,
                        "down": rec.down if rec is not None and ep is None else "",
                        "mac": ep.mac if ep else None, "host": ep.host if ep else None,
                        "serves": rec.serves if rec else None, "pid": rec.pid if rec else None,
                        "age_s": round(now - rec.at, 1) if rec else None,
                        "ranges": sum(1 for r in ranges if any(h["name"] == name for h in r["helpers"])),
                        **(summary(rec.stats) if rec else {})})
    return {"service": service, "ranges": ranges, "helpers": helpers, "holds_error": holds_error,
            "holds": [{"lo": h.lo, "hi": h.hi, "what": what, "at": at} for h, what, at in holds]}
