"""Open sockets inside another network namespace while the process stays in its own.

A service in a testbed host needs its raw socket on the host's data interface
(inside the host's namespace) but talks to etcd over the control network
(loopback of the root namespace).  A socket keeps the namespace it was created
in, so ``with netns(path): sock = socket.socket(...)`` is all it takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

from vfab.vid.errors import TransportError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise TransportError(f"cannot enter network namespace {what}: {os.strerror(err)} "
                             "(needs root, and the namespace must exist)")


@contextlib.contextmanager
def netns(path: str | None) -> Iterator[None]:
    """Run the block in the network namespace at ``path`` (e.g. /proc/PID/ns/net); None = stay."""
    if not path:
        yield
        return
    try:
        target = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise TransportError(f"network namespace {path!r} cannot be opened: {exc.strerror}") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(target, path)
        try:
            yield
        finally:
            _setns(home, "of this process")
    finally:
        os.close(target)
        os.close(home)
