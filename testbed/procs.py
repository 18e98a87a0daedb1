"""Process supervision: everything the testbed starts is tracked and stopped by PID, never by name.

Also how a testbed process ends: SIGTERM and SIGHUP are turned into the
exception SIGINT raises (``Interrupted`` is a ``KeyboardInterrupt``), so every
``finally``/``with`` unwinds and the testbed stops what it started, whoever
stopped the run (``timeout``, CI, an operator, a closed terminal).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable

log = logging.getLogger("vfab.procs")
UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread exactly where SIGINT would raise KeyboardInterrupt."""


_shield_depth = 0
_pending: int | None = None


def _on_signal(signum: int, frame) -> None:
    global _pending
    name = signal.Signals(signum).name
    if _shield_depth:
        _pending = _pending or signum
        log.warning("%s during teardown: finishing the teardown first", name)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(name)


def unwind_on_signals() -> bool:
    """Make SIGTERM and SIGHUP unwind this process like SIGINT does (raise in the main thread).

    Only signals still at their default action are taken over: a handler the
    program installed (``vfab up``'s daemon) or an ignored SIGHUP (``nohup``)
    is left alone.  Idempotent; False when not called from the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in UNWIND_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_signal)
    return True


@contextlib.contextmanager
def shielded():
    """Run a teardown to its end: SIGINT/SIGTERM/SIGHUP arriving meanwhile are held, then re-raised.

    A signal that arrives while an exception is already unwinding the stack is
    only logged (the unwinding is what it asked for).
    """
    global _shield_depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are handled in the main thread only: nothing to hold here
        return
    took_int = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if took_int:
        signal.signal(signal.SIGINT, _on_signal)
    _shield_depth += 1
    failed = True
    try:
        yield
        failed = False
    finally:
        _shield_depth -= 1
        if took_int:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if not _shield_depth:
            signum, _pending = _pending, None
            if signum is not None and not failed:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise Interrupted(signal.Signals(signum).name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    logpath: str
    logfile: IO | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.logpath, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


class Supervisor:
    """Starts processes (in the root namespace or inside a Mininet host) and stops them by PID."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        os.makedirs(logdir, exist_ok=True)
        self.procs: list[Proc] = []
        # Called with each Proc right after it is spawned / after it is gone (the testbed's run record).
        self.on_start: Callable[[Proc], None] | None = None
        self.on_stop: Callable[[Proc], None] | None = None

    def start(self, name: str, cmd: list[str], host=None, env: dict | None = None,
              stdout=None) -> Proc:
        logpath = os.path.join(self.logdir, f"{name}.log")
        logfile = open(logpath, "ab")
        full_env = dict(os.environ, **(env or {}))
        kwargs = dict(stdout=stdout if stdout is not None else logfile, stderr=logfile, env=full_env)
        if host is not None:
            popen = host.popen(cmd, **kwargs)
        else:
            popen = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        proc = Proc(name, popen, logpath, logfile)
        self.procs.append(proc)
        if self.on_start is not None:
            self.on_start(proc)
        log.info("%s: started pid %d (log %s)", name, popen.pid, logpath)
        return proc

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, grace: float = 5.0) -> int | None:
        if proc.alive():
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s: pid %d ignored signal %d; killing", proc.name, proc.pid, sig)
                os.kill(proc.pid, signal.SIGKILL)
                proc.popen.wait(5)
        if proc.logfile:
            proc.logfile.close()
            proc.logfile = None
        if proc in self.procs:
            self.procs.remove(proc)
            if self.on_stop is not None:
                self.on_stop(proc)
        return proc.popen.returncode

    def kill9(self, proc: Proc) -> None:
        """Crash a process (for fault tests): SIGKILL, no cleanup."""
        self.stop(proc, signal.SIGKILL)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until truthy; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
