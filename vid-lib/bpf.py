"""Classic BPF socket filters for the vfab receive backends (DESIGN.md §5).

Two programs:

* :func:`vid_filter` -- accept vfab frames (EtherType 0x88B5) whose Ethernet
  destination matches one of a set of (value, mask) pairs over the 48-bit MAC,
  or equals our own MAC.  Compiled by the real libpcap (``pcap_compile`` on a
  dead ``DLT_EN10MB`` handle), so the code is what ``tcpdump -d`` would print.
* :func:`host_only_filter` -- accept only vfab frames the kernel classified as
  ``PACKET_HOST`` (destination = this interface's MAC); hand-assembled, needs
  no libpcap.  Used when OVS rewrites the VID to the server's MAC.

:func:`attach` installs a program on a socket with ``SO_ATTACH_FILTER``; the
kernel swaps filters atomically, so re-attaching never opens a window in which
unfiltered frames get through.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import socket
import struct
import threading
from typing import Iterable, NamedTuple

from vfab.vid.codec import MAC_MAX, int_to_mac, mac_to_int
from vfab.vid.errors import TransportError, VidError
from vfab.vid.frame import ETH_TYPE

log = logging.getLogger("vfab.bpf")

# <linux/filter.h>, <linux/bpf_common.h>
BPF_LD, BPF_JMP, BPF_RET = 0x00, 0x05, 0x06
BPF_W, BPF_H = 0x00, 0x08
BPF_ABS = 0x20
BPF_JEQ = 0x10
BPF_K = 0x00
SKF_AD_OFF = -0x1000
SKF_AD_PKTTYPE = 4
BPF_MAXINSNS = 4096
PACKET_HOST = 0
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
SNAP_LEN = 0x40000  # bytes a matching program keeps (tcpdump's default: the whole frame)

# <pcap/pcap.h>
DLT_EN10MB = 1
PCAP_NETMASK_UNKNOWN = 0xFFFFFFFF
PCAP_SONAMES = ("libpcap.so.0.8", "libpcap.so.1", "libpcap.so")


class Insn(NamedTuple):
    """One classic BPF instruction (struct sock_filter / struct bpf_insn)."""

    code: int
    jt: int
    jf: int
    k: int


Program = list[Insn]
Block = tuple[int, int]  # (value, mask) over the 48-bit destination MAC


class _BpfInsn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _BpfProgram(ctypes.Structure):
    _fields_ = [("bf_len", ctypes.c_uint), ("bf_insns", ctypes.POINTER(_BpfInsn))]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_BpfInsn))]


_pcap_lock = threading.Lock()  # older libpcaps have a non-reentrant compiler
_pcap: ctypes.CDLL | None = None


def _libpcap() -> ctypes.CDLL:
    global _pcap
    if _pcap is not None:
        return _pcap
    names = list(PCAP_SONAMES)
    found = ctypes.util.find_library("pcap")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise TransportError(
            "libpcap is not installed (none of " + ", ".join(PCAP_SONAMES) + " loads): the 'bpf' "
            "receive backend compiles its filter with it; install it with "
            "'apt-get install libpcap0.8', or use rx='ovs' or rx='promisc', which need no libpcap"
        )
    lib.pcap_open_dead.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.pcap_open_dead.restype = ctypes.c_void_p
    lib.pcap_compile.argtypes = [ctypes.c_void_p, ctypes.POINTER(_BpfProgram), ctypes.c_char_p,
                                 ctypes.c_int, ctypes.c_uint32]
    lib.pcap_compile.restype = ctypes.c_int
    lib.pcap_geterr.argtypes = [ctypes.c_void_p]
    lib.pcap_geterr.restype = ctypes.c_char_p
    lib.pcap_freecode.argtypes = [ctypes.POINTER(_BpfProgram)]
    lib.pcap_freecode.restype = None
    lib.pcap_close.argtypes = [ctypes.c_void_p]
    lib.pcap_close.restype = None
    _pcap = lib
    return lib


def compile_expression(expr: str, optimize: bool = True) -> Program:
    """Compile a pcap filter expression for Ethernet with libpcap; TransportError on failure."""
    lib = _libpcap()
    with _pcap_lock:
        handle = lib.pcap_open_dead(DLT_EN10MB, 65535)
        if not handle:
            raise TransportError("pcap_open_dead(DLT_EN10MB) failed: libpcap is out of memory or broken")
        try:
            prog = _BpfProgram()
            rc = lib.pcap_compile(handle, ctypes.byref(prog), expr.encode(), int(optimize),
                                  PCAP_NETMASK_UNKNOWN)
            if rc != 0:
                err = (lib.pcap_geterr(handle) or b"?").decode(errors="replace")
                raise TransportError(f"libpcap rejected the filter {expr[:200]!r}: {err}")
            try:
                out = [Insn(i.code, i.jt, i.jf, i.k) for i in prog.bf_insns[: prog.bf_len]]
            finally:
                lib.pcap_freecode(ctypes.byref(prog))
        finally:
            lib.pcap_close(handle)
    return out


def normalize_blocks(blocks: Iterable[Block]) -> list[Block]:
    """Check (value, mask) pairs, canonicalise value &= mask, drop duplicates and contained blocks."""
    out: list[Block] = []
    for item in blocks:
        try:
            value, mask = item
        except (TypeError, ValueError):
            raise VidError(f"block {item!r} is malformed: give (value, mask) over the 48-bit MAC") from None
        for name, v in (("value", value), ("mask", mask)):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAC_MAX:
                raise VidError(f"block {name} {v!r} is out of range: it must be an integer in 0..{MAC_MAX:#x}")
        out.append((value & mask, mask))
    out = sorted(set(out), key=lambda b: (bin(b[1]).count("1"), b))  # widest blocks first
    kept: list[Block] = []
    for value, mask in out:
        # (value, mask) lies inside (v2, m2) iff m2's bits are a subset of mask's and they agree on them.
        if not any(mask & m2 == m2 and value & m2 == v2 for v2, m2 in kept):
            kept.append((value, mask))
    return sorted(kept)


def _clause(value: int, mask: int) -> str:
    hi_v, hi_m = value >> 16, mask >> 16
    lo_v, lo_m = value & 0xFFFF, mask & 0xFFFF
    parts = []
    if hi_m == 0xFFFFFFFF:
        parts.append(f"ether[0:4] = 0x{hi_v:08x}")
    elif hi_m:
        parts.append(f"ether[0:4] & 0x{hi_m:08x} = 0x{hi_v:08x}")
    if lo_m == 0xFFFF:
        parts.append(f"ether[4:2] = 0x{lo_v:04x}")
    elif lo_m:
        parts.append(f"ether[4:2] & 0x{lo_m:04x} = 0x{lo_v:04x}")
    return "(" + " and ".join(parts) + ")" if parts else ""


def vid_expression(blocks: Iterable[Block], own_mac: int | str | bytes | None = None) -> str | None:
    """The pcap expression behind :func:`vid_filter`; None when nothing can match."""
    norm = normalize_blocks(blocks)
    clauses = [_clause(v, m) for v, m in norm]
    if "" in clauses:  # a zero mask: every vfab frame matches
        return f"ether proto 0x{ETH_TYPE:04x}"
    if own_mac is not None:
        clauses.append(f"(ether dst {int_to_mac(mac_to_int(own_mac))})")
    if not clauses:
        return None
    return f"ether proto 0x{ETH_TYPE:04x} and (" + " or ".join(clauses) + ")"


def reject_all() -> Program:
    return [Insn(BPF_RET | BPF_K, 0, 0, 0)]


def vid_filter(blocks: Iterable[Block], own_mac: int | str | bytes | None = None) -> Program:
    """cBPF accepting 0x88B5 frames whose dst matches any (value, mask) block or equals own_mac.

    Compiled with libpcap; raises TransportError if libpcap is missing or the program
    exceeds the kernel's BPF_MAXINSNS.
    """
    expr = vid_expression(blocks, own_mac)
    if expr is None:
        return reject_all()
    prog = compile_expression(expr)
    if len(prog) > BPF_MAXINSNS:
        raise TransportError(
            f"the receive filter needs {len(prog)} BPF instructions, the kernel limit is "
            f"{BPF_MAXINSNS}: the owned ranges split into too many blocks; merge adjacent ranges "
            "or use rx='ovs' (the switch filters)"
        )
    log.debug("vid filter: %d blocks -> %d instructions", expr.count(" or ") + 1, len(prog))
    return prog


def host_only_filter() -> Program:
    """cBPF accepting only PACKET_HOST frames of EtherType 0x88B5 (hand-assembled)."""
    accept, drop = 4, 5  # instruction indexes below; jumps are relative to the next one
    return [
        # 0: A = skb->pkt_type (ancillary load)
        Insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, (SKF_AD_OFF + SKF_AD_PKTTYPE) & 0xFFFFFFFF),
        # 1: if A == PACKET_HOST goto 2 else drop
        Insn(BPF_JMP | BPF_JEQ | BPF_K, 0, drop - 2, PACKET_HOST),
        # 2: A = ether type; if A == 0x88B5 accept else drop
        Insn(BPF_LD | BPF_H | BPF_ABS, 0, 0, 12),
        Insn(BPF_JMP | BPF_JEQ | BPF_K, accept - 4, drop - 4, ETH_TYPE),
        Insn(BPF_RET | BPF_K, 0, 0, SNAP_LEN),  # accept
        Insn(BPF_RET | BPF_K, 0, 0, 0),  # drop
    ]


def to_bytes(program: Program) -> bytes:
    """The program as an array of struct sock_filter (native byte order)."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def disassemble(program: Program) -> str:
    """``tcpdump -dd`` style listing, one instruction per line (for logs and error reports)."""
    return "\n".join(f"{{ 0x{i.code:02x}, {i.jt}, {i.jf}, 0x{i.k:08x} }}," for i in program)


class Attached:
    """Keeps the ctypes buffers of an attached program alive for as long as the caller holds it."""

    def __init__(self, program: Program):
        if not program:
            raise TransportError("an empty BPF program cannot be attached: give at least a return instruction")
        if len(program) > BPF_MAXINSNS:
            raise TransportError(
                f"BPF program of {len(program)} instructions exceeds the kernel limit {BPF_MAXINSNS}"
            )
        self.program = list(program)
        self.insns = (_BpfInsn * len(program))(*(_BpfInsn(*i) for i in program))
        self.fprog = _SockFprog(len(program), ctypes.cast(self.insns, ctypes.POINTER(_BpfInsn)))

    def __len__(self) -> int:
        return len(self.program)


def attach(sock: socket.socket, program: Program) -> Attached:
    """Install ``program`` on ``sock`` (SO_ATTACH_FILTER; replaces any previous filter atomically)."""
    handle = Attached(program)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(handle.fprog))
    except OSError as exc:
        raise TransportError(
            f"SO_ATTACH_FILTER of a {len(program)}-instruction program failed ({exc.strerror}): "
            "the kernel rejected it; check it with bpf.disassemble() or use rx='promisc'"
        ) from None
    return handle


def detach(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    except OSError:
        pass  # no filter attached
