"""Raw Ethernet transport for vfab frames: one AF_PACKET socket on one interface.

Receive backends (DESIGN.md §5), chosen per port with ``rx``:

``ovs`` (default)
    The switch rewrites the destination VID to this interface's MAC, so the
    kernel classifies our frames as PACKET_HOST; a hand-assembled socket filter
    drops everything else (frames for other hosts never reach userspace).
``bpf``
    The switch delivers frames with the VID untouched.  The socket joins the
    interface's promiscuous membership (PACKET_ADD_MEMBERSHIP/PACKET_MR_PROMISC,
    dropped automatically when the socket closes) and a libpcap-compiled filter
    keeps only frames whose destination lies in the owned blocks or is our MAC;
    :meth:`RawPort.set_blocks` re-attaches it when ownership changes.
``promisc``
    Promiscuous membership, no kernel filter: userspace checks the destination
    and counts drops in ``counters['filtered']``.

Receiving never raises for bad input: malformed frames are counted in
``counters['bad_frames']`` and skipped.  Socket-level failures raise
TransportError naming the interface and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import select
import socket
import struct
import time
from pathlib import Path
from typing import Iterable

from vfab.vid import bpf
from vfab.vid.codec import int_to_mac, mac_to_int
from vfab.vid.errors import FrameError, TransportError
from vfab.vid.frame import ETH_TYPE, Frame, parse
from vfab.vid.netns import netns as in_netns

log = logging.getLogger("vfab.transport")

RX_MODES = ("ovs", "bpf", "promisc")
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_OUTGOING = 4
SO_RCVBUFFORCE = 33
SIOCGIFFLAGS = 0x8913
SIOCGIFHWADDR = 0x8927
SIOCGIFINDEX = 0x8933
IFF_UP = 0x1
IFNAMSIZ = 16
RECV_SIZE = 65536
DEFAULT_RCVBUF = 4 << 20
FATAL_ERRNOS = {errno.ENETDOWN: "the interface is down: bring it up with 'ip link set {iface} up'",
                errno.ENXIO: "the interface disappeared: the port must be reopened",
                errno.ENODEV: "the interface disappeared: the port must be reopened"}


def _ifreq(iface: str) -> bytes:
    return struct.pack("16s16x", iface.encode())


def check_iface_name(iface: str) -> str:
    if not isinstance(iface, str) or not iface or "/" in iface or len(iface.encode()) >= IFNAMSIZ:
        raise TransportError(
            f"interface name {iface!r} is invalid: it must be 1-{IFNAMSIZ - 1} bytes without '/' "
            "(see 'ip link')"
        )
    return iface


def sysfs_mac(iface: str) -> bytes | None:
    """The MAC in /sys/class/net/IFACE/address, or None if sysfs does not show the interface."""
    try:
        text = Path(f"/sys/class/net/{iface}/address").read_text().strip()
        return mac_to_int(text).to_bytes(6, "big")
    except (OSError, ValueError):
        return None


class RawPort:
    """An AF_PACKET SOCK_RAW socket bound to ``iface`` for EtherType 0x88B5."""

    def __init__(self, iface: str, rx: str = "ovs", blocks: Iterable[bpf.Block] = (),
                 rcvbuf: int = DEFAULT_RCVBUF, netns: str | None = None):
        self.iface = check_iface_name(iface)
        if rx not in RX_MODES:
            raise TransportError(f"receive backend {rx!r} is unknown: use one of {', '.join(RX_MODES)}")
        self.rx = rx
        self.counters: dict[str, int] = {"rx": 0, "tx": 0, "bad_frames": 0, "filtered": 0, "tx_dropped": 0}
        self._blocks: list[bpf.Block] = bpf.normalize_blocks(blocks)
        self._filter: bpf.Attached | None = None
        self._closed = False
        self.netns = netns
        with in_netns(netns):
            self._open(iface, rcvbuf)
        log.info("port %s: open, mac %s, rx=%s, %d blocks", iface, self.mac_str, rx, len(self._blocks))

    def _open(self, iface: str, rcvbuf: int) -> None:
        try:
            # Protocol 0: the socket receives nothing until bind(), so no frame can slip in
            # before the filter is attached.
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        except PermissionError:
            raise TransportError(
                f"opening a raw socket on {iface} needs root or CAP_NET_RAW: run as root, or "
                "'setcap cap_net_raw,cap_net_admin+ep' the python binary"
            ) from None
        except OSError as exc:
            raise TransportError(f"cannot open a raw socket for {iface}: {exc.strerror}") from None
        try:
            self._setup(rcvbuf)
        except BaseException:
            self.sock.close()
            raise

    # -- setup ------------------------------------------------------------
    def _ioctl(self, request: int, what: str) -> bytes:
        try:
            return fcntl.ioctl(self.sock.fileno(), request, _ifreq(self.iface))
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                raise TransportError(
                    f"no such interface {self.iface} in this network namespace: check 'ip link' "
                    "(inside a Mininet host, run in that host's namespace)"
                ) from None
            raise TransportError(f"cannot read the {what} of {self.iface}: {exc.strerror}") from None

    def _setup(self, rcvbuf: int) -> None:
        self.ifindex = struct.unpack_from("i", self._ioctl(SIOCGIFINDEX, "index"), 16)[0]
        flags = struct.unpack_from("H", self._ioctl(SIOCGIFFLAGS, "flags"), 16)[0]
        if not flags & IFF_UP:
            raise TransportError(f"interface {self.iface} is down: bring it up with 'ip link set {self.iface} up'")
        self.mac = self._own_mac()
        for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)
                break
            except OSError:
                continue
        if self.rx in ("bpf", "promisc"):
            mreq = struct.pack("iHH8s", self.ifindex, PACKET_MR_PROMISC, 0, b"")
            try:
                self.sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
            except OSError as exc:
                raise TransportError(
                    f"cannot make {self.iface} promiscuous for rx={self.rx} ({exc.strerror}): "
                    "needs CAP_NET_RAW; or use rx='ovs'"
                ) from None
        self._apply_filter()
        try:
            self.sock.bind((self.iface, ETH_TYPE))
        except OSError as exc:
            raise TransportError(f"cannot bind a raw socket to {self.iface}: {exc.strerror}") from None
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)

    def _own_mac(self) -> bytes:
        raw = self._ioctl(SIOCGIFHWADDR, "MAC address")
        ioctl_mac = bytes(raw[18:24])
        mac = sysfs_mac(self.iface)
        if mac is None:
            # sysfs shows the namespace it was mounted in; after setns() it may not list iface.
            log.debug("port %s: not in /sys/class/net, MAC from SIOCGIFHWADDR", self.iface)
            return ioctl_mac
        if mac != ioctl_mac:
            log.warning("port %s: /sys/class/net says %s but the device says %s (sysfs of another "
                        "network namespace?); using the device's", self.iface, int_to_mac(int.from_bytes(mac, "big")),
                        int_to_mac(int.from_bytes(ioctl_mac, "big")))
            return ioctl_mac
        return mac

    def _apply_filter(self, blocks: list | None = None) -> None:
        if self.rx == "ovs":
            program = bpf.host_only_filter()
        elif self.rx == "bpf":
            program = bpf.vid_filter(self._blocks if blocks is None else blocks, own_mac=self.mac)
        else:
            return
        self._filter = bpf.attach(self.sock, program)  # keeps the buffer alive
        log.debug("port %s: filter of %d instructions attached", self.iface, len(program))

    # -- properties -------------------------------------------------------
    @property
    def mac_str(self) -> str:
        return int_to_mac(int.from_bytes(self.mac, "big"))

    @property
    def blocks(self) -> list[bpf.Block]:
        return list(self._blocks)

    def set_blocks(self, blocks: Iterable[bpf.Block]) -> None:
        """Replace the owned (value, mask) blocks; in rx='bpf' the kernel filter is re-attached."""
        new = bpf.normalize_blocks(blocks)
        if self.rx == "bpf" and not self._closed:
            self._apply_filter(new)
        # published once the kernel filter receives them: another thread that sees the new blocks (a test,
        # waiting to send) used to find the old filter still attached, and its frame dropped
        self._blocks = new
        log.info("port %s: now receiving %d blocks (rx=%s)", self.iface, len(self._blocks), self.rx)

    def accepts(self, dst: bytes) -> bool:
        """Whether a frame to ``dst`` is ours: our MAC, or inside an owned block."""
        if dst == self.mac:
            return True
        value = int.from_bytes(dst, "big")
        return any(value & mask == v for v, mask in self._blocks)

    def fileno(self) -> int:
        return self.sock.fileno()

    # -- I/O --------------------------------------------------------------
    def _fatal(self, exc: OSError, op: str) -> TransportError:
        hint = FATAL_ERRNOS.get(exc.errno or 0, "see the kernel log")
        return TransportError(f"{op} on {self.iface} failed ({exc.strerror}): {hint.format(iface=self.iface)}")

    def send(self, frame: bytes | Frame) -> bool:
        """Transmit one frame; False (and counters['tx_dropped']) if the queue was full."""
        data = frame.serialize() if isinstance(frame, Frame) else bytes(frame)
        try:
            self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            self.counters["tx_dropped"] += 1
            return False
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                self.counters["tx_dropped"] += 1
                return False
            if exc.errno == errno.EMSGSIZE:
                raise TransportError(
                    f"frame of {len(data)} B is too large for {self.iface}: its MTU is the limit; "
                    "send a smaller payload or raise the MTU"
                ) from None
            if exc.errno == errno.EINVAL and len(data) < 14:
                raise TransportError(f"frame of {len(data)} B is shorter than an Ethernet header (14 B)") from None
            raise self._fatal(exc, "send") from None
        self.counters["tx"] += 1
        return True

    def recv_raw(self, timeout: float | None = None) -> tuple[bytes, int] | None:
        """(bytes, pkttype) of the next frame the kernel passed us, or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                data, addr = self.sock.recvfrom(RECV_SIZE, socket.MSG_DONTWAIT)
                return data, addr[2]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise self._fatal(exc, "receive") from None
            if deadline is None:
                wait = -1
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                wait = max(1, math.ceil(left * 1000))
            self._poll.poll(wait)

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next well-formed vfab frame for us within ``timeout`` s (None = wait forever)."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            got = self.recv_raw(left)
            if got is None:
                return None
            data, pkttype = got
            if pkttype == PACKET_OUTGOING:
                continue
            if self.rx != "ovs" and not (len(data) >= 6 and self.accepts(data[:6])):
                # promisc: the only filter; bpf: frames queued before a set_blocks() narrowed it.
                self.counters["filtered"] += 1
                continue
            try:
                frame = parse(data)
            except FrameError as exc:
                self.counters["bad_frames"] += 1
                log.debug("port %s: dropped a bad frame of %d B: %s", self.iface, len(data), exc)
                continue
            except Exception as exc:  # parse promises FrameError only; never let input kill us
                self.counters["bad_frames"] += 1
                log.warning("port %s: frame parser failed on %d B (%r): dropped", self.iface, len(data), exc)
                continue
            self.counters["rx"] += 1
            return frame

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()
            log.info("port %s: closed, counters %s", self.iface, self.counters)

    def __enter__(self) -> "RawPort":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RawPort({self.iface!r}, rx={self.rx!r}, mac={self.mac_str})"


__all__ = ["RawPort", "RX_MODES", "sysfs_mac", "check_iface_name"]
