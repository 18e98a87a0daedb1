"""A busy switch on demand: background traffic that fills the datapath's flow cache, and its measure.

``BusySender`` streams frames from one fabric host to ``macs`` distinct
unknown unicast destinations, round robin, at ``rate`` frames/s, from a child
process of its own (the caller's threads keep the GIL).  NORMAL floods an
unknown destination and caches one exact-match datapath flow per destination
and switch, so the cache holds about ``min(macs, rate * max-idle)`` flows per
switch while it runs.  The frames carry their own EtherType (``ETHERTYPE``),
so vfab endpoints and benchmark receivers never take them for requests.

``datapath_flows()`` is the count the switch itself reports
(``ovs-appctl upcall/show``: flows cached in the userspace datapath, every
bridge together), never an assumption.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import socket
import subprocess
import time

from vfab.vid import netns

ETHERTYPE = 0x88B5          # IEEE local experimental: not vfab's, not IP
MAC_BASE = 0x0A0000000000   # locally administered unicast; low nibble of octet 0 is 0xA, never a VID (0xE)
FLOWS_RE = re.compile(r"flows\s*:\s*\(current (\d+)\)")
DUMP_RE = re.compile(r"dump duration\s*:\s*(\d+)\s*ms")


def _upcall_show() -> str:
    out = subprocess.run(["ovs-appctl", "upcall/show"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"ovs-appctl upcall/show failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def datapath_flows() -> int:
    """Flows cached in the datapath(s) right now, as ``ovs-appctl upcall/show`` counts them."""
    return sum(int(m) for m in FLOWS_RE.findall(_upcall_show()))


def datapath_state() -> tuple[int, int | None]:
    """(flows cached, ms the last revalidation pass took) as ``ovs-appctl upcall/show`` reports them.

    The pass is what a table change waits for: a cached flow follows the new tables only once the
    revalidator reaches it, so a cut-over's first packet lands somewhere within one pass after the commit.
    """
    text = _upcall_show()
    passes = [int(m) for m in DUMP_RE.findall(text)]
    return sum(int(m) for m in FLOWS_RE.findall(text)), (max(passes) if passes else None)


def _send(ns_path: str, iface: str, src: bytes, macs: int, rate: float, stop) -> None:
    with netns.netns(ns_path):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        sock.bind((iface, 0))
    tail = ETHERTYPE.to_bytes(2, "big") + b"vfab-busy".ljust(46, b".")
    frames = [(MAC_BASE + i).to_bytes(6, "big") + src + tail for i in range(macs)]
    per_ms = rate / 1000.0
    i, owed, nxt = 0, 0.0, time.monotonic()
    while not stop.is_set():
        owed += per_ms
        while owed >= 1.0:
            try:
                sock.send(frames[i])
            except OSError:
                pass  # a full queue: the next frame goes on
            i = (i + 1) % macs
            owed -= 1.0
        nxt += 0.001
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            nxt = time.monotonic()


class BusySender:
    """Background frames to ``macs`` unknown destinations from a host's port (see the module)."""

    def __init__(self, ns_path: str, iface: str, src_mac: bytes, macs: int, rate: float = 8000.0):
        if macs < 1:
            raise ValueError("BusySender needs at least one destination MAC")
        self.macs, self.rate = macs, rate
        ctx = mp.get_context("fork")
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_send, args=(ns_path, iface, src_mac, macs, rate, self._stop),
                                 name="vfab-busy", daemon=True)

    def start(self, testbed=None) -> "BusySender":
        """Start sending; with ``testbed``, the child is in its run record (stopped by the next testbed if
        this run dies without its teardown)."""
        self._proc.start()
        self._testbed = testbed
        if testbed is not None:
            testbed.track(self._proc.pid, "busy-sender")
        return self

    def fill(self, want: int, timeout: float = 60.0, every: float = 0.5) -> int:
        """Wait until the datapath caches at least ``want`` flows (or the count stops growing); the count."""
        deadline = time.monotonic() + timeout
        best, still = 0, 0
        while time.monotonic() < deadline:
            n = datapath_flows()
            if n >= want:
                return n
            still = still + 1 if n <= best else 0
            best = max(best, n)
            if still >= 6 and time.monotonic() > deadline - timeout + self.macs / self.rate + 2:
                return n  # it stopped growing (max-idle or the flow limit caps it)
            time.sleep(every)
        return datapath_flows()

    def stop(self) -> None:
        self._stop.set()
        self._proc.join(3)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(3)
        if getattr(self, "_testbed", None) is not None:
            self._testbed.untrack(self._proc.pid)
            self._testbed = None

    def __enter__(self) -> "BusySender":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
