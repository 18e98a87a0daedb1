"""Relays onto the control network of emulated hosts: a loopback port here leads to an address over there.

On real machines the fabric's processes reach etcd over the management network.  In the multi-host testbed
the etcd members sit on that network's addresses inside the hosts' namespaces (``testbed.hosts``), which the
root namespace (the test, ``vfab`` run by an operator after ``vfab up --hosts N``) cannot see.  A forward
makes ``127.0.0.1:PORT`` in one namespace lead to ``ADDR:PORT`` in another::

    net = ControlNet()
    net.forward(None, 23791, ("172.16.46.1", 2379), "/var/run/netns/vfnu", tags=("member:host1",))
    net.cut("member:host1")    # its listener closes (connections to it are refused) and its connections end
    net.heal("member:host1")   # open again (once no tag of the forward is cut)

One thread relays every connection (control traffic: watches, lease renewals, a few puts).  The connection
onward is made without blocking and given up after ``CONNECT`` s, so an address that does not answer (a host
cut off) never stalls the others' traffic.  A relay turns "refused" into "accepted, then closed": the
testbed cuts a member's forwards while the member is down or cut off, so a client sees it refused, as it
would on a real network.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from vfab.vid.errors import TransportError
from vfab.vid.netns import netns

log = logging.getLogger("vfab.testbed.ctlnet")
CHUNK = 65536
CONNECT = 2.0      # s for the connection onward before the client's connection is closed


@dataclass
class Forward:
    listen_ns: str | None          # netns path of the listener (None: this process's)
    port: int                      # 127.0.0.1:port there
    target: tuple[str, int]
    target_ns: str | None          # netns path the connection onward is made in
    tags: tuple[str, ...]
    sock: socket.socket | None = None
    conns: set = field(default_factory=set)   # relayed sockets (both ends) of this forward


class ControlNet:
    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.forwards: list[Forward] = []
        self.cuts: set[str] = set()
        self.pairs: dict[socket.socket, socket.socket] = {}
        self.owner: dict[socket.socket, Forward] = {}
        self.pending: dict[socket.socket, bytes] = {}         # unsent bytes towards a socket
        self.connecting: dict[socket.socket, float] = {}      # onward sockets not connected yet -> deadline
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ctlnet", daemon=True)
        self.thread.start()

    # -- forwards ---------------------------------------------------------------------------
    def forward(self, listen_ns: str | None, port: int, target: tuple[str, int], target_ns: str | None = None,
                tags: tuple[str, ...] = ()) -> Forward:
        """Listen on 127.0.0.1:``port`` in ``listen_ns`` and relay each connection to ``target`` (reached from
        ``target_ns``); cut with any of ``tags``."""
        fwd = Forward(listen_ns, port, tuple(target), target_ns, tuple(tags))
        with self.lock:
            self.forwards.append(fwd)
        if not self.cuts & set(fwd.tags):
            self._open(fwd)
        return fwd

    def _open(self, fwd: Forward) -> None:
        with netns(fwd.listen_ns):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", fwd.port))
        s.listen(64)
        s.setblocking(False)
        with self.lock:
            fwd.sock = s
            self.sel.register(s, selectors.EVENT_READ, ("listen", fwd))
        self._wake()

    def cut(self, tag: str) -> None:
        """Close the listeners and relayed connections of every forward tagged ``tag`` until ``heal(tag)``."""
        with self.lock:
            self.cuts.add(tag)
            for fwd in self.forwards:
                if tag in fwd.tags:
                    if fwd.sock is not None:
                        self._forget(fwd.sock)
                        fwd.sock = None
                    for s in list(fwd.conns):
                        self._close_pair(s)
        self._wake()

    def heal(self, tag: str) -> None:
        with self.lock:
            self.cuts.discard(tag)
            reopen = [f for f in self.forwards if f.sock is None and not self.cuts & set(f.tags)]
        for fwd in reopen:
            self._open(fwd)

    def close(self) -> None:
        self.stopped.set()
        self._wake()
        self.thread.join(5)
        with self.lock:
            for fwd in self.forwards:
                if fwd.sock is not None:
                    fwd.sock.close()
                    fwd.sock = None
            for s in list(self.pairs):
                s.close()
            self.pairs.clear()
        self.wake_r.close()
        self.wake_w.close()
        self.sel.close()

    # -- the relay ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def _forget(self, s: socket.socket) -> None:
        try:
            self.sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    def _close_pair(self, s: socket.socket) -> None:
        for one in (s, self.pairs.get(s)):
            if one is None:
                continue
            self.pairs.pop(one, None)
            fwd = self.owner.pop(one, None)
            if fwd is not None:
                fwd.conns.discard(one)
            self.pending.pop(one, None)
            self.connecting.pop(one, None)
            self._forget(one)

    def _accept(self, lsock: socket.socket, fwd: Forward) -> None:
        try:
            inner, _ = lsock.accept()
        except OSError:
            return
        try:
            with netns(fwd.target_ns):
                outer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except TransportError as exc:   # its namespace is gone (a host torn down or killed): refuse, as it would
            log.debug("ctlnet: %s:%d unreachable: %s", *fwd.target, exc)
            inner.close()
            return
        for s in (inner, outer):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.owner[s] = fwd
            fwd.conns.add(s)
        self.pairs[inner], self.pairs[outer] = outer, inner
        code = outer.connect_ex(fwd.target)
        if code not in (0, errno.EINPROGRESS):
            log.debug("ctlnet: %s:%d refused: %s", *fwd.target, errno.errorcode.get(code, code))
            self._close_pair(inner)
            return
        self.connecting[outer] = time.monotonic() + CONNECT
        self.sel.register(outer, selectors.EVENT_WRITE, ("data", None))   # the client waits until it connects

    def _connected(self, outer: socket.socket) -> None:
        self.connecting.pop(outer, None)
        code = outer.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            log.debug("ctlnet: connection onward failed: %s", errno.errorcode.get(code, code))
            self._close_pair(outer)
            return
        self.sel.modify(outer, selectors.EVENT_READ, ("data", None))
        self.sel.register(self.pairs[outer], selectors.EVENT_READ, ("data", None))

    def _pump(self, src: socket.socket) -> None:
        dst = self.pairs.get(src)
        if dst is None:
            return
        try:
            data = src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_pair(src)
            return
        self._send(dst, data)

    def _send(self, dst: socket.socket, data: bytes) -> None:
        data = self.pending.pop(dst, b"") + data
        try:
            sent = dst.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN,):
                self._close_pair(dst)
                return
            sent = 0
        if sent < len(data):
            self.pending[dst] = data[sent:]
            self.sel.modify(dst, selectors.EVENT_READ | selectors.EVENT_WRITE, ("data", None))
        else:
            self.sel.modify(dst, selectors.EVENT_READ, ("data", None))

    def _expire(self) -> None:
        now = time.monotonic()
        for s in [s for s, deadline in self.connecting.items() if deadline < now]:
            log.debug("ctlnet: no answer from %s:%d within %.0f s", *self.owner[s].target, CONNECT)
            self._close_pair(s)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            events = self.sel.select(0.25)
            with self.lock:
                for key, mask in events:
                    kind, fwd = key.data
                    s = key.fileobj
                    if kind == "wake":
                        try:
                            s.recv(4096)
                        except OSError:
                            pass
                    elif kind == "listen":
                        if fwd.sock is s:
                            self._accept(s, fwd)
                    elif s in self.connecting:
                        self._connected(s)
                    elif s in self.pairs:
                        if mask & selectors.EVENT_WRITE and s in self.pending:
                            self._send(s, b"")
                        if mask & selectors.EVENT_READ and s in self.pairs:
                            self._pump(s)
                if self.connecting:
                    self._expire()
