"""Process supervision: everything the testbed starts is tracked and stopped by PID, never by name."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import IO

log = logging.getLogger("vfab.procs")


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
