"""An OpenFlow 1.4 channel to one switch over a plain socket, under the controller's ``OFConn``.

``OFConn`` (controller/ofconn.py) needs of a datapath only its ``id``, an ``xid`` counter and ``send(bytes)``,
and is handed the replies; os-ken gives it that inside the controller.  A bench driving many switches from
one process needs no os-ken app per switch: ``SockDatapath`` connects to a switch's management socket
(``RUNDIR/BRIDGE.mgmt``, where ``ovs-ofctl`` goes; a service connection may send flow-mods and bundles),
says hello in OpenFlow 1.4, and a reader thread routes each reply to ``OFConn.on_reply``: bundle-control
replies, barrier replies, errors (by the failing message's xid) and multipart replies.  Flow-stats bodies
are handed over as ``RawFlowStats`` (parsed by ``ofmsg``); group descriptions are not parsed here (the
bench's switches hold no groups: a reply that lists some fails the dump, it is not dropped silently).
Echo requests are answered.  Wire layout (``ofp_header``, then a multipart reply's type, flags, padding)::

    0       1       2               4                               8
    | version | type |    length     |              xid              |
    8               10              12                              16
    |  mp type      |  mp flags     |            pad                |   (multipart replies)
"""

from __future__ import annotations

import socket
import struct
import threading

from os_ken.ofproto import ofproto_v1_4 as ofp

from vfab.controller import ofmsg
from vfab.controller.ofconn import OFConn, RawFlowStats

MP_HEADER = struct.Struct("!HH4x")
ERROR = struct.Struct("!HH")
BUNDLE_CTRL = struct.Struct("!IH")   # bundle id, control type (OpenFlow 1.4 ofp_bundle_ctrl_msg)


class ChannelError(Exception):
    """The switch's socket refused the connection or did not speak OpenFlow 1.4."""


class SockDatapath:
    def __init__(self, path: str, dpid: int, timeout: float = 30.0):
        self.id = dpid
        self.xid = 0
        self.path = path
        self._send_lock = threading.Lock()
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
        except OSError as exc:
            raise ChannelError(f"switch {dpid:016x}: cannot connect to {path}: {exc} (is ovs-vswitchd running "
                               "with that run directory and bridge?)") from None
        self.conn = OFConn(self, timeout=timeout)
        self.sock.sendall(ofmsg.header(ofp.OFPT_HELLO, ofmsg.MIN_LEN, 0))
        version, msg_type, length, _ = ofmsg.HEADER.unpack(self._read(ofmsg.MIN_LEN))
        self._read(length - ofmsg.MIN_LEN)      # a hello's elements (OVS sends its version bitmap)
        if msg_type != ofp.OFPT_HELLO:
            raise ChannelError(f"switch {dpid:016x}: first message of type {msg_type}, not a hello")
        if version < ofp.OFP_VERSION:
            raise ChannelError(f"switch {dpid:016x} speaks OpenFlow version {version}, not 1.4 (0x05): set the "
                               "bridge's protocols to include OpenFlow14")
        self._reader = threading.Thread(target=self._loop, name=f"of-{dpid:x}", daemon=True)
        self._reader.start()

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the switch closed the connection")
            buf += chunk
        return bytes(buf)

    def send(self, data: bytes) -> bool:
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _loop(self) -> None:
        try:
            while True:
                head = self._read(ofmsg.MIN_LEN)
                _, msg_type, length, xid = ofmsg.HEADER.unpack(head)
                buf = head + self._read(length - ofmsg.MIN_LEN)
                self._dispatch(msg_type, xid, buf)
        except (OSError, EOFError, struct.error) as exc:
            self.conn.close(f"switch {self.id:016x}: channel closed ({exc})")

    def _dispatch(self, msg_type: int, xid: int, buf: bytes) -> None:
        if msg_type == ofp.OFPT_ECHO_REQUEST:
            self.send(ofmsg.header(ofp.OFPT_ECHO_REPLY, len(buf), xid) + buf[ofmsg.MIN_LEN:])
        elif msg_type == ofp.OFPT_ERROR:
            etype, code = ERROR.unpack_from(buf, ofmsg.MIN_LEN)
            self.conn.on_reply(xid, error=f"OpenFlow error type {etype} code {code}")
        elif msg_type == ofp.OFPT_BUNDLE_CONTROL:
            # Only the commit's answer ends a bundle (as in controller/app.py): the open's reply comes first,
            # and taking it for the answer reported a bundle the switch then refused as committed.
            _, ctrl = BUNDLE_CTRL.unpack_from(buf, ofmsg.MIN_LEN)
            if ctrl == ofp.OFPBCT_COMMIT_REPLY:
                self.conn.on_reply(xid)
        elif msg_type == ofp.OFPT_BARRIER_REPLY:
            self.conn.on_reply(xid)
        elif msg_type == ofp.OFPT_MULTIPART_REPLY:
            mp_type, flags = MP_HEADER.unpack_from(buf, ofmsg.MIN_LEN)
            start = ofmsg.MIN_LEN + MP_HEADER.size
            more = bool(flags & ofp.OFPMPF_REPLY_MORE)
            if mp_type == ofp.OFPMP_FLOW:
                self.conn.on_reply(xid, [RawFlowStats(buf, start, len(buf) - start)], more)
            elif mp_type == ofp.OFPMP_GROUP_DESC and len(buf) > start:
                self.conn.on_reply(xid, error="the switch holds groups: this channel does not parse them")
            else:
                self.conn.on_reply(xid, (), more)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=5)
