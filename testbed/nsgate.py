"""Processes held at a gate in their network namespaces and released together (``native/nsgate.c``).

``HeldStart(specs)`` forks one process per ``(namespace path, argv)``; each enters its namespace and a session
of its own, then waits.  ``release()`` lets them all go on to their exec at once.  Starting 245 DHCP clients
one by one from Python took ~0.63 s of a ~0.6-0.65 s lease phase on a 2-core machine (the phase measured the
starter more than the servers); held, only the exec and the client itself remain after the release, as for
245 hosts that boot together.

The handles (``procs``) answer like ``subprocess.Popen`` for what the client farm uses: ``pid``, ``poll()``,
``wait(timeout)``, ``returncode``.  The gate program is the processes' parent and reports each exit; if this
side goes away before the release, the held processes exit without running anything.
"""
from __future__ import annotations

import os
import subprocess
import threading

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
GATE = os.path.join(NATIVE_DIR, "build", "vfab-nsgate")


class GateError(RuntimeError):
    pass


class GateProc:
    """One held process, as the gate program reports it (its parent)."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]


class HeldStart:
    """Fork every ``(netns path, argv)`` of ``specs``, held; ``release()`` starts them all."""

    def __init__(self, specs: list[tuple[str, list[str]]], stderr=subprocess.DEVNULL):
        if not os.access(GATE, os.X_OK):
            raise GateError(f"{GATE} is not built: run 'make -C {NATIVE_DIR}' (make bootstrap does)")
        lines = []
        for ns, argv in specs:
            fields = [ns, *argv]
            if not argv or any(not f or "\t" in f or "\n" in f for f in fields):
                raise ValueError(f"{fields!r}: a namespace and a command, no empty field, tab or newline")
            lines.append("\t".join(fields) + "\n")
        self.proc = subprocess.Popen([GATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                     text=True, bufsize=1)
        self.procs: list[GateProc] = []
        self.released = False
        self._reader: threading.Thread | None = None   # reads the exits, from "ready" on
        try:
            self.proc.stdin.write("".join(lines) + "\n")
            self.proc.stdin.flush()
            for ln in self.proc.stdout:
                word = ln.split()
                if word == ["ready"]:
                    break
                if len(word) == 3 and word[0] == "pid":
                    self.procs.append(GateProc(int(word[2]), specs[int(word[1])][1]))
            else:
                raise GateError("vfab-nsgate ended before its processes were ready")
            if len(self.procs) != len(specs):
                raise GateError(f"vfab-nsgate held {len(self.procs)} of {len(specs)} processes (its stderr says why)")
        except BaseException:
            self.abandon()
            raise
        self._by_pid = {p.pid: p for p in self.procs}
        self._reader = threading.Thread(target=self._read_exits, name="nsgate-exits", daemon=True)
        self._reader.start()

    def _read_exits(self) -> None:
        for ln in self.proc.stdout:
            word = ln.split()
            if len(word) == 3 and word[0] == "exit" and int(word[1]) in self._by_pid:
                self._by_pid[int(word[1])]._end(int(word[2]))
        self.proc.wait()

    def release(self) -> None:
        """Every held process goes on to its exec."""
        self.released = True
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def abandon(self) -> None:
        """The held processes exit without running anything (after a release: nothing more happens)."""
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        if self.released:
            return
        if self._reader is None:
            self.proc.stdout.read()   # its exit lines, so it never blocks on a full pipe
        self.proc.wait(10)
        if self._reader is not None:
            self._reader.join(10)   # every exit read: each handle has its code
