"""The control network of emulated hosts: the root namespace's loopback ports, reachable from each host.

On real machines the fabric's processes reach etcd over the management network.  Here etcd listens on the
root namespace's loopback, which an emulated host (a network namespace) cannot see; this relay makes
``127.0.0.1:PORT`` inside each host's namespace lead to ``127.0.0.1:PORT`` of the root namespace, so the
same ``vfab node join --etcd 127.0.0.1:PORT`` works inside a host and out.  One thread relays every
connection of every host (control traffic: watches, lease renewals, a few puts).

``cut(host)`` closes a host's listeners and connections (it is off the control network: a partition);
``heal(host)`` opens them again.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading

from vfab.vid.netns import netns

log = logging.getLogger("vfab.testbed.ctlnet")
CHUNK = 65536


class ControlNet:
    def __init__(self, ports: list[int]):
        self.ports = list(ports)
        self.sel = selectors.DefaultSelector()
        self.hosts: dict[str, str] = {}                       # host -> netns path
        self.listeners: dict[str, list[socket.socket]] = {}
        self.pairs: dict[socket.socket, socket.socket] = {}
        self.owner: dict[socket.socket, str] = {}             # relayed socket -> host
        self.pending: dict[socket.socket, bytes] = {}         # unsent bytes towards a socket
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ctlnet", daemon=True)
        self.thread.start()

    # -- hosts ------------------------------------------------------------------------------
    def add(self, host: str, ns_path: str) -> None:
        """Open the listeners of ``host`` (in the namespace at ``ns_path``)."""
        socks = []
        with netns(ns_path):
            for port in self.ports:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.listen(64)
                s.setblocking(False)
                socks.append(s)
        with self.lock:
            self.hosts[host] = ns_path
            self.listeners[host] = socks
            for s in socks:
                self.sel.register(s, selectors.EVENT_READ, ("listen", host))
        self._wake()

    def cut(self, host: str) -> None:
        """Take ``host`` off the control network: its listeners and relayed connections close."""
        with self.lock:
            for s in self.listeners.pop(host, []):
                self._forget(s)
            for s in [s for s, h in self.owner.items() if h == host]:
                self._close_pair(s)
        self._wake()

    def heal(self, host: str) -> None:
        if host in self.hosts and host not in self.listeners:
            self.add(host, self.hosts[host])

    def close(self) -> None:
        self.stopped.set()
        self._wake()
        self.thread.join(5)
        with self.lock:
            for host in list(self.listeners):
                for s in self.listeners.pop(host):
                    s.close()
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
        peer = self.pairs.pop(s, None)
        self.owner.pop(s, None)
        self.pending.pop(s, None)
        self._forget(s)
        if peer is not None:
            self.pairs.pop(peer, None)
            self.owner.pop(peer, None)
            self.pending.pop(peer, None)
            self._forget(peer)

    def _accept(self, lsock: socket.socket, host: str) -> None:
        try:
            inner, _ = lsock.accept()
        except OSError:
            return
        port = lsock.getsockname()[1]
        outer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)   # made in this thread's (root) namespace
        try:
            outer.connect(("127.0.0.1", port))
        except OSError as exc:
            log.debug("ctlnet %s: 127.0.0.1:%d refused: %s", host, port, exc)
            inner.close()
            outer.close()
            return
        for s in (inner, outer):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.owner[s] = host
            self.sel.register(s, selectors.EVENT_READ, ("data", None))
        self.pairs[inner], self.pairs[outer] = outer, inner

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

    def _loop(self) -> None:
        while not self.stopped.is_set():
            events = self.sel.select(1.0)
            with self.lock:
                for key, mask in events:
                    kind, host = key.data
                    s = key.fileobj
                    if kind == "wake":
                        try:
                            s.recv(4096)
                        except OSError:
                            pass
                    elif kind == "listen":
                        self._accept(s, host)
                    elif s in self.pairs:
                        if mask & selectors.EVENT_WRITE and s in self.pending:
                            self._send(s, b"")
                        if mask & selectors.EVENT_READ and s in self.pairs:
                            self._pump(s)
