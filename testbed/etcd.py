"""A private single-member etcd on loopback, for tests and for ``vfab up``.

The member is a child process owned by this object: it is started with a
fresh data dir and explicit ports, and stopped by its own PID (never by
name, so another etcd on the machine is never touched)::

    etcd = LocalEtcd(tmpdir, free_port(), free_port())
    etcd.start(timeout=10)
    Registry(etcd.endpoint)  # "127.0.0.1:PORT"
    etcd.stop()

Starting one makes SIGTERM/SIGHUP unwind the process like SIGINT
(``procs.unwind_on_signals``), so a killed test run still stops its member.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from vfab.testbed.procs import free_port  # noqa: F401  (re-exported for tests)
from vfab.testbed.procs import unwind_on_signals
from vfab.vid.errors import RegistryError

log = logging.getLogger("vfab.testbed.etcd")
HOST = "127.0.0.1"


class LocalEtcd:
    """One etcd member listening on 127.0.0.1 only.

    ``heartbeat_ms``/``election_ms`` default low so that leases can be as short
    as 1 s (etcd's minimum TTL is 1.5 election ticks' worth of heartbeats).

    ``history`` is how long etcd keeps old revisions (``--auto-compaction-mode periodic``, etcd's
    duration syntax; ``"0"`` keeps them all, etcd's own default).  Every endpoint's load report is a put
    each second, and without compaction each one stays in the database (~190 bytes per revision here):
    4 shards add ~65 MB a day, and at etcd's 2 GiB quota it raises its NOSPACE alarm and refuses every
    write, the fabric's range changes and re-registrations included.  A watch resumed from a revision
    older than ``history`` is cancelled by etcd, and ``Registry.follow`` reads its prefix again.
    """

    def __init__(self, data_dir: str | os.PathLike, client_port: int, peer_port: int, *,
                 name: str = "vfab", binary: str = "etcd", heartbeat_ms: int = 50,
                 election_ms: int = 500, history: str = "1h"):
        self.data_dir = Path(data_dir)
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.binary = binary
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.history = history
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self.on_spawn: Callable[[int], None] | None = None  # called with the PID right after the spawn

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` as ``vfab.vid.store.Registry`` takes it."""
        return f"{HOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        peer = f"http://{HOST}:{self.peer_port}"
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", self.history,
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=0.5) as resp:
                return resp.status == 200 and json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def start(self, timeout: float = 15.0) -> "LocalEtcd":
        """Start the member and wait until /health answers; RegistryError if it does not."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if shutil.which(self.binary) is None:
            raise RegistryError(f"etcd binary {self.binary!r} not found on PATH: install etcd (3.4+)")
        unwind_on_signals()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if self.on_spawn is not None:
            self.on_spawn(self.proc.pid)
        log.info("etcd %s: started pid %d on %s", self.name, self.proc.pid, self.endpoint)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RegistryError(
                    f"etcd on {self.endpoint} (peer port {self.peer_port}) exited with code {code} "
                    f"while starting: {self.log_tail()} (a port clash? pick other ports)"
                )
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RegistryError(
            f"etcd on {self.endpoint} was not healthy after {timeout:.0f} s: {self.log_tail()}"
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop our member by its PID: SIGTERM, then SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("etcd %s: pid %d ignored SIGTERM, killing it", self.name, proc.pid)
                proc.kill()
                proc.wait(timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill9(self) -> None:
        """SIGKILL our member by its PID (a crash); ``start`` brings it back on the same data and ports."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return " | ".join(text[-lines:]) or "empty log"

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
