"""A shard's data port: the raw socket that receives DHCP through the dhcp4 front door, and ARP.

vid-lib's :class:`~vfab.vid.transport.RawPort` binds to EtherType 0x88B5 only;
the front door delivers IPv4/UDP frames (rewritten to the shard's MAC by the
first switch, ``rx=ovs``), and clients resolve the virtual server address with
ARP broadcasts.  :class:`DhcpPort` is the same port bound to every EtherType
behind a hand-assembled classic BPF program that lets through only

* IPv4/UDP to port 67, unfragmented, classified ``PACKET_HOST`` (sent to this
  interface's MAC: the front door's frames), and
* ARP requests (any destination: they are broadcast),

and never our own outgoing frames.  Everything else stays in the kernel.
"""

from __future__ import annotations

from vfab.vid import bpf
from vfab.vid.bpf import Insn
from vfab.vid.transport import RawPort

ETH_P_ALL = 0x0003
BPF_LD, BPF_LDX, BPF_JMP, BPF_RET = 0x00, 0x01, 0x05, 0x06
BPF_W, BPF_H, BPF_B = 0x00, 0x08, 0x10
BPF_ABS, BPF_IND, BPF_MSH = 0x20, 0x40, 0xA0
BPF_JEQ, BPF_JSET, BPF_K = 0x10, 0x40, 0x00
PACKET_HOST, PACKET_OUTGOING = 0, 4
PKTTYPE = (bpf.SKF_AD_OFF + bpf.SKF_AD_PKTTYPE) & 0xFFFFFFFF


def dhcp_filter() -> bpf.Program:
    """cBPF: IPv4/UDP/67 sent to us (PACKET_HOST, no fragment) or an ARP request; never an outgoing frame."""
    ACCEPT, DROP, ARP = 16, 17, 14

    def j(at: int, op: int, k: int, yes: int, no: int) -> Insn:
        return Insn(BPF_JMP | op | BPF_K, yes - at - 1, no - at - 1, k)

    prog = [
        Insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, PKTTYPE),            # 0: A = pkt_type
        j(1, BPF_JEQ, PACKET_OUTGOING, DROP, 2),                   # 1: our own frames: drop
        Insn(BPF_LD | BPF_H | BPF_ABS, 0, 0, 12),                  # 2: A = EtherType
        j(3, BPF_JEQ, 0x0806, ARP, 4),                             # 3: ARP?
        j(4, BPF_JEQ, 0x0800, 5, DROP),                            # 4: IPv4?
        Insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, PKTTYPE),            # 5: A = pkt_type
        j(6, BPF_JEQ, PACKET_HOST, 7, DROP),                       # 6: sent to this MAC
        Insn(BPF_LD | BPF_B | BPF_ABS, 0, 0, 23),                  # 7: A = IP protocol
        j(8, BPF_JEQ, 17, 9, DROP),                                # 8: UDP
        Insn(BPF_LD | BPF_H | BPF_ABS, 0, 0, 20),                  # 9: A = flags + fragment offset
        j(10, BPF_JSET, 0x3FFF, DROP, 11),                         # 10: MF or an offset: a fragment
        Insn(BPF_LDX | BPF_B | BPF_MSH, 0, 0, 14),                 # 11: X = IP header length
        Insn(BPF_LD | BPF_H | BPF_IND, 0, 0, 14 + 2),              # 12: A = UDP destination port
        j(13, BPF_JEQ, 67, ACCEPT, DROP),                          # 13
        Insn(BPF_LD | BPF_H | BPF_ABS, 0, 0, 20),                  # 14 (ARP): A = operation
        j(15, BPF_JEQ, 1, ACCEPT, DROP),                           # 15: a request
        Insn(BPF_RET | BPF_K, 0, 0, bpf.SNAP_LEN),                 # 16: accept
        Insn(BPF_RET | BPF_K, 0, 0, 0),                            # 17: drop
    ]
    assert len(prog) == DROP + 1
    return prog


class DhcpPort(RawPort):
    """A RawPort (rx=ovs) receiving DHCP to port 67 and ARP requests instead of vfab frames."""

    def _apply_filter(self) -> None:
        self._filter = bpf.attach(self.sock, dhcp_filter())

    def _setup(self, rcvbuf: int) -> None:
        super()._setup(rcvbuf)
        # RawPort bound the socket to 0x88B5 behind our filter; take every EtherType now (the filter decides).
        self.sock.bind((self.iface, ETH_P_ALL))
